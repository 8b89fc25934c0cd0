"""Batched sampling: logits processors, then greedy or seeded random choice, for all rows at once.

Order of the transforms (Hugging Face `generate`'s order, so each can be checked against its
logits processors): forbidden tokens (``min_tokens``, ``bad_words``, ``allowed_token_ids``), logit
bias, repetition penalty (HF: over prompt and output tokens; positive logits divided, negative
multiplied), frequency/presence penalties (OpenAI: output tokens only,
``logit -= frequency * count + presence * (count > 0)``), then temperature, top-k, top-p, min-p.
Every transform is one tensor operation over the whole batch: ragged per-row lists (token ids,
biases) become padded index tensors whose padding points at an extra scratch column.

Randomness is a counter-based hash of (request seed, output position, token id) turned into Gumbel
noise, so a row's draw never depends on what else is in the batch (same seed, same text), and no
per-row generator state has to live anywhere: ``argmax(logits / T + Gumbel)`` samples from
``softmax(logits / T)`` (the Gumbel-max trick). Because the noise of a token depends only on its
id, the draw can be made among any candidate set that holds the kept tokens, with the result of the
whole vocabulary.

Exact semantics of the filters (what every path computes, `_draw_exact` being the reference):
tokens are ranked by value, ties by lower token id; top-k keeps ranks < k; top-p keeps rank 0 and
every token whose mass strictly above it (within the top-k) is below ``top_p`` of the top-k's mass;
min-p keeps values >= max + log(min_p). Masses are the integers ``floor(exp(z - max) * 2**44)``
(``z = logits / T``), summed exactly, so no path's decision depends on summation order; the
comparison is ``float64(mass above) < float64(top_p) * float64(total)``. The draw is the arg-max of
``z + G`` over kept tokens, ties by lower id.

Paths: on CUDA with Triton and ``KVPILOT_TRITON_SAMPLER=1`` (opt-in until measured on a GPU),
`kvpilot.kernels.sampling` draws every row without sorting and without ``[rows, V]`` temporaries;
elsewhere plain rows add the full noise and filtered rows first try
the best ``_TOPK_CANDIDATES_MAX`` tokens (exact when they provably hold the kept set). Rows neither
settles fall back to `_draw_exact` (a stable full sort).

Log-probabilities are taken from the unmodified distribution (``log_softmax`` of the raw logits),
as vLLM's default and OpenAI's API do, so top-p/top-k never shrink the ``logprobs`` lists.
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)

_M32 = 0xFFFFFFFF
# Rows whose top_k is at most this take their candidates from torch.topk instead of a full sort.
_TOPK_CANDIDATES_MAX = 1024
# Token masses are floor(exp(z - max) * 2**44) (kvpilot.kernels.sampling uses the same constants);
# tokens more than _ZERO_DEPTH below the max have mass 0 and can never win (the noise spans < 20.2).
_Q_SCALE = 2.0 ** 44
_ZERO_DEPTH = 31.5
_NO_ID = torch.iinfo(torch.int64).max
# Up to this many top logprobs the Triton path extracts them per vocabulary chunk (else torch.topk).
_TRITON_LOGPROBS_MAX = 32



@dataclass
class SamplingRow:
    """Plain per-row inputs of the sampler (one row = one sequence that samples this step)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    step: int = 0  # output position of the token being drawn
    logprobs: Optional[int] = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    prompt_token_ids: Optional[list[int]] = None  # only when repetition_penalty != 1
    output_token_ids: list[int] = field(default_factory=list)
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    banned_token_ids: list[int] = field(default_factory=list)
    bad_word_seqs: list[list[int]] = field(default_factory=list)
    # Penalty history as device tensors, kept across steps when the engine reuses the row of a
    # sequence (its output only grows): prompt ids once, output ids appended as they come.
    _prompt_t: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    _out_t: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    def history(self, dev: torch.device) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """(prompt ids, output ids) as int64 tensors on ``dev``, updated with the new output ids."""
        if self._out_t is not None and self._out_t.device != dev:
            # Logits can arrive on another device than last step (the multi-process executor
            # returns large batches through a pipe, on the CPU): rebuild there.
            self._prompt_t = self._out_t = None
        if self._prompt_t is None and self.prompt_token_ids is not None:
            self._prompt_t = torch.tensor(self.prompt_token_ids, dtype=torch.int64).to(dev, non_blocking=True)
        have = 0 if self._out_t is None else self._out_t.numel()
        if self._out_t is None or have > len(self.output_token_ids):
            self._out_t = torch.tensor(self.output_token_ids, dtype=torch.int64).to(dev, non_blocking=True)
        elif have < len(self.output_token_ids):
            new = torch.tensor(self.output_token_ids[have:], dtype=torch.int64).to(dev, non_blocking=True)
            self._out_t = torch.cat([self._out_t, new])
        return self._prompt_t, self._out_t

    @property
    def needs_processing(self) -> bool:
        return bool(self.allowed_token_ids is not None or self.banned_token_ids or self.bad_word_seqs
                    or self.logit_bias or self.repetition_penalty != 1.0 or self.frequency_penalty
                    or self.presence_penalty)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Optional[float]]  # log-probability of each chosen token (raw distribution)
    top_logprobs: list[Optional[tuple[list[int], list[float], int]]]  # (ids, logprobs, chosen rank)


