"""Load Hugging Face safetensors checkpoints (single file or sharded) into a `kvpilot.model.decoder.CausalLM`.

Each rank reads only its shard of each tensor (``safe_open(...).get_slice``), straight onto the
target device. Hugging Face names map onto kvpilot's fused projections: q/k/v -> ``qkv_proj``,
gate/up -> ``gate_up_proj``. A family with fused checkpoint tensors (Phi-3's ``qkv_proj`` and
``gate_up_proj``) splits them into those names first (`FamilySpec.split_checkpoint_tensor`). Every
projection tensor ``<proj>.<suffix>`` goes to the layer parameter of that suffix (``weight``,
``bias``, or what a quantization method registers, e.g. a per-row ``weight_scale``), sliced as the
weight is. Norm weights (input, post-attention, Gemma's pre/post feed-forward, q/k norms) are
replicated. After the last tensor, every module's ``process_weights_after_loading`` runs once
(quantization repacking, Gemma's ``1 + w`` norms).

A layer whose ``mlp`` has ``load_checkpoint_tensor`` (a mixture-of-experts block,
`kvpilot.model.moe.SparseMoeBlock`) loads its own ``mlp.*`` tensors: the per-expert tensors go
into one stacked tensor per projection.

Biases of row-parallel layers (``o_proj``, ``down_proj``) are not split: every tensor-parallel rank
holds the whole bias, and `llama.ParallelContext.row_parallel` adds it exactly once (after the fp32
all-reduce, or inside rank 0's GEMM with ``Tuning(tp_reduce_fp32=False)``).

Tensor-parallel-invariant models (``Tuning.tp_invariant``, `tp_invariant.InvariantDecoderLayer`): each of
a rank's shards ``g`` gets what rank ``g`` of a TP-``T`` group loads, through the same slicing code
(`_shard_targets`), into its own parameters (``qkv_shards.j``, ``o_shards.j``, ``gate_up_shards.j``,
``down_shards.j``, ``lm_head_shards.j``; a tied model's embedding, where it reads those LM head shards,
`tp_invariant.InvariantTiedEmbedding`, has no parameter of its own).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from torch import nn

from kvpilot.model.linear import kv_heads_of as _kv_heads_of
from kvpilot.model.quantization import FP8_DTYPE

logger = logging.getLogger(__name__)

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files (from ``model.safetensors.index.json`` when sharded).

    Raises:
        FileNotFoundError: the directory holds no ``*.safetensors`` file.
    """
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def _shard_targets(model: nn.Module) -> list[tuple[int, int, dict[str, str]]]:
    """``(rank, tp, names)`` per weight shard this model holds: the rank of a TP-``tp`` group whose
    slices it loads, and the (layer-relative) names of the parameters they go to. One entry (this
    rank of its group) for the default model; one per shard ``first + j`` of a TP-``T`` group in
    tensor-parallel-invariant mode."""
    pc = model.pc
    if not model.invariant_shards:
        return [(pc.tp_rank, pc.tp_size, {"qkv": "self_attn.qkv_proj", "o": "self_attn.o_proj.weight",
                                          "gate_up": "mlp.gate_up_proj", "down": "mlp.down_proj.weight"})]
    s = model.invariant_shards
    return [(pc.tp_rank * s + j, model.tp_invariant,
             {"qkv": f"self_attn.qkv_shards.{j}", "o": f"self_attn.o_shards.{j}.weight",
              "gate_up": f"mlp.gate_up_shards.{j}", "down": f"mlp.down_shards.{j}.weight"}) for j in range(s)]


