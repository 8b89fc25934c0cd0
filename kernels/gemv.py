"""Fused small-batch matrix-vector products (GEMV) for decode: RMSNorm->GEMV, SiLU-and-mul->GEMV.

At batch 1 a decode layer's matrix products read every weight once and do two flops per weight
byte, so they are bound by HBM bandwidth; the norm and activation kernels between them move a few
kilobytes and are bound by launch latency (about 2 us each inside a CUDA graph). These kernels fold
the norm and the activation into the product that consumes them:

- ``rmsnorm_gemv(x, residual, norm_weight, eps, W)``: ``h = x + residual``,
  ``y = (RMSNorm(h) * norm_weight) @ W.T``; returns ``(y, h)`` (``y`` alone without a residual).
- ``silu_mul_gemv(gate_up, W)``: ``y = (silu(gate) * up) @ W.T``, gate_up = ``[gate | up]``.
- ``gelu_tanh_mul_gemv(gate_up, W)``: ``y = (gelu_tanh(gate) * up) @ W.T`` (GeGLU, Gemma); the SiLU
  op's kernel with another prologue, and its launch table and ``FUSED_MAX_ROWS["silu"]`` (the same
  bytes move; not measured separately).
- ``gemv(x, W)``: ``y = x @ W.T``.

``W`` is an ``nn.Linear`` weight, ``[N, K]`` row-major; every op takes an optional ``bias`` ``[N]``.
``gemv`` and ``silu_mul_gemv`` also take ``out_dtype``: ``torch.float32`` returns the fp32
accumulator (plus bias) unrounded, for a tensor-parallel row-parallel layer that sums partial
products across ranks before rounding once (engine/model/llama.py); the default (None) is the input dtype,
bit-identical to calling without it.
Each op has a ``*_ref`` (PyTorch: the references of ``reference.py`` + ``F.linear``), a
``*_triton`` (any ``M <= MAX_TRITON_ROWS``) and a dispatcher: Triton for CUDA inputs of at most
``FUSED_MAX_ROWS[op]`` rows, where it measured faster than the unfused pair on an H200 (M = 1;
M <= 2 for ``gemv``); else the package's separate ``rms_norm`` / ``silu_and_mul`` (Triton on CUDA)
and ``F.linear`` (cuBLAS), which on CPU is exactly the reference.

Kernel (one for all three ops; the prologue is a compile-time switch). A program owns
``BLOCK_N`` output columns for all ``M <= BLOCK_M`` rows and walks the whole of K: no split-K, as
every shape here has 256 or more column tiles, so splitting K would only add a reduction. Per K
tile it loads the ``[BLOCK_N, BLOCK_K]`` weight tile (rows of W are contiguous: 16-byte loads
along K), builds the activation tile from the inputs (norm or SiLU on the fly) and accumulates in
fp32:

- "fma" (small M): a register accumulator ``[BLOCK_M, BLOCK_N, BLOCK_K]`` of products, summed
  over K once at the end, so there is no cross-thread reduction inside the loop;
- "dot" (larger M): ``tl.dot`` on ``[16, BLOCK_K] x [BLOCK_K, BLOCK_N]`` (mma). Rows past M are
  clamped copies of row M-1 and are never stored. ``num_stages`` tiles are in flight.
- ``prefetch`` (either): register double buffering of the next K tile.
- ``vec`` (fma, M = 1 only): weight tiles loaded as ``[BLOCK_N, BLOCK_K / vec, vec]`` and each
  thread's vector of products summed at once, a ``vec`` times smaller accumulator.

The RMSNorm prologue needs each row's mean square before the first tile. So every program first
sweeps its rows of ``x`` (+ ``residual``) once (``M * K`` elements, from L2 after the first
program), then normalises each K tile as it loads it. That sweep is a chain of dependent L2 round
trips before the first weight load, so the RMSNorm configurations cap the grid at a few programs
per SM (``programs_per_sm``). Each program then loops over several column tiles and pays for the
sweep once: on the H200 this took gate_up at M = 1 from 68 to 62 us. Program 0 alone writes ``h``.
The rounding points are the references': ``h`` is rounded to the input dtype, the normalised row
is rounded before the weight multiply, and the activation is rounded to the input dtype before the
product.

Launch configurations: ``CONFIGS`` / ``gemv_config``; docs/kernels.md ("Fused decode GEMV") has
the H200 measurements behind them.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .reference import gelu_tanh_and_mul_ref, rms_norm_ref, silu_and_mul_ref

from kvpilot import envs

try:  # the references and dispatchers work without Triton
    import triton
    import triton.language as tl

    from .pdl import launch_options, pdl_mode, pdl_trigger, pdl_wait
    from .pointwise import _gelu_tanh
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None

__all__ = [
    "MAX_TRITON_ROWS",
    "gemv",
    "gemv_ref",
    "gemv_triton",
    "gemv_config",
    "FUSED_MAX_ROWS",
    "launch_config",
    "rmsnorm_gemv",
    "rmsnorm_gemv_ref",
    "rmsnorm_gemv_triton",
    "silu_mul_gemv",
    "silu_mul_gemv_ref",
    "silu_mul_gemv_triton",
    "gelu_tanh_mul_gemv",
    "gelu_tanh_mul_gemv_ref",
    "gelu_tanh_mul_gemv_triton",
]

MAX_TRITON_ROWS = 16
"""The ``*_triton`` functions take at most this many rows (tokens); the launch tables end here."""

_PLAIN, _RMSNORM, _SILU, _GELU = 0, 1, 2, 3
# Launch-table names (CONFIGS, FUSED_MAX_ROWS): GELU-and-mul takes SiLU-and-mul's.
_PROLOGUE_NAMES = {_PLAIN: "plain", _RMSNORM: "rmsnorm", _SILU: "silu", _GELU: "silu"}


# ---------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------


def _check_linear(a_cols: int, weight: torch.Tensor, bias: torch.Tensor | None, name: str) -> None:
    if weight.dim() != 2 or weight.shape[1] != a_cols:
        raise ValueError(f"{name}: weight must be [N, {a_cols}], got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{name}: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")


def _check_silu(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                name: str = "silu_mul_gemv") -> None:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"{name}: gate_up must be [M, 2 * I] (gate|up), got {tuple(gate_up.shape)}")
    _check_linear(gate_up.shape[1] // 2, weight, bias, name)


def _check_out_dtype(x: torch.Tensor, out_dtype: torch.dtype | None) -> bool:
    """True when ``out_dtype`` asks for an output other than ``x.dtype`` (only float32 may)."""
    if out_dtype is None or out_dtype == x.dtype:
        return False
    if out_dtype != torch.float32:
        raise ValueError(f"out_dtype must be None, the input dtype or torch.float32, got {out_dtype}")
    return True


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            out_dtype: torch.dtype | None) -> torch.Tensor:
    """``F.linear``, or with ``out_dtype=torch.float32`` its fp32 accumulator (bias added in fp32),
    unrounded: ``torch.mm(..., out_dtype=torch.float32)`` (cuBLAS, fp16/bf16 inputs, CUDA only);
    elsewhere ``F.linear`` on the inputs converted to float32 (exact: 16-bit values are fp32 values)."""
    if not _check_out_dtype(x, out_dtype):
        return F.linear(x, weight, bias)
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        y = torch.mm(x, weight.t(), out_dtype=torch.float32)
        return y if bias is None else y.add_(bias)
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` (``F.linear``).

    Args:
        x: ``[M, K]``. weight: ``[N, K]``, same dtype. bias: optional ``[N]``.
        out_dtype: None (``x.dtype``) or ``torch.float32``: the fp32 accumulator plus bias,
            unrounded (``torch.mm(..., out_dtype=torch.float32)`` for 16-bit CUDA inputs).

    Returns:
        ``[M, N]`` in ``out_dtype`` (default ``x.dtype``).

    Raises:
        ValueError: on mismatched shapes, or another ``out_dtype``.
    """
    if x.dim() != 2:
        raise ValueError(f"gemv: x must be [M, K], got {tuple(x.shape)}")
    _check_linear(x.shape[1], weight, bias, "gemv")
    return _linear(x, weight, bias, out_dtype)


