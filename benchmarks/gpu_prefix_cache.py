"""Time to first token with a cached 4,000-token prefix against the same request cold (block reuse).

One engine, Llama-3.1-8B-shaped random bf16 weights on one GPU (or `--tiny` on CPU for a dry run).
For each trial a fresh 4,000-token prefix is drawn: the request (prefix + a 32-token question) is
first timed cold (nothing cached), then a second request with the same prefix and a different
question is timed warm (the prefix's full blocks come from the cache). TTFT is measured from
`generate_async` to the first streamed token. Prints the medians and the speed-up.

The engine runs as configured by default: CUDA graphs on, so the cached request's small prefill step
replays a prefill graph (`kvpilot.runner.cuda_graphs.PrefillGraphs`). For an A/B run of that step eagerly,
pass ``--tuning prefill_graphs=0`` (decode graphs stay on); the table says which graphs were captured.

    python3 benchmarks/gpu_prefix_cache.py --out $OUT       # GPU
    python3 benchmarks/gpu_prefix_cache.py --out $OUT --tuning prefill_graphs=0   # GPU, prefill eager
    .venv/bin/python benchmarks/gpu_prefix_cache.py --tiny   # CPU dry run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpilot.tools.random_model import LLAMA31_8B, TINY, write_random_llama  # noqa: E402


async def _ttft(llm, ids, sp) -> float:
    from kvpilot import SamplingParams  # noqa: F401

    t0 = time.perf_counter()
    async for _ in llm.generate_async(ids, sp, streaming=True):
        return time.perf_counter() - t0
    raise RuntimeError("no token streamed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU dry run on a tiny random model")
    ap.add_argument("--prefix-len", type=int, default=4000)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--model-dir", default="/tmp/kvpilot-llama8b-random")
    ap.add_argument("--out", default=None, help="folder for the JSON result")
    ap.add_argument("--tuning", default="", help="kvpilot.tuning.Tuning overrides, e.g. prefill_graphs=0")
    args = ap.parse_args()
    from kvpilot.tuning import parse_overrides

    tuning = parse_overrides(args.tuning)

    from kvpilot import LLM, KvCacheConfig, SamplingParams

    cfg, device = (TINY, "cpu") if args.tiny else (LLAMA31_8B, "cuda")
    path = Path(args.model_dir + ("-tiny" if args.tiny else ""))
    if not (path / "config.json").exists():
        write_random_llama(path, cfg, dtype=torch.float32 if args.tiny else torch.bfloat16, device=device)
    llm = LLM(str(path), skip_tokenizer_init=True, device=device, max_seq_len=8192,
              kv_cache_config=KvCacheConfig(enable_block_reuse=True, free_gpu_memory_fraction=0.5), tuning=tuning)
    runner = llm._executor
    pg, dg = getattr(runner, "prefill_graphs", None), getattr(runner, "graphs", None)
    graphs = f"{len(dg.graphs) if dg else 0} decode + {len(pg.graphs) if pg else 0} prefill"
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    vocab = cfg["vocab_size"]

    def draw(n):
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    async def run():
        await _ttft(llm, draw(args.prefix_len + args.question_len), sp)  # warm-up (kernels, allocator)
        cold, warm = [], []
        for _ in range(args.trials):
            prefix = draw(args.prefix_len)
            cold.append(await _ttft(llm, prefix + draw(args.question_len), sp))
            warm.append(await _ttft(llm, prefix + draw(args.question_len), sp))
        return cold, warm

    cold, warm = asyncio.run(run())
    stats = llm.get_stats(timeout=1)
    hit_rate = stats[-1]["kvCacheStats"]["cacheHitRate"] if stats else None
    llm.shutdown()
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "prefix_len": args.prefix_len, "question_len": args.question_len, "trials": args.trials,
        "cold_ttft_s": cold, "warm_ttft_s": warm,
        "cold_median_s": statistics.median(cold), "warm_median_s": statistics.median(warm),
        "speedup": statistics.median(cold) / statistics.median(warm), "cache_hit_rate": hit_rate,
        "cuda_graphs": graphs,
    }
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "prefix_cache.json").write_text(json.dumps(result, indent=1))
    print("| device | CUDA graphs | prefix | cold TTFT median | cached-prefix TTFT median | speed-up |")
    print("|---|---|---:|---:|---:|---:|")
    print(f"| {result['device']} | {graphs} | {args.prefix_len} | {result['cold_median_s'] * 1e3:.1f} ms | "
          f"{result['warm_median_s'] * 1e3:.1f} ms | {result['speedup']:.1f}x |")


if __name__ == "__main__":
    main()
