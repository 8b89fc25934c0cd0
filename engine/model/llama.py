"""The Llama architecture: `kvpilot.model.decoder.CausalLM` with Llama's spec (pre-norm, SwiGLU,
rope default/linear/llama3/...), plus the tensor-parallel-invariant shard layers only Llama has.

Shapes: the batch is *ragged*: all scheduled tokens of all sequences are concatenated into one
``[num_tokens]`` stream (prefill chunks and decode tokens together); `AttentionMetadata` says where
each sequence starts, how long its context is, and which cache slot each token writes. Hidden
states are ``[num_tokens, hidden_size]``.

Tensor parallelism (Megatron-LM layout): QKV and gate/up projections are split by output features
(column parallel), the attention output and down projections by input features (row parallel, one
all-reduce each), the embedding and LM head by vocabulary. With ``tp_size == 1`` it is the plain
model. When ``tp_size`` exceeds the KV head count, KV heads are replicated across ranks.

Fused decode GEMVs (``Tuning.fused_gemv``, default 1, read once when the model is built): each
decoder layer runs its four matrix products through the dispatchers of ``kernels/gemv.py``:
input RMSNorm (+ residual add) and QKV as ``rmsnorm_gemv``, ``o_proj`` as ``gemv``, the
post-attention RMSNorm and gate/up as ``rmsnorm_gemv``, SiLU-and-mul and ``down_proj`` as
``silu_mul_gemv``. They launch one Triton kernel for CUDA batches of at most
``FUSED_MAX_ROWS[op]`` tokens (batch-1 decode: about 0.23 ms per Llama-3.1-8B step on an H200 in
benchmarks/lab/gpu_gemv.py) and otherwise run exactly the unfused ops, so CPU runs and larger batches
compute the same values either way. The ``nn.Linear`` modules stay (weight names, loading and
tensor-parallel sharding are unchanged); only their forward is bypassed. ``Tuning(fused_gemv=False)``
restores the unfused module calls.

Row-parallel reduction in float32 (``Tuning(tp_reduce_fp32=True)``; default 0, read once when the model is
built; tensor parallelism with a 16-bit model only): one GPU rounds ``o_proj``'s and ``down_proj``'s
fp32 accumulation to the model dtype once. Summing per-rank partial products that were each rounded
to bf16, in a bf16 all-reduce, would round twice more per projection, and on random-weight models
that moved logits by ~0.1 nat. So each rank keeps its partial product in fp32 (the GEMM's
or fused GEMV's accumulator, ``out_dtype=torch.float32``), the all-reduce sums fp32, the bias is
added once in fp32 after it, and the sum is rounded once to the model dtype: then the residual add
of the next RMSNorm sees what one GPU sees, up to the fp32 summation order. The cost: each
all-reduce moves twice the bytes (``4 * tokens * hidden`` instead of ``2 *``: 16 KB per reduction
at batch 1 for hidden 4096, latency-bound), plus one cast kernel per reduction (and one bias add on
models with biases). Measured on two H200s (BENCHMARKS.md, Llama-3.1-8B shape,
random weights, 8 prompts x 64 greedy tokens): against one GPU the mean logprob difference fell from
4.4e-2 to 3.6e-2 and the max from 0.156 to 0.125, but no prompt became identical (the rest is fp32
summation order: cuBLAS algorithms for the halved matrices, attention's context splits over fewer
KV heads), and batch-1 ITL rose 0.9%; prefill all-reduces would move twice the bytes. So it is off
by default, like vLLM's and TensorRT-LLM's bf16 all-reduce: the bf16 all-reduce of rounded partials
(tensor-parallel rank 0 adds the bias inside its GEMM). Every rank holds the whole
bias of a row-parallel layer (`weights.load_weights`); it is added exactly once either way.

Tensor-parallel-invariant mode (``Tuning(tp_invariant=T)``, default off): the layers of
`kvpilot.model.tp_invariant` (`InvariantDecoderLayer`) replace the default ones when the model is built;
see that module.
"""

from __future__ import annotations

from typing import Optional

from torch import nn
import torch
import torch.distributed as dist  # noqa: F401  (the group ops ParallelContext calls)

from kvpilot.model.attention import Attention, AttentionOptions
from kvpilot.model.config import ModelConfig
from kvpilot.model.decoder import CausalLM, DecoderLayer, FamilySpec
from kvpilot.model.layers import AttentionMetadata, ParallelContext, RMSNorm, VocabParallelEmbedding  # noqa: F401
from kvpilot.model.mlp import GatedMLP
from kvpilot.model.tp_invariant import InvariantDecoderLayer, InvariantTiedEmbedding, tp_invariant_shards


