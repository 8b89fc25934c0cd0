"""The attention block every family shares: QKV projection, optional per-head q/k RMSNorm, rotary,
paged KV write, paged attention (optionally windowed and soft-capped), output projection.

Features by family (`AttentionOptions`): ``qkv_bias`` / ``o_bias`` (Qwen2: q/k/v biases only),
``qk_norm`` (Qwen3, Gemma 3: RMSNorm over each head's ``head_dim`` before rotary), ``sliding_window``
(Mistral, Gemma local layers: the query at position ``p`` attends keys in ``(p - window, p]``),
``logits_soft_cap`` (Gemma 2: scores become ``cap * tanh(scores / cap)`` before the softmax),
``scale`` (Gemma: ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``), partial rotary.

Kernels: every layer runs `kvpilot.kernels.rotary_decode_attention` for decode-only batches (one
launch at small batch sizes), else `rotary_write_kv_cache` + `paged_attention`; a window or cap goes
to them as the keywords ``sliding_window`` / ``logits_soft_cap`` (layers without either make
exactly the calls the Llama model always made). Partial rotary rotates the first ``rotary_dim``
features with `kvpilot.kernels.apply_rotary`, then writes the cache (`write_kv_cache`) and attends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from kvpilot import kernels as K
from kvpilot.kernels import gemv as KG
from kvpilot.model.layers import AttentionMetadata, ParallelContext, RMSNorm
from kvpilot.model.linear import QKVParallelLinear, RowParallelLinear
from kvpilot.model.quantization import QuantizationMethod


@dataclass(frozen=True)
class AttentionOptions:
    """One layer's attention settings (module docstring). ``scale`` None: ``head_dim ** -0.5``.
    ``rope_key``: which of the model's cos/sin tables the layer reads (e.g. ``"local"``)."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    qk_norm_offset: float = 0.0
    sliding_window: Optional[int] = None
    logits_soft_cap: Optional[float] = None
    scale: Optional[float] = None
    rotary_dim: Optional[int] = None
    rope_key: str = "default"


class Attention(nn.Module):
    """QKV (column parallel), [q/k norm], rotary, paged attention, ``o_proj`` (row parallel).

    ``forward(positions [T], hidden [T, hidden], meta, kv_cache [2, blocks, block, Hkv, D],
    cos_sin_cache [P, rotary_dim])`` -> ``[T, hidden]``. ``reduce_fp32``: the row-parallel fp32
    reduction switch.

    Raises:
        ValueError: a tensor-parallel size that does not split the heads.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 pc: ParallelContext, opts: AttentionOptions = AttentionOptions(), rms_norm_eps: float = 1e-6,
                 reduce_fp32: bool = False, quant_method: Optional[QuantizationMethod] = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.opts = opts
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, opts.qkv_bias, pc,
                                          quant_method)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.launch_kv_heads = self.num_kv_heads  # what attention's launch decisions assume
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.scale = opts.scale if opts.scale is not None else head_dim ** -0.5
        self.rotary_dim = opts.rotary_dim or head_dim
        if opts.qk_norm:
            self.q_norm = RMSNorm(head_dim, rms_norm_eps, opts.qk_norm_offset)
            self.k_norm = RMSNorm(head_dim, rms_norm_eps, opts.qk_norm_offset)
        self.o_proj = RowParallelLinear(self.q_size * pc.tp_size, hidden_size, opts.o_bias, pc, quant_method,
                                        reduce_fp32, what="num_attention_heads * head_dim")
        self.pc = pc

    @property
    def reduce_fp32(self) -> bool:
        return self.o_proj.reduce_fp32

    @reduce_fp32.setter
    def reduce_fp32(self, value: bool) -> None:
        self.o_proj.reduce_fp32 = value

    def forward(self, positions, hidden, meta: AttentionMetadata, kv_cache, cos_sin_cache):
        return self.attend(positions, self.qkv_proj(hidden), meta, kv_cache, cos_sin_cache)

    def attend(self, positions, qkv, meta: AttentionMetadata, kv_cache, cos_sin_cache,
               fused_gemv: bool = False) -> torch.Tensor:
        """Attention after the QKV projection: ``qkv`` ``[T, q_size + 2 * kv_size]`` (this rank's heads)
        -> ``[T, hidden]`` in ``qkv``'s dtype. ``fused_gemv`` runs ``o_proj`` through
        `kvpilot.kernels.gemv.gemv` (module docstring of `kvpilot.model.llama`)."""
        n = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.opts.qk_norm:
            q = self.q_norm(q.reshape(-1, self.head_dim)).reshape(n, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).reshape(n, self.num_kv_heads, self.head_dim)
        out = self._paged(positions, q, k, v, meta, kv_cache, cos_sin_cache)
        return self.o_proj(out.reshape(n, self.q_size), fused=KG.gemv if fused_gemv else None)

    def _paged(self, positions, q, k, v, meta: AttentionMetadata, kv_cache, cos_sin_cache) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        window, cap = self.opts.sliding_window, self.opts.logits_soft_cap
        features = {"sliding_window": window, "logits_soft_cap": cap} if window or cap else {}
        if self.rotary_dim != self.head_dim:
            q, k = self._rotate_partial(positions, q, k, cos_sin_cache)
            K.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
            return K.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                     self.scale, meta.max_query_len, meta.max_seq_len, **features)
        if meta.max_query_len == 1:  # decode-only: one launch at small batch (kernels.rotary_decode_attention)
            return K.rotary_decode_attention(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping,
                                             meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale,
                                             meta.max_seq_len, **features)
        # One launch: rotates q (in place on CUDA), writes rotated k and v to their slots.
        q = K.rotary_write_kv_cache(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping)
        return K.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                 self.scale, meta.max_query_len, meta.max_seq_len, **features)

    def _rotate_partial(self, positions, q, k, cos_sin_cache):
        r = self.rotary_dim
        qr, kr = K.apply_rotary(q[..., :r].contiguous(), k[..., :r].contiguous(), positions, cos_sin_cache)
        return torch.cat([qr, q[..., r:]], dim=-1), torch.cat([kr, k[..., r:]], dim=-1).contiguous()
