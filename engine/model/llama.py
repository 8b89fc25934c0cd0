"""The Llama architecture as plain `nn.Module`s over a paged KV cache (tensor-parallel aware).

Shapes: the batch is *ragged*: all scheduled tokens of all sequences are concatenated into one
``[num_tokens]`` stream (prefill chunks and decode tokens together); `AttentionMetadata` says where
each sequence starts, how long its context is, and which cache slot each token writes. Hidden
states are ``[num_tokens, hidden_size]``.

Tensor parallelism (Megatron-LM layout): QKV and gate/up projections are split by output features
(column parallel), the attention output and down projections by input features (row parallel, one
all-reduce each), the embedding and LM head by vocabulary. With ``tp_size == 1`` it is the plain
model. When ``tp_size`` exceeds the KV head count, KV heads are replicated across ranks.

Fused decode GEMVs (``KVPILOT_FUSED_GEMV``, default 1, read once when the model is built): each
decoder layer runs its four matrix products through the dispatchers of ``kernels/gemv.py``:
input RMSNorm (+ residual add) and QKV as ``rmsnorm_gemv``, ``o_proj`` as ``gemv``, the
post-attention RMSNorm and gate/up as ``rmsnorm_gemv``, SiLU-and-mul and ``down_proj`` as
``silu_mul_gemv``. They launch one Triton kernel for CUDA batches of at most
``FUSED_MAX_ROWS[op]`` tokens (batch-1 decode: about 0.23 ms per Llama-3.1-8B step on an H200 in
benchmarks/lab/gpu_gemv.py) and otherwise run exactly the unfused ops, so CPU runs and larger batches
compute the same values either way. The ``nn.Linear`` modules stay (weight names, loading and
tensor-parallel sharding are unchanged); only their forward is bypassed. ``KVPILOT_FUSED_GEMV=0``
restores the unfused module calls.

Row-parallel reduction in float32 (``KVPILOT_TP_REDUCE_FP32=1``; default 0, read once when the model is
built; tensor parallelism with a 16-bit model only): one GPU rounds ``o_proj``'s and ``down_proj``'s
fp32 accumulation to the model dtype once. Summing per-rank partial products that were each rounded
to bf16, in a bf16 all-reduce, would round twice more per projection, and on random-weight models
that moved logits by ~0.1 nat (issue 9). So each rank keeps its partial product in fp32 (the GEMM's
or fused GEMV's accumulator, ``out_dtype=torch.float32``), the all-reduce sums fp32, the bias is
added once in fp32 after it, and the sum is rounded once to the model dtype: then the residual add
of the next RMSNorm sees what one GPU sees, up to the fp32 summation order. The cost: each
all-reduce moves twice the bytes (``4 * tokens * hidden`` instead of ``2 *``: 16 KB per reduction
at batch 1 for hidden 4096, latency-bound), plus one cast kernel per reduction (and one bias add on
models with biases). Measured on two H200s (BENCHMARKS.md seventh session, Llama-3.1-8B shape,
random weights, 8 prompts x 64 greedy tokens): against one GPU the mean logprob difference fell from
4.4e-2 to 3.6e-2 and the max from 0.156 to 0.125, but no prompt became identical (the rest is fp32
summation order: cuBLAS algorithms for the halved matrices, attention's context splits over fewer
KV heads), and batch-1 ITL rose 0.9%; prefill all-reduces would move twice the bytes. So it is off
by default, like vLLM's and TensorRT-LLM's bf16 all-reduce: the bf16 all-reduce of rounded partials
(tensor-parallel rank 0 adds the bias inside its GEMM). Every rank holds the whole
bias of a row-parallel layer (`weights.load_weights`); it is added exactly once either way.

Tensor-parallel-invariant mode (``KVPILOT_TP_INVARIANT=T``, default off): the layers of
`kvpilot.model.tp_invariant` (`InvariantDecoderLayer`) replace the default ones when the model is built;
see that module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from kvpilot import kernels as K
from kvpilot.model.config import ModelConfig
from kvpilot.model.layers import (AttentionMetadata, ParallelContext, RMSNorm, VocabParallelEmbedding,  # noqa: F401
                                  fused_gemv_enabled, tp_reduce_fp32_enabled)
from kvpilot.model.tp_invariant import (InvariantDecoderLayer, InvariantTiedEmbedding, tp_invariant_shards,
                                        tp_invariant_size)
from kvpilot.kernels import gemv as KG


class LlamaAttention(nn.Module):
    """QKV (column parallel), rotary, paged attention, ``o_proj`` (row parallel). ``reduce_fp32``
    (default: ``KVPILOT_TP_REDUCE_FP32``) is `ParallelContext.row_parallel`'s switch."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, pc: ParallelContext,
                 reduce_fp32: Optional[bool] = None) -> None:
        super().__init__()
        tp = pc.tp_size
        if cfg.num_attention_heads % tp:
            raise ValueError(f"tensor_parallel_size {tp} must divide num_attention_heads {cfg.num_attention_heads}")
        if cfg.num_key_value_heads % tp and tp % cfg.num_key_value_heads:
            raise ValueError(f"tensor_parallel_size {tp} must divide, or be a multiple of, "
                             f"num_key_value_heads {cfg.num_key_value_heads}")
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads // tp
        self.num_kv_heads = max(1, cfg.num_key_value_heads // tp)
        self.launch_kv_heads = self.num_kv_heads  # what attention's launch decisions assume
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.pc = pc
        self.ar_site = pc.new_site()  # o_proj's all-reduce
        self.reduce_fp32 = tp_reduce_fp32_enabled() if reduce_fp32 is None else reduce_fp32

    def forward(self, positions, hidden, meta: AttentionMetadata, kv_cache, cos_sin_cache):
        return self.attend(positions, self.qkv_proj(hidden), meta, kv_cache, cos_sin_cache)

    def attend(self, positions, qkv, meta: AttentionMetadata, kv_cache, cos_sin_cache,
               fused_gemv: bool = False) -> torch.Tensor:
        """Attention after the QKV projection: rotary + KV write, paged attention, ``o_proj``, all-reduce.

        ``qkv`` ``[T, q_size + 2 * kv_size]`` (this rank's heads); returns ``[T, hidden]`` in ``qkv``'s
        dtype. ``fused_gemv`` runs ``o_proj`` through :func:`kvpilot.kernels.gemv.gemv`; the reduction
        is `ParallelContext.row_parallel`'s.
        """
        n = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if meta.max_query_len == 1:  # decode-only: one launch at small batch (kernels.rotary_decode_attention)
            out = K.rotary_decode_attention(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping,
                                            meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale,
                                            meta.max_seq_len)
        else:
            # One launch: rotates q (in place on CUDA), writes rotated k and v to their slots.
            q = K.rotary_write_kv_cache(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping)
            out = K.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                    self.scale, meta.max_query_len, meta.max_seq_len)
        out = out.reshape(n, self.q_size)
        return self.pc.row_parallel(out, self.o_proj.weight, self.o_proj.bias, KG.gemv if fused_gemv else KG.gemv_ref,
                                    self.reduce_fp32, self.ar_site)


