"""The PyTorch reference kernels against naive dense implementations and transformers."""

from __future__ import annotations

import math

import pytest
import torch

from kvpilot.kernels import (
    apply_rotary,
    apply_rotary_ref,
    build_rope_cache,
    paged_attention,
    paged_attention_ref,
    rms_norm_ref,
    silu_and_mul_ref,
    write_kv_cache_ref,
)
from support.paged_attention import make_paged_batch, naive_attention


@pytest.mark.parametrize(
    "q_lens,ctx_lens,heads,kv_heads,head_dim,block_size",
    [
        ([1, 1, 1], [0, 5, 40], 4, 4, 16, 16),  # decodes only, GQA 1
        ([7, 1, 3, 1], [0, 17, 33, 2], 8, 4, 8, 16),  # mixed, GQA 2, prefix cached
        ([5, 1, 16], [30, 63, 0], 8, 2, 32, 32),  # GQA 4, block 32
        ([1, 4], [100, 0], 4, 1, 8, 4),  # MQA
    ],
)
def test_paged_attention_ref_matches_naive(q_lens, ctx_lens, heads, kv_heads, head_dim, block_size):
    q, kc, vc, bt, sl, qsl, dk, dv = make_paged_batch(
        q_lens, ctx_lens, heads, kv_heads, head_dim, block_size
    )
    scale = head_dim**-0.5
    out = paged_attention_ref(q, kc, vc, bt, sl, qsl, scale, max(q_lens), int(sl.max()))
    expected = naive_attention(q, dk, dv, sl, qsl, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # The dispatcher takes the reference on CPU.
    torch.testing.assert_close(
        paged_attention(q, kc, vc, bt, sl, qsl, scale, max(q_lens), int(sl.max())), out
    )


def test_paged_attention_ref_bf16_and_padding_tokens():
    q, kc, vc, bt, sl, qsl, dk, dv = make_paged_batch([3, 1], [4, 9], 4, 2, 16, 16, torch.bfloat16)
    q = torch.cat([q, torch.ones(2, 4, 16, dtype=torch.bfloat16)])  # 2 padded tokens at the end
    out = paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.25, 3, 10)
    expected = naive_attention(q[:4], dk, dv, sl, qsl, 0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out[:4].double(), expected, atol=2e-2, rtol=2e-2)
    assert torch.equal(out[4:], torch.zeros(2, 4, 16, dtype=torch.bfloat16))


def test_paged_attention_ref_rejects_bad_input():
    q, kc, vc, bt, sl, qsl, _, _ = make_paged_batch([2], [3], 4, 2, 8, 4)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention_ref(q[:, :3], kc, vc, bt, sl, qsl, 1.0, 2, 5)
    with pytest.raises(ValueError, match="q_len"):
        paged_attention_ref(q, kc, vc, bt, torch.tensor([1], dtype=torch.int32), qsl, 1.0, 2, 5)
    with pytest.raises(ValueError, match="bounds"):
        paged_attention_ref(q, kc, vc, bt, sl, qsl, 1.0, 1, 5)


def test_write_kv_cache_ref_scatters_and_skips_padding():
    kc = torch.zeros(3, 4, 2, 8)
    vc = torch.zeros(3, 4, 2, 8)
    k = torch.randn(4, 2, 8)
    v = torch.randn(4, 2, 8)
    slots = torch.tensor([5, -1, 0, 11])
    write_kv_cache_ref(k, v, kc, vc, slots)
    assert torch.equal(kc[1, 1], k[0]) and torch.equal(vc[1, 1], v[0])
    assert torch.equal(kc[0, 0], k[2]) and torch.equal(kc[2, 3], k[3])
    assert int((kc != 0).any(-1).any(-1).sum()) == 3  # the -1 token wrote nothing
    with pytest.raises(ValueError, match="out of range"):
        write_kv_cache_ref(k, v, kc, vc, torch.tensor([0, 1, 2, 12]))


def test_rms_norm_ref_matches_hf_llama_rmsnorm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    res = torch.randn(5, 64, dtype=torch.bfloat16)
    hf = LlamaRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    hf.weight.data = torch.randn(64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(rms_norm_ref(x, hf.weight, 1e-5), hf(x))
        y, h = rms_norm_ref(x, hf.weight, 1e-5, residual=res)
        assert torch.equal(h, x + res)
        assert torch.equal(y, hf(x + res))


def test_silu_and_mul_ref():
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    expected = torch.tensor([[1.0 / (1 + math.exp(-1.0)) * 3.0, -2.0 / (1 + math.exp(2.0)) * 0.5]])
    torch.testing.assert_close(silu_and_mul_ref(x), expected)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul_ref(torch.ones(2, 3))


def _hf_llama_config(head_dim: int, theta: float, rope_scaling: dict | None):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_theta=theta,
        rope_scaling=dict(rope_scaling) if rope_scaling else None,
    )


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_build_rope_cache_matches_transformers(rope_scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    head_dim, theta, n = 128, 500000.0, 300
    config = _hf_llama_config(head_dim, theta, rope_scaling)
    rotary = LlamaRotaryEmbedding(config)
    assert rotary.attention_scaling == 1.0
    cache = build_rope_cache(head_dim, n, theta, rope_scaling)
    assert cache.shape == (n, head_dim) and cache.dtype == torch.float32
    half = head_dim // 2
    # Same inverse frequencies, bit for bit, as transformers' RoPE init functions.
    if rope_scaling:
        hf_inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_scaling["rope_type"]](config, "cpu")
        assert torch.equal(rotary.inv_freq, hf_inv_freq)
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), rotary.inv_freq)
    assert torch.equal(cache[:, :half], freqs.cos()) and torch.equal(cache[:, half:], freqs.sin())
    cos, sin = rotary(torch.zeros(1, n, head_dim), torch.arange(n)[None])
    torch.testing.assert_close(cache[:, :half], cos[0, :, :half])
    torch.testing.assert_close(cache[:, half:], sin[0, :, :half])
    torch.testing.assert_close(cos[0, :, half:], cos[0, :, :half])  # HF duplicates the halves


def test_build_rope_cache_legacy_type_key_and_errors():
    llama3 = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    a = build_rope_cache(64, 10, 1e4, dict(llama3, rope_type="llama3"))
    b = build_rope_cache(64, 10, 1e4, dict(llama3, type="llama3"))
    assert torch.equal(a, b) and not torch.equal(a, build_rope_cache(64, 10, 1e4, None))
    with pytest.raises(ValueError, match="unsupported rope_scaling"):
        build_rope_cache(64, 10, 1e4, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="even"):
        build_rope_cache(63, 10, 1e4)


def test_apply_rotary_ref_matches_hf():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    head_dim = 32
    cache = build_rope_cache(head_dim, 64, 10000.0)
    q = torch.randn(6, 4, head_dim)
    k = torch.randn(6, 2, head_dim)
    pos = torch.tensor([0, 1, 2, 40, 41, 63])
    half = head_dim // 2
    cos = torch.cat([cache[pos, :half]] * 2, dim=-1)
    sin = torch.cat([cache[pos, half:]] * 2, dim=-1)
    # HF expects [batch, heads, seq, dim] with cos/sin [batch, seq, dim].
    hq, hk = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    rq, rk = apply_rotary_ref(q, k, pos, cache)
    torch.testing.assert_close(rq, hq[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rk, hk[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    dq, dk = apply_rotary(q, k, pos, cache)
    assert torch.equal(dq, rq) and torch.equal(dk, rk)
    # Position 0 is the identity.
    torch.testing.assert_close(rq[0], q[0])
