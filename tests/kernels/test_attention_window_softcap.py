"""Sliding-window attention and logit soft-capping in every paged-attention kernel.

The reference (`paged_attention_ref`) is checked against a dense attention whose mask comes from
``transformers.masking_utils.sliding_window_causal_mask_function`` (the mask Mistral, Qwen2, Gemma 2
and Gemma 3 use: key ``k`` visible to query ``q`` iff ``q - window < k <= q``) and Gemma 2's soft cap
``cap * tanh(scores / cap)``; each Triton kernel (prefill, split decode, TMA decode, the fused rotary
decode) is checked against the reference with windows shorter and longer than the context, windows
that start inside a page, prefix-cached / chunked prefill, and forced context splits. Keys before a
sequence's first visible key are NaN in the cache: a kernel that loaded them (or a page wholly
before the window) would return NaN. On CPU the kernels run under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

import pytest
import torch

import kvpilot.kernels as K
from kvpilot.kernels import build_rope_cache, paged_attention_ref, rotary_decode_attention_ref
from support.paged_attention import make_paged_batch

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not (HAS_CUDA or INTERPRET), reason="needs a CUDA GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
FP32_TOL = dict(atol=2e-5, rtol=2e-5)


def _paged(q_lens, ctx_lens, heads, kv_heads, head_dim, block, dtype=torch.float32, window=None, seed=0):
    """`make_paged_batch`, and with ``window`` the cache rows of keys no query of a sequence sees
    (positions below ``ctx_len - window + 1``) set back to NaN."""
    batch = make_paged_batch(q_lens, ctx_lens, heads, kv_heads, head_dim, block, dtype, seed)
    k_cache, v_cache, tables = batch[1], batch[2], batch[3]
    for i, ctx in enumerate(ctx_lens if window is not None else []):
        for p in range(max(ctx - window + 1, 0)):
            k_cache[int(tables[i, p // block]), p % block] = float("nan")
            v_cache[int(tables[i, p // block]), p % block] = float("nan")
    return batch


def _dense_hf(q, dense_k, dense_v, seq_lens, qsl, scale, window, cap):
    """Dense fp32 attention, per sequence, with Hugging Face's causal (+ sliding-window) mask."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    mask_fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    out = torch.zeros(q.shape, dtype=torch.float32)
    for i, s in enumerate(seq_lens.tolist()):
        a, b = int(qsl[i]), int(qsl[i + 1])
        if a == b:
            continue
        qpos = torch.arange(s - (b - a), s)[:, None]
        kpos = torch.arange(s)[None, :]
        allowed = mask_fn(0, 0, qpos, kpos)  # [q_len, s]
        group = q.shape[1] // dense_k[i].shape[1]
        k = dense_k[i].float().repeat_interleave(group, 1)
        v = dense_v[i].float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].float(), k) * scale
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        probs = scores.masked_fill(~allowed[None], float("-inf")).softmax(-1)
        out[a:b] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


MIXED = ([12, 1, 30, 1, 5], [20, 45, 0, 3, 70])  # prefill chunks on cached prefixes, decodes, a fresh prompt


@pytest.mark.parametrize("window", [None, 1, 4, 16, 17, 40, 1000])
@pytest.mark.parametrize("cap", [None, 2.0])
def test_reference_matches_transformers_masks(window, cap):
    q_lens, ctx_lens = MIXED
    q, kc, vc, bt, sl, qsl, dk, dv = _paged(q_lens, ctx_lens, 4, 2, 16, 8, window=window)
    scale = 0.3
    got = paged_attention_ref(q, kc, vc, bt, sl, qsl, scale, max(q_lens), int(sl.max()),
                              sliding_window=window, logits_soft_cap=cap)
    assert not got.isnan().any()
    torch.testing.assert_close(got, _dense_hf(q, dk, dv, sl, qsl, scale, window, cap), **FP32_TOL)


