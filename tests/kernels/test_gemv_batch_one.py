"""The batch-1 GEMV paths (kernels/gemv.py): the one-load RMSNorm pass (``norm_one_load``, constexpr
NORM_PAD), the first weight tile issued before it (``early_weight``, EARLY_W, peeled off the tile
loop), the vector-summed weight tiles at M = 1 (``vec``, `_activation_vec`), strided biases, and the
configurations the kernel cannot run being refused.

CPU tests run the kernels under ``TRITON_INTERPRET=1`` (small shapes; the interpreter rounds fp32 ->
bf16 by truncation, so exact rounding checks use fp16 and fp32); ``gpu`` tests run the launch table at
shapes of Llama 3.x models, their tensor-parallel shards and other dtypes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kvpilot.kernels import rms_norm_ref, silu_and_mul_ref
from kvpilot.kernels import gemv as G
from support.paths import load_benchmark

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET) or G.triton is None, reason="needs a CUDA GPU or TRITON_INTERPRET=1"
)
needs_cuda = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU")
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"

C = G.launch_config
# Small versions of the table's batch-1 rows (the table's own rows have K tiles of 1024-2048).
# On CPU `_sm_count` is 4, so programs_per_sm=1 gives 4 programs, each owning 1-3 column tiles.
VEC = C("fma", 1, 4, 32, programs_per_sm=1, norm_one_load=True, vec=8)   # qkv / o_proj style
EARLY = C("fma", 1, 4, 32, programs_per_sm=1, norm_one_load=True, early_weight=True)  # gate_up style


def _inputs(m, k, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return dict(x=rnd(m, k), res=rnd(m, k), nw=(1 + 0.1 * rnd(k)).to(dtype), w=(rnd(n, k) / k**0.5).to(dtype),
                gu=rnd(m, 2 * k), b=rnd(n))  # fmt: skip


def _dev(*ts):
    return [t.to(DEVICE) if t is not None else None for t in ts]


# ---- inputs and configurations -------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("op", ["plain", "rmsnorm", "silu"])
def test_a_strided_bias_is_read_with_its_stride(op):
    """A bias view with a stride (every other element of a wider vector, a column of a 2-D tensor) is
    read with its stride: the kernel reads ``bias[n]`` at ``b_ptr + n``, so `_launch` makes a strided bias
    contiguous, as it does for ``x``, ``residual`` and ``norm_weight`` (`_check_linear` checks only the
    shape). Checked in the table's batch-1 rows: vec for plain and rmsnorm, fma for silu."""
    m, k, n = 1, 64, 12
    t = _inputs(m, k, n, torch.float32, seed=8)
    wide = torch.randn(2 * n, generator=torch.Generator().manual_seed(9))
    bias = wide[::2]  # [n], stride 2
    assert bias.stride(-1) == 2
    if op == "plain":
        ref = G.gemv_ref(t["x"], t["w"], bias)
        x, w, b = _dev(t["x"], t["w"], wide)
        y = G.gemv_triton(x, w, b[::2])
    elif op == "rmsnorm":
        ref, _ = G.rmsnorm_gemv_ref(t["x"], t["res"], t["nw"], 1e-5, t["w"], bias)
        x, r, nw, w, b = _dev(t["x"], t["res"], t["nw"], t["w"], wide)
        y, _ = G.rmsnorm_gemv_triton(x, r, nw, 1e-5, w, b[::2])
    else:
        ref = G.silu_mul_gemv_ref(t["gu"], t["w"], bias)
        gu, w, b = _dev(t["gu"], t["w"], wide)
        y = G.silu_mul_gemv_triton(gu, w, b[::2])
    torch.testing.assert_close(y.cpu(), ref, atol=1e-5, rtol=1e-5)


