"""CUDA graphs for decode-only steps (one new token per sequence), captured at padded batch sizes.

A decode step of a large model at small batch is dozens of small kernels per layer; launching them
one by one from Python costs more than the GPU needs to run them. Each graph here replays the whole
forward pass (and, by default, the LM head) of a fixed padded batch size from static input buffers,
as vLLM and TensorRT-LLM do:

- Batch sizes: 1, 2, 4, then every 8 up to ``max_batch_size`` (vLLM's default list). A step with
  ``n`` sequences replays the smallest captured size ``b >= n``; rows ``n..b`` are padding: slot
  ``-1`` (no KV write), a query range of length 0 (the attention kernels skip it).
- Context buckets: the decode attention kernel splits long contexts over several programs (flash
  decoding) and its grid is fixed at capture time from an upper bound of the context length. For
  batches small enough to use more than one split, graphs are captured per context bucket
  (2k, 8k, 32k tokens and ``max_seq_len``) so a short context is not split for the longest one.
- Inputs live in one pinned host buffer mirrored by one device buffer (token ids, positions, slots
  as int64; sequence lengths, query offsets and block tables as int32) and go over in one
  asynchronous copy per step.
- All graphs share one memory pool; outputs are written into static buffers (``logits`` [max_bs,
  vocab] float32 or ``hidden`` [max_bs, hidden]) so graphs of different sizes do not each keep
  their own output memory.

``lm_head_in_graph`` (default True, ``KVPILOT_LM_HEAD_IN_GRAPH=0`` to change) puts the final
projection inside the graph; measured on an H200 in docs/gpu_benchmarks.md.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from .llama import AttentionMetadata

if TYPE_CHECKING:  # pragma: no cover
    from .model_runner import ModelRunner, ScheduledSeq

logger = logging.getLogger(__name__)

_CONTEXT_BUCKETS = (2048, 8192, 32768)


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to and including ``max_batch_size`` (vLLM's capture list)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch_size] + list(range(8, max_batch_size, 8))
    return sorted(set(sizes + [max_batch_size]))


class DecodeGraphs:
    """Captured decode graphs of one `ModelRunner` (CUDA only).

    Args:
        runner: a single-process runner holding the whole model (not a pipeline stage).
        batch_sizes: padded sizes to capture (default `default_batch_sizes(runner.max_batch_size)`).
        lm_head_in_graph: replay the LM head inside the graph (else it runs eagerly after it).
    """

    def __init__(self, runner: "ModelRunner", batch_sizes: list[int] | None = None,
                 lm_head_in_graph: bool | None = None) -> None:
        if runner.device.type != "cuda" and self._needs_cuda:
            raise ValueError("CUDA graphs need a CUDA device")
        self.runner = runner
        self.batch_sizes = sorted(batch_sizes or default_batch_sizes(runner.max_batch_size))
        if lm_head_in_graph is None:
            lm_head_in_graph = os.environ.get("KVPILOT_LM_HEAD_IN_GRAPH", "1") not in ("0", "false", "False")
        self.lm_head_in_graph = lm_head_in_graph
        self.max_bs = self.batch_sizes[-1]
        self.width = runner.max_blocks_per_seq
        dev = runner.device
        cfg = runner.cfg
        mb = self.max_bs
        # int64 section: ids | positions | slots; int32 section: seq_lens | qsl | block tables, each
        # part starting on a 64-byte boundary (Triton specialises kernels on 16-byte alignment).
        mb = -(-mb // 16) * 16
        self._mb = mb
        self._o_qsl = mb
        self._o_tab = mb + -(-(mb + 1) // 16) * 16
        self._n64 = 3 * mb
        self._n32 = self._o_tab + self.max_bs * self.width
        self._host64 = self._host_buffer(self._n64, torch.int64)
        self._host32 = self._host_buffer(self._n32, torch.int32)
        self._dev64 = torch.zeros(self._n64, dtype=torch.int64, device=dev)
        self._dev32 = torch.zeros(self._n32, dtype=torch.int32, device=dev)
        self._h64 = self._host64.numpy()
        self._h32 = self._host32.numpy()
        self._copied = self._new_event()
        self.ids, self.pos, self.slots = (self._dev64[i * mb:(i + 1) * mb] for i in range(3))
        self.seq_lens = self._dev32[:mb]
        self.qsl = self._dev32[self._o_qsl:self._o_qsl + mb + 1]
        self.tables = self._dev32[self._o_tab:].view(self.max_bs, self.width)
        out_dim = cfg.vocab_size if lm_head_in_graph else cfg.hidden_size
        out_dtype = torch.float32 if lm_head_in_graph else runner.dtype
        self.out = torch.zeros(self.max_bs, out_dim, dtype=out_dtype, device=dev)
        self.graphs: dict[tuple[int, int], object] = {}  # (batch, context bound) -> graph with replay()
        self.buckets: dict[int, list[int]] = {}
        self.capture_seconds = 0.0

    # ---- device hooks (a test subclass replaces these to run the host logic on CPU) -----------------
    _needs_cuda = True

    @staticmethod
    def _host_buffer(n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, pin_memory=True)

    @staticmethod
    def _new_event():
        return torch.cuda.Event()

    def _num_sms(self) -> int:
        return torch.cuda.get_device_properties(self.runner.device).multi_processor_count

    @staticmethod
    def _capture_resources():
        return torch.cuda.graph_pool_handle(), torch.cuda.Stream()

    @staticmethod
    def _sync() -> None:
        torch.cuda.synchronize()

    def _capture_one(self, b: int, ctx: int, pool, stream) -> torch.cuda.CUDAGraph:
        # Warm up outside capture: Triton compiles on first launch, which a capture cannot contain.
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._body(b, ctx)
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=stream):
            self._body(b, ctx)
        return g

    # ---- capture -----------------------------------------------------------------------------
    def _context_buckets(self, batch: int) -> list[int]:
        top = self.runner.max_seq_len
        if 2 * self._num_sms() <= batch * self.runner.num_kv_heads:  # one split: buckets change nothing
            return [top]
        return [c for c in _CONTEXT_BUCKETS if c < top] + [top]

    def _body(self, b: int, ctx: int) -> None:
        """The captured work: forward over the static inputs, output into the static buffer."""
        r = self.runner
        meta = AttentionMetadata(slot_mapping=self.slots[:b], block_tables=self.tables[:b],
                                 seq_lens=self.seq_lens[:b], query_start_loc=self.qsl[:b + 1],
                                 max_query_len=1, max_seq_len=ctx)
        hidden = r.model(self.ids[:b], self.pos[:b], meta, r.kv_caches)
        if self.lm_head_in_graph:
            self.out[:b].copy_(r.model.compute_logits(hidden))
        else:
            self.out[:b].copy_(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (batch size, context bucket) graph, largest first so smaller ones reuse its pool."""
        t0 = time.perf_counter()
        mb = self._mb
        # Dummy inputs: padding rows everywhere (no KV write, nothing attended).
        self._h64[:] = 0
        self._h64[2 * mb:3 * mb] = -1
        self._h32[:] = 0
        self._dev64.copy_(self._host64)
        self._dev32.copy_(self._host32)
        pool, stream = self._capture_resources()
        for b in reversed(self.batch_sizes):
            self.buckets[b] = self._context_buckets(b)
            for ctx in reversed(self.buckets[b]):
                self.graphs[(b, ctx)] = self._capture_one(b, ctx, pool, stream)
        self._sync()
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d decode CUDA graphs (batch sizes %d..%d, lm head %s graph) in %.1f s",
                    len(self.graphs), self.batch_sizes[0], self.max_bs, "in" if self.lm_head_in_graph else "outside",
                    self.capture_seconds)

    # ---- replay ------------------------------------------------------------------------------
    def can_run(self, seqs: list["ScheduledSeq"]) -> bool:
        """True for a decode-only step (one token each, logits of it only) that fits a captured size."""
        if not self.graphs or not seqs or len(seqs) > self.max_bs:
            return False
        for s in seqs:
            if len(s.token_ids) != 1 or not s.sample or s.all_logits:
                return False
        return True

    def _pick(self, n: int, max_ctx: int) -> tuple[int, int]:
        b = next(x for x in self.batch_sizes if x >= n)
        ctx = next(c for c in self.buckets[b] if c >= max_ctx)
        return b, ctx

    def run(self, seqs: list["ScheduledSeq"]) -> torch.Tensor:
        """Replay the graph for these decodes. Returns logits [n, vocab] float32 (a view of a static
        buffer, valid until the next replay).

        Raises:
            ValueError: a sequence is longer than ``max_seq_len`` (no graph covers it).
        """
        r = self.runner
        n = len(seqs)
        mb, B, W = self._mb, r.block_size, self.width
        o_qsl, o_tab = self._o_qsl, self._o_tab
        h64, h32 = self._h64, self._h32
        self._copied.synchronize()  # the previous step's copy has read the host buffers
        ids = h64[:n]
        pos = h64[mb:mb + n]
        ids[:] = [s.token_ids[0] for s in seqs]
        pos[:] = [s.start_pos for s in seqs]
        max_ctx = int(pos.max()) + 1
        if max_ctx > r.max_seq_len:
            raise ValueError(f"sequence of {max_ctx} tokens exceeds max_seq_len {r.max_seq_len}")
        tables = h32[o_tab:o_tab + n * W].reshape(n, W)
        for i, s in enumerate(seqs):
            bt = s.block_table
            tables[i, :len(bt)] = bt
        b, ctx = self._pick(n, max_ctx)
        rows = np.arange(n)
        h64[2 * mb:2 * mb + n] = tables[rows, pos // B].astype(np.int64) * B + pos % B
        h32[:n] = pos + 1
        qsl = h32[o_qsl:o_qsl + mb + 1]
        qsl[:n + 1] = np.arange(n + 1)
        if b > n:  # padding rows: no KV write, empty query range
            h64[2 * mb + n:2 * mb + b] = -1
            h64[n:b] = 0
            h64[mb + n:mb + b] = 0
            h32[n:b] = 0
            qsl[n + 1:b + 1] = n
        # One copy per section; the block tables only for the rows in use.
        self._dev64.copy_(self._host64, non_blocking=True)
        end32 = o_tab + b * W
        self._dev32[:end32].copy_(self._host32[:end32], non_blocking=True)
        self._copied.record()
        self.graphs[(b, ctx)].replay()
        if self.lm_head_in_graph:
            return self.out[:n]
        return r.model.compute_logits(self.out[:n])
