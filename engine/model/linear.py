"""Tensor-parallel linear layers over a `QuantizationMethod` (Megatron-LM layout).

- `ColumnParallelLinear`: output features split across ranks; no communication.
- `MergedColumnParallelLinear`: several column-parallel projections stored as one matrix (gate/up),
  each split across ranks; a rank holds ``[part0 / tp | part1 / tp | ...]``.
- `QKVParallelLinear`: q, k and v as one matrix, split by heads; KV heads are replicated when the
  tensor-parallel size exceeds their count (`kv_heads_of`).
- `RowParallelLinear`: input features split; each rank's partial product is summed over the group
  by `ParallelContext.row_parallel` (fp32 or 16-bit reduction), the bias added exactly once.

Parameters are registered by the layer's quantization method (``weight`` ``[N, K]``, ``bias``
``[N]`` for the unquantized one), so checkpoint names stay ``<proj>.weight`` / ``<proj>.bias``.
``forward(x [T, K]) -> [T, N]`` in ``x.dtype``. `output_partitions` gives the per-rank row ranges of
the merged parts, which the loader (`kvpilot.model.weights`) fills.

LoRA seam: ``layer.lora`` (None unless `kvpilot.lora.layers.LoRASlots` attached one) is called as
``lora(x, out)`` after the base product and adds each token's adapter update to ``out``; in a
row-parallel layer, to the rank's partial product before the all-reduce.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kvpilot.model.layers import ParallelContext
from kvpilot.model.quantization import QuantizationMethod, UnquantizedLinearMethod


def kv_heads_of(num_kv_heads: int, rank: int, tp: int) -> tuple[int, int]:
    """First KV head and count held by rank ``rank`` of ``tp`` (replicated when tp > num_kv_heads)."""
    per_rank = max(1, num_kv_heads // tp)
    if tp <= num_kv_heads:
        return rank * per_rank, per_rank
    return rank // (tp // num_kv_heads), 1


class LinearBase(nn.Module):
    """A projection whose storage and product belong to ``quant_method`` (default bf16/fp32)."""

    #: ``lora(x, out) -> out``: the batched LoRA update added after the base product (module docstring)
    lora = None

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, pc: ParallelContext,
                 quant_method: Optional[QuantizationMethod] = None) -> None:
        super().__init__()
        self.pc = pc
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(output_sizes)
        self.bias_flag = bias
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size, self.output_sizes, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias)
        return out if self.lora is None else self.lora(x, out)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def set_quant_method(self, quant_method: QuantizationMethod) -> None:
        """Replace the layer's method and its parameters (before loading; e.g. a checkpoint module
        a quantization format leaves unquantized, `kvpilot.model.quantization.apply_module_exclusions`).
        The new parameters are on the old weight's device."""
        device = self.weight.device
        for name in list(self._parameters):
            delattr(self, name)
        for attr in ("quant_dtypes", "scale_block"):
            self.__dict__.pop(attr, None)
        self.quant_method = quant_method
        with torch.device(device):
            quant_method.create_weights(self, self.input_size, self.output_sizes, self.bias_flag)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_sizes}, quant={type(self.quant_method).__name__}"


def _split(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide {what} {n}")
    return n // tp


class ColumnParallelLinear(LinearBase):
    """``output_size`` split over ranks: this rank holds rows ``[r * N / tp, (r + 1) * N / tp)``."""

    def __init__(self, input_size: int, output_size: int, bias: bool, pc: ParallelContext,
                 quant_method: Optional[QuantizationMethod] = None, what: str = "output size") -> None:
        super().__init__(input_size, [_split(output_size, pc.tp_size, what)], bias, pc, quant_method)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel projections in one matrix (e.g. ``[gate | up]``), each split over ranks."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, pc: ParallelContext,
                 quant_method: Optional[QuantizationMethod] = None, what: str = "intermediate_size") -> None:
        super().__init__(input_size, [_split(n, pc.tp_size, what) for n in output_sizes], bias, pc, quant_method)


class QKVParallelLinear(LinearBase):
    """``[q | k | v]`` of this rank's heads: ``num_heads / tp`` query heads and `kv_heads_of` KV heads.

    Raises:
        ValueError: ``tp`` does not divide the query heads, or neither divides nor is a multiple of
            the KV heads.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 pc: ParallelContext, quant_method: Optional[QuantizationMethod] = None) -> None:
        tp = pc.tp_size
        if num_heads % tp:
            raise ValueError(f"tensor_parallel_size {tp} must divide num_attention_heads {num_heads}")
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(f"tensor_parallel_size {tp} must divide, or be a multiple of, "
                             f"num_key_value_heads {num_kv_heads}")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden_size, [q, kv, kv], bias, pc, quant_method)


class RowParallelLinear(LinearBase):
    """``input_size`` split over ranks; ``forward`` returns the all-reduced ``[T, output_size]``.

    ``reduce_fp32``: `ParallelContext.row_parallel`'s switch. ``fused`` (``forward``'s keyword): a
    fused matmul with `kvpilot.kernels.gemv.gemv`'s signature to use instead of the method's
    (the decode fast path; only when ``quant_method.supports_fused_gemv``).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, pc: ParallelContext,
                 quant_method: Optional[QuantizationMethod] = None, reduce_fp32: bool = False,
                 what: str = "input size") -> None:
        super().__init__(_split(input_size, pc.tp_size, what), [output_size], bias, pc, quant_method)
        self.reduce_fp32 = reduce_fp32
        self.ar_site = pc.new_site()

    def _matmul(self, x, weight, bias, out_dtype):
        return self.quant_method.apply(self, x, bias, out_dtype)

    def forward(self, x: torch.Tensor, fused=None) -> torch.Tensor:
        matmul = fused if fused is not None and self.quant_method.supports_fused_gemv else self._matmul
        lora = self.lora
        if lora is not None and lora.active:  # the rank's share of the update joins its partial product
            base = matmul

            def matmul(x, weight, bias, out_dtype):
                return lora(x, base(x, weight, bias, out_dtype))
        return self.pc.row_parallel(x, self.weight, self.bias, matmul, self.reduce_fp32, self.ar_site)
