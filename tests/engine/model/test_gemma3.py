"""Gemma 3 (text) against transformers on random weights: local layers (window shorter than the
prompt, their own rope base) and global layers (another base, linear rope scaling), q/k norm
with ``(1 + w)``, sandwich norms, embedding scaling, tied embeddings."""

from __future__ import annotations

import pytest
import torch

from support.hf_compare import compare_with_transformers, random_checkpoint

PROMPT = [2, 17, 40, 3, 99, 5, 60, 7, 8, 21, 33, 64, 12, 90, 45, 2, 77, 9, 10, 11, 70, 4, 5]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=5, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], rms_norm_eps=1e-6,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}})
    return random_checkpoint(tmp_path_factory.mktemp("gemma3"), Gemma3ForCausalLM, cfg, seed=5, norm_center=0.0,
                             std=0.2)


def test_gemma3_logprobs_and_greedy_match_transformers(ckpt):
    from transformers import Gemma3ForCausalLM

    out = compare_with_transformers(ckpt, Gemma3ForCausalLM, PROMPT, steps=32, chunk=6)
    model = out["runner"].model
    assert [layer.self_attn.opts.rope_key for layer in model.layers] == ["local", "local", "default"]
    assert [layer.self_attn.opts.sliding_window for layer in model.layers] == [5, 5, None]
    local, glob = model.rope_caches["local"], model.rope_caches["default"]
    assert not torch.equal(local, glob)  # two bases: two tables
    assert model.layers[0].self_attn.opts.qk_norm