def test_window_and_cap_change_the_result():
    """A window shorter than the context and a soft cap each change the output (the options are live)."""
    q, kc, vc, bt, sl, qsl, _, _ = _paged([1, 6], [40, 30], 4, 2, 16, 8)
    args = (q, kc, vc, bt, sl, qsl, 0.5, 6, int(sl.max()))
    full = paged_attention_ref(*args)
    assert (paged_attention_ref(*args, sliding_window=8) - full).abs().max() > 1e-2
    assert (paged_attention_ref(*args, logits_soft_cap=1.0) - full).abs().max() > 1e-2
    # A window at least as long as every context is full attention.
    torch.testing.assert_close(paged_attention_ref(*args, sliding_window=int(sl.max())), full)


@pytest.mark.parametrize("bad", [dict(sliding_window=0), dict(sliding_window=-3), dict(sliding_window=2.5),
                                 dict(sliding_window=True), dict(logits_soft_cap=0.0), dict(logits_soft_cap=-1.0),
                                 dict(logits_soft_cap=float("inf")), dict(logits_soft_cap="50")])
def test_bad_window_or_cap_is_a_value_error(bad):
    q, kc, vc, bt, sl, qsl, _, _ = _paged([1], [5], 2, 1, 16, 8)
    with pytest.raises(ValueError, match="sliding_window|logits_soft_cap"):
        paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.25, 1, 6, **bad)
    with pytest.raises(ValueError, match="sliding_window|logits_soft_cap"):
        K.paged_attention(q, kc, vc, bt, sl, qsl, 0.25, 1, 6, **bad)


def _triton_attention(*args, **kwargs):
    from kvpilot.kernels.attention import paged_attention_triton

    dev = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    return paged_attention_triton(*dev, **kwargs).cpu()


PREFILL_CASES = [  # q_lens, ctx_lens, heads, kv_heads, head_dim, block, window, cap, num_splits
    (*MIXED, 4, 2, 32, 16, 7, None, None),       # window inside a page, shorter than every context
    (*MIXED, 4, 2, 32, 16, 16, 3.0, None),       # window of one page, soft cap
    (*MIXED, 4, 2, 32, 16, 33, None, 3),         # window across page boundaries, split contexts
    (*MIXED, 4, 2, 32, 16, 500, 3.0, 4),         # window longer than every context
    ([70, 1], [100, 60], 2, 1, 32, 16, 24, 3.0, None),   # two query tiles: each starts at its own window
    ([70, 1], [100, 60], 2, 1, 32, 16, 24, None, 5),
    ([9], [0], 4, 4, 64, 8, 3, 1.5, None),       # a fresh prompt, MHA
]


@needs_triton
@pytest.mark.parametrize("q_lens,ctx_lens,heads,kv_heads,head_dim,block,window,cap,num_splits", PREFILL_CASES)
def test_prefill_and_mixed_steps_match_reference(q_lens, ctx_lens, heads, kv_heads, head_dim, block, window, cap,
                                                 num_splits):
    q, kc, vc, bt, sl, qsl, _, _ = _paged(q_lens, ctx_lens, heads, kv_heads, head_dim, block, window=window)
    args = (q, kc, vc, bt, sl, qsl, head_dim ** -0.5 * 2, max(q_lens), int(sl.max()))
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    want = paged_attention_ref(*args, **kw)
    got = _triton_attention(*args, num_splits=num_splits, **kw)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, **FP32_TOL)


@needs_triton
@pytest.mark.parametrize("to_decode_kernel", [True, False])
def test_mixed_step_decode_rows_in_either_kernel(monkeypatch, to_decode_kernel):
    from kvpilot.kernels import attention

    monkeypatch.setitem(attention.TUNING["prefill"], "decode_rows_to_decode_kernel", to_decode_kernel)
    q_lens, ctx_lens = [1, 9, 1, 3], [150, 40, 20, 70]
    q, kc, vc, bt, sl, qsl, _, _ = _paged(q_lens, ctx_lens, 4, 2, 32, 16, window=19)
    args = (q, kc, vc, bt, sl, qsl, 0.2, max(q_lens), int(sl.max()))
    kw = dict(sliding_window=19, logits_soft_cap=4.0)
    torch.testing.assert_close(_triton_attention(*args, **kw), paged_attention_ref(*args, **kw), **FP32_TOL)


