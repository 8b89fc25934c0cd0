"""Draft-model proposals: a second `ModelRunner` with its own paged KV pool drafts tokens autoregressively.

Each target sequence that speculates has a draft-side record (`_DraftSeq`: block table, tokens whose
K/V the draft pool holds). A proposal for a sequence of ``L`` tokens with ``k`` drafts runs:

1. catch-up: the tokens the draft has not computed yet (the whole prompt at first, then the tokens
   the target accepted since), as prefill chunks within the runner's token budget; the last one's
   logits give draft 1;
2. ``k - 1`` decode steps, each feeding the previous draft, all sequences in one batch.

The draft's K/V then covers ``L + k - 1`` positions, of which the first ``L + min(a, k - 1)`` stay
valid after the target accepts ``a`` drafts (`on_verified`): the rest are overwritten by the next
catch-up. The draft pool is freed per sequence when it finishes, is preempted or is aborted
(`release`, `release_stale`). A sequence whose drafts do not fit the draft pool simply gets none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from kvpilot.core.kv_cache_manager import KVCacheManager
from kvpilot.core.sequence import Sequence, SequenceStatus
from kvpilot.runner.batch import ScheduledSeq
from kvpilot.spec_decode.rejection import DRAFT_SALT, sample_from, target_probs


@dataclass(eq=False)
class _DraftSeq:
    """A target sequence's place in the draft pool (the fields `KVCacheManager` reads)."""

    seq: Sequence
    seq_id: int
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_blocks: int = 0
    shared_prefix: None = None
    fed: int = 0  # positions fed in the last proposal (L + k - 1)


