"""The worker side of tensor x pipeline parallelism: one process per rank, each a model shard.

Rank layout (Megatron-LM / vLLM order): ``rank = pp_rank * tp_size + tp_rank``, so the ranks of one
pipeline stage are consecutive and, on a multi-GPU node, share the node's fastest links. Each rank
runs a `StageRunner` (a `ModelRunner` holding only its stage's layers and its tensor-parallel
shard of them) and, every step, the same plan (``list[ScheduledSeq]``) as every other rank.

Pipeline stages exchange ``(hidden, residual)`` of shape ``[2, num_tokens, hidden_size]`` with
``torch.distributed`` point-to-point sends between equal tensor-parallel ranks of neighbouring
stages. A step's plan is cut into up to ``pp_size`` micro-batches of whole sequences, so stage 0
computes micro-batch 1 while stage 1 computes micro-batch 0 (GPipe-style filling within a step).

Only the output rank (tensor-parallel rank 0 of the last stage) returns logits to the front end.

CUDA graphs: with ``P == 1`` the runner's own decode graphs run (every tensor-parallel rank captures
the same ones). With ``P > 1`` each stage captures `cuda_graphs.DecodeGraphs` of its own layers
(stage mode) and every decode-only micro-batch that fits replays one at its padded batch size: a
stage after the first receives the previous stage's ``[2, b, hidden]`` activations straight into the
graph's static input buffer, a stage before the last sends from the graph's static output buffer;
the sends and receives stay outside the graphs. Every rank takes the same graph-or-eager decision for
a micro-batch (the plan and the batch sizes are the same everywhere), so the padded shapes of a send
and its receive agree. Steps with a prefill chunk run eagerly. See `rank_graphs_enabled` for the
switches.

Same shapes as one GPU: one GPU replays prefill steps of up to 256 tokens from graphs
captured at padded token counts, so on CUDA every rank pads such eager steps the same way
(`model_runner.prefill_padding`; off where one GPU would not graph them: ``Tuning(cuda_graphs=False)``,
``Tuning(prefill_graphs=False)``). Pipeline stages then run the same kernels at the same shapes as one GPU
on their layers, and a request alone in the engine gets one GPU's greedy tokens. With several
requests in a step, micro-batching (``Tuning.pp_microbatch``, default 1) cuts the step into smaller
batches than one GPU runs, so their shapes, and so the bf16 rounding of their matrix products, can
still differ from one GPU's; ``Tuning(pp_microbatch=False)`` keeps whole steps. A micro-batch is padded
(to its own bucket) only when one GPU would pad the whole step: where one GPU runs a step eagerly
(more tokens or sequences than its largest graph, prompt logprobs) padding its micro-batches would
only add compute.
"""

from __future__ import annotations

import logging
import os
import pickle
import statistics
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from kvpilot.config import KvCacheConfig
from kvpilot import envs

from kvpilot.model.config import ModelConfig
from kvpilot.parallel.custom_all_reduce import CustomAllReduce
from kvpilot.model.llama import ParallelContext
from kvpilot.runner.model_runner import ModelRunner, ScheduledSeq, prefill_padding
from kvpilot.tuning import Tuning

logger = logging.getLogger(__name__)

# Messages on the front-end <-> worker pipe (pickled tuples; logits travel as raw bytes after a header).
MSG_READY = "ready"
MSG_OK = "ok"
MSG_ERROR = "error"
MSG_TIMING = "timing"

# How the output rank hands a step's logits to the front end (the third field of a "step" message).
LOGITS_PIPE = 0  # raw float32 bytes on the pipe
LOGITS_SYNC = 1  # the shared CUDA buffer, answered after the worker's stream finished
LOGITS_EVENT = 2  # the shared CUDA buffer, answered after launch; the front end waits on an IPC event

# Asynchronous tensor-parallel steps (`MultiprocExecutor.defers_logits`): a "step" message's fourth
# field is None (a settled plan) or (kind, broadcast, ids, event handle), see `InputSync`.
MSG_GO = "go"
# ("ids", list[int], redrawn rows): the ids of a step the output rank chose itself (arg-max or its own
# sampler, `Worker.own_step`), sent once they exist; redrawn rows: those its sampler drew again on
# the host (they were -1 in its ids buffer, which the next step may have read).
MSG_IDS = "ids"
SYNC_EVENT = 1  # the sampled ids are published: the output rank's stream waits on the front end's event
SYNC_GO = 2  # the output rank first waits for ("go", ids or None): the ids are published after this plan
SYNC_SELF = 3  # the ids are the output rank's own choice of the previous step (arg-max or its sampler)


class StopRequested(Exception):
    """The front end stopped the engine while the output rank waited for a step's sampled ids."""


def rank_graphs_enabled(tp_size: int, pipelined: bool, tuning: Tuning) -> bool:
    """Whether a worker rank captures decode CUDA graphs (on a CUDA device).

    ``tuning.cuda_graphs`` False turns off every graph; ``tuning.tp_cuda_graphs`` False the graphs
    of ranks holding a tensor-parallel shard (``tp_size > 1``: TP and TP x PP);
    ``tuning.pp_cuda_graphs`` False those of pipeline stages (``pipelined``: ``P > 1``).
    """
    if not tuning.cuda_graphs:
        return False
    if tp_size > 1 and not tuning.tp_cuda_graphs:
        return False
    return not (pipelined and not tuning.pp_cuda_graphs)


def single_gpu_prefill_buckets(max_num_tokens: int, tuning: Tuning) -> Optional[list[int]]:
    """The padded token counts of the prefill graphs one GPU captures at ``max_num_tokens`` (CUDA)
    with ``tuning``, or None when it captures none (``tuning.cuda_graphs`` or
    ``tuning.prefill_graphs`` False)."""
    from kvpilot.runner.cuda_graphs import default_token_buckets

    if not (tuning.cuda_graphs and tuning.prefill_graphs):
        return None
    return default_token_buckets(max_num_tokens, tuning.prefill_graph_tokens)


