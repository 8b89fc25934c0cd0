"""Triton kernels against the PyTorch references.

On CPU these run under ``TRITON_INTERPRET=1`` (set by ``make test``) with small shapes; without that
variable and without a GPU they skip. ``gpu``-marked tests use Llama-3.1-8B shapes in bf16.
"""

from __future__ import annotations

import os

import pytest
import torch

# The shared paged-batch builder and the naive dense attention.
from support.paged_attention import make_paged_batch, naive_attention

from kvpilot.kernels import (
    apply_rotary_ref,
    apply_rotary_triton,
    build_rope_cache,
    paged_attention_ref,
    paged_attention_triton,
    rms_norm_ref,
    rms_norm_triton,
    silu_and_mul_ref,
    silu_and_mul_triton,
    write_kv_cache_ref,
    write_kv_cache_triton,
)

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET), reason="needs a CUDA GPU or TRITON_INTERPRET=1"
)
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU")


def _to(device, *tensors):
    return [t.to(device) for t in tensors]


def _tol(dtype):
    return {
        torch.float32: dict(atol=1e-4, rtol=1e-4),
        torch.float16: dict(atol=2e-3, rtol=2e-3),
        torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
    }[dtype]


ATTENTION_CASES = [
    # q_lens, cached-context lens, heads, kv heads, head_dim, block_size, dtype
    ([1, 1, 1], [0, 20, 45], 2, 2, 64, 16, torch.float32),  # decodes, GQA 1
    ([5, 1, 3, 1], [0, 17, 33, 2], 4, 2, 64, 16, torch.float16),  # mixed, GQA 2, cached prefix
    ([9, 1], [40, 70], 4, 1, 128, 32, torch.float32),  # GQA 4, head_dim 128, block 32
    ([1, 2], [5, 3], 8, 2, 64, 32, torch.bfloat16),  # GQA 4, bf16
    ([70, 1], [10, 100], 2, 2, 64, 16, torch.float16),  # two query tiles in one sequence
]


@pytest.mark.parametrize("q_lens,ctx_lens,heads,kv_heads,head_dim,block_size,dtype", ATTENTION_CASES)
def test_paged_attention_triton_matches_reference(
    q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, dtype
):
    q, kc, vc, bt, sl, qsl, dk, dv = make_paged_batch(
        q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    args = (bt, sl, qsl, scale, max(q_lens), int(sl.max()))
    ref = paged_attention_ref(q, kc, vc, *args)
    qd, kcd, vcd, btd, sld, qsld = _to(DEVICE, q, kc, vc, bt, sl, qsl)
    out = paged_attention_triton(qd, kcd, vcd, btd, sld, qsld, *args[3:])
    assert out.dtype == dtype and out.shape == q.shape
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.cpu(), ref, **_tol(dtype))
    if dtype == torch.float32:
        expected = naive_attention(q, dk, dv, sl, qsl, scale)
        torch.testing.assert_close(out.cpu().double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "num_splits,dtype,q_lens",
    [
        (1, torch.float32, [1, 1, 1, 1]),
        (3, torch.float32, [1, 1, 1, 1]),
        (3, torch.bfloat16, [1, 1, 1, 1]),
        (3, torch.float16, [1, 20, 1, 2]),  # mixed: all in the prefill kernel, q_len 0 included
    ],
)
def test_paged_attention_triton_split_k_decode(num_splits, dtype, q_lens):
    """Split-K decode kernel (forced split counts), including a padded sequence with q_len 0."""
    ctx_lens = [150, 0, 64, 99]
    q, kc, vc, bt, sl, qsl, dk, dv = make_paged_batch(q_lens, ctx_lens, 4, 2, 64, 16, dtype)
    # Append a sequence with no query this step (q_len 0): it must produce nothing.
    qsl = torch.cat([qsl, qsl[-1:]])
    sl = torch.cat([sl, torch.tensor([7], dtype=torch.int32)])
    bt = torch.cat([bt, bt[:1]])
    ref = paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.125, max(q_lens), int(sl.max()))
    qd, kcd, vcd, btd, sld, qsld = _to(DEVICE, q, kc, vc, bt, sl, qsl)
    out = paged_attention_triton(
        qd, kcd, vcd, btd, sld, qsld, 0.125, max(q_lens), int(sl.max()), num_splits=num_splits
    )
    torch.testing.assert_close(out.cpu(), ref, **_tol(dtype))


