"""Micro-benchmark of the batched sampler (engine/sampler.py) at serving batch sizes.

Times `Sampler()(logits, rows)` for a [batch, vocab] float32 logits matrix under common settings
(greedy, temperature, top-k, top-p, penalties, logprobs), median of ``--iters`` runs after warm-up,
synchronising the device around each call (the sampler ends with a device->host copy anyway).
For scale it also times the LM-head matmul of a Llama-3-8B-sized model at the same batch
(hidden 4096 x vocab, bfloat16), which is only a part of one decode step.

Run (GPU):  .venv/bin/python benchmarks/sampler_bench.py --device cuda --batch 256 --vocab 128256
Run (CPU):  .venv/bin/python benchmarks/sampler_bench.py --device cpu --batch 32 --vocab 32000
Prints one line per scenario: name, median ms, and ms per row.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    from kvpilot.sampler import Sampler, SamplingRow
except ImportError:  # kvpilot not installed (e.g. a bare GPU box): load the module file directly
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from sampler import Sampler, SamplingRow  # type: ignore[no-redef]


def _rows(batch: int, kind: str, vocab: int) -> list[SamplingRow]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(batch):
        r = SamplingRow(seed=i, step=100)
        if kind == "greedy":
            r.temperature = 0.0
        elif kind == "temperature":
            r.temperature = 0.8
        elif kind == "top_k":
            r.temperature, r.top_k = 0.8, 50
        elif kind == "top_p":
            r.temperature, r.top_p = 0.8, 0.9
        elif kind == "top_k_top_p_min_p":
            r.temperature, r.top_k, r.top_p, r.min_p = 0.8, 100, 0.9, 0.05
        elif kind == "mixed":  # a realistic mix of requests in one batch
            r.temperature = [0.0, 0.7, 1.0, 0.8][i % 4]
            r.top_p = [1.0, 0.9, 0.95, 1.0][i % 4]
            r.top_k = [0, 0, 40, 0][i % 4]
        elif kind == "penalties":
            r.temperature, r.top_p = 0.8, 0.9
            r.repetition_penalty, r.frequency_penalty, r.presence_penalty = 1.1, 0.5, 0.5
            r.prompt_token_ids = torch.randint(0, vocab, (1024,), generator=g).tolist()
            r.output_token_ids = torch.randint(0, vocab, (512,), generator=g).tolist()
            r.logit_bias = {int(t): 1.0 for t in torch.randint(0, vocab, (10,), generator=g)}
        elif kind == "logprobs":
            r.temperature, r.top_p, r.logprobs = 0.8, 0.9, 5
        out.append(r)
    return out


def _time(fn, device: torch.device, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table per scenario")
    ap.add_argument("--kinds", default="greedy,temperature,top_k,top_p,top_k_top_p_min_p,mixed,penalties,logprobs")
    args = ap.parse_args()
    dev = torch.device(args.device)
    logits = torch.randn(args.batch, args.vocab, device=dev) * 4
    sampler = Sampler()
    print(f"device={dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}) "
          f"batch={args.batch} vocab={args.vocab} torch={torch.__version__}")
    for kind in args.kinds.split(","):
        rows = _rows(args.batch, kind, args.vocab)
        ms = _time(lambda: sampler(logits, rows), dev, args.iters)
        print(f"{kind:20s} {ms:8.3f} ms  ({ms / args.batch * 1e3:.2f} us/row)")
        if args.profile:
            acts = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            with torch.profiler.profile(activities=acts) as prof:
                sampler(logits, rows)
            key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=12))
    if dev.type == "cuda":
        hidden = torch.randn(args.batch, 4096, device=dev, dtype=torch.bfloat16)
        head = torch.randn(args.vocab, 4096, device=dev, dtype=torch.bfloat16)
        ms = _time(lambda: (hidden @ head.T).float(), dev, args.iters)
        print(f"{'lm_head_8b_bf16':20s} {ms:8.3f} ms  (reference: LM-head matmul + float cast)")


if __name__ == "__main__":
    main()
