"""GeGLU with the tanh approximation of GELU (Gemma's MLP): ``gelu_tanh_and_mul`` and the fused
``gelu_tanh_mul_gemv`` against PyTorch / transformers.

On CPU the Triton kernels run under ``TRITON_INTERPRET=1`` with small shapes (a partial K tile, N
not a multiple of the tile, the register-FMA, vector and ``tl.dot`` paths).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import kvpilot.kernels as K
from kvpilot.kernels import gelu_tanh_and_mul_ref
from kvpilot.kernels import gemv as G

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
needs_triton = pytest.mark.skipif(not (HAS_CUDA or INTERPRET) or G.triton is None,
                                  reason="needs a CUDA GPU or TRITON_INTERPRET=1")


def _tol(dtype):
    # bf16: the CPU interpreter truncates fp32 -> bf16 instead of rounding.
    return {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}[dtype]


def test_reference_is_transformers_gelu_pytorch_tanh_times_up():
    """The reference is Gemma's ``act_fn(gate_proj(x)) * up_proj(x)`` with ``hidden_activation =
    "gelu_pytorch_tanh"`` (transformers' ACT2FN) on a gate|up concatenation."""
    from transformers.activations import ACT2FN

    x = torch.randn(5, 3, 2 * 37, generator=torch.Generator().manual_seed(0)) * 4
    gate, up = x[..., :37], x[..., 37:]
    want = ACT2FN["gelu_pytorch_tanh"](gate) * up
    torch.testing.assert_close(gelu_tanh_and_mul_ref(x), want)
    # Not SiLU: the two activations differ.
    assert (gelu_tanh_and_mul_ref(x) - K.silu_and_mul_ref(x)).abs().max() > 0.1
    with pytest.raises(ValueError, match="even"):
        gelu_tanh_and_mul_ref(torch.zeros(2, 7))
    # On CPU tensors the dispatcher is the reference.
    assert torch.equal(K.gelu_tanh_and_mul(x), gelu_tanh_and_mul_ref(x))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2 * 64), (7, 2 * 100), (3, 2, 2 * 1500)])
def test_triton_kernel_matches_reference(dtype, shape):
    from kvpilot.kernels.pointwise import gelu_tanh_and_mul_triton

    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 5).to(dtype)
    x[..., 0] = 30.0  # saturated tanh on both sides
    x[..., 1] = -30.0
    got = gelu_tanh_and_mul_triton(x.to(DEVICE)).cpu()
    assert got.dtype == dtype and got.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(got, gelu_tanh_and_mul_ref(x), **_tol(dtype))
    with pytest.raises(ValueError, match="even"):
        gelu_tanh_and_mul_triton(torch.zeros(2, 7, device=DEVICE))


CONFIGS = {"table": None, "fma": G.launch_config("fma", 4, 16, 64), "dot": G.launch_config("dot", 16, 16, 64),
           "vec": G.launch_config("fma", 1, 16, 64, vec=8, programs_per_sm=1)}


@needs_triton
@pytest.mark.parametrize("cfg_name,dtype", [("table", torch.float32), ("table", torch.bfloat16),
                                            ("fma", torch.float32), ("dot", torch.bfloat16), ("vec", torch.float32)])
@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (1, 200, 40), (3, 200, 77)])
def test_fused_gemv_matches_activation_then_linear(m, k, n, dtype, cfg_name):
    cfg = CONFIGS[cfg_name]
    if cfg is not None and m > cfg["block_m"] or cfg_name == "vec" and m > 1:
        pytest.skip("configuration holds fewer rows")
    g = torch.Generator().manual_seed(m + k + n)
    gu = (torch.randn(m, 2 * k, generator=g) * 2).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    want = F.linear(gelu_tanh_and_mul_ref(gu), w, b)
    got = G.gelu_tanh_mul_gemv_triton(gu.to(DEVICE), w.to(DEVICE), b.to(DEVICE), config=cfg).cpu()
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got, want, **_tol(dtype) if dtype != torch.float32 else dict(atol=1e-4, rtol=1e-4))
    # Not the SiLU prologue.
    silu = F.linear(K.silu_and_mul_ref(gu), w, b)
    assert (got.float() - silu.float()).abs().max() > 0.05


@needs_triton
def test_fused_gemv_fp32_accumulator_output():
    g = torch.Generator().manual_seed(3)
    gu = torch.randn(1, 2 * 96, generator=g).to(torch.float16)
    w = (torch.randn(40, 96, generator=g) / 10).to(torch.float16)
    got = G.gelu_tanh_mul_gemv_triton(gu.to(DEVICE), w.to(DEVICE), out_dtype=torch.float32).cpu()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, G.gelu_tanh_mul_gemv_ref(gu, w, out_dtype=torch.float32), atol=2e-3, rtol=2e-3)


def test_gemv_reference_dispatcher_and_errors():
    g = torch.Generator().manual_seed(4)
    gu, w, b = torch.randn(3, 2 * 24, generator=g), torch.randn(10, 24, generator=g), torch.randn(10, generator=g)
    want = F.linear(gelu_tanh_and_mul_ref(gu), w, b)
    assert torch.equal(G.gelu_tanh_mul_gemv_ref(gu, w, b), want)
    assert torch.equal(G.gelu_tanh_mul_gemv(gu, w, b), want)  # CPU: the unfused pair, exactly the reference
    with pytest.raises(ValueError, match="gelu_tanh_mul_gemv: gate_up"):
        G.gelu_tanh_mul_gemv_ref(gu[:, :47], w)
    with pytest.raises(ValueError, match="gelu_tanh_mul_gemv: weight"):
        G.gelu_tanh_mul_gemv(gu, w[:, :20])
