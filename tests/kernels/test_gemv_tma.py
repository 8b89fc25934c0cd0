"""The "tma" GEMV kind (`kvpilot.kernels.gemv._gemv_tma_kernel`: M = 1, weight tiles by TMA through
a multi-stage shared-memory ring) against the references, for every prologue.

CPU: the kernel under TRITON_INTERPRET=1 (which runs tensor descriptors) in float16, where the
interpreter rounds like the GPU, so ``h`` must be bit-exact; tails in N and K, bias, float32 output,
the fallback of ineligible weights. GPU (``-m gpu``): Llama-3.1-8B's shapes in bf16, with and
without programmatic dependent launch, against the references and the fma kernel.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvpilot.kernels import gemv as G

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
EPS = 1e-5


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _cases(n: int, k: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, device=device).to(dtype)  # noqa: E731
    w, x, res, nw, gu, b = rnd(n, k) / k**0.5, rnd(1, k), rnd(1, k), 1 + 0.1 * rnd(k), rnd(1, 2 * k), rnd(n)
    return {
        "plain": (lambda c: G.gemv_triton(x, w, config=c), lambda: G.gemv_ref(x, w)),
        "plain bias": (lambda c: G.gemv_triton(x, w, b, config=c), lambda: G.gemv_ref(x, w, b)),
        "plain fp32": (lambda c: G.gemv_triton(x, w, b, config=c, out_dtype=torch.float32),
                       lambda: G.gemv_ref(x, w, b, out_dtype=torch.float32)),
        "silu": (lambda c: G.silu_mul_gemv_triton(gu, w, config=c), lambda: G.silu_mul_gemv_ref(gu, w)),
        "gelu": (lambda c: G.gelu_tanh_mul_gemv_triton(gu, w, config=c), lambda: G.gelu_tanh_mul_gemv_ref(gu, w)),
        "rmsnorm": (lambda c: G.rmsnorm_gemv_triton(x, None, nw, EPS, w, config=c),
                    lambda: G.rmsnorm_gemv_ref(x, None, nw, EPS, w)),
        "rmsnorm residual": (lambda c: G.rmsnorm_gemv_triton(x, res, nw, EPS, w, b, config=c),
                             lambda: G.rmsnorm_gemv_ref(x, res, nw, EPS, w, b)),
    }


def _check(name: str, got, ref, tol: float) -> None:
    if isinstance(ref, tuple):
        assert torch.equal(got[1], ref[1]), f"{name}: h = x + residual differs"
        got, ref = got[0], ref[0]
    assert got.dtype == ref.dtype and got.shape == ref.shape, name
    err = _rel(got, ref)
    assert err < tol, f"{name}: relative error {err:.3g}"


@pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernel under TRITON_INTERPRET=1")
@pytest.mark.parametrize("n,k", [(40, 96), (33, 64), (16, 200)])
@pytest.mark.parametrize("block", [(16, 32, 2), (8, 64, 3)])
def test_tma_kind_equals_reference_cpu(n, k, block):
    cfg = G.launch_config("tma", 1, block[0], block[1], num_stages=block[2])
    for name, (fused, ref) in _cases(n, k, torch.float16, "cpu").items():
        _check(name, fused(cfg), ref(), 1e-3)
    late = G.launch_config("tma", 1, block[0], block[1], num_stages=block[2], late_trigger=True)
    fused, ref = _cases(n, k, torch.float16, "cpu")["rmsnorm residual"]
    _check("late trigger", fused(late), ref(), 1e-3)


def test_tma_kind_rejects_what_it_cannot_run():
    with pytest.raises(ValueError, match="tma"):
        G.launch_config("tma", 2, 16, 64)
    with pytest.raises(ValueError, match="tma"):
        G.launch_config("tma", 1, 16, 64, programs_per_sm=2)
    with pytest.raises(ValueError, match="tma"):
        G.launch_config("tma", 1, 16, 64, vec=8)
    cfg = G.launch_config("tma", 1, 16, 32)
    x = torch.randn(1, 100, dtype=torch.float16)  # a row of 200 bytes: not a 16-byte multiple
    with pytest.raises(ValueError, match="16-byte"):
        G.gemv_triton(x, torch.randn(8, 100, dtype=torch.float16), config=cfg)
    with pytest.raises(ValueError, match="M = 1"):
        G.gemv_triton(torch.randn(2, 64, dtype=torch.float16), torch.randn(8, 64, dtype=torch.float16), config=cfg)


@pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels under TRITON_INTERPRET=1")
def test_table_tma_rows_fall_back_for_ineligible_weights(monkeypatch):
    """A "tma" table row gives way to the next row for a weight TMA cannot address (row of 200 bytes)."""
    rows = [(1, 0, G.launch_config("tma", 1, 16, 32)), (1, 0, G.launch_config("fma", 1, 8, 32)),
            (16, 0, G.launch_config("fma", 16, 8, 32))]
    monkeypatch.setitem(G.CONFIGS, "plain", rows)
    x = torch.randn(1, 100, dtype=torch.float16)
    w = torch.randn(24, 100, dtype=torch.float16)
    assert G.gemv_config(1, 24, 100, "plain", tma=False) is rows[1][2]
    _check("fallback", G.gemv_triton(x, w), G.gemv_ref(x, w), 1e-3)


# ---- GPU ---------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "down tp8": (4096, 1792)}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("pdl", ["0", "1"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_tma_kind_equals_reference(monkeypatch, pdl, shape):
    monkeypatch.setenv("KVPILOT_PDL", pdl)
    n, k = SHAPES[shape]
    cases = _cases(n, k, torch.bfloat16, "cuda", seed=n + k)
    fma = G.launch_config("fma", 1, 8, 512)
    for cfg in (G.launch_config("tma", 1, 16, 256, num_stages=4), G.launch_config("tma", 1, 8, 512, num_stages=4),
                G.launch_config("tma", 1, 16, 256, num_stages=4, late_trigger=True)):
        for name, (fused, ref) in cases.items():
            got, want = fused(cfg), ref()
            _check(f"{shape} {name} {cfg}", got, want, 1e-2)
            other = fused(fma)
            if isinstance(got, tuple):
                got, other = got[0], other[0]
            assert _rel(got, other) < 1e-2, f"{shape} {name}: tma and fma kernels disagree"
