"""Gemma 2: GeGLU MLP (``gelu_pytorch_tanh``), RMSNorm as ``x / rms(x) * (1 + w)``, norms before and
after both attention and MLP, embeddings scaled by ``sqrt(hidden_size)``, tied embeddings, softmax
scale ``query_pre_attn_scalar ** -0.5``, attention logits soft-capped at ``attn_logit_softcapping``
and final logits at ``final_logit_softcapping`` (``cap * tanh(x / cap)``), and local (sliding-window)
and global layers alternating (``layer_types``; older configs: even layers local)."""

from __future__ import annotations

from dataclasses import replace

from kvpilot.model.attention import AttentionOptions
from kvpilot.model.decoder import CausalLM, FamilySpec


class Gemma2Spec(FamilySpec):
    norm_offset = 1.0
    sandwich_norms = True
    scale_embeddings = True

    def layer_type(self, layer_idx: int) -> str:
        if self.raw.get("layer_types"):
            return self.raw["layer_types"][layer_idx]
        return "sliding_attention" if layer_idx % 2 == 0 else "full_attention"

    def activation(self) -> str:
        return self.raw.get("hidden_activation") or "gelu_pytorch_tanh"

    def attention_options(self, layer_idx: int) -> AttentionOptions:
        scalar = self.raw.get("query_pre_attn_scalar") or self.cfg.head_dim
        return replace(super().attention_options(layer_idx), scale=float(scalar) ** -0.5,
                       logits_soft_cap=self.raw.get("attn_logit_softcapping") or None)


class Gemma2ForCausalLM(CausalLM):
    spec_cls = Gemma2Spec
