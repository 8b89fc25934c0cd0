"""Batched sampling: logits processors, then greedy or seeded random choice, for all rows at once.

Order of the transforms (Hugging Face `generate`'s order, so each can be checked against its
logits processors): forbidden tokens (``min_tokens``, ``bad_words``, ``allowed_token_ids``), logit
bias, repetition penalty (HF: over prompt and output tokens; positive logits divided, negative
multiplied), frequency/presence penalties (OpenAI: output tokens only,
``logit -= frequency * count + presence * (count > 0)``), then temperature, top-k, top-p, min-p.
The first four are `kvpilot.sampling.logits_processors` (a few batched operations each, penalties from
per-sequence token counts kept on the device).
Rows with a grammar (structured output) then get its token mask (`kvpilot.sampling.guided.apply_guides`:
forbidden tokens -inf) before temperature and the filters.

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

Paths: on CUDA with Triton (the default; ``Tuning(triton_sampler=False)`` turns it off),
`kvpilot.kernels.sampling` draws every row without sorting and without ``[rows, V]`` temporaries
(rows with top-k through a window around the kept prefix's end; rows with only top-p/min-p by
testing Gumbel-max candidates for membership, which needs no boundary at all: ``_Draw`` puts
those last, and the kernels get their count); elsewhere plain rows add the full noise and
filtered rows first try the best ``_TOPK_CANDIDATES_MAX`` tokens (exact when they provably hold
the kept set). Rows neither settles fall back to `_draw_exact` (a stable full sort).

Log-probabilities are taken from the unmodified distribution (``log_softmax`` of the raw logits),
as vLLM's default and OpenAI's API do, so top-p/top-k never shrink the ``logprobs`` lists.

Host work per call (it, not the kernels, sets the sampler's cost at serving batch sizes): the rows'
fixed parameters are cached packed records (`kvpilot.sampling.sampler_inputs`), every index and parameter
array goes to the device in one pinned non-blocking copy, and nothing reads the device until the
one read of the results (`Sampler.launch` queues everything, `_Pending.finish` reads). Rows a
fast path could not settle exactly come back as -1 and are drawn again by `_draw_exact` then.
"""

from __future__ import annotations

import functools
import logging
import operator
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from kvpilot.sampling.guided import apply_guides
from kvpilot.sampling.logits_processors import Processing, apply_penalties_and_masks
from kvpilot.sampling.sampler_inputs import SamplingRow, Upload, records, to_host

__all__ = ["Sampler", "SamplerOutput", "SamplingRow", "apply_penalties_and_masks", "greedy_ids", "gumbel_noise",
           "mask_sorted_candidates", "top_k_top_p_min_p"]

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


