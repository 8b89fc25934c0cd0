"""Gemma 2 against transformers on random weights: attention and final soft caps, alternating
local (window shorter than the prompt) and global layers, sandwich norms with ``(1 + w)``,
query_pre_attn_scalar, embedding scaling, tied embeddings, GeGLU."""

from __future__ import annotations

import pytest

from support.hf_compare import compare_with_transformers, random_checkpoint

PROMPT = [2, 17, 40, 3, 99, 5, 60, 7, 8, 21, 33, 64, 12, 90, 45, 2, 77, 9, 10, 11, 70]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                       sliding_window=6, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                       final_logit_softcapping=3.0, rms_norm_eps=1e-6)
    return random_checkpoint(tmp_path_factory.mktemp("gemma2"), Gemma2ForCausalLM, cfg, seed=4, norm_center=0.0,
                             std=0.2)


def test_gemma2_logprobs_and_greedy_match_transformers(ckpt):
    from transformers import Gemma2ForCausalLM

    out = compare_with_transformers(ckpt, Gemma2ForCausalLM, PROMPT, steps=32, chunk=5)
    model = out["runner"].model
    windows = [layer.self_attn.opts.sliding_window for layer in model.layers]
    assert windows == [6, None, 6]
    assert model.layers[0].self_attn.scale == 24 ** -0.5
    assert model.layers[0].self_attn.opts.logits_soft_cap == 2.0 and model.logit_soft_cap == 3.0
    assert model.lm_head is None  # tied
    logits = out["runner"].model.compute_logits(model.embed_tokens.weight[:4] * 50)
    assert logits.abs().max() <= 3.0  # the final soft cap bounds the logits
