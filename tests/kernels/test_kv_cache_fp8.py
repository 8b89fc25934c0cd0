"""FP8 KV cache (``KvCacheConfig(dtype="fp8")``, the seed's advanced configuration): saturating
writes, attention over an FP8 cache (reference and Triton), and the engine end to end on CPU.

Triton cases run under ``TRITON_INTERPRET=1`` (set by ``make test``). The interpreter's float32 ->
E4M3 conversion mis-rounds values that round up into the next power of two (7.94 -> 4 instead of
8; the GPU's conversion instruction rounds to nearest even), so the Triton write tests feed values
that E4M3 holds exactly, plus out-of-range ones: what they check is the kernels' own work (slots,
padding, saturation), and the rounding is the hardware's.
"""

from __future__ import annotations

import os

import pytest
import torch

from support.paged_attention import make_paged_batch

from kvpilot import LLM, KvCacheConfig, SamplingParams
from kvpilot.kernels import (
    FP8_KV_DTYPE,
    build_rope_cache,
    paged_attention_ref,
    rotary_write_kv_cache_ref,
    write_kv_cache_ref,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET),
                                  reason="needs a CUDA GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def test_kv_cache_config_accepts_fp8_and_names_the_choices():
    assert KvCacheConfig(dtype="fp8").dtype == "fp8"
    with pytest.raises(ValueError, match="fp8"):
        KvCacheConfig(dtype="fp4")


def test_reference_write_saturates_instead_of_nan():
    k = torch.tensor([[[1.0, -2.5, 1000.0, -1e6]]])  # [1 token, 1 head, 4]
    cache = torch.zeros(2, 4, 1, 4, dtype=FP8_KV_DTYPE)
    vcache = cache.clone()
    write_kv_cache_ref(k, k, cache, vcache, torch.tensor([5]))
    got = cache[1, 1, 0].float()
    assert got.tolist() == [1.0, -2.5, 448.0, -448.0]
    assert torch.equal(vcache.float(), cache.float())
    assert not torch.isnan(cache.float()).any()


def _exact_e4m3(*shape, generator, scale=3.0):
    """Random values that E4M3 represents exactly (so no rounding is involved)."""
    return (torch.randn(*shape, generator=generator) * scale).to(FP8_KV_DTYPE).float()


