"""The mixture-of-experts block that fills a decoder layer's ``mlp`` slot (Mixtral, Qwen2-MoE, Qwen3-MoE).

`SparseMoeBlock.forward(hidden [T, H]) -> [T, H]`: the router (``gate``, ``[E, H]``, replicated on
every tensor-parallel rank) scores the experts, `kvpilot.kernels.moe.select_experts` keeps each
token's ``top_k`` (softmax then top-k, renormalised where the family says so), and
`kvpilot.kernels.moe.fused_moe` runs the chosen experts: the Triton kernels on CUDA with backend
``"TRITON"``, the PyTorch reference on CPU or with ``"TORCH"`` (`kvpilot.config.MoeConfig`).
Qwen2-MoE adds a shared expert every token goes through (a `GatedMLP`), scaled by
``sigmoid(shared_expert_gate(x))``.

Weights: each projection of all experts is one tensor, stacked at load from the checkpoint's
per-expert tensors: ``w13`` ``[E, 2 * I / tp, H]`` (gate rows then up rows per expert) and ``w2``
``[E, H, I / tp]``. `load_checkpoint_tensor` takes the names under ``mlp.`` as Qwen's checkpoints
spell them (``gate.weight``, ``experts.N.{gate,up,down}_proj.weight``, ``shared_expert.*``,
``shared_expert_gate.weight``); Mixtral's spec renames its ``block_sparse_moe.experts.N.w1/w3/w2``
to those first (`kvpilot.model.mixtral`).

Tensor parallelism: every expert's intermediate dimension is split like a `GatedMLP`'s (rank ``r``
holds gate/up rows and down columns ``[r * I / tp, (r + 1) * I / tp)``), each rank computes its
partial sum over its slice for every token, and one all-reduce adds them. Expert parallelism
(experts partitioned over ranks) is not implemented: `kvpilot.config.MoeConfig` and the `LLM`
refuse ``moe_expert_parallel_size > 1``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.kernels.moe import check_backend, fused_moe, select_experts
from kvpilot.model.layers import ParallelContext
from kvpilot.model.linear import _split
from kvpilot.model.mlp import GatedMLP, activation_of
from kvpilot.model.quantization import QuantizationMethod, UnquantizedLinearMethod

_PROJ = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}


class SparseMoeBlock(nn.Module):
    """Router + stacked experts (+ Qwen2-MoE's gated shared expert); module docstring.

    Args:
        hidden_size, intermediate_size: ``H`` and each expert's ``I`` (whole, before the TP split).
        num_experts, top_k: ``E`` and the experts per token.
        renormalize: divide the kept routing weights by their sum.
        shared_intermediate_size: the shared expert's intermediate size (0: none).
        backend: `kvpilot.kernels.moe.MOE_BACKENDS`.

    Raises:
        ValueError: ``tensor_parallel_size`` does not divide ``intermediate_size``; ``top_k``
            outside ``[1, E]``; an activation other than SiLU; a quantized checkpoint (MoE weights
            are 16/32-bit only); an unknown backend.
    """

    fusable = False  # the decode fast path's fused GEMVs are for `GatedMLP`

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool,
                 pc: ParallelContext, activation: str = "silu", shared_intermediate_size: int = 0,
                 reduce_fp32: bool = False, quant_method: Optional[QuantizationMethod] = None,
                 backend: str = "TRITON") -> None:
        super().__init__()
        if activation_of(activation) != "silu":
            raise ValueError(f"MoE experts support the SiLU activation only, got {activation!r}")
        if quant_method is not None and not isinstance(quant_method, UnquantizedLinearMethod):
            raise ValueError("quantized mixture-of-experts checkpoints are not supported; the experts load "
                             "16/32-bit weights only")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}")
        self.backend = check_backend(backend)
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size = hidden_size
        self.inter = _split(intermediate_size, pc.tp_size, "moe_intermediate_size")
        self.pc = pc
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter), requires_grad=False)
        self.shared_expert = None
        self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, pc, False, activation, reduce_fp32,
                                          quant_method)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.ar_site = pc.new_site()
        self._loaded: set[tuple[int, int]] = set()  # (expert, projection) pairs loaded

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights [T, K] float32, topk_ids [T, K] int64)`` for ``hidden`` ``[T, H]``."""
        return select_experts(F.linear(hidden, self.gate.weight), self.top_k, self.renormalize)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(hidden)
        out = fused_moe(hidden, self.w13, self.w2, weights, ids, self.backend)
        out = self.pc.all_reduce(out, self.ar_site)
        if self.shared_expert is not None:
            gate = torch.sigmoid(F.linear(hidden, self.shared_expert_gate.weight))
            out = out + gate * self.shared_expert(hidden)
        return out

    # -- loading ------------------------------------------------------------------------------------
    def load_checkpoint_tensor(self, name: str, tensor, put: Callable) -> bool:
        """Load one checkpoint tensor named ``name`` (relative to the block, e.g.
        ``experts.3.up_proj.weight``) through ``put(param_name, value, index=None)``, which copies
        ``value`` into ``param[index]``; returns False for a name the block does not own.

        ``tensor``: a safetensors slice (or a tensor); this rank reads its rows (gate/up) or
        columns (down) only.
        """
        r, inter = self.pc.tp_rank, self.inter
        lo, hi = r * inter, (r + 1) * inter
        parts = name.split(".")
        if name == "gate.weight":
            put("gate.weight", tensor[:])
        elif name == "shared_expert_gate.weight" and self.shared_expert_gate is not None:
            put("shared_expert_gate.weight", tensor[:])
        elif len(parts) == 4 and parts[0] == "experts" and parts[2] in _PROJ and parts[3] == "weight":
            e, proj = int(parts[1]), _PROJ[parts[2]]
            if not 0 <= e < self.num_experts:
                raise ValueError(f"checkpoint tensor mlp.{name}: expert {e} outside num_experts={self.num_experts}")
            if proj == 2:
                put("w2", tensor[:, lo:hi], e)
            else:
                put("w13", tensor[lo:hi], (e, slice(proj * inter, (proj + 1) * inter)))
            self._loaded.add((e, proj))
        elif len(parts) == 3 and parts[0] == "shared_expert" and self.shared_expert is not None and parts[2] == "weight":
            shared = self.shared_expert.down_proj.input_size
            s_lo, s_hi = r * shared, (r + 1) * shared
            if parts[1] == "down_proj":
                put("shared_expert.down_proj.weight", tensor[:, s_lo:s_hi])
            elif parts[1] in ("gate_proj", "up_proj"):
                off = 0 if parts[1] == "gate_proj" else shared
                put("shared_expert.gate_up_proj.weight", tensor[s_lo:s_hi], slice(off, off + shared))
            else:
                return False
        else:
            return False
        return True

    def process_weights_after_loading(self) -> None:
        """Check that every expert's three projections were in the checkpoint.

        Raises:
            KeyError: some were not; the message names the first missing ones.
        """
        missing = [f"experts.{e}.{p}" for e in range(self.num_experts) for p, i in _PROJ.items()
                   if (e, i) not in self._loaded]
        if missing:
            raise KeyError(f"the checkpoint lacks MoE expert tensors {missing[:6]}{' ...' if len(missing) > 6 else ''}")

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, inter/rank={self.inter}, "
                f"renormalize={self.renormalize}, backend={self.backend}")


