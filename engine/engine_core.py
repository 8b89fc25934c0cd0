"""The engine step: schedule -> run the model -> sample -> detokenize -> report, plus its thread.

`EngineCore` is single-threaded plain logic; `EngineLoop` runs it on a background thread so that
many callers (`generate`, concurrent `generate_async`, the HTTP server) share every batch. Callers
talk to the loop only through a queue (add / abort) and receive `RequestUpdate`s on their
`RequestOutput`.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from .detokenizer import decode_new_text, find_stop, hold_back_len, init_offsets
from .kv_cache_manager import KVCacheManager
from .model_runner import ScheduledSeq
from .outputs import Logprob, RequestAborted, RequestError, RequestUpdate, SequenceDelta
from .beam_search import BeamSearch
from .sampler import Sampler, SamplingRow
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Request, Sequence
from .stats import FinishedRequestStats, IterationStats, KvCacheStats

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler, the KV-cache manager and the executor (which runs the model).

    Args:
        executor: has ``execute(list[ScheduledSeq]) -> (logits [R, V] float32, row positions)``,
            ``num_blocks`` and ``block_size``; a `ModelRunner` or a multi-process executor.
        tokenizer: a Hugging Face tokenizer, or None (then no text is produced).
        eos_token_ids: ids that end a sequence unless ``ignore_eos``.
    """

    def __init__(self, executor, tokenizer, eos_token_ids: list[int], max_num_tokens: int,
                 max_batch_size: int, max_seq_len: int, enable_block_reuse: bool) -> None:
        self.executor = executor
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_seq_len = max_seq_len
        self.kv = KVCacheManager(executor.num_blocks, executor.block_size, enable_block_reuse)
        self.scheduler = Scheduler(self.kv, max_num_tokens, max_batch_size)
        self.sampler = Sampler()
        self.beam_search = BeamSearch(self)  # issue 7: use_beam_search requests
        self._context_logits: dict[int, list[torch.Tensor]] = {}  # issue 7: return_context_logits
        self.requests: dict[int, Request] = {}
        self.iteration = 0
        self._pending_finished: list[FinishedRequestStats] = []
        # Updates wait here until the step's stats are reported, so that a caller woken by its
        # result already sees the stats of the step that produced it.
        self._outbox: list[tuple] = []

    def flush_outputs(self) -> None:
        outbox, self._outbox = self._outbox, []
        for output, update in outbox:
            output._push(update)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        for seq in req.seqs:
            init_offsets(seq)
            self.scheduler.add(seq)

    def abort_request(self, request_id: int) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        req.aborted = True
        # With best_of or beams, sequences are candidates, not choices: no choice has been sent yet.
        whole = req.params.num_candidates > req.params.n or req.params.use_beam_search
        open_seqs = [s for s in req.seqs if not s.is_finished]
        for seq in open_seqs:
            self.scheduler.finish(seq)
            if seq.params.stop:  # text held back as a possible stop string is never sent
                seq.text = seq.text[:max(len(seq.text) - hold_back_len(seq.text, seq.params.stop), seq.sent_text_len)]
            seq.finish_reason = "abort"
        if whole:
            deltas = [SequenceDelta(i, [], "", finish_reason="abort") for i in range(req.params.n)]
        else:  # what each open choice generated and has not sent yet (all of it, if not streaming)
            deltas = [self._delta(seq) for seq in open_seqs]
        self._finish_request(req, deltas, error=RequestAborted(f"request {request_id} was aborted"))

    def fail_all(self, error: BaseException) -> None:
        """Fail every request in flight (after an engine error) and free their blocks."""
        for req in list(self.requests.values()):
            for seq in req.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq)
                    seq.finish_reason = "abort"
            self._finish_request(req, [], error=RequestError(f"engine error: {error!r}"))

    def _finish_request(self, req: Request, deltas: list[SequenceDelta], error=None) -> None:
        self.requests.pop(req.request_id, None)
        now = time.monotonic()
        m = req.output.metrics
        reasons = {s.finish_reason for s in req.seqs}
        self._pending_finished.append(FinishedRequestStats(
            request_id=req.request_id,
            finish_reason="abort" if "abort" in reasons else ("stop" if "stop" in reasons else "length"),
            num_prompt_tokens=req.num_prompt_tokens,
            num_generation_tokens=sum(s.num_output_tokens for s in req.seqs),
            max_tokens=req.params.max_tokens, n=req.params.n, arrival_time=m.arrival_time,
            first_scheduled_time=m.first_scheduled_time, first_token_time=m.first_token_time,
            finished_time=now))
        ctx = self._context_logits.pop(req.request_id, None)  # issue 7: return_context_logits
        self._outbox.append((req.output, RequestUpdate(deltas=deltas, finished=True, error=error,
                                                       prompt_logprobs=_copy(req.prompt_logprobs_acc),
                                                       context_logits=torch.cat(ctx) if ctx else None)))

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> Optional[IterationStats]:
        t0 = time.monotonic()
        sched = self.scheduler.schedule()
        if not sched:
            if self.scheduler.waiting and not self.scheduler.running:
                # Nothing can ever run: the head of the queue does not fit an empty pool.
                seq = self.scheduler.waiting[0]
                req = seq.request
                for s in req.seqs:
                    self.scheduler.finish(s)
                    s.finish_reason = "abort"
                self._finish_request(req, [], error=RequestError(
                    f"request {req.request_id} needs more KV-cache blocks than the pool has"))
            return self._stats(t0, sched, 0, 0, [], [])
        plan: list[ScheduledSeq] = []
        num_context = sum(1 for seq, _ in sched.scheduled if seq.num_computed_tokens < seq.num_prompt_tokens)
        for seq, n in sched.scheduled:
            start = seq.num_computed_tokens
            want_prompt_lp = ((seq.params.prompt_logprobs is not None or seq.params.return_context_logits)
                              and seq.index == 0 and start < seq.num_prompt_tokens)
            # The block table is passed, not copied: the executor is done with it before it changes.
            plan.append(ScheduledSeq(seq.seq_id, seq.token_ids[start:start + n], start, seq.block_table,
                                     sample=start + n == seq.num_tokens, all_logits=want_prompt_lp))
            m = seq.request.output.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = t0
        logits, _ = self.executor.execute(plan)
        now = time.monotonic()
        rows: list[SamplingRow] = []
        sample_seqs: list[Sequence] = []
        sample_rows: list[int] = []
        row = 0
        num_prompt_tokens = 0
        for (seq, n), p in zip(sched.scheduled, plan):
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                num_prompt_tokens += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
            if p.all_logits:
                if seq.params.prompt_logprobs is not None:
                    self._prompt_logprobs(seq, p.start_pos, logits[row:row + n])
                if seq.params.return_context_logits:  # issue 7
                    self._keep_context_logits(seq, p.start_pos, logits[row:row + n])
                row += n
                last = row - 1
            elif p.sample:
                last = row
                row += 1
            seq.num_computed_tokens += n
            self.kv.cache_full_blocks(seq)
            if p.sample:
                rows.append(self._sampling_row(seq))
                sample_seqs.append(seq)
                sample_rows.append(last)
        ttft, itl = [], []
        updates: dict[int, list[SequenceDelta]] = {}
        if any(s.params.use_beam_search for s in sample_seqs):  # issue 7: beams choose their own tokens
            sample_seqs, rows, sample_rows = self.beam_search.step(sample_seqs, rows, sample_rows, logits)
        if sample_seqs:
            sel = logits[torch.tensor(sample_rows, device=logits.device)] if row != len(sample_rows) else logits
            out = self.sampler(sel, rows)
            for i, seq in enumerate(sample_seqs):
                req = seq.request
                if req.output.metrics.first_token_time is None:
                    req.output.metrics.first_token_time = now
                    ttft.append(now - req.output.metrics.arrival_time)
                elif seq.last_token_time is not None:
                    itl.append(now - seq.last_token_time)
                seq.last_token_time = now
                keep_logits = seq.params.return_generation_logits
                delta = self._append_token(seq, out.token_ids[i], out.logprobs[i], out.top_logprobs[i],
                                           sel[i].cpu() if keep_logits else None)
                if delta is not None:
                    updates.setdefault(req.request_id, []).append(delta)
        num_generated = len(sample_seqs)
        self._emit(updates, sample_seqs)
        return self._stats(t0, sched, num_prompt_tokens, num_generated, ttft, itl, num_context)

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        """The sequence's sampler inputs: built once from its parameters, then only what changes
        per step (the output position, the min_tokens bans, the history for penalties) is updated."""
        p = seq.params
        row = seq.sampling_row
        out_len = seq.num_output_tokens
        if row is None:
            want_lp = p.logprobs
            if want_lp is None and p.num_candidates > p.n:
                want_lp = 0  # best_of needs each token's log-probability
            row = seq.sampling_row = SamplingRow(
                temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=seq.seed,
                logprobs=want_lp, repetition_penalty=p.repetition_penalty,
                frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
                prompt_token_ids=seq.request.prompt_token_ids if p.repetition_penalty != 1.0 else None,
                logit_bias=p.logit_bias, allowed_token_ids=p.allowed_token_ids,
                banned_token_ids=list(p.bad_token_ids), bad_word_seqs=p._bad_words_ids)
        row.step = out_len
        if p.min_tokens and out_len <= p.min_tokens:
            row.banned_token_ids = list(p.bad_token_ids) + (
                list(self._end_ids(p)) + list(p.stop_token_ids) if out_len < p.min_tokens else [])
        if p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0 or p._bad_words_ids:
            row.output_token_ids = seq.output_token_ids
        return row

    def _keep_context_logits(self, seq: Sequence, start: int, logits: torch.Tensor) -> None:
        """Keep the raw logits of prompt positions not kept yet (a recomputed prompt repeats them)."""
        kept = self._context_logits.setdefault(seq.request.request_id, [])
        have = sum(t.shape[0] for t in kept)
        stop = min(start + logits.shape[0], seq.num_prompt_tokens)
        if start > have:  # positions before `start` came from the prefix cache: no logits for them
            logger.warning("request %d: context logits miss prompt positions %d..%d (prefix cache hit)",
                           seq.request.request_id, have, start - 1)
        elif stop > have:
            kept.append(logits[have - start:stop - start].float().cpu())

    def _end_ids(self, p) -> set[int]:
        """End-of-sequence ids of a request: TensorRT-LLM's ``end_id`` when given, else the model's."""
        return {p.end_id} if p.end_id is not None else self.eos_token_ids

    def _prompt_logprobs(self, seq: Sequence, start: int, logits: torch.Tensor) -> None:
        req = seq.request
        k = seq.params.prompt_logprobs
        lps = torch.log_softmax(logits.float(), dim=-1)
        if req.prompt_logprobs_acc is None:
            req.prompt_logprobs_acc = [None]
        acc = req.prompt_logprobs_acc
        top_vals, top_ids = lps.topk(k, dim=-1) if k > 0 else (lps[:, :0], lps[:, :0].long())
        for j in range(lps.shape[0]):
            pos = start + j + 1
            if pos >= req.num_prompt_tokens:
                break
            if pos < len(acc):  # recomputed after a preemption: already collected
                continue
            tok = req.prompt_token_ids[pos]
            context = req.prompt_token_ids[max(0, pos - 4):pos]
            entry = {int(t): Logprob(float(v), r + 1, self._piece(int(t), context))
                     for r, (t, v) in enumerate(zip(top_ids[j].tolist(), top_vals[j].tolist()))}
            chosen = float(lps[j, tok])
            entry.setdefault(tok, Logprob(chosen, int((lps[j] > chosen).sum()) + 1, self._piece(tok, context)))
            acc.append(entry)

    def _append_token(self, seq: Sequence, token: int, logprob, top, logits_row) -> Optional[SequenceDelta]:
        p = seq.params
        seq.token_ids.append(token)
        if logprob is not None:
            seq.cumulative_logprob += logprob
        if top is not None and p.logprobs is not None:
            ids, vals, rank = top
            context = seq.token_ids[-5:-1]
            entry = {t: Logprob(v, r + 1, self._piece(t, context)) for r, (t, v) in enumerate(zip(ids, vals))}
            entry.setdefault(token, Logprob(logprob, rank, self._piece(token, context)))
            seq.pending_logprobs.append(entry)
        if logits_row is not None:
            seq.pending_logits.append(logits_row)
        out_len = seq.num_output_tokens
        # The sampler bans EOS and stop tokens until min_tokens exist, so any that arrives counts.
        stopped_by_token = False
        if token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason, stopped_by_token = "stop", token, True
        elif not p.ignore_eos and token in self._end_ids(p):
            seq.finish_reason, seq.stop_reason, stopped_by_token = "stop", None, True
        if self.tokenizer is not None and p.detokenize and (not stopped_by_token or p.include_stop_str_in_output):
            new = decode_new_text(self.tokenizer, seq, p.skip_special_tokens)
            if new:
                seq.text += new
                if p.stop and out_len >= p.min_tokens and seq.finish_reason is None:
                    hit = find_stop(seq.text, len(new), p.stop)
                    if hit is not None:
                        start, s = hit
                        seq.text = seq.text[:start + len(s)] if p.include_stop_str_in_output else seq.text[:start]
                        seq.finish_reason, seq.stop_reason = "stop", s
        if seq.finish_reason is None and (out_len >= p.max_tokens or seq.num_tokens >= self.max_seq_len):
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)
        if p.num_candidates > p.n:
            return None  # best_of: the chosen n are sent whole when the request ends
        if not seq.request.output.streaming and seq.finish_reason is None:
            return None  # nobody reads intermediate chunks of a non-streaming request: one delta at the end
        return self._delta(seq)

    def _delta(self, seq: Sequence, replace_index: Optional[int] = None) -> SequenceDelta:
        p = seq.params
        end = len(seq.text)
        if seq.finish_reason is None and p.stop:
            end -= hold_back_len(seq.text, p.stop)
        end = max(end, seq.sent_text_len)
        text = seq.text[seq.sent_text_len:end]
        seq.sent_text_len = end
        toks = seq.token_ids[seq.num_prompt_tokens + seq.sent_token_len:]
        seq.sent_token_len += len(toks)
        lps, seq.pending_logprobs = seq.pending_logprobs, []
        gen_logits = None
        if seq.pending_logits:
            gen_logits, seq.pending_logits = torch.stack(seq.pending_logits), []
        return SequenceDelta(
            index=seq.index if replace_index is None else replace_index, new_token_ids=toks, new_text=text,
            new_logprobs=lps, cumulative_logprob=seq.cumulative_logprob if (p.logprobs is not None or p.num_candidates > p.n) else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, generation_logits=gen_logits,
            replace=replace_index is not None)

    def _piece(self, token: int, context: list[int]) -> Optional[str]:
        """The text ``token`` adds after ``context`` (keeps its leading space, unlike decoding it alone)."""
        if self.tokenizer is None:
            return None
        before = self.tokenizer.decode(context, skip_special_tokens=True)
        return self.tokenizer.decode(context + [token], skip_special_tokens=True)[len(before):]

    def _emit(self, updates: dict[int, list[SequenceDelta]], sampled: list[Sequence]) -> None:
        for req in {s.request for s in sampled}:
            if req.request_id not in self.requests:
                continue
            deltas = updates.get(req.request_id, [])
            if req.finished:
                if req.params.num_candidates > req.params.n:
                    best = sorted(req.seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:req.params.n]
                    deltas = [self._delta(s, replace_index=i) for i, s in enumerate(best)]
                self._finish_request(req, deltas)
            elif deltas:
                self._outbox.append((req.output, RequestUpdate(deltas=deltas, prompt_logprobs=_copy(req.prompt_logprobs_acc))))

    def idle_stats(self) -> IterationStats:
        """Gauges without a step (after aborts or an engine error), so that usage can fall to 0."""
        return self._stats(time.monotonic(), SchedulerOutput(), 0, 0, [], [])

    def _stats(self, t0, sched, num_prompt_tokens, num_generated, ttft, itl, num_context=0) -> IterationStats:
        self.iteration += 1
        kv = self.kv
        finished, self._pending_finished = self._pending_finished, []
        gpu_mem = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        return IterationStats(
            iter=self.iteration, timestamp=time.time(), iter_latency_s=time.monotonic() - t0,
            # Sequences: a request with n > 1 counts n times, as vLLM v1 fans parallel sampling out
            # into n child requests; that is also the load the autoscaler should see.
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache=KvCacheStats(
                max_num_blocks=kv.num_blocks, free_num_blocks=kv.num_free_blocks, used_num_blocks=kv.num_used_blocks,
                tokens_per_block=kv.block_size, alloc_total_blocks=kv.stats.alloc_new_blocks + kv.stats.reused_blocks,
                alloc_new_blocks=kv.stats.alloc_new_blocks, reused_blocks=kv.stats.reused_blocks,
                missed_blocks=kv.stats.missed_blocks, cache_hit_rate=kv.hit_rate()),
            num_prompt_tokens=num_prompt_tokens, num_generation_tokens=num_generated,
            num_preemptions=len(sched.preempted), prefix_cache_queries=sched.prefix_queries,
            prefix_cache_hits=sched.prefix_hits, num_scheduled_tokens=sched.num_tokens,
            num_context_requests=num_context, num_generation_requests=len(sched.scheduled) - num_context,
            gpu_mem_usage=gpu_mem, ttft=ttft, inter_token_latencies=itl, finished=finished)


def _copy(entries: Optional[list]) -> Optional[list]:
    """A snapshot for the consumer thread (the engine keeps appending to its own list)."""
    return None if entries is None else list(entries)
