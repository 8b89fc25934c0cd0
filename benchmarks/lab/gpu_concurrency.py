"""Output tokens/s against concurrency (1..512), with Triton compiles during the runs reported.

Same engine settings and random-weight Llama-3.1-8B-shaped checkpoint as `gpu_recheck.py` (bf16 KV
cache unless ``--kv-dtype fp8``). For each concurrency c: c prompts of 128 tokens, 128 generated each
(ignore_eos), all submitted at once; ``--repeats`` timed runs (fresh prompts each), the first one
printed separately, so that a one-time cost (a Triton kernel compiled on first use) shows as the
difference. Every Triton compile while the sweep runs is logged with its kernel name and seconds.
Writes ``gpu_concurrency.json`` and ``gpu_concurrency.png`` (median of the runs after the first)
to ``--out``.

    python3 benchmarks/lab/gpu_concurrency.py --out $OUT [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpilot.tools.random_model import LLAMA31_8B, write_random_llama  # noqa: E402
from gpu_recheck import StepLog, build  # noqa: E402


def log_compiles(events: list) -> None:
    """Append (kernel name, seconds) to ``events`` for every Triton JIT compile from now on (Triton's
    ``knobs.runtime`` cache and post-compile hooks: a kernel specialization not yet in memory)."""
    from triton import knobs

    started: dict = {}

    def before(*_, **kw):
        started[str(kw.get("key"))] = time.perf_counter()
        return False  # a true value would skip the compile

    def after(*_, **kw):
        fn = kw.get("fn")
        t = started.pop(str(kw.get("key")), None)
        events.append((getattr(fn, "name", "?"), time.perf_counter() - t if t else float("nan")))
        return False

    knobs.runtime.jit_cache_hook = before
    knobs.runtime.jit_post_compile_hook = after


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="/tmp/kvpilot-llama8b-random")
    ap.add_argument("--out", default=".")
    ap.add_argument("--kv-dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    a = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")  # start-up steps
    from kvpilot.tools.bench_offline import random_prompts, run_throughput

    path = Path(a.model_dir)
    if not (path / "config.json").exists():
        write_random_llama(path, LLAMA31_8B, dtype=torch.bfloat16, device="cuda")
    llm, load_s = build(path, a.kv_dtype, StepLog())
    events: list = []
    log_compiles(events)
    rows = []
    print(f"{torch.cuda.get_device_name()}, KV {a.kv_dtype}, loaded in {load_s:.1f} s")
    print("| concurrency | first run tok/s | later runs tok/s | compiles in the first run |")
    print("|---:|---:|---:|---|")
    for c in a.concurrency:
        runs = []
        for i in range(a.repeats):
            n0 = len(events)
            r = run_throughput(llm, random_prompts(c, 128, LLAMA31_8B["vocab_size"], seed=1000 * c + i), 128,
                               max_concurrency=c)
            runs.append(r["output_tokens_per_s"])
            if i == 0:
                first_compiles = events[n0:]
        later = statistics.median(runs[1:]) if len(runs) > 1 else runs[0]
        rows.append({"concurrency": c, "first_run_tok_s": runs[0], "runs_tok_s": runs, "median_later_tok_s": later,
                     "first_run_compiles": first_compiles})
        comp = ", ".join(f"{n} {s:.2f} s" for n, s in first_compiles) or "none"
        print(f"| {c} | {runs[0]:.0f} | {later:.0f} | {comp} |", flush=True)
    llm.shutdown()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_concurrency.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "kv": a.kv_dtype,
                                                          "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    xs = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [r["median_later_tok_s"] for r in rows], "o-")
    ax.set(xscale="log", xlabel="concurrent requests (128 in / 128 out)", ylabel="output tokens/s",
           title=f"kvpilot, Llama-3.1-8B shape bf16, {torch.cuda.get_device_name()}")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "gpu_concurrency.png", dpi=120)


if __name__ == "__main__":
    main()