@torch.no_grad()
def load_weights(model: nn.Module, model_dir: Path) -> None:
    """Copy the checkpoint's tensors (this rank's shard of them) into ``model``'s parameters.

    Raises:
        KeyError: a parameter of the model has no tensor in the checkpoint.
    """
    cfg, pc = model.cfg, model.pc
    start, end = model.layer_range
    hd = cfg.head_dim
    targets = _shard_targets(model)
    # Row-parallel biases: whole on every rank, in the default layer's or the shard layer's name.
    o_bias = "self_attn.o_bias" if model.invariant_shards else "self_attn.o_proj.bias"
    down_bias = "mlp.down_bias" if model.invariant_shards else "mlp.down_proj.bias"
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    spec = getattr(model, "spec", None)
    split = spec.split_checkpoint_tensor if spec is not None else (lambda rest, sl: [(rest, sl)])
    device = next(model.parameters()).device

    def put(name: str, tensor: torch.Tensor, rows: slice | None = None) -> None:
        if name not in params:
            raise KeyError(f"checkpoint {_model_dir(model)} has a tensor for {name}, which the "
                           f"{type(model).__name__} model does not have (a config/checkpoint mismatch)")
        p = params[name]
        if (p.dtype == FP8_DTYPE) != (tensor.dtype == FP8_DTYPE):
            raise ValueError(f"{name}: checkpoint tensor is {tensor.dtype} but the model expects {p.dtype} "
                             f"({getattr(model, 'quant_method', None)!r}); is the module missing from, or wrongly in, the "
                             f"checkpoint's list of unquantized modules?")
        target = p if rows is None else p[rows]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}{'' if rows is None else rows}: checkpoint shape {tuple(tensor.shape)} "
                             f"does not match {tuple(target.shape)}")
        target.copy_(tensor.to(device=device, dtype=p.dtype))
        loaded.add(name)

    def vocab_rows(sl, param_name: str, r: int) -> None:
        per = params[param_name].shape[0]
        # (a tiny vocabulary may leave a last rank or shard no row at all: lo clamped to V)
        lo, hi = min(r * per, cfg.vocab_size), min((r + 1) * per, cfg.vocab_size)
        put(param_name, sl[lo:hi], slice(0, hi - lo))
        if hi - lo < per:  # padding rows of the last rank never win the arg-max
            params[param_name][hi - lo:].zero_()

    def lm_head_rows(sl) -> None:
        if model.lm_head_shards is not None:  # invariant mode: one TP-T rank's rows per shard
            for j in range(len(model.lm_head_shards)):
                vocab_rows(sl, f"lm_head_shards.{j}", pc.tp_rank * len(model.lm_head_shards) + j)
        elif model.lm_head is not None:
            vocab_rows(sl, "lm_head", pc.tp_rank)

    def rank_cols(name: str, sl, r: int):
        """A row-parallel layer's non-weight tensor: whole, or (2-D block scales) rank ``r``'s columns."""
        t = sl[:]
        p = params.get(name)
        if p is not None and t.dim() == 2 and p.dim() == 2 and t.shape[1] != p.shape[1]:
            local_k = params[name.rsplit(".", 1)[0] + ".weight"].shape[1]
            if block is None or local_k % block[1]:
                raise ValueError(f"{name}: this rank's {local_k} input columns do not start on a "
                                 f"{block[1] if block else '?'}-column scale block; choose a tensor_parallel_size "
                                 f"that splits the input size into whole blocks")
            c = p.shape[1]
            t = t[:, r * c:(r + 1) * c]
        return t

    def layer_tensor(prefix: str, rest: str, kind: str, sl, r: int, tp: int, names: dict[str, str]) -> None:
        """Rank ``r`` of TP ``tp``'s slice of one per-layer tensor into ``names``' parameters."""
        q_heads = cfg.num_attention_heads // tp
        kv_first, kv_count = _kv_heads_of(cfg.num_key_value_heads, r, tp)
        inter = cfg.intermediate_size // tp
        if rest.startswith("self_attn.q_proj."):
            put(prefix + f"{names['qkv']}.{kind}", sl[r * q_heads * hd:(r + 1) * q_heads * hd],
                slice(0, q_heads * hd))
        elif rest.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
            off = q_heads * hd + (0 if ".k_proj." in rest else kv_count * hd)
            put(prefix + f"{names['qkv']}.{kind}", sl[kv_first * hd:(kv_first + kv_count) * hd],
                slice(off, off + kv_count * hd))
        elif rest == "self_attn.o_proj.weight":
            put(prefix + names["o"], sl[:, r * q_heads * hd:(r + 1) * q_heads * hd])
        elif rest.startswith("self_attn.o_proj.") and prefix + names["o"].replace(".weight", f".{kind}") in params:
            put(prefix + names["o"].replace(".weight", f".{kind}"), rank_cols(prefix + names["o"].replace(
                ".weight", f".{kind}"), sl, r))  # a per-row scale: whole; a block scale: this rank's K blocks
        elif rest.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
            off = 0 if ".gate_proj." in rest else inter
            put(prefix + f"{names['gate_up']}.{kind}", sl[r * inter:(r + 1) * inter], slice(off, off + inter))
        elif rest == "mlp.down_proj.weight":
            put(prefix + names["down"], sl[:, r * inter:(r + 1) * inter])
        elif rest.startswith("mlp.down_proj.") and prefix + names["down"].replace(".weight", f".{kind}") in params:
            put(prefix + names["down"].replace(".weight", f".{kind}"),
                rank_cols(prefix + names["down"].replace(".weight", f".{kind}"), sl, r))

    files = safetensors_files(_model_dir(model))
    key_files = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            key_files.update({k: path for k in f.keys()})
    block = getattr(getattr(getattr(model, "quant_method", None), "scheme", None), "block", None)
    model.kv_cache_scales = {}

    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                if key in ("model.embed_tokens.weight", "lm_head.weight") and sl.get_dtype() == "F8_E4M3":
                    sl = _dequantized(key, key_files, block)
                if key == "model.embed_tokens.weight":
                    if "embed_tokens.weight" in params:  # (not an InvariantTiedEmbedding: the LM head shards')
                        vocab_rows(sl, "embed_tokens.weight", pc.tp_rank)
                    if cfg.tie_word_embeddings:
                        lm_head_rows(sl)
                    continue
                if key == "lm_head.weight":
                    if not cfg.tie_word_embeddings:
                        lm_head_rows(sl)
                    continue
                if key == "model.norm.weight":
                    if model.norm is not None:
                        put("norm.weight", sl[:])
                    continue
                m = _LAYER_RE.match(key)
                if not m:
                    continue  # e.g. rotary inv_freq buffers
                i, rest = int(m.group(1)), m.group(2)
                if not start <= i < end:
                    continue
                prefix = f"layers.{i - start}."
                kv_kind = _kv_scale_kind(rest)
                if kv_kind:
                    model.kv_cache_scales.setdefault(i, {})[kv_kind] = float(sl[...].float().reshape(-1)[0])
                    continue
                sl = _scale_rows(cfg, rest, sl, block)
                mlp_loader = getattr(getattr(model.layers[i - start], "mlp", None), "load_checkpoint_tensor", None)
                for rest, sl in split(rest, sl):
                    kind = rest.rsplit(".", 1)[-1]  # weight or bias
                    if mlp_loader is not None and rest.startswith("mlp.") and mlp_loader(
                            rest[4:], sl, lambda name, t, index=None: put(prefix + "mlp." + name, t, index)):
                        continue  # an MoE block's tensors (kvpilot.model.moe.SparseMoeBlock)
                    if rest == "self_attn.o_proj.bias":  # whole on every rank (module docstring)
                        put(prefix + o_bias, sl[:])
                    elif rest == "mlp.down_proj.bias":
                        put(prefix + down_bias, sl[:])
                    elif rest.endswith("norm.weight"):  # replicated norms (the model may lack some: KeyError)
                        put(prefix + rest, sl[:])
                    else:
                        for r, tp, names in targets:
                            layer_tensor(prefix, rest, kind, sl, r, tp, names)
    missing = [n for n in params if n not in loaded]
    if not missing:
        for module in model.modules():
            hook = getattr(module, "process_weights_after_loading", None)
            if hook is not None:
                hook()
    if missing:
        raise KeyError(f"checkpoint {_model_dir(model)} lacks tensors for {missing[:8]}"
                       f"{' ...' if len(missing) > 8 else ''}")


