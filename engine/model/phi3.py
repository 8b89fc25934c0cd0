"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): Llama's layers with fused checkpoint tensors (``qkv_proj``:
``[q | k | v]`` rows, ``gate_up_proj``: ``[gate | up]`` rows), split on load into the names the
tensor-parallel loader shards; partial rotary (``partial_rotary_factor``, Phi-4-mini) and LongRoPE
(``longrope`` rope parameters) through `kvpilot.model.rotary`; a sliding window on every layer
where ``sliding_window`` is set."""

from __future__ import annotations

from kvpilot.model.decoder import CausalLM, FamilySpec


class Phi3Spec(FamilySpec):
    def split_checkpoint_tensor(self, rest: str, tensor):
        cfg = self.cfg
        kind = rest.rsplit(".", 1)[-1]
        if rest.startswith("self_attn.qkv_proj."):
            full = tensor[:]
            q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            return [(f"self_attn.q_proj.{kind}", full[:q]), (f"self_attn.k_proj.{kind}", full[q:q + kv]),
                    (f"self_attn.v_proj.{kind}", full[q + kv:q + 2 * kv])]
        if rest.startswith("mlp.gate_up_proj."):
            full = tensor[:]
            n = cfg.intermediate_size
            return [(f"mlp.gate_proj.{kind}", full[:n]), (f"mlp.up_proj.{kind}", full[n:2 * n])]
        return [(rest, tensor)]


class Phi3ForCausalLM(CausalLM):
    spec_cls = Phi3Spec