@needs_triton
def test_config_dicts_the_kernel_cannot_run_are_refused():
    """``config=`` dicts the kernel cannot run are refused: `_launch` runs every dict through
    `_check_config`, the checks of `launch_config` (``vec`` with ``block_m`` > 1 or ``kind='dot'``, a
    negative or non-power-of-two ``vec``). Benchmarks edit dicts (``dict(cfg, block_m=...)``); the vec
    path reads one row, ``row = sum(rows)``, so a vec dict of ``block_m=2`` at M = 2 would give both
    output rows row 1's product, and ``use_dot=True, block_m=16`` at M = 2 would read row 15 of a
    2-row ``x``."""
    t = _inputs(2, 64, 12, torch.float32, seed=1)
    x, w = _dev(t["x"], t["w"])
    plain_vec = C("fma", 1, 4, 32, vec=8)
    for bad in (dict(plain_vec, block_m=2), dict(plain_vec, use_dot=True, block_m=16, block_n=16),
                dict(plain_vec, prefetch=True), dict(plain_vec, early_weight=True),
                dict(C("fma", 2, 4, 32), early_weight=True, prefetch=True)):
        with pytest.raises(ValueError, match="vec needs|early_weight and prefetch"):
            G.gemv_triton(x, w, config=bad)
    with pytest.raises(ValueError, match="power of two"):
        C("fma", 1, 4, 32, vec=-8)
    with pytest.raises(ValueError, match="vec needs"):
        C("fma", 1, 4, 32, vec=64)  # block_k not a multiple of vec
    # what stays accepted computes the reference
    torch.testing.assert_close(G.gemv_triton(x[:1], w, config=plain_vec).cpu(), F.linear(t["x"][:1], t["w"]),
                               atol=1e-5, rtol=1e-5)


# ---- the batch-1 paths against the references ----------------------------------------------------


