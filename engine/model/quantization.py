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

`UnquantizedLinearMethod` is the 16/32-bit method; `Fp8LinearMethod` stores FP8 E4M3 weights with
float32 scales (`Fp8Scheme`: per-tensor, per-channel or block weight scales; no, static or dynamic
activation scales). `get_quantization_method` reads a checkpoint's ``quantization_config``
(ModelOpt, compressed-tensors, block-wise ``fp8``) or an on-the-fly request and refuses schemes the
engine lacks (`UnsupportedQuantizationError`, naming `SUPPORTED_SCHEMES`). Checkpoint modules a
format leaves unquantized (ModelOpt ``exclude_modules``, compressed-tensors ``ignore``) get the
unquantized method (`apply_module_exclusions`). docs/quantization.md has the formats' layouts.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from kvpilot.kernels import fp8_gemv
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
    """A checkpoint's ``quantization_config`` (or a requested on-the-fly scheme) names a scheme the
    engine does not implement; the message names what was asked for and `SUPPORTED_SCHEMES`."""


#: what `get_quantization_method` accepts, for error messages and docs/quantization.md
SUPPORTED_SCHEMES = (
    "ModelOpt quant_algo FP8 (per-tensor weights, static per-tensor activations), "
    "FP8_PER_CHANNEL_PER_TOKEN and FP8_PB_WO (128x128 block weights, weight-only); "
    "compressed-tensors format float-quantized / naive-quantized with 8-bit float weights "
    "(tensor, channel or block strategy) and no, static per-tensor, dynamic per-tensor, dynamic "
    "per-token or dynamic group activations; quant_method 'fp8' (weight_block_size + "
    "weight_scale_inv, or per-tensor weight_scale); on the fly: QuantConfig(quant_algo='FP8') / "
    "--quantization fp8 on a 16/32-bit checkpoint")

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_SCALE_EPS = 1e-12

#: activation modes of `Fp8Scheme`
ACTIVATION_MODES = (None, "static", "dynamic_tensor", "token", "group")


@dataclass(frozen=True)
class Fp8Scheme:
    """How an FP8 (E4M3) linear layer's weights and inputs are scaled.

    Attributes:
        weights: "tensor" (one float32 scale per checkpoint tensor), "channel" (one per output row)
            or "block" (one per ``block`` ``[block_n, block_k]`` tile of the weight).
        activations: None (weight-only: inputs stay in the model dtype), "static" (per-tensor
            ``input_scale`` from the checkpoint), "dynamic_tensor" (``amax(|x|) / 448`` per call),
            "token" (``amax(|x[t]|) / 448`` per token row) or "group" (per token and ``group_size``
            input columns; block checkpoints).
        block: ``(block_n, block_k)`` for block weights.
        group_size: columns per activation group ("group").
        scale_name: the checkpoint's name for the weight scale (``weight_scale``, or
            ``weight_scale_inv`` in block-wise ``quant_method: "fp8"`` checkpoints).
        from_float: the checkpoint holds 16/32-bit weights, quantized at load (per output row).
    """

    weights: str
    activations: Optional[str] = None
    block: Optional[tuple[int, int]] = None
    group_size: Optional[int] = None
    scale_name: str = "weight_scale"
    from_float: bool = False

    def __post_init__(self) -> None:
        if self.weights not in ("tensor", "channel", "block"):
            raise UnsupportedQuantizationError(f"FP8 weight strategy {self.weights!r}; supported: tensor, channel, block")
        if self.activations not in ACTIVATION_MODES:
            raise UnsupportedQuantizationError(f"FP8 activation mode {self.activations!r}; supported: "
                                               f"{', '.join(str(a) for a in ACTIVATION_MODES)}")
        if (self.weights == "block") != (self.block is not None):
            raise UnsupportedQuantizationError("FP8 block weights need a block shape [block_n, block_k]")

    def describe(self) -> str:
        w = f"block {self.block[0]}x{self.block[1]}" if self.block else f"per-{self.weights}"
        a = {None: "weight-only", "static": "static per-tensor activations",
             "dynamic_tensor": "dynamic per-tensor activations", "token": "dynamic per-token activations",
             "group": "dynamic per-group activations"}[self.activations]
        return f"FP8 E4M3 {w} weights, {a}" + (" (quantized at load)" if self.from_float else "")


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``clamp(x / scale, -448, 448)`` rounded to FP8 E4M3 (the producers' formula; ``scale``
    float32, broadcast against ``x``)."""
    return (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def activation_scale(x: torch.Tensor, mode: str, input_scale: Optional[torch.Tensor] = None,
                     group_size: Optional[int] = None) -> torch.Tensor:
    """The float32 scale(s) ``x`` ``[M, K]`` is divided by before rounding to FP8: ``[]`` (static,
    dynamic_tensor), ``[M, 1]`` (token) or ``[M, K / group_size]`` (group). Dynamic scales are
    ``amax(|x|) / 448`` over the tensor, each row, or each row's group (at least 1e-12)."""
    if mode == "static":
        return input_scale.to(torch.float32).reshape(())
    xf = x.to(torch.float32).abs()
    if mode == "dynamic_tensor":
        return (xf.amax() / FP8_MAX).clamp(min=_SCALE_EPS)
    if mode == "token":
        return (xf.amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_SCALE_EPS)
    m, k = xf.shape
    g = group_size
    pad = (-k) % g
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    return (xf.reshape(m, -1, g).amax(dim=-1) / FP8_MAX).clamp(min=_SCALE_EPS)


