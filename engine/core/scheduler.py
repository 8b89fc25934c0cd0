"""Unified token-budget scheduler: decodes first, then prefill chunks, preemption by recompute.

Each step has a token budget (``max_num_tokens``) and a sequence cap (``max_batch_size``). Running
sequences, in admission order, get what they still need (one decode token, or the next chunk of a
long prompt); waiting sequences are then admitted first-come first-served with as many prompt
tokens as the budget allows (chunked prefill), after taking any cached prefix blocks. When the pool
cannot hold a running sequence's next tokens, the most recently admitted running sequence is
preempted: its blocks are freed and it goes back to the head of the queue with the tokens it has
produced, to be recomputed later (vLLM v1's recompute preemption). The output is plain data.

Async scheduling (`engine_core`): a running sequence whose last sampled token is still on the device
(``Sequence.inflight_row >= 0``) counts that token as one more to compute, and is left out when that
token is its last (its length limit). ``schedule(preempt=False)`` returns None instead of preempting,
so that the engine can first read the in-flight tokens (which may finish sequences and free blocks)
and preempt, if it must, on settled state.

Lockstep requests (`Request.lockstep`: beam search, whose beams must all be computed in the same
step) are scheduled as one unit, as vLLM v0 schedules a sequence group: preempting one of their
sequences preempts all of them (taking back what the step already gave the others), and they are
admitted only all together, with the batch slots of the request's full width reserved and the
blocks of every sequence's whole length allocated at once. Otherwise a beam could hold blocks while
it waits for a sibling queued behind a request that only those blocks would let in (a livelock).
A lockstep request's running sequences are also contiguous in running order (forks join next to
their siblings: `add_forks`), so that the end of a step's token budget splits at most one of them;
interleaved, every one of them could lose a sequence to the budget in every step, and none would
ever step again (another livelock, with ``max_num_tokens`` below the beams running).

A preempted lockstep request is re-admitted with its sequences sharing blocks again, as its beams
shared them while running (forked block tables, engine/core/beam_search.py): each sequence takes the
leading full blocks it has in common with an earlier sequence of the group by reference
(`KVCacheManager.share_prefix`; blocks still in the prefix cache are taken from it first), and
gets blocks of its own only for the rest. The sequence that allocated a shared block recomputes it;
the others count it as computed but get nothing to compute until it is (``Sequence.shared_prefix``;
at least one step later, so a step never reads what the same step writes), and then recompute only
their own suffixes. A beam whose siblings wait computes its last token again (`BeamSearch.step`).
So re-admission needs no more blocks than the request held when it was preempted plus the
blocks its next tokens needed: a request that ran once fits the empty pool again.
A lockstep request that cannot be admitted even into an empty batch and pool can never run:
`unfit_error` says why, and the engine fails it with that error.

LoRA (``max_loras`` > 0): the running sequences use at most ``max_loras`` distinct adapters (the
device's slots, `kvpilot.lora.layers.LoRASlots`). A waiting request whose adapter is not among the
running ones when they already use ``max_loras`` is passed over, keeping its place at the head of
the queue, and the requests behind it (the base model's, or those of running adapters) are
admitted in order, as vLLM's scheduler does; it is admitted once a running adapter's last
sequence finishes or is preempted.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from kvpilot.core.kv_cache_manager import KVCacheManager
from kvpilot.outputs import RequestTooLargeError
from kvpilot.core.sequence import Request, Sequence, SequenceStatus

logger = logging.getLogger(__name__)

_RUNNING = SequenceStatus.RUNNING


class _GroupPlan(NamedTuple):
    """`Scheduler._group_plan`: per sequence of a lockstep group, its cached prefix blocks and
    (index in the group of the sequence whose leading blocks it shares, or -1; its leading blocks
    that are cached or shared), and the free blocks the whole group takes."""

    cached: list[list[int]]
    shared: list[tuple[int, int]]
    need: int


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute)
    preempted: list[Sequence] = field(default_factory=list)
    prefix_queries: int = 0  # tokens looked up in the prefix cache at admission this step
    prefix_hits: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_tokens: int, max_batch_size: int, max_loras: int = 0) -> None:
        self.kv = kv
        self.max_loras = max_loras
        self.max_num_tokens = max_num_tokens
        self.max_batch_size = max_batch_size
        self.waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._num_finished_running = 0  # finished sequences not yet dropped from _running
        self.num_preemptions = 0
        # Admitted lockstep requests: each holds batch slots for its full width (`_reserved_slots`).
        self._lockstep: dict[int, Request] = {}

    @property
    def running(self) -> list[Sequence]:
        """Running sequences in admission order (a beam fork next to its request's other sequences:
        `add_forks`). `finish` only marks a sequence; it leaves this list here, in one O(n) pass
        per step, instead of an O(n) ``list.remove`` per finished sequence."""
        if self._num_finished_running:
            self._running = [s for s in self._running if s.status is not SequenceStatus.FINISHED]
            self._num_finished_running = 0
        return self._running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1
        logger.debug("preempted sequence %d (%d tokens)", seq.seq_id, seq.num_tokens)

    def _preempt_last(self, running: list[Sequence], i: int, out: SchedulerOutput) -> tuple[list[Sequence], int]:
        """Preempt the most recently admitted running sequence; with a lockstep request, every
        running sequence of that request (they return to the head of the queue in their order).
        Returns the preempted sequences and how many of them stood before position ``i`` of
        ``running`` (the step had taken those already)."""
        k = len(running) - 1
        victim = running[k]
        req = victim.request
        if not req.lockstep:
            del running[k]
            self._preempt(victim, out)
            return [victim], int(k < i)
        at = [k for k, s in enumerate(running) if s.request is req]
        group = [running[k] for k in at]
        for k in reversed(at):
            del running[k]
        for s in reversed(group):
            self._preempt(s, out)
        self._lockstep.pop(req.request_id, None)
        return group, sum(1 for k in at if k < i)

    def _reserved_slots(self) -> int:
        """Batch slots held by admitted lockstep requests beyond their running sequences (a beam
        request starts with one sequence and forks up to its width)."""
        extra = 0
        for rid, req in list(self._lockstep.items()):
            live = sum(1 for s in req.seqs if s.status is _RUNNING)
            if live == 0:  # finished (or aborted) meanwhile
                del self._lockstep[rid]
            else:
                extra += max(0, req.max_num_seqs - live)
        return extra

    def _waiting_group(self) -> list[Sequence]:
        """The head of the queue with the queued sequences of its request that follow it (a lockstep
        request's sequences are queued together)."""
        waiting = self.waiting
        req = waiting[0].request
        k = 1
        while k < len(waiting) and waiting[k].request is req:
            k += 1
        return [waiting[j] for j in range(k)]

    def _group_plan(self, group: list[Sequence]) -> _GroupPlan:
        """How a lockstep group is admitted (see the module docstring): each sequence's cached prefix
        blocks; the earlier sequence of the group whose leading full blocks it shares beyond those
        (the one it has the most in common with, the first on a tie) and how many; and the free
        blocks admitting all of them takes (new blocks, and cached blocks in the free queue, each
        counted once)."""
        kv = self.kv
        cached = [kv.match_prefix(s) for s in group]
        shared: list[tuple[int, int]] = []
        need = 0
        for i, seq in enumerate(group):
            src, blocks = -1, len(cached[i])
            toks = seq.token_ids
            for j in range(i):
                c = kv.common_full_blocks(group[j].token_ids, toks)
                if c > blocks:
                    src, blocks = j, c
            shared.append((src, blocks))
            need += kv.blocks_needed(seq.num_tokens) - blocks
        # A sequence that shares an earlier one's blocks holds that one's cached blocks among them
        # (equal tokens: equal block hashes), so the set counts every cached block.
        need += len({b for c in cached for b in c if kv.blocks[b].ref_count == 0})
        return _GroupPlan(cached, shared, need)

    @staticmethod
    def _shared_prefix_ready(seq: Sequence) -> bool:
        """Whether the blocks ``seq`` shares with an earlier sequence of its request (``seq.shared_prefix``
        is set) are computed, in an earlier step; if so, the wait ends (``shared_prefix`` = None).
        The source may itself be waiting for blocks it shares: then they count only once computed."""
        src, upto = seq.shared_prefix
        if src.shared_prefix is not None and not Scheduler._shared_prefix_ready(src):
            return False
        if src.num_computed_tokens < upto:
            return False
        seq.shared_prefix = None
        return True

    def _admit_group(self, budget: int, slots: int, running: list[Sequence], out: SchedulerOutput) -> int:
        """Admit the lockstep request at the head of the queue, all of its sequences or none: its full
        width in batch slots, at least one token of ``budget`` for each sequence that can compute
        now, and blocks for all their tokens, shared where their leading full blocks are equal
        (`_group_plan`). Returns the tokens scheduled (0: not admitted)."""
        group = self._waiting_group()
        req = group[0].request
        width = max(req.max_num_seqs, len(group))
        if slots + width > self.max_batch_size or width > self.max_num_tokens:
            return 0  # (a width above max_num_tokens never runs: `unfit_error` says so)
        plan = self._group_plan(group)
        now = sum(1 for src, _ in plan.shared if src < 0)  # the others wait for blocks they share
        if budget < now or plan.need > self.kv.num_free_blocks:
            return 0
        kv = self.kv
        B = kv.block_size
        for seq, c in zip(group, plan.cached):  # every cached block leaves the free queue before any allocation
            self.waiting.popleft()
            kv.admit(seq, c)
        for seq, c, (src, blocks) in zip(group, plan.cached, plan.shared):
            if kv.enable_block_reuse:
                out.prefix_queries += seq.num_tokens
                out.prefix_hits += len(c) * B
            if src >= 0:
                kv.share_prefix(seq, group[src], blocks)
                seq.num_computed_tokens = blocks * B
                seq.shared_prefix = (group[src], blocks * B)
            kv.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
            seq.status = _RUNNING
            running.append(seq)
        used = 0
        for seq, (src, _) in zip(group, plan.shared):
            if src >= 0:
                continue
            now -= 1
            n = min(seq.num_tokens - seq.num_computed_tokens, budget - used - now)  # one token left for each after it
            out.scheduled.append((seq, n))
            used += n
        self._lockstep[req.request_id] = req
        return used

    def unfit_error(self, seq: Sequence) -> RequestTooLargeError:
        """The error to fail ``seq``'s request with when it is the head of the queue and `schedule`
        could not admit it into an empty batch and pool (so it can never run). Says what it needs
        that the engine lacks: batch slots for a beam request's width, tokens per step, or blocks
        (for a beam request, the blocks its queued beams take together). Returned, not raised."""
        req = seq.request
        rid = req.request_id
        if not req.lockstep:
            return RequestTooLargeError(f"request {rid} needs more KV-cache blocks than the pool has")
        group = self._waiting_group() if self.waiting and self.waiting[0] is seq else [seq]
        width = max(req.max_num_seqs, len(group))
        if width > self.max_batch_size:
            return RequestTooLargeError(
                f"request {rid}: beam search with {width} beams needs {width} sequences in one batch, "
                f"but max_batch_size is {self.max_batch_size}")
        if width > self.max_num_tokens:
            return RequestTooLargeError(
                f"request {rid}: its {width} beams need {width} tokens in one step, "
                f"but max_num_tokens is {self.max_num_tokens}")
        need = self._group_plan(group).need
        return RequestTooLargeError(
            f"request {rid}: its {len(group)} beams of {max(s.num_tokens for s in group)} tokens need {need} "
            f"KV-cache blocks together, but the pool has {self.kv.num_blocks} blocks of {self.kv.block_size} "
            f"tokens")

    def schedule(self, preempt: bool = True) -> Optional[SchedulerOutput]:
        """This step's work. With ``preempt=False`` returns None where it would have to preempt (the
        blocks given to the sequences before that one stay theirs: a new schedule needs them too)."""
        out = SchedulerOutput()
        scheduled = out.scheduled
        budget = self.max_num_tokens
        block_size = self.kv.block_size
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if seq.shared_prefix is not None and not self._shared_prefix_ready(seq):
                i += 1  # its blocks are allocated; another sequence of its request computes their start
                continue
            computed = seq.num_computed_tokens
            num_tokens = len(seq.token_ids)
            if seq.spec_token_ids:  # drafts to verify (speculative decoding)
                num_tokens += len(seq.spec_token_ids)
            if seq.inflight_row >= 0:  # its sampled token is still on the device
                num_tokens += 1
                if num_tokens >= seq.length_limit:  # and it is the last one: nothing more to compute
                    i += 1
                    continue
            n = num_tokens - computed
            if n > budget:
                n = budget
            if len(seq.block_table) * block_size >= computed + n:  # fits its blocks already
                scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            if not preempt and not self.kv.can_allocate(seq, n):
                return None
            while not self.kv.can_allocate(seq, n):
                _, before = self._preempt_last(running, i, out)
                if before:  # sequences of a lockstep request the step already took: given back
                    i -= before
                    budget += sum(k for s, k in scheduled if s.status is not _RUNNING)
                    scheduled[:] = [(s, k) for s, k in scheduled if s.status is _RUNNING]
                if seq.status is not _RUNNING:
                    break
            else:
                self.kv.allocate(seq, n)
                scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            # The sequence itself was preempted (the last running one, or with its request's others):
            # running[i] is now the next sequence not preempted, if any.
        if out.preempted and running:
            return out  # the pool is full: admit nothing new this step
        # (With nothing left running the pool is empty: the head, preempted or not, is tried in it.)
        slots = len(running) + (self._reserved_slots() if self._lockstep else 0)
        adapters = {s.request.lora_id for s in running} - {None} if self.max_loras else None
        passed: list[Sequence] = []  # queued sequences whose adapter has no free device slot
        while self.waiting and budget > 0 and slots < self.max_batch_size:
            seq = self.waiting[0]
            if adapters is not None:
                lid = seq.request.lora_id
                if lid is not None and lid not in adapters:
                    if len(adapters) >= self.max_loras:  # every device slot is taken by a running adapter
                        req = seq.request
                        while self.waiting and self.waiting[0].request is req:
                            passed.append(self.waiting.popleft())
                        continue
                    adapters.add(lid)
            if seq.request.lockstep:
                used = self._admit_group(budget, slots, running, out)
                if not used:
                    break
                budget -= used
                slots += seq.request.max_num_seqs  # its full width
                continue
            cached = self.kv.match_prefix(seq)
            computed = len(cached) * self.kv.block_size
            n = min(seq.num_tokens - computed, budget)
            if not self.kv.can_allocate(seq, n, cached):
                break
            self.waiting.popleft()
            self.kv.admit(seq, cached)
            if self.kv.enable_block_reuse:
                out.prefix_queries += seq.num_tokens
                out.prefix_hits += computed
            self.kv.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            running.append(seq)
            scheduled.append((seq, n))
            budget -= n
            slots += 1
        if passed:
            self.waiting.extendleft(reversed(passed))  # back at the head, in their order
        return out

    def add_forks(self, seqs: list[Sequence]) -> None:
        """Run ``seqs``, new sequences of one running lockstep request (beam forks,
        `BeamSearch._reassign`): they join `running` right after the request's last running
        sequence, so that a lockstep request's sequences stay contiguous in running order. Appended
        at the end, behind requests admitted after theirs, two beam requests wider together than
        ``max_num_tokens`` could each have a beam left out of every step's budget: neither would
        ever step again (a livelock)."""
        if not seqs:
            return
        req = seqs[0].request
        running = self.running
        k = len(running)
        while k and running[k - 1].request is not req:
            k -= 1
        if not k:  # (none running: cannot happen, the parent runs)
            k = len(running)
        running[k:k] = seqs

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks (O(1) for a running one)."""
        if seq.status is SequenceStatus.RUNNING:
            self._num_finished_running += 1  # leaves `running` at its next read
        elif seq.status is SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:  # never queued
                pass
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
