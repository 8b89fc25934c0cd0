"""Tensor-parallel-invariant mode (``Tuning(tp_invariant=T)``; docs/parallelism.md).

``T`` (default 0 = off) comes with the model's `kvpilot.tuning.Tuning` (`kvpilot.model.llama.LlamaForCausalLM`),
which every worker gets in its `WorkerSpec`. Every layout then computes the decomposition of a TP-``T`` group: TP
``t`` for any ``t`` dividing ``T`` (TP 1 included) gives bit-identical logits. ``T`` must be a
multiple of ``tensor_parallel_size`` ``t`` and divide the attention heads, the KV heads and
``intermediate_size`` (`tp_invariant_shards`; ValueError at build otherwise). Each rank holds
``s = T / t`` *shards*: shard ``g = tp_rank * s + j`` is exactly what rank ``g`` of a TP-``T``
group holds (its own contiguous tensors, loaded by the same slicing code in `kvpilot.model.weights`), and
every sharded op runs once per shard at that rank's shapes (`InvariantDecoderLayer`):

- QKV and gate/up (column parallel): one projection per shard, called as a TP-``T`` rank calls it
  (fused ``rmsnorm_gemv`` or ``nn.Linear``); q, k and v of the shards are concatenated in head
  order and go through ONE rotary/KV write and ONE attention call, whose launch decisions (context
  splits, the full-batch launch) use one shard's KV-head count (`kernels.paged_attention`'s
  ``launch_kv_heads``; a head's values do not depend on the grid). SiLU and ``down_proj`` run per
  shard on that shard's ``[gate | up]``.
- ``o_proj`` / ``down_proj`` (row parallel): per shard, its input columns made contiguous and the
  projection a TP-``T`` rank runs at that ``M`` (the bias in global shard 0's partial only); then
  the partials of all ``T`` shards are summed in shard order in float32 and rounded once
  (`shard_sum`; for two partials one 16-bit add, which computes exactly that). With ``t = T = 2``
  this is the default two-rank all-reduce (NCCL's and the one-shot kernel's
  ``bf16(float(a) + float(b))``), so that layout keeps the default model (`llama.LlamaDecoderLayer`,
  one-shot kernel included); with ``t > 1`` and ``T > 2`` the ranks all-gather their partials
  instead of all-reducing. ``Tuning.tp_reduce_fp32`` is ignored in this mode.
- LM head (vocabulary parallel, `LlamaForCausalLM.compute_logits`): with ``s > 1`` one
  ``[ceil(V / T), hidden]`` matrix per shard (zero-padded like a TP-``T`` rank's), products
  concatenated in shard order. The embedding lookup is exact in any layout and stays the default
  one, except that a model with tied embeddings whose stage holds both ends looks its rows up in
  those LM head shards (`InvariantTiedEmbedding`: no second copy of the vocabulary matrix). Norms,
  residual adds, rotary and sampling are replicated and unchanged.

The invariance is per step: layouts agree bit for bit when they run the same batches. What stays
different: signed zeros (a two-rank sum of -0.0 and -0.0 is +0.0 in the one-shot kernel, -0.0 in
a 16-bit add), and batch shapes (a row's bf16 values depend on its batch's shapes: kernel choices,
attention splits). The runner keeps those alike across tensor-parallel sizes (TP ranks pad eager
prefill steps to one GPU's prefill-graph buckets, `model_runner.prefill_padding`, and decode graphs
pad batches alike; ``Tuning(tp_cuda_graphs=False)`` or ``Tuning(prefill_graphs=False)`` on one side only
changes ``M``), but not: pipeline micro-batches (``P > 1`` cuts a step into up to ``P`` batches
of its own, so PP 2 matches a one-stage layout only with ``Tuning(pp_microbatch=False)``), and
schedules (a KV pool sized from free memory is larger at TP 2 than on one GPU, so one layout may
preempt or evict cached prefixes where the other does not: fix the pool with
``KvCacheConfig(max_tokens=)``). The cost on one GPU with ``T = 2``: per layer every projection is
two launches at half the width, plus three concatenations, two contiguous copies and two adds.

Validation: `check_tp_invariant` (the front end, before any worker starts) and
`tp_invariant_shards` (every model build) raise ValueError for a bad ``T``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from kvpilot import kernels as K
from kvpilot.model.config import ModelConfig
from kvpilot.kernels import gemv as KG
from kvpilot.model.layers import AttentionMetadata, ParallelContext, RMSNorm


def tp_invariant_shards(cfg: ModelConfig, tp_size: int, invariant_size: int) -> int:
    """Shards per rank ``s = T / t`` (an int >= 1) of tensor-parallel-invariant size ``T``
    (``invariant_size``, >= 1) at ``tp_size`` ``t``.

    Raises:
        ValueError: ``T`` is below 1 or not a multiple of ``t``, or does not divide
            ``num_attention_heads``, ``num_key_value_heads`` or ``intermediate_size``.
    """
    T = invariant_size
    if T < 1 or T % tp_size:
        raise ValueError(f"Tuning.tp_invariant={T} must be a multiple of tensor_parallel_size {tp_size}")
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        n = getattr(cfg, name)
        if n % T:
            raise ValueError(f"Tuning.tp_invariant={T} must divide {name} {n}")
    return T // tp_size


def check_tp_invariant(cfg: ModelConfig, tp_size: int, invariant_size: int) -> int:
    """Validate ``invariant_size`` ``T`` (`Tuning.tp_invariant`) for a model ``cfg`` at
    ``tensor_parallel_size`` ``tp_size`` where the model is not built (a parallel front end, before
    its workers start, so a bad value fails as it fails on one GPU instead of in every worker).
    Returns ``T`` (0 = off).

    Raises:
        ValueError: as `tp_invariant_shards`.
    """
    T = invariant_size
    if T:
        tp_invariant_shards(cfg, tp_size, T)
    return T


# torch 2.13 renamed all_gather_into_tensor (same signature; the old name warns there).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _sum_in_order(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts[0] + parts[1] + ...`` summed left to right in float32, rounded once to their dtype.

    Two 16-bit parts: one add in their dtype, which PyTorch computes as ``float(a) + float(b)``
    rounded once (one kernel instead of four).
    """
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        return parts[0] + parts[1]
    acc = parts[0].to(torch.float32, copy=True)
    for p in parts[1:]:
        acc += p
    return acc.to(parts[0].dtype)


