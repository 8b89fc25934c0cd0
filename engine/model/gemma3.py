"""Gemma 3 (the text model, ``Gemma3ForCausalLM``): Gemma 2's layout with q/k RMSNorm (``1 + w``)
instead of attention soft-capping, local layers (sliding window, ``rope_local_base_freq`` or the
``sliding_attention`` rope parameters, unscaled) interleaved with global layers (``rope_theta`` with
the config's scaling, e.g. ``linear``), five local to one global by default
(``layer_types``; older configs: ``sliding_window_pattern``)."""

from __future__ import annotations

from dataclasses import replace

from kvpilot.model.attention import AttentionOptions
from kvpilot.model.gemma2 import Gemma2Spec
from kvpilot.model.decoder import CausalLM
from kvpilot.model.rotary import RotaryEmbedding, rope_parameters


class Gemma3Spec(Gemma2Spec):
    def layer_type(self, layer_idx: int) -> str:
        if self.raw.get("layer_types"):
            return self.raw["layer_types"][layer_idx]
        pattern = self.raw.get("sliding_window_pattern") or self.raw.get("_sliding_window_pattern") or 6
        return "sliding_attention" if (layer_idx + 1) % pattern else "full_attention"

    def rope_key(self, layer_idx: int) -> str:
        return "local" if self.layer_type(layer_idx) == "sliding_attention" else "default"

    def rotary_embeddings(self) -> dict[str, RotaryEmbedding]:
        src, hd, mp = self.rope_source(), self.cfg.head_dim, self.cfg.max_position_embeddings
        return {"default": RotaryEmbedding(hd, rope_parameters(src, "full_attention"), mp),
                "local": RotaryEmbedding(hd, rope_parameters(src, "sliding_attention"), mp)}

    def attention_options(self, layer_idx: int) -> AttentionOptions:
        return replace(super().attention_options(layer_idx), qk_norm=True, qk_norm_offset=1.0)


class Gemma3ForCausalLM(CausalLM):
    spec_cls = Gemma3Spec