@pytest.mark.parametrize("to_decode_kernel", [True, False])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mixed_step_decode_rows_either_kernel(monkeypatch, to_decode_kernel, num_splits):
    """A mixed step's one-token rows are right whether the decode kernel takes them (after the
    prefill kernel, whose split reduction writes junk there first) or the prefill kernel does."""
    from kvpilot.kernels import attention
    from kvpilot.kernels import attention_common, decode_attention, fused_decode_attention, prefill_attention  # noqa: F401

    monkeypatch.setitem(attention.TUNING["prefill"], "decode_rows_to_decode_kernel", to_decode_kernel)
    q_lens, ctx_lens = [1, 9, 1, 0, 3, 1], [150, 40, 0, 12, 70, 33]
    q, kc, vc, bt, sl, qsl, dk, dv = make_paged_batch(q_lens, ctx_lens, 4, 2, 64, 16, torch.float32)
    ref = paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.125, max(q_lens), int(sl.max()))
    qd, kcd, vcd, btd, sld, qsld = _to(DEVICE, q, kc, vc, bt, sl, qsl)
    out = paged_attention_triton(qd, kcd, vcd, btd, sld, qsld, 0.125, max(q_lens), int(sl.max()),
                                 num_splits=num_splits)
    torch.testing.assert_close(out.cpu(), ref, **_tol(torch.float32))


@pytest.mark.parametrize("min_split,num_splits", [(64, 8), (64, 64), (256, 8)])
def test_decode_splits_follow_each_sequence_length(monkeypatch, min_split, num_splits):
    """A loose context bound (a CUDA graph's bucket) must not leave short sequences unsplit: each
    sequence divides its own context over the splits (at least ``min_split`` keys each), and the
    reduction weighs exactly the splits that sequence used."""
    from kvpilot.kernels import attention
    from kvpilot.kernels import attention_common, decode_attention, fused_decode_attention, prefill_attention  # noqa: F401

    monkeypatch.setitem(attention.TUNING["decode"], "min_split_tokens", min_split)
    ctx_lens = [150, 0, 64, 300, 1]
    q_lens = [1] * len(ctx_lens)
    q, kc, vc, bt, sl, qsl, dk, dv = make_paged_batch(q_lens, ctx_lens, 4, 2, 64, 16, torch.float32)
    ref = paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.125, 1, int(sl.max()))
    qd, kcd, vcd, btd, sld, qsld = _to(DEVICE, q, kc, vc, bt, sl, qsl)
    out = paged_attention_triton(qd, kcd, vcd, btd, sld, qsld, 0.125, 1, 4096, num_splits=num_splits)
    torch.testing.assert_close(out.cpu(), ref, **_tol(torch.float32))


import triton  # noqa: E402 - after the importorskip above
import triton.language as tl  # noqa: E402

from kvpilot.kernels import attention as attention_mod  # noqa: E402

from kvpilot.kernels import attention_common, decode_attention, fused_decode_attention, prefill_attention  # noqa: F401


@triton.jit
def _tile_probe(qsl_ptr, out_ptr, num_seqs, BLOCK_Q: tl.constexpr, SEQ_CHUNK: tl.constexpr):
    t = tl.program_id(0)
    seq, q_tile, total = prefill_attention._prefill_tile(qsl_ptr, num_seqs, t, BLOCK_Q, SEQ_CHUNK)
    tl.store(out_ptr + 3 * t, seq)
    tl.store(out_ptr + 3 * t + 1, q_tile)
    tl.store(out_ptr + 3 * t + 2, total)


