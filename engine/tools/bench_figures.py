"""``kvpilot bench all`` and one subcommand per figure of BENCHMARKS.md's current-results table.

Every figure runs on the random-weight Llama-3.1-8B-shaped checkpoint (`kvpilot.tools.random_model`;
the weights' values do not change speed), written once to ``--model-dir`` in bf16 and reused. The
engine runs with these named settings, the ones every figure of the table was measured with:
``max_batch_size=512, max_num_tokens=8192, max_seq_len=33024, free_gpu_memory_fraction=0.9``, an
FP8 KV cache (``KvCacheConfig(dtype="fp8")``) unless the figure says bf16; everything else is the
engine's default (CUDA graphs, async scheduling, fused kernels).

Figures (``FIGURES``; each returns table rows, see `Row`):

- ``prefill``: one 8,192-token prefill step (the runner's own step, nothing cached) in TFLOP/s, and
  as % of the bf16 matmul rate measured in the same run (an 8192^3 product).
- ``decode-b1``: batch-1 inter-token latency (ITL) of 128 prompt + 512 generated tokens, median of 3,
  against the bandwidth floor (weights read per step + the mean KV bytes read) / the device-to-device
  copy rate measured in the same run; also as % of the floor speed (floor ITL / ITL; target 85%).
- ``ttft``: time to first token of a cold 4,032-token prompt, and of a request whose 4,000-token
  prefix is already cached (prefix reuse; target 10x faster), medians of 3 fresh prefixes.
- ``batch64``: 64 requests of 512 prompt tokens, 256 generated each, all in flight: output tok/s.
- ``offline``: 1,000 x (1,000 in + 1,000 out), FP8 KV, requests in flight as the KV pool holds at
  full length (`kvpilot.tools.bench_offline.run_throughput`): output tok/s (target 12,000).
- ``http``: the OpenAI-compatible HTTP server in this process (uvicorn on a free local port) driven
  by `kvpilot.tools.bench` (streamed ``/v1/completions``, token-id prompts of 128 tokens, 128
  output tokens, ``ignore_eos``), at concurrency 1 and 64: output tok/s, TTFT p50, ITL p50.
- ``offline-bf16``: ``offline`` with a bf16 KV cache.
- ``capacity``: KV-cache pool tokens of the bf16-KV engine and of the FP8 one (when it ran), against
  ``0.9 x free bytes after the profiling pass / bytes per token``.
- ``accuracy``: kvpilot against transformers (float32, CPU or GPU) on a random model of Llama-3.1-8B's
  layer shape with ``--accuracy-layers`` layers: relative L2 error of the prefill logits
  (``||kvpilot - hf|| / ||hf||``) and the share of prompts whose greedy tokens are identical.

``kvpilot bench all`` runs the figures in one process, in `FIGURES` order (one FP8-KV engine, then one
bf16-KV engine, then the accuracy check's float32 engine and transformers), each in its own ``try``:
a failure prints an error row and the next figure runs. Results go to ``--out`` (JSON, rewritten after every figure, so a run cut short keeps what it measured).
``--quick`` shrinks the workloads (figures then differ from the table's: for a smoke test on a GPU);
``--dry-run`` runs every figure on a tiny random Llama on the CPU in seconds (what CI tests).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIR = "/tmp/kvpilot-llama8b-random"


class BenchSetupError(RuntimeError):
    """The benchmarks cannot start here (no CUDA GPU for the full figures)."""


@dataclass
class Row:
    """One line of the results table.

    ``value`` is NaN on an error row (``error`` then says why); ``reference`` is the floor or target
    the value is read against (text, may be empty).
    """

    figure: str
    metric: str
    value: float
    unit: str
    reference: str = ""
    error: str = ""


@dataclass
class Sizes:
    """Workload sizes of one mode (full: the table's; quick: a GPU smoke test; dry: CPU seconds)."""

    decode_in: int = 128
    decode_out: int = 512
    decode_iters: int = 3
    prefix_len: int = 4000
    question_len: int = 32
    ttft_trials: int = 3
    prefill_len: int = 8192
    matmul_n: int = 8192
    b64_requests: int = 64
    b64_in: int = 512
    b64_out: int = 256
    serve_len: int = 128
    serve_out: int = 128
    serve_concurrency: tuple[int, ...] = (1, 64)
    serve_requests: tuple[int, ...] = (8, 256)
    offline_prompts: int = 1000
    offline_in: int = 1000
    offline_out: int = 1000
    accuracy_prompts: int = 8
    accuracy_prompt_len: int = 64
    accuracy_steps: int = 32
    accuracy_prefill_len: int = 512
    copy_bytes: int = 1 << 30


QUICK = Sizes(decode_out=128, ttft_trials=2, prefill_len=4096, serve_requests=(4, 128), offline_prompts=200,
              accuracy_prompts=4, accuracy_steps=16)
DRY = Sizes(decode_in=16, decode_out=16, decode_iters=2, prefix_len=96, question_len=8, ttft_trials=2, prefill_len=128,
            matmul_n=256, b64_requests=8, b64_in=24, b64_out=12, serve_len=16, serve_out=8, serve_concurrency=(1, 4),
            serve_requests=(2, 8), offline_prompts=12, offline_in=24, offline_out=16, accuracy_prompts=3,
            accuracy_prompt_len=12, accuracy_steps=8, accuracy_prefill_len=32, copy_bytes=1 << 22)


@dataclass
class Context:
    """What the figures share in one process: settings, the model, the measured ceilings, one engine."""

    device: str
    model_dir: Path
    cfg: dict
    sizes: Sizes
    dry_run: bool
    accuracy_layers: int = 2
    max_batch_size: int = 512
    max_seq_len: int = 32768 + 256
    results: dict = field(default_factory=dict)
    _engine: Any = None
    _engine_kv: str = ""
    _copy_bps: Optional[float] = None
    _matmul: Optional[float] = None

    def engine(self, kv_dtype: str):
        """The engine with a ``kv_dtype`` cache ("fp8" or "auto"); another dtype's engine is shut down first."""
        if self._engine is not None and self._engine_kv == kv_dtype:
            return self._engine
        self.close()
        from kvpilot import LLM, KvCacheConfig

        if self.dry_run:
            kv = KvCacheConfig(max_tokens=8192, dtype=kv_dtype)
        else:
            kv = KvCacheConfig(free_gpu_memory_fraction=0.9, dtype=kv_dtype)
        t0 = time.perf_counter()
        self._engine = LLM(str(self.model_dir), skip_tokenizer_init=True, device=self.device,
                           max_batch_size=self.max_batch_size, max_num_tokens=8192, max_seq_len=self.max_seq_len,
                           kv_cache_config=kv)
        self._engine_kv = kv_dtype
        runner = self._engine._executor
        self.results.setdefault("engines", {})[kv_dtype] = {
            "load_s": time.perf_counter() - t0, "pool_tokens": self._engine.pool_tokens,
            "bytes_per_token": runner.bytes_per_block // runner.block_size,
            "free_bytes_for_kv": getattr(runner, "free_bytes_for_kv", None)}
        logger.info("engine (%s KV) ready in %.1f s", kv_dtype, time.perf_counter() - t0)
        return self._engine

    def close(self) -> None:
        """Shut the engine down and free its memory (a no-op without one)."""
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
            _empty_cache(self.device)

    def copy_rate(self) -> float:
        if self._copy_bps is None:
            self._copy_bps = copy_bandwidth(self.device, self.sizes.copy_bytes)
            self.results["copy_bandwidth_Bps"] = self._copy_bps
        return self._copy_bps

    def matmul_rate(self) -> float:
        if self._matmul is None:
            self._matmul = matmul_flops(self.device, self.sizes.matmul_n)
            self.results["matmul_flops_per_s"] = self._matmul
        return self._matmul

    def weight_bytes_read(self, llm) -> int:
        """Bytes of weights one decode step reads: all but the embedding table (one row of it is read)."""
        runner = llm._executor
        emb = runner.model.embed_tokens.weight
        return runner.weight_bytes - emb.numel() * emb.element_size() + emb.shape[1] * emb.element_size()


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _empty_cache(device: str) -> None:
    """Free what a shut-down engine held: collect its reference cycles, then return cached GPU memory
    (the next engine sizes its KV pool from the free memory)."""
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def copy_bandwidth(device: str = "cuda", nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes`` (read + write counted), best of 3 x 10 copies."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    best = math.inf
    for _ in range(3):
        _sync(device)
        t = time.perf_counter()
        for _ in range(10):
            b.copy_(a)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes * 10 / best


def matmul_flops(device: str = "cuda", n: int = 8192) -> float:
    """FLOP/s of an ``n x n x n`` matrix product (bf16 on a GPU, float32 on the CPU), best of 3 x 5."""
    import torch

    dt = torch.bfloat16 if device.startswith("cuda") else torch.float32
    x, y = (torch.randn(n, n, device=device, dtype=dt) for _ in range(2))
    for _ in range(2):
        x @ y
    best = math.inf
    for _ in range(3):
        _sync(device)
        t = time.perf_counter()
        for _ in range(5):
            x @ y
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 * 5 / best


def prefill_flops(cfg: dict, tokens: int) -> float:
    """Forward FLOPs of a ``tokens``-token causal prefill: 2 x the matrix weights per token, causal
    attention (QK^T and PV over T(T+1)/2 pairs per head), the LM head for the last token only."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    nh, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh
    per_tok = layers * (h * (nh + 2 * kvh) * hd + nh * hd * h + 3 * h * inter)
    attn = layers * 2 * 2 * nh * hd * tokens * (tokens + 1) / 2
    return 2 * per_tok * tokens + attn + 2 * h * cfg["vocab_size"]


def _prompts(ctx: Context, num: int, length: int, seed: int) -> list[list[int]]:
    from kvpilot.tools.bench_offline import random_prompts

    return random_prompts(num, length, ctx.cfg["vocab_size"], seed=seed)


# ---- figures -------------------------------------------------------------------------------------

def fig_accuracy(ctx: Context) -> list[Row]:
    """kvpilot vs transformers, float32, same random weights: prefill logits and greedy tokens."""
    import torch
    from transformers import LlamaForCausalLM

    from kvpilot import LLM, KvCacheConfig, SamplingParams
    from kvpilot.runner.batch import ScheduledSeq
    from kvpilot.tools.random_model import write_random_llama

    ctx.close()  # the shared engine holds most of the GPU's memory
    s = ctx.sizes
    cfg = dict(ctx.cfg, num_hidden_layers=min(ctx.accuracy_layers, ctx.cfg["num_hidden_layers"]))
    with tempfile.TemporaryDirectory(prefix="kvpilot-accuracy-") as tmp:
        path = write_random_llama(Path(tmp), cfg, dtype=torch.bfloat16, device=ctx.device, seed=1)
        long = _prompts(ctx, 1, s.accuracy_prefill_len, seed=512)[0]
        prompts = _prompts(ctx, s.accuracy_prompts, s.accuracy_prompt_len, seed=32)
        llm = LLM(str(path), skip_tokenizer_init=True, device=ctx.device, dtype="float32",
                  max_batch_size=max(8, s.accuracy_prompts), max_num_tokens=max(2048, s.accuracy_prefill_len),
                  max_seq_len=max(1024, s.accuracy_prefill_len + 8),
                  kv_cache_config=KvCacheConfig(max_tokens=16384))
        try:
            runner = llm._executor
            blocks = list(range(-(-len(long) // runner.block_size)))
            logits, _ = runner.execute([ScheduledSeq(-1, list(long), 0, blocks, True, True)])
            kv_logits = logits.float().cpu().clone()
            sp = SamplingParams(temperature=0, max_tokens=s.accuracy_steps, ignore_eos=True, detokenize=False)
            kv_greedy = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
        finally:
            llm.shutdown()
        del llm, runner, logits
        _empty_cache(ctx.device)
        hf = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
        hf = hf.to(ctx.device).eval()
        with torch.no_grad():
            ref = hf(torch.tensor([long], device=ctx.device)).logits[0].float().cpu()
            batch = torch.tensor(prompts, device=ctx.device)
            gen = hf.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False,
                              max_new_tokens=s.accuracy_steps, min_new_tokens=s.accuracy_steps,
                              eos_token_id=None, pad_token_id=0)
        hf_greedy = gen[:, batch.shape[1]:].tolist()
        del hf
        _empty_cache(ctx.device)
    rel = float((kv_logits - ref).norm() / ref.norm())
    same = sum(a == b for a, b in zip(kv_greedy, hf_greedy)) / len(prompts)
    ctx.results["accuracy"] = {"layers": cfg["num_hidden_layers"], "prefill_tokens": len(long),
                               "logits_rel_l2": rel, "greedy_identical": same, "prompts": len(prompts),
                               "steps": s.accuracy_steps}
    n = cfg["num_hidden_layers"]
    return [Row("accuracy", f"float32 prefill logits vs transformers ({n} layers)", rel, "rel L2", "< 2e-2"),
            Row("accuracy", f"float32 greedy tokens identical to transformers ({len(prompts)} x {s.accuracy_steps})",
                100 * same, "%", ">= 90%")]


def fig_decode_b1(ctx: Context) -> list[Row]:
    """Batch-1 ITL against the bandwidth floor, FP8 KV."""
    from kvpilot.tools.bench_offline import run_latency

    s = ctx.sizes
    llm = ctx.engine("fp8")
    runner = llm._executor
    per_tok = runner.bytes_per_block // runner.block_size
    lat = run_latency(llm, s.decode_in, s.decode_out, batch_size=1, num_iters=s.decode_iters, num_warmup=1,
                      seed=128)
    floor = (ctx.weight_bytes_read(llm) + per_tok * (s.decode_in + (s.decode_out - 1) / 2)) / ctx.copy_rate()
    pct = 100 * floor / lat["itl_s"]
    lat.update(floor_itl_s=floor, pct_of_floor_speed=pct, copy_bandwidth_Bps=ctx.copy_rate())
    ctx.results["decode-b1"] = lat
    return [Row("decode-b1", f"batch-1 ITL, {s.decode_in} in / {s.decode_out} out, FP8 KV", 1e3 * lat["itl_s"], "ms",
                f"floor {1e3 * floor:.3f} ms (copy {ctx.copy_rate() / 1e12:.3f} TB/s)"),
            Row("decode-b1", "batch-1 decode speed, % of the bandwidth floor", pct, "%", "target 85%"),
            Row("decode-b1", f"batch-1 TTFT, {s.decode_in}-token prompt", 1e3 * lat["ttft_s"], "ms")]


def fig_ttft(ctx: Context) -> list[Row]:
    """Cold TTFT of a long prompt against the same prefix cached."""
    from kvpilot import SamplingParams

    s = ctx.sizes
    llm = ctx.engine("fp8")
    params = SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False)

    def ttft(prompt: list[int]) -> float:
        out = llm.generate_async(prompt, params)
        out.result()
        return out.metrics.first_token_time - out.metrics.arrival_time

    ttft(_prompts(ctx, 1, s.prefix_len + s.question_len, seed=4999)[0])  # warm-up, another prefix
    cold, warm = [], []
    for t in range(s.ttft_trials):
        prefix = _prompts(ctx, 1, s.prefix_len, seed=5000 + t)[0]
        q1, q2 = _prompts(ctx, 2, s.question_len, seed=6000 + t)
        cold.append(ttft(prefix + q1))
        warm.append(ttft(prefix + q2))
    c, w = statistics.median(cold), statistics.median(warm)
    ctx.results["ttft"] = {"prefix_len": s.prefix_len, "question_len": s.question_len, "cold_s": cold, "warm_s": warm}
    n = s.prefix_len + s.question_len
    return [Row("ttft", f"TTFT, {n}-token prompt, nothing cached", 1e3 * c, "ms"),
            Row("ttft", f"TTFT, same {s.prefix_len}-token prefix cached", 1e3 * w, "ms"),
            Row("ttft", "prefix-reuse speed-up of the first token", c / w, "x", "target 10x")]


def fig_prefill(ctx: Context) -> list[Row]:
    """One long prefill step of the runner, TFLOP/s against the measured matmul rate.

    Runs the runner directly on KV blocks 0.. (overwriting them), so it goes first on a fresh engine,
    before any request could leave a cached prefix there.
    """
    from kvpilot.runner.batch import ScheduledSeq

    s = ctx.sizes
    llm = ctx.engine("fp8")
    runner = llm._executor
    mm = ctx.matmul_rate()
    if llm.pool_tokens < s.prefill_len:
        raise RuntimeError(f"the KV pool ({llm.pool_tokens} tokens) cannot hold a {s.prefill_len}-token prefill")
    blocks = list(range(-(-s.prefill_len // runner.block_size)))
    times = []
    for it in range(4):
        seq = ScheduledSeq(-100 - it, _prompts(ctx, 1, s.prefill_len, seed=9000 + it)[0], 0, blocks, True)
        _sync(ctx.device)
        t = time.perf_counter()
        runner.execute([seq])[0].argmax(-1).tolist()
        times.append(time.perf_counter() - t)
    t_med = statistics.median(times[1:])
    flops = prefill_flops(ctx.cfg, s.prefill_len) / t_med
    ctx.results["prefill"] = {"tokens": s.prefill_len, "seconds": times, "flops_per_s": flops, "matmul_flops_per_s": mm}
    return [Row("prefill", f"{s.prefill_len}-token prefill step", flops / 1e12, "TFLOP/s",
                f"matmul {mm / 1e12:.1f} TFLOP/s"),
            Row("prefill", "prefill, % of the measured matmul rate", 100 * flops / mm, "%")]


def fig_batch64(ctx: Context) -> list[Row]:
    """64 requests at once, 512 in / 256 out, FP8 KV."""
    from kvpilot.tools.bench_offline import run_throughput

    s = ctx.sizes
    llm = ctx.engine("fp8")
    # warm-up on other prompts: the same ones would leave their blocks in the prefix cache
    run_throughput(llm, _prompts(ctx, 8, s.b64_in, seed=65), 16, max_concurrency=8)
    r = run_throughput(llm, _prompts(ctx, s.b64_requests, s.b64_in, seed=64), s.b64_out,
                       max_concurrency=s.b64_requests)
    ctx.results["batch64"] = r
    return [Row("batch64", f"batch {s.b64_requests} x ({s.b64_in} in + {s.b64_out} out), FP8 KV",
                r["output_tokens_per_s"], "output tok/s")]


def fig_serve(ctx: Context) -> list[Row]:
    """The HTTP server in this process, driven by `kvpilot bench serve`'s client."""
    import asyncio

    import uvicorn

    from kvpilot.server.app import attach_engine, create_app
    from kvpilot.server.launcher import free_port
    from kvpilot.server.state import ServerState
    from kvpilot.tools.bench_serve import run_serve_benchmark, summarize

    s = ctx.sizes
    llm = ctx.engine("fp8")
    state = ServerState(served_model_name="bench", model_path=str(ctx.model_dir))
    loggers = llm._loop.stat_loggers
    n_loggers = len(loggers)
    attach_engine(state, llm)  # its Prometheus stat logger is taken off again below
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="bench-serve", daemon=True)
    thread.start()
    rows, runs = [], []
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on port {port} did not start")
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        logging.getLogger("httpx").setLevel(logging.WARNING)
        asyncio.run(run_serve_benchmark(url, "bench", _prompts(ctx, 2, s.serve_len, seed=799), 1, s.serve_out))
        for conc, num in zip(s.serve_concurrency, s.serve_requests):
            prompts = _prompts(ctx, num, s.serve_len, seed=800 + conc)
            results, duration = asyncio.run(run_serve_benchmark(url, "bench", prompts, conc, s.serve_out))
            summ = summarize(results, duration)
            if summ["failed"]:
                first = next(r.error for r in results if not r.ok)
                raise RuntimeError(f"{summ['failed']} of {len(results)} requests failed: {first}")
            runs.append({"concurrency": conc, **summ})
            label = f"HTTP, concurrency {conc}, {s.serve_len} in / {s.serve_out} out"
            rows += [Row("http", f"{label}: output throughput", summ["output_token_throughput"], "output tok/s"),
                     Row("http", f"{label}: TTFT p50", summ["ttft_ms"]["p50"], "ms"),
                     Row("http", f"{label}: ITL p50", summ["itl_ms"]["p50"], "ms")]
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        del loggers[n_loggers:]
        ctx.results["http"] = runs
    return rows


class StepLog:
    """A stat logger (`LLM.add_stat_logger`) splitting a run's steps into decode-only steps and steps
    that carry prefill tokens: count, seconds, mean step time and batch (where an offline run's time goes)."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, int, int, int]] = []
        self.lock = threading.Lock()
        self.on = False

    def __call__(self, s) -> None:
        if self.on and s.num_scheduled_tokens:
            with self.lock:
                self.rows.append((s.iter_latency_s, s.num_scheduled_tokens, s.num_context_requests,
                                  s.num_generation_requests))

    def summary(self) -> dict:
        def part(rows):
            if not rows:
                return {"steps": 0}
            return {"steps": len(rows), "seconds": sum(r[0] for r in rows),
                    "mean_ms": 1e3 * statistics.fmean(r[0] for r in rows),
                    "mean_tokens": statistics.fmean(r[1] for r in rows),
                    "mean_generation_requests": statistics.fmean(r[3] for r in rows)}

        with self.lock:
            rows = list(self.rows)
        return {"decode_only": part([r for r in rows if r[2] == 0]),
                "with_prefill": part([r for r in rows if r[2] > 0])}


def _offline(ctx: Context, kv_dtype: str, name: str) -> list[Row]:
    from kvpilot.tools.bench_offline import run_throughput

    s = ctx.sizes
    llm = ctx.engine(kv_dtype)
    log = StepLog()
    loggers = llm._loop.stat_loggers
    n_loggers = len(loggers)
    llm.add_stat_logger(log)
    try:
        log.on = True
        r = run_throughput(llm, _prompts(ctx, s.offline_prompts, s.offline_in, seed=1), s.offline_out)
        log.on = False
    finally:
        del loggers[n_loggers:]
    r["steps"] = log.summary()
    ctx.results[name] = r
    label = "FP8" if kv_dtype == "fp8" else ("bf16" if not ctx.dry_run else "model-dtype")
    rows = [Row(name, f"offline {s.offline_prompts} x ({s.offline_in} in + {s.offline_out} out), {label} KV",
                r["output_tokens_per_s"], "output tok/s",
                "target 12,000" if kv_dtype == "fp8" else f"{r['max_concurrency']} in flight")]
    d = r["steps"]["decode_only"]
    if d["steps"]:
        rows.append(Row(name, f"{label} KV: decode-only step ({d['steps']} steps, batch "
                              f"{d['mean_generation_requests']:.0f})", d["mean_ms"], "ms",
                        f"{r['max_concurrency']} in flight"))
    return rows


def fig_offline(ctx: Context) -> list[Row]:
    """Offline throughput, FP8 KV."""
    return _offline(ctx, "fp8", "offline")


def fig_offline_bf16(ctx: Context) -> list[Row]:
    """Offline throughput, bf16 KV."""
    return _offline(ctx, "auto", "offline-bf16")


def fig_capacity(ctx: Context) -> list[Row]:
    """KV pool tokens of the bf16-KV engine (and the FP8 one if it ran) against what the free memory holds."""
    ctx.engine("auto")
    rows = []
    for kv, label in (("auto", "model-dtype" if ctx.dry_run else "bf16"), ("fp8", "FP8")):
        e = ctx.results.get("engines", {}).get(kv)
        if not e:
            continue
        free = e.get("free_bytes_for_kv")
        ref = f"expected {int(0.9 * free // e['bytes_per_token']):,}" if free and not ctx.dry_run else ""
        rows.append(Row("capacity", f"KV cache pool, {label} KV ({e['bytes_per_token']:,} B/token)",
                        float(e["pool_tokens"]), "tokens", ref))
    return rows


FIGURES: dict[str, tuple[Callable[[Context], list[Row]], str]] = {
    "prefill": (fig_prefill, "8,192-token prefill step, TFLOP/s and its share of the matmul rate"),
    "decode-b1": (fig_decode_b1, "batch-1 decode ITL against the bandwidth floor (FP8 KV)"),
    "ttft": (fig_ttft, "time to first token, cold and with a cached 4,000-token prefix"),
    "batch64": (fig_batch64, "64 requests x (512 in + 256 out) at once, output tok/s"),
    "offline": (fig_offline, "offline 1,000 x (1k in + 1k out), FP8 KV, output tok/s"),
    "http": (fig_serve, "the HTTP server in-process: throughput, TTFT, ITL at concurrency 1 and 64"),
    "offline-bf16": (fig_offline_bf16, "offline 1,000 x (1k in + 1k out), bf16 KV, output tok/s"),
    "capacity": (fig_capacity, "KV-cache pool tokens (bf16 and FP8 KV)"),
    "accuracy": (fig_accuracy, "float32 prefill logits and greedy tokens against transformers"),
}
"""Figure name -> (function, one-line help), in the order ``all`` runs them: the FP8-KV engine's
figures (the headline ones first), the bf16-KV engine's, then accuracy with engines of its own."""


# ---- running and reporting ------------------------------------------------------------------------

def make_context(device: str, model_dir: Optional[str], quick: bool, dry_run: bool,
                 accuracy_layers: int = 2) -> Context:
    """The shared context; writes the random model to ``model_dir`` if it holds no ``config.json``.

    ``dry_run`` uses `kvpilot.tools.random_model.TINY` on the CPU (``model_dir`` default: a temp dir).

    Raises:
        BenchSetupError: not ``dry_run`` and ``device`` is not an available CUDA device.
    """
    import torch

    from kvpilot.tools.random_model import LLAMA31_8B, TINY, write_random_llama

    if dry_run:
        cfg, dev = dict(TINY, max_position_embeddings=4096), "cpu"
        path = Path(model_dir) if model_dir else Path(tempfile.mkdtemp(prefix="kvpilot-bench-dry-"))
        sizes, mbs, msl = DRY, 16, 1024
    else:
        cfg = LLAMA31_8B
        dev = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if not dev.startswith("cuda") or not torch.cuda.is_available():
            raise BenchSetupError(f"the figures run an 8B-shaped model on a CUDA GPU, and device {dev!r} is not one "
                                  f"(CUDA available: {torch.cuda.is_available()}); --dry-run runs them on a tiny "
                                  f"model on the CPU")
        path = Path(model_dir or DEFAULT_MODEL_DIR)
        sizes, mbs, msl = (QUICK if quick else Sizes()), 512, 32768 + 256
    if not (path / "config.json").is_file():
        write_random_llama(path, cfg, dtype=torch.bfloat16, device=dev)
    return Context(device=dev, model_dir=path, cfg=cfg, sizes=sizes, dry_run=dry_run, accuracy_layers=accuracy_layers,
                   max_batch_size=mbs, max_seq_len=msl)


def run_figures(ctx: Context, names: list[str], out: Optional[str] = None,
                echo: Callable[[str], None] = print, started: Optional[float] = None,
                commit: Optional[str] = None) -> tuple[list[Row], dict]:
    """Run ``names`` in order, each in its own ``try``; returns the rows and the JSON-ready result.

    A failing figure yields one `Row` with ``value`` NaN and ``error`` set; the run goes on. With
    ``out``, the result is (re)written there after every figure. ``total_s`` counts from ``started``
    (a `time.perf_counter` value; default: now), so that the set-up before the call can be included.
    """
    import torch

    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        raise ValueError(f"unknown figure(s) {', '.join(unknown)}; known: {', '.join(FIGURES)}")
    names = [n for n in FIGURES if n in names]  # the engines' order: FP8 figures, then bf16 ones
    t_all = started if started is not None else time.perf_counter()
    rows: list[Row] = []
    meta = {"device": torch.cuda.get_device_name() if ctx.device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "commit": commit or _commit(), "model_dir": str(ctx.model_dir), "dry_run": ctx.dry_run,
            "sizes": asdict(ctx.sizes), "settings": {"max_batch_size": ctx.max_batch_size, "max_num_tokens": 8192,
                                                     "max_seq_len": ctx.max_seq_len,
                                                     "free_gpu_memory_fraction": 0.9}}
    report = {"meta": meta, "figures": {}, "rows": []}

    def save() -> None:
        report["rows"] = [asdict(r) for r in rows]
        report["measurements"] = ctx.results
        report["total_s"] = time.perf_counter() - t_all
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(report, indent=1, default=str) + "\n")

    try:
        # Ceilings first, while no engine holds the GPU's memory (floors and rates are read against them).
        if any(n in names for n in ("prefill", "decode-b1")):
            try:
                ctx.copy_rate()
                ctx.matmul_rate()
            except Exception as exc:  # noqa: BLE001 - the figures retry and report it
                echo(f"[bench] ceilings: {type(exc).__name__}: {exc}")
        for name in names:
            t0 = time.perf_counter()
            echo(f"[bench] {name} ...")
            try:
                got = FIGURES[name][0](ctx)
                status = "ok"
            except Exception as exc:  # noqa: BLE001 - one figure's failure must not end the run
                logger.debug("figure %s failed", name, exc_info=True)
                got = [Row(name, "error", float("nan"), "", "", f"{type(exc).__name__}: {exc}"[:300])]
                status = "error"
                echo(traceback.format_exc(limit=4))
                if "out of memory" in str(exc).lower():
                    ctx.close()
            dt = time.perf_counter() - t0
            rows += got
            report["figures"][name] = {"status": status, "seconds": dt}
            for r in got:
                echo(f"[bench] {name}: {r.metric} = {_fmt(r.value)} {r.unit} {r.reference} {r.error}".rstrip())
            save()
    finally:
        ctx.close()
    save()
    return rows, report


