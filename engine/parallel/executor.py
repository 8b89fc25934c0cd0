"""Tensor x pipeline parallelism: `MultiprocExecutor` runs the model in T x P worker processes.

The user's process stays the single front end: `LLM`'s engine core (scheduler, KV block manager,
sampler, detokenizer) runs there, and each step's plan (``list[ScheduledSeq]``, plain data) goes to
the workers over `multiprocessing` pipes. The workers (`kvpilot.parallel.worker`) form one
``torch.distributed`` group (NCCL on GPUs, gloo on CPU) and hold one weight shard each; the output
rank (tensor-parallel rank 0 of the last pipeline stage) sends the step's float32 logits back.

Processes start with the ``spawn`` method (CUDA cannot survive ``fork``), which re-imports the
user's main module in every worker: scripts must protect their entry point with
``if __name__ == "__main__":`` (as TensorRT-LLM's LLM API documents); a missing guard is reported
with that advice instead of multiprocessing's bootstrapping error.

A worker that raises, exits or stops answering makes `execute` raise `EngineDeadError` carrying the
worker's traceback; the engine loop is stopped and every other worker is terminated, so nothing
hangs. Waits use `multiprocessing.connection.wait` over the pipes and the process sentinels.

Asynchronous steps (`MultiprocExecutor.defers_logits`; one pipeline stage on one node,
``KVPILOT_TP_ASYNC`` not 0): the front end sends step N+1 before it samples step N, and the output
rank gets step N's ids from the front end (a "go" message, or the interprocess event of an earlier
publication) or chooses them itself: its arg-max when every live request wants only greedy ids, or
its own run of the front end's `Sampler` over the same logits and `SamplingRow` records when every
live request wants only ids drawn with temperature, top-k, top-p, min-p and a seed (nothing that
needs the front end's state: log-probabilities, penalties, biases, bans, beams;
``KVPILOT_TP_RANK_SAMPLING=0`` leaves those draws to the front end). The front end then queues no
device work, since its kernels would time-slice the output rank's GPU, and no step waits for it
(``parallel_worker.InputSync``, `Worker.own_step`; docs/parallelism.md).

Multi-node (a LeaderWorkerSet group): LWS sets ``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE`` and
``LWS_WORKER_INDEX`` in every pod; the rendezvous is ``tcp://$LWS_LEADER_ADDRESS:$MASTER_PORT``.
Pod ``i`` runs ranks ``[i * R, (i + 1) * R)`` with ``R = T * P / LWS_GROUP_SIZE``. The leader's
`LLM` runs the front end and its ranks; the other pods call `run_lws_worker`. Then plans reach the
ranks by a gloo broadcast from rank 0, and rank 0 relays the output rank's logits.
"""

from __future__ import annotations

import dataclasses

import logging
import multiprocessing as mp
import os
import pickle
import socket
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait as mp_wait
from pathlib import Path
from typing import Mapping, Optional

import torch

from kvpilot.outputs import EngineDeadError
from kvpilot import envs
from kvpilot.config import KvCacheConfig

from kvpilot.model.config import ModelConfig
from kvpilot.parallel.custom_all_reduce import custom_all_reduce_enabled, custom_all_reduce_max_tokens
from kvpilot.parallel.worker import (LOGITS_EVENT, LOGITS_PIPE, LOGITS_SYNC, MSG_ERROR, MSG_GO, MSG_IDS, MSG_OK,
                              MSG_READY, MSG_TIMING, SYNC_EVENT, SYNC_GO, SYNC_SELF, PlanEncoder, RowEncoder,
                              StepTimer, WorkerSpec, pipe_spin_seconds, rank_sampling_enabled, spin_poll,
                              stage_layers, step_timing_enabled, worker_main)

logger = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 29500  # torch.distributed's MASTER_PORT convention (the operator sets it too)
_GUARD_HINT = ("kvpilot starts its tensor/pipeline-parallel workers with the 'spawn' method, which re-imports "
               "your main module in every worker. Protect your script's entry point:\n\n"
               "    if __name__ == '__main__':\n        main()\n\n"
               "so that creating the LLM does not run again in the workers.")


def tp_async_enabled() -> bool:
    """``KVPILOT_TP_ASYNC`` (default 1): 0 keeps every tensor-parallel step settled (the front end
    reads a step's tokens before it plans the next; `MultiprocExecutor.execute`)."""
    return os.environ.get("KVPILOT_TP_ASYNC", "1") not in ("0", "false", "False", "no")


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


@dataclass(frozen=True)
class LwsGroup:
    """This pod's place in a LeaderWorkerSet group (from the environment LWS injects)."""

    leader_address: str
    size: int
    index: int
    port: int

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> Optional["LwsGroup"]:
        """The group described by ``LWS_GROUP_SIZE`` / ``LWS_LEADER_ADDRESS`` / ``LWS_WORKER_INDEX``
        (and ``MASTER_PORT``, default 29500); None outside a group or in a group of one pod.

        Raises:
            ValueError: ``LWS_GROUP_SIZE`` > 1 without ``LWS_LEADER_ADDRESS``, or non-integer values.
        """
        env = envs.external_environ() if env is None else env
        size = int(env.get("LWS_GROUP_SIZE") or 1)
        if size <= 1:
            return None
        leader = env.get("LWS_LEADER_ADDRESS")
        if not leader:
            raise ValueError("LWS_GROUP_SIZE > 1 but LWS_LEADER_ADDRESS is not set")
        return cls(leader, size, int(env.get("LWS_WORKER_INDEX") or 0),
                   int(env.get("MASTER_PORT") or DEFAULT_MASTER_PORT))