@needs_triton
@pytest.mark.parametrize("cfg_name", ["vec", "early"])
@pytest.mark.parametrize("one_load_max", [None, 64])  # None: the module's limit; 64: K=200 > limit
def test_one_load_norm_pass_its_fallback_and_peeled_first_tile_match_the_reference(cfg_name, one_load_max,
                                                                                   monkeypatch):
    """K = 200: not a multiple of the K tile (32) nor a power of two (NORM_PAD 256, masked);
    N = 37: 10 column tiles over 4 programs (3, 3, 2, 2 tiles: the peeled tile plus the loop, the
    trigger on the last), the last tile partial. With ``NORM_ONE_LOAD_MAX`` below K the pass falls
    back to the K-tile loop. fp32: ``h`` exact, ``y`` to fp32 summation order; residual and bias
    on, then neither."""
    if one_load_max is not None:
        monkeypatch.setattr(G, "NORM_ONE_LOAD_MAX", one_load_max)
    cfg = {"vec": VEC, "early": EARLY}[cfg_name]
    t = _inputs(1, 200, 37, torch.float32, seed=5)
    x, r, nw, w, b = _dev(t["x"], t["res"], t["nw"], t["w"], t["b"])
    y, h = G.rmsnorm_gemv_triton(x, r, nw, 1e-5, w, b, config=cfg)
    yr, hr = G.rmsnorm_gemv_ref(t["x"], t["res"], t["nw"], 1e-5, t["w"], t["b"])
    assert torch.equal(h.cpu(), hr)
    torch.testing.assert_close(y.cpu(), yr, atol=1e-5, rtol=1e-5)
    y = G.rmsnorm_gemv_triton(x, None, nw, 1e-5, w, config=cfg)
    torch.testing.assert_close(y.cpu(), G.rmsnorm_gemv_ref(t["x"], None, t["nw"], 1e-5, t["w"]),
                               atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("cfg_name", ["vec", "early"])
def test_rounding_points_of_the_new_paths_are_the_references(cfg_name):
    """fp16 with W = the identity (N = K = 40): y[j] is the activation a[j] times 1 plus exact
    zeros, so y equals the reference's activation bit for bit only if the kernel rounds where
    `rms_norm_ref` does (``h`` to fp16, the normalised row to fp16 before the norm weight, the
    product to fp16). Skipping the normalised row's rounding changes 8 of the 40 values. The
    same for SiLU-and-mul with an fp32 output (the activation rounded to fp16 before the product)."""
    cfg = {"vec": VEC, "early": EARLY}[cfg_name]
    k = 40
    t = _inputs(1, k, k, torch.float16, seed=2)
    eye = torch.eye(k, dtype=torch.float16)
    x, r, nw, w = _dev(t["x"], t["res"], t["nw"], eye)
    y, h = G.rmsnorm_gemv_triton(x, r, nw, 1e-5, w, config=cfg)
    a_ref, h_ref = rms_norm_ref(t["x"], t["nw"], 1e-5, t["res"])
    assert torch.equal(h.cpu(), h_ref)
    assert torch.equal(y.cpu(), a_ref)
    # fp32 output: y is the activation as the kernel multiplied it (one rounding would hide in
    # the store's).
    gu = _dev(t["gu"])[0]
    y = G.silu_mul_gemv_triton(gu, w, config=dict(cfg, norm_one_load=False, early_weight=False),
                               out_dtype=torch.float32)
    assert torch.equal(y.cpu(), silu_and_mul_ref(t["gu"]).float())


@needs_triton
def test_vec_path_with_k_not_a_multiple_of_vec_fp16_bias_and_fp32_output():
    """K = 37 (the last 16-byte vector is partial and masked), N = 9 over 4-column tiles, fp16,
    a bias, and ``out_dtype=torch.float32`` (the tensor-parallel partial product: fp32 accumulator
    plus bias, unrounded) against ``F.linear`` in fp32 of the fp16 values (exact inputs)."""
    t = _inputs(1, 37, 9, torch.float16, seed=3)
    b = t["b"].to(torch.float16)
    x, w, bd, gu = _dev(t["x"], t["w"], b, t["gu"])
    y = G.gemv_triton(x, w, bd, config=VEC, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.cpu(), F.linear(t["x"].float(), t["w"].float(), b.float()), atol=1e-5, rtol=1e-5)
    y = G.silu_mul_gemv_triton(gu, w, bd, config=dict(VEC, norm_one_load=False), out_dtype=torch.float32)
    ref = G.silu_mul_gemv_ref(t["gu"], t["w"], b, out_dtype=torch.float32)
    torch.testing.assert_close(y.cpu(), ref, atol=1e-5, rtol=1e-5)


def test_table_keeps_vec_and_early_weight_on_batch_one_rows_only():
    """The table's vec and early_weight rows are M = 1 rows (the kernel's vec path reads one row),
    and only RMSNorm rows ask for the one-load norm pass."""
    for prologue, rows in G.CONFIGS.items():
        for max_m, _, cfg in rows:
            if cfg.get("vec") or cfg.get("early_weight"):
                assert max_m == 1 == cfg["block_m"], (prologue, max_m, cfg)
            if cfg.get("norm_one_load"):
                assert prologue == "rmsnorm"


# ---- GPU: the launch table at other models' shapes, shards and dtypes ---------------------------

_review8 = load_benchmark("gpu_gemv_shapes")
MODELS, check_model = _review8.MODELS, _review8.check_model


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("model", MODELS, ids=[m[0] for m in MODELS])
def test_gpu_batch_one_table_at_model_shapes(model, dtype):
    """The dispatchers at M = 1 (the table's vec qkv and o_proj, early_weight gate_up when
    N >= 16384, fma down) at Llama 8B, its tp-8 shard (partial K tiles), hidden 5120 (masked
    NORM_PAD), 70B tp 2 and 405B tp 4 (K = 8192 / 16384), against the references: ``h`` bit-exact,
    ``y`` within 1e-2 (16-bit) / 1e-5 (fp32) relative L2; o_proj with a strided bias and as an fp32
    partial (benchmarks/lab/gpu_gemv_shapes.py, `check_model`)."""
    assert check_model(*model, dtype) == []
