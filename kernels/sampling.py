"""Triton kernels of the batched sampler; ``engine/sampling/sampler.py`` defines what they compute.

They read the ``[rows, V]`` logits where they lie (rows picked by index, no gathered copies) and
never write a ``[rows, V]`` temporary; the Gumbel noise is made in registers, bit for bit the
counter hash of ``kvpilot.sampling.sampler.gumbel_noise``.

- Greedy rows and rows without top-k/top-p/min-p: ``_plain_kernel``, one pass, arg-max of
  ``logits`` or of ``logits / T + G`` per chunk; ``_resolve_kernel`` reduces the chunks.
- Rows filtered by top-p and/or min-p alone (no top-k; ``draw``'s ``n_pivot`` rows) take, when
  ``CONFIG["pivot_rounds"]`` > 0 (the default), the pivot path, which never locates the kept
  prefix's end. The kept set K is a prefix of the order (value
  desc, then id), so if j is the Gumbel-max token (arg-max of ``z + G``, ties -> lowest id) over
  any superset of K, either j is in K, and then it is the reference's token, or every token of K
  is ordered before j, and the draw continues among those. ``_pivot_first_kernel`` (pass 1): the
  row max ``m`` and the candidate j_0 over all tokens (lanes skip tokens below their running max
  + log(min_p), a superset of the min-p set). Then per generation g (``_pivot_kernel``):
  an M pass (MASS) sums the exact mass of the tokens ordered before j_g (the first also the row's
  total W) and a C pass (DECIDE 2) settles j_g by the reference's comparison; where j_g is not
  kept, the C pass makes noise only in blocks holding tokens ordered before j_g, and finds the
  best candidate (and the exact mass) of each of ``pivot_levels`` nested prefixes of those tokens:
  all of them, and the ones at or above values evenly spaced from z_j up to ``m`` (or, when z_j
  is ``m`` itself, the tied maxima below evenly spaced ids). The next M pass takes the smallest
  prefix whose mass reaches top_p * W (it holds K: every token after it has that much mass before
  it); its candidate is accepted at once when it also lies in the next smaller prefix (mass below
  top_p * W: every token of it is kept), or when no mass is needed (top_p = 1 and it passes
  min-p). Finished rows' programs exit at once. The candidate of pass 1 is a sample of the whole
  distribution, so about a top_p share of the rows is settled by two passes; the levels settle
  nearly all others within two more generations, even for top_p 0.01 on flat logits (a plain
  chain of candidates shrinks the mass only by a uniform factor per generation).
  ``CONFIG["pivot_fuse"]`` finds the next candidates in the M pass instead (settled at the start
  of the next M pass; no C passes): fewer launches, noise made in every row. After
  ``CONFIG["pivot_rounds"]`` generations a row still unsettled gets -1; ``_resolve_kernel``
  settles the last generation. A row's state (-2 in progress, -1 handed to the exact path, else
  its token) lives in one row of a ``[launches + 1, rows]`` buffer per launch: launch k reads row
  k and its programs 0 write row k + 1, so no program reads a state that another one of the same
  launch is writing (see ``_pivot_kernel``).
- Other filtered rows (top-k, with or without top-p/min-p; every filtered row when
  ``pivot_rounds`` is 0) take the window path: they find where their kept prefix (in order of
  value, then token id) ends without sorting. ``_max_kernel``: the row max ``m``.
  ``_stats_kernel`` (stage 1): count and approximate
  mass of the tokens above 16 fixed depths below ``m``, from which a window ``[c_lo, c_hi)`` of
  values is chosen that must hold every boundary (top-k's k-th token, top-p's last token); when the
  window holds more than ``wcap`` tokens, stage 2 counts again at 16 depths inside it (rows that
  need no refinement return at once). The stats are guidance only, so they skip the exact
  division (``x >= c * T`` for ``z >= c``), use ``exp2`` for masses, and sum no masses at all for
  rows without top-p; a wrong guess costs a hand-off (below), never a wrong token.
  ``_collect_kernel``: exact count and mass above the window, the best noisy token there, and the
  window's tokens copied out; exact masses of every token only for top-p without top-k (the only
  case that needs the row's total), else only in blocks holding tokens above the window, which
  are also the only blocks where noise is made. ``_resolve_kernel``: exact top-k, top-p and min-p
  inside the window (the top-k cut searches token ids only when it falls inside tied values),
  then the Gumbel-max winner among kept tokens (Pareto search: the winner is the highest-noise
  token whose rank is inside the prefix, found in a few masked arg-max rounds).

- ``_penalty_kernel`` (`apply_penalties`): repetition/frequency/presence penalties in place, one
  pass reading each penalised row and its token counts (``kvpilot.sampling.logits_processors``).

Masses are the fixed-point integers ``floor(exp(z - m) * 2**44)`` that the reference sums too, so
every exact decision is the same integer comparison in both (no summation-order rounding).
A row whose window cannot settle it exactly (too many tokens in it; unlikely combinations such as a
huge top-k with a small top-p), or that the pivot path did not settle within its generations, gets
-1, and the caller draws it with the exact reference.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from kvpilot import envs

try:  # exp must round like torch's (CUDA expf); tl.exp is the fast approximation
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - old Triton
    libdevice = None

Q_SCALE = 2.0 ** 44
"""Fixed-point scale of token masses (exact in float32 and int64 for any vocabulary < 2**19)."""
ZERO_DEPTH = 31.5
"""Tokens more than this below the row max have mass 0 and can never win the draw (the noise
spans less than 20.2), so no decision depends on anything below it."""
STAGE1_DEPTHS = (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 13.0, 17.0, 23.0, ZERO_DEPTH)
_INT_MAX = tl.constexpr(2147483647)

CONFIG = {
    "chunk": 4096,  # vocabulary columns per program of the full passes
    "block": 1024,  # columns per loop step of the plain/max passes
    "collect_block": 512,  # columns per loop step of the collect pass (< 4096; fewer registers)
    "stats_block": 256,  # columns per loop step of the stats pass (x 16 levels of accumulators)
    "wcap": 8192,  # tokens a window may hold (per row); more -> stage 2, then the exact path
    # Candidate generations of the pivot path (then -1: exact path); 0 = path off (top-p/min-p rows
    # take the window path). With 4, top-p 0.9 took 409 instead of 927 us at 256 x 128k (H200).
    "pivot_rounds": 4,
    "pivot_fuse": 0,  # 1: each M pass also finds the next candidate (no C passes)
    "pivot_block": 1024,  # columns per loop step of pass 1 and the M passes of the pivot path
    "pivot_cblock": 64,  # columns per loop step of its passes that find candidates (x levels)
    "pivot_levels": 16,  # nested prefixes those passes find candidates in (a power of 2)
}
"""Launch parameters (tests shrink ``chunk`` and ``wcap`` to reach every path with a tiny vocab)."""

MAX_VOCAB = 1 << 24
"""Largest vocabulary `draw`, `raw_logprobs` and `apply_penalties` take (ValueError above it; the
engine's sampler takes its PyTorch path there). Their grids have one program per row and column chunk
(CUDA's second grid dimension stops at 65,535) and the reduce programs hold every chunk's partial
result; 16M columns is 64x the largest vocabularies in use. `argmax` grows its chunks instead."""


def _check_vocab(V: int) -> None:
    if V > MAX_VOCAB:
        raise ValueError(f"the Triton sampler kernels take at most {MAX_VOCAB} vocabulary columns, got {V}")


# ---- hashing and noise: the same bits as kvpilot.sampling.sampler._row_keys / _gumbel_from_keys ---------
@triton.jit
def _hash32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _row_key(seed, step):
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    st = (step & 0xFFFFFFFF).to(tl.uint32)
    return _hash32(_hash32(lo) ^ (st * 0x9E3779B1) ^ _hash32(hi ^ 0x5BD1E995))


@triton.jit
def _gumbel(key, cols):
    bits = _hash32(key + cols.to(tl.uint32) * 0x85EBCA77)
    u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return -tl.log(-tl.log(u))  # tl.log rounds like torch.log on CUDA (checked on an H200)


@triton.jit
def _mass(z, m, PRECISE: tl.constexpr):
    """floor(exp(z - m) * 2**44) as int64; 0 for z = -inf."""
    d = tl.where(z > float("-inf"), z - m, float("-inf"))
    if PRECISE:
        w = libdevice.exp(d)
    else:
        w = tl.exp(d)
    return (w * 17592186044416.0).to(tl.int64)


@triton.jit
def _order_key(z):
    """uint32 key with the order of the float32 values (-0.0 counted as +0.0)."""
    b = (z + 0.0).to(tl.uint32, bitcast=True)
    return tl.where((b >> 31) != 0, ~b, b | 0x80000000)


@triton.jit
def _flag(c):
    """A scalar condition that may be combined with tensors (&, |, ~). The interpreter of Triton
    3.9 broadcasts a scalar float comparison as float32 data, which numpy cannot `&` with bools."""
    return tl.where(c, True, False)


@triton.jit
def _row_max(pmax_ptr, i, NS, SP: tl.constexpr):
    offs = tl.arange(0, SP)
    return tl.max(tl.load(pmax_ptr + i * NS + offs, mask=offs < NS, other=float("-inf")), 0)


@triton.jit
def _level_sums(pcnt_ptr, pmass_ptr, i, NS, L: tl.constexpr, SP: tl.constexpr):
    sp = tl.arange(0, SP)[:, None]
    off = (i * NS + sp) * L + tl.arange(0, L)[None, :]
    n = tl.sum(tl.load(pcnt_ptr + off, mask=sp < NS, other=0), 0)
    mass = tl.sum(tl.load(pmass_ptr + off, mask=sp < NS, other=0.0), 0)
    return n, mass


@triton.jit
def _pick(sel, v, fallback):
    return tl.where(tl.max(sel.to(tl.int32), 0) > 0, tl.sum(tl.where(sel, v, 0), 0), fallback)


@triton.jit
def _plan(c, n, mass, c_top, n_top, m_top, c_bot, n_bot, m_bot, k, p, thr_m, m, wk_lo, w_all,
          L: tl.constexpr):
    """Window [c_lo, c_hi) from counts n and approximate masses at thresholds c (descending).

    c_hi: the deepest level whose tokens are all kept by top-k and top-p; c_lo: the shallowest level
    below which nothing is kept (or nothing matters). The top/bottom levels are known to qualify.
    The 1e-4 margins cover the float32 mass sums; _resolve_kernel checks everything exactly.
    """
    lev = tl.arange(0, L)
    k_on = _flag(k > 0)
    top_p = _flag(p < 1.0)
    # min-p or the mass alone bound the window only when the top-k's mass is not needed
    cov = (k_on & (n >= k)) | (c <= m - 31.5) | (
        ((~k_on) | (~top_p)) & ((c <= thr_m) | ((~k_on) & top_p & (mass >= p * w_all * 1.0001))))
    keep = ((~k_on) | (n <= k)) & ((~top_p) | (mass < p * wk_lo * 0.9999))
    l_lo = tl.min(tl.where(cov, lev, L), 0)
    l_hi = tl.max(tl.where(keep & (lev <= l_lo), lev, -1), 0)
    lo, hi = lev == l_lo, lev == l_hi
    return (_pick(hi, c, c_top), _pick(hi, n, n_top), _pick(hi, mass, m_top),
            _pick(lo, c, c_bot), _pick(lo, n, n_bot), _pick(lo, mass, m_bot))


@triton.jit
def _level_counts(base, V, s, cx, xm, sc, MASS: tl.constexpr, L: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK: tl.constexpr):
    """[L] counts of x >= cx[l] in chunk s, and (MASS) their approximate masses exp2((x - xm) * sc).

    Levels are the first axis so that each thread keeps all L accumulators of its columns."""
    acc_n = tl.zeros([L, BLOCK], tl.int32)
    acc_m = tl.zeros([L, BLOCK], tl.float32)
    for start in range(0, CHUNK, BLOCK):
        cols = s * CHUNK + start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        ge = x[None, :] >= cx[:, None]
        acc_n += ge.to(tl.int32)
        if MASS:
            acc_m += tl.where(ge, tl.exp2((x - xm) * sc)[None, :], 0.0)
    return tl.sum(acc_n, 1), tl.sum(acc_m, 1)


# ---- kernels -----------------------------------------------------------------------------------
@triton.jit
def _plain_kernel(x_ptr, stride, V, rows_ptr, fprm_ptr, iprm_ptr, pval_ptr, pidx_ptr, NS,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Per chunk: arg-max of x (T == 0) or of div_rn(x, T) + G; ties -> lowest id."""
    i = tl.program_id(0)
    s = tl.program_id(1)
    r = tl.load(rows_ptr + i)
    t = tl.load(fprm_ptr + r * 4)
    key = _row_key(tl.load(iprm_ptr + r * 4 + 1), tl.load(iprm_ptr + r * 4 + 2))
    base = x_ptr + r.to(tl.int64) * stride
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], _INT_MAX, tl.int32)
    for start in range(0, CHUNK, BLOCK):
        cols = s * CHUNK + start + tl.arange(0, BLOCK)
        inr = cols < V
        x = tl.load(base + cols, mask=inr, other=float("-inf")).to(tl.float32)
        if t == 0.0:
            y = x
        else:
            y = tl.math.div_rn(x, t) + _gumbel(key, cols)
        upd = inr & ((y > best_v) | ((y == best_v) & (cols < best_i)))
        best_v = tl.where(upd, y, best_v)
        best_i = tl.where(upd, cols, best_i)
    v = tl.max(best_v, 0)
    tl.store(pval_ptr + i * NS + s, v)
    tl.store(pidx_ptr + i * NS + s, tl.min(tl.where(best_v == v, best_i, _INT_MAX), 0))


