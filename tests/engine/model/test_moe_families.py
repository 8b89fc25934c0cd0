"""Mixtral, Qwen2-MoE and Qwen3-MoE against transformers on random weights (float32, CPU): the
per-expert checkpoint tensors stacked at load, routing (renormalised or not), Qwen2-MoE's gated
shared expert, and Qwen's dense layers among the sparse ones (``mlp_only_layers``)."""

from __future__ import annotations

import pytest

from support.hf_compare import compare_with_transformers, random_checkpoint

PROMPT = [3, 17, 40, 3, 99, 5, 60, 7, 8, 21, 33, 64, 12, 90, 45, 2, 77, 9, 10]
BASE = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _families():
    import transformers as T

    return {
        "mixtral": (T.MixtralConfig(**BASE, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2,
                                    sliding_window=None), T.MixtralForCausalLM),
        "qwen3_moe": (T.Qwen3MoeConfig(**BASE, head_dim=16, intermediate_size=64, moe_intermediate_size=24,
                                       num_experts=8, num_experts_per_tok=3, norm_topk_prob=True),
                      T.Qwen3MoeForCausalLM),
        "qwen2_moe": (T.Qwen2MoeConfig(**{**BASE, "num_hidden_layers": 3}, intermediate_size=40,
                                       moe_intermediate_size=24, shared_expert_intermediate_size=36,
                                       num_experts=6, num_experts_per_tok=2, norm_topk_prob=False,
                                       mlp_only_layers=[1]), T.Qwen2MoeForCausalLM),
    }


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_moe_family_logprobs_and_greedy_match_transformers(family, tmp_path):
    from kvpilot.model.moe import SparseMoeBlock

    cfg, cls = _families()[family]
    ckpt = random_checkpoint(tmp_path / family, cls, cfg, seed=5, std=0.15)
    out = compare_with_transformers(ckpt, cls, PROMPT, steps=32, chunk=8)
    model = out["runner"].model
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    if family == "qwen2_moe":
        assert len(blocks) == 2 and not isinstance(model.layers[1].mlp, SparseMoeBlock)
        assert blocks[0].shared_expert is not None and not blocks[0].renormalize
    else:
        assert len(blocks) == 2 and blocks[0].renormalize
    # decode fast path: the fused GEMVs serve the attention of MoE layers, the MoE block its own MLP
    assert all(layer.can_fuse and layer.can_fuse_mlp != isinstance(layer.mlp, SparseMoeBlock)
               for layer in model.layers)
    e = blocks[0].num_experts
    assert blocks[0].w13.shape == (e, 2 * blocks[0].inter, 32) and blocks[0].w2.shape == (e, 32, blocks[0].inter)
    assert len(set(out["tokens"])) > 3  # the random model does not collapse onto one token