def _commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _fmt(v: float) -> str:
    if v != v:
        return "ERROR"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    if abs(v) >= 0.01 or v == 0:
        return f"{v:.3f}"
    return f"{v:.2e}"


def format_table(rows: list[Row], report: dict) -> str:
    """The plain-text table ``kvpilot bench all`` prints: figure, metric, value, unit, floor/target."""
    head = ("figure", "metric", "value", "unit", "floor / target")
    body = [(r.figure, r.metric, _fmt(r.value), r.unit, r.error or r.reference) for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(5)]
    line = lambda cells: " | ".join(c.ljust(w) if i != 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    m = report["meta"]
    out = [f"kvpilot bench{' --dry-run' if m['dry_run'] else ''} on {m['device']} (torch {m['torch']}, commit {m['commit']}, {m['date']})",
           line(head), "-+-".join("-" * w for w in widths), *map(line, body),
           f"total {report['total_s']:.1f} s (model and set-up included); " + ", ".join(f"{k} {v['seconds']:.1f} s" + ("" if v["status"] == "ok"
                                                                                             else " (error)")
                                                           for k, v in report["figures"].items())]
    return "\n".join(out)


# ---- command line ---------------------------------------------------------------------------------

def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", default=None,
                   help=f"random-weight Llama-3.1-8B-shaped checkpoint, written there if missing "
                        f"(default: {DEFAULT_MODEL_DIR}; with --dry-run a temporary directory)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (default: auto; --dry-run: cpu)")
    p.add_argument("--quick", action="store_true", help="smaller workloads: a GPU smoke test, not the table's figures")
    p.add_argument("--dry-run", action="store_true",
                   help="every figure on a tiny random Llama on the CPU, in seconds (what CI runs)")
    p.add_argument("--accuracy-layers", type=int, default=2,
                   help="decoder layers of the accuracy figure's Llama-3.1-8B-shaped model (default: 2)")
    p.add_argument("--out", default=None, help="write the rows and measurements as JSON to this file (default: no file)")
    p.add_argument("--commit", default=None,
                   help="commit recorded with the results (default: the checkout's `git rev-parse`, else unknown)")