class LlamaMLP(nn.Module):
    """gate/up (column parallel), SiLU-and-mul, ``down_proj`` (row parallel); ``reduce_fp32`` as for
    `LlamaAttention`."""

    def __init__(self, cfg: ModelConfig, pc: ParallelContext, reduce_fp32: Optional[bool] = None) -> None:
        super().__init__()
        if cfg.intermediate_size % pc.tp_size:
            raise ValueError(f"tensor_parallel_size {pc.tp_size} must divide intermediate_size {cfg.intermediate_size}")
        inter = cfg.intermediate_size // pc.tp_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)
        self.pc = pc
        self.ar_site = pc.new_site()  # down_proj's all-reduce
        self.reduce_fp32 = tp_reduce_fp32_enabled() if reduce_fp32 is None else reduce_fp32

    def forward(self, x):
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: torch.Tensor, fused_gemv: bool = False) -> torch.Tensor:
        """SiLU-and-mul, ``down_proj`` and the all-reduce: ``gate_up`` ``[T, 2 * inter]`` -> ``[T, hidden]``.

        ``fused_gemv`` runs the pair through :func:`kvpilot.kernels.gemv.silu_mul_gemv`; the reduction
        is `ParallelContext.row_parallel`'s.
        """
        w, b = self.down_proj.weight, self.down_proj.bias
        if fused_gemv:
            return self.pc.row_parallel(gate_up, w, b, KG.silu_mul_gemv, self.reduce_fp32, self.ar_site)
        return self.pc.row_parallel(K.silu_and_mul(gate_up), w, b, KG.gemv_ref, self.reduce_fp32,
                                    self.ar_site)


