"""Small-batch products with FP8 weights: ``y = x @ dequant(W).T (+ bias)`` for decode (M <= 8).

At batch 1-8 a decode step's matrix products are bound by the bytes of weight they read; an FP8
(E4M3) weight halves them against bf16. `fp8_gemv` reads each weight byte once, converts it to
float32 in registers, multiplies it by the bf16/fp32 activation (not quantized: no activation
rounding at these sizes) and accumulates in float32; the weight's scales are applied as the
checkpoint format defines them:

- per output row (``scale`` ``[N]`` float32: per-tensor scales expanded to rows, or per-channel):
  ``y[m, n] = scale[n] * sum_k x[m, k] * W[n, k]``, the scale applied once after the K loop;
- per ``[block_n, block_k]`` block (``scale`` ``[ceil(N / block_n), ceil(K / block_k)]``, as the
  block-wise FP8 checkpoints' ``weight_scale_inv``): each K tile's partial sum is multiplied by its
  block's scale (the kernel's ``BLOCK_K`` divides ``block_k``).

``fp8_gemv_ref`` is the PyTorch reference (dequantize to float32, then ``x.float() @ W.T``),
`fp8_gemv` the dispatcher (Triton for CUDA inputs of at most `FP8_GEMV_MAX_ROWS` rows, else the
reference). A program owns ``BLOCK_N`` output columns for all ``M <= BLOCK_M`` rows and walks all
of K with a ``[BLOCK_M, BLOCK_N, BLOCK_K]`` register accumulator summed once at the end.
"""

from __future__ import annotations

from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None

#: rows up to which `fp8_gemv` runs the Triton kernel on CUDA (larger: cuBLASLt ``_scaled_mm``)
FP8_GEMV_MAX_ROWS = 8


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor,
                   block: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """FP8 ``weight`` ``[N, K]`` times its scales, in float32 (``[N, K]``).

    ``scale``: ``[N]`` (per output row) or, with ``block = (block_n, block_k)``,
    ``[ceil(N / block_n), ceil(K / block_k)]`` (one scale per block; partial edge blocks allowed).

    Raises:
        ValueError: a scale shape that does not fit the weight.
    """
    n, k = weight.shape
    w = weight.to(torch.float32)
    if block is None:
        if scale.numel() == 1:
            return w * scale.reshape(()).to(torch.float32)
        if tuple(scale.shape) != (n,):
            raise ValueError(f"per-row scale must be [{n}], got {tuple(scale.shape)}")
        return w * scale.to(torch.float32)[:, None]
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    if tuple(scale.shape) != (nb, kb):
        raise ValueError(f"block scale for [{n}, {k}] in {bn}x{bk} blocks must be [{nb}, {kb}], "
                         f"got {tuple(scale.shape)}")
    s = scale.to(torch.float32).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return w * s


def fp8_gemv_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 bias: Optional[torch.Tensor] = None, block: Optional[tuple[int, int]] = None,
                 out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``x [M, K] @ dequantize_fp8(weight, scale, block).T (+ bias)`` in float32, returned in
    ``out_dtype`` (default ``x.dtype``)."""
    y = x.to(torch.float32) @ dequantize_fp8(weight, scale, block).t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(out_dtype or x.dtype)


if triton is not None:

    @triton.jit
    def _fp8_gemv_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
        HAS_BIAS: tl.constexpr, BLOCKWISE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        offs_m = tl.arange(0, BLOCK_M)
        rows = tl.minimum(offs_m, M - 1).to(tl.int64)  # rows >= M re-read row M-1, never stored
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.minimum(offs_n, N - 1).to(tl.int64)
        arange_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + arange_k
            k_ok = offs_k < K
            w = tl.load(w_ptr + cols[:, None] * stride_wn + offs_k[None, :], mask=k_ok[None, :], other=0.0)
            a = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=k_ok[None, :], other=0.0)
            prod = a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            if BLOCKWISE:
                s = tl.load(s_ptr + (cols // SCALE_BN) * stride_sn + k0 // SCALE_BK)
                prod = prod * s[None, :, None]
            acc += prod
        y = tl.sum(acc, axis=2)
        if not BLOCKWISE:
            y = y * tl.load(s_ptr + cols)[None, :]
        if HAS_BIAS:
            y = y + tl.load(b_ptr + cols).to(tl.float32)[None, :]
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def fp8_gemv_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    bias: Optional[torch.Tensor] = None, block: Optional[tuple[int, int]] = None,
                    out_dtype: Optional[torch.dtype] = None, block_n: int = 16, block_k: int = 128,
                    num_warps: int = 4) -> torch.Tensor:
    """Triton version of `fp8_gemv_ref` for ``M <= FP8_GEMV_MAX_ROWS`` (same contract).

    ``block_n`` / ``block_k`` / ``num_warps``: the launch (output columns per program, K tile,
    warps); the defaults are the dispatcher's.

    Raises:
        ValueError: more rows than `FP8_GEMV_MAX_ROWS`, a weight that is not FP8 E4M3 ``[N, K]``
            contiguous along K, a scale shape that does not fit, or a ``block_k`` the kernel's K
            tile does not divide.
    """
    if triton is None:
        raise RuntimeError("the FP8 GEMV kernel needs the triton package")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8_gemv: x [M, K] and weight [N, K] expected, got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    if weight.dtype != torch.float8_e4m3fn or weight.stride(1) != 1:
        raise ValueError(f"fp8_gemv: weight must be float8_e4m3fn, contiguous along K; got {weight.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    if m > FP8_GEMV_MAX_ROWS:
        raise ValueError(f"fp8_gemv: {m} rows exceed FP8_GEMV_MAX_ROWS={FP8_GEMV_MAX_ROWS}")
    scale = scale.to(torch.float32)
    if block is None:
        scale = scale.reshape(-1).expand(n).contiguous() if scale.numel() == 1 else scale.contiguous()
        if tuple(scale.shape) != (n,):
            raise ValueError(f"per-row scale must be [{n}], got {tuple(scale.shape)}")
        sbn, sbk, stride_sn = 1, 1, 0
    else:
        sbn, sbk = block
        if tuple(scale.shape) != (-(-n // sbn), -(-k // sbk)):
            raise ValueError(f"block scale must be [{-(-n // sbn)}, {-(-k // sbk)}], got {tuple(scale.shape)}")
        while sbk % block_k:
            block_k //= 2
        scale = scale.contiguous()
        stride_sn = scale.stride(0)
    x = x.contiguous()
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    block_m = max(1, triton.next_power_of_2(m))
    grid = (triton.cdiv(n, block_n),)
    _fp8_gemv_kernel[grid](
        x, weight, scale, bias if bias is not None else scale, y, m, n, k, x.stride(0), weight.stride(0), stride_sn,
        y.stride(0), HAS_BIAS=bias is not None, BLOCKWISE=block is not None, SCALE_BN=sbn, SCALE_BK=sbk,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
    )  # fmt: skip
    return y


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
             block: Optional[tuple[int, int]] = None, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """`fp8_gemv_triton` for CUDA ``x`` of at most `FP8_GEMV_MAX_ROWS` rows, else `fp8_gemv_ref`."""
    from . import triton_available

    if x.is_cuda and x.dim() == 2 and x.shape[0] <= FP8_GEMV_MAX_ROWS and triton_available():
        return fp8_gemv_triton(x, weight, scale, bias, block, out_dtype)
    return fp8_gemv_ref(x, weight, scale, bias, block, out_dtype)
