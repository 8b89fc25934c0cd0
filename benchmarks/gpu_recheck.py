"""Re-measure batch-1 latency and offline throughput on one GPU after an engine change.

The same engine settings as `benchmarks/gpu_bench.py` (Llama-3.1-8B-shaped random bf16 weights,
max_batch_size 512, max_num_tokens 8192, max_seq_len 33024, free_gpu_memory_fraction 0.9), only the two workloads the
engine's host time affects, so it fits a short device lease:

    python3 benchmarks/gpu_recheck.py --num-prompts 1000 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_random_model import LLAMA31_8B, write_random_llama  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="/tmp/kvpilot-llama8b-random")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from kvpilot import LLM, KvCacheConfig
    from kvpilot.bench_offline import random_prompts, run_latency, run_throughput

    path = Path(args.model_dir)
    if not (path / "config.json").exists():
        write_random_llama(path, LLAMA31_8B, dtype=torch.bfloat16, device="cuda")
    t0 = time.perf_counter()
    llm = LLM(str(path), skip_tokenizer_init=True, max_batch_size=512, max_num_tokens=8192, max_seq_len=32768 + 256,
              kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.9))
    res = {"load_s": time.perf_counter() - t0, "device": torch.cuda.get_device_name()}
    res["latency_b1"] = run_latency(llm, 128, 512, batch_size=1, num_iters=3)
    print(f"batch-1 ITL {res['latency_b1']['itl_s'] * 1e3:.3f} ms", flush=True)
    prompts = random_prompts(args.num_prompts, 1000, LLAMA31_8B["vocab_size"], seed=1)
    res["throughput"] = run_throughput(llm, prompts, 1000)
    tp = res["throughput"]
    print(f"throughput {args.num_prompts} x (1000 in + 1000 out): {tp['output_tokens_per_s']:.0f} output tok/s "
          f"({tp['max_concurrency']} in flight, {tp['elapsed_s']:.1f} s)", flush=True)
    llm.shutdown()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_recheck.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