def pipe_spin_seconds(device: str, tuning: Tuning) -> float:
    """How long a wait on a pipe polls before it sleeps in ``select`` (`Tuning.pipe_spin_us`).

    Default 1000 us on GPUs (a step's answer usually comes sooner than that, and a sleeping process
    takes tens of microseconds to wake), 0 on CPU (spinning ranks would steal the cores the others
    compute on).
    """
    us = tuning.pipe_spin_us
    if us is None:
        us = 1000.0 if device.startswith("cuda") else 0.0
    return us * 1e-6


def go_spin_seconds(device: str, tuning: Tuning) -> float:
    """How long the output rank polls for a step's sampled ids (`InputSync`) before it sleeps
    (`Tuning.go_spin_us`). Default 50,000 us on GPUs: the ids come one forward pass after the plan
    (a few milliseconds), and waking a sleeping process would add tens of microseconds to every
    step; 0 on CPU."""
    us = tuning.go_spin_us
    if us is None:
        us = 50_000.0 if device.startswith("cuda") else 0.0
    return us * 1e-6


def spin_poll(conn, seconds: float) -> bool:
    """Poll ``conn`` without sleeping for up to ``seconds``; True when data is ready."""
    if seconds <= 0:
        return False
    end = time.perf_counter() + seconds
    while True:
        if conn.poll(0):
            return True
        if time.perf_counter() >= end:
            return False


class StepTimer:
    """Durations of named step phases (kept in milliseconds, the last ``keep`` of each).

    `summary` gives ``{phase: {"n", "mean_ms", "median_ms"}}`` in the order phases were first added.
    """

    def __init__(self, keep: int = 100_000) -> None:
        self.keep = keep
        self.samples: dict[str, deque] = {}

    def add(self, phase: str, seconds: float) -> None:
        q = self.samples.get(phase)
        if q is None:
            q = self.samples[phase] = deque(maxlen=self.keep)
        q.append(seconds * 1e3)

    def reset(self) -> None:
        self.samples.clear()

    def summary(self) -> dict[str, dict[str, float]]:
        return {k: {"n": len(v), "mean_ms": statistics.fmean(v), "median_ms": statistics.median(v)}
                for k, v in self.samples.items() if v}


# ---- plans on the pipe ---------------------------------------------------------------------------
# A plan travels as a list of plain tuples (pickling dataclass instances costs ~7x more: 0.5 ms at
# 256 sequences) and block tables as deltas: `PlanEncoder` remembers, per sequence of the previous
# plan, the list object it sent and its length; when the same list has only grown (the contract
# `HostBlockTables` relies on) only the new entries go. `PlanDecoder` keeps one list per sequence and
# extends it in place, so the worker's `HostBlockTables` sees the same list grow and writes only new
# entries (an unpickled fresh list every step would rewrite every row). Both sides keep exactly the
# sequences of the last plan, so they stay in step without any other message.
_BT_FULL = 0
_BT_APPEND = 1


class PlanEncoder:
    """Front-end half of the plan encoding (see the comment above)."""

    def __init__(self) -> None:
        self._sent: dict[int, tuple[list, int]] = {}

    def encode(self, plan: list[ScheduledSeq]) -> list[tuple]:
        """``plan`` -> list of ``(seq_id, token_ids, start_pos, mode, blocks, sample, all_logits,
        inflight_row, verify, lora)``; ``lora`` is the sequence's `LoRARequest` (not the adapter's tensors:
        each rank loads its own copy on first use) or None."""
        sent = self._sent
        out, now = [], {}
        for s in plan:
            bt = s.block_table
            m = len(bt)
            prev = sent.get(s.seq_id)
            lora = s.lora.request if s.lora is not None else None
            if prev is not None and prev[0] is bt and m >= prev[1] and s.seq_id not in now:
                out.append((s.seq_id, s.token_ids, s.start_pos, _BT_APPEND, bt[prev[1]:], s.sample, s.all_logits,
                            s.inflight_row, s.verify, lora))
            else:
                out.append((s.seq_id, s.token_ids, s.start_pos, _BT_FULL, bt, s.sample, s.all_logits,
                            s.inflight_row, s.verify, lora))
            now[s.seq_id] = (bt, m)
        self._sent = now
        return out


class PlanDecoder:
    """Worker half of the plan encoding: encoded tuples -> ``list[ScheduledSeq]``.

    Raises:
        KeyError: an append for a sequence the decoder does not hold (encoder and decoder out of step).
    """

    def __init__(self, adapter_of=None) -> None:
        self._tables: dict[int, list[int]] = {}
        #: `LoRARequest` -> this rank's loaded `LoRAAdapter` (`Worker.lora_cache`'s ``get``)
        self.adapter_of = adapter_of

    def decode(self, encoded: list[tuple]) -> list[ScheduledSeq]:
        tables = self._tables
        plan, now = [], {}
        for seq_id, toks, start, mode, blocks, sample, all_logits, inflight_row, verify, lora in encoded:
            if mode == _BT_APPEND:
                bt = tables[seq_id]
                if blocks:
                    bt.extend(blocks)
            else:
                bt = list(blocks)
            now[seq_id] = bt
            plan.append(ScheduledSeq(seq_id, toks, start, bt, sample, all_logits=all_logits, inflight_row=inflight_row,
                                     verify=verify, lora=None if lora is None else self.adapter_of(lora)))
        self._tables = now
        return plan


# ---- sampling rows on the pipe ------------------------------------------------------------------
# A step the output rank samples itself carries one (seq_id, step, record) per logits row: the
# front end's `SamplingRow.record` bytes, sent only when the output rank does not hold that
# sequence's record from the previous such step (else None), and the row's output position. Both
# sides keep exactly the sequences of the last such step, as `PlanEncoder` / `PlanDecoder` do.


class RowEncoder:
    """Front-end half of the sampling-row encoding (see the comment above)."""

    def __init__(self) -> None:
        self._sent: dict[int, bytes] = {}

    def encode(self, rows: list[tuple[int, int, bytes]]) -> list[tuple]:
        """``rows`` (seq_id, step, record) -> list of (seq_id, step, record or None)."""
        sent = self._sent
        out, now = [], {}
        for seq_id, step, rec in rows:
            prev = sent.get(seq_id)
            out.append((seq_id, step, None if prev is not None and (prev is rec or prev == rec) else rec))
            now[seq_id] = rec
        self._sent = now
        return out


