"""The engine step: schedule -> run the model -> sample -> detokenize -> report, plus its thread.

`EngineCore` is single-threaded plain logic; `EngineLoop` runs it on a background thread so that
many callers (`generate`, concurrent `generate_async`, the HTTP server) share every batch. Callers
talk to the loop only through a queue (add / abort) and receive `RequestUpdate`s on their
`RequestOutput`.

Asynchronous output processing (vLLM's "async output processor"; ``Tuning.async_output``, default
1). Each sampled token's host work is split in two:

- the *fast* part (`_append_token`), which the next schedule needs: append the id, stop token ids /
  EOS / ``max_tokens`` / ``max_seq_len``, finish the sequence (free its blocks);
- the *slow* part (`_output_token`, `_finish_outputs`): logprob dicts, detokenization, stop
  strings, deltas, TTFT/ITL, `_emit` to the outbox.

Step N runs: schedule -> launch the forward pass (the executor returns device logits at once) ->
the slow part of step N-1 while the device computes -> sample (the one device->host read) -> the fast
part of step N. A sequence that the slow part of N-1 finishes by a stop string was already scheduled
in step N: its step-N token is dropped (never appended, counted or sent). The slow part runs at once
(in the same step) when nothing follows (the scheduler has no work), for requests whose sequences all
finished in the fast part (a final result never waits for another step), before an abort of its
request and before `fail_all`. With ``Tuning(async_output=False)`` both parts always run in the step
that sampled the token (the synchronous engine, for A/B runs).

Async scheduling (vLLM v1's; ``Tuning.async_scheduling``, default on with a CUDA `ModelRunner`, off
on CPU). Above, the device idles from the sampler's read of step N until step N+1's inputs are
copied (the fast part, the next schedule, the plan, the runner's input preparation: 2-3 ms at a few
hundred sequences). With async scheduling step N's sampled ids stay on the device (`_InFlight`) and
each call of `step` runs:

1. schedule step N+1 while step N's tokens are unread: each sequence sampled in step N counts one
   more token (``Sequence.inflight_row``) and is left out when that token is its last by length;
2. plan it, in-flight rows with a placeholder id and their row of step N's sampled-id tensor, and
   launch it: the runner copies those ids into its device input buffer after the inputs' copy and
   before the forward pass or graph replay (`ModelRunner.set_inflight_tokens`), so the device runs
   step N+1 right after step N's sampler;
3. read step N's tokens (`_resolve_inflight`) and run their fast part;
4. the per-row work of step N+1 (computed counts, prefix-cache blocks, sampling rows: every token
   it covers is known by now, so no placeholder is ever hashed or counted), launch its sampler,
   and run step N's slow part while the device computes; step N+1 stays in flight.

The sampler of step N+1 is launched after step N's tokens are read, so penalties, bad words,
``min_tokens`` and seeds see the whole history as in the synchronous engine, and beam requests
(chosen on the host in the per-row work) are never in flight: none of them needs a fallback. What
step N's tokens end (EOS, stop ids; stop strings in the slow part) was also computed in step N+1:
that token is dropped, exactly as the async output processor drops it. Their blocks are freed while
step N+1 may still write them; that is safe because the device runs one stream, so whatever reuses
a block runs after step N+1. A row whose device token was -1 (the sampler's exact path redraws it on
the host in ``finish``) fed a wrong input to step N+1: that row's result is dropped and the sequence
is rolled back one token (``num_computed_tokens`` not advanced), so step N+2 computes the position
again over the same KV slot. Before step N+1 is launched, ``handle.detach()`` queues the copies of
step N's results to pinned host memory with an event, so the read waits for step N only (not for
the step N+1 queued behind it), and copies the logits rows a redraw may read (a decode graph's
logits are a static buffer step N+1 overwrites); generation logits are copied to the host likewise.
No upload from pageable memory may run while a step is in flight: it would wait for the stream.

An executor with ``defers_logits`` (the tensor-parallel `MultiprocExecutor`'s asynchronous steps)
returns a step's logits before they exist: the sampler of step N is launched in the next call, right
after step N+1 is sent (`_start_inflight`: ``await_logits``, launch, ``publish_tokens``, which hands
the ids to the workers waiting for them), unless the step needs its logits on the host (prompt
logprobs, beams, generation logits: then it waits for them at once). When every live request is
`_argmax_only`, the step is an arg-max step: the output rank computes the ids and sends them
(``await_ids``), and nothing is sampled here. When every live request is `_rank_samplable` (and the
executor has ``samples_on_output_rank``), the output rank draws the ids with its own `Sampler` from
the plan's `SamplingRow` records and output positions (`_own_rows`: the ones this engine's sampler
would use, so the same ids); rows it left to the exact draw (-1 on its device) are rolled back as
here.

The step falls back to the synchronous order (read step N first, then schedule): where the schedule
would preempt (``Scheduler.schedule(preempt=False)`` says so; the read may free blocks), when the
feature is switched off, with an executor without ``supports_async_scheduling`` (the pipeline
parallel `MultiprocExecutor`), and with a sampler without ``launch`` or whose call lacks ``tokens``
or ``detach`` (`_overlap_ok`). An abort of a
request in the in-flight step, `fail_all` and shutdown read that step first, so they see the
synchronous engine's state (if an abort's read fails, everything in flight fails as after a failed
step, and the engine keeps serving; the tokens they read are counted in the next stats). A sampler
error in ``finish`` of an in-flight step fails the step (its logits may be overwritten, so rows
cannot be sampled apart; row errors come from ``launch``, which still isolates them). Stats report
each token in the step that read it.

Speculative decoding (``speculative``, a `kvpilot.spec_decode.decoder.SpeculativeDecoder`): before
the schedule it sets each decoding sequence's drafts (``Sequence.spec_token_ids``, which the
scheduler counts); such a sequence's plan entry is its last token plus the drafts with logits at
every position; after the pass its drafts are verified and its tokens appended there
(`SpeculativeDecoder.verify`), beside the other rows' sampling. Steps then run in the synchronous
order.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np
import torch

from kvpilot.core.detokenizer import decode_new_text, find_stop, hold_back_len, init_offsets
from kvpilot.core.kv_cache_manager import KVCacheManager
from kvpilot.runner.batch import ScheduledSeq
from kvpilot.outputs import Logprob, RequestAborted, RequestError, RequestUpdate, SequenceDelta
from kvpilot.core.beam_search import BeamSearch
from kvpilot.sampling.sampler import Sampler, SamplerOutput, SamplingRow
from kvpilot.sampling.sampler_inputs import Upload
from kvpilot.core.scheduler import Scheduler, SchedulerOutput
from kvpilot.core.sequence import Request, Sequence, SequenceStatus
from kvpilot.core.stats import FinishedRequestStats, IterationStats, KvCacheStats
from kvpilot.tuning import Tuning

logger = logging.getLogger(__name__)

_FINISHED = SequenceStatus.FINISHED
_PLACEHOLDER = [0]  # the input id of an in-flight row until the device writes the real one
_NO_SEQS: frozenset = frozenset()


@dataclass(slots=True)
class _InFlight:
    """A step whose sampler call is launched but not read (async scheduling).

    ``handle``: the sampler call (``tokens`` [S] int64 on the device, ``finish()``); ``seqs[i]`` owns
    row i (its ``inflight_row`` is i until the step is read); ``gen``: host copies of the rows'
    logits for ``return_generation_logits`` (None when no request asks).
    """

    handle: object
    seqs: list[Sequence]
    gen: Optional[list]
    # An executor with ``defers_logits``: (logits, their rows to sample or None for all, sampling
    # rows) while the sampler is not launched yet (``handle`` is None until `_start_inflight`).
    launch: Optional[tuple] = None
    # A step whose ids the output rank chose (``own_ids_hint``): every row `_argmax_only` (its
    # arg-max) or `_rank_samplable` (its sampler); `MultiprocExecutor.await_ids`, no logits come back.
    own: bool = False


class _Ready:
    """A sampler call already read (`_start_inflight`'s fallback, or the output rank's ids):
    ``finish()`` returns its output. ``redrawn``: rows whose device token was -1 (drawn again on the
    host; -1 in ``tokens`` too, as a sampler call's device tensor has them)."""

    def __init__(self, out: SamplerOutput, redrawn: list[int] = ()) -> None:
        self.out = out
        self.redrawn = redrawn
        tokens = out.token_ids
        if redrawn:
            tokens = list(tokens)
            for i in redrawn:
                tokens[i] = -1
        self.tokens = torch.tensor(tokens, dtype=torch.int64)

    def finish(self) -> SamplerOutput:
        return self.out


@dataclass(slots=True)
class _Sampled:
    """A token appended by the fast part whose output work (the slow part) is still to do.

    ``num_tokens`` is the sequence's length right after the append: the slow part runs before the
    sequence can get another token, so ``seq.token_ids`` still ends with ``token`` then.
    """

    seq: Sequence
    token: int
    logprob: Optional[float]
    top: Optional[tuple[list[int], list[float], int]]  # (top ids, their logprobs, chosen rank)
    stopped_by_token: bool  # a stop token id or EOS ended the sequence
    num_tokens: int


class EngineCore:
    """Owns the scheduler, the KV-cache manager and the executor (which runs the model).

    Args:
        executor: has ``execute(list[ScheduledSeq]) -> (logits [R, V] float32, row positions)``,
            ``num_blocks`` and ``block_size``; a `ModelRunner` or a multi-process executor.
        tokenizer: a Hugging Face tokenizer, or None (then no text is produced).
        eos_token_ids: ids that end a sequence unless ``ignore_eos``.
        async_output: overlap each step's output work with the next step's forward pass (see the
            module docstring); None takes ``tuning.async_output``. May be changed between steps.
        async_scheduling: plan step N+1 before reading step N's tokens (module docstring); None
            takes ``tuning.async_scheduling``, and when that is None too: on when the executor's
            ``device`` is CUDA.
            Takes effect only with an executor that has ``supports_async_scheduling``. May be
            changed between steps.
        speculative: a `kvpilot.spec_decode.decoder.SpeculativeDecoder`, or None (no speculation).
            With it, steps run in the synchronous order (no async scheduling).
        max_loras: LoRA adapters the executor holds at once (its device slots); 0 without LoRA. Each
            planned sequence then carries its request's adapter (``ScheduledSeq.lora``).
        tuning: the performance switches (`kvpilot.tuning.Tuning`; default: the defaults): the
            defaults of ``async_output`` / ``async_scheduling`` and the sampler's backend.

    ``num_overlapped_steps`` counts the steps launched while the previous step's tokens were still
    on the device.
    """

    def __init__(self, executor, tokenizer, eos_token_ids: list[int], max_num_tokens: int,
                 max_batch_size: int, max_seq_len: int, enable_block_reuse: bool,
                 async_output: Optional[bool] = None, async_scheduling: Optional[bool] = None,
                 max_loras: int = 0, speculative=None, tuning: Optional[Tuning] = None) -> None:
        self.executor = executor
        self.max_loras = max_loras
        # Speculative decoding (`kvpilot.spec_decode.decoder.SpeculativeDecoder`) or None.
        self.spec = speculative
        self.tuning = tuning = tuning or Tuning()
        self.async_output = tuning.async_output if async_output is None else async_output
        if async_scheduling is None:
            async_scheduling = tuning.async_scheduling
        if async_scheduling is None:
            dev = getattr(executor, "device", None)
            async_scheduling = dev is not None and torch.device(dev).type == "cuda"
        self.async_scheduling = async_scheduling
        # The executor returns a step's logits before they exist (a tensor-parallel executor's
        # asynchronous steps: module docstring).
        self._defers = bool(getattr(executor, "defers_logits", False))
        self.num_overlapped_steps = 0
        self._inflight: Optional[_InFlight] = None  # the step whose tokens are still on the device
        # Tokens read from the in-flight step outside `step` (an abort, `fail_all`): the next stats count them.
        self._late_generated = 0
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_seq_len = max_seq_len
        self.kv = KVCacheManager(executor.num_blocks, executor.block_size, enable_block_reuse)
        self.scheduler = Scheduler(self.kv, max_num_tokens, max_batch_size, max_loras)
        self.sampler = Sampler("auto" if tuning.triton_sampler else "torch", check=tuning.sampling_check)
        self.beam_search = BeamSearch(self)  # use_beam_search requests
        self._context_logits: dict[int, list[torch.Tensor]] = {}  # return_context_logits
        self.requests: dict[int, Request] = {}
        self.iteration = 0
        self._pending_finished: list[FinishedRequestStats] = []
        # Updates wait here until the step's stats are reported, so that a caller woken by its
        # result already sees the stats of the step that produced it.
        self._outbox: list[tuple] = []
        self._pending: list[_Sampled] = []  # tokens of the last step whose slow part is still to do
        self._ttft: list[float] = []  # observations since the last stats
        self._itl: list[float] = []
        self._beam_requests: set[int] = set()  # ids of live use_beam_search requests
        self._gen_logits_requests: set[int] = set()  # ids of live return_generation_logits requests
        self._not_argmax_only: set[int] = set()  # ids of live requests `_argmax_only` says no to
        self._not_rank_samplable: set[int] = set()  # ids of live requests `_rank_samplable` says no to
        # The executor's output rank may draw ids with its own sampler (`_own_rows`).
        self._rank_sampling = bool(getattr(executor, "samples_on_output_rank", False))
        self._cuda = torch.cuda.is_available()  # asked once: the query costs microseconds per step

    def flush_outputs(self) -> None:
        outbox, self._outbox = self._outbox, []
        for output, update in outbox:
            output._push(update)

    @property
    def has_work(self) -> bool:
        """Sequences to run, output work of the last step still to do (the next step does it), or a
        step whose tokens are still on the device."""
        return self.scheduler.has_work or bool(self._pending) or self._inflight is not None

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        p = req.params
        if p.use_beam_search:
            self._beam_requests.add(req.request_id)
        if p.return_generation_logits:
            self._gen_logits_requests.add(req.request_id)
        if not _argmax_only(p):
            self._not_argmax_only.add(req.request_id)
        if not _rank_samplable(p):
            self._not_rank_samplable.add(req.request_id)
        limit = min(req.num_prompt_tokens + p.max_tokens, self.max_seq_len)
        for seq in req.seqs:
            init_offsets(seq)
            seq.length_limit = limit
            self.scheduler.add(seq)

    def abort_request(self, request_id: int) -> None:
        inflight = self._inflight
        if inflight is not None and any(s.request.request_id == request_id for s in inflight.seqs):
            # The synchronous engine would have read that step already: so does the abort.
            try:
                self._late_generated += self._resolve_inflight()[0]
            except Exception as e:  # noqa: BLE001 - as a failed step: fail what is in flight, keep serving
                logger.exception("reading the in-flight step for the abort of request %d failed", request_id)
                self.fail_all(e)
                return
        # The request's last token first gets its output work, so that the abort sees (and returns)
        # exactly the state the synchronous engine would have; if that work finished the request,
        # the abort comes too late and does nothing.
        mine = [e for e in self._pending if e.seq.request.request_id == request_id]
        if mine:
            self._pending = [e for e in self._pending if e.seq.request.request_id != request_id]
            self._finish_outputs(mine)
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
        """Fail every request in flight (after an engine error) and free their blocks.

        The output work of the last step is done first (it needs no device; an in-flight step's
        tokens are read first, if the device still answers), so that requests that had already
        finished are delivered rather than failed.
        """
        if self._inflight is not None:
            try:
                self._late_generated += self._resolve_inflight()[0]
            except Exception:
                logger.exception("dropping the in-flight step's tokens")
        abandon = getattr(self.executor, "abandon_steps", None) if self._defers else None
        if abandon is not None:
            try:
                abandon()  # steps the failed call sent and will never read
            except Exception:
                logger.exception("releasing the executor's unread steps")
        pending = self._take_pending()
        if pending:
            try:
                self._finish_outputs(pending)
            except Exception:
                logger.exception("dropping the last step's outputs of %d sequences", len(pending))
        for req in list(self.requests.values()):
            self._fail_request(req, RequestError(f"engine error: {error!r}"))

    def _fail_request(self, req: Request, error: RequestError) -> None:
        """End one request with ``error``: its open sequences are finished ("abort") and freed."""
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        self._finish_request(req, [], error=error)

    def _finish_request(self, req: Request, deltas: list[SequenceDelta], error=None) -> None:
        self.requests.pop(req.request_id, None)
        if self.spec is not None:
            for seq in req.seqs:
                self.spec.release(seq)
        self._beam_requests.discard(req.request_id)
        self._gen_logits_requests.discard(req.request_id)
        self._not_argmax_only.discard(req.request_id)
        self._not_rank_samplable.discard(req.request_id)
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
        ctx = self._context_logits.pop(req.request_id, None)  # return_context_logits
        self._outbox.append((req.output, RequestUpdate(deltas=deltas, finished=True, error=error,
                                                       prompt_logprobs=_copy(req.prompt_logprobs_acc),
                                                       context_logits=torch.cat(ctx) if ctx else None)))

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> Optional[IterationStats]:
        t0 = time.monotonic()
        num_generated = 0
        settled = False  # in-flight tokens were read in this call (they may have freed blocks)
        rollback = _NO_SEQS
        prev = self._inflight
        if prev is not None and not self._overlap_ok():  # switched off since it was launched
            num_generated += self._resolve_inflight()[0]
            prev, settled = None, True
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)  # drafts the schedule counts
        sched = self.scheduler.schedule(preempt=prev is None)
        if sched is None:
            # A running sequence's next token does not fit: read the in-flight tokens first (they
            # may finish sequences and free blocks) and preempt, if still needed, on settled state.
            num_generated += self._resolve_inflight()[0]
            prev, settled = None, True
            sched = self.scheduler.schedule()
        if not sched:
            if prev is not None:  # everything running waits for its in-flight (last) token
                num_generated += self._resolve_inflight()[0]
                settled = True
            if self._pending:
                # Nothing to overlap with: finish the last step's outputs now. They may free blocks
                # (stop strings), so the queue gets another schedule before it can be called stuck.
                self._finish_outputs(self._take_pending())
            elif not settled and self.scheduler.waiting and not self.scheduler.running:
                # Nothing can ever run: the head of the queue does not fit an empty pool.
                seq = self.scheduler.waiting[0]
                req = seq.request
                error = self.scheduler.unfit_error(seq)  # before its sequences leave the queue
                for s in req.seqs:
                    self.scheduler.finish(s)
                    s.finish_reason = "abort"
                self._finish_request(req, [], error=error)
            return self._stats(t0, sched, 0, num_generated)
        plan: list[ScheduledSeq] = []
        num_context = num_prompt_tokens = 0
        host_logits = False  # a row needs this step's logits on the host this step (prompt logprobs)
        # Per-sequence work here and below runs for every sequence of every step (hundreds at large
        # batch): positional constructors, no properties, and decode-only checks kept minimal.
        for seq, n in sched.scheduled:
            start = seq.num_computed_tokens
            toks = seq.token_ids
            # The block table is passed, not copied: the executor is done with it before it changes
            # (and it only grows while passed: see `HostBlockTables`).
            if start < seq.num_prompt_tokens:
                num_context += 1
                num_prompt_tokens += min(n, seq.num_prompt_tokens - start)
                p = seq.params
                want_prompt_lp = (p.prompt_logprobs is not None or p.return_context_logits) and seq.index == 0
                host_logits = host_logits or want_prompt_lp
                plan.append(ScheduledSeq(seq.seq_id, toks[start:start + n], start, seq.block_table,
                                         start + n == len(toks), want_prompt_lp))
                m = seq.request.output.metrics
                if m.first_scheduled_time is None:
                    m.first_scheduled_time = t0
            elif seq.inflight_row >= 0:  # its input is last step's sampled token, still on the device
                plan.append(ScheduledSeq(seq.seq_id, _PLACEHOLDER, start, seq.block_table, True, False,
                                         seq.inflight_row))
            elif seq.spec_token_ids and (sp := self.spec.plan(seq, start, n)) is not None:
                plan.append(sp)  # its last token and drafts, logits at every position
            else:  # past its prompt, so scheduled before: first_scheduled_time is set
                plan.append(ScheduledSeq(seq.seq_id, toks[start:start + n], start, seq.block_table,
                                         start + n == len(toks)))
        if self.max_loras:
            for p, (seq, _) in zip(plan, sched.scheduled):
                p.lora = seq.request.lora
        own = defer = False
        own_rows = None  # a step the output rank samples: (seq_id, output position, record) per row
        if prev is not None and not self._defers:
            self.executor.set_inflight_tokens(prev.handle.tokens)
        elif self._defers:
            # Sample this step in the next call, after its successor is planned and sent, unless
            # its logits are needed on the host now (prompt logprobs, beams, generation logits).
            defer = (self._overlap_ok() and not host_logits and not self._beam_requests
                     and not self._gen_logits_requests)
            # Steps whose ids the output rank chooses: every live request `_argmax_only` (its
            # arg-max) or `_rank_samplable` (its sampler, from this step's records). The next step
            # reads them there at once (SYNC_SELF); the front end samples nothing and does no device
            # work (module docstring).
            hint = None
            if defer and not self._not_argmax_only:
                hint = True
            elif defer and self._rank_sampling and not self._not_rank_samplable:
                hint = own_rows = self._own_rows(sched.scheduled, plan)
            own = hint is not None
            self.executor.own_ids_hint = (hint, prev is not None and prev.handle is None and prev.own
                                          and prev.launch[1] is None)
        logits, _ = self.executor.execute(plan)
        if prev is not None:
            # The device has this step queued behind the last one: read the last one's tokens now
            # (with a deferring executor, sample them first: the workers wait for them).
            self.num_overlapped_steps += 1
            n_read, rollback = self._resolve_inflight()
            num_generated += n_read
        if self._defers and not defer:
            logits = self.executor.await_logits()
        # A sampler with ``launch`` (see `_launch`) lets the output work also cover its own kernels.
        split = getattr(self.sampler, "launch", None) is not None
        if self._pending and not split:
            # On a GPU the executor has only launched the step: the last step's output work runs
            # while the device computes. It may finish sequences scheduled in this step (stop
            # strings); their tokens of this step are dropped below.
            self._overlapped_outputs()
        rows: list[SamplingRow] = []
        sample_seqs: list[Sequence] = []
        sample_rows: list[int] = []
        row = 0
        kv = self.kv
        reuse, B = kv.enable_block_reuse, kv.block_size
        spec_items = []  # (sequence, plan entry, first logits row) of sequences verifying drafts
        for (seq, n), p in zip(sched.scheduled, plan):
            first = row
            if p.all_logits:
                row += n
            elif p.sample:
                row += 1
            if seq.status is _FINISHED:
                continue  # finished by the last step's tokens or output work: nothing of it is kept
            if rollback and seq in rollback:
                # Its input was -1 on the device (the sampler drew that token again on the host):
                # what this step computed for it is dropped, and the next step computes that
                # position again from the real token (its KV slot is simply overwritten).
                continue
            if p.all_logits and p.start_pos + n > len(seq.token_ids):  # drafts: `SpeculativeDecoder.verify`
                spec_items.append((seq, p, first))
                continue
            if p.all_logits:
                if seq.params.prompt_logprobs is not None:
                    self._prompt_logprobs(seq, p.start_pos, logits[first:row])
                if seq.params.return_context_logits:
                    self._keep_context_logits(seq, p.start_pos, logits[first:row])
            # Every token up to here is known on the host now (the in-flight ones were just read),
            # so the prefix cache never hashes a placeholder.
            computed = seq.num_computed_tokens = seq.num_computed_tokens + n
            if reuse and computed // B > seq.num_cached_blocks:  # a block became full
                kv.cache_full_blocks(seq)
            if p.sample:
                srow = seq.sampling_row
                if srow is not None and seq.sampling_row_fixed:
                    srow.step = len(seq.token_ids) - seq.num_prompt_tokens
                else:
                    srow = self._sampling_row(seq)
                if own_rows is not None and own_rows[row - 1][1] != srow.step:
                    # The output rank drew this row at the position planned before the last
                    # step's tokens were read; they must agree (`_own_rows`).
                    raise RuntimeError(f"sequence {seq.seq_id}: the output rank sampled output position "
                                       f"{own_rows[row - 1][1]}, the token is at {srow.step}")
                rows.append(srow)
                sample_seqs.append(seq)
                sample_rows.append(row - 1)
        # beams choose their own tokens (on the host, from this step's logits: never in flight)
        if self._beam_requests and any(s.params.use_beam_search for s in sample_seqs):
            sample_seqs, rows, sample_rows = self.beam_search.step(sample_seqs, rows, sample_rows, logits)
        sampled: list[_Sampled] = []
        any_done = False
        if sample_seqs and defer:
            # Launched by `_start_inflight` (next call, or a read before it); the rows are in flight now.
            for i, seq in enumerate(sample_seqs):
                seq.inflight_row = i
            self._inflight = _InFlight(None, sample_seqs, None,
                                       (logits, None if row == len(sample_rows) else sample_rows, rows), own)
        elif sample_seqs:
            sel = logits if row == len(sample_rows) else logits[_upload_rows(sample_rows, logits.device)]
            gen = None
            if self._gen_logits_requests:
                # Copied now (pinned, not waited for: the sampler's read waits): the next step may
                # overwrite a CUDA graph's logits before this step's tokens are read.
                gen = [_to_host_async(sel[i]) if s.request.params.return_generation_logits else None
                       for i, s in enumerate(sample_seqs)]
            handle, out = self._launch(sel, rows, sample_seqs)
            if self._pending:
                self._overlapped_outputs()
            if handle is not None and self._overlap_ok(handle):
                # Async scheduling: the tokens stay on the device; the next step is planned first.
                handle.detach()  # the read no longer waits for it, and the logits may be overwritten
                for i, seq in enumerate(sample_seqs):
                    seq.inflight_row = i
                self._inflight = _InFlight(handle, sample_seqs, gen)
                if self._defers:
                    self.executor.publish_tokens(handle.tokens)
            else:
                if out is None:
                    out = self._finish_sampling(handle, sel, rows, sample_seqs)
                if self._defers:
                    self.executor.publish_tokens(None)  # read already: the next plan has its ids
                sampled, any_done = self._append_sampled(sample_seqs, out, gen)
        elif self._defers:
            if defer:  # nothing left to sample (its rows ended or were rolled back, or a prefill chunk):
                # its answer is still read, so that the executor's steps stay in order
                (self.executor.await_ids if own else self.executor.await_logits)()
            self.executor.publish_tokens(None)  # nothing sampled in this step
        if self._pending:  # a split sampler with nothing to sample this step
            self._overlapped_outputs()
        if spec_items:
            num_generated += self.spec.verify(self, spec_items, logits)
        if sampled:
            self._settle(sampled, any_done)
        return self._stats(t0, sched, num_prompt_tokens, num_generated + len(sampled), num_context)

    def _settle(self, sampled: list[_Sampled], any_done: bool) -> None:
        """Queue the slow part of tokens whose fast part ran (`_pending`), or run it now where
        nothing follows, in synchronous mode, and for requests the fast part finished."""
        if not self.async_output or not self.scheduler.has_work:
            self._finish_outputs(sampled)  # nothing follows (or synchronous mode): no waiting
        elif not any_done:
            self._pending.extend(sampled)
        else:
            # A request that ended in the fast part gets its result now, not one step later.
            done = []
            for e in sampled:
                (done if e.seq.finish_reason is not None and e.seq.request.finished else self._pending).append(e)
            if done:
                self._finish_outputs(done)

    def _append_sampled(self, seqs: list[Sequence], out: SamplerOutput,
                        gen: Optional[list]) -> tuple[list[_Sampled], bool]:
        """The fast part of a step's tokens (``out`` row i belongs to ``seqs[i]``); ``gen``: host
        copies of the rows' logits for ``return_generation_logits`` (None for the others), or None.
        Returns the appended tokens and whether any finished its sequence."""
        token_ids, logprobs, tops = out.token_ids, out.logprobs, out.top_logprobs
        append = self._append_token
        sampled: list[_Sampled] = []
        any_done = False
        for i, seq in enumerate(seqs):
            if seq.status is _FINISHED:
                continue  # finished by output work that ran after it was scheduled (stop string): dropped
            e = append(seq, token_ids[i], logprobs[i], tops[i], gen[i] if gen is not None else None)
            sampled.append(e)
            if seq.finish_reason is not None:
                any_done = True
        return sampled, any_done

    # ---- async scheduling ----------------------------------------------------------------------
    def _overlap_ok(self, handle=None) -> bool:
        """Whether a step may stay in flight (its tokens unread) while the next one is planned: on
        (``async_scheduling``), an executor with ``supports_async_scheduling``, and a sampler call
        whose tokens are a device tensor (``handle.tokens``) and that can be made independent of
        later device work (``handle.detach()``, see `Sampler.launch`'s `_Pending`)."""
        return (self.async_scheduling and self.spec is None
                and getattr(self.executor, "supports_async_scheduling", False)
                and (handle is None or (getattr(handle, "tokens", None) is not None
                                        and getattr(handle, "detach", None) is not None)))

    def _resolve_inflight(self) -> tuple[int, frozenset]:
        """Read the in-flight step's tokens and run their fast part; their slow part is queued
        (`_settle`). Returns (tokens appended, sequences whose token the device did not have: -1
        rows the sampler drew again on the host, so a step launched meanwhile computed them from a
        wrong input). Raises what the sampler's ``finish`` raises (the step is then lost: its logits
        may have been overwritten, so rows cannot be sampled apart as in `_finish_sampling`)."""
        prev, self._inflight = self._inflight, None
        for seq in prev.seqs:
            seq.inflight_row = -1
        if prev.handle is None:
            self._start_inflight(prev)
        out = prev.handle.finish()
        sampled, any_done = self._append_sampled(prev.seqs, out, prev.gen)
        if sampled:
            self._settle(sampled, any_done)
        redrawn = getattr(prev.handle, "redrawn", ())
        return len(sampled), (frozenset(prev.seqs[i] for i in redrawn) if len(redrawn) else _NO_SEQS)

    def _start_inflight(self, prev: _InFlight) -> None:
        """Launch a deferred step's sampler (``prev.launch``, a deferring executor): wait for its
        logits (`await_logits`), launch, detach, and publish the sampled ids to the workers
        (`publish_tokens`), which may be waiting for them to run the next step. A sampler that
        cannot stay in flight is read here (`_Ready`)."""
        logits, sample_rows, rows = prev.launch
        prev.launch = None
        if prev.own:  # the output rank's ids (its arg-max or its sampler's): nothing to sample here
            ids, redrawn = self.executor.await_ids()
            if sample_rows is not None:
                ids = [ids[r] for r in sample_rows]
                if redrawn:
                    at = {r: i for i, r in enumerate(sample_rows)}
                    redrawn = [at[r] for r in redrawn if r in at]
            n = len(ids)
            # Redrawn rows were -1 in the output rank's ids buffer: rolled back as the front end's own
            # sampler's would be (`_resolve_inflight`).
            prev.handle = _Ready(SamplerOutput(ids, [None] * n, [None] * n), redrawn)
            self.executor.publish_tokens(prev.handle.tokens)
            return
        logits = self.executor.await_logits()
        sel = logits if sample_rows is None else logits[_upload_rows(sample_rows, logits.device)]
        handle, out = self._launch(sel, rows, prev.seqs)
        if handle is not None and self._overlap_ok(handle):
            handle.detach()  # the copies it needs are queued before the ids are published
        else:
            handle = _Ready(out if out is not None else self._finish_sampling(handle, sel, rows, prev.seqs))
        prev.handle = handle
        self.executor.publish_tokens(handle.tokens)

    def _own_rows(self, scheduled: list, plan: list[ScheduledSeq]) -> list[tuple[int, int, bytes]]:
        """The sampling rows of a step the output rank samples (`_rank_samplable` requests only), one
        per logits row: (seq_id, output position of the token drawn, `SamplingRow.record` bytes).

        Planned before the last step's tokens are read: an in-flight row's token is one more than
        ``token_ids`` holds now. A row whose in-flight token ends its sequence or is rolled back is
        drawn but not kept, and every other row gets exactly this position when its sampler row is
        updated after the read (`step` checks it). The records are the sequences' own rows', built
        here at a sequence's first sampled token (`_sampling_row`; rows of these requests only
        change in their position)."""
        out = []
        for (seq, _n), p in zip(scheduled, plan):
            if p.sample:
                srow = seq.sampling_row
                if srow is None:
                    srow = self._sampling_row(seq)
                step = len(seq.token_ids) - seq.num_prompt_tokens + (p.inflight_row >= 0)
                out.append((seq.seq_id, step, srow.record()))
        return out

    def _launch(self, logits: torch.Tensor, rows: list[SamplingRow], seqs: list[Sequence]):
        """Start sampling ``logits`` ([S, V] float32): (handle, None), or (None, `SamplerOutput`).

        A sampler may offer ``launch(logits, rows) -> handle`` (every device operation queued, no
        device->host read) and ``handle.finish() -> SamplerOutput`` (the read); calling the sampler
        must equal ``launch(...).finish()``. Then the last step's output work also overlaps the
        sampler's kernels and its host-side launches, and with ``handle.tokens`` (the sampled ids
        on the device) and ``handle.detach()`` the step may stay in flight (async scheduling).
        Without ``launch`` the sampler is called here. If it raises, rows are sampled apart
        (`_sample_rows_apart`).
        """
        launch = getattr(self.sampler, "launch", None)
        try:
            if launch is None:
                return None, self.sampler(logits, rows)  # the output work already ran, right after execute
            return launch(logits, rows), None
        except Exception as e:  # noqa: BLE001 - isolate the request(s) that caused it
            return None, self._sample_rows_apart(logits, rows, seqs, e)

    def _finish_sampling(self, handle, logits: torch.Tensor, rows: list[SamplingRow],
                         seqs: list[Sequence]) -> SamplerOutput:
        """``handle.finish()``; if it raises, the rows are sampled apart from ``logits``."""
        try:
            return handle.finish()
        except Exception as e:  # noqa: BLE001
            return self._sample_rows_apart(logits, rows, seqs, e)

    def _sample_rows_apart(self, logits: torch.Tensor, rows: list[SamplingRow], seqs: list[Sequence],
                           error: Exception) -> SamplerOutput:
        """After the batched sampler raised: sample row by row, and fail only the requests whose own
        row raises (their tokens are then dropped by the caller), so that one request's parameters
        can never fail every request in flight. If every row samples alone, the batch error was not
        a row's: it is re-raised (the engine loop then fails what is in flight)."""
        out = SamplerOutput([0] * len(rows), [None] * len(rows), [None] * len(rows))
        failed = False
        for i, (row, seq) in enumerate(zip(rows, seqs)):
            if seq.is_finished:
                continue
            try:
                one = self.sampler(logits[i:i + 1], [row])
            except Exception as e:  # noqa: BLE001
                failed = True
                logger.warning("request %d: sampling failed (%r); failing this request only",
                               seq.request.request_id, e)
                self._fail_request(seq.request, RequestError(f"sampling failed: {e!r}"))
                continue
            out.token_ids[i], out.logprobs[i], out.top_logprobs[i] = (
                one.token_ids[0], one.logprobs[0], one.top_logprobs[0])
        if not failed:
            raise error
        return out

    def _overlapped_outputs(self) -> None:
        self._finish_outputs(self._take_pending())
        self._push_progress()

    def _push_progress(self) -> None:
        """Hand the outbox's intermediate (stream) updates to their consumers now, while the device
        is busy. Their tokens' stats were reported with the step that sampled them; final results
        wait for this step's stats (they carry the request's own finished stats)."""
        keep = []
        for output, update in self._outbox:
            if update.finished:
                keep.append((output, update))
            else:
                output._push(update)
        self._outbox = keep

    def _take_pending(self) -> list[_Sampled]:
        pending, self._pending = self._pending, []
        return pending

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        """The sequence's sampler inputs: built once from its parameters, then only what changes
        per step (the output position, the min_tokens bans, the history for penalties) is updated.
        Sets ``seq.sampling_row_fixed`` once only the position can change (the step's fast path)."""
        p = seq.params
        row = seq.sampling_row
        out_len = seq.num_output_tokens
        if row is None:
            want_lp = p.logprobs
            if want_lp is None and p.num_candidates > p.n:
                want_lp = 0  # best_of needs each token's log-probability
            row = seq.sampling_row = SamplingRow(
                temperature=0.0 if p.greedy else p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                seed=seq.seed,
                logprobs=want_lp, repetition_penalty=p.repetition_penalty,
                frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
                prompt_token_ids=seq.request.prompt_token_ids if p.repetition_penalty != 1.0 else None,
                logit_bias=p.logit_bias, allowed_token_ids=p.allowed_token_ids,
                banned_token_ids=list(p.bad_token_ids), bad_word_seqs=p._bad_words_ids, guide=seq.guide)
        row.step = out_len
        if p.min_tokens and out_len <= p.min_tokens:
            row.banned_token_ids = list(p.bad_token_ids) + (
                list(self._end_ids(p)) + list(p.stop_token_ids) if out_len < p.min_tokens else [])
        history = bool(p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0 or p._bad_words_ids)
        if history:
            row.output_token_ids = seq.output_token_ids
        seq.sampling_row_fixed = not history and out_len >= p.min_tokens
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

    def _append_token(self, seq: Sequence, token: int, logprob: Optional[float], top,
                      logits_row: Optional[torch.Tensor]) -> _Sampled:
        """The fast part of a sampled token: what the next schedule needs (length, stop ids, EOS,
        ``max_tokens``, ``max_seq_len``, freed blocks). The rest is `_output_token`'s."""
        toks = seq.token_ids
        toks.append(token)
        if logprob is not None:
            seq.cumulative_logprob += logprob
        if logits_row is not None:
            seq.pending_logits.append(logits_row)
        stop_ids = seq.stop_ids
        if stop_ids is None:  # first token: cache what the checks below need
            p = seq.params
            stop_ids = seq.stop_ids = frozenset(p.stop_token_ids) | (
                frozenset() if p.ignore_eos else frozenset(self._end_ids(p)))
            seq.length_limit = min(seq.num_prompt_tokens + p.max_tokens, self.max_seq_len)
        # The sampler bans EOS and stop tokens until min_tokens exist, so any that arrives counts.
        stopped_by_token = False
        if token in stop_ids:
            stopped_by_token = True
            # A stop token id is its own stop reason, even when it is also an end id.
            seq.finish_reason = "stop"
            seq.stop_reason = token if token in seq.params.stop_token_ids else None
        guide = seq.guide
        if guide is not None and not stopped_by_token and self._guide_ends(seq, guide, token):
            stopped_by_token = True
            seq.finish_reason = "stop"
        elif not stopped_by_token and len(toks) >= seq.length_limit:  # max_tokens or max_seq_len
            seq.finish_reason = "length"  # `_output_token` turns it into "stop" if a stop string ends here
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)
        return _Sampled(seq, token, logprob, top, stopped_by_token, len(toks))

    @staticmethod
    def _guide_ends(seq: Sequence, guide, token: int) -> bool:
        """Advance a guided sequence's grammar by ``token``: True when that ends the sequence (the
        grammar accepted its stop token, or, never with masks applied, refused the token)."""
        if not guide.accept(token):
            logger.warning("request %d: token %d is outside its grammar; ending the sequence",
                           seq.request.request_id, token)
            return True
        return guide.terminated

    def _output_token(self, e: _Sampled) -> Optional[SequenceDelta]:
        """The slow part of a sampled token: logprob entry, detokenization, stop strings, its delta."""
        seq, token = e.seq, e.token
        p = seq.request.params
        assert len(seq.token_ids) == e.num_tokens, "a sequence got a token before the last one's output work"
        if e.top is not None and p.logprobs is not None:
            ids, vals, rank = e.top
            context = seq.token_ids[-5:-1]
            entry = {t: Logprob(v, r + 1, self._piece(t, context)) for r, (t, v) in enumerate(zip(ids, vals))}
            entry.setdefault(token, Logprob(e.logprob, rank, self._piece(token, context)))
            seq.pending_logprobs.append(entry)
        if self.tokenizer is not None and p.detokenize:
            # At the end, the text held back for an incomplete character is flushed; a stop token's
            # own text is left out unless asked for.
            final = seq.finish_reason is not None
            keep_token = not e.stopped_by_token or p.include_stop_str_in_output
            new = decode_new_text(self.tokenizer, seq, p.skip_special_tokens, final=final,
                                  end=None if keep_token else len(seq.token_ids) - 1)
            if new:
                seq.text += new
                # A stop string wins over "length" reached by the same token, as it always has.
                if p.stop and seq.num_output_tokens >= p.min_tokens and seq.finish_reason in (None, "length"):
                    hit = find_stop(seq.text, len(new), p.stop)
                    if hit is not None:
                        start, s = hit
                        seq.text = seq.text[:start + len(s)] if p.include_stop_str_in_output else seq.text[:start]
                        seq.finish_reason, seq.stop_reason = "stop", s
                        if not seq.is_finished:
                            self.scheduler.finish(seq)
        if (p.best_of or p.n) > p.n:  # num_candidates > n
            return None  # best_of: the chosen n are sent whole when the request ends
        if seq.finish_reason is None and not seq.request.output.streaming:
            return None  # nobody reads intermediate chunks of a non-streaming request: one delta at the end
        return self._delta(seq)

    def _finish_outputs(self, sampled: list[_Sampled]) -> None:
        """The slow part of these tokens (at most one per sequence), then their requests' updates."""
        now = time.monotonic()
        updates: dict[int, list[SequenceDelta]] = {}
        reqs: dict[int, Request] = {}  # requests with a delta or a finished sequence: `_emit`'s work
        live = self.requests
        itl = self._itl
        for e in sampled:
            seq = e.seq
            req = seq.request
            rid = req.request_id
            if rid not in live:
                continue  # ended meanwhile (fail_all): nothing more is sent
            m = req.output.metrics
            if m.first_token_time is None:
                m.first_token_time = now
                self._ttft.append(now - m.arrival_time)
            elif seq.last_token_time is not None:
                itl.append(now - seq.last_token_time)
            seq.last_token_time = now
            delta = self._output_token(e)
            if delta is not None:
                updates.setdefault(rid, []).append(delta)
                reqs[rid] = req
            elif seq.status is _FINISHED:
                reqs[rid] = req
        self._emit(updates, reqs.values())

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

    def _emit(self, updates: dict[int, list[SequenceDelta]], reqs: Iterable[Request]) -> None:
        for req in reqs:
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
        return self._stats(time.monotonic(), SchedulerOutput(), 0, 0)

    def _stats(self, t0, sched, num_prompt_tokens, num_generated, num_context=0) -> IterationStats:
        self.iteration += 1
        kv = self.kv
        finished, self._pending_finished = self._pending_finished, []
        ttft, self._ttft = self._ttft, []
        itl, self._itl = self._itl, []
        num_generated, self._late_generated = num_generated + self._late_generated, 0
        gpu_mem = torch.cuda.memory_allocated() if self._cuda else 0
        lora = {}
        if self.max_loras:
            lora = dict(max_lora=self.max_loras, running_lora_adapters=_adapter_names(self.scheduler.running),
                        waiting_lora_adapters=_adapter_names(self.scheduler.waiting))
        return IterationStats(**lora,
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
            gpu_mem_usage=gpu_mem, ttft=ttft, inter_token_latencies=itl, finished=finished,
            spec_decode=self.spec.take_stats() if self.spec is not None else None)


