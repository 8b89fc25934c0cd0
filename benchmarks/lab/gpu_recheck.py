"""Re-measure the engine's GPU workloads after an engine change, in one short device lease.

The same engine settings as `benchmarks/gpu_bench.py` (Llama-3.1-8B-shaped random bf16 weights,
max_batch_size 512, max_num_tokens 8192, max_seq_len 33024, free_gpu_memory_fraction 0.9), and the
workloads the engine's own code affects (the transformers baselines are in `gpu_bench.py`):

- ``latency``: batch-1 decode, 128 prompt tokens, 512 generated: inter-token latency (ITL) against
  the bandwidth floor (weights read per step + mean KV) / device copy rate measured here;
- ``context``: batch-1 ITL at prompt lengths 128 .. 32k (64 generated tokens each);
- ``throughput``: N x (1,000 in + 1,000 out), with where the time went: the engine's iteration
  stats split into decode-only steps and steps that carry prefill tokens;
- ``batch64``: 64 prompts of 512 tokens, 256 generated each, all at once (the workload of the
  transformers batch-64 baseline in `gpu_bench.py`);
- ``--kv-dtype fp8`` repeats ``throughput`` with an FP8 KV cache (``KvCacheConfig(dtype="fp8")``).

    python3 benchmarks/lab/gpu_recheck.py --num-prompts 1000 --out $OUT [--sections latency,context,throughput]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_decode_profile import copy_bandwidth  # noqa: E402
from kvpilot.tools.random_model import LLAMA31_8B, write_random_llama  # noqa: E402


class StepLog:
    """Collects (latency, scheduled tokens, context requests, generation requests) of every step."""

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
        dec = [r for r in self.rows if r[2] == 0]
        mix = [r for r in self.rows if r[2] > 0]

        def part(rows):
            if not rows:
                return {"steps": 0}
            return {"steps": len(rows), "seconds": sum(r[0] for r in rows),
                    "mean_ms": 1e3 * statistics.fmean(r[0] for r in rows),
                    "mean_tokens": statistics.fmean(r[1] for r in rows),
                    "mean_generation_requests": statistics.fmean(r[3] for r in rows)}

        return {"decode_only": part(dec), "with_prefill": part(mix)}


def build(path: Path, kv_dtype: str, log: StepLog, max_batch_size: int = 512, tuning=None):
    """The engine of these measurements; ``tuning``: a `kvpilot.tuning.Tuning` (default: the defaults)."""
    from kvpilot import LLM, KvCacheConfig

    t0 = time.perf_counter()
    llm = LLM(str(path), skip_tokenizer_init=True, max_batch_size=max_batch_size, max_num_tokens=8192, max_seq_len=32768 + 256,
              kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.9, dtype=kv_dtype), tuning=tuning)
    llm.add_stat_logger(log)
    return llm, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="/tmp/kvpilot-llama8b-random")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--sections", default="latency,context,throughput")
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096, 8192, 16384, 32768])
    ap.add_argument("--kv-dtype", nargs="+", default=["auto"], help="KV cache dtypes to run throughput with")
    ap.add_argument("--out", default=None)
    ap.add_argument("--max-batch-size", type=int, default=512, help="the engine's max_batch_size (default 512)")
    ap.add_argument("--tuning", default="", help="kvpilot.tuning.Tuning overrides, e.g. 'cuda_graphs=0' (default: none)")
    ap.add_argument("--decode-tuning", default="", help="decode attention launch-table overrides (JSON object of "
                    "kvpilot.kernels.attention_common.TUNING['decode'] entries, e.g. '{\"batch_tma_fp8\": false}')")
    args = ap.parse_args()
    from kvpilot.kernels.attention_common import TUNING, decode_tuning_from_json
    from kvpilot.tuning import parse_overrides

    tuning = parse_overrides(args.tuning)
    if args.decode_tuning:
        TUNING["decode"].update(decode_tuning_from_json(args.decode_tuning))
    sections = set(args.sections.split(","))

    from kvpilot.tools.bench_offline import random_prompts, run_latency, run_throughput

    bw = copy_bandwidth()
    res = {"device": torch.cuda.get_device_name(), "copy_bandwidth_Bps": bw, "date": time.strftime("%Y-%m-%d")}
    print(f"{res['device']}: copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    path = Path(args.model_dir)
    if not (path / "config.json").exists():
        write_random_llama(path, LLAMA31_8B, dtype=torch.bfloat16, device="cuda")

    def save():
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "gpu_recheck.json").write_text(json.dumps(res, indent=1))

    for i, kv_dtype in enumerate(args.kv_dtype):
        log = StepLog()
        llm, load_s = build(path, kv_dtype, log, args.max_batch_size, tuning)
        runner = llm._executor
        cfg = LLAMA31_8B
        per_tok = runner.bytes_per_block // runner.block_size
        weight_read = runner.weight_bytes - cfg["vocab_size"] * cfg["hidden_size"] * 2
        key = f"kv_{kv_dtype}" + (f"_mbs{args.max_batch_size}" if args.max_batch_size != 512 else "")
        res[key] = {"load_s": load_s, "pool_tokens": llm.pool_tokens, "kv_bytes_per_token": per_tok}
        print(f"[{key}] loaded in {load_s:.1f} s; pool {llm.pool_tokens} tokens, {per_tok} B/token", flush=True)
        if i == 0 and "latency" in sections:
            lat = run_latency(llm, 128, 512, batch_size=1, num_iters=3)
            floor = (weight_read + per_tok * (128 + 511 / 2)) / bw
            lat.update(floor_itl_s=floor, pct_of_floor_speed=100 * floor / lat["itl_s"])
            res[key]["latency_b1"] = lat
            print(f"batch-1 ITL {lat['itl_s'] * 1e3:.3f} ms; floor {floor * 1e3:.3f} ms "
                  f"({lat['pct_of_floor_speed']:.1f}% of floor speed); TTFT {lat['ttft_s'] * 1e3:.1f} ms", flush=True)
            save()
        if i == 0 and "context" in sections:
            pts = []
            for ctx in args.contexts:
                r = run_latency(llm, ctx, 64, 1, num_iters=1, num_warmup=1, seed=ctx)
                fl = (weight_read + per_tok * (ctx + 32)) / bw
                pts.append({"context": ctx, "itl_s": r["itl_s"], "floor_itl_s": fl, "ttft_s": r["ttft_s"]})
                print(f"context {ctx}: ITL {r['itl_s'] * 1e3:.2f} ms (floor {fl * 1e3:.2f}), "
                      f"TTFT {r['ttft_s'] * 1e3:.1f} ms", flush=True)
            res[key]["itl_vs_context"] = pts
            save()
        if "throughput" in sections:
            prompts = random_prompts(args.num_prompts, 1000, cfg["vocab_size"], seed=1)
            log.on = True
            tp = run_throughput(llm, prompts, 1000)
            log.on = False
            tp["steps"] = log.summary()
            res[key]["throughput"] = tp
            d, m = tp["steps"]["decode_only"], tp["steps"]["with_prefill"]
            print(f"throughput {args.num_prompts} x (1000 in + 1000 out): {tp['output_tokens_per_s']:.0f} output tok/s "
                  f"({tp['max_concurrency']} in flight, {tp['elapsed_s']:.1f} s); decode-only steps "
                  f"{d.get('steps')} x {d.get('mean_ms', 0):.2f} ms (batch {d.get('mean_generation_requests', 0):.0f}), "
                  f"with prefill {m.get('steps')} x {m.get('mean_ms', 0):.2f} ms ({m.get('mean_tokens', 0):.0f} tokens)",
                  flush=True)
            save()
        if "batch64" in sections:
            # The batch-64 workload (gpu_bench.py's transformers baseline: generate at batch 64):
            # 64 prompts of 512 tokens, 256 generated each, all in flight at once.
            prompts = random_prompts(64, 512, cfg["vocab_size"], seed=64)
            # warm-up on other prompts: the same ones would leave their blocks in the prefix cache
            run_throughput(llm, random_prompts(8, 512, cfg["vocab_size"], seed=65), 16)
            b64 = run_throughput(llm, prompts, 256, max_concurrency=64)
            res[key]["batch64"] = b64
            print(f"batch 64 x (512 in + 256 out): {b64['output_tokens_per_s']:.0f} output tok/s "
                  f"({b64['elapsed_s']:.2f} s)", flush=True)
            save()
        llm.shutdown()
        del llm, runner
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