class DraftModelProposer:
    """Drafts with ``runner`` (a `ModelRunner` of the draft checkpoint).

    Args:
        runner: the draft's runner; its ``num_blocks`` / ``block_size`` size the draft pool.
        max_num_tokens: tokens per draft forward pass (catch-up chunks are split to fit).
    """

    def __init__(self, runner, max_num_tokens: int) -> None:
        self.runner = runner
        self.kv = KVCacheManager(runner.num_blocks, runner.block_size, enable_block_reuse=False)
        self.max_num_tokens = max_num_tokens
        self.states: dict[int, _DraftSeq] = {}

    # ---- bookkeeping -------------------------------------------------------------------------
    def release(self, seq: Sequence) -> None:
        st = self.states.pop(seq.seq_id, None)
        if st is not None:
            self.kv.free(st)

    def release_stale(self) -> None:
        """Free the draft blocks of sequences that no longer run (finished, aborted, preempted)."""
        for sid in [sid for sid, st in self.states.items() if st.seq.status is not SequenceStatus.RUNNING]:
            self.kv.free(self.states.pop(sid))

    def on_verified(self, seq: Sequence, num_tokens_before: int, accepted: int) -> None:
        """After verification: the draft K/V of the sequence's first ``L + min(accepted, k - 1)``
        positions is valid (``L`` = ``num_tokens_before``); blocks past that length are freed."""
        st = self.states.get(seq.seq_id)
        if st is None:
            return
        st.num_computed_tokens = min(st.fed, num_tokens_before + accepted)
        keep = self.kv.blocks_needed(st.num_computed_tokens)
        if len(st.block_table) > keep:
            self.kv.trim(st, st.num_computed_tokens)

    # ---- proposals ---------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int], params: list[tuple[float, int, float, float]]
                ) -> tuple[list[list[int]], list[Optional[torch.Tensor]]]:
        """Drafts for ``seqs`` (``ks[i]`` tokens each, >= 1), sampled with ``params[i]`` = (temperature,
        top_k, top_p, min_p) of the request (temperature 0: greedy, point-mass drafts).

        Returns (drafts per sequence, possibly fewer than asked (none when the draft pool is full),
        and per sequence None (greedy) or the [len(drafts), V] float32 distributions they were drawn
        from).
        """
        kv = self.kv
        live: list[tuple[int, _DraftSeq, int, int]] = []  # (index, state, L, k)
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            st = self.states.get(seq.seq_id)
            if st is None:
                st = self.states[seq.seq_id] = _DraftSeq(seq, seq.seq_id)
            L = len(seq.token_ids)
            need = L + k - 1 - st.num_computed_tokens
            if not kv.can_allocate(st, need):
                continue
            kv.allocate(st, need)
            live.append((i, st, L, k))
        drafts: list[list[int]] = [[] for _ in seqs]
        q: list[Optional[list[torch.Tensor]]] = [None] * len(seqs)
        if not live:
            return drafts, [None] * len(seqs)
        # 1. catch-up chunks within the token budget; a sequence samples when its chunk reaches L.
        pos = {i: st.num_computed_tokens for i, st, _, _ in live}
        last_logits: dict[int, torch.Tensor] = {}
        while any(pos[i] < L for i, _, L, _ in live):
            plan, who, budget = [], [], self.max_num_tokens
            for i, st, L, _ in live:
                if pos[i] >= L or budget <= 0:
                    continue
                n = min(L - pos[i], budget)
                toks = st.seq.token_ids[pos[i]:pos[i] + n]
                plan.append(ScheduledSeq(st.seq_id, toks, pos[i], st.block_table, pos[i] + n == L))
                if pos[i] + n == L:
                    who.append(i)
                pos[i] += n
                budget -= n
            logits, _ = self.runner.execute(plan)
            for r, i in enumerate(who):
                last_logits[i] = logits[r].clone()  # a decode graph's logits are overwritten by the next pass
        # 2. draft 1 from the catch-up logits, then k - 1 decode steps.
        order = [i for i, _, _, _ in live]
        cur = {i: last_logits[i] for i in order}
        info = {i: (st, L, k) for i, st, L, k in live}
        j = 0
        while True:
            rows = [i for i in order if info[i][2] > j]
            if not rows:
                break
            x = torch.stack([cur[i] for i in rows])
            toks, probs = self._draw(x, rows, seqs, params, j)
            for r, i in enumerate(rows):
                drafts[i].append(toks[r])
                if probs is not None and params[i][0] > 0:
                    q[i] = (q[i] or []) + [probs[r]]
            feed = [i for i in rows if info[i][2] > j + 1]
            if not feed:
                break
            plan = [ScheduledSeq(info[i][0].seq_id, [drafts[i][-1]], info[i][1] + j, info[i][0].block_table, True)
                    for i in feed]
            logits, _ = self.runner.execute(plan)
            cur = {i: logits[r] for r, i in enumerate(feed)}
            j += 1
        for i, st, L, k in live:
            st.fed = st.num_computed_tokens = L + k - 1
        return drafts, [None if x is None else torch.stack(x) for x in q]

    def _draw(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence],
              params: list[tuple[float, int, float, float]], j: int
              ) -> tuple[list[int], Optional[torch.Tensor]]:
        """Draft ``j`` (0-based) of each row: arg-max for greedy requests, else a draw from the
        request's filtered distribution with the draft's own noise stream. Returns the ids and the
        rows' distributions ([len(rows), V] float32; None when every row is greedy)."""
        dev = logits.device
        temp = torch.tensor([params[i][0] for i in rows], dtype=torch.float32, device=dev)
        if not bool((temp > 0).any()):
            return logits.argmax(dim=-1).tolist(), None
        probs = target_probs(logits, temp, torch.tensor([params[i][1] for i in rows], dtype=torch.int64, device=dev),
                             torch.tensor([params[i][2] for i in rows], dtype=torch.float32, device=dev),
                             torch.tensor([params[i][3] for i in rows], dtype=torch.float32, device=dev))
        seeds = torch.tensor([seqs[i].seed for i in rows], dtype=torch.int64, device=dev)
        steps = torch.tensor([seqs[i].num_output_tokens + j for i in rows], dtype=torch.int64, device=dev)
        return sample_from(probs, seeds, steps, salt=DRAFT_SALT).tolist(), probs
