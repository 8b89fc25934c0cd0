"""CUDA graphs for decode-only steps (`DecodeGraphs`) and for steps with a prefill chunk (`PrefillGraphs`).

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
  asynchronous copy per step. Block tables come from the runner's persistent `HostBlockTables`
  (only new blocks are written per step, then one gather), so the host work per sequence is a few
  list reads, not a copy of its whole table.
- All graphs share one memory pool; outputs are written into static buffers (``logits`` [max_bs,
  vocab] float32 or ``hidden`` [max_bs, hidden]) so graphs of different sizes do not each keep
  their own output memory.

``lm_head_in_graph`` (default True, ``KVPILOT_LM_HEAD_IN_GRAPH=0`` to change) puts the final
projection inside the graph; measured on an H200 in docs/gpu_benchmarks.md.

Pipeline stages (`DecodeGraphs` of a `parallel_worker.StageRunner` whose model is one stage): a
stage's graph covers only its layers. A stage after the first reads the previous stage's
``(hidden, residual)`` from a static buffer (`DecodeGraphs.stage_input`), a stage before the last ends
at its own ``(hidden, residual)`` in a static buffer (`DecodeGraphs.stage_output`); both are
contiguous ``[2, b, hidden]`` views for padded batch ``b``, so the worker receives into and sends from
them directly. The last stage ends at the logits as above. The point-to-point sends and receives stay
outside the graphs (`parallel_worker.Worker.execute` issues them); tensor-parallel all-reduces of the
stage's layers are inside, as in the whole-model tensor-parallel graphs.

`PrefillGraphs` covers steps with at least one prefill chunk (alone or mixed with decodes) of up to
256 tokens by default (``KVPILOT_PREFILL_GRAPH_TOKENS``; at most ``max_num_tokens``), padded to a
token bucket (`default_token_buckets`, which says why 256); larger steps are GPU-bound for an 8B
model and run eagerly. Each bucket of ``T`` tokens has a fixed sequence count
``min(T, max_batch_size)``; padded tokens write no KV (slot ``-1``), padded sequences have empty query
ranges, and the prefill attention kernel's grid is a bound from these shapes (its programs find
their tile on the device). The graph ends at the final hidden states ``[T, hidden]`` in a static
buffer; the LM head then runs eagerly over the sampled rows only. Both kinds of graphs share one
memory pool, the prefill graphs (the larger) captured first (`capture_all`).
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from itertools import chain

import numpy as np
import torch

from kvpilot.model.layers import AttentionMetadata
from kvpilot.runner.batch import ScheduledSeq


logger = logging.getLogger(__name__)

_CONTEXT_BUCKETS = (2048, 8192, 32768)


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to and including ``max_batch_size`` (vLLM's capture list)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch_size] + list(range(8, max_batch_size, 8))
    return sorted(set(sizes + [max_batch_size]))


class _GraphSet:
    """Device hooks shared by the graph sets; a test subclass replaces them to run the host logic on CPU."""

    _needs_cuda = True

    def __init__(self, runner: "ModelRunner") -> None:
        if runner.device.type != "cuda" and self._needs_cuda:
            raise ValueError("CUDA graphs need a CUDA device")
        self.runner = runner
        self.graphs: dict = {}  # key -> graph with replay()
        self.capture_seconds = 0.0

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

    @staticmethod
    def _reserved_bytes() -> int:
        return torch.cuda.memory_reserved()

    def _body(self, *key) -> None:
        raise NotImplementedError

    def _capture_one(self, key: tuple, pool, stream) -> torch.cuda.CUDAGraph:
        # Warm up outside capture: Triton compiles on first launch, which a capture cannot contain.
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._body(*key)
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=stream):
            self._body(*key)
        return g


class DecodeGraphs(_GraphSet):
    """Captured decode graphs of one `ModelRunner` (CUDA only).

    Args:
        runner: a runner holding the whole model, or one pipeline stage of it (stage mode: see the
            module docstring; `load`, `replay`, `stage_input`, `stage_output` and `logits` are the
            worker's steps, `run` the whole-model one).
        batch_sizes: padded sizes to capture (default `default_batch_sizes(runner.max_batch_size)`).
        lm_head_in_graph: replay the LM head inside the graph (else it runs eagerly after it; last
            stage or whole model only).

    Attributes: ``is_first``/``is_last`` (the runner's model embeds / computes logits), ``out``: the
    static output (``[max_bs, vocab]`` float32 logits, ``[max_bs, hidden]`` without the LM head in the
    graph, or, before the last stage, ``[2 * max_bs * hidden]`` in the model's dtype, read through
    `stage_output`).
    """

    def __init__(self, runner: "ModelRunner", batch_sizes: list[int] | None = None,
                 lm_head_in_graph: bool | None = None) -> None:
        super().__init__(runner)
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
        self._h_tables = self._h32[self._o_tab:].reshape(self.max_bs, self.width)
        self._arange = np.arange(mb + 1)
        self.ids, self.pos, self.slots = (self._dev64[i * mb:(i + 1) * mb] for i in range(3))
        self.seq_lens = self._dev32[:mb]
        self.qsl = self._dev32[self._o_qsl:self._o_qsl + mb + 1]
        self.tables = self._dev32[self._o_tab:].view(self.max_bs, self.width)
        self.is_first, self.is_last = runner.model.is_first, runner.model.is_last
        H = cfg.hidden_size
        # Pipeline stages: flat buffers so that batch b's [2, b, H] view is contiguous (send/recv).
        self._acts_in = None if self.is_first else torch.zeros(2 * self.max_bs * H, dtype=runner.dtype, device=dev)
        if self.is_last:
            out_dim = cfg.vocab_size if lm_head_in_graph else cfg.hidden_size
            out_dtype = torch.float32 if lm_head_in_graph else runner.dtype
            self.out = torch.zeros(self.max_bs, out_dim, dtype=out_dtype, device=dev)
        else:
            self.out = torch.zeros(2 * self.max_bs * H, dtype=runner.dtype, device=dev)
        self.graphs: dict[tuple[int, int], object] = {}  # (batch, context bound) -> graph with replay()
        self.buckets: dict[int, list[int]] = {}

    # ---- capture -----------------------------------------------------------------------------
    def _context_buckets(self, batch: int) -> list[int]:
        top = self.runner.max_seq_len
        # One split: buckets change nothing. (The attention kernels' KV-head count: one shard's in
        # tensor-parallel-invariant mode, model_runner.launch_kv_heads.)
        heads = getattr(self.runner, "launch_kv_heads", self.runner.num_kv_heads)
        if 2 * self._num_sms() <= batch * heads:
            return [top]
        return [c for c in _CONTEXT_BUCKETS if c < top] + [top]

    def plan_buckets(self) -> None:
        """Fill ``buckets`` (context buckets per batch size); `capture` calls it first."""
        for b in self.batch_sizes:
            self.buckets[b] = self._context_buckets(b)

    def stage_input(self, b: int) -> torch.Tensor:
        """The static buffer a stage after the first reads: ``[2, b, hidden]`` (hidden, residual) in the
        model's dtype, contiguous; the previous stage's activations for padded batch ``b`` go here.

        Raises:
            ValueError: the first stage (it reads token ids).
        """
        if self._acts_in is None:
            raise ValueError("the first pipeline stage has no activation input")
        return self._acts_in[:2 * b * self.runner.cfg.hidden_size].view(2, b, -1)

    def stage_output(self, b: int) -> torch.Tensor:
        """The static buffer a stage before the last writes: ``[2, b, hidden]`` (hidden, residual) in
        the model's dtype, contiguous, valid until the next replay; padded rows hold garbage.

        Raises:
            ValueError: the last stage (it ends at the logits).
        """
        if self.is_last:
            raise ValueError("the last pipeline stage ends at the logits, not at activations")
        return self.out[:2 * b * self.runner.cfg.hidden_size].view(2, b, -1)

    def _body(self, b: int, ctx: int) -> None:
        """The captured work: forward over the static inputs, output into the static buffer."""
        r = self.runner
        meta = AttentionMetadata(slot_mapping=self.slots[:b], block_tables=self.tables[:b],
                                 seq_lens=self.seq_lens[:b], query_start_loc=self.qsl[:b + 1],
                                 max_query_len=1, max_seq_len=ctx)
        if not (self.is_first and self.is_last):
            self._stage_body(b, meta)
            return
        hidden = r.model(self.ids[:b], self.pos[:b], meta, r.kv_caches)
        if self.lm_head_in_graph:
            self.out[:b].copy_(r.model.compute_logits(hidden))
        else:
            self.out[:b].copy_(hidden)

    def _stage_body(self, b: int, meta: AttentionMetadata) -> None:
        r = self.runner
        hidden = residual = None
        if not self.is_first:
            hidden, residual = self.stage_input(b).unbind(0)
        out = r.model(self.ids[:b], self.pos[:b], meta, r.kv_caches, hidden, residual)
        if not self.is_last:
            dst = self.stage_output(b)
            dst[0].copy_(out[0])
            dst[1].copy_(out[1])
        elif self.lm_head_in_graph:
            self.out[:b].copy_(r.model.compute_logits(out))
        else:
            self.out[:b].copy_(out)

    @torch.inference_mode()
    def capture(self, pool=None, stream=None) -> None:
        """Capture every (batch size, context bucket) graph, largest first so smaller ones reuse its pool.

        ``pool``/``stream``: a graph memory pool and capture stream shared with other graph sets
        (default: new ones).
        """
        t0 = time.perf_counter()
        mb = self._mb
        # Dummy inputs: padding rows everywhere (no KV write, nothing attended).
        self._h64[:] = 0
        self._h64[2 * mb:3 * mb] = -1
        self._h32[:] = 0
        self._dev64.copy_(self._host64)
        self._dev32.copy_(self._host32)
        if pool is None:
            pool, stream = self._capture_resources()
        self.plan_buckets()
        for b in reversed(self.batch_sizes):
            for ctx in reversed(self.buckets[b]):
                self.graphs[(b, ctx)] = self._capture_one((b, ctx), pool, stream)
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
        b = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        ctx = next(c for c in self.buckets[b] if c >= max_ctx)
        return b, ctx

    def prepare(self, seqs: list["ScheduledSeq"]) -> tuple[int, int]:
        """Fill the host buffers for these decodes (CPU work only; waits for the previous step's
        copy to have read them). Returns the graph to replay: (padded batch size, context bucket).

        Raises:
            ValueError: a sequence is longer than ``max_seq_len`` (no graph covers it).
        """
        r = self.runner
        n = len(seqs)
        mb, B = self._mb, r.block_size
        h64, h32 = self._h64, self._h32
        self._copied.synchronize()  # the previous step's copy has read the host buffers
        ids = h64[:n]
        pos = h64[mb:mb + n]
        ids[:] = [s.token_ids[0] for s in seqs]
        pos[:] = [s.start_pos for s in seqs]
        max_ctx = int(pos.max()) + 1
        if max_ctx > r.max_seq_len:
            raise ValueError(f"sequence of {max_ctx} tokens exceeds max_seq_len {r.max_seq_len}")
        tables = self._h_tables
        r.block_tables.gather(seqs, tables)
        b, ctx = self._pick(n, max_ctx)
        arange = self._arange
        h64[2 * mb:2 * mb + n] = tables[arange[:n], pos // B].astype(np.int64) * B + pos % B
        h32[:n] = pos + 1
        qsl = h32[self._o_qsl:self._o_qsl + mb + 1]
        qsl[:n + 1] = arange[:n + 1]
        if b > n:  # padding rows: no KV write, empty query range
            h64[2 * mb + n:2 * mb + b] = -1
            h64[n:b] = 0
            h64[mb + n:mb + b] = 0
            h32[n:b] = 0
            qsl[n + 1:b + 1] = n
        return b, ctx

    def load(self, seqs: list["ScheduledSeq"]) -> tuple[int, int]:
        """`prepare`, then queue the copy of the inputs into the static device buffers. Returns the
        graph to replay: (padded batch size, context bucket).

        Raises:
            ValueError: a sequence is longer than ``max_seq_len`` (no graph covers it).
        """
        b, ctx = self.prepare(seqs)
        # One copy per section; the block tables only for the rows in use.
        self._dev64.copy_(self._host64, non_blocking=True)
        end32 = self._o_tab + b * self.width
        self._dev32[:end32].copy_(self._host32[:end32], non_blocking=True)
        self._copied.record()
        return b, ctx

    def replay(self, key: tuple[int, int]) -> None:
        """Replay the graph ``key`` (from `load`) on the current stream."""
        self.graphs[key].replay()

    def logits(self, n: int) -> torch.Tensor:
        """Logits [n, vocab] float32 of the last replay's first ``n`` rows (last stage or whole model):
        a view of the static buffer, valid until the next replay, unless the LM head runs outside
        the graph (then it runs here, a new tensor)."""
        if self.lm_head_in_graph:
            return self.out[:n]
        return self.runner.model.compute_logits(self.out[:n])

    def run(self, seqs: list["ScheduledSeq"], fix_inputs=None) -> torch.Tensor:
        """Replay the graph for these decodes (whole model). Returns logits [n, vocab] float32 (a view
        of a static buffer, valid until the next replay). ``fix_inputs(ids)``, if given, runs after
        the inputs' copy is queued and before the replay, with the static input ids (int64 [max_bs]
        on the device) to overwrite on the device (async scheduling's in-flight ids).

        Raises:
            ValueError: a sequence is longer than ``max_seq_len`` (no graph covers it).
        """
        n = len(seqs)
        key = self.load(seqs)
        if fix_inputs is not None:
            fix_inputs(self.ids)
        self.replay(key)
        return self.logits(n)


DEFAULT_PREFILL_GRAPH_TOKENS = 256


def default_token_buckets(max_num_tokens: int, cap: int = DEFAULT_PREFILL_GRAPH_TOKENS) -> list[int]:
    """Padded token counts of the prefill graphs: 16, 32, 64, 96, 128, every 32 to 512, every 64 beyond.

    The list stops at ``min(cap, max_num_tokens)``, which is always the last bucket. Below about 128
    tokens a step of an 8B model is bound by its weight read, so padding there is nearly free;
    above, GPU time grows with the tokens and padding costs in proportion (at most 32 tokens up to
    512, 64 beyond).

    Why ``cap`` defaults to 256 (Llama-3.1-8B shape, 32 layers, one H200, across four hosts;
    benchmarks/lab/gpu_mixed_graphs.py): a 256-token step took 7.6-7.9 ms from its graph against
    12-21 ms eagerly, and 64 tokens on a 4,000-token cached prefix 7.0 ms against 13-29 ms (eager time
    depends on the host CPU); but a 575-token mixed step is GPU-bound (about 17 ms either way,
    0.95-1.19x), and with graphs up to 1,024 tokens offline throughput at 256 concurrent requests
    (200 in / 200 out: steps of a few hundred tokens) was 2-5% lower than without them, the
    padding's cost. Smaller models and slower host CPUs move the break-even point up; raise the cap
    with ``KVPILOT_PREFILL_GRAPH_TOKENS`` there.
    """
    top = max(1, min(cap, max_num_tokens))
    sizes = [16, 32, 64, 96, *range(128, 513, 32), *range(576, max(cap, 576) + 1, 64)]
    return [t for t in sizes if t < top] + [top]


def prefill_graph_tokens() -> int:
    """``KVPILOT_PREFILL_GRAPH_TOKENS`` (default 256): the largest step, in tokens, a prefill graph covers.

    Raises:
        ValueError: the variable is not a positive integer.
    """
    raw = os.environ.get("KVPILOT_PREFILL_GRAPH_TOKENS", str(DEFAULT_PREFILL_GRAPH_TOKENS))
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"KVPILOT_PREFILL_GRAPH_TOKENS must be a positive integer, got {raw!r}")
    return int(raw)


class PrefillGraphs(_GraphSet):
    """Captured graphs of steps that prefill (a chunk of two or more tokens, maybe mixed with decodes).

    Bucket ``T`` runs a step of at most ``T`` tokens and ``min(T, max_batch_size)`` sequences (every
    sequence has at least one token, so any step of at most ``T`` tokens fits). Prompt-logprob steps
    (``all_logits``) run eagerly; speculative verification entries (``all_logits`` with ``verify``)
    replay the graphs, their logits taken at every position from the static hidden states.


    Args:
        runner: a single-process runner holding the whole model (not a pipeline stage).
        token_buckets: padded token counts to capture (default `default_token_buckets` up to
            `prefill_graph_tokens`).

    Raises:
        ValueError: not on CUDA (unless a test double), or a bad ``KVPILOT_PREFILL_GRAPH_TOKENS``.
    """

    def __init__(self, runner: "ModelRunner", token_buckets: list[int] | None = None) -> None:
        super().__init__(runner)
        self.token_buckets = sorted(set(token_buckets or default_token_buckets(runner.max_num_tokens,
                                                                                prefill_graph_tokens())))
        self.max_tokens = self.token_buckets[-1]
        self.max_seqs = self._seqs_for(self.max_tokens)
        self.width = W = runner.max_blocks_per_seq
        mt, ms = self.max_tokens, self.max_seqs
        # One pinned byte buffer mirrored on the device, one copy per step. Every part starts on a
        # 64-byte boundary (Triton specialises on 16-byte alignment); the block tables come last so
        # a step copies only the rows it uses.
        parts = (("ids", torch.int64, mt), ("pos", torch.int64, mt), ("slots", torch.int64, mt),
                 ("rows", torch.int64, mt), ("seq_lens", torch.int32, ms), ("qsl", torch.int32, ms + 1),
                 ("tables", torch.int32, ms * W))
        self._offsets, off = {}, 0
        for name, dtype, n in parts:
            self._offsets[name] = off
            off += -(-n * dtype.itemsize // 64) * 64
        self._host = self._host_buffer(off, torch.uint8)
        self._dev = torch.zeros(off, dtype=torch.uint8, device=runner.device)
        self._copied = self._new_event()
        self._h: dict[str, np.ndarray] = {}
        for name, dtype, n in parts:
            o = self._offsets[name]
            self._h[name] = self._host[o:o + n * dtype.itemsize].view(dtype).numpy()
            setattr(self, name, self._dev[o:o + n * dtype.itemsize].view(dtype))
        self.tables = self.tables.view(ms, W)
        self._h["tables"] = self._h["tables"].reshape(ms, W)
        self.hidden = torch.zeros(mt, runner.cfg.hidden_size, dtype=runner.dtype, device=runner.device)
        self.graphs: dict[int, object] = {}  # padded tokens -> graph with replay()

    def _seqs_for(self, tokens: int) -> int:
        return min(tokens, self.runner.max_batch_size)

    def _body(self, T: int) -> None:
        """The captured work: forward of ``T`` padded tokens into the static hidden-state buffer."""
        r = self.runner
        S = self._seqs_for(T)
        meta = AttentionMetadata(slot_mapping=self.slots[:T], block_tables=self.tables[:S],
                                 seq_lens=self.seq_lens[:S], query_start_loc=self.qsl[:S + 1],
                                 max_query_len=T, max_seq_len=r.max_seq_len)
        self.hidden[:T].copy_(r._forward(self.ids[:T], self.pos[:T], meta, r.kv_caches))

    @torch.inference_mode()
    def capture(self, pool=None, stream=None) -> None:
        """Capture every token bucket, largest first (see `DecodeGraphs.capture` for the arguments)."""
        t0 = time.perf_counter()
        h = self._h
        for a in h.values():
            a[...] = 0  # every sequence empty: nothing attended
        h["slots"][:] = -1  # no KV write
        self._dev.copy_(self._host)
        if pool is None:
            pool, stream = self._capture_resources()
        for T in reversed(self.token_buckets):
            self.graphs[T] = self._capture_one((T,), pool, stream)
        self._sync()
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d prefill CUDA graphs (%d..%d tokens) in %.1f s", len(self.graphs),
                    self.token_buckets[0], self.max_tokens, self.capture_seconds)

    # ---- replay ------------------------------------------------------------------------------
    def can_run(self, seqs: list["ScheduledSeq"]) -> bool:
        """True for a step with a chunk of two or more tokens (a prefill chunk or drafts to verify), at
        most ``max_tokens`` tokens and no prompt-logprob chunk (``all_logits`` without ``verify``)."""
        if not self.graphs or not seqs or len(seqs) > self.max_seqs:
            return False
        tokens, longest = 0, 0
        for s in seqs:
            if (s.all_logits and not s.verify) or len(s.block_table) > self.width:
                return False
            n = len(s.token_ids)
            tokens += n
            longest = max(longest, n)
        return longest > 1 and tokens <= self.max_tokens

    def prepare(self, seqs: list["ScheduledSeq"]) -> tuple[int, int, list[int]]:
        """Fill the host buffers for ``seqs``; returns (bucket T, real tokens, sampled rows)."""
        r = self.runner
        B, h = r.block_size, self._h
        n = len(seqs)
        qlens = np.fromiter((len(s.token_ids) for s in seqs), np.int64, n)
        starts = np.fromiter((s.start_pos for s in seqs), np.int64, n)
        real = int(qlens.sum())
        T = next(t for t in self.token_buckets if t >= real)
        S = self._seqs_for(T)
        self._copied.synchronize()  # the previous step's copy has read the host buffers
        qsl = np.zeros(n + 1, np.int64)
        np.cumsum(qlens, out=qsl[1:])
        h["qsl"][:n + 1] = qsl
        h["qsl"][n + 1:S + 1] = real  # padded sequences: empty query ranges
        h["seq_lens"][:n] = starts + qlens
        h["seq_lens"][n:S] = 0
        tables = h["tables"]
        r.block_tables.gather(seqs, tables)
        seq_of_tok = np.repeat(np.arange(n), qlens)
        pos = starts[seq_of_tok] + (np.arange(real) - qsl[:-1][seq_of_tok])
        h["ids"][:real] = np.fromiter(chain.from_iterable(s.token_ids for s in seqs), np.int64, real)
        h["pos"][:real] = pos
        h["slots"][:real] = tables[seq_of_tok, pos // B].astype(np.int64) * B + pos % B
        h["ids"][real:T] = 0
        h["pos"][real:T] = 0
        h["slots"][real:T] = -1  # padded tokens: no KV write
        rows = []
        for i, s in enumerate(seqs):
            if s.all_logits:  # a verification entry (`can_run`): every position
                rows.extend(range(int(qsl[i]), int(qsl[i + 1])))
            elif s.sample:
                rows.append(int(qsl[i + 1]) - 1)
        h["rows"][:len(rows)] = rows
        return T, real, rows

    def run(self, seqs: list["ScheduledSeq"], fix_inputs=None) -> tuple[torch.Tensor, list[int]]:
        """Replay the bucket for this step; returns (logits [R, vocab] float32, their flat-batch rows),
        as `ModelRunner.execute`. Call only when `can_run` said yes. ``fix_inputs``: as in
        `DecodeGraphs.run` (here the ids are int64 [max_tokens], in flat token order)."""
        T, _, rows = self.prepare(seqs)
        n = len(seqs)
        end = self._offsets["tables"] + n * self.width * 4  # block tables of the rows in use only
        self._dev[:end].copy_(self._host[:end], non_blocking=True)
        self._copied.record()
        if fix_inputs is not None:
            fix_inputs(self.ids)
        self.graphs[T].replay()
        model = self.runner.model
        if not rows:
            return torch.empty(0, self.runner.cfg.vocab_size, device=self.runner.device), []
        return model.compute_logits(self.hidden.index_select(0, self.rows[:len(rows)])), rows


def capture_all(runner: "ModelRunner", prefill: bool = True, decode_cls: type = DecodeGraphs,
                prefill_cls: type = PrefillGraphs) -> tuple[DecodeGraphs | None, PrefillGraphs | None]:
    """Capture the prefill graphs (if ``prefill``), then the decode graphs, into one memory pool.

    Returns (decode graphs, prefill graphs); either is ``None`` when its capture failed, which is
    logged as a warning (those steps then run eagerly). After a failed prefill capture the decode
    graphs get a fresh pool. ``decode_cls``/``prefill_cls`` let tests substitute CPU doubles.
    """
    pool, stream = decode_cls._capture_resources()
    reserved = decode_cls._reserved_bytes()
    pg = dg = None
    if prefill:
        try:
            pg = prefill_cls(runner)
            pg.capture(pool, stream)
        except Exception:  # noqa: BLE001 - serve eagerly rather than not at all
            logger.warning("prefill CUDA graph capture failed; prefill and mixed steps will run eagerly",
                           exc_info=True)
            pg = None
            decode_cls._sync()
            pool, stream = decode_cls._capture_resources()
    try:
        dg = decode_cls(runner)
        dg.capture(pool, stream)
    except Exception:  # noqa: BLE001
        logger.warning("decode CUDA graph capture failed; decode steps will run eagerly", exc_info=True)
        dg = None
    logger.info("CUDA graphs: %d decode + %d prefill in %.1f s, %.0f MB of device memory (pool and buffers)",
                len(dg.graphs) if dg else 0, len(pg.graphs) if pg else 0,
                (dg.capture_seconds if dg else 0) + (pg.capture_seconds if pg else 0),
                (decode_cls._reserved_bytes() - reserved) / 1e6)
    return dg, pg
