"""The sampler's logits transforms, batched: forbidden tokens, logit bias, penalties.

Order (Hugging Face `generate`'s, so each can be checked against its logits processors): forbidden
tokens (``allowed_token_ids``, then ``banned_token_ids`` and ``bad_words``), logit bias, repetition
penalty (HF: over prompt and output tokens, each token once; positive logits divided, negative
multiplied), frequency/presence penalties (OpenAI: output tokens only,
``logit -= frequency * count + presence * (count > 0)``).

Each kind is a fixed number of device operations over the whole batch, whatever the rows hold:
bans and biases are flat ``row * V + token`` index arrays (one scatter each); penalties read
per-sequence token counts that live on the device (`TokenCounts`) and are updated with each row's new
output tokens only, so a step costs the same at 100 or 100,000 tokens of history (no per-row
operations, no sort or ``unique`` of the histories). Every index array of a call travels in the
call's one upload (`kvpilot.sampling.sampler_inputs.Upload`).
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional

import numpy as np
import torch

from kvpilot.sampling.sampler_inputs import ALLOWED, BIAS, PENALTIES, SamplingRow, Upload, records


_RECOUNT = object()  # the prompt of a `SamplingRow._counts` to count again (matches no row's prompt)


class TokenCounts:
    """Token counts of the sequences that use penalties, on one device: an int32 ``[slots, V]`` pool.

    A row's slot holds ``2 * (count in its output) + (1 if in its prompt)`` per token id, so
    ``> 0`` is "seen" (repetition penalty), ``>> 1`` the output count (frequency) and ``>= 2``
    "present in the output" (presence). A row keeps its slot across calls (``SamplingRow._counts``)
    and each call adds only the output tokens that are new since the last one; a row seen for the
    first time, or whose history visibly no longer extends what was counted (shorter than the
    counted part, another token at its last position, or another prompt list), is counted again
    from scratch. The check is O(1), so it cannot see a replaced history that agrees at the last
    counted position ([3, 7] then [5, 7, 9]): give another history its own `SamplingRow` (as the
    beam search does for forks). Slots of rows that were garbage-collected are reused.
    Memory: 4 * V bytes per live row (0.5 MB at V = 128256); the pool grows by doubling and never
    shrinks.
    """

    def __init__(self, device: torch.device, vocab_size: int):
        self.device, self.V = device, vocab_size
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self._owner: list[Optional[weakref.ref]] = []
        self._free: list[int] = []
        self.lock = threading.Lock()  # held by `plan` and the device operations that follow it

    def _alloc(self, row: SamplingRow) -> int:
        if not self._free:
            self._free = [i for i, w in enumerate(self._owner) if w is None or w() is None][::-1]
        if not self._free:
            cap = len(self._owner)
            new = max(8, 2 * cap)
            grown = torch.zeros(new, self.V, dtype=torch.int32, device=self.device)
            grown[:cap] = self.counts
            self.counts = grown
            self._owner += [None] * (new - cap)
            self._free = list(range(new - 1, cap - 1, -1))
        slot = self._free.pop()
        self._owner[slot] = weakref.ref(row)
        return slot

    def plan(self, rows: list[SamplingRow], idx) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Slots of ``rows[i]`` for i in ``idx`` and the updates that bring them up to date.

        Returns (slots [P], slots to clear [C], flat ``slot * V + token`` keys of prompt tokens to
        mark [K1], keys of output tokens to add 2 to [K2]), all int64; token ids outside [0, V)
        are ignored. Apply them with `update` before reading the counts."""
        V = self.V
        slots: list[int] = []
        clear: list[int] = []
        mark: list[np.ndarray] = []
        add_slot: list[int] = []
        add_tok: list[int] = []
        for i in idx:
            r = rows[i]
            out = r.output_token_ids
            prompt = r.prompt_token_ids
            st = r._counts
            n_out = len(out)
            if (st is not None and st[0] is self and self._owner[st[1]]() is r and st[4] is prompt
                    and st[2] <= n_out and (st[2] == 0 or out[st[2] - 1] == st[3])):
                slot = st[1]
                if st[2] < n_out:
                    new = out[st[2]:]
                    add_slot += [slot] * len(new)
                    add_tok += new
            else:
                slot = st[1] if (st is not None and st[0] is self and self._owner[st[1]]() is r) else self._alloc(r)
                clear.append(slot)
                if prompt:
                    p = np.asarray(prompt, dtype=np.int64)
                    mark.append(slot * V + p[(p >= 0) & (p < V)])
                add_slot += [slot] * n_out
                add_tok += out
            r._counts = (self, slot, n_out, out[-1] if n_out else None, prompt)
            slots.append(slot)
        tok = np.array(add_tok, dtype=np.int64)
        ok = (tok >= 0) & (tok < V)
        adds = (np.array(add_slot, dtype=np.int64) * V + tok)[ok]
        marks = np.concatenate(mark) if mark else np.empty(0, np.int64)
        return (np.array(slots, dtype=np.int64), np.array(clear, dtype=np.int64), marks, adds)

    def update(self, clear: torch.Tensor, marks: torch.Tensor, adds: torch.Tensor, twos: torch.Tensor) -> None:
        """Apply `plan`'s updates on the device (``twos``: int32 2s shaped like ``adds``)."""
        if clear.numel():
            self.counts.index_fill_(0, clear, 0)
        flat = self.counts.view(-1)
        if marks.numel():
            flat.index_fill_(0, marks, 1)  # the same value for duplicates: order-free
        if adds.numel():
            flat.index_add_(0, adds, twos)


