"""FP8-weight decode products (kernels/fp8_gemv.py): the Triton kernel against the float32
dequantize-then-multiply reference, for per-row scales (per-tensor / per-channel checkpoints) and
per-block scales (block-wise FP8, partial edge blocks included), with a bias, 1-8 rows and a float32
output; the reference against hand-written dequantization; bad inputs refused.

CPU runs the kernel under ``TRITON_INTERPRET=1`` (tiny shapes); a CUDA GPU runs it natively."""

from __future__ import annotations

import os

import pytest
import torch

from kvpilot.kernels import fp8_gemv as F8

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not (HAS_CUDA or INTERPRET) or F8.triton is None,
                                  reason="needs a CUDA GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"


def _weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)


def test_dequantize_matches_hand_written_scales():
    w = _weight(5, 7)
    row = torch.tensor([0.5, 1.0, 2.0, 0.25, 4.0])
    assert torch.equal(F8.dequantize_fp8(w, row), w.float() * row[:, None])
    blk = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])  # 2x4 blocks over [5, 7]
    want = w.float().clone()
    for i in range(5):
        for j in range(7):
            want[i, j] *= blk[i // 2, j // 4]
    assert torch.equal(F8.dequantize_fp8(w, blk, (2, 4)), want)
    with pytest.raises(ValueError, match="block scale"):
        F8.dequantize_fp8(w, blk[:2], (2, 4))


@needs_triton
@pytest.mark.parametrize("m,n,k,block,bias", [(1, 40, 96, None, False), (3, 33, 200, None, True),
                                              (8, 64, 256, (32, 64), True), (2, 50, 130, (16, 32), False)])
def test_triton_matches_reference(m, n, k, block, bias):
    g = torch.Generator().manual_seed(m * 100 + n)
    x = torch.randn(m, k, generator=g).to(DEVICE)
    w = _weight(n, k).to(DEVICE)
    scale = (torch.rand(n, generator=g) + 0.5) if block is None else \
        (torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) + 0.5)
    scale = scale.to(DEVICE) / 64
    b = torch.randn(n, generator=g).to(DEVICE) if bias else None
    got = F8.fp8_gemv_triton(x, w, scale, b, block)
    want = F8.fp8_gemv_ref(x, w, scale, b, block)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@needs_triton
def test_triton_bf16_input_float32_output():
    x = torch.randn(2, 64).to(torch.bfloat16).to(DEVICE)
    w = _weight(24, 64).to(DEVICE)
    scale = torch.full((24,), 0.01, device=DEVICE)
    got = F8.fp8_gemv_triton(x, w, scale, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F8.fp8_gemv_ref(x, w, scale, out_dtype=torch.float32), rtol=1e-5, atol=1e-4)


@needs_triton
def test_triton_refuses_bad_inputs():
    w = _weight(16, 32).to(DEVICE)
    with pytest.raises(ValueError, match="rows exceed"):
        F8.fp8_gemv_triton(torch.randn(9, 32, device=DEVICE), w, torch.ones(16, device=DEVICE))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        F8.fp8_gemv_triton(torch.randn(1, 32, device=DEVICE), w.float(), torch.ones(16, device=DEVICE))
    with pytest.raises(ValueError, match="per-row scale"):
        F8.fp8_gemv_triton(torch.randn(1, 32, device=DEVICE), w, torch.ones(15, device=DEVICE))


@needs_triton
@pytest.mark.parametrize("static", [False, True])
def test_row_quantization_kernel_matches_reference(static):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 200, generator=g) * torch.tensor([[1.0], [30.0], [1e-3]])).to(DEVICE)
    st = torch.tensor(0.02, device=DEVICE) if static else None
    q, s = F8.quantize_rows_triton(x, st)
    qr, sr = F8.quantize_rows_ref(x, st)
    assert s.shape == (3, 1) and q.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(s, sr)
    if DEVICE == "cuda":
        assert torch.equal(q.float(), qr.float())
    else:  # the interpreter casts float32 -> e4m3 by truncation, and drops a mantissa carry into the
        # next binade (-126.1 -> -64, not -128): compare within one e4m3 step, away from binade tops
        top = (x / s).abs()
        away = (top.log2() - top.log2().floor()) < 0.9
        step = torch.maximum(2.0 ** (top.log2().floor() - 3), torch.tensor(2.0 ** -9))
        assert ((q.float() - qr.float()).abs() <= step)[away].all()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", ["on_the_fly", "static", "block"])
