"""`Tuning`: the engine's performance switches, in one frozen record.

Each field selects between code paths that compute the same result (or, for the tensor-parallel
exactness fields, a result that is the same across layouts) at different speeds. The defaults are
the measured winners (BENCHMARKS.md); no user needs to change them. Benchmarks and tests A/B a
field by passing ``LLM(..., tuning=Tuning(field=value))``, or, for an engine in another process,
through the one validated hook ``KVPILOT_TUNING`` (a JSON object of fields, `kvpilot.envs`), which
`LLM` reads once when ``tuning`` is not given. The record then flows explicitly: `LLM` ->
`kvpilot.core.engine_core.EngineCore`, `kvpilot.runner.model_runner.ModelRunner` (model, CUDA
graphs, sampler) and, with tensor/pipeline parallelism, `kvpilot.parallel.executor.MultiprocExecutor`
-> `kvpilot.parallel.worker.WorkerSpec` -> every worker. No component reads the environment for it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

DEFAULT_PREFILL_GRAPH_TOKENS = 256


@dataclass(frozen=True)
class Tuning:
    """Performance switches of one engine (module docstring). Defaults: the measured winners.

    Single-GPU runner (`ModelRunner`, `kvpilot.runner.cuda_graphs`):
        cuda_graphs: capture and replay CUDA graphs (False: every step eager; debugging and
            eager-against-graph equality checks). Measured: prefix-cache TTFT 33.5 ms with graphs
            against 104.3 ms eager (BENCHMARKS.md).
        prefill_graphs: also graph prefill and mixed steps (False: only decode steps replay).
        prefill_graph_tokens: the largest step, in tokens, a prefill graph covers (>= 1).
        lm_head_in_graph: replay the LM head inside the decode graphs (False: it runs eagerly after).
        warmup: run `ModelRunner.warm_up_eager` at start-up (the Triton compiles of eager mixed
            steps happen before the first request instead of during it).

    Model (`kvpilot.model`):
        fused_gemv: batch-1 decode runs the fused RMSNorm/SiLU + GEMV kernels of kernels/gemv.py
            (False: unfused RMSNorm/SiLU + matmul, as at larger batches).
        tp_reduce_fp32: tensor-parallel row-parallel outputs are summed in float32 and rounded once
            (False: 16-bit partial sums, NCCL's default). Ignored when ``tp_invariant`` is set.
        tp_invariant: 0 (off) or ``T``: every tensor-parallel size dividing ``T`` (one GPU included)
            computes ``T``'s decomposition, so greedy output is the same across those layouts
            (kvpilot/model/tp_invariant.py; docs/parallelism.md). ``T`` must divide the model's head
            counts and intermediate size.

    Sampling (`kvpilot.sampling.sampler`, kernels/sampling.py):
        triton_sampler: the sort-free Triton sampler and arg-max on CUDA (False: the PyTorch path).
        sampling_check: the Triton sampler's pivot kernels clamp and record out-of-range indices
            (a diagnostic; slower).

    Engine loop (`EngineCore`):
        async_output: a step's output work (detokenization, stop checks) overlaps the next step.
        async_scheduling: plan and launch step N+1 before reading step N's sampled ids; None: on
            with a CUDA executor, off on CPU.

    Tensor/pipeline parallelism (`kvpilot.parallel`):
        tp_async: the front end sends step N+1 before it samples step N.
        tp_rank_sampling: with asynchronous tensor-parallel steps, the output rank draws the tokens
            of steps it can sample exactly as the front end would.
        pp_microbatch: pipeline stages cut a step into micro-batches.
        tp_cuda_graphs, pp_cuda_graphs: ranks holding a tensor-parallel shard / pipeline stages
            capture decode CUDA graphs (``cuda_graphs`` False turns off every graph).
        tp_custom_allreduce: two-GPU tensor parallelism uses the one-shot all-reduce kernel of
            kernels/allreduce.py for small all-reduces (False: NCCL for every all-reduce).
        tp_custom_allreduce_max_tokens: the largest all-reduce, in tokens, the one-shot kernel
            takes (None: `kvpilot.parallel.custom_all_reduce.DEFAULT_MAX_TOKENS`, capped by memory).
        logits_ipc: on one GPU node the output rank shares its logits with the front end through
            a CUDA IPC buffer (False: logits cross the pipe as bytes).
        logits_event: with ``logits_ipc``, the output rank answers right after launching a step
            and the front end waits on an interprocess CUDA event (False: the rank synchronizes
            before answering).
        pipe_spin_us: how long a wait on a worker pipe polls before it sleeps (us; None: 1,000 on
            GPUs, 0 on CPU).
        go_spin_us: how long the output rank polls for a step's sampled ids before it sleeps (us;
            None: 50,000 on GPUs, 0 on CPU).
        step_timing: record per-phase step times in the front end and workers (`step_timings`).

    Raises:
        TypeError: a field of the wrong type.
        ValueError: a value out of range.
    """

    cuda_graphs: bool = True
    prefill_graphs: bool = True
    prefill_graph_tokens: int = DEFAULT_PREFILL_GRAPH_TOKENS
    lm_head_in_graph: bool = True
    warmup: bool = True
    fused_gemv: bool = True
    tp_reduce_fp32: bool = False
    tp_invariant: int = 0
    triton_sampler: bool = True
    sampling_check: bool = False
    async_output: bool = True
    async_scheduling: Optional[bool] = None
    tp_async: bool = True
    tp_rank_sampling: bool = True
    pp_microbatch: bool = True
    tp_cuda_graphs: bool = True
    pp_cuda_graphs: bool = True
    tp_custom_allreduce: bool = True
    tp_custom_allreduce_max_tokens: Optional[int] = None
    logits_ipc: bool = True
    logits_event: bool = True
    pipe_spin_us: Optional[float] = None
    go_spin_us: Optional[float] = None
    step_timing: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            _check_type(f.name, f.type, value)
        if self.prefill_graph_tokens < 1:
            raise ValueError(f"Tuning.prefill_graph_tokens must be >= 1, got {self.prefill_graph_tokens}")
        if self.tp_invariant < 0:
            raise ValueError(f"Tuning.tp_invariant must be >= 0 (0 = off), got {self.tp_invariant}")
        if self.tp_custom_allreduce_max_tokens is not None and self.tp_custom_allreduce_max_tokens < 1:
            raise ValueError(f"Tuning.tp_custom_allreduce_max_tokens must be >= 1 or None, "
                             f"got {self.tp_custom_allreduce_max_tokens}")
        for name in ("pipe_spin_us", "go_spin_us"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"Tuning.{name} must be >= 0 or None, got {value}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], base: Optional["Tuning"] = None) -> "Tuning":
        """``base`` (default: the defaults) with the fields of ``values`` replaced.

        Raises:
            ValueError: a key that is not a field (the message lists the fields), or a bad value.
            TypeError: a value of the wrong type.
        """
        if not isinstance(values, Mapping):
            raise TypeError(f"tuning overrides must be a mapping of field names, got {type(values).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown Tuning fields {unknown}; known: {sorted(names)}")
        return dataclasses.replace(base or cls(), **dict(values))

    @classmethod
    def from_json(cls, text: str, source: str = "KVPILOT_TUNING") -> "Tuning":
        """The record of a JSON object of overrides, e.g. ``'{"fused_gemv": false}'``.

        Raises:
            ValueError: not JSON, not an object, an unknown field or a bad value; the message names
                ``source``.
        """
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source} is not JSON: {e}") from None
        if not isinstance(values, dict):
            raise ValueError(f"{source} must be a JSON object of Tuning fields, got {type(values).__name__}")
        try:
            return cls.from_dict(values)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def from_env(cls) -> "Tuning":
        """The defaults overridden by ``KVPILOT_TUNING`` when it is set (`kvpilot.envs.tuning_json`)."""
        from kvpilot import envs

        text = envs.tuning_json()
        return cls() if text is None else cls.from_json(text)

    def overrides(self) -> dict[str, Any]:
        """The fields that differ from the defaults, by name (for logs and benchmark reports)."""
        default = Tuning()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)}

    def to_json(self) -> str:
        """`overrides` as the JSON text `from_json` reads (a ``KVPILOT_TUNING`` value)."""
        return json.dumps(self.overrides(), sort_keys=True)


_TYPES = {"bool": (bool,), "int": (int,), "float": (int, float)}


def _check_type(name: str, annotation: str, value: Any) -> None:
    kind = annotation.replace("Optional[", "").rstrip("]")
    if annotation.startswith("Optional[") and value is None:
        return
    ok = isinstance(value, _TYPES[kind]) and (kind == "bool" or not isinstance(value, bool))
    if not ok:
        raise TypeError(f"Tuning.{name} must be {annotation}, got {value!r}")


def parse_overrides(text: str) -> Tuning:
    """A record from ``name=value,name=value`` (benchmark command lines; values as JSON literals
    or ``1/0/true/false/on/off/yes/no``), e.g. ``"tp_async=0,pipe_spin_us=0"``.

    Raises:
        ValueError: a malformed pair, an unknown field or a bad value.
    """
    values: dict[str, Any] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        name, sep, raw = pair.partition("=")
        if not sep:
            raise ValueError(f"tuning override {pair!r} is not name=value")
        name = name.strip()
        values[name] = _literal(name, raw.strip())
    return Tuning.from_dict(values)


def _literal(name: str, raw: str) -> Any:
    field_type = next((f.type for f in fields(Tuning) if f.name == name), None)
    if field_type is None:
        raise ValueError(f"unknown Tuning field {name!r}; known: {sorted(f.name for f in fields(Tuning))}")
    if raw.lower() in ("none", "null"):
        return None
    if "bool" in field_type:
        from kvpilot.envs import parse_bool

        return parse_bool(name, raw)
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise ValueError(f"tuning override {name}={raw!r}: expected a number") from None