_POOLS: dict[tuple[torch.device, int], TokenCounts] = {}
_POOLS_LOCK = threading.Lock()


def token_counts(device: torch.device, vocab_size: int) -> TokenCounts:
    """The process's `TokenCounts` pool for ``(device, vocab_size)`` (created on first use)."""
    key = (torch.device(device), vocab_size)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = TokenCounts(key[0], vocab_size)
        return pool


def bad_word_bans(r: SamplingRow) -> list[int]:
    """The row's banned ids now: ``banned_token_ids`` plus the last token of every bad word whose
    prefix ends its output."""
    out = list(r.banned_token_ids)
    for seq in r.bad_word_seqs:
        prefix = seq[:-1]
        if not prefix or r.output_token_ids[-len(prefix):] == prefix:
            out.append(seq[-1])
    return out


def _flat_keys(rows, ids: list[np.ndarray], V: int) -> np.ndarray:
    """``row * V + id`` of every id of ``ids[j]`` (int64 arrays), with ``row = rows[j]``."""
    if not ids:
        return np.empty(0, np.int64)
    lens = np.fromiter(map(len, ids), np.int64, len(ids))
    return np.concatenate(ids) + np.repeat(np.asarray(rows, dtype=np.int64) * V, lens)


class Processing:
    """The transforms of one call: host index arrays (added to an `Upload`), then the device work.

    Build it with the rows and their `records`; `empty` tells when no row needs anything. Then
    `add_to` the call's upload, send it, and `apply` with the uploaded tensors.
    """

    def __init__(self, rows: list[SamplingRow], V: int, recs: np.ndarray):
        self.S, self.V = len(rows), V
        self._held = False  # the token counts' lock, from `add_to` to the end of `apply`
        self.pen_rows = np.empty(0, np.int64)
        flags = recs["flags"]
        bans = [(i, bad_word_bans(r)) for i, r in enumerate(rows) if r.banned_token_ids or r.bad_word_seqs]
        self.empty = not (bans or flags.any())
        if self.empty:
            return
        self.ban_keys = _flat_keys([i for i, _ in bans], [np.array([t for t in b if 0 <= t < V], dtype=np.int64)
                                                          for _, b in bans], V)
        self.allowed = np.flatnonzero(flags & ALLOWED)
        self.allowed_keys = _flat_keys(range(self.allowed.size),
                                       [rows[i].vocab_arrays(V)[2] for i in self.allowed.tolist()], V)
        biased = np.flatnonzero(flags & BIAS)
        arrays = [rows[i].vocab_arrays(V) for i in biased.tolist()]
        self.bias_keys = _flat_keys(biased, [a[0] for a in arrays], V)
        self.bias_vals = np.concatenate([a[1] for a in arrays]) if arrays else np.empty(0, np.float32)
        self.pen_rows = np.flatnonzero(flags & PENALTIES)
        self.rows = rows
        if self.pen_rows.size:
            pen = np.empty((self.pen_rows.size, 3), dtype=np.float32)
            pen[:, 0] = recs["repetition"][self.pen_rows]
            pen[:, 1] = recs["frequency"][self.pen_rows]
            pen[:, 2] = recs["presence"][self.pen_rows]
            self.pen = pen
            self.any_rep = bool((pen[:, 0] != 1.0).any())
            self.any_freq = bool((pen[:, 1:] != 0).any())

    def add_to(self, up: Upload, device: torch.device) -> None:
        """Plan the penalty counts (on ``device``'s pool) and register every array with ``up``.

        With penalties this takes the pool's lock, which `apply` (or `release`) gives back: call
        ``up.send`` and `apply` right after, and `release` if anything in between raises."""
        self._h = [up.add(a) for a in (self.ban_keys, self.allowed, self.allowed_keys, self.bias_keys,
                                       self.bias_vals)]
        if self.pen_rows.size:
            self.pool = token_counts(device, self.V)
            self.pool.lock.acquire()  # released by `apply`
            self._held = True
            try:
                slots, clear, marks, adds = self.pool.plan(self.rows, self.pen_rows)
                self._h += [up.add(a) for a in (self.pen_rows, slots, self.pen, clear, marks, adds,
                                                np.full(adds.size, 2, dtype=np.int32))]
            except BaseException:
                self.release()
                raise

    def apply(self, logits: torch.Tensor, t: list[torch.Tensor], use_triton: bool = False) -> torch.Tensor:
        """Apply the transforms to ``logits`` ([S, V], modified in place and returned); ``t`` is the
        sent upload. ``use_triton``: penalties through `kvpilot.kernels.sampling.apply_penalties`."""
        try:
            x = logits if logits.is_contiguous() else logits.contiguous()
            self._masks_and_bias(x, t)
            if self.pen_rows.size:
                rows, slots, pen, clear, marks, adds, twos = (t[h] for h in self._h[5:])
                self.pool.update(clear, marks, adds, twos)
                if use_triton and x.dtype == torch.float32:
                    from kvpilot.kernels import sampling as ksampling

                    ksampling.apply_penalties(x, rows, slots, self.pool.counts, pen, self.any_rep, self.any_freq)
                else:
                    _penalties_torch(x, rows, slots, self.pool.counts, pen, self.any_rep, self.any_freq)
        except BaseException:
            self.release()
            raise
        if self._held:
            self._held = False
            self.pool.lock.release()
        if x is not logits:
            logits.copy_(x)
        return logits

    def release(self) -> None:
        """After a failure between `add_to` and the end of `apply`: give back the pool's lock (if
        still held), and make the penalty rows count from scratch next time (their counts may be
        partly updated), each in the slot it holds (dropping ``_counts`` would leave that slot
        owned by the live row, unusable until the row dies). Safe to call more than once."""
        if self.pen_rows.size:
            for i in self.pen_rows:
                r = self.rows[i]
                st = r._counts
                if st is not None:
                    r._counts = (st[0], st[1], 0, None, _RECOUNT)
        if self._held:
            self._held = False
            self.pool.lock.release()

    def _masks_and_bias(self, x: torch.Tensor, t: list[torch.Tensor]) -> None:
        ban_keys, allowed, allowed_keys, bias_keys, bias_vals = (t[h] for h in self._h[:5])
        S, V = x.shape
        flat = x.view(-1)
        if self.allowed.size:
            A = self.allowed.size
            keep = torch.zeros(A * V, dtype=torch.bool, device=x.device)
            keep.index_fill_(0, allowed_keys, True)
            keep = keep.view(A, V)
            if A == S:
                x.masked_fill_(~keep, float("-inf"))
            else:
                x[allowed] = x[allowed].masked_fill_(~keep, float("-inf"))
        if self.ban_keys.size:
            flat.index_fill_(0, ban_keys, float("-inf"))
        if self.bias_keys.size:
            flat.index_add_(0, bias_keys, bias_vals.to(x.dtype))


