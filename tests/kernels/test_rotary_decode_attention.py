"""The fused rotary + KV-cache write + decode attention (``rotary_decode_attention``) against the
composition of its reference ops and against the unfused Triton launches.

On CPU the kernel runs under ``TRITON_INTERPRET=1`` (set by ``make test``) with small shapes; without
that variable and without a GPU those tests skip. ``gpu``-marked tests use Llama-3.1-8B shapes, replay
the kernel in a CUDA graph and compare with the unfused kernels bit for bit where they must agree.
"""

from __future__ import annotations

import os

import pytest
import torch

import kvpilot.kernels as K
from kvpilot.kernels import build_rope_cache, rotary_decode_attention, rotary_decode_attention_ref

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not (HAS_CUDA or INTERPRET), reason="needs a CUDA GPU or TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU")


def _decode_batch(ctx, heads, kv_heads, head_dim, block, dtype, cache_dtype=None, pad=0, seed=0, device="cpu"):
    """A decode step: sequence ``i`` has ``ctx[i]`` keys, its last one the new token. Cached keys are
    random, block tables shuffled, ``pad`` trailing padded sequences (query length 0, slot -1) as in a
    CUDA graph. Returns the argument tuple of `rotary_decode_attention_ref`."""
    g = torch.Generator().manual_seed(seed)
    n, width = len(ctx), -(-max(ctx) // block)
    num_blocks = (n + pad) * width + 3
    cache_dtype = cache_dtype or dtype
    q = torch.randn(n + pad, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(n + pad, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(n + pad, kv_heads, head_dim, generator=g).to(dtype)
    k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g).to(cache_dtype)
    tables = torch.randperm(num_blocks, generator=g)[: (n + pad) * width].reshape(n + pad, width).to(torch.int32)
    seq_lens = torch.tensor(list(ctx) + [0] * pad, dtype=torch.int32)
    qsl = torch.tensor(list(range(n + 1)) + [n] * pad, dtype=torch.int32)
    positions = torch.tensor([c - 1 for c in ctx] + [0] * pad, dtype=torch.int64)
    slots = torch.tensor([int(tables[i, (c - 1) // block]) * block + (c - 1) % block for i, c in enumerate(ctx)]
                         + [-1] * pad, dtype=torch.int64)
    cos_sin = build_rope_cache(head_dim, max(ctx) + 8, 500000.0, None)
    args = (q, k, v, positions, cos_sin, k_cache, v_cache, slots, tables, seq_lens, qsl, head_dim ** -0.5, max(ctx))
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _with_caches(args, k_cache, v_cache):
    return args[:5] + (k_cache, v_cache) + args[7:]


def _triton():
    pytest.importorskip("triton")
    from kvpilot.kernels.attention import paged_attention_triton
    from kvpilot.kernels.fused_decode_attention import rotary_decode_attention_triton
    from kvpilot.kernels.kv_cache import rotary_write_kv_cache_triton

    def unfused(*args, num_splits=None):
        q, k, v, pos, cs, kc, vc, slots, bt, sl, qsl, scale, max_seq = args
        q = rotary_write_kv_cache_triton(q.clone(), k, v, pos, cs, kc, vc, slots)
        return paged_attention_triton(q, kc, vc, bt, sl, qsl, scale, 1, max_seq, num_splits=num_splits)

    return rotary_decode_attention_triton, unfused


CASES = [  # ctx, heads, kv_heads, head_dim, block, dtype, num_splits, pad
    ([100], 8, 2, 32, 16, torch.float32, None, 0),          # split by the heuristic
    ([70, 33, 5], 8, 2, 32, 16, torch.float32, 3, 2),       # forced splits, padded rows
    ([1000], 8, 2, 32, 16, torch.float32, 20, 0),           # 16 valid splits, one merge chunk of 16
    ([1000], 16, 2, 32, 16, torch.float32, 20, 0),          # group 8: merged 8 splits at a time, 2 chunks
    ([5, 40, 17], 4, 4, 64, 8, torch.float32, 1, 0),        # MHA, no split
    ([129, 64], 12, 4, 48, 16, torch.float32, 4, 1),        # head_dim 48 (padded to 64), group 3
    ([300, 45], 8, 2, 32, 16, torch.float16, 6, 0),
    ([1], 4, 1, 16, 4, torch.float32, 2, 0),                # the first token of a sequence
]


@needs_triton
@pytest.mark.parametrize("ctx,heads,kv_heads,head_dim,block,dtype,num_splits,pad", CASES)
def test_fused_matches_reference_composition(ctx, heads, kv_heads, head_dim, block, dtype, num_splits, pad):
    fused, unfused = _triton()
    args = _decode_batch(ctx, heads, kv_heads, head_dim, block, dtype, pad=pad)
    q_before = args[0].clone()
    kc_ref, vc_ref = args[5].clone(), args[6].clone()
    want = rotary_decode_attention_ref(*_with_caches(args, kc_ref, vc_ref))
    got = fused(*args, num_splits=num_splits)
    n = len(ctx)
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got[:n], want[:n], **tol)
    torch.testing.assert_close(args[5], kc_ref, **tol)  # the new keys (rotated) and values written
    torch.testing.assert_close(args[6], vc_ref, atol=0, rtol=0)
    assert torch.equal(args[0], q_before)  # q is not rotated in place
    # The unfused Triton launches write the very same cache bytes.
    kc2, vc2 = args[5].clone(), args[6].clone()
    _ = unfused(*_with_caches(args, kc2, vc2), num_splits=num_splits)
    assert torch.equal(kc2, args[5]) and torch.equal(vc2, args[6])


@needs_triton
def test_fp8_cache_same_bytes_as_unfused_and_close_to_reference():
    fused, unfused = _triton()
    args = _decode_batch([90, 200], 8, 2, 32, 16, torch.float16, cache_dtype=torch.float8_e4m3fn, pad=1)
    kc_u, vc_u = args[5].clone(), args[6].clone()
    want_u = unfused(*_with_caches(args, kc_u, vc_u), num_splits=4)
    kc_r, vc_r = args[5].clone(), args[6].clone()
    want_r = rotary_decode_attention_ref(*_with_caches(args, kc_r, vc_r))
    got = fused(*args, num_splits=4)
    assert torch.equal(args[5].view(torch.uint8), kc_u.view(torch.uint8))
    assert torch.equal(args[6].view(torch.uint8), vc_u.view(torch.uint8))
    torch.testing.assert_close(got[:2], want_u[:2], atol=2e-3, rtol=2e-3)
    # (The interpreter's fp16 -> e4m3 rounding differs from PyTorch's: reference within FP8 error.)
    torch.testing.assert_close(got[:2].float(), want_r[:2].float(), atol=5e-2, rtol=5e-2)


@needs_triton
def test_split_counters_are_left_zero_and_a_second_launch_repeats_the_first():
    from kvpilot.kernels import attention as A
    from kvpilot.kernels import attention_common, decode_attention, fused_decode_attention, prefill_attention  # noqa: F401

    fused, _ = _triton()
    args = _decode_batch([257, 64, 1], 8, 2, 32, 16, torch.float32, seed=3)
    first = fused(*args, num_splits=5)
    counters = fused_decode_attention._SPLIT_COUNTERS[(args[0].device.type, args[0].device.index)]
    assert counters.numel() >= 4096 and int(counters.abs().sum()) == 0
    # The new token's slot now holds the same values: a replay of the step computes the same output.
    again = fused(*args, num_splits=5)
    assert torch.equal(first[:3], again[:3])
    assert int(counters.abs().sum()) == 0


@needs_triton
def test_counter_buffer_grows_and_keeps_the_old_one():
    from kvpilot.kernels import attention as A
    from kvpilot.kernels import attention_common, decode_attention, fused_decode_attention, prefill_attention  # noqa: F401

    key = ("cpu", None)
    before = fused_decode_attention._SPLIT_COUNTERS.get(key)
    try:
        small = fused_decode_attention._split_counters(torch.device("cpu"), 10)
        assert small.numel() == max(4096, small.numel()) and small.dtype == torch.int32
        big = fused_decode_attention._split_counters(torch.device("cpu"), 5000)
        assert big.numel() == 8192 and fused_decode_attention._RETIRED_COUNTERS[-1] is small
        assert fused_decode_attention._split_counters(torch.device("cpu"), 100) is big
    finally:
        if before is not None:
            fused_decode_attention._SPLIT_COUNTERS[key] = before


@needs_triton
def test_bad_input_raises_value_error():
    fused, _ = _triton()
    args = _decode_batch([20, 9], 8, 2, 32, 16, torch.float32)
    q, k, v, pos, cs, kc, vc, slots, bt, sl, qsl, scale, max_seq = args
    with pytest.raises(ValueError, match="launch_kv_heads"):
        fused(*args, launch_kv_heads=3)
    with pytest.raises(ValueError, match="positions"):
        fused(q, k, v, pos[:1], cs, kc, vc, slots, bt, sl, qsl, scale, max_seq)
    with pytest.raises(ValueError, match="slot_mapping"):
        fused(q, k, v, pos, cs, kc, vc, slots[:1], bt, sl, qsl, scale, max_seq)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        fused(q, k, v, pos, cs[:, :16], kc, vc, slots, bt, sl, qsl, scale, max_seq)
    with pytest.raises(ValueError, match="contiguous"):
        fused(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, pos, cs, kc, vc, slots, bt, sl, qsl, scale,
              max_seq)
    with pytest.raises(ValueError):
        fused(q, k[:, :1], v, pos, cs, kc, vc, slots, bt, sl, qsl, scale, max_seq)


def test_dispatcher_uses_the_reference_on_cpu():
    args = _decode_batch([33, 7], 8, 2, 32, 16, torch.float32, pad=1)
    kc, vc = args[5].clone(), args[6].clone()
    want = rotary_decode_attention_ref(*_with_caches(args, kc, vc))
    got = rotary_decode_attention(*args)
    assert torch.equal(got[:2], want[:2])
    assert torch.equal(args[5], kc) and torch.equal(args[6], vc)


@needs_triton
@pytest.mark.parametrize("max_seqs,fused_calls", [(8, 1), (2, 1), (1, 0), (0, 0)])
def test_dispatcher_batch_limit(monkeypatch, max_seqs, fused_calls):
    """Batches of at most ``fused_rotary_max_seqs`` sequences take the one-launch kernel, larger
    ones (0: every batch) the unfused launches; both give the reference's values."""
    from kvpilot.kernels import attention as A
    from kvpilot.kernels import attention_common, decode_attention, fused_decode_attention, prefill_attention  # noqa: F401

    fused, _ = _triton()
    calls = []
    monkeypatch.setattr(K, "_use_triton", lambda t: True)
    monkeypatch.setattr(K, "rotary_decode_attention_triton",
                        lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    monkeypatch.setitem(A.TUNING["decode"], "fused_rotary_max_seqs", max_seqs)
    args = _decode_batch([40, 19], 8, 2, 32, 16, torch.float32)
    kc, vc = args[5].clone(), args[6].clone()
    want = rotary_decode_attention_ref(*_with_caches(args, kc, vc))
    got = rotary_decode_attention(*args)
    assert len(calls) == fused_calls
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(args[5], kc, atol=2e-5, rtol=2e-5)


@needs_triton
def test_dispatcher_falls_back_once_when_the_fused_kernel_fails(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("cannot compile")

    monkeypatch.setattr(K, "_use_triton", lambda t: True)
    monkeypatch.setattr(K, "rotary_decode_attention_triton", broken)
    monkeypatch.setattr(K, "_fused_decode_failed", False)
    args = _decode_batch([40, 19], 8, 2, 32, 16, torch.float32)
    kc, vc = args[5].clone(), args[6].clone()
    want = rotary_decode_attention_ref(*_with_caches(args, kc, vc))
    got = rotary_decode_attention(*args)
    assert K._fused_decode_failed
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # A ValueError (bad input) is the caller's error, not a kernel failure: raised, no switch.
    monkeypatch.setattr(K, "_fused_decode_failed", False)
    monkeypatch.setattr(K, "rotary_decode_attention_triton", lambda *a, **kw: (_ for _ in ()).throw(ValueError("x")))
    with pytest.raises(ValueError):
        rotary_decode_attention(*args)
    assert not K._fused_decode_failed


# ---- GPU: Llama-3.1-8B shapes --------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("ctx,bound", [([512], 2048), ([3999], 4000), ([640], 33024), ([777, 1, 64, 2048], 4096),
                                       ([16384], 32768)])
def test_gpu_fused_equals_unfused_llama8b(cache_dtype, ctx, bound):
    """Same cache bytes as the unfused launches; outputs within one bf16 ulp of theirs (the split merge
    sums in another order); a CUDA-graph replay (PDL on) gives the eager launch's output exactly.
    Bounds above ``fused_long_keys`` take the 2-warp launch."""
    fused, unfused = _triton()
    args = _decode_batch(ctx, 32, 8, 128, 32, torch.bfloat16, cache_dtype=cache_dtype, pad=1, device="cuda")
    args = args[:-1] + (bound,)
    kc_u, vc_u = args[5].clone(), args[6].clone()
    want = unfused(*_with_caches(args, kc_u, vc_u))
    got = fused(*args)
    n = len(ctx)
    assert torch.equal(args[5].view(torch.uint8), kc_u.view(torch.uint8))
    assert torch.equal(args[6].view(torch.uint8), vc_u.view(torch.uint8))
    torch.testing.assert_close(got[:n].float(), want[:n].float(), atol=1e-2, rtol=2**-7)
    kc_r, vc_r = args[5].clone(), args[6].clone()
    ref = rotary_decode_attention_ref(*_with_caches(args, kc_r, vc_r))
    torch.testing.assert_close(got[:n].float(), ref[:n].float(), atol=3e-2, rtol=3e-2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused(*args)  # warm-up outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = fused(*args)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[:n], got[:n])
