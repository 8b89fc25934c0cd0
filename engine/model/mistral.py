"""Mistral / Ministral: Llama's layers with sliding-window attention where the config sets
``sliding_window`` (every layer, or the layers ``layer_types`` marks ``sliding_attention``)."""

from __future__ import annotations

from kvpilot.model.decoder import CausalLM, FamilySpec


class MistralSpec(FamilySpec):
    """`FamilySpec` defaults: a window on every layer when ``sliding_window`` is set."""


class MistralForCausalLM(CausalLM):
    spec_cls = MistralSpec
