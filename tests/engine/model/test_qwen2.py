"""Qwen2 against transformers on random weights: q/k/v biases (none on o_proj), GQA, tied embeddings."""

from __future__ import annotations

import pytest

from support.hf_compare import compare_with_transformers, random_checkpoint

PROMPT = [1, 17, 40, 3, 99, 5, 60, 7, 8, 21, 33, 64, 12, 90, 45, 2, 77]


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def ckpt(request, tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-6, tie_word_embeddings=request.param)
    return random_checkpoint(tmp_path_factory.mktemp("qwen2"), Qwen2ForCausalLM, cfg, seed=2), request.param


def test_qwen2_logprobs_and_greedy_match_transformers(ckpt):
    from transformers import Qwen2ForCausalLM

    path, tied = ckpt
    out = compare_with_transformers(path, Qwen2ForCausalLM, PROMPT, steps=32, chunk=6)
    model = out["runner"].model
    attn = model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.qkv_proj.bias.abs().sum() > 0
    assert attn.o_proj.bias is None
    assert (model.lm_head is None) is tied