def _adapter_names(seqs) -> list[str]:
    """Sorted names of the LoRA adapters of ``seqs`` (each once)."""
    return sorted({s.request.lora.request.lora_name for s in seqs if s.request.lora is not None})


def _rank_samplable(p) -> bool:
    """Whether a request's tokens depend on nothing but its logits and the scalars of its sampler
    record (temperature, top-k, top-p, min-p, seed; the output position): nothing that changes the
    logits first (penalties, which need the token history, biases, bans, ``min_tokens``), no beams or
    ``best_of``, and no log-probabilities or logits returned. The tensor-parallel output rank can
    then draw them with its own `Sampler` exactly as this engine's would (`EngineCore._own_rows`)."""
    return (not p.use_beam_search and p.repetition_penalty == 1.0 and not p.frequency_penalty
            and not p.presence_penalty and not p.logit_bias and p.allowed_token_ids is None
            and not p.bad_token_ids and not p._bad_words_ids and not p.min_tokens and p.logprobs is None
            and p.num_candidates == p.n and p.prompt_logprobs is None and not p.return_context_logits
            and not p.return_generation_logits and p.guided_decoding is None)


def _argmax_only(p) -> bool:
    """Whether a request needs nothing but the arg-max of its raw logits: greedy and
    `_rank_samplable` (so the sampler's token is ``logits.argmax(-1)``, the first maximum, as
    `torch.argmax` picks it on any device)."""
    return p.greedy and _rank_samplable(p)


def _upload_rows(rows: list[int], dev: torch.device) -> torch.Tensor:
    """``rows`` as an int64 index tensor on ``dev``, through pinned memory: an upload from pageable
    memory waits for everything queued on the stream (the forward pass of an in-flight step)."""
    up = Upload()
    h = up.add(np.asarray(rows, dtype=np.int64))
    return up.send(dev)[h]


def _to_host_async(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``. On CUDA it is queued into pinned memory without waiting, so it is
    valid once the stream has passed this point (the step's sampler read waits for that)."""
    if not t.is_cuda:
        return t.clone()
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


def _copy(entries: Optional[list]) -> Optional[list]:
    """A snapshot for the consumer thread (the engine keeps appending to its own list)."""
    return None if entries is None else list(entries)
