"""Write a random-weight Llama checkpoint in Hugging Face layout, fast (no `save_pretrained`).

`save_pretrained` of a 16 GB model builds the whole model first and serialises it slowly; for
benchmarks only the shapes matter ("the weights' values do not change speed"), so this draws each
tensor on the target device (normal, std 0.02, as `LlamaConfig.initializer_range`; RMSNorm weights
1), writes one safetensors shard per few layers plus ``model.safetensors.index.json``, and a
``config.json`` from `transformers.LlamaConfig`, so both transformers and kvpilot load the directory.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

LLAMA31_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False,
    rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
)
"""Llama-3.1-8B's shape (its published config.json), built in code."""

TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)
"""A CPU-sized model with the same structure (GQA, untied head), for dry runs and tests."""


def _layer_tensors(cfg: dict, i: int, draw) -> dict[str, torch.Tensor]:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    p = f"model.layers.{i}."
    return {
        p + "self_attn.q_proj.weight": draw(q, h), p + "self_attn.k_proj.weight": draw(kv, h),
        p + "self_attn.v_proj.weight": draw(kv, h), p + "self_attn.o_proj.weight": draw(h, q),
        p + "mlp.gate_proj.weight": draw(inter, h), p + "mlp.up_proj.weight": draw(inter, h),
        p + "mlp.down_proj.weight": draw(h, inter),
        p + "input_layernorm.weight": draw(h, ones=True), p + "post_attention_layernorm.weight": draw(h, ones=True),
    }


def write_random_llama(path: Path, cfg: dict, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                       seed: int = 0, std: float = 0.02, layers_per_shard: int = 4) -> Path:
    """Write config.json, sharded safetensors and their index for a random Llama of shape ``cfg``.

    Args:
        path: output directory (created).
        cfg: `transformers.LlamaConfig` keyword arguments (e.g. `LLAMA31_8B`).
        dtype: stored dtype (also ``torch_dtype`` in config.json).
        device: where the values are drawn (a GPU draws 16 GB in well under a second).
        seed: the values are a function of (seed, device type).
        std: standard deviation of matrix entries.
    Returns:
        ``path``.
    """
    from transformers import LlamaConfig

    t0 = time.perf_counter()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape, ones=False):
        if ones:
            return torch.ones(shape, dtype=dtype)
        return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype).cpu()

    weight_map: dict[str, str] = {}
    n_layers = cfg["num_hidden_layers"]
    groups = [list(range(s, min(s + layers_per_shard, n_layers))) for s in range(0, n_layers, layers_per_shard)]
    total = len(groups) + 1
    for k, layers in enumerate(groups + [[]]):
        name = f"model-{k + 1:05d}-of-{total:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for i in layers:
            tensors.update(_layer_tensors(cfg, i, draw))
        if not layers:  # the last shard: embedding, final norm, LM head
            v, h = cfg["vocab_size"], cfg["hidden_size"]
            tensors["model.embed_tokens.weight"] = draw(v, h)
            tensors["model.norm.weight"] = draw(h, ones=True)
            if not cfg.get("tie_word_embeddings", False):
                tensors["lm_head.weight"] = draw(v, h)
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in tensors})
    size = sum((path / n).stat().st_size for n in set(weight_map.values()))
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": size}, "weight_map": weight_map}, indent=1))
    config = LlamaConfig(**cfg)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = str(dtype).replace("torch.", "")
    config.to_json_file(str(path / "config.json"))
    logger.info("wrote random Llama (%.2f GB) to %s in %.1f s", size / 1e9, path, time.perf_counter() - t0)
    return path
