"""`SpeculativeDecoder`: the engine's speculation hooks (propose before the schedule, verify after the pass).

One engine step with speculation (`kvpilot.core.engine_core.EngineCore.step` calls these):

1. `propose` (before the schedule): every running sequence that is decoding (all its tokens but the
   last computed) and `eligible` gets up to ``max_draft_len`` drafts in ``seq.spec_token_ids``
   (fewer near its length limit). The scheduler counts them as tokens to compute, so its token
   budget and block allocation cover them (a budget cut keeps a prefix of the drafts).
2. The step's plan gives such a sequence the chunk ``[last token] + drafts`` with logits at every
   position (``all_logits``, ``verify``): the target verifies all drafts of all sequences in the
   same forward pass as the other sequences' prefill chunks and decodes (the prefill/extend
   attention path; the prefill CUDA graphs cover such steps up to their token bucket).
3. `verify` (after the pass): `kvpilot.spec_decode.rejection.verify` picks each sequence's tokens;
   they are appended one position at a time across the verified sequences, each through the engine's
   fast and slow output work (stop ids, EOS, ``max_tokens``, stop strings, logprobs, detokenization),
   so a sequence that stops inside its accepted run keeps nothing after the stop; the step's
   updates of a request are then merged into one (`_coalesce`). Then the
   sequence's computed tokens become ``L + accepted`` (the K/V of rejected positions is stale and
   is overwritten by later steps), full blocks are registered in the prefix cache from accepted
   tokens only, and blocks past the sequence's length are returned to the pool (`KVCacheManager.trim`).

Requests that cannot speculate exactly (`eligible` says why) decode one token per step in the same
batches. Speculation runs with the synchronous engine order: async scheduling is off while it is
configured (`EngineCore._overlap_ok`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from kvpilot.core.sequence import Sequence, SequenceStatus
from kvpilot.core.stats import SpecDecodeStats
from kvpilot.runner.batch import ScheduledSeq
from kvpilot.sampling.sampler import _raw_logprobs
from kvpilot.spec_decode.config import DraftTargetDecodingConfig, NGramDecodingConfig, SpeculativeConfig
from kvpilot.spec_decode.ngram import ngram_draft
from kvpilot.spec_decode.rejection import target_probs, verify

logger = logging.getLogger(__name__)

_RUNNING = SequenceStatus.RUNNING


def eligible(p, seq: Sequence) -> bool:
    """Whether a sequence may speculate this step: its next tokens depend only on the logits and the
    request's temperature / top-k / top-p / min-p / seed. Not for beam search, ``best_of``,
    penalties, logit bias, allowed or banned ids and bad words (they change the logits from the
    token history), guided decoding (the grammar masks each position after the previous token), before
    ``min_tokens`` are out, or with ``return_generation_logits``.
    Log-probabilities are supported."""
    return (not p.use_beam_search and p.num_candidates == p.n and p.repetition_penalty == 1.0
            and not p.frequency_penalty and not p.presence_penalty and not p.logit_bias
            and p.allowed_token_ids is None and not p.bad_token_ids and not p._bad_words_ids
            and seq.num_output_tokens >= p.min_tokens and not p.return_generation_logits
            and getattr(p, "guided_decoding", None) is None)


class SpeculativeDecoder:
    """The speculation of one engine (module docstring).

    Args:
        config: `NGramDecodingConfig` or `DraftTargetDecodingConfig`.
        draft: the `DraftModelProposer` of a `DraftTargetDecodingConfig` (None for n-gram).

    ``totals``: `SpecDecodeStats` since the engine started; `take_stats` returns and resets the
    counts since its last call.
    """

    def __init__(self, config: SpeculativeConfig, draft=None) -> None:
        if isinstance(config, DraftTargetDecodingConfig) and draft is None:
            raise ValueError("a DraftTargetDecodingConfig needs its draft model's proposer")
        self.config = config
        self.max_draft_len = config.max_draft_len
        self.draft = draft
        self._q: dict[int, Optional[torch.Tensor]] = {}  # seq_id -> draft distributions (sampled draft model)
        self._step = SpecDecodeStats(accepted_per_pos=[0] * self.max_draft_len)
        self.totals = SpecDecodeStats(accepted_per_pos=[0] * self.max_draft_len)

    # ---- hooks ---------------------------------------------------------------------------------
    def propose(self, running: list[Sequence]) -> None:
        """Set ``spec_token_ids`` of every running sequence (empty for those that do not speculate)."""
        if self.draft is not None:
            self.draft.release_stale()
        self._q.clear()
        cands: list[Sequence] = []
        ks: list[int] = []
        K = self.max_draft_len
        limit = self.config.max_concurrency
        if limit is not None and len(running) > limit:  # large batch: plain decoding this step
            for seq in running:
                seq.spec_token_ids = ()
            return
        for seq in running:
            seq.spec_token_ids = ()
            if seq.status is not _RUNNING or seq.shared_prefix is not None or seq.inflight_row >= 0:
                continue
            L = len(seq.token_ids)
            if seq.num_computed_tokens != L - 1 or L <= seq.num_prompt_tokens:
                continue  # prefilling, or not started
            k = min(K, seq.length_limit - L - 1)  # k drafts + 1 token reach the limit at most
            if k < 1 or not eligible(seq.params, seq):
                continue
            cands.append(seq)
            ks.append(k)
        if not cands:
            return
        if isinstance(self.config, NGramDecodingConfig):
            n = self.config.max_matching_ngram_size
            for seq, k in zip(cands, ks):
                d = ngram_draft(seq.token_ids, k, n)
                if d:
                    seq.spec_token_ids = d
            return
        params = [_params(s.params) for s in cands]
        drafts, qs = self.draft.propose(cands, ks, params)
        for seq, d, q in zip(cands, drafts, qs):
            if d:
                seq.spec_token_ids = d
                self._q[seq.seq_id] = q

    def plan(self, seq: Sequence, start: int, n: int) -> Optional[ScheduledSeq]:
        """The plan entry of a sequence the scheduler gave ``n`` tokens from ``start``, when they
        include drafts (``start + n`` past its tokens): its last token and the drafts that fit, with
        logits at every position. None otherwise."""
        toks = seq.token_ids
        extra = start + n - len(toks)
        if extra <= 0 or not seq.spec_token_ids:
            return None
        return ScheduledSeq(seq.seq_id, toks[start:] + list(seq.spec_token_ids[:extra]), start, seq.block_table,
                            True, True, verify=True)

    def verify(self, core, items: list[tuple[Sequence, ScheduledSeq, int]], logits: torch.Tensor) -> int:
        """Verify the drafts of ``items`` = (sequence, its plan entry, its first row of ``logits``) and
        append the chosen tokens through ``core``'s output work (module docstring). Returns the
        tokens appended."""
        live = [(s, p, r) for s, p, r in items if s.status is _RUNNING]
        for s, _, _ in items:
            s.spec_token_ids = ()
        if not live:
            return 0
        dev = logits.device
        rows, temp, topk, topp, minp = [], [], [], [], []
        drafts, seeds, firsts, qs = [], [], [], []
        for seq, p, first in live:
            d = list(p.token_ids[1:])
            m = len(d)
            rows.extend(range(first, first + m + 1))
            t, k, tp, mp = _params(seq.params)
            temp += [t] * (m + 1)
            topk += [k] * (m + 1)
            topp += [tp] * (m + 1)
            minp += [mp] * (m + 1)
            drafts.append(d)
            seeds.append(seq.seed)
            firsts.append(seq.num_output_tokens)
            q = self._q.get(seq.seq_id)
            qs.append(None if q is None else q[:m])
        raw = logits[torch.tensor(rows, dtype=torch.int64, device=dev)]
        probs = target_probs(raw, torch.tensor(temp, dtype=torch.float32, device=dev),
                             torch.tensor(topk, dtype=torch.int64, device=dev),
                             torch.tensor(topp, dtype=torch.float32, device=dev),
                             torch.tensor(minp, dtype=torch.float32, device=dev))
        emitted = verify(probs, drafts, qs if any(q is not None for q in qs) else None, seeds, firsts)
        # Log-probabilities of the emitted tokens (raw distribution), for requests that ask.
        lps: list[Optional[list]] = [None] * len(live)
        off = 0
        want = []
        for i, (seq, p, _) in enumerate(live):
            if seq.params.logprobs is not None:
                want.append((i, off))
            off += len(p.token_ids)
        if want:
            kmax = max(live[i][0].params.logprobs for i, _ in want)
            sel = [o + j for i, o in want for j in range(len(emitted[i]))]
            chosen = [t for i, _ in want for t in emitted[i]]
            got = _raw_logprobs(raw[torch.tensor(sel, device=dev)], torch.tensor(chosen, device=dev), kmax)
            c, rk, tv, ti = (g.tolist() for g in got)
            at = 0
            for i, _ in want:
                k = live[i][0].params.logprobs
                lps[i] = [(c[at + j], (ti[at + j][:k], tv[at + j][:k], rk[at + j])) for j in range(len(emitted[i]))]
                at += len(emitted[i])
        lengths = [len(s.token_ids) for s, _, _ in live]
        appended = 0
        mark = len(core._outbox)
        for j in range(max(len(e) for e in emitted)):
            batch = []
            for i, (seq, _, _) in enumerate(live):
                if j >= len(emitted[i]) or seq.status is not _RUNNING:
                    continue
                lp, top = lps[i][j] if lps[i] is not None else (None, None)
                batch.append(core._append_token(seq, emitted[i][j], lp, top, None))
            if not batch:
                break
            appended += len(batch)
            core._finish_outputs(batch)  # the slow part at once: the next position may follow
        _coalesce(core._outbox, mark)
        kv = core.kv
        st = self._step
        for i, (seq, p, _) in enumerate(live):
            m = len(p.token_ids) - 1
            accepted = len(emitted[i]) - 1
            st.num_drafts += 1
            st.num_draft_tokens += m
            st.num_accepted_tokens += accepted
            for j in range(accepted):
                st.accepted_per_pos[j] += 1
            rm = seq.request.output.metrics
            rm.num_draft_tokens += m
            rm.num_accepted_tokens += accepted
            if seq.status is not _RUNNING:
                if self.draft is not None:
                    self.draft.release(seq)
                continue
            L = lengths[i]
            seq.num_computed_tokens = L + accepted  # the last token and the accepted drafts
            if kv.enable_block_reuse and seq.num_computed_tokens // kv.block_size > seq.num_cached_blocks:
                kv.cache_full_blocks(seq)
            kv.trim(seq, len(seq.token_ids))
            if self.draft is not None:
                self.draft.on_verified(seq, L, accepted)
        self._q.clear()
        return appended

    def release(self, seq: Sequence) -> None:
        """Forget a sequence (its request ended): its draft pool blocks are freed."""
        seq.spec_token_ids = ()
        if self.draft is not None:
            self.draft.release(seq)

    def take_stats(self) -> Optional[SpecDecodeStats]:
        """This step's `SpecDecodeStats` (None when no sequence verified drafts); the counts restart."""
        st = self._step
        if not st.num_drafts:
            return None
        self._step = SpecDecodeStats(accepted_per_pos=[0] * self.max_draft_len)
        t = self.totals
        t.num_drafts += st.num_drafts
        t.num_draft_tokens += st.num_draft_tokens
        t.num_accepted_tokens += st.num_accepted_tokens
        t.accepted_per_pos = [a + b for a, b in zip(t.accepted_per_pos, st.accepted_per_pos)]
        return st


def _coalesce(outbox: list, start: int) -> None:
    """Merge the updates queued from ``start`` on into one per request (deltas in order; the last
    update's end state), so a streaming request gets one chunk per step, not one per token."""
    tail = outbox[start:]
    if len(tail) < 2:
        return
    merged: list = []
    at: dict[int, int] = {}
    for output, update in tail:
        i = at.get(id(output))
        if i is None:
            at[id(output)] = len(merged)
            merged.append((output, update))
        else:
            merged[i] = (output, dataclasses.replace(update, deltas=merged[i][1].deltas + update.deltas))
    outbox[start:] = merged


def _params(p) -> tuple[float, int, float, float]:
    """(temperature (0 = greedy), top_k (0 = off), top_p, min_p) of a request, as the sampler reads them."""
    return (0.0 if p.greedy else float(p.temperature), max(int(p.top_k), 0), float(p.top_p), float(p.min_p))