@triton.jit
def _max_kernel(x_ptr, stride, V, rows_ptr, pmax_ptr, wcnt_ptr, NS,
                CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    s = tl.program_id(1)
    base = x_ptr + tl.load(rows_ptr + i).to(tl.int64) * stride
    acc = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, CHUNK, BLOCK):
        cols = s * CHUNK + start + tl.arange(0, BLOCK)
        acc = tl.maximum(acc, tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32))
    tl.store(pmax_ptr + i * NS + s, tl.max(acc, 0))
    if s == 0:
        tl.store(wcnt_ptr + i, 0)


@triton.jit
def _stats_kernel(x_ptr, stride, V, rows_ptr, fprm_ptr, iprm_ptr, pmax_ptr, depth_ptr,
                  pcnt1_ptr, pmass1_ptr, planf_ptr, plani_ptr, sub_ptr, pcnt2_ptr, pmass2_ptr, NS, WCAP,
                  STAGE: tl.constexpr, L: tl.constexpr, SP: tl.constexpr,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Count and approximate mass (float32; 0 for rows without top-p) of the tokens with z >= c_l
    for L thresholds c_l, compared as x >= c_l * T (a token within rounding of c_l may count on
    either side: these are guidance, collect and resolve decide exactly).

    Stage 1: c_l = m - STAGE1_DEPTHS[l]. Stage 2 (rows whose stage-1 window is over capacity):
    L thresholds evenly inside that window. Stage 2's first program of a row stores the stage-1
    plan (planf: c_hi, M_hi, c_lo, M_lo, Wk_lo, W; plani: N_hi, N_lo, refine) and the thresholds.
    """
    i = tl.program_id(0)
    s = tl.program_id(1)
    r = tl.load(rows_ptr + i)
    t = tl.load(fprm_ptr + r * 4)
    xm = _row_max(pmax_ptr, i, NS, SP)
    m = tl.math.div_rn(xm, t)
    lev = tl.arange(0, L)
    if STAGE == 1:
        depth = tl.load(depth_ptr + lev)
        c = m - depth
        cx = xm - depth * t  # level 0 is exactly the max: it always counts the best token
        work = m > float("-inf")
        pcnt_ptr = pcnt1_ptr
        pmass_ptr = pmass1_ptr
    else:
        p = tl.load(fprm_ptr + r * 4 + 1)
        thr_m = m + tl.load(fprm_ptr + r * 4 + 2)
        k = tl.load(iprm_ptr + r * 4).to(tl.int32)
        c1 = m - tl.load(depth_ptr + lev)
        n1, mass1 = _level_sums(pcnt1_ptr, pmass1_ptr, i, NS, L, SP)
        w_all = tl.sum(tl.where(lev == L - 1, mass1, 0.0), 0)
        wk_lo = tl.where(k == 0, w_all, tl.max(tl.where(n1 <= k, mass1, 0.0), 0))
        # the last stage-1 level (ZERO_DEPTH) always qualifies as the bottom, so no fallback is used
        c_hi, n_hi, m_hi, c_lo, n_lo, m_lo = _plan(c1, n1, mass1, float("inf"), 0, 0.0, m - 31.5, 0, 0.0,
                                                    k, p, thr_m, m, wk_lo, w_all, L)
        work = (m > float("-inf")) & (n_lo - n_hi > WCAP)
        top = tl.minimum(c_hi, m)
        c = top - (top - c_lo) * ((lev + 1).to(tl.float32) * (1.0 / (L + 1)))
        if s == 0:
            tl.store(planf_ptr + i * 8 + 0, c_hi)
            tl.store(planf_ptr + i * 8 + 1, m_hi)
            tl.store(planf_ptr + i * 8 + 2, c_lo)
            tl.store(planf_ptr + i * 8 + 3, m_lo)
            tl.store(planf_ptr + i * 8 + 4, wk_lo)
            tl.store(planf_ptr + i * 8 + 5, w_all)
            tl.store(plani_ptr + i * 4 + 0, n_hi)
            tl.store(plani_ptr + i * 4 + 1, n_lo)
            tl.store(plani_ptr + i * 4 + 2, work.to(tl.int32))
            tl.store(sub_ptr + i * L + lev, c)
        cx = c * t
        pcnt_ptr = pcnt2_ptr
        pmass_ptr = pmass2_ptr
    if work:
        # Guidance only, so in raw-logit units without the exact division: x >= cx ~ c * t stands
        # for z >= c, and exp2((x - x_max) * log2(e) / t) for exp(z - m).
        sc = 1.4426950408889634 / t
        base = x_ptr + r.to(tl.int64) * stride
        if _flag(tl.load(fprm_ptr + r * 4 + 1) < 1.0):  # only top-p's plan reads the masses
            n_l, mass_l = _level_counts(base, V, s, cx, xm, sc, True, L, CHUNK, BLOCK)
        else:
            n_l, mass_l = _level_counts(base, V, s, cx, xm, sc, False, L, CHUNK, BLOCK)
        off = (i * NS + s) * L + lev
        tl.store(pcnt_ptr + off, n_l)
        tl.store(pmass_ptr + off, mass_l)


@triton.jit
def _collect_kernel(x_ptr, stride, V, rows_ptr, fprm_ptr, iprm_ptr, pmax_ptr, planf_ptr, plani_ptr,
                    sub_ptr, pcnt2_ptr, pmass2_ptr, win_ptr, wz_ptr, wid_ptr, wcnt_ptr,
                    pn_ptr, pmhi_ptr, pw_ptr, pyb_ptr, pib_ptr, NS, WCAP,
                    L: tl.constexpr, SP: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                    PRECISE: tl.constexpr):
    """Exact per-chunk sums for the final window [c_lo, c_hi) of each filtered row.

    Partials: count and mass of tokens with z >= c_hi (pn, pmhi), the row's total mass (pw), and the
    best (z + G, id) among them that pass min-p (pyb, pib). Window tokens (z, id) are appended to
    the row's buffer (wz, wid) through the counter wcnt (order irrelevant; at most WCAP stored).
    """
    i = tl.program_id(0)
    s = tl.program_id(1)
    r = tl.load(rows_ptr + i)
    t = tl.load(fprm_ptr + r * 4)
    p = tl.load(fprm_ptr + r * 4 + 1)
    m = tl.math.div_rn(_row_max(pmax_ptr, i, NS, SP), t)
    thr_m = m + tl.load(fprm_ptr + r * 4 + 2)
    k = tl.load(iprm_ptr + r * 4).to(tl.int32)
    key = _row_key(tl.load(iprm_ptr + r * 4 + 1), tl.load(iprm_ptr + r * 4 + 2))
    c_hi = tl.load(planf_ptr + i * 8 + 0)
    c_lo = tl.load(planf_ptr + i * 8 + 2)
    if tl.load(plani_ptr + i * 4 + 2) != 0:  # stage 2 refined this row's window
        lev = tl.arange(0, L)
        c2 = tl.load(sub_ptr + i * L + lev)
        n2, mass2 = _level_sums(pcnt2_ptr, pmass2_ptr, i, NS, L, SP)
        wk_lo = tl.load(planf_ptr + i * 8 + 4)
        wk_lo = tl.where(k == 0, wk_lo, tl.maximum(wk_lo, tl.max(tl.where(n2 <= k, mass2, 0.0), 0)))
        c_hi, n_hi, m_hi, c_lo, n_lo, m_lo = _plan(
            c2, n2, mass2, c_hi, tl.load(plani_ptr + i * 4 + 0), tl.load(planf_ptr + i * 8 + 1),
            c_lo, tl.load(plani_ptr + i * 4 + 1), tl.load(planf_ptr + i * 8 + 3),
            k, p, thr_m, m, wk_lo, tl.load(planf_ptr + i * 8 + 5), L)
    if s == 0:
        tl.store(win_ptr + i * 2, c_hi)
        tl.store(win_ptr + i * 2 + 1, c_lo)
    # The row's total mass is needed only by top-p without top-k; otherwise masses are summed only
    # in blocks holding tokens above the window, and the noise is made only there too.
    need_w = _flag(p < 1.0) & _flag(k == 0)
    base = x_ptr + r.to(tl.int64) * stride
    n_hi = tl.full((), 0, tl.int32)
    mhi_acc = tl.zeros([BLOCK], tl.int64)
    w_acc = tl.zeros([BLOCK], tl.int64)
    best_y = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], _INT_MAX, tl.int32)
    if m > float("-inf"):
        for start in range(0, CHUNK, BLOCK):
            cols = s * CHUNK + start + tl.arange(0, BLOCK)
            inr = cols < V
            z = tl.math.div_rn(tl.load(base + cols, mask=inr, other=float("-inf")).to(tl.float32), t)
            hi = inr & (z >= c_hi)
            win = inr & (z >= c_lo) & (z < c_hi)
            packed = tl.sum(win.to(tl.int32) + hi.to(tl.int32) * 4096, 0)  # one reduction: both counts
            nh = packed >> 12
            nw = packed & 4095
            n_hi += nh
            if need_w:
                q = _mass(z, m, PRECISE)
                w_acc += q
                mhi_acc += tl.where(hi, q, 0)
            elif nh > 0:
                mhi_acc += tl.where(hi, _mass(z, m, PRECISE), 0)
            if nh > 0:
                cand = hi & (z >= thr_m)
                y = z + _gumbel(key, cols)
                upd = cand & ((y > best_y) | ((y == best_y) & (cols < best_i)))
                best_y = tl.where(upd, y, best_y)
                best_i = tl.where(upd, cols, best_i)
            if nw > 0:
                start_pos = tl.atomic_add(wcnt_ptr + i, nw)
                pos = start_pos + tl.cumsum(win.to(tl.int32), 0) - 1
                ok = win & (pos < WCAP)
                tl.store(wz_ptr + i.to(tl.int64) * WCAP + pos, z, mask=ok)
                tl.store(wid_ptr + i.to(tl.int64) * WCAP + pos, cols, mask=ok)
    o = i * NS + s
    tl.store(pn_ptr + o, n_hi)
    tl.store(pmhi_ptr + o, tl.sum(mhi_acc, 0))
    tl.store(pw_ptr + o, tl.sum(w_acc, 0))
    yb = tl.max(best_y, 0)
    tl.store(pyb_ptr + o, yb)
    tl.store(pib_ptr + o, tl.min(tl.where(best_y == yb, best_i, _INT_MAX), 0))


# ---- the pivot path: rows filtered by top-p and/or min-p only ----------------------------------
@triton.jit
def _checked(rec_ptr, code, x, hi, a, b, c):
    """Debug mode (Tuning(sampling_check=True)): x clamped into [0, hi); an x outside is recorded at
    rec_ptr as (code, x, hi, a, b, c) for `draw` to raise on."""
    bad = (x < 0) | (x >= hi)
    if bad:
        tl.store(rec_ptr, code)
        tl.store(rec_ptr + 1, x)
        tl.store(rec_ptr + 2, hi)
        tl.store(rec_ptr + 3, a)
        tl.store(rec_ptr + 4, b)
        tl.store(rec_ptr + 5, c)
    return tl.where(bad, 0, x)


@triton.jit
def _best(cy_ptr, ci_ptr, off, NS, SP: tl.constexpr):
    """The id of the best of NS partial (y, id) pairs at ``off``: largest y, ties -> lowest id."""
    so = tl.arange(0, SP)
    cy = tl.load(cy_ptr + off + so, mask=so < NS, other=float("-inf"))
    ci = tl.load(ci_ptr + off + so, mask=so < NS, other=_INT_MAX)
    return tl.min(tl.where(cy == tl.max(cy, 0), ci, _INT_MAX), 0)


@triton.jit
def _pivot_kept(pw_ptr, pmb_ptr, ow, omb, NS, p, zj, thr, SP: tl.constexpr):
    """Whether a candidate with value zj is kept: min-p, then the reference's top-p comparison
    float64(mass ordered before it) < float64(top_p) * float64(row mass), from NS partials each."""
    so = tl.arange(0, SP)
    w = tl.sum(tl.load(pw_ptr + ow + so, mask=so < NS, other=0), 0)
    mb = tl.sum(tl.load(pmb_ptr + omb + so, mask=so < NS, other=0), 0)
    return _flag(zj >= thr) & (_flag(p >= 1.0) | (mb.to(tl.float64) < p.to(tl.float64) * w.to(tl.float64)))


# Row lists are slices of the engine's row order whose alignment varies with the row counts: read
# once per program, they are not specialised on (no variant compiled per alignment).
@triton.jit(do_not_specialize=["rows_ptr", "S"])
def _pivot_first_kernel(x_ptr, stride, V, rows_ptr, fprm_ptr, iprm_ptr, pmax_ptr, cy_ptr, ci_ptr, state_ptr, NS,
                        dbg_ptr, S, CHUNK: tl.constexpr, BLOCK: tl.constexpr, CHECK: tl.constexpr):
    """Pivot pass 1, per chunk: max of z = div_rn(x, T), and the best (z + G, id) among the tokens
    with z >= (their lane's running max of z) + log(min_p), a superset of the row's min-p set.
    Program 0 of a row sets its state: -2 (in progress), or -1 for a row with top-k (not ours)."""
    i = tl.program_id(0)
    s = tl.program_id(1)
    r = tl.load(rows_ptr + i)
    if CHECK:
        r = _checked(dbg_ptr + (i * NS + s) * 8, 1, r, S, 0, r, 0)
    t = tl.load(fprm_ptr + r * 4)
    lmp = tl.load(fprm_ptr + r * 4 + 2)
    key = _row_key(tl.load(iprm_ptr + r * 4 + 1), tl.load(iprm_ptr + r * 4 + 2))
    base = x_ptr + r.to(tl.int64) * stride
    mz = tl.full([BLOCK], float("-inf"), tl.float32)
    best_y = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], _INT_MAX, tl.int32)
    for start in range(0, CHUNK, BLOCK):
        cols = s * CHUNK + start + tl.arange(0, BLOCK)
        inr = cols < V
        z = tl.math.div_rn(tl.load(base + cols, mask=inr, other=float("-inf")).to(tl.float32), t)
        mz = tl.maximum(mz, z)
        y = z + _gumbel(key, cols)
        upd = inr & (z >= mz + lmp) & ((y > best_y) | ((y == best_y) & (cols < best_i)))
        best_y = tl.where(upd, y, best_y)
        best_i = tl.where(upd, cols, best_i)
    o = i * NS + s
    tl.store(pmax_ptr + o, tl.max(mz, 0))
    yb = tl.max(best_y, 0)
    tl.store(cy_ptr + o, yb)
    tl.store(ci_ptr + o, tl.min(tl.where(best_y == yb, best_i, _INT_MAX), 0))
    if s == 0:
        tl.store(state_ptr + i, tl.where(tl.load(iprm_ptr + r * 4) == 0, -2, -1).to(tl.int32))


@triton.jit
def _in_levels(z, cols, cl, il):
    """[L, BLOCK]: token ordered before level l's boundary (value cl[l], id il[l]), i.e. z > cl[l]
    or z == cl[l] with id < il[l] (il = INT_MAX takes every token equal to cl[l])."""
    zz = z[None, :]
    return (zz > cl[:, None]) | ((zz == cl[:, None]) & (cols[None, :] < il[:, None]))


@triton.jit
def _level_best(best_y, best_i, c, z, cols, cl, il, key):
    """Per level l ([L, BLOCK] running bests): arg-max of z + G over tokens with c in level l."""
    if tl.max(c.to(tl.int32), 0) > 0:  # noise only where some token qualifies
        y = (z + _gumbel(key, cols))[None, :]
        upd = c[None, :] & _in_levels(z, cols, cl, il) & ((y > best_y) | ((y == best_y) & (cols[None, :] < best_i)))
        best_y = tl.where(upd, y, best_y)
        best_i = tl.where(upd, cols[None, :], best_i)
    return best_y, best_i


@triton.jit
def _cand_update(best_y, best_i, b1_y, b1_i, top_p, c, z, cols, cl, il, key):
    """The candidate search of one block: per level ([L, BLOCK] bests) for a top-p row; for a
    min-p-only row ([BLOCK] bests) only level 0, the one its M passes read (every token that passes
    min-p is kept, so the best of them is the row's token)."""
    if top_p:
        best_y, best_i = _level_best(best_y, best_i, c, z, cols, cl, il, key)
    elif tl.max(c.to(tl.int32), 0) > 0:
        y = z + _gumbel(key, cols)
        upd = c & ((y > b1_y) | ((y == b1_y) & (cols < b1_i)))
        b1_y = tl.where(upd, y, b1_y)
        b1_i = tl.where(upd, cols, b1_i)
    return best_y, best_i, b1_y, b1_i


@triton.jit(do_not_specialize=["rows_ptr", "NF", "S", "NC", "g", "k"])
def _pivot_kernel(x_ptr, stride, V, rows_ptr, fprm_ptr, iprm_ptr, pmax_ptr, cy_ptr, ci_ptr, pf_ptr, lv_ptr,
                  li_ptr, cj_ptr, cz_ptr, pw_ptr, pmb_ptr, state_ptr, NF, NS, dbg_ptr, S, NC, g, k,
                  DECIDE: tl.constexpr, MASS: tl.constexpr, TOTAL: tl.constexpr, CAND: tl.constexpr,
                  L: tl.constexpr, SP: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                  PRECISE: tl.constexpr, CHECK: tl.constexpr):
    """One pass of pivot generation g over the chunks of the rows still in progress (state -2).

    Partials are laid out [generation, level, row, chunk]; generation g's candidates come from
    level 0 (all tokens ordered before j_{g-1}, or pass 1's set for g = 0) or level l, the prefix
    P_l of the tokens ordered before j_{g-1} and before the boundary (c_l, i_l): c_l = z_j +
    (m - z_j) * l / L with every token equal to c_l, or, when z_j is the row max m (the kept set
    lies inside the tied maxima), c_l = m with ids below i_l = j * (L - l) / L.

    DECIDE 1 / 2: first settle the candidate of generation g - 1 / g from its stored id (cj), value
    (cz) and mass partials; a kept one is the row's token (its new state, which program 0 stores
    in row k + 1 of the states; launch k reads row k).
    MASS ("M pass"): picks the tightest P_l whose exact mass reaches top_p * W (it holds every
    kept token: those below it have at least that mass before them), its best token is j_g;
    j_g is accepted at once when it also lies in P_{l+1} (mass < top_p * W: all kept) or when no
    mass is needed (top_p = 1, j_g passes min-p); else sums the partial mass of the tokens ordered
    before j_g (pmb[g]; TOTAL: also the row's mass W, pw).
    CAND: for generation g + 1, each level's partial mass (p < 1) and best (z + G, id) among the
    level's tokens that pass min-p (noise and masses only in blocks holding tokens before j_g).
    """
    i = tl.program_id(0)
    s = tl.program_id(1)
    r = tl.load(rows_ptr + i)
    if CHECK:
        r = _checked(dbg_ptr + (i * NS + s) * 8, 2, r, S, g, r, 0)
    # Launch k reads the states launch k - 1 left (row k of state_ptr, [launches + 1, NF]) and
    # program 0 of each row writes row k + 1. Never one row for both: a program that read a state
    # program 0 was storing in the same launch could see the old value in some warps and the new in
    # others, and warps that disagree on `go` fall out of step in the cross-warp reductions below
    # (on an H200 that gave a level index of 7169 and a load 3.5 GB off; BENCHMARKS.md).
    st = tl.load(state_ptr + k * NF + i)
    new_st = st
    go = st == -2
    if go:
        t = tl.load(fprm_ptr + r * 4)
        p = tl.load(fprm_ptr + r * 4 + 1)
        m = _row_max(pmax_ptr, i, NS, SP)
        thr = m + tl.load(fprm_ptr + r * 4 + 2)
        top_p = _flag(p < 1.0)
        base = x_ptr + r.to(tl.int64) * stride
        lev = tl.arange(0, L)
        if DECIDE != 0:
            if DECIDE == 1:
                d = g - 1
            else:
                d = g
            kept = _pivot_kept(pw_ptr, pmb_ptr, i * NS, (d * NF + i) * NS, NS, p, tl.load(cz_ptr + d * NF + i),
                               thr, SP)
            if kept:
                new_st = tl.load(cj_ptr + d * NF + i)
            go = go & (~kept)
        if MASS:
            lstar = tl.full((), 0, tl.int32)
            nxt = tl.full((), float("inf"), tl.float32)  # boundary of level lstar + 1 (inf: none)
            nxt_i = tl.full((), _INT_MAX, tl.int32)
            if (g > 0) & top_p:
                so = tl.arange(0, SP)
                w = tl.sum(tl.load(pw_ptr + i * NS + so, mask=so < NS, other=0), 0)
                fo = ((g * L + lev[:, None]) * NF + i) * NS + so[None, :]
                f = tl.sum(tl.load(pf_ptr + fo, mask=(so < NS)[None, :] & (lev > 0)[:, None], other=0), 1)
                ok = (lev == 0) | (f.to(tl.float64) >= p.to(tl.float64) * w.to(tl.float64))
                lstar = tl.max(tl.where(ok, lev, 0), 0)
                nl = lev == lstar + 1
                nxt = tl.min(tl.load(lv_ptr + (g * L + lev) * NF + i, mask=nl, other=float("inf")), 0)
                nxt_i = tl.min(tl.load(li_ptr + (g * L + lev) * NF + i, mask=nl, other=_INT_MAX), 0)
            cbo = ((g * L + lstar) * NF + i) * NS
            if CHECK:
                lstar = _checked(dbg_ptr + (i * NS + s) * 8, 3, lstar, L, g, r, cbo)
                cbo = _checked(dbg_ptr + (i * NS + s) * 8, 4, cbo, NC - NS + 1, g, r, lstar)
            j = _best(cy_ptr, ci_ptr, cbo, NS, SP)
            jl = tl.minimum(j, V - 1)
            if CHECK:
                jl = _checked(dbg_ptr + (i * NS + s) * 8, 5, jl, V, g, r, cbo)
            jz = tl.math.div_rn(tl.load(base + jl).to(tl.float32), t)
            bad = (j == _INT_MAX) | _flag(m == float("-inf"))
            in_next = _flag(jz > nxt) | (_flag(jz == nxt) & (j < nxt_i))
            done = bad | (_flag(jz >= thr) & ((~top_p) | in_next))
            if go:
                if s == 0:
                    tl.store(cj_ptr + g * NF + i, j)
                    tl.store(cz_ptr + g * NF + i, jz)
                if done:
                    new_st = tl.where(bad, -1, j)
            go = go & (~done)
        else:
            j = tl.load(cj_ptr + g * NF + i)
            jz = tl.load(cz_ptr + g * NF + i)
        need_mb = MASS & top_p & _flag(jz >= thr)
        need_f = CAND & top_p
        run = need_mb  # whether this pass reads the row at all
        if TOTAL:
            run = run | top_p
        if CAND:
            run = go
        if go & run:
            key = _row_key(tl.load(iprm_ptr + r * 4 + 1), tl.load(iprm_ptr + r * 4 + 2))
            # level thresholds of generation g + 1 (level 0: every token before j_g)
            cl = tl.where(lev == 0, float("-inf"), jz + (m - jz) * (lev.to(tl.float32) * (1.0 / L)))
            il = tl.where((lev > 0) & _flag(jz == m), (j * (L - lev)) // L, _INT_MAX)
            if CAND:
                if s == 0:
                    tl.store(lv_ptr + ((g + 1) * L + lev) * NF + i, cl)
                    tl.store(li_ptr + ((g + 1) * L + lev) * NF + i, il)
            w_acc = tl.zeros([BLOCK], tl.int64)
            mb_acc = tl.zeros([BLOCK], tl.int64)
            f_acc = tl.zeros([L, BLOCK], tl.int64)
            best_y = tl.full([L, BLOCK], float("-inf"), tl.float32)
            best_i = tl.full([L, BLOCK], _INT_MAX, tl.int32)
            b1_y = tl.full([BLOCK], float("-inf"), tl.float32)
            b1_i = tl.full([BLOCK], _INT_MAX, tl.int32)
            for start in range(0, CHUNK, BLOCK):
                cols = s * CHUNK + start + tl.arange(0, BLOCK)
                inr = cols < V
                z = tl.math.div_rn(tl.load(base + cols, mask=inr, other=float("-inf")).to(tl.float32), t)
                before = inr & ((z > jz) | ((z == jz) & (cols < j)))
                if TOTAL:  # the row's mass W is needed whatever the candidate
                    if top_p:
                        q = _mass(z, m, PRECISE)
                        w_acc += q
                        mb_acc += tl.where(before, q, 0)
                        if CAND:
                            f_acc += tl.where(before[None, :] & _in_levels(z, cols, cl, il), q[None, :], 0)
                    if CAND:
                        best_y, best_i, b1_y, b1_i = _cand_update(best_y, best_i, b1_y, b1_i, top_p,
                                                                  before & (z >= thr), z, cols, cl, il, key)
                elif tl.max(before.to(tl.int32), 0) > 0:
                    if need_mb | need_f:
                        q = _mass(z, m, PRECISE)
                        mb_acc += tl.where(before, q, 0)
                        if CAND:
                            f_acc += tl.where(before[None, :] & _in_levels(z, cols, cl, il), q[None, :], 0)
                    if CAND:
                        best_y, best_i, b1_y, b1_i = _cand_update(best_y, best_i, b1_y, b1_i, top_p,
                                                                  before & (z >= thr), z, cols, cl, il, key)
            o = i * NS + s
            if TOTAL:
                tl.store(pw_ptr + o, tl.sum(w_acc, 0))
            if MASS:
                tl.store(pmb_ptr + g * NF * NS + o, tl.sum(mb_acc, 0))
            if CAND:
                lo = ((g + 1) * L + lev) * NF * NS + o
                tl.store(pf_ptr + lo, tl.sum(f_acc, 1))
                if top_p:
                    yb = tl.max(best_y, 1)
                    ib = tl.min(tl.where(best_y == yb[:, None], best_i, _INT_MAX), 1)
                else:  # level 0's best in every level (only level 0 is read)
                    y1 = tl.max(b1_y, 0)
                    yb = tl.zeros([L], tl.float32) + y1
                    ib = tl.zeros([L], tl.int32) + tl.min(tl.where(b1_y == y1, b1_i, _INT_MAX), 0)
                tl.store(cy_ptr + lo, yb)
                tl.store(ci_ptr + lo, ib)
    if s == 0:
        tl.store(state_ptr + (k + 1) * NF + i, new_st)


@triton.jit
def _topk_in_window(z, ids, valid, kk):
    """Mask of the kk best window tokens by (value desc, id asc); 0 < kk < number valid."""
    ukey = _order_key(z)
    tkey = tl.full((), 0, tl.uint32)
    bit = tl.full((), 0x80000000, tl.uint32)
    for _ in range(32):  # the kk-th largest key, bit by bit
        cand = tkey | bit
        cnt = tl.sum((valid & (ukey >= cand)).to(tl.int32), 0)
        tkey = tl.where(cnt >= kk, cand, tkey)
        bit = bit >> 1
    need = kk - tl.sum((valid & (ukey > tkey)).to(tl.int32), 0)
    tie = valid & (ukey == tkey)
    idc = tl.full((), _INT_MAX, tl.int32)  # every tied token is kept (the usual case: no tie)
    if need < tl.sum(tie.to(tl.int32), 0):
        idc = tl.full((), 0, tl.int32)
        ibit = tl.full((), 1 << 30, tl.int32)
        for _ in range(31):  # the need-th smallest id among the tied tokens
            cand = idc | ibit
            cnt = tl.sum((tie & (ids < cand)).to(tl.int32), 0)
            idc = tl.where(cnt < need, cand, idc)
            ibit = ibit >> 1
    return valid & ((ukey > tkey) | (tie & (ids <= idc)))


# The filtered-row count (and, below, the logprobs count) change from step to step: Triton does not
# specialise on them, so a new value (1, a multiple of 16, anything else) compiles no new variant.
@triton.jit(do_not_specialize=["frows_ptr", "prows_ptr", "vrows_ptr", "vstate_ptr", "NF", "NV", "VG"])
def _resolve_kernel(out_ptr, frows_ptr, prows_ptr, fprm_ptr, iprm_ptr, pmax_ptr, win_ptr, wz_ptr, wid_ptr,
                    wcnt_ptr, pn_ptr, pmhi_ptr, pw_ptr, pyb_ptr, pib_ptr, pval_ptr, pidx_ptr,
                    vrows_ptr, vpmax_ptr, vcj_ptr, vcz_ptr, vpw_ptr, vpmb_ptr, vstate_ptr, NF, NV, VG, NS, NSP,
                    WCAP: tl.constexpr, SP: tl.constexpr, SPP: tl.constexpr, PRECISE: tl.constexpr):
    """One program per row: window rows (the first NF) settle exactly; pivot rows (the next NV) take
    their state, or settle generation VG's candidate; plain rows reduce their chunk arg-maxes."""
    pid = tl.program_id(0)
    if (pid >= NF) & (pid < NF + NV):
        i = pid - NF
        r = tl.load(vrows_ptr + i)
        tok = tl.load(vstate_ptr + i)
        if tok == -2:
            thr = _row_max(vpmax_ptr, i, NS, SP) + tl.load(fprm_ptr + r * 4 + 2)
            kept = _pivot_kept(vpw_ptr, vpmb_ptr, i * NS, (VG * NV + i) * NS, NS, tl.load(fprm_ptr + r * 4 + 1),
                               tl.load(vcz_ptr + VG * NV + i), thr, SP)
            tok = tl.where(kept, tl.load(vcj_ptr + VG * NV + i), -1)
        tl.store(out_ptr + r, tok.to(tl.int64))
    elif pid >= NF:
        j = pid - NF - NV
        po = tl.arange(0, SPP)
        pv = tl.load(pval_ptr + j * NSP + po, mask=po < NSP, other=float("-inf"))
        pi = tl.load(pidx_ptr + j * NSP + po, mask=po < NSP, other=_INT_MAX)
        pbest = tl.max(pv, 0)
        ptok = tl.min(tl.where(pv == pbest, pi, _INT_MAX), 0)
        ptok = tl.where(ptok == _INT_MAX, 0, ptok)  # an all-NaN row: token 0, as the exact path
        tl.store(out_ptr + tl.load(prows_ptr + j), ptok.to(tl.int64))
    else:
        i = pid
        r = tl.load(frows_ptr + i)
        t = tl.load(fprm_ptr + r * 4)
        p = tl.load(fprm_ptr + r * 4 + 1)
        k = tl.load(iprm_ptr + r * 4).to(tl.int32)
        key = _row_key(tl.load(iprm_ptr + r * 4 + 1), tl.load(iprm_ptr + r * 4 + 2))
        m = tl.math.div_rn(_row_max(pmax_ptr, i, NS, SP), t)
        thr_m = m + tl.load(fprm_ptr + r * 4 + 2)
        c_hi = tl.load(win_ptr + i * 2)
        c_lo = tl.load(win_ptr + i * 2 + 1)
        so = tl.arange(0, SP)
        smask = so < NS
        n_hi = tl.sum(tl.load(pn_ptr + i * NS + so, mask=smask, other=0), 0)
        m_hi = tl.sum(tl.load(pmhi_ptr + i * NS + so, mask=smask, other=0), 0)
        w_all = tl.sum(tl.load(pw_ptr + i * NS + so, mask=smask, other=0), 0)
        yb_s = tl.load(pyb_ptr + i * NS + so, mask=smask, other=float("-inf"))
        ib_s = tl.load(pib_ptr + i * NS + so, mask=smask, other=_INT_MAX)
        yb = tl.max(yb_s, 0)
        ib = tl.min(tl.where(yb_s == yb, ib_s, _INT_MAX), 0)
        n_win = tl.load(wcnt_ptr + i)
        offs = tl.arange(0, WCAP)
        valid = offs < n_win
        z = tl.load(wz_ptr + i.to(tl.int64) * WCAP + offs, mask=valid, other=float("-inf"))
        ids = tl.load(wid_ptr + i.to(tl.int64) * WCAP + offs, mask=valid, other=_INT_MAX)
        q = tl.where(valid, _mass(z, m, PRECISE), 0)
        kk = k - n_hi
        intop = tl.where((k <= 0) | (kk != 0), valid, offs < 0)
        if (k > 0) & (kk > 0) & (kk < n_win) & (n_win <= WCAP):
            intop = _topk_in_window(z, ids, valid, kk)
        m_win = tl.sum(tl.where(intop, q, 0), 0)
        top_p = p < 1.0
        wk = tl.where(k == 0, w_all, m_hi + m_win)
        pthr = p.to(tl.float64) * wk.to(tl.float64)
        deep = c_lo <= m - 31.5
        fail = (n_win > WCAP) | (m == float("-inf"))
        fail |= (k > 0) & (kk < 0)
        fail |= top_p & (k > 0) & (kk > n_win) & (~deep)  # top-k ends below the window: W_k unknown
        fail |= top_p & (n_hi > 0) & (m_hi.to(tl.float64) >= pthr)
        cov = ((k > 0) & (kk <= n_win)) | (top_p & ((m_hi + m_win).to(tl.float64) >= pthr)) | (c_lo <= thr_m) | deep
        fail |= ~cov
        # Pareto search: arg-max of z + G among candidates; if its rank is past the top-p prefix,
        # every token ranked at or after it is too, so continue among those ranked before it.
        y = z + _gumbel(key, ids.to(tl.uint32))
        cand = tl.where(fail, offs < 0, intop & (z >= thr_m))
        win_y = tl.full((), float("-inf"), tl.float32)
        win_i = tl.full((), _INT_MAX, tl.int32)
        go = tl.max(cand.to(tl.int32), 0) > 0
        while go:
            ymax = tl.max(tl.where(cand, y, float("-inf")), 0)
            tid = tl.min(tl.where(cand & (y == ymax), ids, _INT_MAX), 0)
            tz = tl.max(tl.where(valid & (ids == tid), z, float("-inf")), 0)
            above = valid & ((z > tz) | ((z == tz) & (ids < tid)))
            rank = n_hi + tl.sum(above.to(tl.int32), 0)
            mass_above = m_hi + tl.sum(tl.where(above, q, 0), 0)
            kept = (~top_p) | (rank == 0) | (mass_above.to(tl.float64) < pthr)
            win_y = tl.where(kept, ymax, win_y)
            win_i = tl.where(kept, tid, win_i)
            cand = tl.where(kept, offs < 0, cand & above)
            go = tl.max(cand.to(tl.int32), 0) > 0
        take_above = (yb > win_y) | ((yb == win_y) & (ib < win_i))
        tok = tl.where(take_above, ib, win_i)
        tok = tl.where(fail | (tok == _INT_MAX), -1, tok)
        tl.store(out_ptr + r, tok.to(tl.int64))


@triton.jit(do_not_specialize=["N"])
def _logprob_kernel(x_ptr, stride, V, rows_ptr, chosen_ptr, pmax_ptr, psum_ptr, pcnt_ptr, cval_ptr, cid_ptr,
                    NS, N, CHUNK: tl.constexpr):
    """Per chunk of a raw-logits row: max, sum of exp(x - max), count of x > x[chosen], and the
    chunk's N best (x, id), best first (ties: lowest id)."""
    i = tl.program_id(0)
    s = tl.program_id(1)
    base = x_ptr + tl.load(rows_ptr + i).to(tl.int64) * stride
    cols = s * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    xc = tl.load(base + tl.load(chosen_ptr + i)).to(tl.float32)
    mx = tl.max(x, 0)
    o = i * NS + s
    tl.store(pmax_ptr + o, mx)
    tl.store(psum_ptr + o, tl.sum(tl.exp(tl.where(x > float("-inf"), x - mx, float("-inf"))), 0))
    tl.store(pcnt_ptr + o, tl.sum((x > xc).to(tl.int32), 0))
    for j in range(N):
        best = tl.max(x, 0)
        bid = tl.min(tl.where(x == best, cols, _INT_MAX), 0)
        tl.store(cval_ptr + o * N + j, best)
        tl.store(cid_ptr + o * N + j, bid)
        x = tl.where(cols == bid, float("-inf"), x)


@triton.jit
def _penalty_kernel(x_ptr, stride, V, rows_ptr, slots_ptr, cnt_ptr, pen_ptr,
                    REP: tl.constexpr, FREQ: tl.constexpr, BLOCK: tl.constexpr):
    """Repetition, frequency and presence penalties of one block of one row, in place.

    Counts are ``2 * output count + (1 if in the prompt)``; the arithmetic is the PyTorch
    reference's, operation for operation (launched without FMA contraction, so bit-identical)."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inr = cols < V
    xp = x_ptr + tl.load(rows_ptr + i) * stride + cols
    x = tl.load(xp, mask=inr, other=0.0)
    c = tl.load(cnt_ptr + tl.load(slots_ptr + i) * V + cols, mask=inr, other=0)
    if REP:
        rp = tl.load(pen_ptr + i * 3)
        x = tl.where(c > 0, tl.where(x > 0, tl.math.div_rn(x, rp), x * rp), x)
    if FREQ:
        n = c >> 1
        x = tl.where(n > 0, x - (tl.load(pen_ptr + i * 3 + 1) * n.to(tl.float32) + tl.load(pen_ptr + i * 3 + 2)), x)
    tl.store(xp, x, mask=inr)


@triton.jit
def _argmax_pick(f, v, i):
    # The lane torch.argmax picks among (NaN flag f, value v, index i): a NaN first (NaN lanes carry
    # v = 0), then the largest value, then the lowest index. Returns (f, v, i) of that lane.
    bf = tl.max(f, 0)
    bv = tl.max(tl.where(f == bf, v, float("-inf")), 0)
    bi = tl.min(tl.where((f == bf) & (v == bv), i, _INT_MAX), 0)
    return bf, bv, bi


@triton.jit
def _argmax_chunk_kernel(x_ptr, stride, V, pf_ptr, pv_ptr, pi_ptr, NS, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row i, chunk s): the arg-max of ``x[i, s * CHUNK : (s + 1) * CHUNK]`` as (NaN flag,
    value, index) at ``[i * NS + s]``."""
    i = tl.program_id(0)
    s = tl.program_id(1)
    base = x_ptr + i.to(tl.int64) * stride
    bf = tl.zeros([BLOCK], tl.int32)
    bv = tl.full([BLOCK], float("-inf"), tl.float32)
    bi = tl.full([BLOCK], _INT_MAX, tl.int32)
    for start in range(0, CHUNK, BLOCK):
        cols = s * CHUNK + start + tl.arange(0, BLOCK)
        inr = cols < V
        x = tl.load(base + cols, mask=inr, other=float("-inf")).to(tl.float32)
        f = (x != x).to(tl.int32)
        v = tl.where(f > 0, 0.0, x)
        upd = inr & ((f > bf) | ((f == bf) & ((v > bv) | ((v == bv) & (cols < bi)))))
        bf = tl.where(upd, f, bf)
        bv = tl.where(upd, v, bv)
        bi = tl.where(upd, cols, bi)
    rf, rv, ri = _argmax_pick(bf, bv, bi)
    tl.store(pf_ptr + i * NS + s, rf)
    tl.store(pv_ptr + i * NS + s, rv)
    tl.store(pi_ptr + i * NS + s, ri)


@triton.jit
def _argmax_resolve_kernel(pf_ptr, pv_ptr, pi_ptr, out_ptr, NS, SP: tl.constexpr):
    """Program (row i): the arg-max of its ``NS`` chunk results, stored as int64 at ``out[i]``."""
    i = tl.program_id(0)
    k = tl.arange(0, SP)
    ok = k < NS
    f = tl.load(pf_ptr + i * NS + k, mask=ok, other=-1)
    v = tl.load(pv_ptr + i * NS + k, mask=ok, other=float("-inf"))
    idx = tl.load(pi_ptr + i * NS + k, mask=ok, other=_INT_MAX)
    _, _, bi = _argmax_pick(f, v, idx)
    tl.store(out_ptr + i, bi.to(tl.int64))


# ---- host side ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _depths(device: torch.device) -> torch.Tensor:
    return torch.tensor(STAGE1_DEPTHS, dtype=torch.float32, device=device)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _carve(sizes: list[int], dtype: torch.dtype, dev: torch.device) -> list[torch.Tensor]:
    """Uninitialised 1-D buffers of ``sizes`` elements from one allocation, each starting 16 bytes
    aligned (Triton specialises on pointer alignment: a part whose offset depends on the row count
    would compile a variant per alignment)."""
    per = max(1, 16 // dtype.itemsize)
    padded = [-(-n // per) * per for n in sizes]
    buf = torch.empty(sum(padded), dtype=dtype, device=dev)
    return [part[:n] for part, n in zip(buf.split(padded), sizes)]


def draw(logits: torch.Tensor, fprm: torch.Tensor, iprm: torch.Tensor, plain_rows: torch.Tensor,
         filt_rows: torch.Tensor, n_pivot: Optional[int] = None, check: bool = False) -> torch.Tensor:
    """Choose one token per row of ``logits`` (see the module docstring and engine/sampling/sampler.py).

    Args:
        logits: [S, V] float32/bfloat16/float16, last dimension contiguous (CUDA, or CPU tensors
            under TRITON_INTERPRET=1).
        fprm: [S, 4] float32 per row: temperature (0 = greedy), top_p, log(min_p) (-inf = off), 0.
        iprm: [>= S, 4] int64 per row: top_k (0 = off, < V), seed, step (output position), 0.
        plain_rows: [P] int32/int64 rows drawn without filters (greedy or plain temperature).
        filt_rows: [F] int32/int64 rows with top-k/top-p/min-p (temperature > 0, top_p > 0).
        n_pivot: how many rows at the END of ``filt_rows`` have top_k == 0 (top-p and/or min-p
            only); they take the pivot path (module docstring), the others the window path. None:
            draw finds them itself, at the cost of one device->host read (the engine passes it).
            A row with top_k > 0 among the last n_pivot is not mis-drawn: it comes back as -1.
        check: the pivot kernels clamp every index they compute to its buffer and record the
            ones that were outside; `draw` then raises RuntimeError with the records (a
            diagnostic, `kvpilot.tuning.Tuning.sampling_check`).
    Returns:
        [S] int64 token ids on the logits' device; -1 where a filtered row needs the exact
        reference; rows in neither list are left uninitialised.
    Raises:
        ValueError: logits not contiguous along the vocabulary, more than ``MAX_VOCAB`` columns,
            n_pivot outside [0, F], or
            ``CONFIG["pivot_levels"]`` not a power of 2.
    """
    S, V = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits must be contiguous along the vocabulary")
    _check_vocab(V)
    dev = logits.device
    cfg = CONFIG
    chunk = min(cfg["chunk"], max(cfg["block"], _pow2(V)))
    NS = triton.cdiv(V, chunk)
    SP = _pow2(NS)
    wcap = cfg["wcap"]
    precise = dev.type == "cuda" and libdevice is not None and not envs.triton_interpret()
    stride = logits.stride(0)
    out = torch.empty(S, dtype=torch.int64, device=dev)
    P = plain_rows.numel()
    G = cfg["pivot_rounds"]
    if G <= 0:  # pivot path off: every filtered row takes the window path
        n_pivot = 0
    elif n_pivot is None:
        k0 = iprm[filt_rows.long(), 0] == 0
        n_pivot = int(k0.sum())
        if 0 < n_pivot < filt_rows.numel():
            filt_rows = torch.cat([filt_rows[~k0], filt_rows[k0]])
    if not 0 <= n_pivot <= filt_rows.numel():
        raise ValueError(f"n_pivot must be in [0, {filt_rows.numel()}], got {n_pivot}")
    F = filt_rows.numel() - n_pivot
    NV = n_pivot
    piv_rows, filt_rows = filt_rows[F:], filt_rows[:F]
    f32 = torch.float32
    pval = torch.empty(max(P, 1) * NS, dtype=f32, device=dev)
    pidx = torch.empty(max(P, 1) * NS, dtype=torch.int32, device=dev)
    one_long = torch.empty(1, dtype=torch.int64, device=dev)
    if P:
        _plain_kernel[(P, NS)](logits, stride, V, plain_rows, fprm, iprm, pval, pidx, NS,
                               CHUNK=chunk, BLOCK=cfg["block"], num_warps=4)
    if NV:
        LV = cfg["pivot_levels"]
        if LV < 1 or LV & (LV - 1):
            raise ValueError(f"CONFIG['pivot_levels'] must be a power of 2, got {LV}")
        vpmax, vcy, vlv, vcz = _carve([NV * NS, G * LV * NV * NS, G * LV * NV, G * NV], f32, dev)
        fuse = bool(cfg["pivot_fuse"])
        launches = G if fuse else 2 * G - 1  # of _pivot_kernel; each writes its own row of states
        vci, vli, vcj, vstates = _carve([G * LV * NV * NS, G * LV * NV, G * NV, (launches + 1) * NV], torch.int32,
                                        dev)
        vpw, vpmb, vpf = _carve([NV * NS, G * NV * NS, G * LV * NV * NS], torch.int64, dev)
        grid = (NV, NS)
        mblock = min(cfg["pivot_block"], chunk)  # M passes
        cblock = min(cfg["pivot_cblock"], chunk)  # passes that find candidates ([levels, block] registers)
        check = bool(check)
        dbg = torch.zeros(NV * NS * 8 if check else 1, dtype=torch.int32, device=dev)
        _pivot_first_kernel[grid](logits, stride, V, piv_rows, fprm, iprm, vpmax, vcy, vci, vstates, NS, dbg, S,
                                  CHUNK=chunk, BLOCK=mblock, CHECK=check, num_warps=4)
        args = (logits, stride, V, piv_rows, fprm, iprm, vpmax, vcy, vci, vpf, vlv, vli, vcj, vcz, vpw, vpmb, vstates,
                NV, NS, dbg, S, vcy.numel())
        k = 0
        for g in range(G):
            cand = fuse and g < G - 1
            # M pass of generation g (fused: also settles g - 1 and finds generation g + 1's candidates)
            _pivot_kernel[grid](*args, g, k, DECIDE=1 if fuse and g else 0, MASS=True, TOTAL=g == 0, CAND=cand,
                                L=LV, SP=SP, CHUNK=chunk, BLOCK=cblock if cand else mblock, PRECISE=precise,
                                CHECK=check, num_warps=4)
            k += 1
            if not fuse and g < G - 1:  # C pass: settle generation g, else find g + 1's candidates
                _pivot_kernel[grid](*args, g, k, DECIDE=2, MASS=False, TOTAL=False, CAND=True, L=LV, SP=SP,
                                    CHUNK=chunk, BLOCK=cblock, PRECISE=precise, CHECK=check, num_warps=4)
                k += 1
        assert k == launches
        vstate = vstates[launches * NV:]
        if check:
            rec = dbg.view(-1, 8)
            rec = rec[rec[:, 0] != 0].tolist()
            if rec:
                raise RuntimeError(f"pivot path read outside its buffers: {len(rec)} records "
                                   f"(code, value, bound, g, row, extra), first {rec[:8]}")
    else:  # placeholders of the right dtypes (see below)
        vpmax = vcz = pval
        vcj = vstate = pidx
        vpw = vpmb = one_long
    L = len(STAGE1_DEPTHS)
    if F:
        plani, pcnt1, pcnt2, pn, pib, wcnt = _carve([4 * F, F * NS * L, F * NS * L, F * NS, F * NS, F],
                                                    torch.int32, dev)
        planf, sub, pmass1, pmass2, win, pmax, pyb = _carve(
            [8 * F, F * L, F * NS * L, F * NS * L, 2 * F, F * NS, F * NS], f32, dev)
        pmhi, pw = _carve([F * NS, F * NS], torch.int64, dev)
        wz = torch.empty(F * wcap, dtype=f32, device=dev)
        wid = torch.empty(F * wcap, dtype=torch.int32, device=dev)
        depths = _depths(dev)
        grid = (F, NS)
        _max_kernel[grid](logits, stride, V, filt_rows, pmax, wcnt, NS, CHUNK=chunk, BLOCK=cfg["block"],
                          num_warps=4)
        sb = min(cfg["stats_block"], chunk)
        for stage in (1, 2):
            _stats_kernel[grid](logits, stride, V, filt_rows, fprm, iprm, pmax, depths, pcnt1, pmass1,
                                planf, plani, sub, pcnt2, pmass2, NS, wcap, STAGE=stage, L=L, SP=SP,
                                CHUNK=chunk, BLOCK=sb, num_warps=8)
        _collect_kernel[grid](logits, stride, V, filt_rows, fprm, iprm, pmax, planf, plani, sub, pcnt2, pmass2,
                              win, wz, wid, wcnt, pn, pmhi, pw, pyb, pib, NS, wcap, L=L, SP=SP, CHUNK=chunk,
                              BLOCK=min(cfg["collect_block"], chunk), PRECISE=precise, num_warps=4)
    else:
        # Unused by the launch below (no window rows), but the kernel is still compiled for their
        # dtypes: every placeholder must have the dtype of the buffer it stands for.
        wcnt = wid = pn = pib = pidx
        pmax = win = wz = pyb = pval
        pmhi = pw = one_long
    if P or F or NV:
        _resolve_kernel[(F + NV + P,)](out, filt_rows, plain_rows, fprm, iprm, pmax, win, wz, wid, wcnt, pn, pmhi,
                                       pw, pyb, pib, pval, pidx, piv_rows, vpmax, vcj, vcz, vpw, vpmb, vstate,
                                       F, NV, max(G - 1, 0), NS, NS, WCAP=wcap, SP=SP, SPP=SP,
                                       PRECISE=precise, num_warps=16 if wcap >= 4096 else 4)
    return out


def raw_logprobs(logits: torch.Tensor, rows: torch.Tensor, chosen: torch.Tensor, n: int):
    """Log-probabilities of the raw distribution (``log_softmax(logits[rows])``) without [R, V] copies.

    Args:
        logits: [S, V] float32/bfloat16/float16, last dimension contiguous.
        rows: [R] int64 rows of ``logits``; chosen: [R] int64 chosen token per row; n: top-n >= 0.
    Returns:
        (chosen logprob [R] float32, rank [R] int64 = 1 + number of larger logits,
        top-n logprobs [R, n] float32 best first, their ids [R, n] int64).
    """
    S, V = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits must be contiguous along the vocabulary")
    _check_vocab(V)
    R, dev = rows.numel(), logits.device
    chunk = min(4096, _pow2(V))
    NS = triton.cdiv(V, chunk)
    f = torch.empty(R * NS * (2 + n), dtype=torch.float32, device=dev)
    pmax, psum, cval = f.split([R * NS, R * NS, R * NS * n])
    ints = torch.empty(R * NS * (1 + n), dtype=torch.int32, device=dev)
    pcnt, cid = ints.split([R * NS, R * NS * n])
    _logprob_kernel[(R, NS)](logits, logits.stride(0), V, rows, chosen, pmax, psum, pcnt, cval, cid, NS, n,
                             CHUNK=chunk, num_warps=8)
    pmax, psum = pmax.view(R, NS), psum.view(R, NS)
    top = pmax.max(dim=1, keepdim=True).values
    lse = top + torch.log((psum * torch.exp(pmax - top)).sum(dim=1, keepdim=True))
    xc = logits[rows, chosen].float()[:, None]
    ranks = pcnt.view(R, NS).sum(dim=1) + 1
    if n:
        vals, pos = cval.view(R, NS * n).topk(n, dim=1)
        ids = cid.view(R, NS * n).gather(1, pos).long()
        top_lp = vals - lse
    else:
        ids = torch.empty(R, 0, dtype=torch.int64, device=dev)
        top_lp = torch.empty(R, 0, device=dev)
    return (xc - lse).squeeze(1), ranks, top_lp, ids


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                    pen: torch.Tensor, rep: bool = True, freq: bool = True) -> None:
    """Repetition (HF) and frequency/presence (OpenAI) penalties in place, one pass over the rows.

    Args:
        logits: [S, V] float32, last dimension contiguous; rows ``rows`` are modified.
        rows: [P] int64 rows of ``logits``; slots: [P] int64 rows of ``counts``.
        counts: [N, V] int32, contiguous: ``2 * (count in the output) + (1 if in the prompt)`` per
            token (kvpilot.sampling.logits_processors.TokenCounts).
        pen: [P, 3] float32 contiguous: repetition, frequency, presence penalty per row.
        rep / freq: whether any row has a repetition penalty / a frequency or presence penalty.
    Only tokens with a count change (``x / rep`` or ``x * rep`` where seen, then
    ``x - (frequency * n + presence)`` where the output holds them n > 0 times); the values equal
    ``kvpilot.sampling.logits_processors._penalties_torch`` bit for bit.
    """
    S, V = logits.shape
    if logits.stride(1) != 1 or logits.dtype != torch.float32:
        raise ValueError("logits must be float32 and contiguous along the vocabulary")
    if not counts.is_contiguous() or counts.shape[1] != V or counts.dtype != torch.int32:
        raise ValueError(f"counts must be a contiguous int32 [N, {V}] tensor")
    _check_vocab(V)
    P = rows.numel()
    if P == 0 or not (rep or freq):
        return
    block = 2048
    _penalty_kernel[(P, triton.cdiv(V, block))](logits, logits.stride(0), V, rows, slots, counts, pen.contiguous(),
                                                 REP=rep, FREQ=freq, BLOCK=block, num_warps=4,
                                                 enable_fp_fusion=False)


ARGMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Logits dtypes `argmax` takes (every value is exact in float32, where the kernels compare)."""
_ARGMAX_MAX_CHUNKS = 1024


def argmax(logits: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` in two launches that spread each row over many programs.

    PyTorch's reduction gave a batch-1 row of 128,256 float32 logits to few programs: 27 us on an
    H200 inside the decode step (BENCHMARKS.md). Here ``CONFIG["chunk"]`` columns per
    program (32 programs per row at 128k), then one program per row reduces the chunks.
    Same result as ``torch.argmax``: the first NaN of a row if it has one, else the first maximum.

    Args:
        logits: [S, V] float32/bfloat16/float16, last dimension contiguous, V < 2**31 (CUDA, or CPU
            tensors under TRITON_INTERPRET=1).
        out: optional [S] int64 tensor on the same device to write the ids into.
    Returns:
        [S] int64 ids (``out`` when given).
    Raises:
        ValueError: logits not 2-D, not contiguous along the vocabulary or of another dtype (the
            kernels compare in float32: float64 rows would tie where they differ), an empty
            vocabulary, or a wrong ``out``.
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [S, V] and contiguous along V, got {tuple(logits.shape)}, "
                         f"strides {logits.stride()}")
    if logits.dtype not in ARGMAX_DTYPES:
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    S, V = logits.shape
    if V == 0 or V >= 2**31:
        raise ValueError(f"the vocabulary must hold 1 .. 2**31 - 1 columns, got {V}")
    dev = logits.device
    if out is None:
        out = torch.empty(S, dtype=torch.int64, device=dev)
    elif out.shape != (S,) or out.dtype != torch.int64 or out.device != dev or out.stride(0) != 1:
        raise ValueError(f"out must be a contiguous [{S}] int64 tensor on {dev}")
    if S == 0:
        return out
    cfg = CONFIG
    # At most _ARGMAX_MAX_CHUNKS programs per row (CUDA's second grid dimension stops at 65,535 and
    # the resolve program holds them all): chunks grow past CONFIG["chunk"] only for vocabularies
    # above _ARGMAX_MAX_CHUNKS * CONFIG["chunk"] columns.
    chunk = max(min(cfg["chunk"], max(cfg["block"], _pow2(V))), _pow2(triton.cdiv(V, _ARGMAX_MAX_CHUNKS)))
    block = min(cfg["block"], chunk)
    NS = triton.cdiv(V, chunk)
    pf, pi = _carve([S * NS, S * NS], torch.int32, dev)
    pv = torch.empty(S * NS, dtype=torch.float32, device=dev)
    _argmax_chunk_kernel[(S, NS)](logits, logits.stride(0), V, pf, pv, pi, NS, CHUNK=chunk, BLOCK=block,
                                  num_warps=4)
    _argmax_resolve_kernel[(S,)](pf, pv, pi, out, NS, SP=_pow2(NS), num_warps=1)
    return out