def _row_keys_host(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """`_row_keys` on the host (numpy, the same bits): [rows] int64 in [0, 2**32)."""
    m = np.uint64(_M32)

    def h(x):
        x = x ^ (x >> np.uint64(16))
        x = (x * np.uint64(0x7FEB352D)) & m
        x = x ^ (x >> np.uint64(15))
        x = (x * np.uint64(0x846CA68B)) & m
        return x ^ (x >> np.uint64(16))

    s = seeds.astype(np.int64).view(np.uint64)
    st = (steps.astype(np.int64).view(np.uint64) & m) * np.uint64(0x9E3779B1) & m
    return h(h(s & m) ^ st ^ h(((s >> np.uint64(32)) & m) ^ np.uint64(0x5BD1E995))).view(np.int64)


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


_STEP = operator.attrgetter("step")


class _Draw:
    """Per-row draw parameters of one sampler call, from the rows' records (host side, numpy).

    ``fprm`` [S, 4] float32: temperature, top_p, log(min_p) (-inf = off), 0. ``iprm`` [S, 4]
    int64: top_k (0 = off), seed, step, 0. ``order`` [S] int64: the rows plain + greedy + filtered
    (for the kernels), the filtered ones with top-k first and the last ``n_pivot`` without top-k
    (the kernels' pivot rows). ``plain``, ``greedy``, ``filt``: ascending int64 row indices of
    each kind; ``ks`` [S] int64: top_k. top_k >= V is off, and top_p <= 0 becomes top_k 1 (both
    keep only the best token). `tensors` (or `add_to` a call's `Upload`) puts fprm, iprm and order on the device;
    `keys` gives the PyTorch paths their row keys (the kernels hash seed and step themselves).
    """

    def __init__(self, rows: list[SamplingRow], V: int, recs: Optional[np.ndarray] = None):
        rec = records(rows) if recs is None else recs
        S = len(rows)
        fprm = np.zeros((S, 4), dtype=np.float32)
        iprm = np.zeros((S, 4), dtype=np.int64)
        temp, min_p = rec["temperature"], rec["min_p"]
        fprm[:, 0] = temp
        top_p, top_k = fprm[:, 1], iprm[:, 0]  # views: edited in place below
        top_p[:] = rec["top_p"]
        top_k[:] = rec["top_k"]
        iprm[:, 1] = rec["seed"]
        iprm[:, 2] = np.fromiter(map(_STEP, rows), np.int64, S)
        top_k[(top_k < 0) | (top_k >= V)] = 0
        p_off = top_p <= 0
        top_k[p_off], top_p[p_off] = 1, 1.0
        greedy = temp == 0
        filt = ~greedy & ((top_k > 0) | (top_p < 1) | (min_p > 0))
        self.greedy, self.filt = np.flatnonzero(greedy), np.flatnonzero(filt)
        self.plain = np.flatnonzero(~greedy & ~filt)
        self.n_pivot = int(np.count_nonzero(top_k[self.filt] == 0))
        self.ks = top_k
        if (min_p > 0).any():
            fprm[:, 2] = _log_min_p(torch.from_numpy(np.array(min_p, dtype=np.float32))).numpy()  # a writable copy
        else:
            fprm[:, 2] = float("-inf")
        self.fprm, self.iprm = fprm, iprm
        fk = top_k[self.filt] > 0  # filtered rows with top-k first, then top-p/min-p only (pivot rows)
        self.order = np.concatenate([self.plain, self.greedy, self.filt[fk], self.filt[~fk]])

    def keys(self) -> np.ndarray:
        """[S] int64 row keys (`_row_keys` of seed and step), computed on the host."""
        return _row_keys_host(self.iprm[:, 1], self.iprm[:, 2])

    def add_to(self, up: Upload) -> tuple[int, int, int]:
        """Register fprm, iprm and order with a call's upload; returns their handles."""
        return up.add(self.fprm), up.add(self.iprm), up.add(self.order)

    def tensors(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(fprm, iprm, order) on ``dev``, in one upload (see the class docstring)."""
        up = Upload()
        h = self.add_to(up)
        t = up.send(dev)
        return t[h[0]], t[h[1]], t[h[2]]


def _sel(index: torch.Tensor, n: int, S: int):
    """Row selector of ``n`` ascending rows: ``slice(None)`` when they are all S rows (no gather)."""
    return slice(None) if n == S else index


# ---- the sampler ----------------------------------------------------------------------------
def greedy_ids(logits: torch.Tensor, out: Optional[torch.Tensor] = None, use_triton: Optional[bool] = None
               ) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` ([S] int64, into ``out`` when given): by
    `kvpilot.kernels.sampling.argmax` (same ids, spread over more programs; 27 -> a few us per batch-1
    step on an H200) when ``use_triton`` (default: CUDA logits and Triton importable) and that function takes the arguments (2-D float32/bfloat16/float16 logits contiguous
    along a vocabulary of 1 .. 2**31 - 1 columns; ``out`` None or a contiguous [S] int64 tensor on
    their device); else by ``torch.argmax``, whose errors it raises."""
    if use_triton is None:
        from kvpilot.kernels import triton_available

        use_triton = logits.is_cuda and triton_available()
    if use_triton:
        from kvpilot.kernels import sampling as ksampling

        if _argmax_kernel_takes(logits, out, ksampling.ARGMAX_DTYPES):
            return ksampling.argmax(logits, out=out)
    return torch.argmax(logits, dim=-1) if out is None else torch.argmax(logits, dim=-1, out=out)


def _argmax_kernel_takes(logits: torch.Tensor, out: Optional[torch.Tensor], dtypes: tuple) -> bool:
    # kernels.sampling.argmax's contract, so that greedy_ids never raises where torch.argmax would not
    if logits.dim() != 2 or logits.stride(1) != 1 or not 0 < logits.shape[1] < 2**31 or logits.dtype not in dtypes:
        return False
    return out is None or (out.shape == logits.shape[:1] and out.dtype == torch.int64
                           and out.device == logits.device and out.stride(0) == 1)


class Sampler:
    """Chooses the next token of every row of a ``[S, V]`` float32 logits matrix.

    Greedy rows (temperature 0) take the arg-max of the processed logits (ties: lowest id); the
    others draw by Gumbel-max under the exact semantics of the module docstring. ``backend``:
    "auto" (Triton kernels on CUDA when Triton imports, else PyTorch; `kvpilot.tuning.Tuning.triton_sampler`
    False makes the engine pass "torch"),
    "triton" (also CPU tensors under TRITON_INTERPRET=1), "torch" (the candidate path), or "exact"
    (`_draw_exact` for every filtered row). All backends choose the same tokens. Raises ValueError
    when the number of rows and of logits rows differ, or for an unknown backend.

    ``sampler(logits, rows)`` equals ``sampler.launch(logits, rows).finish()``: `launch` queues
    every device operation without reading the device, so the caller can do host work while they
    run (`EngineCore._launch`); ``finish`` makes the call's one device->host read.
    """

    BACKENDS = ("auto", "triton", "torch", "exact")

    def __init__(self, backend: str = "auto", check: bool = False):
        if backend not in self.BACKENDS:
            raise ValueError(f"unknown sampler backend {backend!r}; expected one of {self.BACKENDS}")
        self.backend = backend
        self.check = check  # the Triton draw's index checks (`kvpilot.kernels.sampling.draw`)
        self.exact_rows = 0  # filtered rows the fast paths handed to `_draw_exact` (all calls)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        return self.launch(logits, rows).finish()

    def launch(self, logits: torch.Tensor, rows: list[SamplingRow]) -> "_Pending":
        """Queue the call (logits transforms, draw, log-probabilities); ``.finish()`` returns the
        `SamplerOutput`. ``logits`` [S, V] float32 is not modified (transforms work on a copy) and
        must stay unchanged until ``finish``."""
        return self._launch(logits, rows, process=True, logprobs=True)

    def choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """Token id per row of ``logits`` ([S, V], already processed), as a host list."""
        return self._launch(logits, rows, process=False, logprobs=False).finish().token_ids

    def _launch(self, logits: torch.Tensor, rows: list[SamplingRow], process: bool, logprobs: bool) -> "_Pending":
        S, V = logits.shape
        if S != len(rows):
            raise ValueError(f"got {S} logits rows for {len(rows)} sampling rows")
        dev = logits.device
        recs = records(rows)
        proc = Processing(rows, V, recs) if process else None
        if proc is not None and proc.empty:
            proc = None
        d = None if bool((recs["temperature"] == 0).all()) else _Draw(rows, V, recs)
        lp_rows = np.flatnonzero(recs["logprobs"] >= 0) if logprobs else np.empty(0, np.int64)
        use_triton = self._use_triton(logits)
        up = Upload()
        hd = d.add_to(up) if d is not None else None
        hk = up.add(d.keys()) if d is not None and not use_triton else None
        hl = up.add(lp_rows) if lp_rows.size else None
        if proc is not None:
            proc.add_to(up, dev)  # last: from here it holds the token counts' lock until `apply`
        try:
            t = up.send(dev)
            x = logits if proc is None else proc.apply(logits.clone(), t, use_triton)
            if process:  # structured output: grammar masks (kvpilot.sampling.guided; a no-op without guides)
                x = apply_guides(x, logits, rows)
        except BaseException:
            if proc is not None:
                proc.release()
            raise
        fprm = iprm = keys = None
        if d is None:
            tokens = greedy_ids(x, use_triton=use_triton)
        else:
            fprm, iprm, order = (t[h] for h in hd)
            if use_triton:
                from kvpilot.kernels import sampling as ksampling

                n_plain = len(d.plain) + len(d.greedy)
                tokens = ksampling.draw(x, fprm, iprm, order[:n_plain], order[n_plain:], n_pivot=d.n_pivot,
                                        check=self.check)
            else:
                keys = t[hk]
                tokens = self._draw_torch(x, d, fprm, iprm, keys, order)
        lp = None
        if lp_rows.size:
            kmax = min(int(recs["logprobs"][lp_rows].max()), V)
            sel = t[hl]
            chosen = tokens[sel].clamp(min=0)  # -1: drawn again by `finish`, which redoes its logprobs
            if use_triton and logits.stride(1) == 1 and kmax <= _TRITON_LOGPROBS_MAX:
                from kvpilot.kernels import sampling as ksampling

                lp = ksampling.raw_logprobs(logits, sel, chosen, kmax)
            else:
                lp = _raw_logprobs(logits[_sel(sel, lp_rows.size, S)], chosen, kmax)
        return _Pending(self, logits, x, recs, d, fprm, iprm, keys, tokens, lp_rows, lp)

    def _draw_torch(self, x: torch.Tensor, d: _Draw, fprm: torch.Tensor, iprm: torch.Tensor, keys: torch.Tensor,
                    order: torch.Tensor) -> torch.Tensor:
        """[S] int64 tokens by the PyTorch paths; -1 where a filtered row needs `_draw_exact`."""
        S, V = x.shape
        out = torch.empty(S, dtype=torch.int64, device=x.device)
        nP, nG = len(d.plain), len(d.greedy)
        if nG:
            sel = _sel(order[nP:nP + nG], nG, S)
            out[sel] = x[sel].argmax(dim=-1)
        if nP:
            sel = _sel(order[:nP], nP, S)
            z = x[sel].float() / fprm[sel, 0][:, None]
            out[sel] = (z + _full_noise(keys[sel], V)).argmax(dim=-1)
        if len(d.filt):
            sel = _sel(order[nP + nG:], len(d.filt), S)
            out[sel] = self._filtered(x, fprm, iprm, keys, sel, d.ks[d.filt], exact=self.backend == "exact")
        return out

    def _use_triton(self, logits: torch.Tensor) -> bool:
        if self.backend == "triton":
            return True
        if self.backend != "auto" or not logits.is_cuda:
            return False
        from kvpilot.kernels import triton_available

        if not triton_available():
            return False
        from kvpilot.kernels import sampling as ksampling

        return logits.shape[-1] <= ksampling.MAX_VOCAB  # larger: the PyTorch path

    @staticmethod
    def _filtered(x: torch.Tensor, fprm: torch.Tensor, iprm: torch.Tensor, keys: Optional[torch.Tensor], sel,
                  ks: np.ndarray, exact: bool) -> torch.Tensor:
        """Draw rows ``sel`` (an int64 index tensor or ``slice(None)``; temperature > 0 and a filter)
        in PyTorch: [n] int64, -1 where the candidate path cannot settle a row exactly (flat
        distributions; `_Pending.finish` draws those by `_draw_exact`). ``ks``: their top_k;
        ``keys``: [S] row keys, or None to hash them from ``iprm`` here."""
        V = x.shape[1]
        z = x[sel].float() / fprm[sel, 0][:, None]
        top_k, top_p, log_min_p = iprm[sel, 0], fprm[sel, 1], fprm[sel, 2]
        keys = _row_keys(iprm[sel, 1], iprm[sel, 2]) if keys is None else keys[sel]
        if exact:
            return _draw_exact(z, top_k, top_p, log_min_p, keys)
        # one candidate more than the largest top_k: the prefix above the last candidate's value
        # then still holds k tokens unless values tie there
        small = bool(((ks > 0) & (ks <= _TOPK_CANDIDATES_MAX)).all())
        kc = min(V, int(ks.max()) + 1 if small else _TOPK_CANDIDATES_MAX)
        tokens, ok = _draw_candidates(z, top_k, top_p, log_min_p, keys, kc)
        return torch.where(ok, tokens, -1)


class _Pending:
    """A launched sampler call: the device results, read by `finish` (see `Sampler.launch`).

    ``tokens``: [S] int64 on the device, the chosen ids, -1 for rows `finish` draws again (the
    engine's async scheduling feeds them to the next step before `finish`); after `finish`,
    ``redrawn`` lists those rows (ascending int64 indices).
    """

    def __init__(self, sampler: Sampler, raw: torch.Tensor, x: torch.Tensor, recs: np.ndarray,
                 d: Optional[_Draw], fprm, iprm, keys, tokens: torch.Tensor, lp_rows: np.ndarray, lp):
        self.sampler, self.raw, self.x, self.recs, self.d = sampler, raw, x, recs, d
        self.fprm, self.iprm, self.keys, self.tokens, self.lp_rows, self.lp = fprm, iprm, keys, tokens, lp_rows, lp
        self.redrawn: np.ndarray = np.empty(0, np.int64)
        self._host: Optional[list[torch.Tensor]] = None  # results copied by `detach`
        self._ready = None  # the event after those copies

    def detach(self) -> None:
        """Make `finish` independent of device work queued after this call (the engine's async
        scheduling queues the next step's forward pass before reading this call): the results'
        device->host copies are queued now, with an event that `finish` waits for instead of the
        whole stream, and the logits rows `finish` may still read (rows a fast path may hand to the
        exact draw, and their raw rows for log-probabilities) are copied into tensors of this call's
        own, so the caller may overwrite the logits (the next CUDA graph replay writes the same static
        buffer). Queues work only (no logits copy when no row is filtered)."""
        d = self.d
        if d is not None and len(d.filt):

            def keep(t: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
                if len(rows) == t.shape[0]:
                    return t.clone()
                out = torch.empty_like(t)  # only ``rows`` are ever read
                up = Upload()  # pinned: an upload from pageable memory would wait for the stream
                h = up.add(rows)
                idx = up.send(t.device)[h]
                return out.index_copy_(0, idx, t.index_select(0, idx))

            if self.x is self.raw:
                self.x = self.raw = keep(self.raw, d.filt)
            else:  # ``x`` is already a processed copy; raw rows are read for redrawn rows' logprobs
                rows = np.intersect1d(self.lp_rows, d.filt)
                if rows.size:
                    self.raw = keep(self.raw, rows)
        if self.tokens.is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                          for t in [self.tokens] + list(self.lp or ())]
            self._ready = torch.cuda.Event()
            self._ready.record()

    @property
    def ready(self):
        """The CUDA event recorded after `detach`'s copies (query it to learn, without waiting,
        whether `finish` would block), or None (not detached, or CPU tensors)."""
        return self._ready

    def finish(self) -> SamplerOutput:
        """The tokens (and log-probabilities) as host lists: the call's one device->host read, plus
        one more only when a fast path handed rows to the exact draw."""
        if self._host is not None:  # queued by `detach`
            self._ready.synchronize()
            host = self._host
        else:
            host = to_host([self.tokens] + (list(self.lp) if self.lp is not None else []))
        tokens = host[0].tolist()
        S = len(tokens)
        redo = np.flatnonzero(host[0].numpy() < 0) if self.d is not None and len(self.d.filt) else []
        if len(redo):
            self.redrawn = redo
            self.sampler.exact_rows += len(redo)
            logger.debug("sampler: %d of %d filtered rows drawn by the exact path", len(redo), len(self.d.filt))
            sel = torch.from_numpy(redo).to(self.x.device)
            again = Sampler._filtered(self.x, self.fprm, self.iprm, self.keys, sel, self.d.ks[redo], exact=True)
            for i, t in zip(redo.tolist(), again.tolist()):
                tokens[i] = t
        logprobs: list[Optional[float]] = [None] * S
        top: list[Optional[tuple[list[int], list[float], int]]] = [None] * S
        if self.lp_rows.size:
            chosen_lp, ranks, top_vals, top_ids = (h.tolist() for h in host[1:])
            again_rows = set(redo.tolist()) if len(redo) else set()
            fix = [j for j, i in enumerate(self.lp_rows.tolist()) if i in again_rows]
            if fix:  # their chosen token was not known when the log-probabilities were launched
                rows = self.lp_rows[fix]
                dev = self.raw.device
                kmax = len(top_ids[0])
                got = to_host(list(_raw_logprobs(self.raw[torch.from_numpy(rows).to(dev)],
                                                 torch.tensor([tokens[i] for i in rows.tolist()], device=dev), kmax)))
                for j, a, b, c, e in zip(fix, *(g.tolist() for g in got)):
                    chosen_lp[j], ranks[j], top_vals[j], top_ids[j] = a, b, c, e
            ks = self.recs["logprobs"][self.lp_rows].tolist()
            for j, (i, k) in enumerate(zip(self.lp_rows.tolist(), ks)):
                logprobs[i] = chosen_lp[j]
                top[i] = (top_ids[j][:k], top_vals[j][:k], ranks[j])
        return SamplerOutput(token_ids=tokens, logprobs=logprobs, top_logprobs=top)


def _raw_logprobs(raw: torch.Tensor, chosen: torch.Tensor, kmax: int):
    """Log-probabilities of the raw distribution for rows ``raw`` ([R, V]) and their chosen ids
    (``chosen`` [R] int64 on raw's device), as device tensors: chosen token's logprob [R] float32,
    its rank (1 + number of tokens with a larger logit) [R] int64, the top ``kmax`` logprobs
    [R, kmax] float32 and their ids [R, kmax] int64 (the tuple of `kernels.sampling.raw_logprobs`).
    """
    x = raw.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    xc = x.gather(1, chosen[:, None])
    ranks = (x > xc).sum(dim=-1) + 1
    if kmax > 0:
        vals, ids = x.topk(kmax, dim=-1)
        top_vals = vals - lse
    else:
        top_vals = x.new_empty(x.shape[0], 0)
        ids = torch.empty(x.shape[0], 0, dtype=torch.int64, device=x.device)
    return (xc - lse).squeeze(1), ranks, top_vals, ids


def _full_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel noise [rows, V] for row keys (Triton on CUDA, PyTorch elsewhere)."""
    if keys.is_cuda and _triton_gumbel() is not None:
        return _triton_gumbel()(keys, vocab_size)
    return _gumbel_from_keys(keys, torch.arange(vocab_size, device=keys.device, dtype=torch.int64)[None, :])