DECODE_CASES = [  # ctx_lens (keys before the new token), window, cap, num_splits
    ([150, 0, 64, 300, 17], 32, None, None),     # split by the heuristic over the window's keys
    ([150, 0, 64, 300, 17], 50, 2.5, 4),         # forced splits: each sequence divides its window
    ([150, 0, 64, 300, 17], 7, None, 1),         # one split, window inside a page
    ([150, 9, 64], 1000, 2.5, 3),                # window longer than the contexts
    ([150, 9, 64], 1, None, 2),                  # window of one key: the token itself
]


@needs_triton
@pytest.mark.parametrize("ctx_lens,window,cap,num_splits", DECODE_CASES)
def test_split_decode_matches_reference(monkeypatch, ctx_lens, window, cap, num_splits):
    from kvpilot.kernels import attention

    monkeypatch.setitem(attention.TUNING["decode"], "min_split_tokens", 16)
    q, kc, vc, bt, sl, qsl, _, _ = _paged([1] * len(ctx_lens), ctx_lens, 8, 2, 32, 16, window=window)
    args = (q, kc, vc, bt, sl, qsl, 0.25, 1, int(sl.max()) + 64)  # a loose bound, as in a CUDA graph
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    got = _triton_attention(*args, num_splits=num_splits, **kw)
    assert not got.isnan().any()
    torch.testing.assert_close(got, paged_attention_ref(*args, **kw), **FP32_TOL)


@needs_triton
@pytest.mark.parametrize("num_splits", [None, 3])
def test_gemma_head_dim_256(num_splits):
    """Gemma's head_dim 256 (the kernels halve their key tiles above 128) with window and cap, in a
    mixed step of prefill chunks and decodes and in a decode-only step."""
    kw = dict(sliding_window=21, logits_soft_cap=2.0)
    q, kc, vc, bt, sl, qsl, _, _ = _paged([20, 1, 1], [40, 30, 70], 4, 2, 256, 16, window=21)
    args = (q, kc, vc, bt, sl, qsl, 256 ** -0.5, 20, int(sl.max()))
    torch.testing.assert_close(_triton_attention(*args, num_splits=num_splits, **kw), paged_attention_ref(*args, **kw),
                               **FP32_TOL)
    q, kc, vc, bt, sl, qsl, _, _ = _paged([1, 1], [90, 33], 4, 2, 256, 16, window=21)
    args = (q, kc, vc, bt, sl, qsl, 256 ** -0.5, 1, int(sl.max()))
    torch.testing.assert_close(_triton_attention(*args, num_splits=num_splits, **kw), paged_attention_ref(*args, **kw),
                               **FP32_TOL)


@needs_triton
@pytest.mark.skipif(not INTERPRET, reason="runs the TMA kernel under TRITON_INTERPRET=1")
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("pages", [1, 2])
@pytest.mark.parametrize("window,cap", [(5, None), (16, 2.0), (23, None), (40, 2.0), (1000, None)])
def test_tma_decode_matches_reference(monkeypatch, kv_dtype, pages, window, cap):
    """Full-batch decodes through `_decode_tma_kernel` (8 programs fill the interpreter's 4 "SMs"):
    the first tile starts at the window's page and masks the keys before the window."""
    from kvpilot.kernels import attention, decode_attention

    calls = []
    real = decode_attention._launch_decode_tma
    monkeypatch.setitem(attention.TUNING, "decode", dict(attention.TUNING["decode"], batch_tma=True,
                                                         batch_tma_fp8=True, batch_tma_pages=pages))
    monkeypatch.setattr(decode_attention, "_launch_decode_tma", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    ctx_lens = [0, 14, 15, 16, 39, 63, 70]
    q, kc, vc, bt, sl, qsl, _, _ = _paged([1] * len(ctx_lens), ctx_lens, 8, 2, 32, 16, window=window)
    q = q.to(torch.float16)
    kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
    args = (q, kc, vc, bt, sl, qsl, 32 ** -0.5, 1, int(sl.max()))
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    got = _triton_attention(*args, **kw)
    assert calls == [1]
    want = paged_attention_ref(q.float(), kc.float(), vc.float(), *args[3:], **kw)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)


