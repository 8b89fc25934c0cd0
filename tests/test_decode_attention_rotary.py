"""The fused decode step (rotary + KV-cache write + paged attention + split merge, one launch)
against its reference composition (`rotary_write_kv_cache_ref` then `paged_attention_ref`).

On CPU under ``TRITON_INTERPRET=1`` (``make test``); ``gpu``-marked cases use Llama-3.1-8B's
attention shape on a CUDA device.
"""

from __future__ import annotations

import os

import pytest
import torch

from test_kernels_reference import make_paged_batch

from kvpilot.kernels import FP8_KV_DTYPE, build_rope_cache, decode_attention_rotary, decode_attention_rotary_ref

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not (HAS_CUDA or INTERPRET), reason="needs a CUDA GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"

from kvpilot.kernels import decode_attention_rotary_triton, rotary_write_kv_cache_triton  # noqa: E402
from kvpilot.kernels import attention as attn_mod  # noqa: E402


def _step(ctx_lens, heads, kv_heads, head_dim, block_size, dtype, padded=(), seed=0, cache_dtype=None):
    """A decode step: sequence i has ``ctx_lens[i]`` cached keys plus one new token (raw k/v given
    separately; its cache slot holds NaN, so reading it before the write would poison the output).
    Sequences in ``padded`` have no query (a CUDA graph's padding): slot -1, never touched."""
    q_lens = [0 if i in padded else 1 for i in range(len(ctx_lens))]
    q, kc, vc, bt, sl, qsl, _, _ = make_paged_batch(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size,
                                                    dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    n = sum(q_lens)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.reshape(n, -1, head_dim) for t in (q, k, v))  # strided views, as in the model
    slots, positions = [], []
    for i, c in enumerate(ctx_lens):
        if i in padded:
            continue
        p = c  # context index of the new token = seq_len - 1
        slot = int(bt[i, p // block_size]) * block_size + p % block_size
        kc.view(-1, kv_heads, head_dim)[slot] = float("nan")
        vc.view(-1, kv_heads, head_dim)[slot] = float("nan")
        slots.append(slot)
        positions.append(p + 3)  # rotary positions need not equal context indices
    if cache_dtype is not None:
        kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
    cos_sin = build_rope_cache(head_dim, 8192, 10000.0, None)
    return dict(q=q, k=k, v=v, positions=torch.tensor(positions), cos_sin_cache=cos_sin, k_cache=kc, v_cache=vc,
                slot_mapping=torch.tensor(slots), block_tables=bt, seq_lens=sl, query_start_loc=qsl,
                scale=head_dim ** -0.5, max_seq_len=int(sl.max()))


def _run(fn, case, device, **kw):
    args = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    for name in ("k_cache", "v_cache"):
        args[name] = case[name].clone().to(device)
    out = fn(**args, **kw)
    return out.cpu(), args["k_cache"].cpu(), args["v_cache"].cpu(), args


def _triton_write(case):
    """The caches after the separate Triton rotary + KV-write kernel on the same device: the fused
    kernel must write the same bytes (the engine uses one or the other by batch size)."""
    kc, vc = case["k_cache"].clone().to(DEVICE), case["v_cache"].clone().to(DEVICE)
    rotary_write_kv_cache_triton(*(case[n].clone().to(DEVICE) for n in ("q", "k", "v", "positions", "cos_sin_cache")),
                                 kc, vc, case["slot_mapping"].to(DEVICE))
    return kc.cpu(), vc.cpu()


def _assert_same_cache(got, want):
    assert torch.equal(torch.isnan(got.float()), torch.isnan(want.float()))
    assert torch.equal(torch.nan_to_num(got.float()), torch.nan_to_num(want.float()))


TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_reference(num_splits, dtype):
    """Several sequences (context 0, one block boundary, long), GQA 4, forced split counts (the
    merge is then the kernel's own), plus a padded sequence; caches byte-identical to the separate
    Triton write's."""
    case = _step([0, 31, 150, 47], 8, 2, 64, 16, dtype, padded=(3,))
    want = _run(decode_attention_rotary_ref, case, "cpu")[0]
    kc_want, vc_want = _triton_write(case)
    got, kc_got, vc_got, args = _run(decode_attention_rotary_triton, case, DEVICE, num_splits=num_splits)
    n = int(case["query_start_loc"][-1])
    assert not torch.isnan(got[:n]).any()
    torch.testing.assert_close(got[:n], want[:n], **TOL[dtype])
    _assert_same_cache(kc_got, kc_want)
    _assert_same_cache(vc_got, vc_want)
    # q, k, v are read only
    for name in ("q", "k", "v"):
        assert torch.equal(args[name].cpu(), case[name])


def _unfused_triton(case, num_splits=None):
    """The separate Triton kernels: rotary + KV write, then paged attention (decode kernel)."""
    from kvpilot.kernels import paged_attention_triton

    a = {k: (v.clone().to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    q = rotary_write_kv_cache_triton(a["q"], a["k"], a["v"], a["positions"], a["cos_sin_cache"], a["k_cache"],
                                     a["v_cache"], a["slot_mapping"])
    return paged_attention_triton(q, a["k_cache"], a["v_cache"], a["block_tables"], a["seq_lens"],
                                  a["query_start_loc"], a["scale"], 1, a["max_seq_len"], num_splits=num_splits).cpu()


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("key_scale", [1.0, 300.0])
def test_fp8_cache(num_splits, key_scale):
    """An FP8 cache: the new key and value are saturated to E4M3 and written as the separate kernel
    writes them (x300: some rotated keys pass 448), and the attention uses the cached (rounded)
    values for the new key too: close to the separate kernels' result (both dot in fp16) and, at
    ordinary magnitudes, to the reference."""
    case = _step([5, 90, 200], 4, 1, 128, 32, torch.bfloat16, cache_dtype=FP8_KV_DTYPE, seed=3)
    case["k"] = case["k"] * key_scale
    kc_want, vc_want = _triton_write(case)
    got, kc_got, vc_got, _ = _run(decode_attention_rotary_triton, case, DEVICE, num_splits=num_splits)
    _assert_same_cache(kc_got, kc_want)
    _assert_same_cache(vc_got, vc_want)
    torch.testing.assert_close(got.float(), _unfused_triton(case, num_splits).float(), atol=1e-2, rtol=1e-2)
    # (Under the CPU interpreter the separate kernels' fp16 dots over an FP8 cache already differ
    # from the reference by up to 0.5 on the 6-key sequence, so the reference check is the GPU's.)
    if key_scale > 1.0:
        assert float(torch.nan_to_num(kc_want.float()).abs().max()) == 448.0
    elif DEVICE == "cuda":
        want = _run(decode_attention_rotary_ref, case, "cpu")[0]
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("chunk,max_splits", [(2, 32), (16, 2)])
def test_merge_chunks_and_merge_kernel_fallback(monkeypatch, chunk, max_splits):
    """The in-kernel merge over several chunks of splits (chunk 2, 5 splits), and a launch with more
    splits than ``fused_merge_max_splits``, which leaves the merge to the separate kernel (the
    arrival counters then stay untouched)."""
    monkeypatch.setitem(attn_mod.TUNING["decode"], "fused_merge_chunk", chunk)
    monkeypatch.setitem(attn_mod.TUNING["decode"], "fused_merge_max_splits", max_splits)
    case = _step([300, 10, 200], 8, 2, 64, 16, torch.float32, seed=7)
    want = _run(decode_attention_rotary_ref, case, "cpu")[0]
    got = _run(decode_attention_rotary_triton, case, DEVICE, num_splits=5)[0]
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_counters_reset_and_reused():
    """The arrival counters the merge uses are left at zero, so a second launch (a CUDA graph's next
    replay) merges again; results are identical run to run."""
    case = _step([70, 130], 4, 2, 64, 16, torch.float32, seed=5)
    first = _run(decode_attention_rotary_triton, case, DEVICE, num_splits=3)[0]
    counters = attn_mod._REDUCE_COUNTERS[torch.device(DEVICE) if DEVICE == "cpu" else torch.device("cuda", 0)]
    assert int(counters.abs().sum()) == 0
    second = _run(decode_attention_rotary_triton, case, DEVICE, num_splits=3)[0]
    assert torch.equal(first, second)


def test_dispatcher_and_errors():
    case = _step([10], 2, 1, 32, 16, torch.float32)
    want = _run(decode_attention_rotary_ref, case, "cpu")[0]
    got = _run(decode_attention_rotary, case, "cpu")[0]  # CPU tensors: the reference
    assert torch.equal(got, want)
    bad = dict(case, positions=case["positions"][:0])
    with pytest.raises(ValueError, match="positions"):
        _run(decode_attention_rotary_triton, bad, DEVICE)
    odd = dict(case, cos_sin_cache=case["cos_sin_cache"][:, :-1])
    with pytest.raises(ValueError, match="cos_sin_cache"):
        _run(decode_attention_rotary_triton, odd, DEVICE)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU")
@pytest.mark.parametrize("cache_dtype", [None, FP8_KV_DTYPE])
def test_gpu_llama_shape(cache_dtype):
    """Llama-3.1-8B attention (32 heads, 8 kv heads, 128 dims, blocks of 32) at batch 1 and 4,
    contexts up to 5,000 keys (default split heuristic, so the kernel merges up to 64 splits)."""
    for ctx in ([127], [511], [4999], [1, 64, 700, 3000]):
        case = _step(ctx, 32, 8, 128, 32, torch.bfloat16, cache_dtype=cache_dtype, seed=len(ctx))
        case["max_seq_len"] = 8192  # a graph bucket's loose bound
        want = _run(decode_attention_rotary_ref, case, "cpu")[0]
        kc_want, vc_want = _triton_write(case)
        for _ in range(3):
            got, kc_got, vc_got, _ = _run(decode_attention_rotary_triton, case, "cuda")
            torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
            _assert_same_cache(kc_got, kc_want)
            _assert_same_cache(vc_got, vc_want)
