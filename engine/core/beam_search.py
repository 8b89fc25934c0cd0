"""Beam search inside the continuous-batching engine (``SamplingParams.use_beam_search``).

A beam request runs its live beams as ordinary sequences, so their decode steps share batches with
every other request. After each step in which all of a request's beams produced logits, this module
(instead of the sampler) chooses the next beams, exactly as Hugging Face's vectorised
``generate(num_beams=W)`` does (transformers >= 4.50, ``_beam_search``):

- scores: ``log_softmax(logits)``, then the request's logits processors (min_tokens, bad words,
  penalties, bias: `apply_penalties_and_masks`), plus the beam's running score;
- the best ``max(2, 1 + number of stop ids) * W`` (beam, token) candidates over all beams;
- a candidate that ends in EOS / a stop token id, or reaches ``max_tokens``, is a finished
  hypothesis when it ranks in the top ``W``; its score is ``sum of log-probs / length **
  length_penalty`` with ``length`` counting the generated tokens including the last one;
  the best ``W`` finished hypotheses are kept;
- the best ``W`` unfinished candidates are the next beams;
- the search stops when every candidate finishes (``max_tokens``), or when ``W`` hypotheses are
  finished and the best running beam, normalised by the current length, cannot beat the worst of
  them (HF's default ``early_stopping=False`` heuristic).

The request returns its best ``n`` hypotheses (beam width ``W = best_of or n``), sorted by score,
with ``cumulative_logprob`` the (processed) log-probability sum. Temperature, top-k/top-p/min-p and
seeds do not apply (deterministic beam search); per-token ``logprobs`` and stop strings are not
produced for beam requests.

KV cache: a beam that continues its own sequence appends in place. A beam forked from another one
takes that sequence's *full* blocks by reference (their contents never change) and recomputes the
tokens of the parent's last, partial block in its next step (at most ``tokens_per_block`` tokens),
so no block is ever written by two beams and no copy kernel is needed. A forked beam joins the
running sequences at once, next to its siblings (`Scheduler.add_forks`: a request's beams stay
contiguous in running order); the scheduler reserved the request's full width in batch slots when it
admitted it, and preempts and re-admits all of its beams together (engine/core/scheduler.py). Re-admitted
beams share their common leading full blocks again (with or without block reuse): one beam
recomputes each shared block, the others wait for it and then recompute only their own tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from kvpilot.outputs import SequenceDelta
from kvpilot.sampling.sampler import SamplingRow, apply_penalties_and_masks
from kvpilot.core.sequence import Request, Sequence, SequenceStatus

logger = logging.getLogger(__name__)

_NEG = -1.0e9  # HF's "impossible" score offset


@dataclass
class Hypothesis:
    """A finished beam: generated token ids (last one included), normalised score, log-prob sum."""

    token_ids: list[int]
    score: float
    cumulative_logprob: float
    finish_reason: str


@dataclass
class BeamState:
    """Search state of one request; ``scores[i]`` is the running score of ``request.seqs[i]``."""

    width: int
    scores: list[float] = field(default_factory=lambda: [0.0])
    finished: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True


class BeamSearch:
    """Advances the beam requests of an `EngineCore` (one instance per core)."""

    def __init__(self, core: "EngineCore") -> None:
        self.core = core
        self.states: dict[int, BeamState] = {}

    def step(self, seqs: list[Sequence], rows: list[SamplingRow], sample_rows: list[int],
             logits: torch.Tensor) -> tuple[list[Sequence], list[SamplingRow], list[int]]:
        """Consume this step's beam rows; return the (seqs, rows, logits row indices) left to sample.

        Args:
            seqs, rows, sample_rows: the step's sampled sequences, their `SamplingRow`s and the
                index of each one's row in ``logits`` ([R, V] float32).
        """
        for rid in [r for r in self.states if r not in self.core.requests]:  # aborted or failed
            del self.states[rid]
        keep = [i for i, s in enumerate(seqs) if not s.params.use_beam_search]
        by_req: dict[int, list[int]] = {}
        for i, s in enumerate(seqs):
            if s.params.use_beam_search:
                by_req.setdefault(s.request.request_id, []).append(i)
        for idx in by_req.values():
            req = seqs[idx[0]].request
            pos = {seqs[i].seq_id: i for i in idx}
            if any(s.seq_id not in pos for s in req.seqs):
                # A beam is mid-prefill (recomputed after a preemption), waits for blocks it shares
                # with another beam (re-admitted), or got no tokens from the step's budget: all
                # beams must step together, so the others compute their last token again next
                # step. (Beams are never preempted or admitted apart: the scheduler treats a
                # request's beams as one unit, `Request.lockstep`.)
                for i in idx:
                    seqs[i].num_computed_tokens -= 1
                continue
            order = [pos[s.seq_id] for s in req.seqs]
            self._advance(req, logits[torch.tensor([sample_rows[i] for i in order], device=logits.device)],
                          [rows[i] for i in order])
        return [seqs[i] for i in keep], [rows[i] for i in keep], [sample_rows[i] for i in keep]

    # ---- one search step ----------------------------------------------------------------------
    def _advance(self, req: Request, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        core, p = self.core, req.params
        st = self.states.setdefault(req.request_id, BeamState(width=p.num_candidates))
        W = st.width
        m = req.output.metrics
        if m.first_token_time is None:
            m.first_token_time = time.monotonic()
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else core._end_ids(p))
        lp = torch.log_softmax(logits.float(), dim=-1)
        if any(r.needs_processing for r in rows):
            lp = apply_penalties_and_masks(lp, rows)
        V = lp.shape[1]
        acc = (lp + torch.tensor(st.scores, dtype=lp.dtype, device=lp.device)[:, None]).reshape(-1)
        K = min(max(2, 1 + len(stop_ids)) * W, acc.numel())
        top_vals, top_idx = acc.topk(K)
        new_len = req.seqs[0].num_output_tokens + 1
        at_max = new_len >= p.max_tokens or req.seqs[0].num_tokens + 1 >= core.max_seq_len
        vals, parents, tokens = top_vals.tolist(), (top_idx // V).tolist(), (top_idx % V).tolist()
        hits = [at_max or t in stop_ids for t in tokens]

        running = torch.tensor([v + (_NEG if h else 0.0) for v, h in zip(vals, hits)]).topk(min(W, K))
        run_scores, run_idx = running.values.tolist(), running.indices.tolist()

        # SamplingParams has no early_stopping field: HF's default False unless one is added.
        early = getattr(p, "early_stopping", False)
        if st.improvable and not (len(st.finished) >= W and early is True):
            for j in range(min(W, K)):
                if hits[j]:
                    toks = req.seqs[parents[j]].output_token_ids + [tokens[j]]
                    reason = "stop" if tokens[j] in stop_ids else "length"
                    st.finished.append(Hypothesis(toks, vals[j] / (new_len ** p.length_penalty), vals[j], reason))
            st.finished.sort(key=lambda h: h.score, reverse=True)
            del st.finished[W:]
        if len(st.finished) >= W and st.improvable:
            length = p.max_tokens if (early == "never" and p.length_penalty > 0) else new_len
            best_running = run_scores[0] / (length ** p.length_penalty)
            st.improvable = best_running > min(h.score for h in st.finished)
        done = not st.improvable or all(hits) or (early is True and len(st.finished) >= W)
        if done:
            self._finish(req, st)
            return
        self._reassign(req, [(parents[j], tokens[j]) for j in run_idx])
        st.scores = run_scores

    # ---- sequences and KV blocks ------------------------------------------------------------
    def _reassign(self, req: Request, beams: list[tuple[int, int]]) -> None:
        """Make ``req.seqs[i]`` hold beam ``i`` = (parent index, new token)."""
        kv, sched = self.core.kv, self.core.scheduler
        old = list(req.seqs)
        snap = [(list(s.token_ids), s.block_table[:s.num_computed_tokens // kv.block_size], s.num_cached_blocks)
                for s in old]
        in_place: dict[int, int] = {}
        forks: list[tuple[int, int]] = []  # (beam index, parent)
        for i, (parent, _tok) in enumerate(beams):
            if parent not in in_place:
                in_place[parent] = i
            else:
                forks.append((i, parent))
        spare = [s for j, s in enumerate(old) if j not in in_place]
        new_seqs: list[Sequence] = [None] * len(beams)  # type: ignore[list-item]
        for parent, i in in_place.items():
            new_seqs[i] = old[parent]
        # Take the shared blocks before any spare sequence releases its own (a shared block must
        # never pass through the free queue).
        for _i, parent in forks:
            kv.ref_blocks(snap[parent][1])
        added: list[Sequence] = []
        for i, parent in forks:
            tokens, blocks, cached = snap[parent]
            if spare:
                seq = spare.pop()
                kv.free(seq)
            else:
                seq = Sequence(request=req, index=0, token_ids=[], seed=0)
                seq.status = SequenceStatus.RUNNING
                added.append(seq)
            seq.token_ids = list(tokens)
            seq.sampling_row = None  # its cached penalty history belonged to another hypothesis
            seq.block_table = list(blocks)
            seq.num_computed_tokens = len(blocks) * kv.block_size
            seq.num_cached_blocks = min(cached, len(blocks))
            new_seqs[i] = seq
        sched.add_forks(added)  # next to the request's other beams (a livelock otherwise: `add_forks`)
        for seq in spare:  # fewer live beams than sequences (the vocabulary is tiny)
            sched.finish(seq)
        for i, (_parent, tok) in enumerate(beams):
            new_seqs[i].token_ids.append(tok)
            new_seqs[i].index = i
        req.seqs = new_seqs

    def _finish(self, req: Request, st: BeamState) -> None:
        core, p = self.core, req.params
        best = st.finished[:p.n]
        for seq in req.seqs:
            core.scheduler.finish(seq)
            seq.finish_reason = best[0].finish_reason if best else "length"
        tok = core.tokenizer
        deltas = []
        for i, h in enumerate(best):
            text = ""
            if tok is not None and p.detokenize:
                # Decoded after the prompt's last tokens, so a leading space survives.
                context = req.prompt_token_ids[-4:]
                before = tok.decode(context, skip_special_tokens=p.skip_special_tokens)
                text = tok.decode(context + list(h.token_ids), skip_special_tokens=p.skip_special_tokens)[len(before):]
            stop_reason = h.token_ids[-1] if (h.finish_reason == "stop" and h.token_ids[-1] in p.stop_token_ids) else None
            deltas.append(SequenceDelta(index=i, new_token_ids=list(h.token_ids), new_text=text,
                                        cumulative_logprob=h.cumulative_logprob, finish_reason=h.finish_reason,
                                        stop_reason=stop_reason, replace=True))
        del self.states[req.request_id]
        core._finish_request(req, deltas)
