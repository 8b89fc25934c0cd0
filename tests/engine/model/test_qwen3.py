"""Qwen3 against transformers on random weights: per-head q/k RMSNorm, no biases, GQA, head_dim
independent of hidden_size."""

from __future__ import annotations

import pytest

from support.hf_compare import compare_with_transformers, random_checkpoint

PROMPT = [3, 17, 40, 3, 99, 5, 60, 7, 8, 21, 33, 64, 12, 90, 45, 2, 77, 9, 10]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                      rms_norm_eps=1e-6, tie_word_embeddings=False)
    return random_checkpoint(tmp_path_factory.mktemp("qwen3"), Qwen3ForCausalLM, cfg, seed=3)


def test_qwen3_logprobs_and_greedy_match_transformers(ckpt):
    from transformers import Qwen3ForCausalLM

    out = compare_with_transformers(ckpt, Qwen3ForCausalLM, PROMPT, steps=32, chunk=8)
    attn = out["runner"].model.layers[1].self_attn
    assert attn.opts.qk_norm and attn.q_norm.weight.shape == (16,) and attn.qkv_proj.bias is None
    assert (attn.k_norm.weight - 1).abs().sum() > 0  # the checkpoint's k_norm, not the initial ones
