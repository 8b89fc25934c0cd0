"""A persistent host copy of the block tables a model runner is given, updated incrementally.

Every step the runner needs the block tables of the scheduled sequences as one int32 matrix. Copying
each sequence's whole table from its Python list costs about a microsecond per 10-20 entries: at
batch 448 with 1,500-token contexts (47 blocks each) that is 1-2 ms of host time per step while the
GPU waits. A sequence's table changes rarely (one new block every ``tokens_per_block`` tokens), so
`HostBlockTables` keeps one numpy row per sequence and writes only the entries appended since the
last step; the step's matrix is then one vectorised gather of those rows.

Change detection needs no help from the engine: a row remembers the list object it mirrors and how
many entries it holds. A new list (a freed and re-admitted sequence, a beam fork, a plan unpickled in
a worker process) rewrites the row; a longer one appends. The contract this relies on: **while a
list is passed as a block table, entries are only appended to it**; any other change (a freed,
replaced or forked table) must assign a new list. `KVCacheManager` and the beam search follow it.
(A list only truncated in place since the last step is detected too.)
"""

from __future__ import annotations

from typing import Sequence as Seq

import numpy as np

_KEEP_CALLS = 4  # rows unused for this many `sync` calls may be handed to other sequences


class HostBlockTables:
    """Rows of block ids (``array``: [rows, width] int32) for the sequences of recent steps.

    Args:
        width: initial row width in blocks (grows when a longer table arrives).
        rows: initial number of rows (grows when more sequences are live than rows).

    Rows are keyed by ``seq_id``. A row is never freed explicitly (the runner does not see
    sequences end); rows unused for a few calls are reused when the free ones run out.
    """

    def __init__(self, width: int, rows: int = 64) -> None:
        width, rows = max(1, width), max(1, rows)
        self.array = np.zeros((rows, width), np.int32)
        self._row_of: dict[int, int] = {}  # seq_id -> row
        self._owner: list = [None] * rows  # row -> seq_id (None: free, or a duplicate's spare row)
        self._list: list = [None] * rows  # row -> the list object it mirrors
        self._len = [0] * rows  # row -> entries of that list written
        self._stamp = [-_KEEP_CALLS - 1] * rows  # row -> the call that last used it
        self._free = list(range(rows - 1, -1, -1))
        self._calls = 0

    @property
    def num_rows(self) -> int:
        return self.array.shape[0]

    def sync(self, seqs: Seq) -> tuple[np.ndarray, int]:
        """Bring the rows of ``seqs`` (objects with ``seq_id`` and ``block_table``: list[int]) up to date.

        Returns (row index of each sequence in `array`: [len(seqs)] intp, longest table length).
        ``array[rows[i]]`` then holds ``seqs[i].block_table`` followed by zeros. The array may be
        reallocated (grown) by this call.
        """
        self._calls += 1
        call = self._calls
        row_of, lst, lens, stamp = self._row_of, self._list, self._len, self._stamp
        arr = self.array
        width = arr.shape[1]
        out = []
        longest = 0
        for s in seqs:
            bt = s.block_table
            m = len(bt)
            r = row_of.get(s.seq_id)
            if r is None or (stamp[r] == call and lst[r] is not bt):
                r = self._take(s.seq_id if r is None else None, call)
                arr = self.array
            prev = lens[r]
            if lst[r] is bt and m == prev:
                pass  # unchanged: the common case
            else:
                if m > width:
                    self._widen(m)
                    arr, width = self.array, self.array.shape[1]
                if lst[r] is bt and m == prev + 1:  # a block appended
                    arr[r, prev] = bt[prev]
                elif lst[r] is bt and m > prev:
                    arr[r, prev:m] = bt[prev:]
                else:  # a new list (or one truncated in place): rewrite the row
                    lst[r] = bt
                    arr[r, :m] = bt
                    if prev > m:
                        arr[r, m:prev] = 0
                lens[r] = m
            stamp[r] = call
            out.append(r)
            if m > longest:
                longest = m
        return np.array(out, dtype=np.intp), longest

    def gather(self, seqs: Seq, out: np.ndarray) -> int:
        """Write the block tables of ``seqs`` into rows ``0..n-1`` of ``out`` ([>= n, W] int32 or
        int64), zero-padded to the longest table length ``w``, which is returned. Columns ``>= w``
        of ``out`` are left as they were.

        Raises:
            ValueError: a table is longer than ``out``'s width ``W``.
        """
        rows, w = self.sync(seqs)
        if w > out.shape[1]:
            raise ValueError(f"a block table of {w} blocks does not fit {out.shape[1]} columns")
        if w:
            out[:len(rows), :w] = self.array[rows, :w]
        return w

    # ---- rows ----------------------------------------------------------------------------------
    def _take(self, seq_id, call: int) -> int:
        if not self._free:
            self._reclaim(call)
        if not self._free:
            self._grow()
        r = self._free.pop()
        if self._len[r]:
            self.array[r, :self._len[r]] = 0  # rows beyond a table's length stay zero
        self._owner[r] = seq_id
        self._list[r] = None
        self._len[r] = 0
        if seq_id is not None:
            self._row_of[seq_id] = r
        return r

    def _reclaim(self, call: int) -> None:
        """Free the rows no call has used lately (their sequences ended, or wait to be resumed)."""
        for r, st in enumerate(self._stamp):
            if st < call - _KEEP_CALLS and (self._owner[r] is not None or self._list[r] is not None):
                owner = self._owner[r]
                if owner is not None and self._row_of.get(owner) == r:
                    del self._row_of[owner]
                self._owner[r] = self._list[r] = None
                self._free.append(r)

    def _grow(self) -> None:
        old = self.num_rows
        self.array = np.concatenate([self.array, np.zeros_like(self.array)])
        self._owner += [None] * old
        self._list += [None] * old
        self._len += [0] * old
        self._stamp += [-_KEEP_CALLS - 1] * old
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _widen(self, width: int) -> None:
        rows, w = self.array.shape
        new = np.zeros((rows, max(width, 2 * w)), np.int32)
        new[:, :w] = self.array
        self.array = new