def rmsnorm_gemv_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm_ref(x, norm_weight, eps, residual)`` followed by ``F.linear(., weight, bias)``.

    Args:
        x: ``[M, K]``. residual: ``None`` or ``[M, K]``, same dtype. norm_weight: ``[K]``.
        eps: RMSNorm epsilon. weight: ``[N, K]`` in ``x.dtype``. bias: optional ``[N]``.

    Returns:
        ``y`` ``[M, N]`` in ``x.dtype`` without a residual; ``(y, h)`` with one, where
        ``h = x + residual`` (rounded to ``x.dtype``) is the new residual stream.

    Raises:
        ValueError: on mismatched shapes.
    """
    _check_linear(x.shape[-1], weight, bias, "rmsnorm_gemv")
    out = rms_norm_ref(x, norm_weight, eps, residual)
    if residual is None:
        return F.linear(out, weight, bias)
    normed, h = out
    return F.linear(normed, weight, bias), h


def silu_mul_gemv_ref(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``F.linear(silu_and_mul_ref(gate_up), weight, bias)``.

    Args:
        gate_up: ``[M, 2 * I]``, gate in the first half, up in the second.
        weight: ``[N, I]`` in ``gate_up.dtype``. bias: optional ``[N]``.
        out_dtype: as for :func:`gemv_ref` (the activation is still rounded to ``gate_up.dtype``).

    Returns:
        ``[M, N]`` in ``out_dtype`` (default ``gate_up.dtype``).

    Raises:
        ValueError: on an odd last dimension, mismatched shapes, or another ``out_dtype``.
    """
    _check_silu(gate_up, weight, bias)
    return _linear(silu_and_mul_ref(gate_up), weight, bias, out_dtype)