@pytest.mark.parametrize("m", [1, 3, 64])
def test_cuda_paths_match_the_dequantize_reference(scheme, m):
    """`Fp8LinearMethod.apply` on CUDA (the GEMV at M = 1, ``_scaled_mm`` or the dequantized product
    above) against its reference path on the same layer, or against the dequantized weights where
    the CUDA path leaves inputs unrounded (bf16 output rounding apart)."""
    from kvpilot.model.layers import ParallelContext
    from kvpilot.model.linear import MergedColumnParallelLinear
    from kvpilot.model.quantization import Fp8LinearMethod, Fp8Scheme, on_the_fly_fp8

    torch.manual_seed(0)
    method = {"on_the_fly": on_the_fly_fp8(), "static": Fp8LinearMethod(Fp8Scheme("tensor", "static")),
              "block": Fp8LinearMethod(Fp8Scheme("block", "group", block=(128, 128), group_size=128,
                                                 scale_name="weight_scale_inv"))}[scheme]
    with torch.device("cuda"):
        layer = MergedColumnParallelLinear(512, [384, 384], False, ParallelContext(), method)
    w = torch.randn(768, 512, device="cuda") * 0.05
    with torch.no_grad():
        if scheme == "on_the_fly":
            layer.weight.data = w.to(layer.weight.dtype)
        elif scheme == "static":
            s = w.abs().amax() / 448
            layer.weight.copy_((w / s).to(torch.float8_e4m3fn))
            layer.weight_scale.fill_(float(s))
            layer.input_scale.fill_(0.02)
        else:
            s = w.reshape(6, 128, 4, 128).abs().amax(dim=(1, 3)) / 448
            layer.weight.copy_((w / s.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.float8_e4m3fn))
            layer.weight_scale_inv.copy_(s.repeat_interleave(128, 0))
    layer.process_weights_after_loading()
    x = torch.randn(m, 512, device="cuda").to(torch.bfloat16)
    got = layer(x).float()
    if m == 1 or scheme == "block":  # the GEMV and the dequantized product leave inputs unrounded
        want = x.float() @ method.dequantized_weight(layer).t()
    else:
        Fp8LinearMethod.reference = True
        try:
            want = layer(x).float()
        finally:
            Fp8LinearMethod.reference = False
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_dequantized_weight_is_the_fp8_weight_times_its_scale():
    """`Fp8LinearMethod.dequantized_weight` (the CUDA path's product for block weights at many rows
    and the GPU tests' reference) on a per-tensor static layer."""
    from kvpilot.model.layers import ParallelContext
    from kvpilot.model.linear import MergedColumnParallelLinear
    from kvpilot.model.quantization import Fp8LinearMethod, Fp8Scheme

    torch.manual_seed(0)
    method = Fp8LinearMethod(Fp8Scheme("tensor", "static"))
    layer = MergedColumnParallelLinear(64, [32, 32], False, ParallelContext(), method)
    w = torch.randn(64, 64) * 0.05
    s = float(w.abs().amax() / 448)
    with torch.no_grad():
        layer.weight.copy_((w / s).to(torch.float8_e4m3fn))
        layer.weight_scale.fill_(s)
        layer.input_scale.fill_(0.02)
    layer.process_weights_after_loading()
    got = method.dequantized_weight(layer)
    assert got.dtype == torch.float32 and got.shape == (64, 64)
    torch.testing.assert_close(got, layer.weight.float() * s, rtol=0, atol=0)
    # e4m3 rounds to 3 mantissa bits: half a unit is 1/16 of the value (subnormals: s * 2**-10)
    assert bool(((got - w).abs() <= w.abs() / 16 + s * 2 ** -10).all())
