"""The MLP slot of a decoder layer.

A decoder layer holds ``mlp`` built by its family's ``mlp_factory(cfg, layer_idx, pc, reduce_fp32,
quant_method)``; any module with ``forward(hidden [T, H]) -> [T, H]`` (all-reduced over the
tensor-parallel group) fits, so a mixture-of-experts block replaces `GatedMLP` per layer without
touching the decoder layer. The decode fast path (`kvpilot.model.decoder.DecoderLayer`) fuses
``gate_up_proj`` and ``down`` only for a `GatedMLP` with SiLU.

`GatedMLP`: ``down(act(gate) * up)`` with ``[gate | up]`` one column-parallel matrix and
``down_proj`` row parallel. Activations: ``silu`` (SwiGLU: Llama, Mistral, Qwen, Phi) and
``gelu_tanh`` (GeGLU with the tanh approximation: Gemma's ``gelu_pytorch_tanh``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kvpilot import kernels as K
from kvpilot.kernels import gemv as KG
from kvpilot.model.layers import ParallelContext
from kvpilot.model.linear import MergedColumnParallelLinear, RowParallelLinear
from kvpilot.model.quantization import QuantizationMethod

ACTIVATIONS = {"silu": "silu", "silu_and_mul": "silu", "swish": "silu",
               "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def activation_of(name: str) -> str:
    """The `GatedMLP` activation for a config's ``hidden_act`` / ``hidden_activation``.

    Raises:
        ValueError: an activation the engine does not implement.
    """
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported MLP activation {name!r}; supported: {', '.join(sorted(ACTIVATIONS))}") \
            from None


class GatedMLP(nn.Module):
    """``gate_up_proj`` (merged column parallel), ``act(gate) * up``, ``down_proj`` (row parallel)."""

    def __init__(self, hidden_size: int, intermediate_size: int, pc: ParallelContext, bias: bool = False,
                 activation: str = "silu", reduce_fp32: bool = False,
                 quant_method: Optional[QuantizationMethod] = None) -> None:
        super().__init__()
        self.activation = activation_of(activation)
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, pc, quant_method)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, pc, quant_method, reduce_fp32,
                                           what="intermediate_size")
        self.pc = pc

    @property
    def reduce_fp32(self) -> bool:
        return self.down_proj.reduce_fp32

    @reduce_fp32.setter
    def reduce_fp32(self, value: bool) -> None:
        self.down_proj.reduce_fp32 = value

    @property
    def fusable(self) -> bool:
        """Whether the decode fast path may fuse this MLP (SiLU, weights the GEMV kernels read)."""
        return (self.activation == "silu" and self.gate_up_proj.quant_method.supports_fused_gemv
                and self.down_proj.quant_method.supports_fused_gemv)

    def forward(self, x):
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: torch.Tensor, fused_gemv: bool = False) -> torch.Tensor:
        """Activation-and-mul, ``down_proj`` and the all-reduce: ``gate_up`` ``[T, 2 * inter]`` ->
        ``[T, hidden]``. ``fused_gemv`` (SiLU only) runs the pair through
        `kvpilot.kernels.gemv.silu_mul_gemv`."""
        if fused_gemv and self.activation == "silu":
            return self.down_proj(gate_up, fused=KG.silu_mul_gemv)
        act = K.silu_and_mul(gate_up) if self.activation == "silu" else K.gelu_tanh_and_mul(gate_up)
        return self.down_proj(act)