def _decode_step(ctx, heads, kv_heads, head_dim, block, window, seed=0):
    """Arguments of `rotary_decode_attention_ref`: sequence ``i`` has ``ctx[i]`` keys, the last one the
    new token; cache rows before each sequence's window are NaN."""
    g = torch.Generator().manual_seed(seed)
    n, width = len(ctx), -(-max(ctx) // block)
    num_blocks = n * width + 2
    q = torch.randn(n, heads, head_dim, generator=g)
    k = torch.randn(n, kv_heads, head_dim, generator=g)
    v = torch.randn(n, kv_heads, head_dim, generator=g)
    k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: n * width].reshape(n, width).to(torch.int32)
    for i, c in enumerate(ctx):
        for p in range(max(c - window, 0)):
            k_cache[int(tables[i, p // block]), p % block] = float("nan")
            v_cache[int(tables[i, p // block]), p % block] = float("nan")
    seq_lens = torch.tensor(ctx, dtype=torch.int32)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    positions = torch.tensor([c - 1 for c in ctx])
    slots = torch.tensor([int(tables[i, (c - 1) // block]) * block + (c - 1) % block for i, c in enumerate(ctx)])
    cos_sin = build_rope_cache(head_dim, max(ctx) + 1, 10000.0)
    return (q, k, v, positions, cos_sin, k_cache, v_cache, slots, tables, seq_lens, qsl, head_dim ** -0.5, max(ctx))


@needs_triton
@pytest.mark.parametrize("ctx,window,cap,num_splits", [
    ([100, 33, 5], 20, None, 3),
    ([100, 33, 5], 20, 2.0, None),
    ([300], 64, 2.0, 8),
    ([40, 17], 16, None, 1),
    ([40, 17], 200, 2.0, 2),
])
def test_fused_rotary_decode_matches_reference(ctx, window, cap, num_splits):
    from kvpilot.kernels.fused_decode_attention import rotary_decode_attention_triton

    args = _decode_step(ctx, 8, 2, 32, 16, window)
    kc, vc = args[5].clone(), args[6].clone()
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    want = rotary_decode_attention_ref(*args[:5], kc, vc, *args[7:], **kw)
    dev = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    got = rotary_decode_attention_triton(*dev, num_splits=num_splits, **kw).cpu()
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, **FP32_TOL)
    new = [(int(args[8][i, (c - 1) // 16]), (c - 1) % 16) for i, c in enumerate(ctx)]
    for b, o in new:  # the new token's key and value were written
        torch.testing.assert_close(dev[5].cpu()[b, o], kc[b, o], **FP32_TOL)
        torch.testing.assert_close(dev[6].cpu()[b, o], vc[b, o], **FP32_TOL)


def test_package_functions_pass_window_and_cap_to_the_reference_on_cpu():
    """`kernels.paged_attention` / `kernels.rotary_decode_attention` (what the model calls) take the
    keywords on every device; on CPU tensors they are the reference."""
    q, kc, vc, bt, sl, qsl, _, _ = _paged([3, 1], [20, 30], 4, 2, 16, 8, window=6)
    args = (q, kc, vc, bt, sl, qsl, 0.25, 3, int(sl.max()))
    kw = dict(sliding_window=6, logits_soft_cap=2.0)
    torch.testing.assert_close(K.paged_attention(*args, **kw), paged_attention_ref(*args, **kw))
    step = _decode_step([40, 17], 8, 2, 32, 16, 10)
    kc1, vc1, kc2, vc2 = step[5].clone(), step[6].clone(), step[5].clone(), step[6].clone()
    got = K.rotary_decode_attention(*step[:5], kc1, vc1, *step[7:], **kw)
    want = rotary_decode_attention_ref(*step[:5], kc2, vc2, *step[7:], **kw)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want)
