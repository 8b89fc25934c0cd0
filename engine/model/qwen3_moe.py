"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm, no biases)
with a mixture-of-experts block where ``mlp_only_layers`` / ``decoder_sparse_step`` put one (every
layer in the released models): ``num_experts`` experts of ``moe_intermediate_size``,
``num_experts_per_tok`` per token, renormalised when ``norm_topk_prob``; no shared expert."""

from __future__ import annotations

from kvpilot.model.decoder import CausalLM
from kvpilot.model.moe import MoeSpecMixin
from kvpilot.model.qwen3 import Qwen3Spec


class Qwen3MoeSpec(MoeSpecMixin, Qwen3Spec):
    pass


class Qwen3MoeForCausalLM(CausalLM):
    spec_cls = Qwen3MoeSpec
