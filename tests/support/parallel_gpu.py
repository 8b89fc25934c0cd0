"""The Llama-shaped random model the two-GPU tests load (written once per module)."""

from __future__ import annotations


import pytest


# Llama-shaped and big enough that a step's GPU time dwarfs the launch (so an answer before the
# GPU finished is actually exercised), small enough to load in seconds.
SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-5,
             rope_theta=10000.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kvpilot.tools.random_model import write_random_llama

    return write_random_llama(tmp_path_factory.mktemp("par_gpu") / "m", SHAPE, device="cuda", std=0.05)
