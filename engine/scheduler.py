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
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from .kv_cache_manager import KVCacheManager
from .sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


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
    def __init__(self, kv: KVCacheManager, max_num_tokens: int, max_batch_size: int) -> None:
        self.kv = kv
        self.max_num_tokens = max_num_tokens
        self.max_batch_size = max_batch_size
        self.waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._num_finished_running = 0  # finished sequences not yet dropped from _running
        self.num_preemptions = 0

    @property
    def running(self) -> list[Sequence]:
        """Running sequences in admission order. `finish` only marks a sequence; it leaves this list
        here, in one O(n) pass per step, instead of an O(n) ``list.remove`` per finished sequence."""
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
            computed = seq.num_computed_tokens
            num_tokens = len(seq.token_ids)
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
                victim = running.pop()
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                self.kv.allocate(seq, n)
                scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            break  # the sequence itself was preempted: it was the last running one
        if out.preempted:
            return out  # the pool is full: admit nothing new this step
        while self.waiting and budget > 0 and len(running) < self.max_batch_size:
            seq = self.waiting[0]
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
        return out

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