class RowDecoder:
    """Worker half of the sampling-row encoding: encoded tuples -> ``list[SamplingRow]``, one per
    logits row, each sequence's row object kept across steps (only its ``step`` changes).

    Raises:
        KeyError: a row without a record for a sequence the decoder does not hold (out of step).
        ValueError: a record that needs more than its scalars (`SamplingRow.from_record`).
    """

    def __init__(self) -> None:
        self._rows: dict = {}

    def decode(self, encoded: list[tuple]) -> list:
        from kvpilot.sampling.sampler_inputs import SamplingRow

        rows = self._rows
        out, now = [], {}
        for seq_id, step, rec in encoded:
            row = rows[seq_id] if rec is None else SamplingRow.from_record(rec)
            row.step = step
            now[seq_id] = row
            out.append(row)
        self._rows = now
        return out


def stage_layers(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` layer ranges of the pipeline stages; earlier stages take the remainder.

    5 layers over 2 stages -> ``[(0, 3), (3, 5)]``.

    Raises:
        ValueError: more stages than layers.
    """
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size {pp_size} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    out, start = [], 0
    for s in range(pp_size):
        end = start + base + (1 if s < extra else 0)
        out.append((start, end))
        start = end
    return out


def all_reduce_sites(layer_range: tuple[int, int]) -> int:
    """All-reduce call sites a stage of ``layer_range`` (``(start, end)`` layer indices) may have
    (`ParallelContext.new_site`): one per row-parallel layer (``o_proj``, ``down_proj``), plus the
    vocabulary-parallel embedding's (counted on every stage: a later stage with tied embeddings
    holds one as its LM head, whose site is never reduced)."""
    return 2 * (layer_range[1] - layer_range[0]) + 1


def one_shot_everywhere(worker: Worker) -> bool:
    """Whether every rank of the world, on every node, may sum its tensor-parallel all-reduces with
    the one-shot kernel (`engine.custom_all_reduce`): collective over the default group (every rank
    calls it once, after `Worker` is built). A node's front end hears only its own node's ranks, so a
    rank's own flag would not tell it about the stages on other pods of a LeaderWorkerSet group."""
    mine = worker.runner.model.pc.custom_all_reduce is not None
    flag = torch.tensor([int(mine)], dtype=torch.int64, device=worker.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def check_same_invariant_size(worker: Worker) -> None:
    """Raise ValueError unless every rank of the world, on every node, built its model with the same
    ``Tuning.tp_invariant`` (engine/model/tp_invariant.py): ranks that disagree would pair an all-gather
    with an all-reduce. Collective over the default group, once, after `Worker` is built (pods of a
    LeaderWorkerSet group build their `Tuning` from their own ``KVPILOT_TUNING``)."""
    size = int(getattr(worker.runner.model, "tp_invariant", 0))
    span = torch.tensor([size, -size], dtype=torch.int64, device=worker.device)
    dist.all_reduce(span, op=dist.ReduceOp.MIN)
    low, high = int(span[0].item()), -int(span[1].item())
    if low != high:
        raise ValueError(f"ranks disagree on Tuning.tp_invariant: values from {low} to {high} "
                         f"(this rank: {size}); set the same KVPILOT_TUNING on every pod")


def split_microbatches(plan: list[ScheduledSeq], parts: int) -> list[list[ScheduledSeq]]:
    """Cut ``plan`` into at most ``parts`` contiguous, non-empty runs of sequences with balanced token counts.

    Contiguity keeps the logits rows in plan order when the micro-batches' outputs are concatenated.
    """
    if parts <= 1 or len(plan) <= 1:
        return [plan]
    parts = min(parts, len(plan))
    total = sum(len(s.token_ids) for s in plan)
    out: list[list[ScheduledSeq]] = [[]]
    done = 0
    for i, s in enumerate(plan):
        left_seqs = len(plan) - i
        left_parts = parts - len(out)
        # Close the current micro-batch once it holds its share, keeping one sequence per remaining part.
        if out[-1] and left_parts > 0 and (done >= total * len(out) / parts or left_seqs <= left_parts):
            out.append([])
        out[-1].append(s)
        done += len(s.token_ids)
    return out


@dataclass
class WorkerSpec:
    """Everything a worker process needs to build its shard (plain, picklable data)."""

    model_dir: str
    cfg: ModelConfig
    kv_config: KvCacheConfig
    max_num_tokens: int
    max_batch_size: int
    max_seq_len: int
    device: str  # "cpu" or "cuda" (each rank then takes cuda:<local rank>)
    dtype: str
    tp_size: int
    pp_size: int
    init_method: str  # tcp://host:port of the rendezvous
    ranks_per_node: int  # world size on one node (== world size unless a LeaderWorkerSet group)
    multi_node: bool  # plans reach non-leader ranks by broadcast, logits return through rank 0
    timeout_s: float
    tuning: Tuning = field(default_factory=Tuning)
    log_level: int = logging.WARNING
    lora_config: Optional[Any] = None  # `kvpilot.lora.config.LoraConfig`

    @property
    def microbatching(self) -> bool:
        """Pipeline stages cut a step into micro-batches (`Tuning.pp_microbatch`)."""
        return self.tuning.pp_microbatch

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size


class StageRunner(ModelRunner):
    """A `ModelRunner` for one pipeline stage's layers and one tensor-parallel shard of them.

    The base class's profiling pass feeds token ids; a stage after the first takes activations
    instead, so `_forward` gives it zeros of the right shape when it has none.

    On CUDA it captures decode graphs (``graphs``, a `DecodeGraphs`, in stage mode for a pipeline
    stage) after the KV pool is sized, from the memory the pool leaves (`rank_graphs_enabled`), and
    pads eager prefill steps as one GPU's prefill graphs would (``prefill_pad_buckets``, module
    docstring).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The base runner captures graphs only for the whole, unsplit model. Every TP rank of a stage
        # builds its runner at the same time, so all capture the same graphs, NCCL calls included;
        # with TP a failed capture fails the worker (and so the engine) rather than leaving peers
        # waiting in a collective. Without TP a stage's graphs hold no collective: a failed capture
        # leaves this rank eager and `Worker` makes every rank follow (its start-up all-reduce).
        whole = self.model.is_first and self.model.is_last
        tp = self.model.pc.tp_size
        if self.device.type == "cuda" and self.prefill_graphs is None:
            self.prefill_pad_buckets = single_gpu_prefill_buckets(self.max_num_tokens, self.tuning)
        if (self.graphs is None and self.device.type == "cuda" and (tp > 1 or not whole)  # else the base's
                and rank_graphs_enabled(tp, not whole, self.tuning)):
            from kvpilot.runner.cuda_graphs import DecodeGraphs, capture_all

            if tp == 1:
                self.graphs, _ = capture_all(self, prefill=False)
            else:
                reserved = torch.cuda.memory_reserved()
                self.graphs = DecodeGraphs(self)
                self.graphs.capture()
                logger.info("captured %d decode CUDA graphs (%s, TP %d) in %.1f s, %.0f MB of device memory",
                            len(self.graphs.graphs), "whole model" if whole else f"layers {self.model.layer_range}",
                            tp, self.graphs.capture_seconds, (torch.cuda.memory_reserved() - reserved) / 1e6)

    def _forward(self, ids, pos, meta, caches, hidden=None, residual=None):
        if hidden is None and not self.model.is_first:
            shape = (ids.shape[0], self.cfg.hidden_size)
            hidden = torch.zeros(shape, dtype=self.dtype, device=self.device)
            residual = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return super()._forward(ids, pos, meta, caches, hidden, residual)


class InputSync:
    """The input-id hand-over of one asynchronous tensor-parallel step (one pipeline stage).

    The front end plans step N+1 before it has sampled step N (`engine_core`'s async scheduling), so
    the plan's in-flight rows carry placeholders. The output rank (tensor-parallel rank 0, on the
    front end's GPU) owns ``tok_buf``, an int64 buffer the front end writes the sampled ids into
    (CUDA IPC) before recording its interprocess event; on CPU the ids come as a list in a message.
    `wrap` turns the runner's in-flight fix-up (`ModelRunner._inflight_fix`, reading ``tok_buf``)
    into: wait for the ids (``SYNC_GO``: the ("go", ids) message, read from the pipe, answering
    step-timing requests meanwhile; then, on CUDA, the stream waits on the front end's event, as with
    ``SYNC_EVENT``), fix the ids, and, with ``broadcast``, send the input ids from rank 0 to every
    rank of the group (the others receive them into their own input ids). Waiting for the event also
    orders this step's logits write after the front end's sampler has read the previous ones out of
    the shared logits buffer.
    """

    def __init__(self, worker: "Worker", kind: int, broadcast: bool, ids: Optional[list[int]], conn) -> None:
        self.worker = worker
        self.kind = kind
        self.broadcast = broadcast
        self.ids = ids
        self.conn = conn

    def wrap(self, fix):
        """The ``fix_inputs(ids)`` callable for this step (``fix``: the runner's, or None)."""
        worker = self.worker

        def run(ids: torch.Tensor) -> None:
            if worker.is_output:
                self._await_ids()
            if fix is not None:
                fix(ids)
            if self.broadcast:
                group = worker.runner.model.pc.tp_group
                dist.broadcast(ids, src=worker.pp_rank * worker.spec.tp_size, group=group)
        return run

    def _await_ids(self) -> None:
        worker = self.worker
        ids = self.ids
        if self.kind == SYNC_SELF:
            return  # ``tok_buf`` holds them, written on this stream after the previous step
        if self.kind == SYNC_GO:
            ids = worker.wait_go(self.conn)
        if ids is not None:
            if ids:
                worker.tok_buf[:len(ids)].copy_(torch.tensor(ids, dtype=torch.int64))
        elif worker.tok_event is not None:
            torch.cuda.current_stream().wait_event(worker.tok_event)
        else:
            raise RuntimeError("an asynchronous step's sampled ids came without ids or an event")


class Worker:
    """One rank: process groups, its `StageRunner`, and the per-step stage computation."""

    def __init__(self, rank: int, spec: WorkerSpec) -> None:
        self.rank = rank
        self.spec = spec
        self.pp_rank, self.tp_rank = divmod(rank, spec.tp_size)
        self.local_rank = rank % spec.ranks_per_node
        on_gpu = spec.device.startswith("cuda")
        if on_gpu:
            torch.cuda.set_device(self.local_rank)
            self.device = f"cuda:{self.local_rank}"
        else:
            self.device = "cpu"
            if envs.external("OMP_NUM_THREADS") is None:
                # Ranks share the host's cores; oversubscribed intra-op threads slow each collective ~5x.
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.ranks_per_node))
        backend = "nccl" if on_gpu else "gloo"
        timeout = timedelta(seconds=spec.timeout_s)
        dist.init_process_group(backend, init_method=spec.init_method, rank=rank, world_size=spec.world_size,
                                timeout=timeout)
        # Every rank must create every group, in the same order.
        tp_group = None
        if spec.tp_size > 1:
            for s in range(spec.pp_size):
                g = dist.new_group(list(range(s * spec.tp_size, (s + 1) * spec.tp_size)))
                if s == self.pp_rank:
                    tp_group = g
        self.ctrl_group = dist.new_group(backend="gloo", timeout=timeout) if (spec.multi_node and on_gpu) else None
        pc = ParallelContext(self.tp_rank, spec.tp_size, tp_group)
        layer_range = stage_layers(spec.cfg.num_hidden_layers, spec.pp_size)[self.pp_rank]
        if on_gpu and spec.tp_size == 2 and spec.ranks_per_node % spec.tp_size == 0:
            # Before the model (its layers take site numbers) and before the KV cache is sized.
            pc.custom_all_reduce = CustomAllReduce.create(tp_group, self.tp_rank, spec.tp_size, self.device,
                                                          all_reduce_sites(layer_range), spec.cfg.hidden_size,
                                                          spec.tuning.tp_custom_allreduce,
                                                          spec.tuning.tp_custom_allreduce_max_tokens)
        self.runner = StageRunner(Path(spec.model_dir), spec.cfg, spec.kv_config, spec.max_num_tokens,
                                  spec.max_batch_size, spec.max_seq_len, device=self.device, dtype=spec.dtype,
                                  pc=pc, layer_range=layer_range, lora_config=spec.lora_config,
                                  tuning=spec.tuning)
        # This rank's adapters in host memory, read from their directories on first use (in the step).
        self.lora_cache = None
        if spec.lora_config is not None:
            from kvpilot.lora.adapter import AdapterCache, load_adapter
            from kvpilot.lora.layers import global_targets

            targets = global_targets(spec.cfg)
            layers, rank_max, dt = spec.cfg.num_hidden_layers, spec.lora_config.max_lora_rank, self.runner.dtype
            self.lora_cache = AdapterCache(spec.lora_config,
                                           lambda req: load_adapter(req, targets, layers, rank_max, dt))
        # One pool size for all ranks: the smallest (block ids index every rank's cache). Decode
        # graphs only if every rank has them: a graph micro-batch sends and receives padded shapes,
        # and TP ranks must run the same collectives.
        agree = torch.tensor([self.runner.num_blocks, int(self.runner.graphs is not None)], dtype=torch.int64,
                             device=self.device)
        dist.all_reduce(agree, op=dist.ReduceOp.MIN)
        self.num_blocks, all_graphs = (int(v) for v in agree.tolist())
        self.runner.num_blocks = self.num_blocks
        if self.runner.graphs is not None and not all_graphs:
            logger.warning("rank %d: another rank has no decode CUDA graphs; every rank runs eagerly", rank)
            self.runner.graphs = None
        self.graph_replays = 0  # decode graphs replayed by `execute` with P > 1 (tests, timing)
        self.timer: Optional[StepTimer] = None  # set by the step loop when step timing is on
        self.is_first = self.pp_rank == 0
        self.is_last = self.pp_rank == spec.pp_size - 1
        self.is_output = self.is_last and self.tp_rank == 0
        # On one GPU node the output rank shares a logits buffer with the front end (CUDA IPC), so
        # a step's [rows, vocab] float32 logits never cross a pipe or the host.
        # Two slots (``[2, max_batch_size, vocab]``), each with its event: asynchronous steps alternate
        # them, so a step's logits never overwrite those the front end may still be sampling.
        self.logits_buf = None
        self.logits_events: list = []
        if on_gpu and self.is_output and not spec.multi_node and spec.tuning.logits_ipc:
            self.logits_buf = torch.empty((2, spec.max_batch_size, spec.cfg.vocab_size), dtype=torch.float32,
                                          device=self.device)
            # Answer right after launching the step: the front end polls this event (recorded after
            # the logits are in the buffer) instead of this process synchronizing.
            if spec.tuning.logits_event:
                try:
                    self.logits_events = [torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
                                          for _ in range(2)]
                except Exception:  # noqa: BLE001 - the synchronizing path still works
                    logger.warning("cannot create an interprocess CUDA event; answering after a sync",
                                   exc_info=True)
        # Asynchronous tensor-parallel steps (`InputSync`): the output rank of a one-stage layout
        # on one node holds the buffer the front end writes sampled ids into.
        self.tok_buf = None
        self.tok_event = None
        if self.is_output and spec.pp_size == 1 and not spec.multi_node:
            self.tok_buf = torch.zeros(spec.max_batch_size, dtype=torch.int64, device=self.device)
        self.stop_requested = False
        # Steps whose ids this rank chooses (`own_step`): ids copied to the host, sent once their
        # step is done.
        self.pending_ids: deque = deque()  # (event or None, host ids tensor or the sampler's call)
        self.sampler = None  # built at the first step this rank samples
        self.row_decoder = RowDecoder()
        self.num_sampled_steps = 0  # steps drawn by this rank's sampler (tests, timing)
        self._ids_host = None
        if self.tok_buf is not None and on_gpu:
            self._ids_host = torch.empty((2, spec.max_batch_size), dtype=torch.int64, pin_memory=True)
        logger.info("rank %d (pp %d, tp %d): layers %s, %d KV blocks", rank, self.pp_rank, self.tp_rank,
                    layer_range, self.num_blocks)

    def set_input_sync(self, sync: tuple, conn) -> None:
        """Arm the next `execute` with a step's input-id hand-over (`InputSync`): ``sync`` is the
        "step" message's fourth field, (kind, broadcast, ids or None, event IPC handle or None)."""
        kind, broadcast, ids, handle = sync
        if self.is_output:
            if self.tok_buf is None:
                raise RuntimeError("an asynchronous step reached a rank without a sampled-ids buffer")
            if handle is not None and self.tok_event is None:
                self.tok_event = torch.cuda.Event.from_ipc_handle(self.tok_buf.device, handle)
            self.runner.set_inflight_tokens(self.tok_buf)
        self.runner.input_sync = InputSync(self, kind, broadcast, ids, conn)

    def own_step(self, logits: torch.Tensor, slot: int, rows: Optional[list] = None) -> None:
        """A step whose ids this rank chooses (nothing the front end needs the logits for): with
        ``rows`` None an arg-max step (every row plain greedy), else one `SamplingRow` per logits row
        (temperature, top-k, top-p, min-p, seed and output position only), drawn by
        the same `Sampler` as the front end's on the same logits, so the same ids. The ids go into
        ``tok_buf`` (the next step may read them there, ``SYNC_SELF``; -1 where the sampler leaves a
        row to its exact draw on the host, clamped to 0 where read) and their copy to the host is
        queued; `flush_ids` sends them as ("ids", list, redrawn rows).

        Raises:
            ValueError: ``rows`` and the logits have different numbers of rows.
        """
        n = logits.shape[0]
        ids = self.tok_buf[:n]
        if rows is not None:
            if len(rows) != n:
                raise ValueError(f"the step's plan has {len(rows)} sampling rows for {n} logits rows")
            if self.sampler is None:
                from kvpilot.sampling.sampler import Sampler

                tuning = getattr(getattr(self, "spec", None), "tuning", None) or Tuning()
                self.sampler = Sampler("auto" if tuning.triton_sampler else "torch", check=tuning.sampling_check)
            call = self.sampler.launch(logits, rows)
            ids.copy_(call.tokens)
            call.detach()  # host copies queued now; rows it may draw again kept apart from the logits
            self.pending_ids.append((call.ready, call))
            self.num_sampled_steps += 1
            return
        from kvpilot.sampling.sampler import greedy_ids

        tuning = getattr(getattr(self, "spec", None), "tuning", None) or Tuning()
        greedy_ids(logits, out=ids, use_triton=None if tuning.triton_sampler else False)
        if self._ids_host is None:
            self.pending_ids.append((None, ids.clone()))
            return
        host = self._ids_host[slot, :n]
        host.copy_(ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending_ids.append((event, host))

    def flush_ids(self, conn, keep: int) -> None:
        """Send the ids of pending own steps (`own_step`), oldest first, until ``keep`` remain;
        waits for their steps to finish on the device."""
        while len(self.pending_ids) > keep:
            event, ids = self.pending_ids.popleft()
            if event is not None:
                event.synchronize()
            if isinstance(ids, torch.Tensor):
                conn.send((MSG_IDS, ids.tolist(), []))
            else:  # the sampler's call: its read (and the exact draw of rows it left to the host)
                out = ids.finish()
                conn.send((MSG_IDS, out.token_ids, ids.redrawn.tolist()))

    def poll_ids(self, conn) -> None:
        """While the pipe is empty, send the oldest pending ids as soon as its step is done."""
        while self.pending_ids and not conn.poll(0):
            event, _ = self.pending_ids[0]
            if event is None or event.query():
                self.flush_ids(conn, keep=len(self.pending_ids) - 1)

    def wait_go(self, conn) -> Optional[list[int]]:
        """Read the pipe until the front end's ("go", ids) message and return ids (None: they are in
        ``tok_buf`` behind the front end's event). Step-timing requests met on the way are answered.

        Raises:
            StopRequested: the front end sent the stop message or closed the pipe.
            RuntimeError: any other message (a protocol error).
        """
        self.flush_ids(conn, keep=0)  # the front end may need them to publish what this step waits for
        spin = go_spin_seconds(self.spec.device, self.spec.tuning)
        while True:
            try:
                if not spin_poll(conn, spin):
                    conn.poll(None)
                msg = pickle.loads(conn.recv_bytes())
            except EOFError:
                msg = None
            if msg is None:
                self.stop_requested = True
                raise StopRequested()
            if msg[0] == MSG_TIMING:
                _answer_timing(self, conn, msg[1])
                continue
            if msg[0] != MSG_GO:
                raise RuntimeError(f"rank {self.rank} expected the step's sampled ids, got {msg[0]!r}")
            return msg[1]

    @property
    def ctrl(self):
        """The group that carries plans and logits between nodes (gloo, so CPU objects work)."""
        return self.ctrl_group

    @torch.inference_mode()
    def execute(self, plan: list[ScheduledSeq]) -> Optional[tuple[torch.Tensor, list[int]]]:
        """Run this rank's share of one step; the last stage returns (logits [R, V] float32, row indices)."""
        spec = self.spec
        if spec.pp_size == 1:
            return self.runner.execute(plan)  # the base runner's path (CUDA graphs where it has them)
        runner = self.runner
        graphs = runner.graphs
        mbs = split_microbatches(plan, spec.pp_size if spec.microbatching else 1)
        pad_ok = None  # whether eager micro-batches may be padded: decided at the first one
        prev_rank = self.rank - spec.tp_size
        next_rank = self.rank + spec.tp_size
        sends, logits, rows = [], [], []
        offset = 0
        for i, mb in enumerate(mbs):
            # A micro-batch with LoRA adapters runs eagerly (every rank decides alike: same plan).
            lora_on = runner.lora is not None and runner.lora.prepare(mb)
            if graphs is not None and not lora_on and graphs.can_run(mb):
                # The same decision on every rank (same plan, same batch sizes): shapes agree.
                out = self._replay_stage(graphs, mb, prev_rank, more=i + 1 < len(mbs))
                if not self.is_last:
                    sends.append((dist.isend(out, dst=next_rank), out))
                else:
                    logits.append(out)
                    rows.extend(range(offset, offset + len(mb)))
                offset += len(mb)
                continue
            if pad_ok is None:  # only where one GPU pads the whole step (module docstring)
                pad_ok = len(mbs) == 1 or (runner.prefill_pad_buckets is not None and prefill_padding(
                    plan, runner.prefill_pad_buckets, runner.max_batch_size, runner.max_blocks_per_seq) is not None)
            ids, pos, meta, sample_idx = runner.prepare(mb, pad_ok)
            n = ids.shape[0]  # padded like one GPU's prefill graph where it would use one (module docstring)
            if lora_on:
                runner.lora.pad_to(n)
            hidden = residual = None
            if not self.is_first:
                buf = torch.empty((2, n, spec.cfg.hidden_size), dtype=runner.dtype, device=runner.device)
                dist.recv(buf, src=prev_rank)
                hidden, residual = buf[0], buf[1]
            out = runner._forward(ids, pos, meta, runner.kv_caches, hidden, residual)
            if not self.is_last:
                buf = torch.stack(out)
                sends.append((dist.isend(buf, dst=next_rank), buf))
            elif sample_idx:
                logits.append(runner.model.compute_logits(out[torch.tensor(sample_idx, device=runner.device)]))
                rows.extend(offset + i for i in sample_idx)
            offset += sum(len(s.token_ids) for s in mb)  # real tokens: rows index the unpadded step
        for work, _buf in sends:
            work.wait()
        if not self.is_last:
            return None
        if not logits:
            return torch.empty(0, spec.cfg.vocab_size, device=runner.device), []
        return (logits[0] if len(logits) == 1 else torch.cat(logits)), rows

    def _replay_stage(self, graphs, mb: list[ScheduledSeq], prev_rank: int, more: bool) -> torch.Tensor:
        """One decode micro-batch through this stage's graph: inputs in, the previous stage's
        activations received into the static buffer, replay. Returns what goes on: the activations
        to send ``[2, b, hidden]`` (padded batch ``b``), or on the last stage the logits ``[n, vocab]``
        float32. ``more``: another micro-batch follows in this step, whose replay would overwrite the
        static output while its send (or the logits) is still pending, so a copy is returned."""
        t0 = time.perf_counter() if self.timer is not None else 0.0
        key = graphs.load(mb)
        if not self.is_first:
            # Ordered after the previous replay that read this buffer: NCCL's stream waits for the
            # current stream before a receive, and the replay waits for the receive.
            dist.recv(graphs.stage_input(key[0]), src=prev_rank)
        graphs.replay(key)
        self.graph_replays += 1
        if self.is_last:
            out = graphs.logits(len(mb))
            if more and graphs.lm_head_in_graph:
                out = out.clone()
        else:
            out = graphs.stage_output(key[0])
            if more:
                out = out.clone()
        if self.timer is not None:
            self.timer.add("stage_graph", time.perf_counter() - t0)
        return out


def _send_logits(conn, logits: torch.Tensor, rows: list[int], ipc_buf: Optional[torch.Tensor] = None,
                 event=None) -> Optional[object]:
    """Answer one step on ``conn``. Returns the CUDA event marking the logits' completion when the
    answer went out before it (``event`` given), else None.

    ``ipc_buf`` (the buffer shared with the front end) with ``event`` (interprocess, shared too): copy
    into the buffer, record the event, answer at once; without ``event``: copy, synchronize, answer.
    Without ``ipc_buf`` (or more rows than it has): header, then the float32 logits as raw bytes.
    """
    if ipc_buf is not None and logits.shape[0] <= ipc_buf.shape[0]:
        ipc_buf[:logits.shape[0]].copy_(logits)
        if event is not None:
            event.record()  # the front end's stream waits on it; it was recorded before the answer
        else:
            torch.cuda.current_stream().synchronize()  # the front end reads it from another process
        conn.send((MSG_OK, tuple(logits.shape), rows, True))
        return event
    arr = logits.detach().float().contiguous().cpu().numpy()
    conn.send((MSG_OK, tuple(arr.shape), rows, False))
    conn.send_bytes(memoryview(arr).cast("B") if arr.size else b"")  # a cast refuses zero-size arrays
    return None


def worker_main(rank: int, spec: WorkerSpec, conn) -> None:
    """Process entry point of one rank: build the shard, then serve steps until told to stop.

    Protocol on ``conn`` (a `multiprocessing` pipe end): the worker sends ``("ready", num_blocks,
    ipc, info)`` once loaded (``ipc``: the output rank's shared CUDA logits buffer, reduced for pickling, or
    None, or ``{"logits": reduced buffer, "event": IPC handle of the interprocess event or None}``;
    ``info``: ``{"one_shot_all_reduce": bool}``, whether every rank's tensor-parallel all-reduces, on
    every node, may use the one-shot kernel: `one_shot_everywhere`, which every rank joins);
    the front end sends pickled ``("step", encoded plan, logits mode, sync, (slot, own))``
    (`PlanEncoder`; `LOGITS_PIPE`, `LOGITS_SYNC` or `LOGITS_EVENT`; ``sync``: None or an asynchronous
    step's `InputSync` fields; ``slot``: the half of the shared logits buffer; ``own``: False, or a
    step whose ids the output rank chooses (`Worker.own_step`), True for the arg-max of every row or
    the `RowEncoder` list of its sampling rows, answered with ("ids", list, redrawn rows) once done
    instead of logits), ``("go", ids or None)`` (an
    asynchronous step's ids, `SYNC_GO`), ``("timing", reset)`` or ``None`` (stop) as bytes; the output
    rank answers each step with ``("ok", shape, rows, in_buffer)``, followed, when not ``in_buffer``,
    by the float32 logits as raw bytes; every rank the front end sends plans to (all of them on one
    node, rank 0 of a multi-node group) answers ``("timing", rank, summary)`` (`StepTimer.summary`,
    empty unless ``Tuning(step_timing=True)``).
    Any exception is sent as ``("error", rank, traceback_text)`` and ends the process with status 1.
    In a multi-node group only rank 0 talks to the front end; the other ranks get plans by broadcast
    and send logits to rank 0 (``conn`` is None on ranks of other nodes).
    """
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    worker = None
    try:
        worker = Worker(rank, spec)
        one_shot = one_shot_everywhere(worker)  # collective: ranks without a pipe (other pods) join too
        check_same_invariant_size(worker)  # collective too
        if conn is not None:
            ipc = None
            if worker.logits_buf is not None:
                from torch.multiprocessing.reductions import reduce_tensor

                ipc = {"logits": reduce_tensor(worker.logits_buf), "event": None,
                       "tokens": reduce_tensor(worker.tok_buf) if worker.tok_buf is not None else None}
                if worker.logits_events:
                    try:
                        ipc["event"] = [e.ipc_handle() for e in worker.logits_events]
                    except Exception:  # noqa: BLE001 - answer after a sync instead
                        logger.warning("cannot share the logits event; answering after a sync", exc_info=True)
                        worker.logits_events = []
            conn.send((MSG_READY, worker.num_blocks, ipc, {"one_shot_all_reduce": one_shot}))
        _serve(worker, conn)
    except StopRequested:
        pass  # stopped while waiting for a step's sampled ids: a normal stop
    except BaseException as e:  # noqa: BLE001 - report anything, including KeyboardInterrupt, then exit
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        logger.error("rank %d failed: %s", rank, text)
        if conn is not None:
            try:
                conn.send((MSG_ERROR, rank, text))
            except (OSError, ValueError):
                pass
        os._exit(1)  # skip interpreter teardown: peers may be stuck in collectives with us
    finally:
        if conn is not None:
            conn.close()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - shutting down anyway
            pass


class _DeviceClock:
    """Device-side step times of a rank (step timing on GPUs), from timing events on its stream:
    ``gpu_step`` (from the step's first queued work to its end, waits on peers included) and
    ``gpu_idle`` (from the previous step's end to this step's start: zero when the step was queued
    behind the previous one, the stream's idle time otherwise). Read without synchronizing: a pair
    of steps is measured once the later one has completed on the device."""

    def __init__(self, timer: StepTimer) -> None:
        self.timer = timer
        self.steps: deque = deque()
        self._start = None

    def start(self) -> None:
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()

    def end(self) -> None:
        if self._start is None:
            return
        stop = torch.cuda.Event(enable_timing=True)
        stop.record()
        self.steps.append((self._start, stop))
        self._start = None
        while len(self.steps) >= 2 and self.steps[1][1].query():
            (_s0, e0), (s1, e1) = self.steps.popleft(), self.steps[0]
            self.timer.add("gpu_step", s1.elapsed_time(e1) * 1e-3)
            self.timer.add("gpu_idle", e0.elapsed_time(s1) * 1e-3)


def _answer_timing(worker: Worker, conn, reset: bool) -> None:
    """Answer a ("timing", reset) request with this rank's `StepTimer` summary."""
    timer = worker.timer
    summary = timer.summary() if timer is not None else {}
    if timer is not None and reset:
        timer.reset()
    # Only ranks the front end sends plans to answer: in a multi-node group the leader pod's other
    # ranks have pipes too, but the front end reads only rank 0's (an extra answer would be read as
    # an unexpected message at the next step, killing the engine).
    if conn is not None and (worker.rank == 0 or not worker.spec.multi_node):
        conn.send((MSG_TIMING, worker.rank, summary))


def _serve(worker: Worker, conn) -> None:
    spec = worker.spec
    rank = worker.rank
    output_rank = (spec.pp_size - 1) * spec.tp_size
    decoder = PlanDecoder(worker.lora_cache.get if worker.lora_cache is not None else None)
    timer = StepTimer() if spec.tuning.step_timing else None
    worker.timer = timer
    on_gpu = spec.device.startswith("cuda")
    spin = pipe_spin_seconds(spec.device, spec.tuning)
    clock = time.perf_counter
    device_clock = _DeviceClock(timer) if timer is not None and on_gpu else None
    while True:
        if worker.pending_ids:
            worker.poll_ids(conn)
        if timer is not None:
            t_idle = clock()
        if spec.multi_node:
            obj = [None]
            if rank == 0:
                try:
                    if not spin_poll(conn, spin):
                        conn.poll(None)
                    obj = [pickle.loads(conn.recv_bytes())]
                except EOFError:
                    pass  # the front end is gone: broadcast the stop
            group = worker.ctrl
            dist.broadcast_object_list(obj, src=0, group=group)
            msg = obj[0]
            if timer is not None:
                t_recv = clock()
        else:
            try:
                if not spin_poll(conn, spin):
                    conn.poll(None)
                if timer is not None:
                    t_recv = clock()
                msg = pickle.loads(conn.recv_bytes())
            except EOFError:
                msg = None  # the front end is gone
        if msg is None:
            if timer is not None and timer.samples:
                logger.info("rank %d step timing: %s", rank, timer.summary())
            return
        if msg[0] == MSG_TIMING:
            _answer_timing(worker, conn, msg[1])
            continue
        _kind, encoded, logits_mode, sync, (slot, own) = msg
        plan = decoder.decode(encoded)
        own_rows = None
        if isinstance(own, list) and worker.is_output:  # decoded at every such step: both ends in step
            own_rows = worker.row_decoder.decode(own)
        if timer is not None:
            t_plan = clock()
            timer.add("idle", t_recv - t_idle)
            timer.add("recv", t_plan - t_recv)
        if sync is not None:
            worker.set_input_sync(sync, conn)
        if device_clock is not None:
            device_clock.start()
        result = worker.execute(plan)
        if timer is not None:
            t_launch = clock()
            timer.add("prepare_launch", t_launch - t_plan)
        pending = None
        # Measuring GPU completion synchronizes this rank: only for settled steps, where the front
        # end waits for the step anyway (with asynchronous ones it would stop this rank preparing
        # the next step while the device computes).
        gpu_timing = timer is not None and on_gpu and sync is None
        if not spec.multi_node or output_rank == 0:
            if worker.is_output and own:
                # The front end takes the ids, not the logits: nothing is copied out (module docstring).
                logits, rows = result
                worker.own_step(logits, slot, own_rows)
                if device_clock is not None:
                    device_clock.end()
                conn.send((MSG_OK, tuple(logits.shape), rows, True))
                worker.flush_ids(conn, keep=1 if worker._ids_host is not None else 0)
                if timer is not None:
                    timer.add("answer", clock() - t_launch)
            elif worker.is_output:
                buf = worker.logits_buf[slot] if worker.logits_buf is not None and logits_mode != LOGITS_PIPE else None
                event = worker.logits_events[slot] if logits_mode == LOGITS_EVENT else None
                if sync is not None and buf is not None and worker.tok_event is not None:
                    # The front end's last published sampler has read this slot's previous logits.
                    torch.cuda.current_stream().wait_event(worker.tok_event)
                if device_clock is not None:
                    device_clock.end()
                pending = _send_logits(conn, *result, buf, event)
                if timer is not None:
                    t_sent = clock()
                    timer.add("answer", t_sent - t_launch)
                    if pending is not None and gpu_timing:
                        pending.synchronize()  # timing only: after the answer, so it delays nothing
                        timer.add("gpu_done_after_answer", clock() - t_sent)
            else:
                if device_clock is not None:
                    device_clock.end()
                if gpu_timing:
                    torch.cuda.current_stream().synchronize()  # timing only
                    timer.add("gpu_done", clock() - t_launch)
            continue
        # Multi-node: the output rank may live on another node; rank 0 relays its logits.
        if worker.is_output:
            logits, rows = result
            header = [tuple(logits.shape), rows]
            dist.send_object_list(header, dst=0, group=worker.ctrl)
            dist.send(logits.float().cpu().contiguous() if worker.ctrl is not None else logits.float().contiguous(),
                      dst=0, group=worker.ctrl)
        elif rank == 0:
            header = [None, None]
            dist.recv_object_list(header, src=output_rank, group=worker.ctrl)
            shape, rows = header
            dev = "cpu" if worker.ctrl is not None else worker.device
            logits = torch.empty(shape, dtype=torch.float32, device=dev)
            dist.recv(logits, src=output_rank, group=worker.ctrl)
            _send_logits(conn, logits, rows)
