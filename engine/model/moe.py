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
``shared_expert_gate.weight``; also transformers 5's stacked ``experts.gate_up_proj`` ``[E, 2I, H]``
and ``experts.down_proj`` ``[E, H, I]``); Mixtral's spec renames its ``block_sparse_moe.experts.N.w1/w3/w2``
to those first (`kvpilot.model.mixtral`).

Parallelism (TensorRT-LLM's layout: ``tensor_parallel_size = moe_tensor_parallel_size *
moe_expert_parallel_size``, ``ep`` and ``mtp`` below): the attention is tensor parallel over all
``tp`` ranks, whose hidden states are therefore the same on every rank when the MoE block runs.
Rank ``r`` holds the experts ``[q * E / ep, (q + 1) * E / ep)`` of its expert-parallel rank
``q = r % ep``, each expert's intermediate dimension split ``mtp`` ways by its expert-tensor rank
``s = r // ep`` (gate/up rows and down columns ``[s * I / mtp, (s + 1) * I / mtp)``, like a
`GatedMLP`'s). Every rank computes, for every token, the choices that fall on its experts (the
others contribute zero), and one all-reduce over the tensor-parallel group sums the partial outputs:
the same single collective as a dense MLP's, no token exchange (the tokens are already everywhere).
The shared expert is split over all ``tp`` ranks as a `GatedMLP`.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.kernels.moe import check_backend, fused_moe, select_experts
from kvpilot.model.layers import ParallelContext
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
        expert_parallel_size: ``ep`` (module docstring).

    Raises:
        ValueError: a layout that does not split (`check_moe_split`); ``top_k``
            outside ``[1, E]``; an activation other than SiLU; a quantized checkpoint (MoE weights
            are 16/32-bit only); an unknown backend.
    """

    fusable = False  # the decode fast path's fused GEMVs are for `GatedMLP`

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool,
                 pc: ParallelContext, activation: str = "silu", shared_intermediate_size: int = 0,
                 reduce_fp32: bool = False, quant_method: Optional[QuantizationMethod] = None,
                 backend: str = "TRITON", expert_parallel_size: int = 1) -> None:
        super().__init__()
        if activation_of(activation) != "silu":
            raise ValueError(f"MoE experts support the SiLU activation only, got {activation!r}")
        if quant_method is not None and not isinstance(quant_method, UnquantizedLinearMethod):
            raise ValueError("quantized mixture-of-experts models (a quantized checkpoint, or on-the-fly FP8) are "
                             "not supported; the experts load 16/32-bit weights only")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}")
        self.backend = check_backend(backend)
        check_moe_split(num_experts, intermediate_size, pc.tp_size, expert_parallel_size)
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size = hidden_size
        ep = expert_parallel_size
        self.ep_size, self.ep_rank, self.moe_tp_rank = ep, pc.tp_rank % ep, pc.tp_rank // ep
        self.local_experts = num_experts // ep
        self.first_expert = self.ep_rank * self.local_experts
        self.inter = intermediate_size // (pc.tp_size // ep)
        self.pc = pc
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(self.local_experts, 2 * self.inter, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.local_experts, hidden_size, self.inter), requires_grad=False)
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
        if self.ep_size > 1:  # this rank's experts only; -1: a choice served by another rank
            ids = ids - self.first_expert
            ids = torch.where((ids >= 0) & (ids < self.local_experts), ids, -1)
        out = fused_moe(hidden, self.w13, self.w2, weights, ids, self.backend, partial=self.ep_size > 1)
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
        inter = self.inter
        lo, hi = self.moe_tp_rank * inter, (self.moe_tp_rank + 1) * inter
        parts = name.split(".")
        if name == "gate.weight":
            put("gate.weight", tensor[:])
        elif name == "shared_expert_gate.weight" and self.shared_expert_gate is not None:
            put("shared_expert_gate.weight", tensor[:])
        elif len(parts) == 4 and parts[0] == "experts" and parts[2] in _PROJ and parts[3] == "weight":
            e, proj = int(parts[1]), _PROJ[parts[2]]
            if not 0 <= e < self.num_experts:
                raise ValueError(f"checkpoint tensor mlp.{name}: expert {e} outside num_experts={self.num_experts}")
            e -= self.first_expert
            if not 0 <= e < self.local_experts:
                return True  # another expert-parallel rank's expert
            if proj == 2:
                put("w2", tensor[:, lo:hi], e)
            else:
                put("w13", tensor[lo:hi], (e, slice(proj * inter, (proj + 1) * inter)))
            self._loaded.add((e, proj))
        elif name in ("experts.gate_up_proj", "experts.down_proj"):  # transformers 5's stacked layout
            if tuple(tensor.get_shape() if hasattr(tensor, "get_shape") else tensor.shape)[0] != self.num_experts:
                raise ValueError(f"checkpoint tensor mlp.{name}: first dimension is not num_experts={self.num_experts}")
            first, last = self.first_expert, self.first_expert + self.local_experts
            if name == "experts.down_proj":
                put("w2", tensor[first:last, :, lo:hi])
            else:
                full = self.inter * (self.pc.tp_size // self.ep_size)
                put("w13", tensor[first:last, lo:hi], (slice(None), slice(0, inter)))
                put("w13", tensor[first:last, full + lo:full + hi], (slice(None), slice(inter, 2 * inter)))
            proj = (2,) if name == "experts.down_proj" else (0, 1)
            self._loaded.update((e, p) for e in range(self.local_experts) for p in proj)
        elif len(parts) == 3 and parts[0] == "shared_expert" and self.shared_expert is not None and parts[2] == "weight":
            r = self.pc.tp_rank
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
        """Check that every expert of this rank had its three projections in the checkpoint.

        Raises:
            KeyError: some were not; the message names the first missing ones.
        """
        missing = [f"experts.{e + self.first_expert}.{p}" for e in range(self.local_experts) for p, i in _PROJ.items()
                   if (e, i) not in self._loaded]
        if missing:
            raise KeyError(f"the checkpoint lacks MoE expert tensors {missing[:6]}{' ...' if len(missing) > 6 else ''}")

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, local=[{self.first_expert}, {self.first_expert + self.local_experts}), "
                f"top_k={self.top_k}, inter/rank={self.inter}, "
                f"renormalize={self.renormalize}, backend={self.backend}")


def check_moe_split(num_experts: int, intermediate_size: int, tp: int, ep: int) -> None:
    """Check that ``tp`` ranks with ``moe_expert_parallel_size`` ``ep`` split the experts.

    Raises:
        ValueError: ``ep`` does not divide ``tp`` or ``num_experts``, or ``moe_tensor_parallel_size``
            ``tp / ep`` does not divide the experts' intermediate size; the message names the constraint.
    """
    if ep < 1 or tp % ep:
        raise ValueError(f"moe_expert_parallel_size {ep} must divide tensor_parallel_size {tp} "
                         f"(tensor_parallel_size = moe_tensor_parallel_size x moe_expert_parallel_size)")
    if num_experts % ep:
        raise ValueError(f"moe_expert_parallel_size {ep} must divide num_experts {num_experts}")
    if intermediate_size % (tp // ep):
        raise ValueError(f"moe_tensor_parallel_size {tp // ep} (tensor_parallel_size {tp} / moe_expert_parallel_size "
                         f"{ep}) must divide the experts' intermediate size {intermediate_size}")


def check_moe_layout(cfg, tp: int) -> None:
    """`check_moe_split` for a model config (``cfg.moe_expert_parallel_size``); nothing for a
    dense model. Called before any worker starts (`kvpilot.parallel.executor.validate_layout`).

    Raises:
        ValueError: as `check_moe_split`; ``moe_expert_parallel_size > 1`` for a dense model.
    """
    from kvpilot.model.registry import model_class

    ep = getattr(cfg, "moe_expert_parallel_size", 1)
    spec_cls = getattr(model_class(cfg.architecture), "spec_cls", None)
    if spec_cls is None or not issubclass(spec_cls, MoeSpecMixin):
        if ep > 1:
            raise ValueError(f"moe_expert_parallel_size={ep} needs a mixture-of-experts model; "
                             f"{cfg.architecture} is dense")
        return
    spec = spec_cls(cfg)
    check_moe_split(spec.num_experts(), spec.expert_intermediate_size(), tp, ep)


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
                              reduce_fp32, quant_method, getattr(self.cfg, "moe_backend", "TRITON"),
                              getattr(self.cfg, "moe_expert_parallel_size", 1))
