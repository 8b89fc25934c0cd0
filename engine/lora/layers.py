"""LoRA on a loaded model: per-projection GPU slots, and the per-step slot index of every token.

`LoRASlots(model, config, dtype, device)` attaches a `LoRAProjection` as ``.lora`` to every
decoder layer's ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and ``down_proj``
(`kvpilot.model.linear.LinearBase` adds its update after the base product). Each holds
``max_loras`` slots of stacked weights, ``a`` ``[max_loras, parts * max_lora_rank, in]`` and
``b`` ``[max_loras, out, parts * max_lora_rank]`` (``parts``: 3 for q/k/v, 2 for gate/up, 1
otherwise; an adapter's module of rank ``r`` fills ``r`` of its part's ``max_lora_rank`` columns,
the rest stay zero), so one `kvpilot.kernels.lora.lora_apply` call applies every adapter of a batch
to a fused projection.

Per step, `LoRASlots.prepare(seqs)` gives each adapter of the step a slot (an LRU over the slots;
an adapter not resident is copied in from host memory, evicting the least recently used adapter
that this step does not use) and uploads each token's slot (``-1``: no adapter) into the shared
`LoRAState`. A step where no sequence has an adapter leaves the state inactive and the projections
add nothing (CUDA graphs captured that way stay valid; steps with adapters run eagerly:
`kvpilot.runner.model_runner`).

Tensor parallelism: adapters are sharded like their base layers. Adapters are loaded with the
base model's global shapes (`global_targets`); each rank's slots take its share when an adapter
is copied in. For a column-parallel projection (q/k/v, gate/up) ``a`` is whole and ``b`` holds
the rank's output rows (`LoRAProjection.rows`: the global row of each local one; replicated KV
heads included). For a row-parallel one (``o_proj``, ``down_proj``) ``a`` holds the rank's input
columns and ``b`` is whole, and the update is added to the rank's partial product before the
all-reduce (`kvpilot.model.linear.RowParallelLinear`), so the sum over ranks is the whole update
and no collective is added.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

import torch

from kvpilot.kernels.lora import lora_apply, lora_tiles
from kvpilot.lora.adapter import MODULE_PARTS, TARGETS, LoRAAdapter, Target
from kvpilot.lora.config import LoraConfig


class LoRAState:
    """What the projections read in one forward pass: ``active`` (some token has an adapter),
    ``slot_index`` ``[T]`` int32 on the device, ``slots`` (the distinct slots of the step, host ints),
    ``tiles`` (`kvpilot.kernels.lora.LoRATiles` for the Triton kernels; None on CPU)."""

    def __init__(self) -> None:
        self.active = False
        self.slot_index: Optional[torch.Tensor] = None
        self.slots: list[int] = []
        self.tiles = None


class LoRAProjection:
    """The LoRA slots of one projection (module docstring); ``__call__(x [T, in], out [T, out])``
    adds the update of each token's adapter to ``out`` in place and returns it."""

    def __init__(self, state: LoRAState, in_features: int, out_features: int, parts: int, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device, rows: Optional[torch.Tensor] = None,
                 col_start: int = 0) -> None:
        self.state = state
        self.max_rank = max_rank
        self.a = torch.zeros(max_loras, parts * max_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, out_features, parts * max_rank, dtype=dtype, device=device)
        #: global output row of each of this rank's rows (column parallel; identity on one rank)
        self.rows = torch.arange(out_features) if rows is None else rows
        #: first global input column of this rank (row parallel; 0 on one rank)
        self.col_start = col_start

    @property
    def active(self) -> bool:
        return self.state.active

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        st = self.state
        if not st.active:
            return out
        return lora_apply(x, out, self.a, self.b, st.slot_index, st.slots, st.tiles)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def fill(self, slot: int, entries: list[tuple[Target, torch.Tensor, torch.Tensor]]) -> None:
        """Copy this rank's share of one adapter's modules of this projection into ``slot``
        (cleared first). ``entries`` have the global shapes (module docstring)."""
        self.clear(slot)
        R = self.max_rank
        K = self.a.shape[2]
        for tgt, a, b in entries:
            r = a.shape[0]
            c = tgt.part * R
            self.a[slot, c:c + r].copy_(a[:, self.col_start:self.col_start + K])
            local = torch.nonzero((self.rows >= tgt.row) & (self.rows < tgt.row + tgt.rows), as_tuple=True)[0]
            if local.numel():
                part = b.index_select(0, self.rows[local] - tgt.row).to(self.b.device, self.b.dtype)
                self.b[slot, :, c:c + r].index_copy_(0, local.to(self.b.device), part)

    @property
    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()


