"""Layers every model family shares: batch metadata, the tensor-parallel context, RMSNorm, the
vocabulary-parallel embedding. Linear layers: `kvpilot.model.linear`; attention:
`kvpilot.model.attention`; MLPs: `kvpilot.model.mlp`; rotary tables: `kvpilot.model.rotary`.

Shapes: the batch is *ragged*: all scheduled tokens of all sequences are concatenated into one
``[num_tokens]`` stream; hidden states are ``[num_tokens, hidden_size]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from kvpilot import kernels as K


_HALF_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class AttentionMetadata:
    """Where the ragged batch's tokens belong. Integer tensors live on the model's device.

    slot_mapping: [num_tokens] int64, cache slot written by each token (-1 = padding).
    block_tables: [num_seqs, max_blocks] int32.
    seq_lens: [num_seqs] int32, context length after this step (cached + new tokens).
    query_start_loc: [num_seqs + 1] int32, cumulative new-token counts.
    max_query_len, max_seq_len: host ints, upper bounds for kernel grids.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int


@dataclass
class ParallelContext:
    """This process's place in the tensor-parallel group (rank 0 of 1 when not parallel).

    ``custom_all_reduce``: an object with ``fits(x, site) -> bool`` and ``all_reduce(x, site) -> x``
    (`kvpilot.engine.custom_all_reduce.CustomAllReduce`, the one-shot kernel of two GPUs) or None
    (NCCL / gloo only). Each row-parallel call site takes a site number from `new_site` when the
    model is built; the one-shot kernel keeps one receive buffer per site.
    """

    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Optional[object] = None
    custom_all_reduce: Optional[object] = None
    num_sites: int = 0

    def new_site(self) -> int:
        """A fresh all-reduce call-site number (0, 1, 2, ... in model-building order)."""
        self.num_sites += 1
        return self.num_sites - 1

    def all_reduce(self, x: torch.Tensor, site: Optional[int] = None) -> torch.Tensor:
        """Sum ``x`` over the tensor-parallel group in place (no-op with one rank); returns ``x``.

        With a ``site`` and a ``custom_all_reduce`` that takes ``x`` (small enough; every rank
        decides alike, from ``x``'s size) the one-shot kernel sums it; otherwise
        ``torch.distributed.all_reduce``.
        """
        if self.tp_size > 1:
            car = self.custom_all_reduce
            if car is not None and site is not None and car.fits(x, site):
                return car.all_reduce(x, site)
            dist.all_reduce(x, group=self.tp_group)
        return x

    def row_parallel(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], matmul,
                     reduce_fp32: bool, site: Optional[int] = None) -> torch.Tensor:
        """A row-parallel projection's output, summed over the tensor-parallel group.

        ``matmul(x, weight, bias, out_dtype)`` computes this rank's partial product ``[T, N]`` (e.g.
        :func:`kvpilot.kernels.gemv.gemv`); ``bias`` ``[N]`` is the layer's whole bias (every rank
        holds it) or None. With one rank: ``matmul(x, weight, bias, None)``. With ``reduce_fp32`` and
        a 16-bit ``x``: fp32 partials (no bias), an fp32 all-reduce, the bias added once in fp32, one
        rounding to ``x.dtype`` (module docstring). Otherwise rounded partials, rank 0's with the bias,
        summed in ``x.dtype``. ``site``: the call site's number for `all_reduce`. Returns ``[T, N]``
        in ``x.dtype``.

        Inside a CUDA graph capture the fp32 partial comes from the graph's memory pool like any
        other activation, so it is as static as the 16-bit one it replaces.
        """
        if self.tp_size == 1:
            return matmul(x, weight, bias, None)
        if reduce_fp32 and x.dtype in _HALF_DTYPES:
            part = matmul(x, weight, None, torch.float32)
            self.all_reduce(part, site)
            if bias is not None:
                part.add_(bias)
            return part.to(x.dtype)
        return self.all_reduce(matmul(x, weight, bias if self.tp_rank == 0 else None, None), site)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension of ``[T, hidden]`` (+ fused residual add: `kvpilot.kernels.rms_norm`).

    ``weight_offset`` 0 (Llama): ``w * bf16(x / rms(x))`` through the kernels. ``weight_offset`` 1
    (Gemma): ``x / rms(x) * (1 + w)`` computed in float32 and rounded once, as transformers'
    ``GemmaRMSNorm`` does (the checkpoint stores ``w``; `process_weights_after_loading` keeps
    ``1 + w`` in float32). Rounding the normalised input and ``1 + w`` to bf16 first, as the Llama
    kernel would, measurably raised the bf16 log-prob error of a random Gemma 3 above transformers'
    own (benchmarks/gpu_family_accuracy.py, CPU dry run: 7.5e-3 against 6.5e-3 mean; 6.0e-3 with
    this arithmetic). These norms run as PyTorch ops (several launches each on a GPU).
    """

    def __init__(self, hidden: int, eps: float, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps
        self.weight_offset = weight_offset
        self._scale: Optional[torch.Tensor] = None  # 1 + w in float32 (offset norms)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if not self.weight_offset:
            return K.rms_norm(x, self.weight, self.eps, residual)
        h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
        hf = h.float()
        scale = self._scale if self._scale is not None else self.weight.float() + self.weight_offset
        y = (hf * torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + self.eps) * scale).to(x.dtype)
        return y if residual is None else (y, h)

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        if self.weight_offset:
            self._scale = self.weight.float() + self.weight_offset


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows are split across tensor-parallel ranks (padded to a multiple of tp)."""

    def __init__(self, vocab_size: int, hidden: int, pc: ParallelContext) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // pc.tp_size)
        self.start = pc.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden))
        self.pc = pc
        self.ar_site = pc.new_site()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.pc.tp_size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local < 0) | (local >= self.per_rank)
        out = nn.functional.embedding(local.masked_fill(mask, 0), self.weight)
        out = out.masked_fill(mask.unsqueeze(-1), 0)
        return self.pc.all_reduce(out, self.ar_site)
