"""``out_dtype=torch.float32`` of ``gemv`` / ``silu_mul_gemv`` (kernels/gemv.py): the fp32 accumulator,
unrounded, for the float32 tensor-parallel reduction (engine/model/llama.py).

- CPU: the references and dispatchers give ``F.linear`` of the inputs in float32 exactly; the
  Triton kernels under ``TRITON_INTERPRET=1`` match it to fp32 rounding (the interpreter's bf16 store
  truncates, so the bit-level check of the default output runs on a GPU); a float32 input with
  ``out_dtype`` float32 is the default call; any other ``out_dtype`` is refused. (The interpreter
  truncates the fused SiLU's bf16 activation where the reference rounds it: that case is loose.)
- GPU (``gpu``): at Llama-3.1-8B's row-parallel shapes (TP 1 and TP 2), the kernels' fp32 output
  rounded to bf16 is bit for bit their default bf16 output (only the store changed), and the cuBLAS
  path (``torch.mm(..., out_dtype=torch.float32)``) matches a float64 product to fp32 accuracy.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kvpilot.kernels import gemv as G
from kvpilot.kernels import silu_and_mul_ref

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET or G.triton is None, reason="needs TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU")
F32 = torch.float32


def _inputs(m, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return rnd(m, k), (rnd(n, k) / k**0.5).to(dtype), rnd(n), rnd(m, 2 * k)


@pytest.mark.parametrize("with_bias", [False, True])
def test_references_and_dispatchers_return_the_fp32_product(with_bias):
    x, w, b, gu = _inputs(3, 96, 40, torch.bfloat16)
    bias = b.to(torch.bfloat16) if with_bias else None
    want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    for fn in (G.gemv_ref, G.gemv):
        got = fn(x, w, bias, out_dtype=F32)
        assert got.dtype == F32 and torch.equal(got, want)
        assert torch.equal(fn(x, w, bias), F.linear(x, w, bias))  # the default is unchanged
        assert torch.equal(fn(x, w, bias, out_dtype=torch.bfloat16), F.linear(x, w, bias))
    want = F.linear(silu_and_mul_ref(gu).float(), w.float(), None if bias is None else bias.float())
    for fn in (G.silu_mul_gemv_ref, G.silu_mul_gemv):
        got = fn(gu, w, bias, out_dtype=F32)
        assert got.dtype == F32 and torch.equal(got, want)


def test_other_out_dtypes_are_refused():
    x, w, _, gu = _inputs(2, 32, 16, torch.bfloat16)
    for fn, a in ((G.gemv_ref, x), (G.gemv, x), (G.silu_mul_gemv, gu)):
        with pytest.raises(ValueError, match="out_dtype must be None, the input dtype or torch.float32"):
            fn(a, w, None, out_dtype=torch.float16)


@needs_interpreter
@pytest.mark.parametrize("m,k,n", [(1, 200, 77), (2, 64, 48), (8, 128, 40)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_kernels_store_the_fp32_accumulator(m, k, n, dtype):
    x, w, b, gu = _inputs(m, k, n, dtype, seed=m)
    bias = b.to(dtype)
    cases = ((G.gemv_triton, x, x), (G.silu_mul_gemv_triton, gu, silu_and_mul_ref(gu)))
    for fn, a, act in cases:
        want = F.linear(act.double(), w.double(), bias.double())
        got = fn(a, w, bias, out_dtype=F32)
        assert got.dtype == F32 and got.shape == (m, n)
        # Not rounded to bf16 on the way out: few outputs are bf16 values.
        assert (got == got.bfloat16().float()).float().mean() < 0.2
        if fn is G.silu_mul_gemv_triton and dtype != F32:
            # The interpreter truncates the bf16 activation where the reference rounds it.
            torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2)
        else:  # fp32 accumulation of exact products: a few fp32 ulps, far below bf16's 4e-3
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        if dtype == F32:
            assert torch.equal(got, fn(a, w, bias))  # float32 input: out_dtype float32 is the default
        else:
            assert fn(a, w, bias).dtype == torch.bfloat16


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("m", [1, 2, 8])
def test_gpu_fp32_output_rounds_to_the_default_output(tp, m):
    g = torch.Generator(device="cuda").manual_seed(10 * tp + m)
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    hidden, inter = 4096, 14336 // tp
    a_o, w_o = rnd(m, hidden // tp), rnd(hidden, hidden // tp) / (hidden // tp) ** 0.5  # o_proj shard
    gu, w_d = rnd(m, 2 * inter), rnd(hidden, inter) / inter**0.5  # down_proj shard
    bias = rnd(hidden)
    for fn, a, w in ((G.gemv_triton, a_o, w_o), (G.silu_mul_gemv_triton, gu, w_d)):
        for b in (None, bias):
            y32 = fn(a, w, b, out_dtype=F32)
            assert y32.dtype == F32
            assert torch.equal(y32.bfloat16(), fn(a, w, b))
    # The dispatchers (Triton up to FUSED_MAX_ROWS, then torch.mm with out_dtype) against float64.
    got = G.gemv(a_o, w_o, bias, out_dtype=F32)
    assert got.dtype == F32
    torch.testing.assert_close(got.double(), F.linear(a_o.double(), w_o.double(), bias.double()), rtol=1e-4, atol=1e-4)
    got = G.silu_mul_gemv(gu, w_d, bias, out_dtype=F32)
    want = F.linear(silu_and_mul_ref(gu).double(), w_d.double(), bias.double())
    # (above one row the activation comes from the Triton silu_and_mul: a rare ulp apart from the reference's)
    assert got.dtype == F32 and ((got.double() - want).norm() / want.norm()).item() < 1e-3