def _write_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    k = _exact_e4m3(6, 2, 16, generator=g)
    v = _exact_e4m3(6, 2, 16, generator=g)
    k[0, 0, :4] = torch.tensor([600.0, -600.0, 448.0, 1e5])  # beyond E4M3's range: saturate
    slots = torch.tensor([3, -1, 17, 8, 30, 0])
    cache = lambda: torch.full((4, 8, 2, 16), float("nan")).to(FP8_KV_DTYPE)  # noqa: E731
    return k, v, slots, cache


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal values, NaN (never-written slots) in the same places."""
    got, want = got.float(), want.float()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert torch.equal(got[ok], want[ok])


@needs_triton
def test_triton_write_into_fp8_cache_matches_reference():
    from kvpilot.kernels import write_kv_cache_triton

    k, v, slots, cache = _write_case()
    kc, vc, kr, vr = cache(), cache(), cache(), cache()
    write_kv_cache_ref(k, v, kr, vr, slots)
    kc, vc = kc.to(DEVICE), vc.to(DEVICE)
    write_kv_cache_triton(k.to(DEVICE), v.to(DEVICE), kc, vc, slots.to(DEVICE))
    _assert_same(kc.cpu(), kr)
    _assert_same(vc.cpu(), vr)
    assert kc[0, 3, 0, :4].float().tolist() == [448.0, -448.0, 448.0, 448.0]


@needs_triton
def test_fused_rotary_write_into_fp8_cache_matches_reference():
    from kvpilot.kernels import rotary_write_kv_cache_triton

    g = torch.Generator().manual_seed(3)
    heads, kv_heads, hd, n = 4, 2, 16, 6
    qkv = _exact_e4m3(n, (heads + 2 * kv_heads) * hd, generator=g, scale=4.0)
    qkv[0, heads * hd] = 1000.0  # a key beyond E4M3's range: saturates
    # Position 0 rotates by angle 0, so the keys reach the cast unchanged (exactly representable);
    # rotation itself is covered in bf16/fp32 by test_rotary_kv_write.py.
    pos = torch.zeros(n, dtype=torch.int64)
    slots = torch.tensor([3, -1, 17, 8, 30, 0])
    cos_sin = build_rope_cache(hd, 32, 10000.0, None)
    q, k, v = (t.reshape(n, -1, hd) for t in qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1))
    kr = torch.full((4, 8, kv_heads, hd), float("nan")).to(FP8_KV_DTYPE)
    vr, kc, vc = kr.clone(), kr.clone().to(DEVICE), kr.clone().to(DEVICE)
    q_want = rotary_write_kv_cache_ref(q, k, v, pos, cos_sin, kr, vr, slots)
    q_got = rotary_write_kv_cache_triton(q.clone().to(DEVICE), k.to(DEVICE), v.to(DEVICE), pos.to(DEVICE),
                                         cos_sin.to(DEVICE), kc, vc, slots.to(DEVICE))
    torch.testing.assert_close(q_got.cpu(), q_want, atol=1e-4, rtol=1e-4)
    _assert_same(kc.cpu(), kr)
    _assert_same(vc.cpu(), vr)
    assert float(kc[0, 3, 0, 0]) == 448.0


@pytest.mark.parametrize("triton", [False, pytest.param(True, marks=needs_triton)])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_attention_over_fp8_cache(triton, q_dtype):
    """Attention reads an FP8 cache as the values it holds: equal to attention over the same values
    held in the queries' dtype (mixed prefill chunk on a cached prefix + decodes, GQA 2)."""
    q, kc, vc, bt, sl, qsl, _, _ = make_paged_batch([5, 1, 1], [9, 20, 3], 4, 2, 64, 16, dtype=torch.float32)
    kc8, vc8 = kc.to(FP8_KV_DTYPE), vc.to(FP8_KV_DTYPE)
    q = q.to(q_dtype)
    args = (bt, sl, qsl, 0.125, 5, 23)
    want = paged_attention_ref(q, kc8.float().to(q_dtype), vc8.float().to(q_dtype), *args)
    if triton:
        from kvpilot.kernels import paged_attention_triton

        got = paged_attention_triton(q.to(DEVICE), kc8.to(DEVICE), vc8.to(DEVICE), bt.to(DEVICE),
                                     sl.to(DEVICE), qsl.to(DEVICE), *args[3:]).cpu()
    else:
        got = paged_attention_ref(q, kc8, vc8, *args)
    tol = dict(atol=1e-4, rtol=1e-4) if q_dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_engine_with_fp8_kv_cache(stories_model_dir):
    """stories260K (float32 weights) with an FP8 cache: 4x the tokens per byte of the float32 cache,
    and the greedy text of the unquantised cache for its first 16 tokens (E4M3 keeps 3 mantissa bits,
    so long generations may part at near-ties)."""
    prompts = ["Once upon a time", "The dog", ""]
    sp = SamplingParams(temperature=0, max_tokens=40, return_generation_logits=True)
    runs = {}
    for dtype in ("auto", "fp8"):
        with LLM(str(stories_model_dir), kv_cache_config=KvCacheConfig(dtype=dtype, max_tokens=2048)) as llm:
            runs[dtype] = (llm.generate(prompts, sp, use_tqdm=False), llm._executor.bytes_per_block,
                           llm._executor.kv_caches[0].dtype)
    (ref, ref_bytes, ref_dtype), (fp8, fp8_bytes, fp8_dtype) = runs["auto"], runs["fp8"]
    assert (ref_dtype, fp8_dtype) == (torch.float32, FP8_KV_DTYPE)
    assert ref_bytes == 4 * fp8_bytes
    for a, b in zip(ref, fp8):
        assert a.outputs[0].token_ids[:16] == b.outputs[0].token_ids[:16]
        # First-token logits (after a prefill that reads its own keys back from the cache).
        la, lb = a.outputs[0].generation_logits[0], b.outputs[0].generation_logits[0]
        assert float((la - lb).norm() / la.norm()) < 5e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA GPU")
def test_gpu_fp8_writes_round_like_torch():
    """On the GPU the kernels' float32 -> E4M3 conversion rounds to nearest even, as torch's does."""
    from kvpilot.kernels import write_kv_cache_triton

    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(64, 8, 128, generator=g) * 8, torch.randn(64, 8, 128, generator=g) * 8
    slots = torch.randperm(256, generator=g)[:64]
    kr = torch.zeros(8, 32, 8, 128, dtype=FP8_KV_DTYPE)
    vr = kr.clone()
    write_kv_cache_ref(k, v, kr, vr, slots)
    kc, vc = torch.zeros_like(kr, device="cuda"), torch.zeros_like(vr, device="cuda")
    write_kv_cache_triton(k.cuda(), v.cuda(), kc, vc, slots.cuda())
    assert torch.equal(kc.cpu().float(), kr.float()) and torch.equal(vc.cpu().float(), vr.float())