_MODULES = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


def global_targets(cfg) -> dict[str, Target]:
    """`model_targets` of the whole (unsharded) model of ``cfg`` (a `kvpilot.model.config.ModelConfig`):
    one layer built on the meta device, so no memory is allocated."""
    from kvpilot.model.registry import model_class

    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, None, (0, 1))
    return model_targets(model)


def _shard_rows(proj, module: str, cfg, rank: int, tp: int) -> Optional[torch.Tensor]:
    """Global output rows of rank ``rank``'s rows of a column-parallel projection (None on one rank)."""
    if tp == 1:
        return None
    from kvpilot.model.linear import kv_heads_of

    if module == "qkv_proj":
        hd = proj.head_dim
        q_local, q_all = proj.num_heads * hd, cfg.num_attention_heads * hd
        first, count = kv_heads_of(cfg.num_key_value_heads, rank, tp)
        kv_all = cfg.num_key_value_heads * hd
        k = torch.arange(first * hd, (first + count) * hd)
        return torch.cat([rank * q_local + torch.arange(q_local), q_all + k, q_all + kv_all + k])
    sizes = proj.output_sizes  # merged column parallel: each part split over the ranks
    out, base = [], 0
    for n in sizes:
        out.append(base + rank * n + torch.arange(n))
        base += n * tp
    return torch.cat(out)


def model_targets(model) -> dict[str, Target]:
    """PEFT module name -> `Target` for ``model`` (a `kvpilot.model.decoder.CausalLM`), from its
    first layer's projections (every layer has the same shapes).

    Raises:
        ValueError: the model has no layers, or its layers lack the projections LoRA wraps (an MoE block).
    """
    if not len(model.layers):
        raise ValueError("LoRA needs a model stage with decoder layers")
    layer = model.layers[0]
    out: dict[str, Target] = {}
    for peft_name, (module, part, which) in TARGETS.items():
        block = "self_attn" if module in ("qkv_proj", "o_proj") else "mlp"
        proj = getattr(getattr(layer, block, None), module, None)
        if proj is None or not hasattr(proj, "output_sizes"):
            if module in ("qkv_proj", "o_proj"):
                raise ValueError(f"LoRA: {type(layer).__name__} has no {block}.{module} linear layer")
            continue  # e.g. an MoE block in the mlp slot: no gate/up/down targets
        sizes = proj.output_sizes
        if which is None:
            out[peft_name] = Target(module, part, 0, sum(sizes), proj.input_size)
        else:
            out[peft_name] = Target(module, part, sum(sizes[:which]), sizes[which], proj.input_size)
    return out


