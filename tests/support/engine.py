"""Helpers shared by the engine tests: the golden text and tiny random Llama checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch

from kvpilot.tools.convert_llama2c import STORIES260K_GREEDY as GOLDEN  # noqa: F401  (re-exported)


def make_tiny_llama(path: Path, seed: int = 0, rope_scaling: dict | None = None, shards: bool = False,
                    tie: bool = False, vocab: int = 384, layers: int = 3) -> Path:
    """Save a random-weight Llama (GQA 4 heads / 2 KV heads, untied) with `save_pretrained`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
                      rope_scaling=rope_scaling, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():  # larger weights than the default init, so logits are far from ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(path), safe_serialization=True, max_shard_size="100KB" if shards else "2GB")
    return path


def hf_greedy(path: Path, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy continuations by transformers (no EOS stop), one prompt at a time."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


def _checkpoint(path: Path, bias: bool, seed: int = 3) -> Path:
    """A 2-layer random Llama (GQA 4/2 heads of 16, intermediate 96: gate_up N = 192, down K = 96)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, attention_bias=bias, mlp_bias=bias)  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:  # biases too (transformers initialises them to zero)
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(path), safe_serialization=True)
    return path