class LlamaSpec(FamilySpec):
    """Llama (and the Llama-shaped checkpoints of other vendors): the `FamilySpec` defaults."""

    supports_tp_invariant = True

    def sliding_window(self, layer_idx: int):
        return None  # Llama configs carry no window


class LlamaAttention(Attention):
    """`Attention` with a Llama config's shapes: q/k/v and ``o_proj`` biases per ``attention_bias``;
    ``reduce_fp32`` (`Tuning.tp_reduce_fp32`) is `ParallelContext.row_parallel`'s switch."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, pc: ParallelContext, reduce_fp32: bool = False) -> None:
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, layer_idx,
                         pc, AttentionOptions(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias),
                         cfg.rms_norm_eps, reduce_fp32)


class LlamaMLP(GatedMLP):
    """SwiGLU `GatedMLP` with a Llama config's shapes (biases per ``mlp_bias``)."""

    def __init__(self, cfg: ModelConfig, pc: ParallelContext, reduce_fp32: bool = False) -> None:
        super().__init__(cfg.hidden_size, cfg.intermediate_size, pc, cfg.mlp_bias, "silu", reduce_fp32)


class LlamaDecoderLayer(DecoderLayer):
    """`DecoderLayer` with `LlamaSpec` (pre-norm). ``fused_gemv`` (`Tuning.fused_gemv`),
    ``reduce_fp32`` (`Tuning.tp_reduce_fp32`): as there."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, pc: ParallelContext, fused_gemv: bool = True,
                 reduce_fp32: bool = False, spec: Optional[FamilySpec] = None,
                 quant_method=None) -> None:
        super().__init__(cfg, layer_idx, pc, fused_gemv, reduce_fp32, spec or LlamaSpec(cfg), quant_method)


class LlamaForCausalLM(CausalLM):
    """Llama decoder over a paged KV cache (`CausalLM`), with the tensor-parallel-invariant mode.

    ``tp_invariant`` (`Tuning.tp_invariant`; 0 = off) and ``invariant_shards``
    (shards per rank when the layers are `tp_invariant.InvariantDecoderLayer`s, else 0).
    ``lm_head_shards``: the per-shard LM head matrices when a rank holds several shards, else None
    (with tied embeddings on a stage that also embeds, ``embed_tokens`` reads its rows from them:
    `tp_invariant.InvariantTiedEmbedding`).

    Raises:
        ValueError: a tensor-parallel size or ``Tuning.tp_invariant`` the model does not split into.
    """

    spec_cls = LlamaSpec
    decoder_layer_cls = LlamaDecoderLayer

    def _build_ends(self) -> None:
        cfg = self.cfg
        self.tp_invariant = T = self.tuning.tp_invariant
        s = tp_invariant_shards(cfg, self.pc.tp_size, T) if T else 0
        # One shard per rank at TP <= 2 is the default model (t = T = 2: the two-rank all-reduce is
        # the invariant sum); otherwise the shard layers.
        self.invariant_shards = s if s > 1 or self.pc.tp_size > 2 else 0
        # Tuning.tp_reduce_fp32 is ignored in tensor-parallel-invariant mode
        self.tp_reduce_fp32 = self.tp_reduce_fp32 and not T
        lm_shards = self.is_last and s > 1
        if lm_shards:  # a TP-T rank's padded [ceil(V / T), hidden] matrix per shard (registered first: names)
            self.lm_head_shards = nn.ParameterList(
                nn.Parameter(torch.empty(-(-cfg.vocab_size // T), cfg.hidden_size)) for _ in range(s))
        if lm_shards and cfg.tie_word_embeddings and self.is_first:  # rows looked up in the LM head shards
            self.embed_tokens = InvariantTiedEmbedding(self.lm_head_shards, self.pc, self.pc.tp_rank * s)
        else:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, self.pc) if (
                self.is_first or (self.is_last and cfg.tie_word_embeddings and not lm_shards)) else None

    def build_layer(self, layer_idx: int) -> nn.Module:
        if self.invariant_shards:
            return InvariantDecoderLayer(self.cfg, layer_idx, self.pc, self.tp_invariant, self.fused_gemv)
        return super().build_layer(layer_idx)