class LlamaDecoderLayer(nn.Module):
    """One pre-norm decoder layer: ``forward(positions [T], hidden [T, H], residual [T, H] or None,
    meta, kv_cache, cos_sin_cache)`` returns ``(hidden, residual)``, both ``[T, H]``; the first
    layer gets ``residual=None`` (the residual stream starts as its input).

    ``fused_gemv`` (default: ``KVPILOT_FUSED_GEMV``) routes the projections through the fused
    GEMV dispatchers (module docstring); a plain attribute, so benchmarks may flip it.
    ``reduce_fp32`` (default: ``KVPILOT_TP_REDUCE_FP32``) goes to the attention and MLP blocks.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, pc: ParallelContext,
                 fused_gemv: Optional[bool] = None, reduce_fp32: Optional[bool] = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, pc, reduce_fp32)
        self.mlp = LlamaMLP(cfg, pc, reduce_fp32)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fused_gemv = fused_gemv_enabled() if fused_gemv is None else fused_gemv

    def forward(self, positions, hidden, residual, meta, kv_cache, cos_sin_cache):
        if self.fused_gemv:
            return self._forward_fused(positions, hidden, residual, meta, kv_cache, cos_sin_cache)
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta, kv_cache, cos_sin_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def _forward_fused(self, positions, hidden, residual, meta, kv_cache, cos_sin_cache):
        attn, mlp = self.self_attn, self.mlp
        ln, qkv_proj = self.input_layernorm, attn.qkv_proj
        if residual is None:
            residual = hidden
            qkv = KG.rmsnorm_gemv(hidden, None, ln.weight, ln.eps, qkv_proj.weight, qkv_proj.bias)
        else:
            qkv, residual = KG.rmsnorm_gemv(hidden, residual, ln.weight, ln.eps, qkv_proj.weight, qkv_proj.bias)
        hidden = attn.attend(positions, qkv, meta, kv_cache, cos_sin_cache, fused_gemv=True)
        ln, gate_up_proj = self.post_attention_layernorm, mlp.gate_up_proj
        gate_up, residual = KG.rmsnorm_gemv(hidden, residual, ln.weight, ln.eps, gate_up_proj.weight,
                                            gate_up_proj.bias)
        return mlp.down(gate_up, fused_gemv=True), residual


class LlamaForCausalLM(nn.Module):
    """Llama decoder over a paged KV cache.

    ``forward(input_ids [T] int64, positions [T] int64, meta, kv_caches)`` returns the final hidden
    states ``[T, hidden]``; ``compute_logits(hidden [S, hidden])`` returns ``[S, vocab]`` float32
    (gathered over tensor-parallel ranks). ``kv_caches[l]`` is ``[2, num_blocks, block_size,
    num_kv_heads_per_rank, head_dim]``.

    ``tp_invariant`` (``KVPILOT_TP_INVARIANT``, read once here; 0 = off) and ``invariant_shards``
    (shards per rank when the layers are `tp_invariant.InvariantDecoderLayer`s, else 0).
    ``lm_head_shards``: the per-shard LM head matrices when a rank holds several shards, else None
    (with tied embeddings on a stage that also embeds, ``embed_tokens`` reads its rows from them:
    `tp_invariant.InvariantTiedEmbedding`).

    Raises:
        ValueError: a tensor-parallel size or ``KVPILOT_TP_INVARIANT`` the model does not split into.
    """

    def __init__(self, cfg: ModelConfig, pc: Optional[ParallelContext] = None,
                 layer_range: Optional[tuple[int, int]] = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.pc = pc or ParallelContext()
        # Pipeline stages own a contiguous range of layers; the first embeds, the last normalises.
        self.layer_range = layer_range or (0, cfg.num_hidden_layers)
        start, end = self.layer_range
        self.is_first = start == 0
        self.is_last = end == cfg.num_hidden_layers
        self.fused_gemv = fused_gemv_enabled()  # read once: KVPILOT_FUSED_GEMV
        self.tp_invariant = T = tp_invariant_size()  # read once: KVPILOT_TP_INVARIANT
        s = tp_invariant_shards(cfg, self.pc.tp_size, T) if T else 0
        # One shard per rank at TP <= 2 is the default model (t = T = 2: the two-rank all-reduce is
        # the invariant sum); otherwise the shard layers.
        self.invariant_shards = s if s > 1 or self.pc.tp_size > 2 else 0
        # read once: KVPILOT_TP_REDUCE_FP32 (ignored in tensor-parallel-invariant mode)
        self.tp_reduce_fp32 = tp_reduce_fp32_enabled() and not T
        lm_shards = self.is_last and s > 1
        self.lm_head_shards = None
        if lm_shards:  # a TP-T rank's padded [ceil(V / T), hidden] matrix per shard (registered first: names)
            self.lm_head_shards = nn.ParameterList(
                nn.Parameter(torch.empty(-(-cfg.vocab_size // T), cfg.hidden_size)) for _ in range(s))
        if lm_shards and cfg.tie_word_embeddings and self.is_first:  # rows looked up in the LM head shards
            self.embed_tokens = InvariantTiedEmbedding(self.lm_head_shards, self.pc, self.pc.tp_rank * s)
        else:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, self.pc) if (
                self.is_first or (self.is_last and cfg.tie_word_embeddings and not lm_shards)) else None
        if self.invariant_shards:
            self.layers = nn.ModuleList(InvariantDecoderLayer(cfg, i, self.pc, T, self.fused_gemv)
                                        for i in range(start, end))
        else:
            self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, self.pc, self.fused_gemv, self.tp_reduce_fp32)
                                        for i in range(start, end))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.is_last else None
        self.lm_head = None
        if self.is_last and not lm_shards and not cfg.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(-(-cfg.vocab_size // self.pc.tp_size), cfg.hidden_size))
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)

    def set_rope_cache(self, cache: torch.Tensor) -> None:
        self.cos_sin_cache = cache

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches,
                hidden: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None):
        if self.is_first:
            hidden = self.embed_tokens(input_ids)
        for layer, kv in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, meta, kv, self.cos_sin_cache)
        if not self.is_last:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_shards is not None:  # tensor-parallel-invariant: a TP-T rank's product per shard
            logits = torch.cat([torch.matmul(hidden, w.t()).float() for w in self.lm_head_shards], dim=-1)
        else:
            weight = self.lm_head if self.lm_head is not None else self.embed_tokens.weight
            logits = torch.matmul(hidden, weight.t()).float()
        if self.pc.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.pc.tp_size)]
            dist.all_gather(parts, logits, group=self.pc.tp_group)
            logits = torch.cat(parts, dim=-1)
        return logits[..., : self.cfg.vocab_size]
