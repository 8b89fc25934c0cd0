"""The fused rotary + KV-cache write against the composition of its two reference ops.

``rotary_write_kv_cache_triton`` must equal ``apply_rotary_ref`` followed by ``write_kv_cache_ref``.
On CPU the kernel runs under ``TRITON_INTERPRET=1`` (set by ``make test``) with small shapes;
without that variable and without a GPU those tests skip. ``gpu``-marked tests use Llama-3.1-8B
shapes in bf16.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvpilot.kernels import (
    apply_rotary_ref,
    build_rope_cache,
    rotary_write_kv_cache,
    rotary_write_kv_cache_ref,
    write_kv_cache_ref,
)

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
needs_triton = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET), reason="needs a CUDA GPU or TRITON_INTERPRET=1"
)
needs_cuda = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU")
LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}  # fmt: skip


def _triton_fn():
    pytest.importorskip("triton")
    from kvpilot.kernels import rotary_write_kv_cache_triton

    return rotary_write_kv_cache_triton


def _case(num_tokens, heads, kv_heads, head_dim, block_size, dtype, cache_dtype=None, seed=0):
    """A fused QKV output, positions across several blocks, shuffled slots with padding, NaN caches.

    Returns (qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping).
    """
    g = torch.Generator().manual_seed(seed)
    num_blocks = 2 * (-(-num_tokens // block_size)) + 3
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 4 * block_size + 7, (num_tokens,), generator=g)
    positions[-1] = 4 * block_size + 5  # beyond the first block, always
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[1::3] = -1  # padded tokens: no write
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=cache_dtype or dtype)
    v_cache = k_cache.clone()
    cos_sin = build_rope_cache(head_dim, 4 * block_size + 8, 500000.0, LLAMA3_SCALING)
    return qkv, positions, cos_sin, k_cache, v_cache, slots


def _split(qkv, heads, kv_heads, head_dim):
    """q, k, v as strided views of the fused projection output, as in LlamaAttention.forward."""
    n = qkv.shape[0]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (
        q.reshape(n, heads, head_dim),
        k.reshape(n, kv_heads, head_dim),
        v.reshape(n, kv_heads, head_dim),
    )


def _composition(qkv, heads, kv_heads, head_dim, positions, cos_sin, k_cache, v_cache, slots):
    """Today's two ops: apply_rotary_ref then write_kv_cache_ref, on copies."""
    q, k, v = _split(qkv.clone(), heads, kv_heads, head_dim)
    kc, vc = k_cache.clone(), v_cache.clone()
    q_rot, k_rot = apply_rotary_ref(q, k, positions, cos_sin)
    write_kv_cache_ref(k_rot, v, kc, vc, slots)
    return q_rot, kc, vc


def _tol(dtype):
    # Triton's CPU interpreter truncates fp32 -> bf16 instead of rounding to nearest even, and a GPU
    # may contract the rotation into FMAs: one bf16 ulp (2**-7 relative) either way.
    if dtype == torch.bfloat16:
        return dict(atol=1e-2, rtol=2**-7, equal_nan=True)
    return dict(atol=1e-5, rtol=1e-5, equal_nan=True)