@pytest.mark.parametrize("seq_chunk", [4, 64])
def test_prefill_tile_map(seq_chunk):
    """The device-side tile map: tile t of the flat list is (its sequence, its query tile there), in
    sequence order, q_len-0 sequences own no tile, and the grid bound covers the worst case."""
    block_q = 4
    q_lens = [0, 5, 1, 4, 0, 0, 9, 1, 1, 12, 3, 0]  # 12 sequences: three chunks of 4
    expected = [(i, j) for i, ql in enumerate(q_lens) for j in range(-(-ql // block_q))]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    grid = prefill_attention.prefill_max_tiles(sum(q_lens), len(q_lens), max(q_lens), block_q)
    assert grid >= len(expected)
    out = torch.full((grid, 3), -7, dtype=torch.int32, device=DEVICE)
    _tile_probe[(grid,)](qsl.to(DEVICE), out, len(q_lens), BLOCK_Q=block_q, SEQ_CHUNK=seq_chunk)
    out = out.cpu()
    assert out[:, 2].tolist() == [len(expected)] * grid
    assert [tuple(r) for r in out[: len(expected), :2].tolist()] == expected
    # Worst case of the bound: every sequence one query past a full tile.
    for n, ql in ((7, block_q + 1), (3, 1), (1, 64)):
        tiles = n * -(-ql // block_q)
        assert prefill_attention.prefill_max_tiles(n * ql, n, ql, block_q) >= tiles
    # Context splits from shapes (8B: 16-query tiles, 8 kv heads, 132 SMs): only small steps split.
    assert prefill_attention.prefill_block_q(4) == (16, 64)
    splits = {t: prefill_attention.prefill_num_splits(t, 16, 8, 132) for t in (16, 64, 128, 256, 2048)}
    assert splits == {16: 16, 64: 16, 128: 9, 256: 1, 2048: 1}
    # A graph passes its padded sizes (16 tokens, 16 sequences, max_query_len 16); the batches it
    # may hold include one 16-token sequence (4 tiles) and eight 2-token sequences (8 tiles).
    assert prefill_attention.prefill_max_tiles(16, 16, 16, block_q) >= 8


@pytest.mark.parametrize("dtype,splits", [(torch.float32, None), (torch.bfloat16, 3), (torch.float32, 5)])
def test_paged_attention_triton_graph_padding(dtype, splits):
    """A CUDA-graph-shaped prefill batch: padded tokens no sequence covers, padded sequences with
    q_len 0 and seq_len 0, max_query_len = padded token count.
    Real rows match the reference; padding rows are not read. ``splits`` forces context splits (the
    path of small steps on a GPU; 5 splits leave some empty for the short contexts here)."""
    q_lens = [1] * 8 + [7, 1, 19] + [1] * 6
    ctx_lens = [(5 * i) % 23 for i in range(len(q_lens))]
    ctx_lens[8], ctx_lens[10] = 16, 3  # chunks on a cached prefix (one block-aligned)
    q, kc, vc, bt, sl, qsl, _, _ = make_paged_batch(q_lens, ctx_lens, 4, 2, 32, 8, dtype)
    real, tokens, seqs = int(qsl[-1]), 48, 24
    q = torch.cat([q, torch.full((tokens - real, 4, 32), float("nan"), dtype=dtype)])
    pad = seqs - len(q_lens)
    sl_p = torch.cat([sl, torch.zeros(pad, dtype=torch.int32)])
    qsl_p = torch.cat([qsl, torch.full((pad,), real, dtype=torch.int32)])
    bt_p = torch.cat([bt, torch.zeros(pad, bt.shape[1], dtype=torch.int32)])
    ref = paged_attention_ref(q[:real], kc, vc, bt, sl, qsl, 0.2, max(q_lens), int(sl.max()))
    qd, kcd, vcd, btd, sld, qsld = _to(DEVICE, q, kc, vc, bt_p, sl_p, qsl_p)
    out = paged_attention_triton(qd, kcd, vcd, btd, sld, qsld, 0.2, tokens, 64, num_splits=splits)
    assert out.shape == q.shape and not torch.isnan(out[:real]).any()
    torch.testing.assert_close(out[:real].cpu(), ref, **_tol(dtype))


def test_write_kv_cache_triton_matches_reference():
    torch.manual_seed(0)
    for block_size, kv_heads, head_dim, dtype in [(16, 2, 64, torch.float32), (32, 4, 128, torch.bfloat16)]:
        num_blocks = 4
        kc = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
        vc = torch.randn_like(kc)
        k = torch.randn(6, kv_heads, head_dim).to(dtype)
        v = torch.randn(6, kv_heads, head_dim).to(dtype)
        slots = torch.tensor([3, -1, block_size, 2 * block_size + 5, -1, num_blocks * block_size - 1])
        kr, vr = kc.clone(), vc.clone()
        write_kv_cache_ref(k, v, kr, vr, slots)
        kcd, vcd = _to(DEVICE, kc, vc)
        write_kv_cache_triton(*_to(DEVICE, k, v), kcd, vcd, slots.int().to(DEVICE))
        assert torch.equal(kcd.cpu(), kr) and torch.equal(vcd.cpu(), vr)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_triton_matches_reference(dtype, with_residual):
    torch.manual_seed(0)
    x = torch.randn(5, 96).to(dtype)  # non-power-of-two hidden exercises the mask
    w = torch.randn(96).to(dtype)
    r = torch.randn(5, 96).to(dtype) if with_residual else None
    ref = rms_norm_ref(x, w, 1e-6, r)
    out = rms_norm_triton(*_to(DEVICE, x, w), 1e-6, r.to(DEVICE) if with_residual else None)
    if with_residual:
        # Triton's CPU interpreter truncates fp32 -> bf16 instead of rounding to nearest even, so
        # the rounded sum is bit-exact only on a GPU.
        exact = DEVICE == "cuda" or dtype == torch.float32
        tol = dict(atol=0, rtol=0) if exact else dict(atol=0, rtol=2**-7)
        torch.testing.assert_close(out[1].cpu(), ref[1], **tol)
        out, ref = out[0], ref[0]
    torch.testing.assert_close(out.cpu(), ref, **_tol(dtype))


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (3, 1, 128)])
def test_apply_rotary_triton_matches_reference(heads, kv_heads, head_dim):
    torch.manual_seed(0)
    cache = build_rope_cache(head_dim, 64, 10000.0)
    qkv = torch.randn(7, heads + 2 * kv_heads, head_dim)
    q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]  # strided views, as from a fused QKV
    pos = torch.tensor([0, 1, 5, 6, 30, 62, 63])
    rq, rk = apply_rotary_ref(q, k, pos, cache)
    qkvd = qkv.to(DEVICE)
    qd, kd = qkvd[:, :heads], qkvd[:, heads : heads + kv_heads]
    oq, ok = apply_rotary_triton(qd, kd, pos.to(DEVICE), cache.to(DEVICE))
    torch.testing.assert_close(oq.cpu(), rq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ok.cpu(), rk, atol=1e-5, rtol=1e-5)
    # In place, and the V part of the fused tensor is untouched.
    torch.testing.assert_close(qkvd[:, :heads].cpu(), rq, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkvd[:, heads + kv_heads :].cpu(), qkv[:, heads + kv_heads :])


@pytest.mark.parametrize("shape,dtype", [((3, 2 * 100), torch.float32), ((2, 2, 2 * 64), torch.bfloat16)])
def test_silu_and_mul_triton_matches_reference(shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape).to(dtype)
    out = silu_and_mul_triton(x.to(DEVICE))
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(out.cpu(), silu_and_mul_ref(x), **_tol(dtype))


# --- GPU: Llama-3.1-8B shapes (32 heads, 8 kv heads, head_dim 128, block 32, bf16) -------------


def _llama8b_batch(q_lens, ctx_lens, seed=0):
    """Build the paged batch directly on the GPU (the CPU builder's per-slot loop is too slow)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    heads, kv_heads, head_dim, block_size = 32, 8, 128, 32
    seq_lens = torch.tensor([c + q for c, q in zip(ctx_lens, q_lens)], dtype=torch.int32)
    nblocks = [-(-int(s) // block_size) for s in seq_lens]
    num_blocks = sum(nblocks) + 8
    perm = torch.randperm(num_blocks, device="cuda", generator=g)
    bt = torch.zeros(len(q_lens), max(nblocks), dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(nblocks):
        bt[i, :n] = perm[start : start + n]
        start += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    kc = torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16)
    vc = torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16)
    q = torch.randn(sum(q_lens), heads, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    return q, kc, vc, bt, seq_lens.cuda(), qsl


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "q_lens,ctx_lens",
    [
        ([1] * 64, [int(x) for x in torch.randint(1, 4000, (64,), generator=torch.Generator().manual_seed(1))]),
        ([1, 1], [32000, 700]),  # long-context decode: split-K
        ([512, 1, 1, 130], [0, 3000, 17, 2048]),  # mixed prefill chunks (with cached prefix) + decodes
    ],
)
def test_gpu_paged_attention_llama8b(q_lens, ctx_lens):
    q, kc, vc, bt, sl, qsl = _llama8b_batch(q_lens, ctx_lens)
    args = (bt, sl, qsl, 128**-0.5, max(q_lens), int(sl.max()))
    out = paged_attention_triton(q, kc, vc, *args)
    ref = paged_attention_ref(q, kc, vc, *args)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@gpu
@needs_cuda
def test_gpu_pointwise_llama8b():
    torch.manual_seed(0)
    t, hidden = 257, 4096
    x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    y, h = rms_norm_triton(x, w, 1e-5, r)
    yr, hr = rms_norm_ref(x, w, 1e-5, r)
    assert torch.equal(h, hr)
    torch.testing.assert_close(y, yr, atol=2e-2, rtol=2e-2)
    gu = torch.randn(t, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(silu_and_mul_triton(gu), silu_and_mul_ref(gu), atol=2e-2, rtol=2e-2)
    cache = build_rope_cache(128, 8192, 500000.0, {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, device="cuda")  # fmt: skip
    q = torch.randn(t, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, 8, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 8192, (t,), device="cuda")
    rq, rk = apply_rotary_ref(q, k, pos, cache)
    oq, ok = apply_rotary_triton(q.clone(), k.clone(), pos, cache)
    torch.testing.assert_close(oq, rq, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ok, rk, atol=2e-2, rtol=2e-2)
    kc = torch.zeros(64, 32, 8, 128, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(64 * 32, device="cuda")[:t]
    slots[::7] = -1
    kr, vr = kc.clone(), vc.clone()
    write_kv_cache_ref(k, k * 2, kr, vr, slots)
    write_kv_cache_triton(k, k * 2, kc, vc, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


def test_decode_split_heuristic_matches_h200_tuning(monkeypatch):
    """The split counts that measured best on an H200 (132 SMs; docs/kernels.md)."""
    from kvpilot.kernels import attention
    from kvpilot.kernels import attention_common, decode_attention, fused_decode_attention, prefill_attention  # noqa: F401

    monkeypatch.setattr(attention_common, "_num_sms", lambda index: 132)
    cuda0 = torch.device("cuda", 0)
    # (num_seqs, max_seq_len) -> splits, with 8 kv heads (Llama-3.1-8B).
    expected = {(64, 4096): 1, (256, 1024): 1, (8, 32768): 9, (1, 131072): 64, (4, 300): 5, (1, 100): 2}
    got = {key: attention_common._num_splits(key[0], 8, key[1], cuda0) for key in expected}
    assert got == expected


@pytest.mark.parametrize("num_splits", [1])
@pytest.mark.parametrize("kv_dtype", [torch.float32, "fp8"])
def test_decode_lazy_rescale_is_bit_identical(monkeypatch, num_splits, kv_dtype):
    """``TUNING["decode"]["lazy_rescale"]`` rescales the running output only in tiles where a row's
    max moved: alpha is exactly 1 in the others, so on the CPU interpreter the output is the same
    bits as the eager rescale (on the GPU the tensor-core accumulation order may move the last bit
    of a few outputs), and equal to the reference. Key scores rise and fall along the cache (a
    sine), so a row's max moves in some tiles and stays in others; GQA 4, contexts across tile
    edges. Only launches without context splits use it (`test_split_decode_launch_is_eager`)."""
    from kvpilot.kernels import attention
    from kvpilot.kernels import attention_common, decode_attention, fused_decode_attention, prefill_attention  # noqa: F401

    ctx = [0, 63, 64, 65, 200, 130]
    q, kc, vc, bt, sl, qsl, _, _ = make_paged_batch([1] * len(ctx), ctx, 8, 2, 64, 16, torch.float32)
    wave = 3 * torch.sin(torch.linspace(0.0, 12.0, kc.shape[0] * kc.shape[1])).reshape(kc.shape[0], kc.shape[1], 1, 1)
    kc = kc + wave * q.mean(dim=(0, 1)).sign()
    q_dtype = torch.float32
    if kv_dtype == "fp8":
        from kvpilot.kernels.reference import to_cache_dtype

        kc, vc = to_cache_dtype(kc, torch.float8_e4m3fn), to_cache_dtype(vc, torch.float8_e4m3fn)
        q_dtype = torch.bfloat16
    q = q.to(q_dtype)
    args = (bt, sl, qsl, 0.125, 1, max(ctx) + 1)
    ref = paged_attention_ref(q, kc.float().to(q_dtype) if kv_dtype == "fp8" else kc,
                              vc.float().to(q_dtype) if kv_dtype == "fp8" else vc, *args)
    outs = {}
    for lazy in (False, True):
        monkeypatch.setitem(attention.TUNING, "decode", dict(attention.TUNING["decode"], lazy_rescale=lazy))
        outs[lazy] = paged_attention_triton(*_to(DEVICE, q, kc, vc, bt, sl, qsl), *args[3:],
                                            num_splits=num_splits).cpu()
    assert torch.equal(outs[True], outs[False])
    torch.testing.assert_close(outs[True].float(), ref.float(), **_tol(q_dtype))


@pytest.mark.parametrize("num_splits, lazy", [(1, True), (3, False)])
def test_split_decode_launch_is_eager(monkeypatch, num_splits, lazy):
    """Lazy rescale is compiled into launches without context splits only: with splits (long
    contexts at small batch) it measured 6-8% slower on an H200 (BENCHMARKS.md)."""
    from kvpilot.kernels import attention
    from kvpilot.kernels import attention_common, decode_attention, fused_decode_attention, prefill_attention  # noqa: F401

    seen = []
    real = decode_attention._decode_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                seen.append(kw["LAZY_RESCALE"])
                return real[grid](*a, **kw)
            return launch

    monkeypatch.setattr(decode_attention, "_decode_kernel", Recorder())
    monkeypatch.setitem(attention.TUNING, "decode", dict(attention.TUNING["decode"], lazy_rescale=True))
    q, kc, vc, bt, sl, qsl, _, _ = make_paged_batch([1, 1], [200, 130], 8, 2, 64, 16, torch.float32)
    out = paged_attention_triton(*_to(DEVICE, q, kc, vc, bt, sl, qsl), 0.125, 1, 201, num_splits=num_splits)
    ref = paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.125, 1, 201)
    assert seen == [lazy]
    torch.testing.assert_close(out.cpu().float(), ref.float(), **_tol(torch.float32))
