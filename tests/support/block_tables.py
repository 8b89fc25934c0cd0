"""A decode workload for block-table tests: sequences whose tables grow in place as they decode,
and now and then get a new list (a preemption), over a shuffled block pool."""

from __future__ import annotations

import random

from kvpilot.runner.model_runner import ScheduledSeq


class DecodeTables:
    """``num_seqs`` sequences with ``lo..hi`` tokens in the cache, blocks of ``block_size`` tokens
    drawn from ``num_blocks`` in random order."""

    def __init__(self, num_blocks: int, block_size: int, num_seqs: int, lo: int, hi: int, seed: int = 0) -> None:
        self.B = block_size
        self.rng = random.Random(seed)
        self.free = list(range(num_blocks))
        self.rng.shuffle(self.free)
        self.lens = {sid: self.rng.randrange(lo, hi) for sid in range(num_seqs)}  # tokens before this step
        self.tabs = {sid: [self.free.pop() for _ in range(-(-(n + 1) // block_size))] for sid, n in self.lens.items()}

    def step(self, min_seqs: int = 1) -> list[ScheduledSeq]:
        """One decode of a random subset of the sequences, in random order (their own lists)."""
        sids = self.rng.sample(sorted(self.lens), self.rng.randrange(min_seqs, len(self.lens) + 1))
        return [ScheduledSeq(s, [3 + s], self.lens[s], self.tabs[s], True) for s in sids]

    def advance(self, seqs: list[ScheduledSeq], preempt: bool = False) -> None:
        """The decoded sequences move one token on; a block is appended in place when one starts (as
        `KVCacheManager.allocate` does). ``preempt``: one sequence gets a new list of other blocks."""
        for s in seqs:
            sid = s.seq_id
            self.lens[sid] += 1
            if self.lens[sid] + 1 > len(self.tabs[sid]) * self.B:
                self.tabs[sid].append(self.free.pop())
        if preempt:
            sid = self.rng.choice(sorted(self.lens))
            self.free[:0] = self.tabs[sid]
            self.tabs[sid] = [self.free.pop() for _ in range(len(self.tabs[sid]))]


def copies(seqs: list[ScheduledSeq], id_offset: int) -> list[ScheduledSeq]:
    """The same step with fresh lists under other seq_ids (their rows are rewritten; the rows of
    ``seqs`` keep being updated incrementally)."""
    return [ScheduledSeq(id_offset + s.seq_id, s.token_ids, s.start_pos, list(s.block_table), True) for s in seqs]