def gelu_tanh_mul_gemv_ref(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``F.linear(gelu_tanh_and_mul_ref(gate_up), weight, bias)``; shapes, ``out_dtype`` and errors as
    :func:`silu_mul_gemv_ref`."""
    _check_silu(gate_up, weight, bias, "gelu_tanh_mul_gemv")
    return _linear(gelu_tanh_and_mul_ref(gate_up), weight, bias, out_dtype)


# ---------------------------------------------------------------------------------------------
# Launch configurations
# ---------------------------------------------------------------------------------------------

def launch_config(kind: str, block_m: int, block_n: int, block_k: int, num_warps: int = 4,
                  num_stages: int = 1, prefetch: bool = False, programs_per_sm: int = 0,
                  norm_one_load: bool = False, early_weight: bool = False, vec: int = 0,
                  min_k: int = 0) -> dict:
    """One launch configuration.

    ``kind`` "fma" (register products; ``block_m`` up to 8) or "dot" (``tl.dot``; every block
    >= 16).
    ``min_k``: as a launch-table row, the configuration only serves weights of at least that many
    columns (:func:`gemv_config` passes over it for smaller K).
    ``prefetch`` double-buffers the K tiles in registers. ``programs_per_sm`` > 0 caps the grid at
    that many programs per SM, each looping over several column tiles (persistent programs: the
    RMSNorm pass runs once per program instead of once per tile); 0 launches one
    program per ``block_n`` columns. ``norm_one_load`` makes the RMSNorm pass one load of each
    whole row (when ``block_m * next_pow2(K) <= NORM_ONE_LOAD_MAX``; else the K-tile loop).
    ``early_weight`` issues a program's first weight tile before that one-load pass (RMSNorm
    prologue only; not with ``prefetch``).
    ``vec`` > 0 (fma, ``block_m`` 1, no ``prefetch`` / ``early_weight``) loads weight tiles as
    ``[block_n, block_k / vec, vec]`` and sums each ``vec`` run of products at once, so the
    accumulator is ``vec`` times smaller (``vec`` = 16 bytes / element size keeps one vector per thread).

    Raises ValueError on an unknown ``kind``, ``early_weight`` with ``prefetch``, or a ``vec`` that
    is not 0 or a power of two or is combined with what it excludes.
    """
    if kind not in ("fma", "dot"):
        raise ValueError(f"kind must be 'fma' or 'dot', got {kind!r}")
    return _check_config(dict(use_dot=kind == "dot", block_m=block_m, block_n=block_n,
                              block_k=block_k, num_warps=num_warps, num_stages=num_stages, prefetch=prefetch,
                              programs_per_sm=programs_per_sm, norm_one_load=norm_one_load,
                              early_weight=early_weight, vec=vec, min_k=min_k))  # fmt: skip


def _check_config(cfg: dict) -> dict:
    """``cfg`` itself after checking the option combinations the kernel cannot run (ValueError).

    Also applied to ``config=`` dicts given to the ``*_triton`` functions: a ``vec`` dict edited to
    ``block_m`` > 1 or ``use_dot`` would otherwise read the row ``sum(rows)`` of ``x`` (beyond M)."""
    vec = cfg.get("vec", 0)
    if cfg.get("early_weight") and cfg.get("prefetch"):
        raise ValueError("early_weight and prefetch cannot be combined")
    if vec < 0 or vec & (vec - 1):
        raise ValueError(f"vec must be 0 or a power of two, got {vec}")
    if vec and (cfg["use_dot"] or cfg["block_m"] != 1 or cfg.get("prefetch") or cfg.get("early_weight")
                or cfg["block_k"] % vec):
        raise ValueError("vec needs kind 'fma', block_m 1, block_k a multiple of vec, no prefetch or early_weight")
    return cfg


NORM_ONE_LOAD_MAX = 4096
"""Largest ``block_m * next_pow2(K)`` for the one-load RMSNorm pass (``launch_config``), which also
gates ``early_weight``: measured at K = 4096 (Llama-3.1-8B). Above it ptxas needs more registers
than the launch table's programs per SM allow (K = 16384: 164 for the ``vec`` row, 250 for gate/up's,
from a CPU compile for sm_90; tests/kernels/test_gemv_batch_one.py), so larger hidden sizes keep the
K-tile loop until measured."""


_cfg = launch_config
# Per prologue, rows (max rows M, min N, configuration): the first row with M <= max rows and
# N >= min N (and K >= the configuration's min_k) is used. Chosen by benchmarks/lab/gpu_gemv.py --sweep
# on an H200 at the Llama-3.1-8B shapes, timed inside CUDA graphs (docs/kernels.md, "Fused decode
# GEMV"). Weight tiles streamed by TMA into shared memory were measured too (32 layers with a bf16
# KV cache 3% faster, the engine's batch-1 ITL unchanged with bf16 or FP8 KV caches; BENCHMARKS.md),
# and left out.
CONFIGS: dict[str, list[tuple[int, int, dict]]] = {
    "rmsnorm": [
        (1, 16384, _cfg("fma", 1, 8, 1024, programs_per_sm=4, norm_one_load=True, early_weight=True)),
        # Tensor parallelism 2's gate/up and QKV shards ([14336, 4096], [3072, 4096]): 33.7 / 9.6 us
        # against 34.7 / 10.4 with the rows of the unsplit shapes (`gpu_gemv_vec.py --tp 2`).
        (1, 8192, _cfg("fma", 1, 8, 1024, norm_one_load=True, early_weight=True)),
        (1, 4096, _cfg("fma", 1, 4, 2048, programs_per_sm=8, norm_one_load=True, vec=8)),
        (1, 0, _cfg("fma", 1, 4, 1024, programs_per_sm=6, norm_one_load=True, early_weight=True)),
        (2, 16384, _cfg("fma", 2, 8, 512, programs_per_sm=4)),
        (2, 0, _cfg("fma", 2, 4, 1024, programs_per_sm=4)),
        (16, 0, _cfg("dot", 16, 32, 256, num_stages=3, programs_per_sm=2)),
    ],
    "silu": [
        (1, 0, _cfg("fma", 1, 8, 1024, num_stages=3)),
        (2, 0, _cfg("fma", 2, 8, 512)),
        (4, 0, _cfg("fma", 4, 8, 256, prefetch=True)),
        (16, 0, _cfg("dot", 16, 32, 256, prefetch=True)),
    ],
    "plain": [
        (1, 0, _cfg("fma", 1, 2, 2048, vec=8)),
        (2, 0, _cfg("fma", 2, 8, 512)),
        (4, 0, _cfg("fma", 4, 8, 256, prefetch=True)),
        (16, 0, _cfg("dot", 16, 32, 256, num_stages=3)),
    ],
}
"""Launch tables of :func:`gemv_config` (benchmarks may replace them)."""

FUSED_MAX_ROWS: dict[str, int] = {"rmsnorm": 1, "silu": 1, "plain": 2}
"""Per op, the largest M at which the dispatchers run the Triton kernel: measured on an H200,
the fused kernel beats the unfused pair (rms_norm / silu_and_mul + cuBLAS) only up to there."""


def gemv_config(m: int, n: int, k: int, prologue: str = "plain") -> dict:
    """Launch configuration for ``m`` rows (``1 <= m <= MAX_TRITON_ROWS``) of a ``[n, k]`` weight.

    ``prologue`` is "plain" (``gemv``), "rmsnorm" or "silu". Returns a :func:`launch_config` dict
    from the first row of ``CONFIGS[prologue]`` that fits. Raises ValueError when none does.
    """
    for max_m, min_n, cfg in CONFIGS[prologue]:
        if m <= max_m and n >= min_n and k >= cfg.get("min_k", 0):
            return cfg
    raise ValueError(f"no GEMV launch configuration for {m} rows of a [{n}, {k}] weight ({prologue})")


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _load(ptrs, k_ok, EVEN_K: tl.constexpr):
        # Unmasked when K is a multiple of BLOCK_K, so the loads stay 16 bytes wide.
        if EVEN_K:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=k_ok, other=0.0)

    @triton.jit
    def _load_tile(
        w_rows, x_ptr, res_ptr, nw_ptr, rows, offs_k, rstd, stride_xm, stride_rm,
        K, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr,
    ):  # fmt: skip
        # The [BLOCK_N, BLOCK_K] weight tile and the [BLOCK_M, BLOCK_K] activation tile (input
        # dtype) at columns offs_k; the weight load is issued first.
        w = _load(w_rows + offs_k[None, :], (offs_k < K)[None, :], EVEN_K)
        a = _activation(x_ptr, res_ptr, nw_ptr, rows, offs_k, rstd, stride_xm, stride_rm, K, PROLOGUE,
                        HAS_RESIDUAL, EVEN_K)
        return w, a

    @triton.jit
    def _activation(
        x_ptr, res_ptr, nw_ptr, rows, offs_k, rstd, stride_xm, stride_rm,
        K, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr,
    ):  # fmt: skip
        # The [BLOCK_M, BLOCK_K] activation tile at columns offs_k: x, SiLU(gate) * up, or the
        # RMSNorm of x (+ residual) times the norm weight, in the input dtype.
        k_ok = (offs_k < K)[None, :]
        xp = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
        if PROLOGUE == 2:  # SiLU(gate) * up: gate at column k, up at K + k
            g = _load(xp, k_ok, EVEN_K)
            gf = g.to(tl.float32)
            u = _load(xp + K, k_ok, EVEN_K).to(tl.float32)
            a = (gf * tl.sigmoid(gf) * u).to(g.dtype)
        elif PROLOGUE == 3:  # GELU-tanh(gate) * up, laid out as for SiLU
            g = _load(xp, k_ok, EVEN_K)
            u = _load(xp + K, k_ok, EVEN_K).to(tl.float32)
            a = (_gelu_tanh(g.to(tl.float32)) * u).to(g.dtype)
        elif PROLOGUE == 1:  # RMSNorm of h = x (+ residual), times the norm weight
            h = _load(xp, k_ok, EVEN_K)
            if HAS_RESIDUAL:
                r = _load(res_ptr + rows[:, None] * stride_rm + offs_k[None, :], k_ok, EVEN_K)
                h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
            nw = _load(nw_ptr + offs_k[None, :], k_ok, EVEN_K)
            normed = (h.to(tl.float32) * rstd[:, None]).to(h.dtype)
            a = (normed.to(tl.float32) * nw.to(tl.float32)).to(h.dtype)
        else:
            a = _load(xp, k_ok, EVEN_K)
        return a

    @triton.jit
    def _activation_vec(
        x_ptr, res_ptr, nw_ptr, row, offs, ok, rstd, stride_xm, stride_rm,
        K, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr,
    ):  # fmt: skip
        # `_activation` of one row (M = 1) at the 2-D k offsets ``offs`` ([BLOCK_K / VEC, VEC]);
        # ``rstd`` is that row's scalar.
        xp = x_ptr + row * stride_xm + offs
        if PROLOGUE == 2:
            g = _load(xp, ok, EVEN_K)
            gf = g.to(tl.float32)
            u = _load(xp + K, ok, EVEN_K).to(tl.float32)
            a = (gf * tl.sigmoid(gf) * u).to(g.dtype)
        elif PROLOGUE == 3:
            g = _load(xp, ok, EVEN_K)
            u = _load(xp + K, ok, EVEN_K).to(tl.float32)
            a = (_gelu_tanh(g.to(tl.float32)) * u).to(g.dtype)
        elif PROLOGUE == 1:
            h = _load(xp, ok, EVEN_K)
            if HAS_RESIDUAL:
                r = _load(res_ptr + row * stride_rm + offs, ok, EVEN_K)
                h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
            nw = _load(nw_ptr + offs, ok, EVEN_K)
            normed = (h.to(tl.float32) * rstd).to(h.dtype)
            a = (normed.to(tl.float32) * nw.to(tl.float32)).to(h.dtype)
        else:
            a = _load(xp, ok, EVEN_K)
        return a

    @triton.jit
    def _accumulate(acc, a, w, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr):
        # dot: acc[BLOCK_M, BLOCK_N] += a @ w.T; fma: acc[BLOCK_M, BLOCK_N, BLOCK_K] += a * w.
        if USE_DOT:
            if DOT_FP32:
                return acc + tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                return acc + tl.dot(a, tl.trans(w))
        else:
            return acc + a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]

    @triton.jit
    def _gemv_kernel(
        x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, h_ptr, eps,
        M, N, K, stride_xm, stride_rm, stride_wn, stride_ym, stride_hm,
        PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
        USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        NORM_PAD: tl.constexpr = 0, EARLY_W: tl.constexpr = False, VEC: tl.constexpr = 0,
        USE_PDL: tl.constexpr = False,
    ):  # fmt: skip
        pid = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        # Clamp instead of masking rows: rows >= M and columns >= N re-read valid memory and are
        # never stored, so the loads need no predicate.
        rows = tl.minimum(offs_m, M - 1).to(tl.int64)
        arange_k = tl.arange(0, BLOCK_K)
        # kernels/pdl.py: wait before any memory access; the next kernel is let in (`pdl_trigger`)
        # only when this program starts its last column tile (measured faster than at entry).
        pdl_wait(USE_PDL)
        if EARLY_W:
            # The first K tile of this program's first column tile, issued before the RMSNorm pass
            # so that its DRAM latency overlaps that pass's L2 round trips.
            first_cols = tl.minimum(pid * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
            w_first = _load(w_ptr + first_cols[:, None] * stride_wn + arange_k[None, :], (arange_k < K)[None, :],
                            EVEN_K)

        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        if PROLOGUE == 1 and NORM_PAD > 0:
            # Pass 1 in one load of each whole row (K <= NORM_PAD): one L2 round trip.
            offs_r = tl.arange(0, NORM_PAD)
            r_ok = (offs_r < K)[None, :]
            h = tl.load(x_ptr + rows[:, None] * stride_xm + offs_r[None, :], mask=r_ok, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + rows[:, None] * stride_rm + offs_r[None, :], mask=r_ok, other=0.0)
                h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
                if pid == 0:
                    tl.store(h_ptr + rows[:, None] * stride_hm + offs_r[None, :], h, mask=(offs_m < M)[:, None] & r_ok)
            hf = h.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(hf * hf, axis=1) / K + eps)
        elif PROLOGUE == 1:
            # Pass 1: mean square of each row of h; program 0 also writes h (the new residual).
            sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + arange_k
                k_ok = (offs_k < K)[None, :]
                h = _load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], k_ok, EVEN_K)
                if HAS_RESIDUAL:
                    r = _load(res_ptr + rows[:, None] * stride_rm + offs_k[None, :], k_ok, EVEN_K)
                    h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
                    if pid == 0:
                        st_mask = (offs_m < M)[:, None] & k_ok
                        tl.store(h_ptr + rows[:, None] * stride_hm + offs_k[None, :], h, mask=st_mask)
                hf = h.to(tl.float32)
                sumsq += tl.sum(hf * hf, axis=1)
            rstd = tl.rsqrt(sumsq / K + eps)

        # Column tiles pid, pid + grid, ...: one per program, or several when the launch caps the
        # grid (persistent programs amortise the RMSNorm pass over their tiles). With EARLY_W the
        # first tile is peeled off, so that w_first is not held in registers through the loop.
        num_tiles = tl.cdiv(N, BLOCK_N)
        first = pid
        if EARLY_W:
            _column_tile(
                pid, w_first, True, x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, rows, offs_m, arange_k, rstd,
                M, N, K, stride_xm, stride_rm, stride_wn, stride_ym, num_tiles,
                PROLOGUE, HAS_RESIDUAL, HAS_BIAS, USE_DOT, DOT_FP32, EVEN_K, PREFETCH,
                BLOCK_M, BLOCK_N, BLOCK_K, VEC, USE_PDL,
            )  # fmt: skip
            first = pid + tl.num_programs(0)
        for tile in range(first, num_tiles, tl.num_programs(0)):
            _column_tile(
                tile, arange_k, False, x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, rows, offs_m, arange_k, rstd,
                M, N, K, stride_xm, stride_rm, stride_wn, stride_ym, num_tiles,
                PROLOGUE, HAS_RESIDUAL, HAS_BIAS, USE_DOT, DOT_FP32, EVEN_K, PREFETCH,
                BLOCK_M, BLOCK_N, BLOCK_K, VEC, USE_PDL,
            )  # fmt: skip

    @triton.jit
    def _column_tile(
        tile, w0, HAS_W0: tl.constexpr, x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, rows, offs_m, arange_k, rstd,
        M, N, K, stride_xm, stride_rm, stride_wn, stride_ym, num_tiles,
        PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
        USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        # (``PDL`` is the calling kernel's USE_PDL; tools/pdl_order_check.py checks that kernel.)
        # One column tile: y[:, tile * BLOCK_N : (tile + 1) * BLOCK_N]. With HAS_W0, ``w0`` is its
        # first K tile of weights, already loaded. The next kernel is let in when a program starts
        # its last tile.
        if tile + tl.num_programs(0) >= num_tiles:
            pdl_trigger(PDL)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.minimum(offs_n, N - 1).to(tl.int64)
        w_rows = w_ptr + cols[:, None] * stride_wn
        if VEC > 0:
            # One row (M = 1), weight tiles loaded as [BLOCK_N, BLOCK_K / VEC, VEC] (a thread's
            # 16-byte vector along the last axis), each vector's products summed in the thread at
            # once: the accumulator is [BLOCK_N, BLOCK_K / VEC], not [BLOCK_N, BLOCK_K].
            kk = tl.arange(0, BLOCK_K // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
            w_rows3 = w_ptr + cols[:, None, None] * stride_wn
            row = tl.sum(rows, axis=0)
            rstd_row = tl.sum(rstd, axis=0)
            acc = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs = k0 + kk
                ok = offs < K
                w = _load(w_rows3 + offs[None, :, :], ok[None, :, :], EVEN_K)
                a = _activation_vec(x_ptr, res_ptr, nw_ptr, row, offs, ok, rstd_row, stride_xm, stride_rm, K,
                                    PROLOGUE, HAS_RESIDUAL, EVEN_K)
                acc += tl.sum(a.to(tl.float32)[None, :, :] * w.to(tl.float32), axis=2)
            out = tl.sum(acc, axis=1)[None, :]
        else:
            out = _tile_2d(
                w0, HAS_W0, x_ptr, res_ptr, nw_ptr, w_rows, rows, arange_k, rstd, stride_xm, stride_rm, K,
                PROLOGUE, HAS_RESIDUAL, USE_DOT, DOT_FP32, EVEN_K, PREFETCH, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
        if HAS_BIAS:
            out += tl.load(b_ptr + cols).to(tl.float32)[None, :]
        y_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=y_mask)

    @triton.jit
    def _tile_2d(
        w0, HAS_W0: tl.constexpr, x_ptr, res_ptr, nw_ptr, w_rows, rows, arange_k, rstd, stride_xm, stride_rm, K,
        PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
        EVEN_K: tl.constexpr, PREFETCH: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # A column tile's [BLOCK_M, BLOCK_N] fp32 result with 2-D weight tiles ([BLOCK_N, BLOCK_K]).
        if USE_DOT:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        if PREFETCH:
            # Register double buffering: tile t + 1's weight and activation loads are issued
            # before tile t's products, so two tiles per program are in flight.
            w, a = _load_tile(
                w_rows, x_ptr, res_ptr, nw_ptr, rows, arange_k, rstd, stride_xm, stride_rm, K,
                PROLOGUE, HAS_RESIDUAL, EVEN_K,
            )  # fmt: skip
            for k0 in range(BLOCK_K, K, BLOCK_K):
                w_next, a_next = _load_tile(
                    w_rows, x_ptr, res_ptr, nw_ptr, rows, k0 + arange_k, rstd, stride_xm, stride_rm, K,
                    PROLOGUE, HAS_RESIDUAL, EVEN_K,
                )  # fmt: skip
                acc = _accumulate(acc, a, w, USE_DOT, DOT_FP32)
                w = w_next
                a = a_next
            acc = _accumulate(acc, a, w, USE_DOT, DOT_FP32)
        else:
            k_lo = 0
            if HAS_W0:  # K tile 0 was loaded before the RMSNorm pass
                a0 = _activation(x_ptr, res_ptr, nw_ptr, rows, arange_k, rstd, stride_xm, stride_rm, K,
                                 PROLOGUE, HAS_RESIDUAL, EVEN_K)
                acc = _accumulate(acc, a0, w0, USE_DOT, DOT_FP32)
                k_lo = BLOCK_K
            for k0 in range(k_lo, K, BLOCK_K):
                w, a = _load_tile(
                    w_rows, x_ptr, res_ptr, nw_ptr, rows, k0 + arange_k, rstd, stride_xm, stride_rm, K,
                    PROLOGUE, HAS_RESIDUAL, EVEN_K,
                )  # fmt: skip
                acc = _accumulate(acc, a, w, USE_DOT, DOT_FP32)
        if not USE_DOT:
            acc = tl.sum(acc, axis=2)
        return acc


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # CPU interpreter: a few programs, so the tile loop runs more than once
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch(
    prologue: int,
    x: torch.Tensor,
    k: int,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    config: dict | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if triton is None:
        raise RuntimeError("the Triton GEMV kernels need the triton package")
    if x.dtype != weight.dtype:
        raise ValueError(f"input dtype {x.dtype} differs from weight dtype {weight.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("weight must be contiguous along its input dimension (nn.Linear layout)")
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    if bias is not None and bias.stride(-1) != 1:
        bias = bias.contiguous()  # the kernel reads bias[n] at b_ptr + n
    m, n = x.shape[0], weight.shape[0]
    cfg = _check_config(config) if config else gemv_config(max(m, 1), n, k, _PROLOGUE_NAMES[prologue])
    if m > cfg["block_m"]:
        raise ValueError(f"{m} rows exceed the launch configuration's block_m={cfg['block_m']}")
    # The kernel accumulates in fp32 and rounds only in its store, to y's dtype.
    y = torch.empty(m, n, dtype=torch.float32 if _check_out_dtype(x, out_dtype) else x.dtype, device=x.device)
    h = torch.empty_like(x) if residual is not None else None
    if m == 0 or n == 0:
        return y, h
    res = residual if residual is not None else x
    nw = norm_weight if norm_weight is not None else x
    if nw.stride(-1) != 1:
        nw = nw.contiguous()
    hh = h if h is not None else y
    tiles = triton.cdiv(n, cfg["block_n"])
    grid = (tiles if not cfg.get("programs_per_sm") else min(tiles, cfg["programs_per_sm"] * _sm_count(x.device)),)
    interpret = envs.triton_interpret()
    pdl = pdl_mode(x.device, m)
    norm_pad = triton.next_power_of_2(k) if prologue == _RMSNORM and cfg.get("norm_one_load") else 0
    if norm_pad * cfg["block_m"] > NORM_ONE_LOAD_MAX:
        norm_pad = 0
    # The early tile overlaps the norm pass; measured only together with the one-load pass.
    early = bool(cfg.get("early_weight")) and not cfg.get("prefetch") and norm_pad > 0
    _gemv_kernel[grid](
        x, res, nw, weight, bias if bias is not None else weight, y, hh, float(eps),
        m, n, k, x.stride(0), res.stride(0), weight.stride(0), y.stride(0), hh.stride(0),
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        USE_DOT=cfg["use_dot"],
        # fp32 products in IEEE fp32 (not tf32); the CPU interpreter's bf16 tl.dot is broken.
        DOT_FP32=x.dtype == torch.float32 or interpret,
        EVEN_K=k % cfg["block_k"] == 0, PREFETCH=cfg.get("prefetch", False),
        BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
        NORM_PAD=norm_pad, EARLY_W=early,
        VEC=cfg.get("vec", 0),
        USE_PDL=pdl > 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_options(pdl),
    )  # fmt: skip
    return y, h


def gemv_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: dict | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Triton version of :func:`gemv_ref` for ``M <= MAX_TRITON_ROWS`` rows (same contract,
    ``out_dtype`` included: float32 stores the kernel's fp32 accumulator plus bias unrounded).

    ``config`` overrides :func:`gemv_config` (benchmarks). Raises ValueError also when the weight is
    not contiguous along K, its dtype differs from ``x``'s, ``M`` exceeds the configuration, or the
    configuration combines options :func:`launch_config` refuses.
    """
    if x.dim() != 2:
        raise ValueError(f"gemv: x must be [M, K], got {tuple(x.shape)}")
    _check_linear(x.shape[1], weight, bias, "gemv")
    return _launch(_PLAIN, x, x.shape[1], weight, bias, config=config, out_dtype=out_dtype)[0]


