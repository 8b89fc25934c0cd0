"""Mistral against transformers on random weights: sliding window shorter than the prompt, GQA."""

from __future__ import annotations

import pytest
import torch

from support.hf_compare import compare_with_transformers, random_checkpoint

PROMPT = [1, 17, 40, 3, 99, 5, 60, 7, 8, 21, 33, 64, 12, 90, 45, 2, 77, 31, 18, 101, 6, 55]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                        sliding_window=8, rms_norm_eps=1e-5, tie_word_embeddings=False)
    return random_checkpoint(tmp_path_factory.mktemp("mistral"), MistralForCausalLM, cfg, seed=1)


def test_mistral_windowed_logprobs_and_greedy_match_transformers(ckpt):
    from transformers import MistralForCausalLM

    out = compare_with_transformers(ckpt, MistralForCausalLM, PROMPT, steps=32, chunk=7)
    layers = out["runner"].model.layers
    assert type(out["runner"].model).__name__ == "MistralForCausalLM"
    assert all(layer.self_attn.opts.sliding_window == 8 for layer in layers)


def test_mistral_window_changes_the_result(ckpt, tmp_path):
    # The same weights with full attention give other log-probs: the window is really applied.
    import json
    import shutil

    from support.hf_compare import kvpilot_runner, run_kvpilot

    full = tmp_path / "full"
    shutil.copytree(ckpt, full)
    cfg = json.loads((full / "config.json").read_text())
    cfg["sliding_window"] = None
    (full / "config.json").write_text(json.dumps(cfg))
    a, _ = run_kvpilot(kvpilot_runner(ckpt), PROMPT, 2, 7)
    b, _ = run_kvpilot(kvpilot_runner(full), PROMPT, 2, 7)
    assert torch.allclose(a[:8], b[:8], atol=1e-5)  # positions inside the window agree
    assert (a[8:] - b[8:]).abs().max() > 1e-3
