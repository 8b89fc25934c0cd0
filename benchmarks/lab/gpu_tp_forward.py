"""GPU time of one batch-1 decode step per rank, TP 1 against TP 2, with a per-kernel breakdown.

`gpu_tp_profile.py` times whole engine steps (front end, pipes, sampling). This script isolates the
device side: each rank builds its `Worker` (the engine's own worker class, decode CUDA graphs and all)
on the random Llama-3.1-8B-shaped checkpoint of ``kvpilot.tools.random_model``, and then

1. ``sync step``: ``Worker.execute`` of a batch-1 decode plan followed by a device synchronisation,
   median over ``--iters`` (host launch + device time, serial);
2. ``queued step``: ``--iters`` executes queued back to back, one synchronisation at the end (the
   device's time per step when the host keeps ahead of it);
3. a `torch.profiler` trace of 5 queued steps on every rank: kernel time per step by kind (GEMV /
   matmul, attention, NCCL, other) and the idle time between kernels (the step's span minus its
   kernel time).

Usage (an nvidia-h200-x2; from the repository root by path, never ``python -m``)::

    python3 benchmarks/lab/gpu_tp_forward.py [--tp 1 2] [--context 512] [--iters 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpilot.tools.random_model import LLAMA31_8B, TINY, write_random_llama  # noqa: E402

def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


KINDS = (("nccl", ("nccl",)), ("one-shot all-reduce", ("two_rank_all_reduce",)), ("attention", ("attention", "attn")),
         ("gemv/matmul", ("gemv", "gemm", "matmul", "sm90", "cutlass", "nvjet", "splitk")))


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(s in low for s in keys)), "other")


def rank_main(rank: int, spec, a, queue) -> None:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from kvpilot.runner.model_runner import ScheduledSeq
    from kvpilot.parallel.worker import Worker

    worker = Worker(rank, spec)
    runner = worker.runner
    nb = -(-a.context // runner.block_size)
    seqs = [ScheduledSeq(-1, [5], a.context - 1, list(range(nb)), True)]

    def step():
        out = worker.execute(seqs)
        return out

    for _ in range(5):
        step()
    sync()
    dist.barrier()
    sync_ms = []
    for _ in range(a.iters):
        t = time.perf_counter()
        step()
        sync()
        sync_ms.append((time.perf_counter() - t) * 1e3)
    dist.barrier()
    sync()
    t = time.perf_counter()
    for _ in range(a.iters):
        step()
    sync()
    queued_ms = (time.perf_counter() - t) / a.iters * 1e3
    dist.barrier()
    on_gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
        sync()
    per_kind, per_name = defaultdict(float), defaultdict(lambda: [0.0, 0])
    starts, ends = [], []
    for e in prof.events():
        if e.device_type.name != ("CUDA" if on_gpu else "CPU"):
            continue
        per_kind[kind_of(e.name)] += e.device_time_total / 5
        per_name[e.name][0] += e.device_time_total / 5
        per_name[e.name][1] += 1
        starts.append(e.time_range.start)
        ends.append(e.time_range.end)
    span = (max(ends) - min(starts)) / 5 if starts else 0.0
    top = sorted(((n[:70], round(v[0], 1), v[1] // 5) for n, v in per_name.items()), key=lambda x: -x[1])[:12]
    queue.put({"rank": rank, "tp": spec.tp_size, "sync_ms": statistics.median(sync_ms), "queued_ms": queued_ms,
               "kinds_us": {k: round(v, 1) for k, v in per_kind.items()}, "span_us": round(span, 1),
               "kernels": sum(v[1] for v in per_name.values()) // 5, "top": top,
               "graphs": runner.graphs is not None})
    dist.barrier()
    queue.close()
    queue.join_thread()  # the result is written before the process ends
    os._exit(0)  # skip NCCL teardown (it can outlast the benchmark)


def run_layout(model: Path, tp: int, a) -> list[dict]:
    from kvpilot import KvCacheConfig
    from kvpilot.model.config import ModelConfig
    from kvpilot.parallel.executor import make_worker_spec

    cfg = ModelConfig.from_dir(model)
    kv = KvCacheConfig(free_gpu_memory_fraction=0.5)
    dev, dtype = ("cpu", "float32") if a.tiny else ("cuda", "bfloat16")
    spec = make_worker_spec(model, cfg, kv, 8192, 8, a.max_seq_len, dev, dtype, tp, 1, None)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, spec, a, queue)) for r in range(tp)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(timeout=20)
        if p.is_alive():
            p.kill()
    return sorted(results, key=lambda r: r["rank"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", default="/tmp/kvpilot_random_8b")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--tiny", action="store_true", help="CPU dry run on a tiny model (gloo)")
    a = p.parse_args()
    model = Path(a.model_dir + ("_tiny" if a.tiny else ""))
    if not (model / "config.json").is_file():
        write_random_llama(model, TINY if a.tiny else LLAMA31_8B, device="cpu" if a.tiny else "cuda")
    rows = []
    for tp in a.tp:
        for r in run_layout(model, tp, a):
            rows.append(r)
            print(f"\nTP {tp} rank {r['rank']} (graphs {r['graphs']}): sync step {r['sync_ms']:.3f} ms, "
                  f"queued step {r['queued_ms']:.3f} ms, profiled span {r['span_us'] / 1e3:.3f} ms, "
                  f"{r['kernels']} kernels/step", flush=True)
            busy = sum(r["kinds_us"].values())
            print("  kernel us/step by kind: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["kinds_us"].items()))
                  + f"; busy {busy:.1f}, idle {r['span_us'] - busy:.1f}")
            for name, us, n in r["top"]:
                print(f"    {us:8.1f} us  x{n:<4} {name}")
    print("\n| TP | rank | sync step ms | queued step ms | kernel busy us | NCCL us | one-shot all-reduce us "
          "| idle us |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        busy = sum(r["kinds_us"].values())
        print(f"| {r['tp']} | {r['rank']} | {r['sync_ms']:.3f} | {r['queued_ms']:.3f} | {busy:.0f} | "
              f"{r['kinds_us'].get('nccl', 0):.0f} | {r['kinds_us'].get('one-shot all-reduce', 0):.0f} | "
              f"{r['span_us'] - busy:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