def test_rotary_write_kv_cache_ref_equals_composition():
    heads, kv_heads, head_dim, block = 4, 2, 64, 16
    qkv, pos, cs, kc, vc, slots = _case(9, heads, kv_heads, head_dim, block, torch.float32)
    q_ref, kc_ref, vc_ref = _composition(qkv, heads, kv_heads, head_dim, pos, cs, kc, vc, slots)
    before = qkv.clone()
    q, k, v = _split(qkv, heads, kv_heads, head_dim)
    out = rotary_write_kv_cache_ref(q, k, v, pos, cs, kc, vc, slots)
    assert torch.equal(out, q_ref)
    torch.testing.assert_close(kc, kc_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(vc, vc_ref, atol=0, rtol=0, equal_nan=True)
    assert torch.equal(qkv, before)  # the reference returns new tensors
    # Padded tokens wrote nothing; every valid token's slot holds its rotated key and its value.
    valid = slots >= 0
    assert int((~torch.isnan(kc[..., 0, 0])).sum()) == int(valid.sum())
    flat_v = vc.reshape(-1, kv_heads, head_dim)
    assert torch.equal(flat_v[slots[valid]], v[valid])
    # The dispatcher takes the reference for CPU tensors.
    kc2, vc2 = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
    assert torch.equal(rotary_write_kv_cache(q, k, v, pos, cs, kc2, vc2, slots), q_ref)
    torch.testing.assert_close(kc2, kc_ref, atol=0, rtol=0, equal_nan=True)


def test_rotary_write_kv_cache_ref_rejects_bad_input():
    heads, kv_heads, head_dim, block = 4, 2, 64, 16
    qkv, pos, cs, kc, vc, slots = _case(5, heads, kv_heads, head_dim, block, torch.float32)
    q, k, v = _split(qkv, heads, kv_heads, head_dim)
    with pytest.raises(ValueError, match="out of range"):
        bad = slots.clone()
        bad[0] = kc.shape[0] * block
        rotary_write_kv_cache_ref(q, k, v, pos, cs, kc, vc, bad)
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_write_kv_cache_ref(q, k, v, pos, cs, kc, vc, slots[:-1])
    with pytest.raises(ValueError, match="positions"):
        rotary_write_kv_cache_ref(q, k, v, pos[:-1], cs, kc, vc, slots)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary_write_kv_cache_ref(q, k, v, pos, cs[:, :32], kc, vc, slots)
    with pytest.raises(ValueError):
        rotary_write_kv_cache_ref(q, k, v[:, :1], pos, cs, kc, vc, slots)


# (tokens, heads, kv heads, head_dim, block_size, dtype, cache dtype, TUNING overrides)
FUSED_CASES = [
    (7, 4, 2, 64, 16, torch.float32, None, {}),  # GQA 2, split-heads path (few tokens)
    (7, 8, 2, 128, 16, torch.bfloat16, None, {}),  # GQA 4, head_dim 128, bf16
    (6, 4, 4, 64, 32, torch.bfloat16, None, {}),  # MHA, block 32
    (5, 4, 1, 128, 16, torch.float32, None, {}),  # MQA
    (9, 6, 2, 64, 16, torch.float32, None, {"split_tile": 64}),  # 2 heads/program, partial last block
    (3, 8, 4, 128, 16, torch.bfloat16, None, {"split_tile": 128}),  # 4 q + 4 kv programs per token
    (40, 3, 1, 64, 16, torch.float32, None, {}),  # one q and one kv program per token, 3 heads padded
    (8, 4, 2, 64, 16, torch.float32, torch.bfloat16, {"split_heads_below_tokens": 0}),  # cast to cache
]


@needs_triton
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim,block,dtype,cache_dtype,tuning", FUSED_CASES)
def test_rotary_write_kv_cache_triton_matches_composition(
    monkeypatch, tokens, heads, kv_heads, head_dim, block, dtype, cache_dtype, tuning
):
    fused = _triton_fn()
    from kvpilot.kernels import kv_cache

    for key, value in tuning.items():
        monkeypatch.setitem(kv_cache.TUNING, key, value)
    qkv, pos, cs, kc, vc, slots = _case(tokens, heads, kv_heads, head_dim, block, dtype, cache_dtype)
    q_ref, kc_ref, vc_ref = _composition(qkv, heads, kv_heads, head_dim, pos, cs, kc, vc, slots)

    qkv_d = qkv.to(DEVICE)
    kc_d, vc_d = kc.to(DEVICE), vc.to(DEVICE)
    q, k, v = _split(qkv_d, heads, kv_heads, head_dim)
    out = fused(q, k, v, pos.to(DEVICE), cs.to(DEVICE), kc_d, vc_d, slots.to(DEVICE))

    assert out.data_ptr() == q.data_ptr() and out.shape == (tokens, heads, head_dim)  # in place
    torch.testing.assert_close(out.cpu(), q_ref, **_tol(dtype))
    torch.testing.assert_close(kc_d.cpu(), kc_ref, **_tol(cache_dtype or dtype))
    # Values are copied, not computed: bit-exact unless cast to a narrower cache dtype.
    exact = cache_dtype is None or DEVICE == "cuda"
    torch.testing.assert_close(vc_d.cpu(), vc_ref, **(dict(atol=0, rtol=0, equal_nan=True) if exact else _tol(cache_dtype)))
    # Unwritten slots (padded tokens included) stay NaN; k and v in the fused tensor are untouched.
    assert torch.equal(torch.isnan(kc_d.cpu()), torch.isnan(kc_ref))
    q_size = heads * head_dim
    assert torch.equal(qkv_d[:, q_size:].cpu(), qkv[:, q_size:])
    if dtype == torch.float32 and cache_dtype is None and DEVICE == "cpu":
        # Same fp32 operations in the same order as the reference: bit-exact in the interpreter.
        assert torch.equal(out.cpu(), q_ref)
        torch.testing.assert_close(kc_d.cpu(), kc_ref, atol=0, rtol=0, equal_nan=True)


@needs_triton
def test_rotary_write_kv_cache_triton_int32_indices_and_errors():
    fused = _triton_fn()
    heads, kv_heads, head_dim, block = 4, 2, 64, 16
    qkv, pos, cs, kc, vc, slots = _case(4, heads, kv_heads, head_dim, block, torch.float32)
    q_ref, kc_ref, vc_ref = _composition(qkv, heads, kv_heads, head_dim, pos, cs, kc, vc, slots)
    qkv_d, kc_d, vc_d = qkv.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE)
    q, k, v = _split(qkv_d, heads, kv_heads, head_dim)
    out = fused(q, k, v, pos.int().to(DEVICE), cs.to(DEVICE), kc_d, vc_d, slots.int().to(DEVICE))
    torch.testing.assert_close(out.cpu(), q_ref, **_tol(torch.float32))
    torch.testing.assert_close(kc_d.cpu(), kc_ref, **_tol(torch.float32))
    torch.testing.assert_close(vc_d.cpu(), vc_ref, atol=0, rtol=0, equal_nan=True)
    # No tokens: nothing launched, q returned as is.
    empty = q[:0]
    assert fused(empty, k[:0], v[:0], pos[:0].to(DEVICE), cs.to(DEVICE), kc_d, vc_d, slots[:0].to(DEVICE)) is empty
    with pytest.raises(ValueError, match="contiguous"):
        fused(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, pos.to(DEVICE), cs.to(DEVICE), kc_d, vc_d,
              slots.to(DEVICE))  # fmt: skip
    with pytest.raises(ValueError, match="even"):
        fused(q[..., :63], k[..., :63], v[..., :63], pos.to(DEVICE), cs[:, :63].to(DEVICE), kc_d[..., :63],
              vc_d[..., :63], slots.to(DEVICE))  # fmt: skip


