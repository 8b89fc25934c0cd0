"""How a linear layer stores and applies its weight: the quantization-method seam.

Every projection of a model (`kvpilot.model.linear`) owns a `QuantizationMethod` object and calls it
at three points of its life:

1. ``create_weights(layer, input_size, output_sizes, bias, dtype)`` when the layer is built: register
   the parameters the method needs on ``layer`` (``weight`` ``[sum(output_sizes), input_size]``
   and optionally ``bias`` for bf16; an FP8 method adds e.g. ``weight_scale``). ``output_sizes``
   are this rank's output partitions (one entry per merged projection, e.g. ``[q, k, v]``), so a
   method that keeps per-partition scales knows the boundaries.
2. Loading (`kvpilot.model.weights.load_weights`): each checkpoint tensor ``<proj>.<suffix>`` goes to
   the layer's parameter of the same suffix, sliced like the weight's rows (column parallel) or
   columns (row parallel) where its shape says so; then ``process_weights_after_loading(layer)``
   runs once (repacking, transposes, scale folding).
3. ``apply(layer, x, bias, out_dtype)`` in the forward pass: ``x`` ``[T, input_size]`` ->
   ``[T, sum(output_sizes)]`` in ``x.dtype``, or float32 when ``out_dtype`` is ``torch.float32``
   (the row-parallel fp32 reduction of `ParallelContext.row_parallel`). ``bias`` is passed
   explicitly because row-parallel layers add it on one rank only.

``supports_fused_gemv`` says whether the decode fast paths (``kernels/gemv.py``'s fused RMSNorm +
GEMV kernels, which read ``layer.weight`` as a 16-bit ``[N, K]`` matrix) may bypass ``apply``; a
method storing anything else sets it False and the layers take their unfused path.

`UnquantizedLinearMethod` is the 16/32-bit method every model uses today. `get_quantization_method`
reads a checkpoint's ``quantization_config`` and refuses schemes the engine lacks.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from kvpilot.kernels import gemv as KG


class QuantizationMethod:
    """Interface of a linear layer's weight storage and product (module docstring)."""

    #: the fused decode GEMV kernels may read ``layer.weight`` / ``layer.bias`` directly
    supports_fused_gemv: bool = False

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], bias: bool,
                       dtype: Optional[torch.dtype] = None) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None,
              out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after every checkpoint tensor of ``layer`` is in place (default: nothing)."""


class UnquantizedLinearMethod(QuantizationMethod):
    """Weights in the model dtype: ``weight`` ``[N, K]``, optional ``bias`` ``[N]``; ``apply`` is
    ``x @ weight.T (+ bias)`` (`kvpilot.kernels.gemv.gemv_ref`, i.e. ``F.linear``; ``torch.mm`` into
    float32 when ``out_dtype`` is float32)."""

    supports_fused_gemv = True

    def create_weights(self, layer, input_size, output_sizes, bias, dtype=None):
        n = sum(output_sizes)
        layer.weight = nn.Parameter(torch.empty(n, input_size, dtype=dtype), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(n, dtype=dtype), requires_grad=False) if bias else None

    def apply(self, layer, x, bias=None, out_dtype=None):
        return KG.gemv_ref(x, layer.weight, bias, out_dtype)


class UnsupportedQuantizationError(ValueError):
    """A checkpoint's ``quantization_config`` names a scheme the engine does not implement."""


def get_quantization_method(hf_config: dict[str, Any]) -> QuantizationMethod:
    """The method for a checkpoint's ``config.json`` (``quantization_config.quant_method``).

    Returns `UnquantizedLinearMethod` when the config has no ``quantization_config``.

    Raises:
        UnsupportedQuantizationError: any quantized checkpoint (no scheme is implemented yet).
    """
    qc = hf_config.get("quantization_config")
    if not qc:
        return UnquantizedLinearMethod()
    method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
    raise UnsupportedQuantizationError(
        f"quantized checkpoints ({method!r}) are not supported yet; kvpilot loads unquantized "
        f"float32/float16/bfloat16 weights")
