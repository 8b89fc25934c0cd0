"""The full-batch decode attention kernel that fetches cache pages by TMA (``_decode_tma_kernel``).

`paged_attention_triton` sends decode-only batches that fill the GPU without context splits to it
when ``TUNING["decode"]["batch_tma_fp8"]`` (FP8 caches) or ``["batch_tma"]`` (16-bit caches) is on.
On CPU it runs under ``TRITON_INTERPRET=1`` (which emulates tensor descriptors) with small shapes,
where 4 "SMs" make 8 (sequence, kv head) programs a full batch; ``gpu`` tests use Llama-3.1-8B shapes
and replay it in a CUDA graph.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvpilot.kernels import attention

from kvpilot.kernels import attention_common, decode_attention, fused_decode_attention, prefill_attention  # noqa: F401
from kvpilot.kernels.reference import paged_attention_ref

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernel under TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU")
FP8 = torch.float8_e4m3fn


@pytest.fixture
def tma_launches(monkeypatch):
    """TMA switched on for both cache kinds; returns the list of `_launch_decode_tma` calls."""
    calls = []
    real = decode_attention._launch_decode_tma
    monkeypatch.setitem(attention.TUNING, "decode", dict(attention.TUNING["decode"], batch_tma=True, batch_tma_fp8=True))
    monkeypatch.setattr(decode_attention, "_launch_decode_tma", lambda *a, **k: (calls.append(a[1].dtype), real(*a, **k))[1])
    return calls


def _poison(cache: torch.Tensor, where) -> None:
    """Write NaN (0x7F in e4m3fn) at ``cache[where]``: bytes a whole-page TMA box reads but must ignore."""
    if cache.dtype == FP8:
        cache.view(torch.uint8)[where] = 0x7F
    else:
        cache[where] = float("nan")


def _batch(lens, kv_dtype, block=16, kv_heads=2, heads=8, head_dim=32, seed=0, device="cpu", poison=True):
    """Decode batch (one query per sequence, ``lens[i]`` keys) over shuffled pages, the cache bytes past
    each context in its last page and all of block 0 (read for a page past the context) set to NaN."""
    g = torch.Generator().manual_seed(seed)
    n, width = len(lens), -(-max(lens) // block) + 1
    nb = n * width + 1
    k = torch.randn(nb, block, kv_heads, head_dim, generator=g).to(kv_dtype)
    v = torch.randn(nb, block, kv_heads, head_dim, generator=g).to(kv_dtype)
    tables = (torch.randperm(nb - 1, generator=g)[: n * width] + 1).reshape(n, width).to(torch.int32)
    if poison:
        for cache in (k, v):
            _poison(cache, 0)
            for i, length in enumerate(lens):
                if length % block:
                    _poison(cache, (int(tables[i, (length - 1) // block]), slice(length % block, None)))
    q = torch.randn(n, heads, head_dim, generator=g).to(torch.float16 if device == "cpu" else torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    return [t.to(device) for t in (q, k, v, tables, seq_lens, qsl)]


def _run(q, k, v, tables, seq_lens, qsl, max_seq_len=None):
    """`paged_attention_triton` of a decode batch (``max_seq_len`` given: no device sync, for capture)."""
    bound = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    return attention.paged_attention_triton(q, k, v, tables, seq_lens, qsl, q.shape[-1] ** -0.5, 1, bound)


@needs_interpreter
@pytest.mark.parametrize("kv_dtype", [torch.float16, FP8])
@pytest.mark.parametrize("pages", [1, 2])
@pytest.mark.parametrize("lazy", [False, True])
def test_tma_decode_matches_reference(tma_launches, monkeypatch, kv_dtype, pages, lazy):
    """Contexts of 1 key, a page minus one, a page, a page plus one, several pages with a partial or a
    NaN-free last page: the output equals the float32 reference (the NaN bytes past each context
    never reach it), and the TMA kernel, not the pointer kernel, ran."""
    attention.TUNING["decode"].update(batch_tma_pages=pages, lazy_rescale=lazy)
    lens = [1, 15, 16, 17, 40, 64, 71]
    q, k, v, tables, seq_lens, qsl = _batch(lens, kv_dtype)
    out = _run(q, k, v, tables, seq_lens, qsl)
    assert tma_launches == [kv_dtype]
    ref = paged_attention_ref(q.float(), k.float().nan_to_num(0.0), v.float().nan_to_num(0.0), tables, seq_lens,
                              qsl, q.shape[-1] ** -0.5, 1, max(lens))
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


@needs_interpreter
def test_tma_decode_agrees_with_pointer_kernel_and_skips_padding(tma_launches, monkeypatch):
    """Trailing padded sequences (query length 0, as in a CUDA graph, their query range starting at
    the real token count) own no output row: the rows past the real tokens keep what the output
    buffer held (a sentinel here). Real rows agree with the pointer kernel (`_decode_kernel`) to fp16
    rounding."""
    lens = [33, 5, 48, 100, 7]
    q, k, v, tables, seq_lens, qsl = _batch(lens, FP8, poison=False)
    qsl = torch.tensor([0, 1, 2, 3, 3, 3], dtype=torch.int32)  # sequences 3 and 4 padded (q_len 0)
    real_empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: real_empty_like(t, **kw).fill_(7.0))
    out = _run(q, k, v, tables, seq_lens, qsl)
    assert tma_launches == [FP8]
    assert torch.equal(out[3:], torch.full_like(out[3:], 7.0))
    attention.TUNING["decode"].update(batch_tma=False, batch_tma_fp8=False)
    base = _run(q, k, v, tables, seq_lens, qsl)
    assert tma_launches == [FP8]
    assert torch.equal(base[3:], torch.full_like(base[3:], 7.0))
    torch.testing.assert_close(out[:3].float(), base[:3].float(), atol=1e-3, rtol=1e-3)


def test_decode_tuning_from_json():
    """Decode launch-table overrides: a JSON object of known keys, two pages at most; anything else a ValueError."""
    assert attention_common.decode_tuning_from_json('{"batch_tma_fp8": false, "batch_tma_pages": 2}') == {
        "batch_tma_fp8": False, "batch_tma_pages": 2}
    for text, match in (("{", "not JSON"), ("[1]", "JSON object"), ('{"batch_tma_fp8 ": false}', "unknown keys"),
                        ('{"batch_tma_pages": 3}', "1 or 2")):
        with pytest.raises(ValueError, match=match):
            attention_common.decode_tuning_from_json(text)


def test_tma_reasons():
    """The launch falls back to the pointer kernel, with a reason, where a TMA box cannot address the cache."""
    q = torch.zeros(4, 8, 32, dtype=torch.float16)
    k = torch.zeros(10, 16, 2, 32, dtype=FP8)
    saved = dict(attention.TUNING["decode"])
    try:
        attention.TUNING["decode"].update(batch_tma=False, batch_tma_fp8=False)
        assert decode_attention._tma_decode_reason(q, k, k, True) == "switched off"
        attention.TUNING["decode"].update(batch_tma=True, batch_tma_fp8=True)
        if decode_attention.TensorDescriptor is None:
            pytest.skip("this Triton has no host-side TMA descriptors")
        assert decode_attention._tma_decode_reason(q, k, k, True) == ""
        assert "contiguous" in decode_attention._tma_decode_reason(q, k[:, :, :1], k, True)
        for shape in ((10, 12, 2, 32), (10, 8, 2, 32), (10, 16, 2, 8), (10, 512, 2, 32)):
            bad = torch.zeros(shape, dtype=FP8)  # a page of 12 or 8 tokens, head_dim 8, a 512-token page
            assert "powers of two from 16 to 256" in decode_attention._tma_decode_reason(q, bad, bad, True), shape
        # The engine's bf16 page (32 x 128) is the largest box; 64 x 128 would need too much shared memory.
        ok, big = torch.zeros(4, 32, 2, 128, dtype=torch.bfloat16), torch.zeros(4, 64, 2, 128, dtype=torch.bfloat16)
        assert decode_attention._tma_decode_reason(q, ok, ok, False) == ""
        assert "shared memory" in decode_attention._tma_decode_reason(q, big, big, False)
        fp32 = torch.zeros(4, 16, 2, 32)
        assert "8- and 16-bit" in decode_attention._tma_decode_reason(q, fp32, fp32, False)
    finally:
        attention.TUNING["decode"].clear()
        attention.TUNING["decode"].update(saved)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [FP8, torch.bfloat16])
def test_tma_decode_gpu_llama_shapes(tma_launches, kv_dtype):
    """Llama-3.1-8B attention shapes, 300 sequences of 1-2,100 keys on 32-token pages (a full batch on an
    H200): within bf16 rounding of the reference on 16 sequences and of the pointer kernel on all,
    and a CUDA-graph replay equals the eager launch bit for bit."""
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(1, 2100, (300,), generator=g).tolist()
    q, k, v, tables, seq_lens, qsl = _batch(lens, kv_dtype, block=32, kv_heads=8, heads=32, head_dim=128,
                                            device="cuda")
    out = _run(q, k, v, tables, seq_lens, qsl)
    assert tma_launches == [kv_dtype]
    ref = paged_attention_ref(q[:16].float(), k.float().nan_to_num(0.0), v.float().nan_to_num(0.0), tables[:16],
                              seq_lens[:16], qsl[:17], 128 ** -0.5, 1, max(lens[:16]))
    assert not out.isnan().any()
    torch.testing.assert_close(out[:16].float(), ref, atol=2e-2, rtol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = _run(q, k, v, tables, seq_lens, qsl, max(lens))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)
    attention.TUNING["decode"].update(batch_tma=False, batch_tma_fp8=False)
    pointer = _run(q, k, v, tables, seq_lens, qsl)
    torch.testing.assert_close(out.float(), pointer.float().nan_to_num(0.0), atol=2e-2, rtol=2e-2)