class MoeSpecMixin:
    """`kvpilot.model.decoder.FamilySpec` methods of an MoE family: which layers hold experts and
    how the config names their sizes. Set ``renormalize`` (True, False or None: the config's
    ``norm_topk_prob``) and ``shared_expert``."""

    renormalize: Optional[bool] = None
    shared_expert: bool = False

    def num_experts(self) -> int:
        raw = self.raw
        return int(raw.get("num_local_experts") or raw.get("num_experts") or 0)

    def expert_intermediate_size(self) -> int:
        return int(self.raw.get("moe_intermediate_size") or self.cfg.intermediate_size)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Qwen's rule: not in ``mlp_only_layers`` and every ``decoder_sparse_step``-th layer."""
        raw = self.raw
        step = int(raw.get("decoder_sparse_step") or 1)
        return (self.num_experts() > 0 and layer_idx not in (raw.get("mlp_only_layers") or [])
                and (layer_idx + 1) % step == 0)

    def build_mlp(self, layer_idx, pc, reduce_fp32, quant_method):
        if not self.is_moe_layer(layer_idx):
            return super().build_mlp(layer_idx, pc, reduce_fp32, quant_method)
        renorm = self.renormalize if self.renormalize is not None else bool(self.raw.get("norm_topk_prob", False))
        shared = int(self.raw.get("shared_expert_intermediate_size") or 0) if self.shared_expert else 0
        return SparseMoeBlock(self.cfg.hidden_size, self.expert_intermediate_size(), self.num_experts(),
                              int(self.raw.get("num_experts_per_tok") or 2), renorm, pc, self.activation(), shared,
                              reduce_fp32, quant_method, getattr(self.cfg, "moe_backend", "TRITON"))
