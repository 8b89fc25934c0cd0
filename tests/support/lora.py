"""Random PEFT LoRA adapters for tests: peft's own ``get_peft_model`` + ``save_pretrained``, so the
files are exactly what users load (``adapter_config.json``, ``adapter_model.safetensors``)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_peft_adapter(base: Path, out: Path, seed: int, std: float = 0.15, **peft_kwargs) -> Path:
    """Save a LoRA adapter of the Llama checkpoint ``base`` into ``out`` and return ``out``.

    Every ``lora_A`` / ``lora_B`` entry is drawn from ``N(0, std)`` (seeded by ``seed``), large
    enough that the adapter moves the logits clearly. ``peft_kwargs`` go to ``peft.LoraConfig``
    (``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``, ``rank_pattern``, ...).
    """
    from peft import LoraConfig as PeftLoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    torch.manual_seed(seed)
    pm = get_peft_model(model, PeftLoraConfig(init_lora_weights=False, **peft_kwargs))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, std)
    pm.save_pretrained(str(out))
    return out
