"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) with a
mixture-of-experts block where ``mlp_only_layers`` / ``decoder_sparse_step`` put one
(`kvpilot.model.moe.MoeSpecMixin.is_moe_layer`; the other layers keep a dense MLP of
``intermediate_size``): ``num_experts`` experts of ``moe_intermediate_size``, ``num_experts_per_tok``
per token, renormalised when ``norm_topk_prob``, plus a shared expert of
``shared_expert_intermediate_size`` that every token goes through, scaled by
``sigmoid(shared_expert_gate(x))``."""

from __future__ import annotations

from kvpilot.model.decoder import CausalLM
from kvpilot.model.moe import MoeSpecMixin
from kvpilot.model.qwen2 import Qwen2Spec


class Qwen2MoeSpec(MoeSpecMixin, Qwen2Spec):
    shared_expert = True

    @property
    def qkv_bias(self) -> bool:
        return bool(self.raw.get("qkv_bias", True))


class Qwen2MoeForCausalLM(CausalLM):
    spec_cls = Qwen2MoeSpec
