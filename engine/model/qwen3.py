"""Qwen3 (dense): Qwen2's layout without the q/k/v biases (``attention_bias``, normally False) and
with an RMSNorm over each head's ``head_dim`` on queries and keys before rotary (``q_norm`` /
``k_norm``)."""

from __future__ import annotations

from dataclasses import replace

from kvpilot.model.attention import AttentionOptions
from kvpilot.model.decoder import CausalLM
from kvpilot.model.qwen2 import Qwen2Spec


class Qwen3Spec(Qwen2Spec):
    def attention_options(self, layer_idx: int) -> AttentionOptions:
        bias = bool(self.raw.get("attention_bias", False))
        return replace(super().attention_options(layer_idx), qkv_bias=bias, o_bias=bias, qk_norm=True)


class Qwen3ForCausalLM(CausalLM):
    spec_cls = Qwen3Spec