def rmsnorm_gemv_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`rmsnorm_gemv_ref` for ``M <= MAX_TRITON_ROWS``, one launch (same
    contract).

    ``h`` is a new tensor (``x`` and ``residual`` are only read: writing ``h`` over them would race
    with the programs still reading them). Errors as :func:`gemv_triton`, plus ValueError on
    mismatched ``x``/``residual``/``norm_weight`` shapes.
    """
    if x.dim() != 2 or tuple(norm_weight.shape) != (x.shape[1],):
        raise ValueError(
            f"rmsnorm_gemv: x must be [M, K] and norm_weight [K], got {tuple(x.shape)}, {tuple(norm_weight.shape)}"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"rmsnorm_gemv: residual must match x ({tuple(x.shape)}, {x.dtype}), "
            f"got {tuple(residual.shape)}, {residual.dtype}"
        )
    _check_linear(x.shape[1], weight, bias, "rmsnorm_gemv")
    y, h = _launch(_RMSNORM, x, x.shape[1], weight, bias, residual, norm_weight, eps, config)
    return y if residual is None else (y, h)


def silu_mul_gemv_triton(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: dict | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Triton version of :func:`silu_mul_gemv_ref` for ``M <= MAX_TRITON_ROWS``, one launch (same
    contract, ``out_dtype`` included).

    Errors as :func:`gemv_triton`, plus ValueError on an odd last dimension.
    """
    _check_silu(gate_up, weight, bias)
    return _launch(_SILU, gate_up, gate_up.shape[1] // 2, weight, bias, config=config, out_dtype=out_dtype)[0]


def gelu_tanh_mul_gemv_triton(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: dict | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Triton version of :func:`gelu_tanh_mul_gemv_ref` (contract and errors as
    :func:`silu_mul_gemv_triton`; SiLU's launch table)."""
    _check_silu(gate_up, weight, bias, "gelu_tanh_mul_gemv")
    return _launch(_GELU, gate_up, gate_up.shape[1] // 2, weight, bias, config=config, out_dtype=out_dtype)[0]


# ---------------------------------------------------------------------------------------------
# Dispatchers
# ---------------------------------------------------------------------------------------------


def _use_triton(x: torch.Tensor, prologue: str) -> bool:
    from . import triton_available

    return x.is_cuda and x.dim() == 2 and x.shape[0] <= FUSED_MAX_ROWS[prologue] and triton_available()


def _unfused_rmsnorm_gemv(x, residual, norm_weight, eps, weight, bias=None):
    # Larger batches: the package's rms_norm (Triton on CUDA) then cuBLAS.
    from . import rms_norm

    out = rms_norm(x, norm_weight, eps, residual)
    if residual is None:
        return F.linear(out, weight, bias)
    return F.linear(out[0], weight, bias), out[1]


def _unfused_silu_mul_gemv(gate_up, weight, bias=None, out_dtype=None):
    from . import silu_and_mul

    return _linear(silu_and_mul(gate_up), weight, bias, out_dtype)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``: Triton for CUDA ``x`` of at most ``FUSED_MAX_ROWS["plain"]``
    rows, else ``F.linear`` (``torch.mm`` with ``out_dtype`` float32). See :func:`gemv_ref`."""
    if _use_triton(x, "plain"):
        return gemv_triton(x, weight, bias, out_dtype=out_dtype)
    return gemv_ref(x, weight, bias, out_dtype)


def rmsnorm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """(Residual add +) RMSNorm + linear: one Triton launch for CUDA inputs of at most
    ``FUSED_MAX_ROWS["rmsnorm"]`` rows; otherwise :func:`kvpilot.kernels.rms_norm` (Triton on CUDA, the
    reference on CPU) followed by ``F.linear``.

    See :func:`rmsnorm_gemv_ref` for shapes, return values and errors.
    """
    if _use_triton(x, "rmsnorm"):
        return rmsnorm_gemv_triton(x, residual, norm_weight, eps, weight, bias)
    _check_linear(x.shape[-1], weight, bias, "rmsnorm_gemv")
    return _unfused_rmsnorm_gemv(x, residual, norm_weight, eps, weight, bias)


def silu_mul_gemv(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """SiLU-and-mul + linear: one Triton launch for CUDA inputs of at most
    ``FUSED_MAX_ROWS["silu"]`` rows; otherwise :func:`kvpilot.kernels.silu_and_mul` followed by ``F.linear``
    (``torch.mm`` with ``out_dtype`` float32).

    See :func:`silu_mul_gemv_ref` for shapes, ``out_dtype`` and errors.
    """
    if _use_triton(gate_up, "silu"):
        return silu_mul_gemv_triton(gate_up, weight, bias, out_dtype=out_dtype)
    _check_silu(gate_up, weight, bias)
    return _unfused_silu_mul_gemv(gate_up, weight, bias, out_dtype)


def gelu_tanh_mul_gemv(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """GELU(tanh)-and-mul + linear (Gemma's MLP down projection): one Triton launch for CUDA inputs of
    at most ``FUSED_MAX_ROWS["silu"]`` rows; otherwise :func:`kvpilot.kernels.gelu_tanh_and_mul`
    followed by ``F.linear`` (``torch.mm`` with ``out_dtype`` float32).

    See :func:`gelu_tanh_mul_gemv_ref` for shapes, ``out_dtype`` and errors.
    """
    if _use_triton(gate_up, "silu"):
        return gelu_tanh_mul_gemv_triton(gate_up, weight, bias, out_dtype=out_dtype)
    from . import gelu_tanh_and_mul

    _check_silu(gate_up, weight, bias, "gelu_tanh_mul_gemv")
    return _linear(gelu_tanh_and_mul(gate_up), weight, bias, out_dtype)
