"""Triton row-wise kernels: fused RMSNorm (+residual add), rotary embedding, SiLU-and-multiply,
GELU(tanh)-and-multiply.

Each program handles one token row; all math is fp32 and results are rounded to the input dtype at
the same points as the references in ``reference.py`` (so fp32 results match to rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_options, pdl_enter, pdl_mode

from .reference import _check_rms_norm_args, _check_rotary_args

TUNING = {
    # Up to this many rows RMSNorm issues its weight load together with x (see _rms_norm_kernel):
    # a decode batch's norm is one DRAM round trip instead of two. Above it, plain loads (the
    # weight then comes from L1/L2 for most rows anyway).
    "rms_norm_early_weight_max_rows": 64,
}
"""Launch heuristics of the row-wise kernels (benchmarks may override them)."""


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, eps,
    stride_x, stride_r, stride_y, stride_h,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EARLY_WEIGHT: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(USE_PDL)  # kernels/pdl.py: before any memory access
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    if EARLY_WEIGHT:
        # Few rows (decode): the kernel is latency-bound. ptxas otherwise issues the weight load only
        # after x has arrived (two DRAM round trips); volatile loads keep program order, so w and x
        # (and the residual) are in flight together. Volatile reads skip L1, which costs nothing
        # here: each program reads each element once.
        w = tl.load(w_ptr + cols, mask=mask, other=0.0, volatile=True)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0, volatile=True)
    else:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # Round the sum to the model dtype, as HF adds residuals in that dtype.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_h + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`kvpilot.kernels.reference.rms_norm_ref` (same contract).

    Returns new tensors; ``x`` and ``residual`` are not modified. When ``weight`` is fp32 and ``x``
    is 16-bit, the product is formed in fp32 before rounding (the reference multiplies in the
    promoted dtype, so results agree to one rounding).

    Raises:
        ValueError: on mismatched shapes or a non-contiguous last dimension.
    """
    _check_rms_norm_args(x, weight, residual)
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("x, weight and residual must be contiguous in their last dimension")
    num_tokens, hidden = x.shape
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else y
    res = residual if residual is not None else x
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        pdl = pdl_mode(x.device, num_tokens)
        _rms_norm_kernel[(num_tokens,)](
            x, res, weight, y, h, float(eps),
            x.stride(0), res.stride(0), y.stride(0), h.stride(0),
            HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
            EARLY_WEIGHT=num_tokens <= TUNING["rms_norm_early_weight_max_rows"], USE_PDL=pdl > 0,
            num_warps=min(16, max(1, block // 256)), **launch_options(pdl),
        )  # fmt: skip
    return y if residual is None else (y, h)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    i_ok = i < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + i, mask=i_ok, other=0.0)[None, :]
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + i, mask=i_ok, other=0.0)[None, :]
    h = tl.arange(0, HEADS_PAD)[:, None]

    mask = (h < NUM_HEADS) & i_ok[None, :]
    p1 = q_ptr + token * stride_qt + h * stride_qh + i[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=mask)

    mask = (h < NUM_KV_HEADS) & i_ok[None, :]
    p1 = k_ptr + token * stride_kt + h * stride_kh + i[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(k_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, (x2 * cos + x1 * sin).to(k_ptr.dtype.element_ty), mask=mask)


def apply_rotary_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`kvpilot.kernels.reference.apply_rotary_ref`, rotating IN PLACE.

    ``q`` and ``k`` may be strided views (e.g. slices of a fused QKV output) as long as the last
    dimension is contiguous. Returns ``(q, k)`` (the same tensors, modified).

    Raises:
        ValueError: on mismatched shapes or a non-contiguous last dimension.
    """
    _check_rotary_args(q, k, positions, cos_sin_cache)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("q, k and cos_sin_cache must be contiguous in their last dimension")
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            q, k, positions, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
            NUM_HEADS=num_heads, NUM_KV_HEADS=k.shape[1],
            HEADS_PAD=triton.next_power_of_2(max(num_heads, k.shape[1])),
            HALF=half, HALF_PAD=triton.next_power_of_2(half),
            num_warps=4 if num_heads * head_dim >= 2048 else 1,
        )  # fmt: skip
    return q, k


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, D: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`kvpilot.kernels.reference.silu_and_mul_ref` (same contract).

    Raises:
        ValueError: if the last dimension is odd.
    """
    return _gated(_silu_and_mul_kernel, x)


def _gated(kernel, x: torch.Tensor) -> torch.Tensor:
    """``kernel(gate) * up`` of ``x`` ``[..., 2 * d]`` (gate|up) -> ``[..., d]`` in ``x.dtype``: one
    program per (row, BLOCK columns).

    Raises:
        ValueError: if the last dimension is odd.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"last dimension must be even (gate|up), got {x.shape[-1]}")
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    if x2.shape[0] and d:
        block = min(1024, triton.next_power_of_2(d))
        kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), D=d, BLOCK=block, num_warps=4 if block >= 512 else 1
        )
    return out.reshape(*x.shape[:-1], d)


@triton.jit
def _gelu_tanh(x):
    """GELU, tanh approximation, of fp32 ``x``: ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 *
    x**3)))`` (PyTorch's ``F.gelu(approximate="tanh")``). tanh as ``1 - 2 / (exp(2u) + 1)`` of ``u``
    clamped to +-15 (tanh(15) is 1 in fp32)."""
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    u = tl.minimum(tl.maximum(u, -15.0), 15.0)
    t = 1.0 - 2.0 / (tl.exp2(u * (2.0 * 1.4426950408889634)) + 1.0)
    return 0.5 * x * (1.0 + t)


@triton.jit
def _gelu_tanh_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, D: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (_gelu_tanh(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


def gelu_tanh_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`kvpilot.kernels.reference.gelu_tanh_and_mul_ref` (same contract; the
    launch of `silu_and_mul_triton`).

    Raises:
        ValueError: if the last dimension is odd.
    """
    return _gated(_gelu_tanh_and_mul_kernel, x)
