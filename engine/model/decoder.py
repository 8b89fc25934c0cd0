"""A generic decoder-only causal LM over a paged KV cache, built from a per-family `FamilySpec`.

Every supported family (`kvpilot.model.registry`) is this model with its own spec: which attention
options each layer has (`AttentionOptions`: biases, q/k norm, sliding window, soft cap, scale, rope
table), which MLP fills each layer's ``mlp`` slot (`FamilySpec.build_mlp`, a `GatedMLP` today, an
MoE block later), the norm layout (pre-norm, or Gemma's pre + post "sandwich" norms), RMSNorm's
``(1 + w)`` variant, embedding scaling, the final logit soft cap, its rope tables, and how fused
checkpoint tensors split (`FamilySpec.split_checkpoint_tensor`).

Shapes: the batch is ragged (all scheduled tokens of all sequences in one ``[T]`` stream); hidden
states are ``[T, hidden]``. Tensor parallelism: `kvpilot.model.linear`'s layers (Megatron-LM
layout), the embedding and LM head split by vocabulary (`VocabParallelEmbedding`); pipeline stages
own a contiguous ``layer_range``.

Decode fast path (``fused_gemv``, ``Tuning.fused_gemv``; `kvpilot.model.llama`'s docstring): a
pre-norm layer whose QKV and gate/up weights the fused GEMV kernels read, with a SiLU `GatedMLP`,
runs RMSNorm + QKV, ``o_proj``, RMSNorm + gate/up, SiLU + ``down_proj`` through
``kernels/gemv.py``'s dispatchers; an MoE layer fuses its attention the same way and then runs its
MoE block; other layers (Gemma's sandwich norms and GeGLU, quantized weights) take the unfused
modules. Both compute the same values on CPU.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from kvpilot.kernels import gemv as KG
from kvpilot.model.attention import Attention, AttentionOptions
from kvpilot.model.config import ModelConfig
from kvpilot.model.layers import AttentionMetadata, ParallelContext, RMSNorm, VocabParallelEmbedding
from kvpilot.model.mlp import GatedMLP
from kvpilot.model.quantization import (QuantizationMethod, UnquantizedLinearMethod, UnsupportedQuantizationError,
                                        apply_module_exclusions, get_quantization_method)
from kvpilot.model.rotary import RotaryEmbedding, rope_parameters
from kvpilot.tuning import Tuning


class FamilySpec:
    """What distinguishes one model family (module docstring). The defaults are Llama's."""

    #: RMSNorm offset: 0 (``w``) or 1 (Gemma's ``1 + w``)
    norm_offset: float = 0.0
    #: Gemma 2/3: norms after attention and MLP too (``pre_feedforward_layernorm`` /
    #: ``post_feedforward_layernorm``; ``post_attention_layernorm`` then normalises the attention output)
    sandwich_norms: bool = False
    #: multiply embeddings by ``sqrt(hidden_size)`` (Gemma)
    scale_embeddings: bool = False
    #: tensor-parallel-invariant shard layers exist for this family (`kvpilot.model.tp_invariant`)
    supports_tp_invariant: bool = False

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.raw = cfg.raw

    # -- attention -------------------------------------------------------------------------------
    def layer_type(self, layer_idx: int) -> str:
        """``"sliding_attention"`` or ``"full_attention"`` (the config's ``layer_types`` when given)."""
        types = self.raw.get("layer_types")
        if types:
            return types[layer_idx]
        return "sliding_attention" if self.raw.get("sliding_window") else "full_attention"

    def sliding_window(self, layer_idx: int) -> Optional[int]:
        if self.layer_type(layer_idx) != "sliding_attention":
            return None
        return self.raw.get("sliding_window") or None

    def rope_key(self, layer_idx: int) -> str:
        return "default"

    def attention_options(self, layer_idx: int) -> AttentionOptions:
        cfg = self.cfg
        return AttentionOptions(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                                sliding_window=self.sliding_window(layer_idx),
                                rotary_dim=self.rotary_embeddings()[self.rope_key(layer_idx)].rotary_dim,
                                rope_key=self.rope_key(layer_idx))

    def rotary_embeddings(self) -> dict[str, RotaryEmbedding]:
        """The model's rope tables by key (`AttentionOptions.rope_key`)."""
        return {"default": RotaryEmbedding(self.cfg.head_dim, rope_parameters(self.rope_source()),
                                           self.cfg.max_position_embeddings)}

    def rope_source(self) -> dict:
        """The config dict rope settings are read from (`ModelConfig`'s fields under ``raw``'s keys,
        so a config built in code without ``raw`` keeps its ``rope_theta`` / ``rope_scaling``)."""
        return {"rope_theta": self.cfg.rope_theta, "rope_scaling": self.cfg.rope_scaling, **self.raw}

    # -- MLP ---------------------------------------------------------------------------------------
    def activation(self) -> str:
        return self.raw.get("hidden_activation") or self.raw.get("hidden_act") or "silu"

    def build_mlp(self, layer_idx: int, pc: ParallelContext, reduce_fp32: bool,
                  quant_method: Optional[QuantizationMethod]) -> nn.Module:
        """The module in layer ``layer_idx``'s ``mlp`` slot (a `GatedMLP`; an MoE block overrides this)."""
        cfg = self.cfg
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, pc, cfg.mlp_bias, self.activation(), reduce_fp32,
                        quant_method)

    # -- logits, checkpoint ------------------------------------------------------------------------
    def final_logit_soft_cap(self) -> Optional[float]:
        return self.raw.get("final_logit_softcapping") or None

    def split_checkpoint_tensor(self, rest: str, tensor):
        """``[(name, tensor)]`` for one per-layer checkpoint tensor (``rest`` after ``model.layers.N.``):
        itself by default; a family with fused checkpoint tensors splits them into the q/k/v or
        gate/up names the loader knows (Phi-3)."""
        return [(rest, tensor)]