_KV_SCALE_NAMES = {"self_attn.k_scale": "k", "self_attn.v_scale": "v", "self_attn.k_proj.k_scale": "k",
                   "self_attn.v_proj.v_scale": "v", "self_attn.k_proj.output_scale": "k",
                   "self_attn.v_proj.output_scale": "v", "self_attn.attn.k_scale": "k", "self_attn.attn.v_scale": "v",
                   "self_attn.kv_scale": "kv"}


def _kv_scale_kind(rest: str):
    """"k", "v" or "kv" for a checkpoint's KV-cache scale tensor (ModelOpt ``k_proj.k_scale``,
    compressed-tensors ``self_attn.k_scale`` or ``k_proj.output_scale``), else None."""
    return _KV_SCALE_NAMES.get(rest)


_SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale")


def _checkpoint_rows(cfg, rest: str):
    """Rows of the weight of checkpoint projection ``rest`` (``self_attn.q_proj.weight_scale`` ->
    ``num_heads * head_dim``), or None for other tensors."""
    hd = cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    proj = rest.rsplit(".", 1)[0]
    return {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv, "self_attn.qkv_proj": q + 2 * kv,
            "self_attn.o_proj": cfg.hidden_size, "mlp.gate_proj": cfg.intermediate_size,
            "mlp.up_proj": cfg.intermediate_size, "mlp.gate_up_proj": 2 * cfg.intermediate_size,
            "mlp.down_proj": cfg.hidden_size}.get(proj)