# --- GPU: Llama-3.1-8B shapes (32 heads, 8 kv heads, head_dim 128, block 32, bf16) -------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 3, 64, 4096])
def test_gpu_rotary_write_kv_cache_llama8b(tokens):
    from kvpilot.kernels import rotary_write_kv_cache_triton

    torch.manual_seed(0)
    heads, kv_heads, head_dim, block = 32, 8, 128, 32
    num_blocks = 2 * (-(-tokens // block)) + 8
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 131072, (tokens,), device="cuda")
    cs = build_rope_cache(head_dim, 131072, 500000.0, LLAMA3_SCALING, device="cuda")
    slots = torch.randperm(num_blocks * block, device="cuda")[:tokens]
    slots[1::7] = -1
    kc = torch.zeros(num_blocks, block, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    q_ref, kc_ref, vc_ref = _composition(qkv, heads, kv_heads, head_dim, pos, cs, kc, vc, slots)
    q, k, v = _split(qkv, heads, kv_heads, head_dim)
    out = rotary_write_kv_cache_triton(q, k, v, pos, cs, kc, vc, slots)
    torch.testing.assert_close(out, q_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(kc, kc_ref, atol=2e-2, rtol=2e-2)
    assert torch.equal(vc, vc_ref)
    # Rotation in fp32 rounded once: at most one bf16 ulp away from the reference, almost always equal.
    assert (out != q_ref).float().mean().item() < 0.01


@needs_triton
@pytest.mark.parametrize("early_weight_max_rows", [0, 64])  # plain loads / weight issued with x
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_triton_both_load_orders(monkeypatch, early_weight_max_rows, dtype):
    pytest.importorskip("triton")
    from kvpilot.kernels import pointwise, rms_norm_ref, rms_norm_triton

    monkeypatch.setitem(pointwise.TUNING, "rms_norm_early_weight_max_rows", early_weight_max_rows)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 80, generator=g).to(dtype)  # non-power-of-two hidden: masked lanes
    r = torch.randn(3, 80, generator=g).to(dtype)
    w = torch.randn(80, generator=g).to(dtype)
    # bf16: the residual sum is one rounding; y is two (normed, then times the weight), each of which
    # the CPU interpreter may truncate.
    tol_y = dict(atol=1.6e-2, rtol=1.6e-2) if dtype == torch.bfloat16 else _tol(dtype)
    y, h = rms_norm_triton(x.to(DEVICE), w.to(DEVICE), 1e-5, r.to(DEVICE))
    yr, hr = rms_norm_ref(x, w, 1e-5, r)
    torch.testing.assert_close(h.cpu(), hr, **_tol(dtype))
    torch.testing.assert_close(y.cpu(), yr, **tol_y)
    y1 = rms_norm_triton(x.to(DEVICE), w.to(DEVICE), 1e-5)
    torch.testing.assert_close(y1.cpu(), rms_norm_ref(x, w, 1e-5), **tol_y)


@needs_triton
def test_dispatcher_falls_back_to_two_kernels_when_the_fused_kernel_fails(monkeypatch):
    """A Triton that cannot compile the fused kernel must not take the engine down: the dispatcher
    switches once to rotary + write (two launches) and the results stay those of the reference."""
    import kvpilot.kernels as K

    def broken(*args):
        raise RuntimeError("cannot compile")

    monkeypatch.setattr(K, "_use_triton", lambda t: True)
    monkeypatch.setattr(K, "rotary_write_kv_cache_triton", broken)
    monkeypatch.setattr(K, "_fused_rotary_failed", False)
    heads, kv_heads, hd = 4, 2, 16
    qkv, pos, cos_sin, k_cache, v_cache, slots = _case(5, heads, kv_heads, hd, 4, torch.float32)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    shape = lambda t, h: t.reshape(5, h, hd)  # noqa: E731
    want_q = rotary_write_kv_cache_ref(shape(q, heads), shape(k, kv_heads), shape(v, kv_heads), pos, cos_sin,
                                       want_k, want_v, slots)
    got_q = rotary_write_kv_cache(shape(q, heads).clone(), shape(k, kv_heads).clone(), shape(v, kv_heads),
                                  pos, cos_sin, k_cache, v_cache, slots)
    assert K._fused_rotary_failed
    torch.testing.assert_close(got_q, want_q)
    written = slots >= 0
    idx = slots[written]
    flat = lambda c: c.reshape(-1, kv_heads, hd)  # noqa: E731
    torch.testing.assert_close(flat(k_cache)[idx], flat(want_k)[idx])
    torch.testing.assert_close(flat(v_cache)[idx], flat(want_v)[idx])