# ---- counter-based random numbers --------------------------------------------------------------
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), without int64 overflow."""
    lo = (x * (c & 0xFFFF)) & _M32
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (the "lowbias32" mixer), elementwise on int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from (seed, step): [rows] int64 in [0, 2**32)."""
    s = seeds.to(torch.int64)
    lo, hi = s & _M32, (s >> 32) & _M32
    return _hash32(_hash32(lo) ^ _mul32(steps.to(torch.int64) & _M32, 0x9E3779B1) ^ _hash32(hi ^ 0x5BD1E995))


def _gumbel_from_keys(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) float32 for each (row key, token id); keys [rows], token_ids [rows or 1, K]."""
    bits = _hash32((keys[:, None] + _mul32(token_ids.to(torch.int64), 0x85EBCA77)) & _M32)
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1)
    return -torch.log(-torch.log(u))


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int,
                 token_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Gumbel(0, 1) noise, a pure function of (seed, step, token id); float32.

    Args:
        seeds: [rows] int64 (any 64-bit value); steps: [rows] int64 >= 0.
        vocab_size: V; the result is ``[rows, V]`` (noise of token ids 0..V-1) unless ``token_ids``.
        token_ids: optional [rows, K] int64: the result is ``[rows, K]``, the noise of those ids
            (equal to the matching columns of the full ``[rows, V]`` noise).
    On CUDA the full-vocabulary case runs as one Triton kernel (same bits as the PyTorch version).
    """
    keys = _row_keys(seeds, steps)
    if token_ids is None:
        return _full_noise(keys, vocab_size)
    return _gumbel_from_keys(keys, token_ids)