def _scale_rows(cfg, rest: str, sl, block):
    """A checkpoint scale in one row per weight row, so it slices like the weight: a per-tensor
    scale (``[]`` or ``[1]``) repeated over the rows, a per-channel ``[N, 1]`` flattened, a block
    scale ``[ceil(N / block_n), ...]`` repeated ``block_n`` times per block row. Other tensors as given."""
    if rest.rsplit(".", 1)[-1] not in _SCALE_SUFFIXES:
        return sl
    rows = _checkpoint_rows(cfg, rest)
    if rows is None:
        return sl
    t = sl[...].to(torch.float32)
    if t.numel() == 1:
        return t.reshape(1).expand(rows).contiguous()
    if t.dim() == 2 and t.shape == (rows, 1):
        return t.reshape(rows)
    if t.dim() == 2 and block is not None and t.shape[0] == -(-rows // block[0]):
        return t.repeat_interleave(block[0], 0)[:rows].contiguous()
    return t


def _dequantized(key: str, key_files: dict, block) -> torch.Tensor:
    """An FP8 embedding or LM head of the checkpoint times its scale (kvpilot keeps them 16/32-bit)."""
    from kvpilot.kernels.fp8_gemv import dequantize_fp8

    stem = key.rsplit(".", 1)[0]
    for suffix in ("weight_scale", "weight_scale_inv"):
        name = f"{stem}.{suffix}"
        if name in key_files:
            with safe_open(str(key_files[name]), framework="pt", device="cpu") as g:
                scale = g.get_tensor(name).to(torch.float32)
            with safe_open(str(key_files[key]), framework="pt", device="cpu") as g:
                w = g.get_tensor(key)
            blk = block if scale.dim() == 2 and scale.shape[1] > 1 else None
            return dequantize_fp8(w, scale.reshape(-1) if blk is None else scale, blk)
    raise KeyError(f"checkpoint has an FP8 {key} without {stem}.weight_scale")


def _model_dir(model: nn.Module) -> Path:
    return Path(model.cfg.raw["_model_dir"])
