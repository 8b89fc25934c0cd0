"""Phi-3 against transformers on random weights: fused qkv and gate_up checkpoint tensors,
partial rotary with LongRoPE (Phi-4-mini's layout), GQA."""

from __future__ import annotations

import pytest

from support.hf_compare import compare_with_transformers, random_checkpoint

PROMPT = [1, 17, 40, 3, 99, 5, 60, 7, 8, 21, 33, 64, 12, 90, 45, 2, 77, 9]


@pytest.fixture(scope="module", params=["full", "partial_longrope"])
def ckpt(request, tmp_path_factory):
    from transformers import Phi3Config, Phi3ForCausalLM

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if request.param == "partial_longrope":
        rot_half = 16 * 3 // 4 // 2  # head_dim 16, partial_rotary_factor 0.75
        kw.update(partial_rotary_factor=0.75, original_max_position_embeddings=64,
                  rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                   "original_max_position_embeddings": 64,
                                   "short_factor": [1.0 + 0.1 * i for i in range(rot_half)],
                                   "long_factor": [2.0 + 0.5 * i for i in range(rot_half)]})
    cfg = Phi3Config(**kw)
    return random_checkpoint(tmp_path_factory.mktemp("phi3"), Phi3ForCausalLM, cfg, seed=6), request.param


def test_phi3_logprobs_and_greedy_match_transformers(ckpt):
    from transformers import Phi3ForCausalLM

    path, kind = ckpt
    out = compare_with_transformers(path, Phi3ForCausalLM, PROMPT, steps=32, chunk=7)
    attn = out["runner"].model.layers[0].self_attn
    assert attn.rotary_dim == (12 if kind == "partial_longrope" else 16)
    assert tuple(attn.qkv_proj.weight.shape) == (4 * 16 + 2 * 2 * 16, 64)