def shard_sum(pc: ParallelContext, parts: list[torch.Tensor], invariant_size: int) -> torch.Tensor:
    """Tensor-parallel-invariant row-parallel sum (module docstring): ``parts`` are this rank's
    (``pc``) shards' partial products (``[T_tok, N]`` each, same dtype), shard ``tp_rank * len(parts) + j``
    at index ``j``; returns the partials of all ``invariant_size`` shards summed in global shard
    order in float32 and rounded once (`_sum_in_order`), ``[T_tok, N]``. With one rank a local
    sum; otherwise the ranks all-gather their partials (every rank then sums the same list).
    """
    if pc.tp_size == 1:
        return _sum_in_order(parts)
    local = parts[0].unsqueeze(0) if len(parts) == 1 else torch.stack(parts)
    gathered = local.new_empty((invariant_size,) + tuple(parts[0].shape))
    _all_gather_flat(gathered, local, group=pc.tp_group)
    return _sum_in_order(list(gathered.unbind(0)))


class InvariantTiedEmbedding(nn.Module):
    """The embedding of a tied model whose stage holds both ends in tensor-parallel-invariant mode
    with several shards per rank: it reads its rows from the LM head shards (``shards``, the
    model's ``lm_head_shards``: ``s`` matrices ``[ceil(V / T), hidden]``, shard ``first_shard + j``
    of a TP-``T`` group at index ``j``; registered on the model first, so the parameters keep those
    names) instead of holding a second copy of the vocabulary matrix.

    ``forward(ids [n] int64) -> [n, hidden]`` in the shards' dtype: bit for bit
    `llama.VocabParallelEmbedding`'s result in any layout (each row selected exactly, never summed,
    on one rank; with several ranks zero rows elsewhere and the same all-reduce).
    """

    def __init__(self, shards: nn.ParameterList, pc: ParallelContext, first_shard: int) -> None:
        super().__init__()
        self.shards = shards
        self.rows = shards[0].shape[0]
        self.start = first_shard * self.rows  # first vocabulary row this rank holds
        self.pc = pc
        self.ar_site = pc.new_site()  # the embedding's all-reduce, as VocabParallelEmbedding's

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = None
        for j, w in enumerate(self.shards):
            local = ids - (self.start + j * self.rows)
            inside = ((local >= 0) & (local < self.rows)).unsqueeze(-1)
            rows = nn.functional.embedding(local.clamp(0, self.rows - 1), w)
            out = rows.masked_fill(~inside, 0) if out is None else torch.where(inside, rows, out)
        if self.pc.tp_size == 1:
            return out
        return self.pc.all_reduce(out, self.ar_site)