def fake_quantize_activation(x: torch.Tensor, mode: Optional[str], input_scale: Optional[torch.Tensor] = None,
                             group_size: Optional[int] = None) -> torch.Tensor:
    """``x`` rounded through FP8 with `activation_scale` and scaled back, in float32 (the
    reference of what the FP8 GEMM sees); ``x`` as float32 when ``mode`` is None."""
    if mode is None:
        return x.to(torch.float32)
    s = activation_scale(x, mode, input_scale, group_size)
    if mode == "group":
        s = s.repeat_interleave(group_size, dim=1)[:, : x.shape[1]]
    return quantize_fp8(x, s).to(torch.float32) * s


class Fp8LinearMethod(QuantizationMethod):
    """FP8 E4M3 weights (`Fp8Scheme`), read from a quantized checkpoint or quantized at load.

    Parameters (created by `create_weights`, filled by the loader, then folded by
    `process_weights_after_loading`):

    - ``weight`` ``[N, K]`` float8_e4m3fn (16/32-bit until quantized for ``from_float``);
    - the weight scale (``scheme.scale_name``), float32: ``[N]`` per output row (a per-tensor
      checkpoint scale is repeated over its tensor's rows, so merged q/k/v or gate/up keep each
      part's scale exactly), or for block weights ``[ceil(N / block_n), ceil(K / block_k)]`` (kept
      as ``[N, ceil(K / block_k)]`` with block rows 1 when a merged part boundary is not on a
      block boundary);
    - ``input_scale`` (static activations) float32 ``[]``: the largest of the merged parts' scales;
    - ``bias`` ``[N]`` in the model dtype.

    ``apply(x [T, K])``:

    - CPU (and any device without a faster path): the reference, exact dequantization math:
      inputs rounded through FP8 as the scheme says (`fake_quantize_activation`; block checkpoints
      keep them unrounded), weights dequantized to float32 (`kvpilot.kernels.fp8_gemv.dequantize_fp8`),
      one float32 product;
    - CUDA, ``T <= FP8_GEMV_MAX_ROWS`` (1; ``FP8_GEMV_MAX_ROWS_ANY`` = 8 for layers without the
      next path): `kvpilot.kernels.fp8_gemv.fp8_gemv` (Triton; FP8 weights read once, activations
      not rounded);
    - CUDA, larger ``T``, per-row scales with activations: inputs quantized (static or per-token
      scales in one launch, `kvpilot.kernels.fp8_gemv.quantize_rows`; per-tensor dynamic in torch),
      ``torch._scaled_mm`` (row-wise scaling on Hopper) with the activation and weight scales in its
      epilogue, bf16 out;
    - CUDA otherwise (weight-only, block weights): weights dequantized to the model dtype, ``F.linear``.

    ``ignore``: checkpoint module names left unquantized (`is_ignored`, ``match`` style "fnmatch"
    for ModelOpt's ``exclude_modules``, "compressed-tensors" for exact names or ``re:`` regular
    expressions, "substring" for ``modules_to_not_convert``). ``kv_cache_fp8``: the checkpoint
    declares an FP8 KV cache. ``source``: the format's name, for messages.
    """

    supports_fused_gemv = False

    def __init__(self, scheme: Fp8Scheme, ignore: Sequence[str] = (), match: str = "fnmatch",
                 source: str = "fp8", kv_cache_fp8: bool = False) -> None:
        self.scheme = scheme
        self.ignore = tuple(ignore or ())
        self.match = match
        self.source = source
        self.kv_cache_fp8 = kv_cache_fp8

    def __repr__(self) -> str:
        return f"Fp8LinearMethod({self.source}: {self.scheme.describe()}, ignore={list(self.ignore)})"

    # -- module exclusions ------------------------------------------------------------------------
    def is_ignored(self, name: str) -> bool:
        """Whether checkpoint module ``name`` (e.g. ``model.layers.0.mlp.down_proj``) stays unquantized."""
        for pat in self.ignore:
            if self.match == "compressed-tensors":
                if pat.startswith("re:") and re.match(pat[3:], name) or pat == name:
                    return True
            elif self.match == "substring":
                if pat in name:
                    return True
            elif fnmatch.fnmatchcase(name, pat) or name == pat:
                return True
        return False

    # -- the seam ---------------------------------------------------------------------------------
    def create_weights(self, layer, input_size, output_sizes, bias, dtype=None):
        n, sch = sum(output_sizes), self.scheme
        layer.output_partitions_fp8 = list(output_sizes)
        if sch.from_float:
            layer.weight = nn.Parameter(torch.empty(n, input_size, dtype=dtype), requires_grad=False)
            layer.quant_dtypes = {}
        else:
            layer.weight = nn.Parameter(torch.empty(n, input_size, dtype=FP8_DTYPE), requires_grad=False)
            cols = -(-input_size // sch.block[1]) if sch.block else None
            shape = (n, cols) if cols else (n,)
            setattr(layer, sch.scale_name, nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False))
            layer.quant_dtypes = {"weight": FP8_DTYPE, sch.scale_name: torch.float32}
            if sch.activations == "static":
                layer.input_scale = nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)
                layer.quant_dtypes["input_scale"] = torch.float32
        layer.bias = nn.Parameter(torch.empty(n, dtype=dtype), requires_grad=False) if bias else None
        layer.scale_block = None

    def process_weights_after_loading(self, layer):
        sch = self.scheme
        if sch.from_float:
            w = layer.weight.data.to(torch.float32)
            scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=_SCALE_EPS)
            q = quantize_fp8(w, scale[:, None])
            del w
            layer.weight = nn.Parameter(q, requires_grad=False)
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
            return
        if sch.activations == "static":
            layer.input_scale = nn.Parameter(layer.input_scale.data.amax().to(torch.float32), requires_grad=False)
        if sch.block:
            bn, bk = sch.block
            s = getattr(layer, sch.scale_name).data
            offsets = [0]
            for p in layer.output_partitions_fp8:
                offsets.append(offsets[-1] + p)
            if all(o % bn == 0 for o in offsets[:-1]):  # block rows line up: one scale row per block
                setattr(layer, sch.scale_name, nn.Parameter(s[::bn].contiguous(), requires_grad=False))
                layer.scale_block = (bn, bk)
            else:  # a merged part starts inside a block: keep one scale row per weight row
                layer.scale_block = (1, bk)

    def weight_scale_of(self, layer) -> torch.Tensor:
        """The layer's folded weight scale (`process_weights_after_loading`'s layout)."""
        return layer.weight_scale if self.scheme.from_float else getattr(layer, self.scheme.scale_name)

    def dequantized_weight(self, layer, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[N, K]`` weight times its scales, in ``dtype``."""
        return fp8_gemv.dequantize_fp8(layer.weight, self.weight_scale_of(layer), layer.scale_block).to(dtype)

    #: run the reference (`apply`'s CPU path) on CUDA too (benchmarks/gpu_fp8.py's accuracy check)
    reference = False

    def apply(self, layer, x, bias=None, out_dtype=None):
        sch, scale = self.scheme, self.weight_scale_of(layer)
        out = out_dtype or x.dtype
        if x.is_cuda and not self.reference:
            n, k = layer.weight.shape
            scaled_mm = sch.activations is not None and layer.scale_block is None and n % 16 == 0 and k % 16 == 0
            limit = fp8_gemv.FP8_GEMV_MAX_ROWS if scaled_mm else fp8_gemv.FP8_GEMV_MAX_ROWS_ANY
            if x.shape[0] <= limit:
                return fp8_gemv.fp8_gemv(x, layer.weight, scale, bias, layer.scale_block, out, max_rows=limit)
            if scaled_mm:
                return self._scaled_mm(layer, x, scale, bias, out)
            y = torch.nn.functional.linear(x, self.dequantized_weight(layer, x.dtype), bias)
            return y.to(out)
        acts = None if sch.weights == "block" else sch.activations
        xq = fake_quantize_activation(x, acts, getattr(layer, "input_scale", None), sch.group_size)
        return fp8_gemv.fp8_gemv_ref(xq, layer.weight, scale, bias, layer.scale_block, out)

    def _scaled_mm(self, layer, x, scale, bias, out):
        sch = self.scheme
        if sch.activations in ("static", "token"):  # one launch (kernels/fp8_gemv.py)
            xq, sa = fp8_gemv.quantize_rows(x, layer.input_scale if sch.activations == "static" else None)
        else:
            mode = "token" if sch.activations == "group" else sch.activations
            sa = activation_scale(x, mode, getattr(layer, "input_scale", None))
            xq = quantize_fp8(x, sa)
            sa = sa.reshape(-1, 1).expand(x.shape[0], 1).contiguous() if sa.numel() == 1 else sa
        y = torch._scaled_mm(xq, layer.weight.t(), scale_a=sa, scale_b=scale.reshape(1, -1),
                             out_dtype=torch.bfloat16)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.to(out)


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model.to(dtype)`` except the parameters quantization methods keep in their own dtype
    (``quant_dtypes`` of each layer: FP8 weights, float32 scales). Returns ``model``."""
    keep = [(m, name, dt) for m in model.modules() for name, dt in (getattr(m, "quant_dtypes", None) or {}).items()]
    model.to(dtype)
    for m, name, dt in keep:
        p = getattr(m, name)
        p.data = p.data.to(dt)
    return model


# -- configs ----------------------------------------------------------------------------------------

def read_hf_quant_config(model_dir) -> Optional[dict[str, Any]]:
    """ModelOpt's ``hf_quant_config.json`` as a ``quantization_config`` dict (``quant_method``
    "modelopt" plus its ``quantization`` section), or None when the file is absent."""
    path = Path(model_dir) / "hf_quant_config.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    section = data.get("quantization", data)
    return {"quant_method": "modelopt", **section, "producer": data.get("producer")}


def _modelopt(qc: dict) -> Fp8LinearMethod:
    algo = str(qc.get("quant_algo") or "").upper()
    if algo == "FP8":
        scheme = Fp8Scheme("tensor", "static")
    elif algo == "FP8_PER_CHANNEL_PER_TOKEN":
        scheme = Fp8Scheme("channel", "token")
    elif algo == "FP8_PB_WO":
        scheme = Fp8Scheme("block", None, block=tuple(qc.get("block_size") or (128, 128)))
    else:
        raise UnsupportedQuantizationError(
            f"ModelOpt checkpoint with quant_algo {qc.get('quant_algo')!r} is not supported; supported: "
            f"{SUPPORTED_SCHEMES}")
    kv = str(qc.get("kv_cache_quant_algo") or "").upper()
    if kv not in ("", "NONE", "FP8"):
        raise UnsupportedQuantizationError(f"ModelOpt kv_cache_quant_algo {kv!r}: kvpilot's KV cache is FP8 "
                                           f"or 16-bit")
    return Fp8LinearMethod(scheme, qc.get("exclude_modules") or (), "fnmatch", "modelopt", kv == "FP8")


def _ct_args(args: Optional[dict], what: str) -> Optional[dict]:
    if args is None:
        return None
    if args.get("type") != "float" or int(args.get("num_bits", 0)) != 8 or not args.get("symmetric", True):
        raise UnsupportedQuantizationError(
            f"compressed-tensors {what} {args.get('type')} {args.get('num_bits')}-bit "
            f"(symmetric={args.get('symmetric', True)}) is not supported; supported: {SUPPORTED_SCHEMES}")
    return args


def _compressed_tensors(qc: dict) -> Fp8LinearMethod:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise UnsupportedQuantizationError(f"compressed-tensors format {fmt!r} is not supported; supported: "
                                           f"{SUPPORTED_SCHEMES}")
    schemes = set()
    for name, group in (qc.get("config_groups") or {}).items():
        targets = list(group.get("targets") or [])
        if targets != ["Linear"]:
            raise UnsupportedQuantizationError(f"compressed-tensors group {name!r} targets {targets}; kvpilot "
                                               f"quantizes every Linear layer alike (targets ['Linear'])")
        w = _ct_args(group.get("weights"), "weights")
        if w is None:
            raise UnsupportedQuantizationError(f"compressed-tensors group {name!r} has no weight quantization")
        if group.get("output_activations"):
            raise UnsupportedQuantizationError("compressed-tensors output_activations are not supported")
        a = _ct_args(group.get("input_activations"), "input_activations")
        strategy = w.get("strategy")
        block = tuple(w["block_structure"]) if strategy == "block" else None
        act, gs = None, None
        if a is not None:
            dyn, ast = bool(a.get("dynamic")), a.get("strategy")
            act = {(False, "tensor"): "static", (True, "tensor"): "dynamic_tensor", (True, "token"): "token",
                   (True, "group"): "group"}.get((dyn, ast))
            if act is None:
                raise UnsupportedQuantizationError(
                    f"compressed-tensors input_activations strategy {ast!r} (dynamic={dyn}) is not supported; "
                    f"supported: {SUPPORTED_SCHEMES}")
            gs = a.get("group_size") if act == "group" else None
        schemes.add(Fp8Scheme(strategy, act, block, gs))
    if len(schemes) != 1:
        raise UnsupportedQuantizationError(f"compressed-tensors checkpoint with {len(schemes)} distinct schemes; "
                                           f"kvpilot reads one scheme for all Linear layers")
    kv = qc.get("kv_cache_scheme")
    if kv and (kv.get("type") != "float" or int(kv.get("num_bits", 0)) != 8):
        raise UnsupportedQuantizationError(f"compressed-tensors kv_cache_scheme {kv}: only 8-bit float")
    return Fp8LinearMethod(schemes.pop(), qc.get("ignore") or (), "compressed-tensors", "compressed-tensors",
                           bool(kv))


def _fp8_config(qc: dict) -> Fp8LinearMethod:
    if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
        raise UnsupportedQuantizationError(f"quant_method 'fp8' with fmt {qc.get('fmt')!r}; supported: e4m3")
    act = qc.get("activation_scheme", "dynamic")
    wbs = qc.get("weight_block_size")
    ignore = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
    if wbs:
        if act != "dynamic":
            raise UnsupportedQuantizationError("block-wise FP8 needs activation_scheme 'dynamic'")
        scheme = Fp8Scheme("block", "group", block=(int(wbs[0]), int(wbs[1])), group_size=int(wbs[1]),
                           scale_name="weight_scale_inv")
    else:
        scheme = Fp8Scheme("tensor", "static" if act == "static" else "dynamic_tensor")
    return Fp8LinearMethod(scheme, ignore, "substring", "fp8")


def on_the_fly_fp8(exclude_modules: Sequence[str] = ()) -> Fp8LinearMethod:
    """The method for ``QuantConfig(quant_algo="FP8")`` on a 16/32-bit checkpoint: weights quantized
    at load with one scale per output channel (``amax(|W[n]|) / 448``), activations per token
    (dynamic). Per-channel because a row's scale follows its own magnitude (per-tensor scales let
    the largest row set every row's resolution) at no cost in the row-wise ``_scaled_mm`` epilogue,
    and merged q/k/v and gate/up rows keep their own scales without requantization. Per-token
    activations need no calibration data."""
    return Fp8LinearMethod(Fp8Scheme("channel", "token", from_float=True), exclude_modules, "fnmatch", "on-the-fly")


_QUANT_ALGOS = {"FP8": "fp8", "FP8_PER_CHANNEL_PER_TOKEN": "fp8"}


def get_quantization_method(hf_config: dict[str, Any],
                            quantization: Optional[dict[str, Any]] = None) -> QuantizationMethod:
    """The method for a checkpoint's ``config.json`` (``quantization_config.quant_method``; a ModelOpt
    ``hf_quant_config.json`` arrives there as ``quant_method`` "modelopt", `read_hf_quant_config`).

    ``quantization``: an on-the-fly request, ``{"quant_algo": "FP8", "exclude_modules": [...]}``
    (`kvpilot.config.QuantConfig.to_dict`); ignored for a checkpoint already quantized to FP8.
    Returns `UnquantizedLinearMethod` for an unquantized checkpoint and no request.

    Raises:
        UnsupportedQuantizationError: a scheme outside `SUPPORTED_SCHEMES` (NVFP4, AWQ, GPTQ, INT8,
            ...); the message names what the checkpoint asks for and what is supported.
    """
    qc = hf_config.get("quantization_config")
    algo = str((quantization or {}).get("quant_algo") or "").upper() or None
    if algo is not None and algo not in _QUANT_ALGOS:
        raise UnsupportedQuantizationError(f"on-the-fly quant_algo {algo!r} is not supported; supported: FP8")
    if not qc:
        if algo:
            return on_the_fly_fp8((quantization or {}).get("exclude_modules") or ())
        return UnquantizedLinearMethod()
    if not isinstance(qc, dict):
        raise UnsupportedQuantizationError(f"quantization_config must be an object, got {qc!r}")
    method = str(qc.get("quant_method", "")).lower()
    if method == "modelopt":
        return _modelopt(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        return _fp8_config(qc)
    raise UnsupportedQuantizationError(
        f"checkpoint quantization {method or '?'!r}"
        f"{' (' + str(qc.get('bits')) + '-bit)' if qc.get('bits') else ''} is not supported; supported: "
        f"{SUPPORTED_SCHEMES}")


# -- module names ------------------------------------------------------------------------------------

_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_names(module_name: str, first_layer: int = 0) -> tuple[str, list[str]]:
    """``(fused_name, part_names)``: the checkpoint names of kvpilot module ``module_name``
    (``layers.3.self_attn.qkv_proj`` of a stage starting at ``first_layer``) -> ``model.layers.N...``
    (the merged name itself, and its q/k/v or gate/up parts)."""
    parts = module_name.split(".")
    if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
        parts[1] = str(int(parts[1]) + first_layer)
        parts = ["model", *parts]
    fused = ".".join(parts)
    leaf = parts[-1]
    if leaf in _FUSED_PARTS:
        stem = ".".join(parts[:-1])
        return fused, [f"{stem}.{p}" for p in _FUSED_PARTS[leaf]]
    return fused, [fused]


def apply_module_exclusions(model: nn.Module) -> None:
    """Give every linear layer of ``model`` whose checkpoint module the quantization method ignores
    an `UnquantizedLinearMethod` (a merged layer is ignored when its merged name or all of its
    parts are).

    Raises:
        UnsupportedQuantizationError: only some parts of a merged layer are ignored, or the method
            quantizes modules kvpilot keeps only unquantized (tensor-parallel-invariant shards).
    """
    method = getattr(model, "quant_method", None)
    if not isinstance(method, Fp8LinearMethod):
        return
    from kvpilot.model.linear import LinearBase

    first = model.layer_range[0]
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase) or not method.ignore:
            continue
        fused, part_names = checkpoint_names(name, first)
        hits = [method.is_ignored(p) for p in part_names]
        if method.is_ignored(fused) or all(hits):
            module.set_quant_method(UnquantizedLinearMethod())
        elif any(hits):
            raise UnsupportedQuantizationError(
                f"{fused}: the checkpoint leaves {[p for p, h in zip(part_names, hits) if h]} unquantized but "
                f"quantizes the other parts; kvpilot merges them into one layer of one precision")
