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
reference); `quantize_rows` rounds activations to FP8 per row in one launch (before ``_scaled_mm``). A program owns ``BLOCK_N`` output columns for all ``M <= BLOCK_M`` rows and walks all
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

#: rows up to which `fp8_gemv` runs the Triton kernel on CUDA by default. Measured on an H200
#: (benchmarks/gpu_fp8.py, CUDA graphs, Llama-3.1-8B projections): at M = 1 the kernel reads FP8
#: weights at 1.9-2.6 TB/s and beats both the bf16 GEMV and the FP8 ``_scaled_mm`` path; at M = 2
#: ``_scaled_mm`` (per-token quantization included) took 133 us over the four projections against
#: the kernel's 153, so per-row weights with activation scales go to ``_scaled_mm`` from M = 2.
FP8_GEMV_MAX_ROWS = 1

#: largest M the kernel accepts, and the dispatch limit for layers without a ``_scaled_mm`` path
#: (block scales, weight-only), whose alternative is dequantizing the whole weight per call
FP8_GEMV_MAX_ROWS_ANY = 8

#: launch table of `fp8_gemv`: ``(max rows, (block_n, block_k, num_warps))``, the first row with
#: ``M <= max rows`` is used: per M the launch with the least total time over the four
#: Llama-3.1-8B projections in benchmarks/gpu_fp8.py's sweep on an H200 (benchmarks/gpu_fp8_h200.json)
FP8_GEMV_CONFIGS: list[tuple[int, tuple[int, int, int]]] = [
    (1, (8, 1024, 4)),
    (2, (4, 512, 4)),
    (4, (8, 256, 4)),
    (8, (8, 256, 4)),
]


def fp8_gemv_config(m: int) -> tuple[int, int, int]:
    """``(block_n, block_k, num_warps)`` of `FP8_GEMV_CONFIGS` for ``m`` rows."""
    for max_m, cfg in FP8_GEMV_CONFIGS:
        if m <= max_m:
            return cfg
    return FP8_GEMV_CONFIGS[-1][1]


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
                    out_dtype: Optional[torch.dtype] = None, block_n: Optional[int] = None,
                    block_k: Optional[int] = None, num_warps: Optional[int] = None) -> torch.Tensor:
    """Triton version of `fp8_gemv_ref` for ``M <= FP8_GEMV_MAX_ROWS_ANY`` (same contract).

    ``block_n`` / ``block_k`` / ``num_warps``: the launch (output columns per program, K tile,
    warps); each left None comes from `fp8_gemv_config`.

    Raises:
        ValueError: more rows than `FP8_GEMV_MAX_ROWS_ANY`, a weight that is not FP8 E4M3 ``[N, K]``
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
    if m > FP8_GEMV_MAX_ROWS_ANY:
        raise ValueError(f"fp8_gemv: {m} rows exceed FP8_GEMV_MAX_ROWS_ANY={FP8_GEMV_MAX_ROWS_ANY}")
    dn, dk, dw = fp8_gemv_config(m)
    block_n, block_k, num_warps = block_n or dn, block_k or dk, num_warps or dw
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
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
             block: Optional[tuple[int, int]] = None, out_dtype: Optional[torch.dtype] = None,
             max_rows: Optional[int] = None) -> torch.Tensor:
    """`fp8_gemv_triton` for CUDA ``x`` of at most ``max_rows`` (default `FP8_GEMV_MAX_ROWS`)
    rows, else `fp8_gemv_ref`."""
    from . import triton_available

    limit = FP8_GEMV_MAX_ROWS if max_rows is None else min(max_rows, FP8_GEMV_MAX_ROWS_ANY)
    if x.is_cuda and x.dim() == 2 and x.shape[0] <= limit and triton_available():
        return fp8_gemv_triton(x, weight, scale, bias, block, out_dtype)
    return fp8_gemv_ref(x, weight, scale, bias, block, out_dtype)


if triton is not None:

    @triton.jit
    def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, stride_xm, stride_qm,
                           STATIC: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        ok = offs < K
        x = tl.load(x_ptr + row * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
        if STATIC:
            s = tl.load(static_ptr)
        else:
            s = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1e-12)
            tl.store(s_ptr + row, s)
        q = tl.minimum(tl.maximum(x / s, -448.0), 448.0)
        tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=ok)


def quantize_rows_ref(x: torch.Tensor, static_scale: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` -> (FP8 E4M3 ``[M, K]``, float32 scale ``[M, 1]``): per-row dynamic scales
    ``max(amax(|x[m]|) / 448, 1e-12)``, or the scalar ``static_scale`` for every row;
    ``q = fp8(clamp(x / s, -448, 448))``."""
    xf = x.to(torch.float32)
    if static_scale is not None:
        s = static_scale.to(torch.float32).reshape(1, 1).expand(x.shape[0], 1)
    else:
        s = (xf.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (xf / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), s.contiguous()


def quantize_rows(x: torch.Tensor, static_scale: Optional[torch.Tensor] = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_ref` in one Triton launch (one program per row) for CUDA inputs with
    ``K <= 16384``; the reference otherwise."""
    from . import triton_available

    m, k = x.shape
    if not (x.is_cuda and triton_available() and k <= 16384) or m == 0:
        return quantize_rows_ref(x, static_scale)
    return quantize_rows_triton(x, static_scale)


def quantize_rows_triton(x: torch.Tensor, static_scale: Optional[torch.Tensor] = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `quantize_rows_ref` (any device Triton runs on, the interpreter included)."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    st = static_scale.to(torch.float32).reshape(1) if static_scale is not None else s
    _quant_rows_kernel[(m,)](x, q, s, st, k, x.stride(0), q.stride(0), STATIC=static_scale is not None,
                             BLOCK=triton.next_power_of_2(k), num_warps=8 if k >= 4096 else 4)
    if static_scale is not None:
        s = st.reshape(1, 1).expand(m, 1).contiguous()
    return q, s