def _penalized_values(v: torch.Tensor, c: torch.Tensor, pen: torch.Tensor, rep: bool, freq: bool) -> torch.Tensor:
    """The penalties of logits ``v`` with counts ``c`` (same shape) and per-element ``pen`` columns
    (broadcastable: repetition, frequency, presence as ``pen[..., 0:1]`` etc.)."""
    if rep:
        r = pen[..., 0:1].to(v.dtype)
        v = torch.where(c > 0, torch.where(v > 0, v / r, v * r), v)
    if freq:
        n = c >> 1
        v = torch.where(n > 0, v - (pen[..., 1:2] * n + pen[..., 2:3]).to(v.dtype), v)
    return v


def _penalties_torch(x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                     pen: torch.Tensor, rep: bool, freq: bool, dense: Optional[bool] = None) -> None:
    """The penalties in PyTorch (the reference of the Triton kernel, which it equals bit for bit).

    x [S, V] (in place); rows, slots [P] int64; counts [slots, V] int32; pen [P, 3] float32:
    repetition, frequency, presence. Only tokens with a count change: ``x / rep`` or ``x * rep``
    where seen, then ``x - (frequency * n + presence)`` where the output holds them n > 0 times.
    ``dense`` (default: on CUDA) works on whole rows (no host synchronisation); otherwise only the
    tokens with a count are gathered (``nonzero``), which is far less work on a CPU.
    """
    V = x.shape[1]
    c = counts.index_select(0, slots)
    if x.is_cuda if dense is None else dense:
        whole = rows.numel() == x.shape[0]
        sub = _penalized_values(x if whole else x.index_select(0, rows), c, pen, rep, freq)
        if whole:
            x.copy_(sub)
        else:
            x.index_copy_(0, rows, sub)
        return
    cflat = c.view(-1)
    pos = cflat.nonzero().squeeze(1)
    p = pos // V
    at = rows.index_select(0, p) * V + (pos - p * V)
    flat = x.view(-1)
    v = _penalized_values(flat.index_select(0, at)[:, None], cflat.index_select(0, pos)[:, None],
                          pen.index_select(0, p), rep, freq)
    flat.index_copy_(0, at, v.squeeze(1))


def apply_penalties_and_masks(logits: torch.Tensor, rows: list[SamplingRow], use_triton: bool = False) -> torch.Tensor:
    """Forbidden tokens, logit bias and repetition/frequency/presence penalties, in place on [S, V].

    Args:
        logits: [S, V] float (float32 in the engine), one row per entry of ``rows``; modified in
            place and returned.
        rows: the `SamplingRow` of each logits row. Token ids outside [0, V) are ignored.
        use_triton: penalties through the Triton kernel (float32 logits on CUDA, or CPU tensors
            under TRITON_INTERPRET=1); same values as the PyTorch path.
    Semantics and order: the module docstring. Raises ValueError when the numbers of rows differ.
    """
    S, V = logits.shape
    if S != len(rows):
        raise ValueError(f"got {S} logits rows for {len(rows)} sampling rows")
    proc = Processing(rows, V, records(rows))
    if proc.empty:
        return logits
    up = Upload()
    proc.add_to(up, logits.device)
    try:
        t = up.send(logits.device)
    except BaseException:
        proc.release()
        raise
    return proc.apply(logits, t, use_triton)
