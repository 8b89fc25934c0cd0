"""Fused decode GEMVs (kernels/gemv.py) against their reference compositions.

On CPU the Triton kernels run under ``TRITON_INTERPRET=1`` with small shapes (non-power-of-2 K and
N, partial K tiles, both the register-FMA and the ``tl.dot`` paths); ``gpu``-marked tests use
Llama-3.1-8B shapes in bf16. The interpreter rounds fp32 -> bf16 by truncation, so bit-exact bf16
checks of ``h`` run on a GPU only.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kvpilot.kernels import rms_norm_ref, silu_and_mul_ref
from kvpilot.kernels import gemv as G

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
needs_triton = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET) or G.triton is None, reason="needs a CUDA GPU or TRITON_INTERPRET=1"
)
needs_cuda = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU")

FMA_SMALL = G.launch_config("fma", 4, 16, 64)
FMA_PREFETCH = G.launch_config("fma", 2, 8, 32, prefetch=True)
DOT_SMALL = G.launch_config("dot", 16, 16, 64, num_stages=2)
DOT_PREFETCH = G.launch_config("dot", 16, 32, 32, prefetch=True)
PERSISTENT = G.launch_config("fma", 8, 16, 64, programs_per_sm=1)  # 4 programs on CPU: tile loop
# RMSNorm pass in one load of the row, first weight tile issued before it; persistent, so the
# early tile is used by each program's first column tile only.
EARLY = G.launch_config("fma", 4, 16, 64, programs_per_sm=1, norm_one_load=True, early_weight=True)
# one row, [BLOCK_N, BLOCK_K / 8, 8] weight tiles summed per 8-vector (M = 1 shapes only)
VEC = G.launch_config("fma", 1, 16, 64, vec=8, programs_per_sm=1)
CONFIGS = {"vec": VEC, "table": None, "fma": FMA_SMALL, "dot": DOT_SMALL, "fma_prefetch": FMA_PREFETCH,
           "dot_prefetch": DOT_PREFETCH, "persistent": PERSISTENT, "early": EARLY}  # fmt: skip
# Each configuration once per dtype would double the interpreter's time; pair them instead.
CASES = [("table", torch.float32), ("table", torch.bfloat16), ("fma", torch.float32), ("dot", torch.bfloat16),
         ("fma_prefetch", torch.bfloat16), ("dot_prefetch", torch.float32), ("persistent", torch.float32),
         ("early", torch.float32), ("vec", torch.bfloat16), ("vec", torch.float32)]

# M, K, N: a partial K tile (200), N not a multiple of the tile (77, 200), M of 1, 3 (clamped
# rows), 8 (tl.dot path in the table).
SHAPES = [(1, 64, 48), (1, 200, 40), (3, 200, 77), (8, 512, 200)]


def _tol(dtype):
    # bf16: the reference rounds the activation to bf16 like the kernel, but the CPU interpreter
    # truncates instead of rounding, and the product's summation order differs.
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)


def _inputs(m, k, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return dict(x=rnd(m, k), res=rnd(m, k), nw=(1 + 0.1 * rnd(k)).to(dtype), w=(rnd(n, k) / k**0.5).to(dtype),
                b=rnd(n), gu=rnd(m, 2 * k))  # fmt: skip


def _fits(cfg, m):
    return cfg is None or m <= cfg["block_m"]


def _dev(*ts):
    return [t.to(DEVICE) if t is not None else None for t in ts]


@needs_triton
@pytest.mark.parametrize("cfg_name,dtype", CASES)
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_rmsnorm_gemv_matches_rms_norm_then_linear(m, k, n, dtype, cfg_name, with_residual):
    cfg = CONFIGS[cfg_name]
    if not _fits(cfg, m):
        pytest.skip("configuration holds fewer rows")
    t = _inputs(m, k, n, dtype, seed=m * 1000 + k + n)
    bias = t["b"].to(dtype) if with_residual else None  # bias covered on one of the two variants
    res = t["res"] if with_residual else None
    normed = rms_norm_ref(t["x"], t["nw"], 1e-5, res)
    ref_y = F.linear(normed[0] if with_residual else normed, t["w"], bias)
    x, r, nw, w, b = _dev(t["x"], res, t["nw"], t["w"], bias)
    out = G.rmsnorm_gemv_triton(x, r, nw, 1e-5, w, b, config=cfg)
    y = out[0] if with_residual else out
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y.cpu(), ref_y, **_tol(dtype))
    if with_residual:
        h = out[1].cpu()
        if dtype == torch.float32:
            assert torch.equal(h, normed[1])
        else:  # truncating interpreter cast: one bf16 ulp at most
            torch.testing.assert_close(h, normed[1], atol=0, rtol=2**-7)
        assert torch.equal(x.cpu(), t["x"]) and torch.equal(r.cpu(), t["res"])  # inputs untouched


@needs_triton
@pytest.mark.parametrize("cfg_name,dtype", CASES)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_silu_mul_gemv_matches_silu_and_mul_then_linear(m, k, n, dtype, cfg_name):
    cfg = CONFIGS[cfg_name]
    if not _fits(cfg, m):
        pytest.skip("configuration holds fewer rows")
    t = _inputs(m, k, n, dtype, seed=7 + m + k + n)
    ref = F.linear(silu_and_mul_ref(t["gu"]), t["w"])
    gu, w = _dev(t["gu"], t["w"])
    y = G.silu_mul_gemv_triton(gu, w, config=cfg)
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y.cpu(), ref, **_tol(dtype))


@needs_triton
@pytest.mark.parametrize("cfg_name,dtype", CASES)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_gemv_matches_linear(m, k, n, dtype, cfg_name):
    cfg = CONFIGS[cfg_name]
    if not _fits(cfg, m):
        pytest.skip("configuration holds fewer rows")
    t = _inputs(m, k, n, dtype, seed=11 + m + k + n)
    # A strided input (a column slice of a wider tensor, as o_proj reads attention output views).
    wide = torch.cat([t["x"], t["res"]], dim=1)
    x_view = wide[:, :k]
    ref = F.linear(x_view, t["w"], t["b"].to(dtype))
    (wide_d, w, b) = _dev(wide, t["w"], t["b"].to(dtype))
    y = G.gemv_triton(wide_d[:, :k], w, b, config=cfg)
    torch.testing.assert_close(y.cpu(), ref, **_tol(dtype))


@needs_triton
def test_every_row_and_column_written():
    # NaN-poisoned outputs would survive if a tile were skipped; torch.empty may hold anything.
    m, k, n = 5, 96, 70
    t = _inputs(m, k, n, torch.float32, seed=3)
    x, w = _dev(t["x"], t["w"])
    for cfg in (FMA_SMALL, DOT_SMALL, None):
        y = G.gemv_triton(x, w, config=cfg if cfg is None or cfg["block_m"] >= m else None)
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y.cpu(), F.linear(t["x"], t["w"]), atol=1e-4, rtol=1e-4)


def test_config_table_covers_every_small_batch():
    for prologue in ("plain", "rmsnorm", "silu"):
        assert 1 <= G.FUSED_MAX_ROWS[prologue] <= G.MAX_TRITON_ROWS
        for m in range(1, G.MAX_TRITON_ROWS + 1):
            for n, k in [(6144, 4096), (28672, 4096), (4096, 14336), (100, 64)]:
                cfg = G.gemv_config(m, n, k, prologue)
                assert cfg["block_m"] >= m
                if cfg["use_dot"]:  # tl.dot needs 16 in every dimension
                    assert cfg["block_m"] >= 16 and cfg["block_n"] >= 16 and cfg["block_k"] >= 16
                else:
                    assert cfg["block_m"] <= 8
    with pytest.raises(ValueError, match="no GEMV launch configuration"):
        G.gemv_config(G.MAX_TRITON_ROWS + 1, 64, 64)
    with pytest.raises(ValueError, match="kind"):
        G.launch_config("wgmma", 16, 16, 16)


def test_dispatchers_use_the_reference_on_cpu_and_for_large_batches():
    # CPU tensors (and any M above MAX_TRITON_ROWS) go to the reference, which equals the
    # composition of the existing references exactly.
    t = _inputs(G.MAX_TRITON_ROWS + 3, 32, 24, torch.float32, seed=5)
    y, h = G.rmsnorm_gemv(t["x"], t["res"], t["nw"], 1e-6, t["w"])
    yr, hr = rms_norm_ref(t["x"], t["nw"], 1e-6, t["res"])
    assert torch.equal(h, hr) and torch.equal(y, F.linear(yr, t["w"]))
    assert torch.equal(G.rmsnorm_gemv(t["x"], None, t["nw"], 1e-6, t["w"]),
                       F.linear(rms_norm_ref(t["x"], t["nw"], 1e-6), t["w"]))  # fmt: skip
    assert torch.equal(G.silu_mul_gemv(t["gu"], t["w"]), F.linear(silu_and_mul_ref(t["gu"]), t["w"]))
    assert torch.equal(G.gemv(t["x"], t["w"], t["b"]), F.linear(t["x"], t["w"], t["b"]))


def test_shape_errors():
    t = _inputs(2, 32, 24, torch.float32, seed=1)
    with pytest.raises(ValueError, match="weight must be"):
        G.gemv_ref(t["x"], t["w"][:, :16])
    with pytest.raises(ValueError, match="bias must be"):
        G.gemv_ref(t["x"], t["w"], t["b"][:5])
    with pytest.raises(ValueError, match="gate_up must be"):
        G.silu_mul_gemv_ref(t["gu"][:, :63], t["w"])
    with pytest.raises(ValueError, match="weight must be"):
        G.rmsnorm_gemv_ref(t["x"], None, t["nw"], 1e-5, t["w"][:, :8])
    with pytest.raises(ValueError, match="early_weight and prefetch"):
        G.launch_config("fma", 1, 8, 64, prefetch=True, early_weight=True)
    if G.triton is not None:
        with pytest.raises(ValueError, match="dtype"):
            G.gemv_triton(t["x"], t["w"].double())
        with pytest.raises(ValueError, match="residual must match"):
            G.rmsnorm_gemv_triton(t["x"], t["res"][:1], t["nw"], 1e-5, t["w"])
        with pytest.raises(ValueError, match="exceed"):
            G.gemv_triton(t["x"], t["w"], config=dict(FMA_SMALL, block_m=1))


# ------------------------------------------------------------------------------------------------
# GPU: Llama-3.1-8B shapes, bf16, the launch table's configurations
# ------------------------------------------------------------------------------------------------


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_gpu_llama8b_shapes(m):
    # The Triton kernels with the launch table's configuration at every M (the dispatchers use
    # them only up to FUSED_MAX_ROWS), then the dispatchers themselves.
    g = torch.Generator(device="cuda").manual_seed(m)
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    hidden, inter = 4096, 14336
    x, res, nw = rnd(m, hidden), rnd(m, hidden), 1 + 0.1 * rnd(hidden)
    for n in (6144, 2 * inter):  # qkv, gate_up
        w = rnd(n, hidden) / hidden**0.5
        yr, hr = G.rmsnorm_gemv_ref(x, res, nw, 1e-5, w)
        for fn in (G.rmsnorm_gemv_triton, G.rmsnorm_gemv):
            y, h = fn(x, res, nw, 1e-5, w)
            assert torch.equal(h, hr)
            assert _rel(y, yr) < 1e-2
    w = rnd(hidden, hidden) / hidden**0.5  # o_proj, on a strided view as in the layer
    qkv = rnd(m, 6144)
    ref = F.linear(qkv[:, :hidden], w)
    for fn in (G.gemv_triton, G.gemv):
        assert _rel(fn(qkv[:, :hidden], w), ref) < 1e-2
    gu, wd = rnd(m, 2 * inter), rnd(hidden, inter) / inter**0.5  # down
    ref = G.silu_mul_gemv_ref(gu, wd)
    for fn in (G.silu_mul_gemv_triton, G.silu_mul_gemv):
        assert _rel(fn(gu, wd), ref) < 1e-2