def configure_all(p: argparse.ArgumentParser) -> None:
    """Arguments of ``kvpilot bench all``."""
    _common(p)
    p.add_argument("--figures", default=",".join(FIGURES),
                   help=f"comma-separated figures to run, always in this order (default: all: {','.join(FIGURES)})")


def _run(args: argparse.Namespace, names: list[str]) -> int:
    if args.accuracy_layers < 1:
        raise SystemExit("--accuracy-layers must be >= 1")
    started = time.perf_counter()
    try:
        ctx = make_context(args.device, args.model_dir, args.quick, args.dry_run, args.accuracy_layers)
    except BenchSetupError as exc:
        print(f"kvpilot bench: {exc}", file=sys.stderr)
        return 2
    rows, report = run_figures(ctx, names, args.out, echo=lambda s: print(s, file=sys.stderr, flush=True),
                               started=started, commit=args.commit)
    print(format_table(rows, report), flush=True)
    return 0 if all(r.value == r.value for r in rows) else 1


def run_all(args: argparse.Namespace) -> int:
    """``kvpilot bench all``: exit status 1 when any figure printed an error row."""
    names = [n.strip() for n in args.figures.split(",") if n.strip()]
    unknown = [n for n in names if n not in FIGURES]
    if unknown or not names:
        raise SystemExit(f"--figures: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(FIGURES)}")
    return _run(args, names)


def _figure_command(name: str) -> Callable[[argparse.Namespace], int]:
    return lambda args: _run(args, [name])


SUBCOMMANDS = [("all", "every figure of BENCHMARKS.md's current-results table in one process", configure_all, run_all),
               *((name, help_text, _common, _figure_command(name)) for name, (_, help_text) in FIGURES.items())]
"""(name, help, configure, run), in `kvpilot.tools.bench`'s ``_SUBCOMMANDS`` format."""