@functools.lru_cache(maxsize=None)
def _triton_gumbel():
    """The full-vocabulary noise as a Triton kernel (uint32 arithmetic wraps natively), or None."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _kernel(keys_ptr, out_ptr, V, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        key = tl.load(keys_ptr + row).to(tl.uint32)
        x = key + cols.to(tl.uint32) * 0x85EBCA77
        # lowbias32, as _hash32 (the interpreter does not resolve helper functions from a closure)
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        bits = x ^ (x >> 16)
        u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        g = -tl.log(-tl.log(u))
        tl.store(out_ptr + row.to(tl.int64) * V + cols, g, mask=cols < V)

    def run(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
        out = torch.empty(keys.shape[0], vocab_size, device=keys.device, dtype=torch.float32)
        if keys.shape[0]:
            block = 1024
            _kernel[(keys.shape[0], triton.cdiv(vocab_size, block))](keys, out, vocab_size, BLOCK=block)
        return out

    return run


# ---- logits processors -------------------------------------------------------------------------
def _padded(lists: list[list[int]], vocab_size: int, dev: torch.device) -> torch.Tensor:
    """[rows, max_len] int64 of the ragged lists; padding and ids outside [0, V) become V."""
    lens = [len(x) for x in lists]
    width = max(max(lens, default=0), 1)
    out = torch.full((len(lists), width), vocab_size, dtype=torch.int64)
    flat = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.int64)
    if flat.numel():
        out[torch.arange(width)[None, :] < torch.tensor(lens)[:, None]] = flat
        out.masked_fill_((out < 0) | (out > vocab_size), vocab_size)
    return out.to(dev, non_blocking=True)


def _bad_word_bans(r: SamplingRow) -> list[int]:
    out = list(r.banned_token_ids)
    for seq in r.bad_word_seqs:
        prefix = seq[:-1]
        if not prefix or r.output_token_ids[-len(prefix):] == prefix:
            out.append(seq[-1])
    return out


def apply_penalties_and_masks(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Forbidden tokens, logit bias and repetition/frequency/presence penalties, in place on [S, V].

    Token ids >= V are ignored. Each kind is one scatter over the batch (padding hits column V of a
    [S, V + 1] scratch tensor, which is dropped).
    """
    S, V = logits.shape
    dev = logits.device

    def clip(ids):
        return [t for t in ids if 0 <= t < V]

    allowed = [r.allowed_token_ids is not None for r in rows]
    if any(allowed):
        ids = _padded([r.allowed_token_ids if a else [] for r, a in zip(rows, allowed)], V, dev)
        keep = torch.zeros(S, V + 1, dtype=torch.bool, device=dev).scatter_(1, ids, True)[:, :V]
        keep |= ~torch.tensor(allowed, device=dev)[:, None]
        logits.masked_fill_(~keep, float("-inf"))
    banned = [_bad_word_bans(r) for r in rows]
    if any(banned):
        mask = torch.zeros(S, V + 1, dtype=torch.bool, device=dev).scatter_(1, _padded(banned, V, dev), True)
        logits.masked_fill_(mask[:, :V], float("-inf"))
    if any(r.logit_bias for r in rows):
        keys = [clip(r.logit_bias or {}) for r in rows]
        vals = torch.zeros(S, max(max(len(k) for k in keys), 1), dtype=logits.dtype)
        for i, (r, k) in enumerate(zip(rows, keys)):
            if k:
                vals[i, :len(k)] = torch.tensor([r.logit_bias[t] for t in k], dtype=logits.dtype)
        bias = torch.zeros(S, V + 1, dtype=logits.dtype, device=dev)
        bias.scatter_add_(1, _padded(keys, V, dev), vals.to(dev))
        logits += bias[:, :V]
    pen_rows = [i for i, r in enumerate(rows)
                if r.repetition_penalty != 1.0 or r.frequency_penalty or r.presence_penalty]
    if pen_rows:
        _apply_history_penalties(logits, rows, pen_rows)
    return logits


