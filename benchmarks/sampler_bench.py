"""Micro-benchmark of the batched sampler (engine/sampler.py) at serving batch sizes, self-checking.

Times `Sampler(backend)(logits, rows)` (on CUDA by default the Triton kernels of
kvpilot.kernels.sampling, which the engine uses with ``KVPILOT_TRITON_SAMPLER=1``) for a
[batch, vocab] float32 logits matrix under common settings, median of ``--iters`` calls after
warm-up, synchronising the device around each call (the sampler ends with a device->host copy
anyway). Every scenario runs on two logits distributions:

- ``flat``:   ``randn`` (std 1). The softmax is nearly flat: top-p 0.9 keeps about half of a
  128k vocabulary, the hardest case for the sort-free path (its boundary lies in the dense middle).
- ``peaked``: ``4 * randn`` (std 4): a few tokens hold most of the mass, like a language model's
  next-token distribution.

Before timing, each scenario is checked: the fast path must choose exactly the tokens of
``Sampler("exact")`` (stable full sort, the reference semantics) for the same inputs at three
output positions; on CUDA the PyTorch candidate path (``Sampler("torch")``) is checked too. The
``exact rows`` column counts rows per call that the fast path handed to the exact path (window
over capacity; expected 0). The script exits with status 1 on any mismatch.

Run (GPU):  python3 benchmarks/sampler_bench.py                  (batch 256, vocab 128256)
Run (CPU):  .venv/bin/python benchmarks/sampler_bench.py --device cpu --batch 16 --vocab 32000
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch


def _import_kvpilot():
    """kvpilot.sampler, also from a bare checkout (engine/ -> kvpilot, kernels/ -> kvpilot.kernels)."""
    try:
        import kvpilot.sampler as sampler  # noqa: F401
    except ImportError:
        root = Path(__file__).resolve().parents[1]
        for name, path in (("kvpilot", root / "engine"), ("kvpilot.kernels", root / "kernels")):
            spec = importlib.util.spec_from_file_location(name, path / "__init__.py",
                                                          submodule_search_locations=[str(path)])
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
    import kvpilot.sampler as sampler

    return sampler


sampler_mod = _import_kvpilot()
Sampler, SamplingRow = sampler_mod.Sampler, sampler_mod.SamplingRow

STEP_MS = 10.83  # batch-256 decode step of Llama-3.1-8B on one H200 (docs/gpu_benchmarks.md)
KINDS = "greedy,temperature,top_k,top_p,top_k_top_p_min_p,mixed,penalties,logprobs"


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
        else:
            raise SystemExit(f"unknown scenario {kind!r}; choose from {KINDS}")
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


def _check(logits: torch.Tensor, rows: list[SamplingRow], fast: Sampler, refs: list[Sampler]) -> tuple[int, float]:
    """Rows whose token differs between ``fast`` and each reference, over three output positions;
    also the mean number of rows per call that ``fast`` handed to the exact path."""
    bad, handed = 0, []
    for step in (100, 101, 7):
        for r in rows:
            r.step = step
        before = fast.exact_rows
        got = fast(logits, rows)
        handed.append(fast.exact_rows - before)
        for ref in refs:
            bad += sum(a != b for a, b in zip(got.token_ids, ref(logits, rows).token_ids))
    for r in rows:
        r.step = 100
    return bad, statistics.mean(handed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--kinds", default=KINDS)
    ap.add_argument("--dists", default="flat,peaked")
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table per scenario")
    ap.add_argument("--backend", default=None, help="Sampler backend to time (default: triton on CUDA, "
                    "which the engine uses with KVPILOT_TRITON_SAMPLER=1; auto on CPU)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    base = torch.randn(args.batch, args.vocab, device=dev, generator=gen)
    dists = {"flat": base, "peaked": base * 4}
    fast = Sampler(args.backend or ("triton" if dev.type == "cuda" else "auto"))
    refs = [Sampler("exact")] + ([Sampler("torch")] if dev.type == "cuda" else [])
    print(f"device={dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}) "
          f"batch={args.batch} vocab={args.vocab} torch={torch.__version__}")
    print("flat = randn (std 1); peaked = 4 * randn (std 4); float32 logits; "
          f"% step = share of a {STEP_MS} ms batch-256 decode step")
    print(f"{'scenario':20s} {'logits':7s} {'ms':>8s} {'us/row':>7s} {'% step':>7s} {'exact rows':>10s}  check")
    mismatches = 0
    for kind in args.kinds.split(","):
        rows = _rows(args.batch, kind, args.vocab)
        for dist in args.dists.split(","):
            logits = dists[dist]
            bad, handed = _check(logits, rows, fast, refs)
            mismatches += bad
            ms = _time(lambda: fast(logits, rows), dev, args.iters)
            print(f"{kind:20s} {dist:7s} {ms:8.3f} {ms / args.batch * 1e3:7.2f} {ms / STEP_MS * 100:6.1f}% "
                  f"{handed:10.1f}  {'ok' if not bad else f'MISMATCH ({bad} rows)'}", flush=True)
            if args.profile:
                acts = [torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
                with torch.profiler.profile(activities=acts) as prof:
                    fast(logits, rows)
                key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
                print(prof.key_averages().table(sort_by=key, row_limit=15))
    rows = _rows(args.batch, "mixed", args.vocab)
    ms = _time(lambda: sampler_mod._Draw(rows, args.vocab).tensors(dev), dev, args.iters)
    print(f"{'host_params_mixed':20s} {'':7s} {ms:8.3f} (reference: gathering the rows' parameters on the host)")
    if dev.type == "cuda":
        hidden = torch.randn(args.batch, 4096, device=dev, dtype=torch.bfloat16)
        head = torch.randn(args.vocab, 4096, device=dev, dtype=torch.bfloat16)
        ms = _time(lambda: (hidden @ head.T).float(), dev, args.iters)
        print(f"{'lm_head_8b_bf16':20s} {'':7s} {ms:8.3f} (reference: LM-head matmul + float cast)")
    if mismatches:
        print(f"FAILED: {mismatches} rows differ from the exact path")
        sys.exit(1)


if __name__ == "__main__":
    main()