class InvariantAttention(nn.Module):
    """`LlamaAttention` of tensor-parallel-invariant mode (module docstring): this rank's
    ``num_shards`` shards of a TP-``invariant_size`` group, shard ``first_shard + j`` in ``qkv_shards[j]``
    (``[q_g + 2 * kv_g, hidden]``) and ``o_shards[j]`` (``[hidden, q_g]``, no bias); ``o_bias``
    (the layer's whole bias, or None) goes into global shard 0's partial only. ``num_heads`` /
    ``num_kv_heads`` are this rank's (all shards: the KV cache's head count), ``launch_kv_heads`` one
    shard's."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, pc: ParallelContext, invariant_size: int) -> None:
        super().__init__()
        T = invariant_size
        s = tp_invariant_shards(cfg, pc.tp_size, T)
        self.layer_idx = layer_idx
        self.pc = pc
        self.invariant_size = T
        self.num_shards = s
        self.first_shard = pc.tp_rank * s
        self.head_dim = cfg.head_dim
        self.launch_kv_heads = cfg.num_key_value_heads // T
        self.num_heads = s * (cfg.num_attention_heads // T)
        self.num_kv_heads = s * self.launch_kv_heads
        self.shard_q_size = cfg.num_attention_heads // T * self.head_dim
        self.shard_kv_size = self.launch_kv_heads * self.head_dim
        self.q_size = s * self.shard_q_size
        self.kv_size = s * self.shard_kv_size
        self.scale = self.head_dim ** -0.5
        qg, kvg = self.shard_q_size, self.shard_kv_size
        self.qkv_shards = nn.ModuleList(nn.Linear(cfg.hidden_size, qg + 2 * kvg, bias=cfg.attention_bias)
                                        for _ in range(s))
        self.o_shards = nn.ModuleList(nn.Linear(qg, cfg.hidden_size, bias=False) for _ in range(s))
        self.o_bias = nn.Parameter(torch.empty(cfg.hidden_size)) if cfg.attention_bias else None

    def attend(self, positions, qkv_parts: list[torch.Tensor], meta: AttentionMetadata, kv_cache, cos_sin_cache,
               fused_gemv: bool = False) -> torch.Tensor:
        """`LlamaAttention.attend` over per-shard QKV outputs ``qkv_parts[j]`` ``[T, q_g + 2 * kv_g]``;
        returns ``[T, hidden]`` in ``qkv_parts``' dtype (the row-parallel sum of all shards, `shard_sum`)."""
        n = qkv_parts[0].shape[0]
        qg, kvg = self.shard_q_size, self.shard_kv_size
        if len(qkv_parts) == 1:
            q, k, v = qkv_parts[0].split([qg, kvg, kvg], dim=-1)
        else:  # this rank's heads in shard order (pure data movement)
            q = torch.cat([p[:, :qg] for p in qkv_parts], dim=-1)
            k = torch.cat([p[:, qg:qg + kvg] for p in qkv_parts], dim=-1)
            v = torch.cat([p[:, qg + kvg:] for p in qkv_parts], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if meta.max_query_len == 1:  # decode-only: one launch at small batch (kernels.rotary_decode_attention)
            out = K.rotary_decode_attention(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping,
                                            meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale,
                                            meta.max_seq_len, launch_kv_heads=self.launch_kv_heads)
        else:
            q = K.rotary_write_kv_cache(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping)
            out = K.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                    self.scale, meta.max_query_len, meta.max_seq_len,
                                    launch_kv_heads=self.launch_kv_heads)
        out = out.reshape(n, self.q_size)
        matmul = KG.gemv if fused_gemv else KG.gemv_ref
        parts = []
        for j, lin in enumerate(self.o_shards):
            # A TP-T rank's input is its own contiguous [T, q_g] tensor.
            x = out if self.num_shards == 1 else out[:, j * qg:(j + 1) * qg].contiguous()
            parts.append(matmul(x, lin.weight, self.o_bias if self.first_shard + j == 0 else None, None))
        return shard_sum(self.pc, parts, self.invariant_size)


