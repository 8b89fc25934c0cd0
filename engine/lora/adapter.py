"""Reading PEFT LoRA adapter directories, and the host-memory LRU of loaded adapters.

A PEFT adapter directory holds ``adapter_config.json`` (``peft_type`` ``LORA``, ``r``,
``lora_alpha``, ``use_rslora``, optional ``rank_pattern`` / ``alpha_pattern``) and
``adapter_model.safetensors`` with tensors named
``base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_A.weight`` (``[r, in_features]``)
and ``...lora_B.weight`` (``[out_features, r]``). The projections kvpilot applies adapters to
(`TARGETS`): ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``,
``down_proj``, and the fused ``qkv_proj`` / ``gate_up_proj`` of checkpoints that have them (Phi-3).
q/k/v land in their row ranges of kvpilot's fused ``qkv_proj``, gate/up in ``gate_up_proj``'s.

Each module's update is ``scaling * B @ A`` with ``scaling = alpha / r`` (``alpha / sqrt(r)`` with
``use_rslora``), ``r`` and ``alpha`` the module's own when ``rank_pattern`` / ``alpha_pattern``
name it, as PEFT computes them. ``B`` is stored already multiplied by the scaling, in the model's dtype.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from kvpilot.lora.config import LoRARequest, LoraConfig


class LoRAAdapterError(ValueError):
    """An adapter directory that kvpilot cannot apply to this base model (the message says why)."""


@dataclass(frozen=True)
class Target:
    """Where one PEFT module's update goes: ``module`` (``"qkv_proj"``, ``"o_proj"``,
    ``"gate_up_proj"``, ``"down_proj"``), the ``part`` of a fused projection (its rank columns in
    the slot: ``[part * max_rank, part * max_rank + r)``), and the output rows ``[row, row + rows)``."""

    module: str
    part: int
    row: int
    rows: int
    in_features: int


#: the projections of a decoder layer an adapter may target, with their fused parts
#: (name -> (kvpilot module, part, which of the module's output partitions: an index, or None for all))
TARGETS = {
    "q_proj": ("qkv_proj", 0, 0), "k_proj": ("qkv_proj", 1, 1), "v_proj": ("qkv_proj", 2, 2),
    "qkv_proj": ("qkv_proj", 0, None), "o_proj": ("o_proj", 0, None),
    "gate_proj": ("gate_up_proj", 0, 0), "up_proj": ("gate_up_proj", 1, 1),
    "gate_up_proj": ("gate_up_proj", 0, None), "down_proj": ("down_proj", 0, None),
}

#: parts (rank blocks) of each wrapped module's slot
MODULE_PARTS = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}

_KEY_RE = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
                     r"(?:\.[\w-]+)?\.weight$")


@dataclass
class LoRAAdapter:
    """One loaded adapter in host memory.

    Attributes:
        request: the `LoRARequest` it was loaded for (id, name, path).
        rank: the largest rank of its modules.
        weights: ``{(layer index, module): [(Target, A [r, in] , B [rows, r] * scaling)]}``, CPU
            tensors in the model's dtype.
    """

    request: LoRARequest
    rank: int
    weights: dict[tuple[int, str], list[tuple[Target, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    @property
    def int_id(self) -> int:
        return self.request.lora_int_id

    @property
    def cache_key(self) -> bytes:
        """Extra bytes of the prefix cache's block hashes for this adapter's requests."""
        return b"lora" + int(self.int_id).to_bytes(8, "little", signed=False)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for ws in self.weights.values() for _, a, b in ws)


def _pattern_value(patterns: dict, module_name: str, default):
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: the first key that matches the end of the
    module's dotted name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def load_adapter(request: LoRARequest, targets: dict[str, Target], num_layers: int, max_rank: int,
                 dtype: torch.dtype) -> LoRAAdapter:
    """Read the PEFT adapter at ``request.lora_path`` for a base model with these ``targets``.

    ``targets``: PEFT module name (``q_proj``, ...) -> `Target` in the base model
    (`kvpilot.lora.layers.model_targets`). ``num_layers``: the base model's decoder layers.

    Raises:
        FileNotFoundError: no such directory, or it lacks ``adapter_config.json`` or
            ``adapter_model.safetensors``.
        LoRAAdapterError: not a LoRA adapter; DoRA, trained biases, ``modules_to_save``, or a
            target kvpilot does not apply (embeddings, LM head); a rank above ``max_rank``; tensor
            shapes that do not fit the base model; a layer index past its last layer.
    """
    path = Path(request.lora_path)
    if not path.is_dir():
        raise FileNotFoundError(f"LoRA adapter {request.lora_name!r}: no directory {path}")
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"LoRA adapter {request.lora_name!r}: {path} has no adapter_config.json")
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        extra = " (adapter_model.bin is not read: save the adapter with safe_serialization=True)" if (
            path / "adapter_model.bin").is_file() else ""
        raise FileNotFoundError(f"LoRA adapter {request.lora_name!r}: {path} has no adapter_model.safetensors{extra}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise LoRAAdapterError(f"LoRA adapter {request.lora_name!r}: {cfg_file} is not valid JSON: {e}") from e
    name = request.lora_name
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: peft_type is {cfg.get('peft_type')!r}, not LORA")
    if cfg.get("use_dora"):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: DoRA adapters (use_dora) are not supported")
    if cfg.get("bias", "none") not in ("none", None):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: trained biases (bias={cfg.get('bias')!r}) are not supported")
    if cfg.get("modules_to_save"):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: modules_to_save ({cfg['modules_to_save']}) are not "
                               f"supported; kvpilot applies LoRA to the attention and MLP projections only")
    r_default = int(cfg.get("r", 8))
    alpha_default = float(cfg.get("lora_alpha", r_default))
    rslora = bool(cfg.get("use_rslora", False))

    from safetensors.torch import load_file

    tensors = load_file(str(weights_file), device="cpu")
    pairs: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY_RE.match(key)
        if m is None:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight of a decoder "
                                   f"layer's projection (targets kvpilot applies: {', '.join(TARGETS)})")
        layer, block, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if module not in targets:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: target module {module!r} ({key}) is not one kvpilot "
                                   f"applies to this model ({', '.join(sorted(targets))})")
        if layer >= num_layers:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {key} is for layer {layer}, but the base model has "
                                   f"{num_layers} layers")
        pairs.setdefault((layer, block, module), {})[ab] = t
    if not pairs:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {weights_file} holds no LoRA weights")
    adapter = LoRAAdapter(request=request, rank=0)
    for (layer, block, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_{''.join(ab)} only")
        a, b = ab["A"], ab["B"]
        tgt = targets[module]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r or a.shape[1] != tgt.in_features or b.shape[0] != tgt.rows:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: layer {layer} {module} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; this base model needs [r, {tgt.in_features}] and [{tgt.rows}, r] "
                f"(an adapter trained for another model?)")
        if r > max_rank:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: rank {r} ({module}) is above max_lora_rank {max_rank}; "
                                   f"raise LoraConfig.max_lora_rank (kvpilot serve --max-lora-rank)")
        full = f"model.layers.{layer}.{block}.{module}"
        r_cfg = int(_pattern_value(cfg.get("rank_pattern"), full, r_default))
        alpha = float(_pattern_value(cfg.get("alpha_pattern"), full, alpha_default))
        if r_cfg != r:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {full} has rank {r} in its tensors but {r_cfg} in "
                                   f"adapter_config.json")
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        b_scaled = (b.float() * scaling).to(dtype)
        adapter.weights.setdefault((layer, tgt.module), []).append((tgt, a.to(dtype).contiguous(), b_scaled))
        adapter.rank = max(adapter.rank, r)
    return adapter


class AdapterCache:
    """Loaded adapters in host memory: an LRU of at most ``max_cpu_loras`` entries, keyed by
    ``lora_int_id``. Thread-safe: `get` runs on the callers' threads (a request's adapter is read
    when it is submitted, not on the engine's thread). An adapter evicted while requests still hold
    it stays alive through them.

    ``loader(request) -> LoRAAdapter`` reads one adapter (`load_adapter` bound to the base model).
    Adapters read by `preload` (``LoraConfig.lora_dir``) stay in host memory for the engine's life;
    a request for one of their directories takes its tensors without reading the files again.
    """

    def __init__(self, config: LoraConfig, loader) -> None:
        self.config = config
        self._loader = loader
        self._lock = threading.Lock()
        self._cache: "OrderedDict[int, LoRAAdapter]" = OrderedDict()
        self._preloaded: dict[Path, LoRAAdapter] = {}

    def preload(self, path: str) -> LoRAAdapter:
        """Read the adapter at ``path`` now and keep it (module docstring).

        Raises:
            FileNotFoundError, LoRAAdapterError: see `load_adapter`.
        """
        key = Path(path).resolve()
        adapter = self._loader(LoRARequest(Path(path).name or str(path), 0, str(path)))
        with self._lock:
            self._preloaded[key] = adapter
        return adapter

    def get(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter for ``request``, loaded on first use.

        Raises:
            ValueError: ``request.lora_int_id`` is already loaded from another directory.
            FileNotFoundError, LoRAAdapterError: see `load_adapter`.
        """
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a kvpilot.executor.LoRARequest, got {type(request).__name__}")
        with self._lock:
            hit = self._cache.get(request.lora_int_id)
            if hit is not None:
                if Path(hit.request.lora_path).resolve() != Path(request.lora_path).resolve():
                    raise ValueError(f"lora_int_id {request.lora_int_id} is already the adapter at "
                                     f"{hit.request.lora_path}; give the adapter at {request.lora_path} another id")
                self._cache.move_to_end(request.lora_int_id)
                return hit
            pre = self._preloaded.get(Path(request.lora_path).resolve())
            adapter = LoRAAdapter(request, pre.rank, pre.weights) if pre is not None else self._loader(request)
            self._cache[request.lora_int_id] = adapter
            while len(self._cache) > self.config.max_cpu_loras:
                self._cache.popitem(last=False)
            return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (requests already holding it keep it); True if it was loaded."""
        with self._lock:
            return self._cache.pop(lora_int_id, None) is not None

    def loaded(self) -> list[LoRAAdapter]:
        with self._lock:
            return list(self._cache.values())

    def __contains__(self, lora_int_id: int) -> bool:
        with self._lock:
            return lora_int_id in self._cache