class LoRASlots:
    """The device side of LoRA for one model (module docstring).

    Args:
        model: a loaded `CausalLM` (one rank: ``pc.tp_size == 1``).
        config: `LoraConfig` (``max_loras`` slots of rank ``max_lora_rank``).
        dtype, device: of the slots (the model's).

    Attributes: ``state`` (`LoRAState`), ``nbytes`` (device bytes of all slots), ``loads`` (adapters
    copied into a slot so far).

    Raises:
        ValueError: a model in tensor-parallel-invariant mode (``KVPILOT_TP_INVARIANT``).
    """

    def __init__(self, model, config: LoraConfig, dtype: torch.dtype, device: torch.device) -> None:
        if getattr(model, "invariant_shards", 0) or getattr(model, "tp_invariant", 0):
            raise ValueError("LoRA adapters are not supported in tensor-parallel-invariant mode "
                             "(KVPILOT_TP_INVARIANT); unset it")
        rank, tp = model.pc.tp_rank, model.pc.tp_size
        self.config = config
        self.device = device
        self.state = LoRAState()
        self.projections: dict[tuple[int, str], LoRAProjection] = {}
        for layer in model.layers:
            for block, module in _MODULES:
                proj = getattr(getattr(layer, block, None), module, None)
                if proj is None or not hasattr(proj, "output_sizes"):
                    continue
                row_parallel = module in ("o_proj", "down_proj")
                p = LoRAProjection(self.state, proj.input_size, proj.output_size, MODULE_PARTS[module],
                                   config.max_loras, config.max_lora_rank, dtype, device,
                                   rows=None if row_parallel else _shard_rows(proj, module, model.cfg, rank, tp),
                                   col_start=rank * proj.input_size if row_parallel else 0)
                proj.lora = p
                self.projections[(layer.layer_idx, module)] = p
        self.nbytes = sum(p.nbytes for p in self.projections.values())
        self._slot_of: "OrderedDict[int, int]" = OrderedDict()  # lora_int_id -> slot, least recent first
        self._free = list(range(config.max_loras))
        self.loads = 0
        if device.type == "cuda":
            from kvpilot.kernels import triton_available

            if triton_available():
                self.warm_up()

    def warm_up(self) -> int:
        """Compile the Triton kernels for every projection shape now (one token through an empty
        slot: nothing changes), so the first step with an adapter does not stall on compilation.
        Returns the shapes compiled. Runs on CUDA at construction; on CPU only under
        ``TRITON_INTERPRET=1`` (tests)."""
        from kvpilot.kernels.lora import lora_apply_triton

        seen = set()
        tiles = lora_tiles([0], self.device)
        slot = torch.zeros(1, dtype=torch.int32, device=self.device)
        for p in self.projections.values():
            key = (p.a.shape[1], p.a.shape[2], p.b.shape[1], p.a.dtype)
            if key in seen:
                continue
            seen.add(key)
            x = torch.zeros(1, p.a.shape[2], dtype=p.a.dtype, device=self.device)
            out = torch.zeros(1, p.b.shape[1], dtype=p.a.dtype, device=self.device)
            lora_apply_triton(x, out, p.a, p.b, slot, tiles=tiles)
        return len(seen)

    def resident(self) -> list[int]:
        """Ids of the adapters in a slot, least recently used first."""
        return list(self._slot_of)

    def drop(self, lora_int_id: int) -> None:
        """Free the slot of an adapter (unloaded by the server); no-op when it holds none."""
        slot = self._slot_of.pop(lora_int_id, None)
        if slot is not None:
            for p in self.projections.values():
                p.clear(slot)
            self._free.append(slot)

    def _slot(self, adapter: LoRAAdapter, in_use: set[int]) -> int:
        lid = adapter.int_id
        slot = self._slot_of.get(lid)
        if slot is not None:
            self._slot_of.move_to_end(lid)
            return slot
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((i for i in self._slot_of if i not in in_use), None)
            if victim is None:
                raise RuntimeError(f"a step uses more than max_loras={self.config.max_loras} adapters")
            slot = self._slot_of.pop(victim)
        for (layer, module), p in self.projections.items():
            entries = adapter.weights.get((layer, module))
            if entries:
                p.fill(slot, entries)
            else:
                p.clear(slot)
        self._slot_of[lid] = slot
        self.loads += 1
        return slot

    def prepare(self, seqs: Sequence) -> bool:
        """Set the state for one step of ``seqs`` (`kvpilot.runner.batch.ScheduledSeq`, in flat-batch
        order; ``lora`` is each one's `LoRAAdapter` or None). Returns whether any token has an adapter.

        Raises:
            RuntimeError: the step uses more distinct adapters than ``max_loras`` (the scheduler
                never plans such a step).
        """
        st = self.state
        if not any(s.lora is not None for s in seqs):
            st.active, st.slot_index, st.slots, st.tiles = False, None, [], None
            return False
        in_use = {s.lora.int_id for s in seqs if s.lora is not None}
        if len(in_use) > self.config.max_loras:
            raise RuntimeError(f"a step uses {len(in_use)} adapters, more than max_loras={self.config.max_loras}")
        index: list[int] = []
        slots: set[int] = set()
        for s in seqs:
            slot = -1 if s.lora is None else self._slot(s.lora, in_use)
            if slot >= 0:
                slots.add(slot)
            index.extend([slot] * len(s.token_ids))
        t = torch.tensor(index, dtype=torch.int32)
        st.slot_index = t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t
        st.slots = sorted(slots)
        st.tiles = lora_tiles(index, self.device) if self.device.type == "cuda" else None
        st.active = True
        return True

    def pad_to(self, n: int) -> None:
        """Extend the step's slot index to ``n`` tokens with ``-1`` (a step padded for its shapes)."""
        st = self.state
        if st.active and st.slot_index.shape[0] < n:
            pad = torch.full((n - st.slot_index.shape[0],), -1, dtype=torch.int32, device=st.slot_index.device)
            st.slot_index = torch.cat([st.slot_index, pad])