def validate_layout(cfg: ModelConfig, tp: int, pp: int) -> None:
    """Check that the model splits into ``tp`` x ``pp`` shards (before any process starts).

    Raises:
        ValueError: naming the dimension that does not split, or a ``KVPILOT_TP_INVARIANT`` the
            layout cannot take (`tp_invariant.check_tp_invariant`).
    """
    if cfg.num_attention_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide num_attention_heads {cfg.num_attention_heads}")
    kv = cfg.num_key_value_heads
    if kv % tp and tp % kv:
        raise ValueError(f"tensor_parallel_size {tp} must divide, or be a multiple of, num_key_value_heads {kv}")
    if cfg.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide intermediate_size {cfg.intermediate_size}")
    from kvpilot.model.tp_invariant import check_tp_invariant  # KVPILOT_TP_INVARIANT, before any worker starts

    check_tp_invariant(cfg, tp)
    stage_layers(cfg.num_hidden_layers, pp)


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = device.split(":", 1)[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if ":" in device:
        logger.warning("device %r: parallel workers use cuda:<local rank>; the index is ignored", device)
    return kind


def format_step_timing(timing: dict) -> str:
    """A text table of `MultiprocExecutor.step_timing`'s result: one line per (process, phase)."""
    lines = [f"{'process':<10} {'phase':<24} {'n':>7} {'mean ms':>9} {'median ms':>9}"]
    parts = [("front end", timing.get("front_end", {}))]
    parts += [(f"rank {r}", t) for r, t in sorted(timing.get("ranks", {}).items())]
    for who, phases in parts:
        for phase, st in phases.items():
            lines.append(f"{who:<10} {phase:<24} {st['n']:>7} {st['mean_ms']:>9.3f} {st['median_ms']:>9.3f}")
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_worker_spec(model_dir: Path, cfg: ModelConfig, kv_config: KvCacheConfig, max_num_tokens: int,
                     max_batch_size: int, max_seq_len: int, device: str, dtype: str, tp: int, pp: int,
                     group: Optional[LwsGroup], lora_config=None) -> WorkerSpec:
    """The `WorkerSpec` every rank gets; on one node the rendezvous is a free localhost port.

    Raises:
        ValueError: a layout the model or the LWS group cannot take, too few GPUs, or a bad
            ``KVPILOT_TP_CUSTOM_ALLREDUCE_MAX_TOKENS`` where the one-shot all-reduce would read it (TP 2
            on CUDA, not ROCm, a whole TP group on each node, ``KVPILOT_TP_CUSTOM_ALLREDUCE`` not 0).
    """
    validate_layout(cfg, tp, pp)
    dev = _resolve_device(device)
    world = tp * pp
    if group is not None:
        if world % group.size:
            raise ValueError(f"tensor x pipeline = {world} ranks do not split evenly over {group.size} pods")
        per_node, init = world // group.size, f"tcp://{group.leader_address}:{group.port}"
    else:
        per_node, init = world, f"tcp://127.0.0.1:{_free_port()}"
    if dev == "cuda" and torch.cuda.device_count() < per_node:
        raise ValueError(f"{per_node} ranks on this node need {per_node} GPUs; {torch.cuda.device_count()} visible")
    if tp == 2 and dev == "cuda" and per_node % tp == 0 and torch.version.hip is None and custom_all_reduce_enabled():
        # Where a worker would read it (`Worker`, `CustomAllReduce.create`): a bad value raises here,
        # before any process starts, not in a worker.
        custom_all_reduce_max_tokens()
    return WorkerSpec(
        model_dir=str(model_dir), cfg=cfg, kv_config=kv_config, max_num_tokens=max_num_tokens,
        max_batch_size=max_batch_size, max_seq_len=max_seq_len, device=dev, dtype=dtype, tp_size=tp,
        pp_size=pp, init_method=init, ranks_per_node=per_node, multi_node=group is not None,
        timeout_s=_env_float("KVPILOT_DIST_TIMEOUT_S", 600.0),
        microbatching=os.environ.get("KVPILOT_PP_MICROBATCH", "1") != "0",
        log_level=logging.getLogger().getEffectiveLevel(), lora_config=lora_config)


def _start_ranks(spec: WorkerSpec, ranks: range, with_pipes: bool):
    """Spawn one process per rank; returns (processes, front-end pipe ends or Nones)."""
    if getattr(mp.current_process(), "_inheriting", False):
        raise RuntimeError(f"an LLM with worker processes was created while a worker was starting. {_GUARD_HINT}")
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for rank in ranks:
        parent, child = ctx.Pipe(duplex=True) if with_pipes else (None, None)
        p = ctx.Process(target=worker_main, args=(rank, spec, child), name=f"kvpilot-rank{rank}", daemon=True)
        try:
            p.start()
        except RuntimeError as e:
            if "bootstrapping phase" in str(e):
                raise RuntimeError(f"{_GUARD_HINT}\n(multiprocessing said: {e})") from e
            raise
        if child is not None:
            child.close()  # the worker holds its end; closing ours lets EOF reach us when it dies
        procs.append(p)
        conns.append(parent)
    return procs, conns


class MultiprocExecutor:
    """Runs the model in ``tensor_parallel_size x pipeline_parallel_size`` worker processes.

    Has the executor interface `EngineCore` uses: ``execute(plan) -> (logits [R, vocab] float32, row
    indices)`` (logits on the output rank's GPU through a shared CUDA buffer on one GPU node, else on
    CPU), ``num_blocks`` (the smallest pool over ranks) and ``block_size``.

    Args:
        llm: the `LLM` being built (model directory, config, limits, layout).
        device: "auto", "cpu" or "cuda" (rank r of a node uses ``cuda:r``).
        dtype: as for `ModelRunner`.

    Raises:
        ValueError: the layout does not fit the model or the machine.
        RuntimeError: a worker failed while starting (its traceback is in the message; a missing
            ``if __name__ == "__main__":`` guard is named as the likely cause).
    """

    def __init__(self, llm, device: str, dtype: str) -> None:
        self._llm_ref = weakref.ref(llm)
        self.block_size = llm.kv_cache_config.tokens_per_block
        self._dead: Optional[BaseException] = None
        self._closed = False
        group = LwsGroup.from_env()
        if group is not None and group.index != 0:
            raise RuntimeError(f"this pod is worker {group.index} of a LeaderWorkerSet group; only the leader "
                               f"(LWS_WORKER_INDEX=0) builds an LLM; the others call kvpilot.parallel.executor.run_lws_worker")
        spec = make_worker_spec(llm.model_dir, llm.model_config, llm.kv_cache_config, llm.max_num_tokens,
                                llm.max_batch_size, llm.max_seq_len, device, dtype, llm.tensor_parallel_size,
                                llm.pipeline_parallel_size, group, getattr(llm, "lora_config", None))
        self.spec = spec
        self._step_timeout = _env_float("KVPILOT_STEP_TIMEOUT_S", spec.timeout_s + 60.0)
        t0 = time.perf_counter()
        self._procs, self._conns = _start_ranks(spec, range(spec.ranks_per_node), with_pipes=True)
        output_rank = (spec.pp_size - 1) * spec.tp_size
        if spec.multi_node:
            self._plan_conns = [self._conns[0]]
            self._out_conn = self._conns[0]
        else:
            self._plan_conns = list(self._conns)
            self._out_conn = self._conns[output_rank]
        blocks, one_shot = {}, []
        self._logits_buf: Optional[torch.Tensor] = None
        self._tok_buf: Optional[torch.Tensor] = None  # the output rank's sampled-ids buffer (CUDA IPC)
        self._logits_events: list = []  # the output rank's interprocess events, one per slot (LOGITS_EVENT)
        self._read_done = None  # recorded after the last clone out of the shared buffer
        self._encoder = PlanEncoder()
        self._timer = StepTimer() if step_timing_enabled() else None
        self._last_return: Optional[float] = None
        self._spin = pipe_spin_seconds(spec.device)
        self._lock = threading.Lock()  # one exchange on the pipes at a time (steps, step_timing)
        self._go_sent = threading.Condition(self._lock)  # step_timing waits on it while a plan awaits its go
        deadline = time.monotonic() + _env_float("KVPILOT_WORKER_START_TIMEOUT_S", 1800.0)
        try:
            while len(blocks) < len(self._conns):
                waiting = [c for i, c in enumerate(self._conns) if i not in blocks]
                conn, msg = self._wait_for(waiting, deadline - time.monotonic(), starting=True)
                if msg[0] != MSG_READY:
                    self._die(f"unexpected message from a starting worker: {msg[0]!r}")
                blocks[self._conns.index(conn)] = msg[1]
                one_shot.append(bool(msg[3].get("one_shot_all_reduce")))
                if msg[2] is not None:
                    self._open_logits_buffer(msg[2])
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = min(blocks.values())
        # Every rank's tensor-parallel all-reduces, on every node, may use the one-shot kernel
        # (engine/parallel/custom_all_reduce.py; the workers agree on it, `parallel_worker.one_shot_everywhere`).
        self.one_shot_all_reduce = bool(one_shot) and all(one_shot)
        # Asynchronous steps (`tp_async_enabled`; `execute`'s docstring).
        self.defers_logits = (tp_async_enabled() and spec.pp_size == 1 and not spec.multi_node
                              and (self.logits_mode == LOGITS_EVENT and self._tok_buf is not None
                                   or spec.device == "cpu"))
        self._sent: deque = deque()  # steps sent, not awaited: [rows, logits tensor, orphan, slot, own]
        self._stash: list = []  # answers read while collecting step timing
        self._unpub: deque = deque()  # steps sent, ids not published: {"own", "self_read"}
        self._slot = 0  # the logits slot of the next asynchronous step (they alternate)
        # Set by the engine before each `execute` (see `execute`): (what the output rank chooses the
        # step's ids from: None, the front end samples; True, the arg-max of every row; or one
        # (seq_id, output position, `SamplingRow.record` bytes) per logits row for its own sampler;
        # whether the step's in-flight ids are the previous step's own ids, all in row order).
        self.own_ids_hint: tuple = (None, False)
        # Whether the engine may give the output rank sampling rows (`rank_sampling_enabled`).
        self.samples_on_output_rank = self.defers_logits and rank_sampling_enabled()
        self._rows = RowEncoder()
        self.num_self_steps = 0  # steps whose in-flight ids were the output rank's own (SYNC_SELF)
        self.num_rank_sampled_steps = 0  # steps whose ids the output rank drew with its sampler
        self.num_rank_redrawn_rows = 0  # rows of those its sampler drew again on the host (exact path)
        self._go_pending = False  # the last plan sent waits for a ("go", ids) message
        self._ready_ids: Optional[list] = None  # CPU: ids published with no plan waiting for them
        self._tok_event = None
        self._tok_handle = None  # sent once, with the first asynchronous plan
        if self.defers_logits and self._tok_buf is not None:
            with torch.cuda.device(self._tok_buf.device):
                self._tok_event = torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
            self._tok_handle = self._tok_event.ipc_handle()
        logger.info("%d x %d workers ready in %.1f s (%s, %d KV blocks per rank%s)", spec.tp_size, spec.pp_size,
                    time.perf_counter() - t0, spec.device, self.num_blocks,
                    ", asynchronous steps" if self.defers_logits else "")

    def _open_logits_buffer(self, ipc) -> None:
        try:
            rebuild, args = ipc["logits"]
            self._logits_buf = rebuild(*args)
        except Exception:  # noqa: BLE001 - the pipe path still works, only slower
            logger.warning("cannot open the output worker's CUDA logits buffer; logits go through the pipe",
                           exc_info=True)
            self._logits_buf = None
            return
        self._read_done = torch.cuda.Event()
        if ipc.get("tokens") is not None:
            try:
                rebuild, args = ipc["tokens"]
                self._tok_buf = rebuild(*args)
            except Exception:  # noqa: BLE001 - steps are then settled (synchronous) only
                logger.warning("cannot open the output worker's sampled-ids buffer", exc_info=True)
        if ipc.get("event") is not None:
            try:
                self._logits_events = [torch.cuda.Event.from_ipc_handle(self._logits_buf.device, h)
                                       for h in ipc["event"]]
            except Exception:  # noqa: BLE001 - the worker then synchronizes before answering
                logger.warning("cannot open the output worker's logits event; it will synchronize instead",
                               exc_info=True)
                self._logits_events = []

    @property
    def output_device(self) -> Optional[torch.device]:
        """The device the step's logits come back on (the output rank's GPU on one node), or None for
        the CPU. The engine thread makes it its current CUDA device: Triton launches (the sampler's)
        need their tensors on the current device, and with pipeline parallelism the output rank is
        not GPU 0."""
        return None if self._logits_buf is None else self._logits_buf.device

    @property
    def supports_async_scheduling(self) -> bool:
        """Whether `EngineCore` may plan a step before the previous one's tokens are read: with
        asynchronous steps (``defers_logits``) only."""
        return self.defers_logits

    @property
    def device(self) -> torch.device:
        """The front end's device for this executor's logits (`EngineCore` enables async scheduling by
        default on CUDA)."""
        return self.output_device or torch.device("cpu")

    @property
    def logits_mode(self) -> int:
        """How the output rank returns logits: `LOGITS_EVENT`, `LOGITS_SYNC` or `LOGITS_PIPE`."""
        if self._logits_buf is None:
            return LOGITS_PIPE
        return LOGITS_EVENT if self._logits_events else LOGITS_SYNC

    # ---- per step ------------------------------------------------------------------------------
    def execute(self, plan) -> tuple[torch.Tensor, list[int]]:
        """Send one step's plan to the workers; return the output rank's logits and rows.

        With ``defers_logits`` (asynchronous steps: one pipeline stage on one node,
        ``KVPILOT_TP_ASYNC`` not 0), this returns at once, after sending the plan: the logits
        ``[R, vocab]`` (R from the plan) are the shared buffer's rows (on CPU, a tensor the answer is
        read into), valid only after `await_logits`, and the rows are ``range(R)``. The caller then
        owes, for every step in order, one `await_logits` and one `publish_tokens` (the step's
        sampled ids, which the next plan's in-flight rows read on the device). A plan sent while an
        earlier step is unpublished makes the output rank wait for that publication (``SYNC_GO``)
        before its step runs, so a step planned ahead is launched while the previous one computes.

        The logits are float32 ``[R, vocab]``: on the output rank's GPU (a copy out of the shared
        buffer, made once the step's event is complete: the output rank answers right after
        launching, and the wait for its GPU is a host-side poll that watches the workers, see
        `_await_logits_event`) on one GPU node, else on the CPU.

        ``own_ids_hint`` (set before the call, reset by it) makes an asynchronous step one whose ids
        the output rank chooses (its logits never leave it; `await_ids` instead of `await_logits`):
        True, the arg-max of every row; a list, one ``(seq_id, output position, record)`` per
        logits row, which its `Sampler` draws exactly as the front end's would (the caller vouches
        that the rows need nothing else: `SamplingRow.from_record`). Its second field says that the
        plan's in-flight rows read the previous step's own ids in row order: when that step is the
        only unpublished one, this step reads them on the output rank at once (``SYNC_SELF``).

        Raises:
            EngineDeadError: a worker failed, exited or timed out (now or earlier).
            ValueError: a list of sampling rows that does not match the plan's logits rows.
        """
        with self._lock:
            if self.defers_logits:
                return self._execute_deferred(plan)
            return self._execute(plan)

    def _execute_deferred(self, plan) -> tuple[torch.Tensor, list[int]]:
        self._check_usable()
        if self._go_pending:  # the caller gave up a step (an engine error): release it, drop its answer
            self._abandon_steps()
        timer = self._timer
        if timer is not None:
            t0 = time.perf_counter()
            if self._last_return is not None:
                timer.add("host_between_steps", t0 - self._last_return)
        n_rows = 0
        inflight = False
        for s in plan:
            n_rows += len(s.token_ids) if s.all_logits else (1 if s.sample else 0)
            inflight = inflight or s.inflight_row >= 0
        handle = self._tok_handle
        own, from_own = self.own_ids_hint
        self.own_ids_hint = (None, False)
        if isinstance(own, list):
            if len(own) != n_rows:
                raise ValueError(f"{len(own)} sampling rows for a plan of {n_rows} logits rows")
            if own:
                own = self._rows.encode(own)
                self.num_rank_sampled_steps += 1
            else:
                own = True  # nothing to draw: an arg-max step of no rows
        own = own or False
        if inflight and from_own and len(self._unpub) == 1 and self._unpub[0]["own"]:
            sync = (SYNC_SELF, True, None, handle)
            self._unpub[0]["self_read"] = True  # its publication must leave the ids buffer alone
            self.num_self_steps += 1
        elif self._unpub:
            sync = (SYNC_GO, inflight, None, handle)
        elif inflight:
            if self._tok_event is None and self._ready_ids is None:
                raise RuntimeError("a plan reads in-flight ids that were never published (publish_tokens)")
            sync = (SYNC_EVENT, True, self._ready_ids, handle)
        else:
            sync = None
            if self._read_done is not None:
                self._read_done.synchronize()  # the last sampler's reads of the shared buffer are done
        if sync is not None:
            self._tok_handle = None  # the output rank keeps the event it opened
        self._ready_ids = None
        slot, self._slot = self._slot, self._slot ^ 1
        data = pickle.dumps(("step", self._encoder.encode(plan), self.logits_mode, sync, (slot, own)),
                            protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self._plan_conns:
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, ConnectionResetError, OSError):
                self._wait_for([conn], 5.0)  # collects the worker's error text if it left one
                self._die("a worker closed its pipe")
        self._go_pending = sync is not None and sync[0] == SYNC_GO
        own = own is not False
        self._unpub.append({"own": own, "self_read": False})
        buf = self._logits_buf
        if buf is not None and n_rows <= buf.shape[1]:
            logits = buf[slot, :n_rows]
        else:
            logits = torch.empty((n_rows, self.spec.cfg.vocab_size), dtype=torch.float32)
        self._sent.append([n_rows, logits, False, slot, own])
        if timer is not None:
            self._last_return = time.perf_counter()
            timer.add("send", self._last_return - t0)
        return logits, list(range(n_rows))

    def await_logits(self) -> torch.Tensor:
        """Wait until the oldest step not yet awaited has its logits; return them (the tensor
        `execute` returned for it, now valid). A host-side wait that watches the workers (see
        `_await_logits_event`).

        Raises:
            EngineDeadError: a worker failed, exited or timed out.
            RuntimeError: no step is waiting, or its ids are the output rank's (`await_ids`).
        """
        return self._await_step(False)

    def await_ids(self) -> tuple[list[int], list[int]]:
        """For a step whose ids the output rank chooses (``own_ids_hint`` asked for it): wait for the
        oldest step not yet awaited and return (its ids, one per logits row: the output rank's
        ``argmax(-1)`` or its sampler's draw; the rows its sampler drew again on the host, ascending:
        they were -1 in its ids buffer, so a step that read them there computed a wrong input)
        instead of logits, which never leave the output rank.

        Raises:
            EngineDeadError: a worker failed, exited or timed out.
            RuntimeError: no step is waiting, or its ids are not the output rank's.
        """
        return self._await_step(True)

    def _await_step(self, want_ids: bool):
        with self._lock:
            self._check_usable()
            timer = self._timer
            t0 = time.perf_counter() if timer is not None else 0.0
            while True:
                if not self._sent:
                    raise RuntimeError("no step sent (execute) and not awaited")
                n_rows, logits, orphan, slot, own = self._sent.popleft()
                if not orphan and own != want_ids:
                    raise RuntimeError(f"the step's ids {'are' if own else 'are not'} the output rank's: "
                                       f"use {'await_ids' if own else 'await_logits'}")
                msg, raw = self._next_message(MSG_OK)
                _, shape, _rows, in_buffer = msg
                if shape[0] != n_rows:
                    self._die(f"the output worker answered {shape[0]} logits rows, the plan has {n_rows}")
                if own:
                    _, ids, redrawn = self._next_message(MSG_IDS)[0]
                    if len(ids) != n_rows:
                        self._die(f"the output worker sent {len(ids)} ids for {n_rows} rows")
                    if not orphan:
                        self.num_rank_redrawn_rows += len(redrawn)
                    result = (ids, redrawn)
                elif in_buffer:
                    if not orphan:
                        self._await_logits_event(slot)
                    result = logits
                else:
                    if raw is None:
                        try:
                            raw = self._out_conn.recv_bytes()
                        except (EOFError, OSError):
                            self._die("the output worker closed its pipe while sending logits")
                    if raw and not orphan:
                        logits.view(-1).numpy()[:] = memoryview(raw).cast("f")
                    result = logits
                if not orphan:
                    break
            if timer is not None:
                t1 = self._last_return = time.perf_counter()
                timer.add("logits", t1 - t0)
            return result

    def publish_tokens(self, tokens: Optional[torch.Tensor]) -> None:
        """Hand the oldest unpublished step's sampled ids to the workers: ``tokens`` int64 ``[S]``
        (the sampler's device tensor, -1 allowed: clamped to 0 where read) or None when nothing
        reads them. On CUDA they are copied into the output rank's buffer on the current stream,
        behind everything queued there (the sampler, its copies out of the shared logits), and the
        front end's interprocess event is recorded; a plan waiting for them (``SYNC_GO``) gets its
        ("go", ...) message. Call once per step, after `await_logits`, in step order.

        Raises:
            EngineDeadError: a worker failed (its pipe is closed).
        """
        with self._lock:
            self._check_usable()
            if not self._unpub:
                raise RuntimeError("publish_tokens without an unpublished step")
            step = self._unpub.popleft()
            if step["self_read"]:
                tokens = None  # the next step read the output rank's own ids (SYNC_SELF)
                if step["own"]:
                    # Nothing was read out of the shared buffers: no device work at all here (this
                    # process's kernels would time-slice the output rank's GPU, module docstring).
                    return
            ids = None
            if self._tok_buf is not None:
                if tokens is not None and tokens.numel():
                    n = tokens.shape[0]
                    self._tok_buf[:n].copy_(tokens.to(self._tok_buf.device, non_blocking=True), non_blocking=True)
                self._tok_event.record()
                self._read_done.record()
            else:
                ids = tokens.tolist() if tokens is not None else []
            if self._go_pending and len(self._unpub) == 1:
                self._send_go(ids)
            else:
                self._ready_ids = ids

    def _send_go(self, ids: Optional[list]) -> None:
        self._go_pending = False
        self._go_sent.notify_all()
        try:
            self._out_conn.send_bytes(pickle.dumps((MSG_GO, ids), protocol=pickle.HIGHEST_PROTOCOL))
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._wait_for([self._out_conn], 5.0)
            self._die("the output worker closed its pipe")

    def abandon_steps(self) -> None:
        """Forget every step sent and not yet awaited or published (after an engine error dropped
        them): a plan still waiting for its ids is released with stale ones (its results are then
        read and discarded, like the others' answers). After the engine died only the bookkeeping
        is cleared (the workers are gone)."""
        with self._lock:
            self._abandon_steps()

    def _abandon_steps(self) -> None:
        if self._go_pending and self._dead is None and not self._closed:
            if self._tok_event is not None:
                self._tok_event.record()
            self._send_go(None if self._tok_buf is not None else [])
        self._go_pending = False
        for entry in self._sent:
            entry[2] = True
        self._unpub.clear()
        self._ready_ids = None

    def _stash_answer(self, msg) -> bool:
        """Keep a step answer or an own step's ids read from the output rank's pipe ahead of
        their `await_logits` / `await_ids` (while collecting step timing, or polling an earlier
        step's event: with ``SYNC_SELF`` the output rank runs a step ahead), with the logits bytes
        that follow an answer on the pipe. False when ``msg`` is neither (or no step is due)."""
        if msg[0] not in (MSG_OK, MSG_IDS) or not self._sent:
            return False
        if msg[0] == MSG_IDS:
            self._stash.append((msg, None))
            return True
        raw = None
        if not msg[3]:
            try:
                raw = self._out_conn.recv_bytes()
            except (EOFError, OSError):
                self._die("the output worker closed its pipe while sending logits")
        self._stash.append((msg, raw))
        return True

    def _next_message(self, kind: str) -> tuple:
        """(the output rank's next message of ``kind``, `MSG_OK` or `MSG_IDS`; the logits bytes that
        followed an answer if they were read with it, else None). Kept ones come first; the other
        kind met on the way is kept (an own step's ids may come after the next step's answer)."""
        for i, (msg, raw) in enumerate(self._stash):
            if msg[0] == kind:
                return self._stash.pop(i)
        while True:
            spin_poll(self._out_conn, self._spin)
            _, msg = self._wait_for([self._out_conn], self._step_timeout)
            if msg[0] == kind:
                return msg, None
            if not self._stash_answer(msg):
                self._die(f"unexpected message from the output worker: {msg[0]!r}")

    @property
    def _unpublished(self) -> int:
        """Steps sent whose sampled ids are not published yet."""
        return len(self._unpub)

    def _check_usable(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise EngineDeadError("tensor/pipeline-parallel engine stopped: it was shut down")

    def _execute(self, plan) -> tuple[torch.Tensor, list[int]]:
        self._check_usable()
        timer = self._timer
        if timer is not None:
            t0 = time.perf_counter()
            if self._last_return is not None:
                timer.add("host_between_steps", t0 - self._last_return)
        if self._read_done is not None:
            # The worker overwrites the shared buffer this step: the last copy out of it must be done
            # (normally long since: the sampler read its result).
            self._read_done.synchronize()
        mode = self.logits_mode
        data = pickle.dumps(("step", self._encoder.encode(plan), mode, None, (0, False)),
                            protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self._plan_conns:
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, ConnectionResetError, OSError):
                self._wait_for([conn], 5.0)  # collects the worker's error text if it left one
                self._die("a worker closed its pipe")
        if timer is not None:
            t1 = time.perf_counter()
            timer.add("send", t1 - t0)
        spin_poll(self._out_conn, self._spin)
        _, msg = self._wait_for([self._out_conn], self._step_timeout)
        if msg[0] != MSG_OK:
            self._die(f"unexpected message from the output worker: {msg[0]!r}")
        if timer is not None:
            t2 = time.perf_counter()
            timer.add("wait_answer", t2 - t1)
        _, shape, rows, in_buffer = msg
        if in_buffer:
            buf = self._logits_buf[0]
            if mode == LOGITS_EVENT:
                self._await_logits_event(0)
                self._logits_events[0].wait(torch.cuda.current_stream(buf.device))  # done already: ordering only
            logits = buf[:shape[0]].clone()
            self._read_done.record(torch.cuda.current_stream(buf.device))
        else:
            try:
                raw = self._out_conn.recv_bytes()
            except (EOFError, OSError):
                self._die("the output worker closed its pipe while sending logits")
            if not raw:
                logits = torch.empty(shape, dtype=torch.float32)
            else:
                logits = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(shape)
        if timer is not None:
            t3 = self._last_return = time.perf_counter()
            timer.add("logits", t3 - t2)
            timer.add("execute", t3 - t0)
        return logits, rows

    def _await_logits_event(self, slot: int) -> None:
        """Wait on the host until the output rank's step (its logits in ``slot``) is done, watching
        the workers meanwhile.

        The step's GPU work is never made to wait on the output rank's event device-side before the
        event is known complete: if a peer rank died mid-step (its NCCL collective then never ends),
        a stream waiting on that event would hang this process past every timeout, while a
        synchronising answer would have been caught by `_wait_for`. Here the event is polled, and
        the workers' process sentinels and pipes (error messages) are checked every ~0.2 ms, with
        the step timeout as the bound; the GIL is released between polls.

        Raises:
            EngineDeadError: a worker exited or reported an error, or the step timed out.
        """
        event = self._logits_events[slot]
        if event.query():
            return
        deadline = time.monotonic() + self._step_timeout
        sentinels = {p.sentinel: i for i, p in enumerate(self._procs)}
        watched = [c for c in self._conns if c is not None] + list(sentinels)
        check_at = time.perf_counter() + 2e-4
        while not event.query():
            now = time.perf_counter()
            if now < check_at:
                time.sleep(0)  # lets other threads (the server, output work) run
                continue
            check_at = now + 2e-4
            ready = mp_wait(watched, timeout=0)
            if self.defers_logits and any(r is self._out_conn for r in ready):
                ready = [r for r in ready if r is not self._out_conn]
                msg = self._recv(self._out_conn, False)  # a worker's error raises here
                if not self._stash_answer(msg):
                    self._die(f"unexpected message {msg[0]!r} from the output worker while its step ran")
            self._fail_on(ready, sentinels, False, " while its step ran")
            if time.monotonic() > deadline:
                self._die(f"the output worker's step did not finish within {self._step_timeout:.0f} s")

    def step_timing(self, reset: bool = False) -> dict:
        """Per-phase step times: ``{"front_end": summary, "ranks": {rank: summary}}``.

        Each summary is ``{phase: {"n", "mean_ms", "median_ms"}}`` (`StepTimer.summary`); empty unless
        ``KVPILOT_STEP_TIMING=1`` was set when the engine started. Front-end phases: ``send`` (encode,
        pickle and write the plan to every pipe), ``wait_answer`` (until the output rank's answer),
        ``logits`` (event wait and copy out of the shared buffer, or read from the pipe), ``execute``
        (all three), ``host_between_steps`` (from one step's return to the next call: sampling, output
        work, scheduling). Worker phases: ``idle`` (waiting for a plan), ``recv`` (read, unpickle,
        decode), ``prepare_launch`` (the rank's host work for the step, until every kernel is queued),
        ``answer`` (output rank: logits into the buffer or pipe and the answer; includes the GPU time
        when it synchronizes first), ``gpu_done_after_answer`` (output rank: GPU completion after an
        early answer), ``gpu_done`` (other GPU ranks: completion after launch), ``gpu_step`` and
        ``gpu_idle`` (device-side, from timing events: a step's time on the rank's stream, and the
        stream's idle time before it). Measuring ``gpu_done*`` synchronizes after the answer, never
        before it, and only on settled steps (on asynchronous ones it would stop a rank preparing the
        next step); asynchronous steps add ``await_logits`` waits to ``logits``. ``reset`` clears all samples after
        reading them. Safe to call while the engine runs (it waits for the step in flight). In a multi-node group
        only the leader pod's rank 0 reports.

        Raises:
            EngineDeadError: a worker failed.
        """
        with self._lock:
            return self._step_timing(reset)

    def _step_timing(self, reset: bool) -> dict:
        # A plan waiting for its ids (SYNC_GO) holds the other ranks in a collective with the output
        # rank, so they could not answer until `publish_tokens` sends the go, which needs the lock:
        # wait for it (the engine thread sends it within its step).
        deadline = time.monotonic() + self._step_timeout
        sentinels = {p.sentinel: i for i, p in enumerate(self._procs)}
        while getattr(self, "_go_pending", False) and self._dead is None and not self._closed:
            if time.monotonic() > deadline:
                self._die(f"no step's ids were published within {self._step_timeout:.0f} s")
            self._fail_on(mp_wait(list(sentinels), timeout=0), sentinels, False, " while a step waited for its ids")
            self._go_sent.wait(timeout=0.2)
        self._check_usable()
        front = self._timer.summary() if self._timer is not None else {}
        if self._timer is not None and reset:
            self._timer.reset()
            self._last_return = None
        data = pickle.dumps((MSG_TIMING, reset))
        for conn in self._plan_conns:
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, ConnectionResetError, OSError):
                self._wait_for([conn], 5.0)  # collects the worker's error text if it left one
                self._die("a worker closed its pipe")
        ranks = {}
        waiting = list(self._plan_conns)
        while waiting:
            conn, msg = self._wait_for(waiting, self._step_timeout)
            if conn is self._out_conn and self._stash_answer(msg):
                continue
            if msg[0] != MSG_TIMING:
                self._die(f"unexpected message {msg[0]!r} while collecting step timing")
            ranks[msg[1]] = msg[2]
            waiting = [c for c in waiting if c is not conn]
        return {"front_end": front, "ranks": ranks}

    def _wait_for(self, wanted: list, timeout: float, starting: bool = False):
        """(pipe, message) of the next message on one of ``wanted``; watch every pipe and process meanwhile."""
        deadline = time.monotonic() + timeout
        sentinels = {p.sentinel: i for i, p in enumerate(self._procs)}
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._die(f"no answer from the workers within {timeout:.0f} s")
            ready = mp_wait([c for c in self._conns if c is not None] + list(sentinels), timeout=min(left, 1.0))
            for conn in ready:
                if any(conn is w for w in wanted):
                    return conn, self._recv(conn, starting)  # an error message raises in _recv
            self._fail_on(ready, sentinels, starting)

    def _fail_on(self, ready: list, sentinels: dict, starting: bool, when: str = "") -> None:
        """Die for the first of ``ready`` (pipes and process sentinels that are not awaited): a worker
        that exited (with its own error text when it sent one) or an unexpected message; returns
        when ``ready`` is empty."""
        for obj in ready:
            if obj in sentinels:
                i = sentinels[obj]
                c = self._conns[i]
                if c is not None and c.poll(0.5):
                    self._recv(c, starting)  # dies with the worker's own error text when it sent one
                self._worker_gone(i, starting)
            msg = self._recv(obj, starting)  # an error message raises in _recv
            self._die(f"unexpected message {msg[0]!r} from a worker{when}")

    def _recv(self, conn, starting: bool):
        rank = self._conns.index(conn)
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            msg = None
        if msg is None:
            self._worker_gone(rank, starting)
        if msg[0] == MSG_ERROR:
            self._die(f"worker rank {msg[1]} failed:\n{msg[2]}")
        return msg

    def _worker_gone(self, rank: int, starting: bool):
        """Die for a worker that exited (or closed its pipe) without sending an error."""
        proc = self._procs[rank]
        proc.join(timeout=2)
        when = " while starting" if starting else ""
        hint = f"\n{_GUARD_HINT}" if starting else ""
        self._die(f"worker rank {rank} exited{when} with code {proc.exitcode} (its stderr has the details).{hint}")

    def _die(self, reason: str):
        """Mark the engine dead, stop every worker and the engine loop, raise `EngineDeadError`."""
        if self._dead is not None:
            raise self._dead  # the first cause is the one to report
        err = EngineDeadError(f"tensor/pipeline-parallel engine stopped: {reason}")
        logger.error("%s", err)
        self._dead = err
        self._terminate()
        llm = self._llm_ref()
        loop = getattr(llm, "_loop", None) if llm is not None else None
        if loop is not None:  # later submissions fail at once, with this error
            loop.error = err
            loop.inbox.put(("stop", None))
        raise err

    # ---- lifecycle -----------------------------------------------------------------------------
    def _terminate(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def shutdown(self) -> None:
        """Ask the workers to stop, then terminate any that do not within 10 s; idempotent."""
        if self._closed:
            return
        if getattr(self, "_timer", None) is not None and self._timer.samples:
            logger.info("front-end step timing: %s", self._timer.summary())
        if getattr(self, "_go_pending", False) and self._dead is None and self._lock.acquire(timeout=1.0):
            # The output rank waits for ids while its peers wait for it in a collective: release the
            # step so that every rank reads the stop. Not if another thread holds the pipes (a step
            # stuck on a hung worker): the workers are terminated below anyway.
            try:
                self._abandon_steps()
            except Exception:  # noqa: BLE001 - stopping anyway
                pass
            finally:
                self._lock.release()
        self._closed = True
        stop = pickle.dumps(None)
        for conn in getattr(self, "_plan_conns", self._conns):
            try:
                conn.send_bytes(stop)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 10
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self._terminate()
        for conn in self._conns:
            if conn is not None:
                conn.close()


def run_lws_worker(model: str, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                   max_batch_size: int = 256, max_num_tokens: int = 8192, max_seq_len: Optional[int] = None,
                   kv_cache_config: Optional[KvCacheConfig] = None, device: str = "auto", dtype: str = "auto",
                   group: Optional[LwsGroup] = None, revision: Optional[str] = None, quant_config=None,
                   lora_config=None) -> int:
    """Run this pod's ranks of a LeaderWorkerSet group until the leader stops; returns an exit status.

    ``kvpilot serve`` calls this instead of building an `LLM` when ``LWS_WORKER_INDEX`` > 0. The
    arguments must equal the leader's (the operator renders the same command for every pod).

    Raises:
        ValueError: not in a LeaderWorkerSet group (or in it as the leader), or a bad layout.
    """
    group = group or LwsGroup.from_env()
    if group is None or group.index == 0:
        raise ValueError("run_lws_worker runs on LeaderWorkerSet workers (LWS_GROUP_SIZE > 1, LWS_WORKER_INDEX > 0)")
    from kvpilot.model.hub import resolve_model

    model_dir = resolve_model(str(model), revision)  # the leader's snapshot (same id and revision)
    cfg = ModelConfig.from_dir(model_dir)
    kv_cache_config = kv_cache_config or KvCacheConfig()
    if quant_config is not None:  # as `kvpilot.LLM` applies it on the leader
        if quant_config.quant_algo:
            cfg.quantization = quant_config.to_dict()
        kv_cache_config = dataclasses.replace(kv_cache_config, dtype=quant_config.kv_cache_dtype(kv_cache_config))
    spec = make_worker_spec(model_dir, cfg, kv_cache_config, max_num_tokens, max_batch_size,
                            int(max_seq_len or cfg.max_position_embeddings), device, dtype, tensor_parallel_size,
                            pipeline_parallel_size, group, lora_config)
    first = group.index * spec.ranks_per_node
    procs, _ = _start_ranks(spec, range(first, first + spec.ranks_per_node), with_pipes=False)
    logger.info("LeaderWorkerSet worker %d: ranks %d..%d started", group.index, first, first + len(procs) - 1)
    status = 0
    pending = {p.sentinel: p for p in procs}
    while pending:
        for s in mp_wait(list(pending)):
            p = pending.pop(s)
            if p.exitcode:
                logger.error("rank process %s exited with code %s; stopping this pod's ranks", p.name, p.exitcode)
                status = 1
                for q in pending.values():
                    q.terminate()
    return status