class DecoderLayer(nn.Module):
    """One decoder layer: ``forward(positions [T], hidden [T, H], residual [T, H] or None, meta,
    kv_cache, cos_sin_cache)`` returns ``(hidden, residual)``; the first layer gets ``residual=None``.

    Pre-norm (Llama): ``h = attn(norm1(x)); x += h; out = mlp(norm2(x))``. Sandwich (Gemma):
    ``h = post_attn_norm(attn(norm1(x))); x += h; out = post_ff_norm(mlp(pre_ff_norm(x)))``. The
    residual add is fused into the next RMSNorm (`kvpilot.kernels.rms_norm`). ``fused_gemv``: the
    decode fast path where the layer allows it (module docstring); a plain attribute.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, pc: ParallelContext, fused_gemv: bool = True,
                 reduce_fp32: bool = False, spec: Optional[FamilySpec] = None,
                 quant_method: Optional[QuantizationMethod] = None) -> None:
        super().__init__()
        spec = spec or FamilySpec(cfg)
        self.layer_idx = layer_idx
        self.self_attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                   layer_idx, pc, spec.attention_options(layer_idx), cfg.rms_norm_eps, reduce_fp32,
                                   quant_method)
        self.mlp = spec.build_mlp(layer_idx, pc, reduce_fp32, quant_method)
        off = spec.norm_offset
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, off)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, off)
        self.sandwich = spec.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, off)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, off)
        self.fused_gemv = fused_gemv
        # The fused GEMVs serve the attention of a pre-norm layer whose QKV weight they read, and
        # the MLP too when it is a SiLU `GatedMLP` (an MoE block runs its own kernels after them).
        self.can_fuse = not self.sandwich and self.self_attn.qkv_proj.quant_method.supports_fused_gemv
        self.can_fuse_mlp = self.can_fuse and getattr(self.mlp, "fusable", False)

    def forward(self, positions, hidden, residual, meta, kv_cache, cos_sin_cache):
        lora = self.self_attn.qkv_proj.lora  # a step with LoRA adapters takes the unfused modules
        if self.fused_gemv and self.can_fuse and (lora is None or not lora.active):
            return self._forward_fused(positions, hidden, residual, meta, kv_cache, cos_sin_cache)
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta, kv_cache, cos_sin_cache)
        if self.sandwich:
            hidden = self.post_attention_layernorm(hidden)
            hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
            return self.post_feedforward_layernorm(self.mlp(hidden)), residual
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
        if not self.can_fuse_mlp:  # e.g. an MoE block
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return mlp(hidden), residual
        ln, gate_up_proj = self.post_attention_layernorm, mlp.gate_up_proj
        gate_up, residual = KG.rmsnorm_gemv(hidden, residual, ln.weight, ln.eps, gate_up_proj.weight,
                                            gate_up_proj.bias)
        return mlp.down(gate_up, fused_gemv=True), residual


class CausalLM(nn.Module):
    """A decoder-only LM of family ``spec_cls`` over a paged KV cache.

    ``forward(input_ids [T] int64, positions [T] int64, meta, kv_caches)`` returns the final hidden
    states ``[T, hidden]`` (a pipeline stage that is not last: ``(hidden, residual)``);
    ``compute_logits(hidden [S, hidden])`` returns ``[S, vocab]`` float32, gathered over
    tensor-parallel ranks, soft-capped where the family says so. ``kv_caches[l]`` is ``[2,
    num_blocks, block_size, num_kv_heads_per_rank, head_dim]``. `init_rope` builds the cos/sin tables.

    Raises:
        ValueError: a tensor-parallel size the model does not split into; a quantization scheme,
            activation or rope type the engine lacks; ``Tuning.tp_invariant`` for a family without
            shard layers.
    """

    spec_cls: type[FamilySpec] = FamilySpec
    decoder_layer_cls: type[DecoderLayer] = DecoderLayer

    def __init__(self, cfg: ModelConfig, pc: Optional[ParallelContext] = None,
                 layer_range: Optional[tuple[int, int]] = None, tuning: Optional[Tuning] = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tuning = tuning = tuning or Tuning()
        self.pc = pc or ParallelContext()
        self.spec = self.spec_cls(cfg)
        self.layer_range = layer_range or (0, cfg.num_hidden_layers)
        start, end = self.layer_range
        self.is_first = start == 0
        self.is_last = end == cfg.num_hidden_layers
        self.fused_gemv = tuning.fused_gemv
        self.tp_invariant = 0
        self.invariant_shards = 0
        self.lm_head_shards = None
        self.tp_reduce_fp32 = tuning.tp_reduce_fp32
        self.quant_method = get_quantization_method(cfg.raw, getattr(cfg, "quantization", None))
        if tuning.tp_invariant and not isinstance(self.quant_method, UnquantizedLinearMethod):
            raise UnsupportedQuantizationError("Tuning.tp_invariant shard layers hold 16/32-bit weights only; "
                                               "leave it 0 for a quantized model")
        if not self.spec.supports_tp_invariant and tuning.tp_invariant:
            raise ValueError(f"Tuning.tp_invariant has shard layers for Llama only, not {cfg.architecture}; "
                             f"leave it 0 for this model")
        self._build_ends()
        self.layers = nn.ModuleList(self.build_layer(i) for i in range(start, end))
        apply_module_exclusions(self)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.spec.norm_offset) if self.is_last else None
        self.lm_head = None
        if self.is_last and self.lm_head_shards is None and not cfg.tie_word_embeddings:
            self.lm_head = nn.Parameter(torch.empty(-(-cfg.vocab_size // self.pc.tp_size), cfg.hidden_size))
        self.rotary = self.spec.rotary_embeddings()
        self.rope_caches: dict[str, torch.Tensor] = {}
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        self.logit_soft_cap = self.spec.final_logit_soft_cap()

    def _build_ends(self) -> None:
        cfg = self.cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, self.pc) if (
            self.is_first or (self.is_last and cfg.tie_word_embeddings)) else None

    def build_layer(self, layer_idx: int) -> nn.Module:
        return self.decoder_layer_cls(self.cfg, layer_idx, self.pc, self.fused_gemv, self.tp_reduce_fp32,
                                      self.spec, self.quant_method)

    def init_rope(self, max_positions: int, device=None) -> None:
        """Build every rope table of the model for positions ``[0, max_positions)`` on ``device``."""
        self.rope_caches = {key: rope.build_cache(max_positions, device) for key, rope in self.rotary.items()}
        self.cos_sin_cache = self.rope_caches["default"]

    def set_rope_cache(self, cache: torch.Tensor) -> None:
        """Install ``cache`` as the default rope table (families with one table)."""
        self.cos_sin_cache = cache
        self.rope_caches = {**self.rope_caches, "default": cache}

    def _rope_of(self, layer: nn.Module) -> torch.Tensor:
        opts = getattr(layer.self_attn, "opts", None)
        key = opts.rope_key if opts is not None else "default"
        return self.rope_caches.get(key, self.cos_sin_cache)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches,
                hidden: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None):
        if self.is_first:
            hidden = self.embed_tokens(input_ids)
            if self.spec.scale_embeddings:  # Gemma: the normaliser rounded to the model dtype first
                hidden = hidden * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=hidden.dtype)
        for layer, kv in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, meta, kv, self._rope_of(layer))
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
        logits = logits[..., : self.cfg.vocab_size]
        if self.logit_soft_cap:
            logits = torch.tanh(logits / self.logit_soft_cap) * self.logit_soft_cap
        return logits
