"""Rope tables of every supported ``rope_type`` against transformers' ``ROPE_INIT_FUNCTIONS``, and
config parsing (transformers 5 ``rope_parameters``, per layer type, and the older keys)."""

from __future__ import annotations

import math

import pytest
import torch

from kvpilot.kernels import build_rope_cache
from kvpilot.model.rotary import RotaryEmbedding, build_cos_sin_cache, rope_parameters

HEAD_DIM, MAX_POS = 32, 256


def _hf(params: dict, seq_len=None):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
                      max_position_embeddings=MAX_POS, rope_parameters=dict(params))
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu", seq_len=seq_len)


def _table(inv_freq: torch.Tensor, attn: float, n: int) -> torch.Tensor:
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq.float())
    return torch.cat([freqs.cos() * attn, freqs.sin() * attn], dim=-1)


@pytest.mark.parametrize("params", [
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0,
     "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
], ids=["linear", "llama3", "yarn", "yarn_mscale"])
def test_static_rope_types_match_transformers(params):
    inv, attn = _hf(params)
    want = _table(inv, attn, MAX_POS)
    got = build_cos_sin_cache(HEAD_DIM, MAX_POS, params, MAX_POS)
    # the inverse frequencies (angles of position 1) and the attention factor, then the whole table
    angle = torch.atan2(got[1, HEAD_DIM // 2:], got[1, :HEAD_DIM // 2])
    torch.testing.assert_close(angle, inv.float(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    if params["rope_type"] == "yarn":
        assert attn > 1.0  # the attention factor is really in the table
        assert abs(got[0, 0].item() - attn) < 1e-6


def test_llama_types_match_the_kernels_table():
    p = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    assert torch.equal(build_cos_sin_cache(HEAD_DIM, MAX_POS, p, MAX_POS), build_rope_cache(HEAD_DIM, MAX_POS, 500000.0, p))


def test_dynamic_ntk_is_unscaled_within_the_context_and_ntk_beyond():
    p = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    inv, _ = _hf(p)  # transformers' value for sequences within max_position_embeddings
    torch.testing.assert_close(build_cos_sin_cache(HEAD_DIM, MAX_POS, p, MAX_POS), _table(inv, 1.0, MAX_POS))
    long_inv, _ = _hf(p, seq_len=2 * MAX_POS)  # a 512-token sequence
    torch.testing.assert_close(build_cos_sin_cache(HEAD_DIM, 2 * MAX_POS, p, MAX_POS),
                               _table(long_inv, 1.0, 2 * MAX_POS), atol=1e-6, rtol=1e-6)


def test_longrope_short_rows_then_long_rows():
    half = HEAD_DIM // 2
    p = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
         "short_factor": [1.0 + 0.05 * i for i in range(half)], "long_factor": [1.5 + 0.2 * i for i in range(half)]}
    short_inv, attn = _hf(p)
    long_inv, attn_long = _hf(p, seq_len=65)
    assert attn == attn_long == pytest.approx(math.sqrt(1 + math.log(MAX_POS / 64) / math.log(64)))
    got = build_cos_sin_cache(HEAD_DIM, MAX_POS, p, MAX_POS)
    torch.testing.assert_close(got[:64], _table(short_inv, attn, 64))
    torch.testing.assert_close(got[64:], _table(long_inv, attn, MAX_POS)[64:], atol=1e-5, rtol=1e-5)


def test_partial_rotary_dimension():
    rope = RotaryEmbedding(32, {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}, 128)
    assert rope.rotary_dim == 24 and rope.is_partial and rope.build_cache(10).shape == (10, 24)


def test_rope_parameters_of_config_formats():
    # transformers 5, one set
    assert rope_parameters({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 5.0}}) == {
        "rope_type": "yarn", "factor": 2.0, "rope_theta": 5.0, "partial_rotary_factor": 1.0}
    # per layer type (Gemma 3)
    raw = {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                               "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}
    assert rope_parameters(raw, "sliding_attention")["rope_theta"] == 1e4
    assert rope_parameters(raw, "full_attention")["factor"] == 8.0
    # older keys: rope_theta + rope_scaling (legacy "type"), Gemma 3's rope_local_base_freq
    old = {"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 8.0}, "rope_local_base_freq": 1e4}
    assert rope_parameters(old) == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6,
                                    "partial_rotary_factor": 1.0}
    assert rope_parameters(old, "sliding_attention")["rope_type"] == "default"
    assert rope_parameters(old, "sliding_attention")["rope_theta"] == 1e4


def test_unknown_rope_type_is_a_clear_error():
    with pytest.raises(ValueError, match="unsupported rope type 'mrope'.*longrope"):
        build_cos_sin_cache(16, 8, {"rope_type": "mrope"}, 8)
