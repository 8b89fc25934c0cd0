"""Mixtral: Mistral's attention (sliding window where ``sliding_window`` is set) with a
mixture-of-experts block in every layer: ``num_local_experts`` experts of ``intermediate_size``,
``num_experts_per_tok`` per token (softmax over the experts, top-k, renormalised to sum to 1).

Checkpoint names: ``block_sparse_moe.gate`` (the router) and ``block_sparse_moe.experts.N.w1`` /
``w3`` / ``w2`` (gate / up / down) are renamed to `kvpilot.model.moe.SparseMoeBlock`'s
``mlp.gate`` and ``mlp.experts.N.{gate,up,down}_proj`` and stacked there.
"""

from __future__ import annotations

from kvpilot.model.decoder import CausalLM
from kvpilot.model.mistral import MistralSpec
from kvpilot.model.moe import MoeSpecMixin

_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MixtralSpec(MoeSpecMixin, MistralSpec):
    renormalize = True

    def is_moe_layer(self, layer_idx: int) -> bool:
        return True

    def split_checkpoint_tensor(self, rest: str, tensor):
        if rest.startswith("block_sparse_moe."):
            parts = rest.split(".")
            if len(parts) == 5 and parts[1] == "experts" and parts[3] in _EXPERT_PROJ:
                parts[3] = _EXPERT_PROJ[parts[3]]
            rest = ".".join(["mlp"] + parts[1:])
        return [(rest, tensor)]


class MixtralForCausalLM(CausalLM):
    spec_cls = MixtralSpec
