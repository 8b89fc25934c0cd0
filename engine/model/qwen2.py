"""Qwen2 / Qwen2.5: Llama's layers with biases on q, k and v (none on ``o_proj``), tied embeddings
on the small sizes, and sliding-window attention only where ``use_sliding_window`` is set (then on
the layers from ``max_window_layers`` on, or as ``layer_types`` says)."""

from __future__ import annotations

from dataclasses import replace

from kvpilot.model.attention import AttentionOptions
from kvpilot.model.decoder import CausalLM, FamilySpec


class Qwen2Spec(FamilySpec):
    qkv_bias = True

    def layer_type(self, layer_idx: int) -> str:
        if self.raw.get("layer_types"):
            return self.raw["layer_types"][layer_idx]
        sliding = (self.raw.get("use_sliding_window") and self.raw.get("sliding_window")
                   and layer_idx >= self.raw.get("max_window_layers", 0))
        return "sliding_attention" if sliding else "full_attention"

    def sliding_window(self, layer_idx: int):
        if not self.raw.get("use_sliding_window"):
            return None
        return super().sliding_window(layer_idx)

    def attention_options(self, layer_idx: int) -> AttentionOptions:
        return replace(super().attention_options(layer_idx), qkv_bias=self.qkv_bias, o_bias=False)


class Qwen2ForCausalLM(CausalLM):
    spec_cls = Qwen2Spec