class InvariantMLP(nn.Module):
    """`LlamaMLP` of tensor-parallel-invariant mode: ``gate_up_shards[j]`` ``[2 * inter_g, hidden]``
    (``[gate_g | up_g]`` as on a TP-``T`` rank), ``down_shards[j]`` ``[hidden, inter_g]`` (no bias);
    ``down_bias`` as `InvariantAttention`'s ``o_bias``."""

    def __init__(self, cfg: ModelConfig, pc: ParallelContext, invariant_size: int) -> None:
        super().__init__()
        T = invariant_size
        s = tp_invariant_shards(cfg, pc.tp_size, T)
        inter = cfg.intermediate_size // T
        self.pc = pc
        self.invariant_size = T
        self.num_shards = s
        self.first_shard = pc.tp_rank * s
        self.gate_up_shards = nn.ModuleList(nn.Linear(cfg.hidden_size, 2 * inter, bias=cfg.mlp_bias)
                                            for _ in range(s))
        self.down_shards = nn.ModuleList(nn.Linear(inter, cfg.hidden_size, bias=False) for _ in range(s))
        self.down_bias = nn.Parameter(torch.empty(cfg.hidden_size)) if cfg.mlp_bias else None

    def down(self, gate_up_parts: list[torch.Tensor], fused_gemv: bool = False) -> torch.Tensor:
        """SiLU-and-mul and ``down_proj`` per shard (``gate_up_parts[j]`` ``[T, 2 * inter_g]``), then
        the row-parallel sum of all shards: ``[T, hidden]``."""
        parts = []
        for j, (gate_up, lin) in enumerate(zip(gate_up_parts, self.down_shards)):
            bias = self.down_bias if self.first_shard + j == 0 else None
            if fused_gemv:
                parts.append(KG.silu_mul_gemv(gate_up, lin.weight, bias, None))
            else:
                parts.append(KG.gemv_ref(K.silu_and_mul(gate_up), lin.weight, bias, None))
        return shard_sum(self.pc, parts, self.invariant_size)


def _rmsnorm_gemv_shards(x, residual, ln: RMSNorm, shards: nn.ModuleList):
    """``rmsnorm_gemv`` per shard, called exactly as each TP-``T`` rank calls it (the same inputs, so
    the same kernel variant, residual add included): returns (outputs per shard, new residual). Every
    call computes the same new residual ``h``; the first one's is kept."""
    if residual is None:
        return [KG.rmsnorm_gemv(x, None, ln.weight, ln.eps, lin.weight, lin.bias) for lin in shards], x
    outs, h = [], None
    for lin in shards:
        y, h_j = KG.rmsnorm_gemv(x, residual, ln.weight, ln.eps, lin.weight, lin.bias)
        outs.append(y)
        h = h_j if h is None else h
    return outs, h


class InvariantDecoderLayer(nn.Module):
    """`LlamaDecoderLayer` of tensor-parallel-invariant mode (module docstring): same ``forward``
    contract, ``fused_gemv`` likewise; every sharded op runs per shard."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, pc: ParallelContext, invariant_size: int,
                 fused_gemv: bool = True) -> None:
        super().__init__()
        self.self_attn = InvariantAttention(cfg, layer_idx, pc, invariant_size)
        self.mlp = InvariantMLP(cfg, pc, invariant_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fused_gemv = fused_gemv

    def forward(self, positions, hidden, residual, meta, kv_cache, cos_sin_cache):
        attn, mlp = self.self_attn, self.mlp
        if self.fused_gemv:
            qkv, residual = _rmsnorm_gemv_shards(hidden, residual, self.input_layernorm, attn.qkv_shards)
            hidden = attn.attend(positions, qkv, meta, kv_cache, cos_sin_cache, fused_gemv=True)
            gate_up, residual = _rmsnorm_gemv_shards(hidden, residual, self.post_attention_layernorm,
                                                     mlp.gate_up_shards)
            return mlp.down(gate_up, fused_gemv=True), residual
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = attn.attend(positions, [lin(hidden) for lin in attn.qkv_shards], meta, kv_cache, cos_sin_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return mlp.down([lin(hidden) for lin in mlp.gate_up_shards]), residual