def _apply_history_penalties(logits: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> None:
    """Repetition (HF: over prompt and output) and frequency/presence (OpenAI: output only) penalties.

    Sparse: only the (row, token) pairs of the rows' histories are touched, through flat indices
    ``row * V + token`` into ``logits`` ([S, V], modified in place); no [S, V] temporaries.
    """
    S, V = logits.shape
    dev = logits.device
    if not logits.is_contiguous():
        raise ValueError("penalties are applied in place through a flat view: logits must be contiguous")
    flat = logits.view(-1)
    prompts, outs = zip(*(rows[i].history(dev) for i in idx))

    def keys(tensors) -> torch.Tensor:
        lens = torch.tensor([0 if t is None else t.numel() for t in tensors], device=dev)
        ids = torch.cat([t for t in tensors if t is not None] or [torch.empty(0, dtype=torch.int64, device=dev)])
        row = torch.repeat_interleave(torch.tensor(idx, device=dev), lens)
        ok = (ids >= 0) & (ids < V)
        return (row * V + ids)[ok]

    out_keys = keys(outs)
    rep = [rows[i].repetition_penalty for i in idx]
    if any(p != 1.0 for p in rep):
        seen = torch.unique(torch.cat([keys([p if rows[i].repetition_penalty != 1.0 else None
                                             for i, p in zip(idx, prompts)]), out_keys]))
        pen = torch.tensor([r.repetition_penalty for r in rows], dtype=logits.dtype, device=dev)[seen // V]
        vals = flat[seen]
        flat[seen] = torch.where(vals > 0, vals / pen, vals * pen)
    if out_keys.numel() and any(rows[i].frequency_penalty or rows[i].presence_penalty for i in idx):
        uniq, counts = torch.unique(out_keys, return_counts=True)
        r = uniq // V
        freq = torch.tensor([x.frequency_penalty for x in rows], dtype=logits.dtype, device=dev)[r]
        pres = torch.tensor([x.presence_penalty for x in rows], dtype=logits.dtype, device=dev)[r]
        flat.index_add_(0, uniq, -(freq * counts.to(logits.dtype) + pres))


def _log_min_p(min_p: torch.Tensor) -> torch.Tensor:
    """[S] float32: log(min_p) where min_p > 0, -inf (filter off) elsewhere."""
    mp = min_p.float()
    return torch.where(mp > 0, torch.log(mp.clamp(min=1e-30)), torch.full_like(mp, float("-inf")))


def _masses(values: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """[S, K] int64 fixed-point masses floor(exp(values - max) * 2**44) (0 for -inf values)."""
    d = torch.where(values > float("-inf"), values - row_max[:, None], float("-inf"))
    return (torch.exp(d) * _Q_SCALE).to(torch.int64)


def _kept_sorted(values: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, log_min_p: torch.Tensor,
                 topk_mass: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Kept mask [S, K] of rows sorted by value (desc), ties by id (asc); see the module docstring.

    ``topk_mass`` [S] int64 overrides the top-k's total mass (needed when K < V); by default it is
    summed from ``values`` (full rows).
    """
    K = values.shape[1]
    rank = torch.arange(K, device=values.device)[None, :]
    intop = rank < torch.where(top_k > 0, top_k, torch.full_like(top_k, K + 1))[:, None]
    q = _masses(values, values[:, 0]).masked_fill_(~intop, 0)
    csum = q.cumsum(dim=-1)
    total = csum[:, -1] if topk_mass is None else topk_mass
    p = top_p.to(torch.float64)
    keep_p = ((csum - q).to(torch.float64) < (p * total.to(torch.float64))[:, None]) | (rank == 0) | (p >= 1)[:, None]
    keep_m = values >= (values[:, 0] + log_min_p)[:, None]
    return intop & keep_p & keep_m


def mask_sorted_candidates(values: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                           min_p: torch.Tensor) -> torch.Tensor:
    """Top-k, top-p and min-p on full rows sorted in descending order; returns masked ``values``.

    Args:
        values: [S, V] float32 logits already divided by the temperature, each row sorted
            descending with ties in ascending token id order (``torch.sort(stable=True)``).
        top_k: [S] int64 (<= 0 = off); top_p: [S] float32 (1 = off); min_p: [S] float32 (0 = off).
    Semantics of Hugging Face's TopK/TopP/MinP logits warpers, applied in that order: top-p keeps
    the smallest prefix whose probability reaches ``top_p`` (a token is dropped when the mass
    strictly above it already reaches ``top_p``), min-p drops tokens whose probability is below
    ``min_p`` times the largest; the best token always survives. Ties at the k-th value are cut by
    token id (HF keeps every token equal to the k-th value). Masses are exact fixed-point sums
    (module docstring), where HF sums float32 probabilities.
    """
    return values.masked_fill(~_kept_sorted(values, top_k, top_p, _log_min_p(min_p)), float("-inf"))


def top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      min_p: torch.Tensor) -> torch.Tensor:
    """Mask ([S, V] float32, already divided by temperature) to -inf outside top-k, top-p, min-p.

    Full-vocabulary form of `mask_sorted_candidates` (same arguments and semantics), for callers
    and tests that want the masked logits in vocabulary order.
    """
    values, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    masked = mask_sorted_candidates(values, top_k, top_p, min_p)
    return torch.empty_like(logits).scatter_(1, order, masked)


# ---- the draw ---------------------------------------------------------------------------------
def _argmax_lowest_id(y: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[S] int64: the id of each row's largest ``y``; ties -> the lowest id (vocabulary order)."""
    best = y.max(dim=-1, keepdim=True).values
    return torch.where(y == best, ids, _NO_ID).min(dim=-1).values


def _draw_exact(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, log_min_p: torch.Tensor,
                keys: torch.Tensor) -> torch.Tensor:
    """The reference draw of filtered rows: stable full sort, exact masks, Gumbel-max; [S] int64.

    z: [S, V] float32 logits / temperature; top_k [S] int64 (0 = off), top_p [S] float32,
    log_min_p [S] float32 (-inf = off), keys [S] int64 row keys (`_row_keys`).
    """
    values, order = torch.sort(z, dim=-1, descending=True, stable=True)
    kept = _kept_sorted(values, top_k, top_p, log_min_p)
    y = torch.where(kept, values + _gumbel_from_keys(keys, order), float("-inf"))
    return _argmax_lowest_id(y, order)


def _draw_candidates(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, log_min_p: torch.Tensor,
                     keys: torch.Tensor, kc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draw among each row's best ``kc`` tokens: (tokens [S] int64, exact [S] bool).

    The candidates with a value above the kc-th value are a prefix of the row's ranking (ties at the
    kc-th value may be split by topk). A row is exact when its kept set lies inside that prefix and
    its top-k mass is known: top_k fits, or the prefix already holds top_p of the mass, or every
    token after it fails min-p, or has mass 0 (the whole row when kc == V).
    """
    S, V = z.shape
    row_max = z.max(dim=-1).values
    values, ids = z.topk(kc, dim=-1)
    ids, perm = ids.sort(dim=-1)  # canonical order: value desc, then id asc
    values, perm = values.gather(1, perm).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, perm)
    rank = torch.arange(kc, device=z.device)[None, :]
    if kc < V:
        last = values[:, -1]
        n = (values > last[:, None]).sum(dim=-1)
        deep = last < row_max - _ZERO_DEPTH
        past_min_p = last < row_max + log_min_p
    else:
        n = torch.full_like(top_k, V)
        deep = past_min_p = torch.ones_like(top_k, dtype=torch.bool)
    k_on = top_k > 0
    intop = (rank < n[:, None]) & (rank < torch.where(k_on, top_k, torch.full_like(top_k, V + 1))[:, None])
    prefix_mass = _masses(values, row_max).masked_fill_(~intop, 0).sum(dim=-1)
    k_fits = k_on & (top_k <= n)
    mass_known = ~k_on | k_fits | deep
    total = torch.where(k_on, prefix_mass, _masses(z, row_max).sum(dim=-1))
    reached = prefix_mass.to(torch.float64) >= top_p.to(torch.float64) * total.to(torch.float64)
    exact = (n > 0) & (mass_known | (top_p >= 1)) & (k_fits | ((top_p < 1) & reached) | past_min_p | deep)
    kept = _kept_sorted(values, torch.where(k_on, torch.minimum(top_k, n), n), top_p, log_min_p, total)
    y = torch.where(kept, values + _gumbel_from_keys(keys, ids), float("-inf"))
    return _argmax_lowest_id(y, ids), exact


_FLOAT_FIELDS = operator.attrgetter("temperature", "top_p", "min_p")
_INT_FIELDS = operator.attrgetter("top_k", "seed", "step")


class _Draw:
    """Per-row draw parameters of one sampler call, gathered from the rows once (host side).

    ``fprm`` [S, 4] float32: temperature, top_p, log(min_p) (-inf = off), 0. ``iprm`` [S, 4]
    int64: top_k (0 = off), seed, step, 0. ``order`` [S] int64: the rows plain + greedy + filtered
    (for the kernels); iprm and order travel in one host->device copy. top_k >= V is off, and
    top_p <= 0 becomes top_k 1 (both keep only the best token).
    """

    def __init__(self, rows: list[SamplingRow], V: int):
        S = len(rows)
        f = np.fromiter(itertools.chain.from_iterable(map(_FLOAT_FIELDS, rows)), np.float32, 3 * S).reshape(S, 3)
        ints = np.zeros(5 * S, dtype=np.int64)
        iprm = ints[:4 * S].reshape(S, 4)
        iprm[:, :3] = np.fromiter(itertools.chain.from_iterable(map(_INT_FIELDS, rows)), np.int64,
                                  3 * S).reshape(S, 3)
        temp, top_p, min_p, top_k = f[:, 0], f[:, 1], f[:, 2], iprm[:, 0]
        top_k[(top_k < 0) | (top_k >= V)] = 0
        p_off = top_p <= 0
        top_k[p_off], top_p[p_off] = 1, 1.0
        greedy = temp == 0
        filt = ~greedy & ((top_k > 0) | (top_p < 1) | (min_p > 0))
        self.greedy = np.flatnonzero(greedy).tolist()
        self.filt = np.flatnonzero(filt).tolist()
        self.plain = np.flatnonzero(~greedy & ~filt).tolist()
        self.ks = top_k.tolist()
        ints[4 * S:] = self.plain + self.greedy + self.filt
        fl = torch.zeros(S, 4)
        fl[:, :3] = torch.from_numpy(f)
        if bool((min_p > 0).any()):
            fl[:, 2] = _log_min_p(fl[:, 2])
        else:
            fl[:, 2] = float("-inf")
        self._fl, self._ints = fl, torch.from_numpy(ints)

    def tensors(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(fprm, iprm, order) on ``dev`` (see the class docstring)."""
        S = self._fl.shape[0]
        ints = self._ints.to(dev, non_blocking=True)
        return self._fl.to(dev, non_blocking=True), ints[:4 * S].view(S, 4), ints[4 * S:]


def _sub(t: torch.Tensor, idx: list[int], S: int):
    """``t[idx]`` (a copy), or ``t`` itself when idx covers every row in order."""
    return t if len(idx) == S else t[torch.tensor(idx, device=t.device)]


# ---- the sampler ----------------------------------------------------------------------------
def triton_sampler_enabled() -> bool:
    """``KVPILOT_TRITON_SAMPLER`` (default 0): 1 makes the "auto" backend use the sort-free Triton
    kernels on CUDA. They are checked against the exact path on CPU under ``TRITON_INTERPRET=1`` but
    have not yet run on a GPU, so the PyTorch path stays the default until they are measured there."""
    return os.environ.get("KVPILOT_TRITON_SAMPLER", "0") in ("1", "true", "True", "yes")


class Sampler:
    """Chooses the next token of every row of a ``[S, V]`` float32 logits matrix.

    Greedy rows (temperature 0) take the arg-max of the processed logits (ties: lowest id); the
    others draw by Gumbel-max under the exact semantics of the module docstring. ``backend``:
    "auto" (Triton kernels on CUDA when Triton imports and `triton_sampler_enabled`, else PyTorch),
    "triton" (also CPU tensors under TRITON_INTERPRET=1), "torch" (the candidate path), or "exact"
    (`_draw_exact` for every filtered row). All backends choose the same tokens. Raises ValueError when the number of rows
    and of logits rows differ, or for an unknown backend.
    """

    BACKENDS = ("auto", "triton", "torch", "exact")

    def __init__(self, backend: str = "auto"):
        if backend not in self.BACKENDS:
            raise ValueError(f"unknown sampler backend {backend!r}; expected one of {self.BACKENDS}")
        self.backend = backend
        self.exact_rows = 0  # filtered rows the fast paths handed to `_draw_exact` (all calls)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        S, V = logits.shape
        if S != len(rows):
            raise ValueError(f"got {S} logits rows for {len(rows)} sampling rows")
        raw = logits
        if any(r.needs_processing for r in rows):
            logits = apply_penalties_and_masks(logits.clone(), rows)
        token_ids = self.choose(logits, rows)
        logprobs: list[Optional[float]] = [None] * S
        top: list[Optional[tuple[list[int], list[float], int]]] = [None] * S
        lp_rows = [i for i, r in enumerate(rows) if r.logprobs is not None]
        if lp_rows:
            kmax = min(max(rows[i].logprobs for i in lp_rows), V)
            chosen = [token_ids[i] for i in lp_rows]
            if self._use_triton(raw) and raw.stride(1) == 1 and kmax <= _TRITON_LOGPROBS_MAX:
                from .kernels import sampling as ksampling

                idx = torch.tensor([lp_rows, chosen], dtype=torch.int64).to(raw.device, non_blocking=True)
                packed = torch.cat([t.double().reshape(len(lp_rows), -1)
                                    for t in ksampling.raw_logprobs(raw, idx[0], idx[1], kmax)], dim=1).tolist()
                chosen_lp = [r[0] for r in packed]
                ranks = [int(r[1]) for r in packed]
                top_vals = [r[2:2 + kmax] for r in packed]
                top_ids = [[int(t) for t in r[2 + kmax:]] for r in packed]
            else:
                chosen_lp, ranks, top_vals, top_ids = _raw_logprobs(_sub(raw, lp_rows, S), chosen, kmax)
            for j, i in enumerate(lp_rows):
                k = rows[i].logprobs
                logprobs[i] = chosen_lp[j]
                top[i] = (top_ids[j][:k], top_vals[j][:k], ranks[j])
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top)

    def choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """Token id per row of ``logits`` ([S, V], already processed), as a host list."""
        S, V = logits.shape
        if all(r.temperature == 0.0 for r in rows):
            return logits.argmax(dim=-1).tolist()
        d = _Draw(rows, V)
        fprm, iprm, order = d.tensors(logits.device)
        if self._use_triton(logits):
            from .kernels import sampling as ksampling

            n_plain = len(d.plain) + len(d.greedy)
            out = ksampling.draw(logits, fprm, iprm, order[:n_plain], order[n_plain:])
            tokens = out.tolist()
            redo = [i for i in d.filt if tokens[i] < 0]
            if redo:
                self.exact_rows += len(redo)
                logger.debug("sampler: %d of %d filtered rows drawn by the exact path", len(redo), len(d.filt))
                for i, t in zip(redo, self._filtered(logits, fprm, iprm, redo, d.ks, exact=True).tolist()):
                    tokens[i] = t
            return tokens
        out = torch.empty(S, dtype=torch.int64, device=logits.device)
        if d.greedy:
            out[_index(d.greedy, S, logits.device)] = _sub(logits, d.greedy, S).argmax(dim=-1)
        if d.plain:
            sel = _index(d.plain, S, logits.device)
            z = _sub(logits, d.plain, S).float() / fprm[sel, 0][:, None]
            keys = _row_keys(iprm[sel, 1], iprm[sel, 2])
            out[sel] = (z + _full_noise(keys, V)).argmax(dim=-1)
        if d.filt:
            out[_index(d.filt, S, logits.device)] = self._filtered(logits, fprm, iprm, d.filt, d.ks,
                                                                   exact=self.backend == "exact", stats=self)
        return out.tolist()

    def _use_triton(self, logits: torch.Tensor) -> bool:
        if self.backend == "triton":
            return True
        if self.backend != "auto" or not logits.is_cuda or not triton_sampler_enabled():
            return False
        from .kernels import triton_available

        return triton_available()

    @staticmethod
    def _filtered(logits: torch.Tensor, fprm: torch.Tensor, iprm: torch.Tensor, idx: list[int],
                  all_ks: list[int], exact: bool, stats: Optional["Sampler"] = None) -> torch.Tensor:
        """Draw rows ``idx`` (all with temperature > 0 and a filter) in PyTorch; [len(idx)] int64."""
        S, V = logits.shape
        sel = _index(idx, S, logits.device)
        z = _sub(logits, idx, S).float() / fprm[sel, 0][:, None]
        top_k, top_p, log_min_p = iprm[sel, 0], fprm[sel, 1], fprm[sel, 2]
        keys = _row_keys(iprm[sel, 1], iprm[sel, 2])
        if exact:
            return _draw_exact(z, top_k, top_p, log_min_p, keys)
        ks = [all_ks[i] for i in idx]
        # one candidate more than the largest top_k: the prefix above the last candidate's value
        # then still holds k tokens unless values tie there
        kc = min(V, max(ks) + 1 if all(0 < k <= _TOPK_CANDIDATES_MAX for k in ks) else _TOPK_CANDIDATES_MAX)
        tokens, ok = _draw_candidates(z, top_k, top_p, log_min_p, keys, kc)
        if not bool(ok.all()):  # rare (flat distributions): sort these rows' whole vocabulary
            bad = (~ok).nonzero().squeeze(1)
            if stats is not None:
                stats.exact_rows += bad.numel()
            tokens[bad] = _draw_exact(z[bad], top_k[bad], top_p[bad], log_min_p[bad], keys[bad])
        return tokens


def _index(idx: list[int], S: int, dev: torch.device):
    return slice(None) if len(idx) == S else torch.tensor(idx, device=dev)


def _raw_logprobs(raw: torch.Tensor, chosen: list[int], kmax: int):
    """Log-probabilities of the raw distribution for rows ``raw`` ([R, V]) and their chosen ids.

    Returns host lists: chosen token's logprob [R], its rank (1 + number of tokens with a larger
    logit) [R], and the top ``kmax`` (logprobs, ids) [R][kmax].
    """
    x = raw.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    xc = x.gather(1, torch.tensor(chosen, device=x.device)[:, None])
    ranks = ((x > xc).sum(dim=-1) + 1).tolist()
    if kmax > 0:
        vals, ids = x.topk(kmax, dim=-1)
        top_vals, top_ids = (vals - lse).tolist(), ids.tolist()
    else:
        top_vals = top_ids = [[] for _ in chosen]
    return (xc - lse).squeeze(1).tolist(), ranks, top_vals, top_ids


def _full_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel noise [rows, V] for row keys (Triton on CUDA, PyTorch elsewhere)."""
    if keys.is_cuda and _triton_gumbel() is not None:
        return _triton_gumbel()(keys, vocab_size)
    return _gumbel_from_keys(keys, torch.arange(vocab_size, device=keys.device, dtype=torch.int64)[None, :])
