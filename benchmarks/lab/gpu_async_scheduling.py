"""A/B of async scheduling (`kvpilot.core.engine_core`) in one engine on a GPU, self-checking.

Builds the engine of `gpu_recheck.py` (Llama-3.1-8B shape, random bf16 weights, max_batch_size 512,
max_num_tokens 8192, ``--kv-dtype``), then runs every workload with ``async_scheduling`` off and on
(switched at run time on the same engine, so both modes share weights, graphs and KV pool):

1. correctness: ``--check-prompts`` x (128 in + 64 out), greedy, and the same with seeded
   top-k 50 + top-p 0.9 sampling: the token ids of both modes must be identical (the schedules are
   the same, so the batches are too); any difference is printed and the script exits with 1;
2. speed: ``--batch`` x (1,000 in + ``--output-len`` out), greedy, all submitted at once (the
   offline regime's decode steps: contexts 1,000 .. 1,000 + output-len): output tokens/s over the
   run and the mean wall time of the full-batch decode-only steps (iteration stats), with the
   number of steps launched while the previous step's tokens were still on the device.

    python3 benchmarks/lab/gpu_async_scheduling.py [--batch 492] [--output-len 128] [--kv-dtype fp8]

``--tiny`` runs the same logic on a two-layer random model (on the CPU too, with
``Tuning.async_scheduling`` irrelevant: the mode is switched per run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpilot.tools.random_model import LLAMA31_8B, TINY, write_random_llama  # noqa: E402
from gpu_recheck import StepLog  # noqa: E402


def build(path: Path, kv_dtype: str, tiny: bool, log: StepLog):
    from kvpilot import LLM, KvCacheConfig

    kw = dict(max_batch_size=512, max_num_tokens=8192, max_seq_len=32768 + 256) if not tiny else dict(
        max_batch_size=64, max_num_tokens=512, max_seq_len=1024)
    llm = LLM(str(path), skip_tokenizer_init=True,
              kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.9, dtype=kv_dtype), **kw)
    llm.add_stat_logger(log)
    return llm


def generate(llm, prompts, params) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    outs = [llm.generate_async(p, params) for p in prompts]
    toks = [o.result().outputs[0].token_ids for o in outs]
    return toks, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="/tmp/kvpilot-llama8b-random")
    ap.add_argument("--kv-dtype", default="fp8")
    ap.add_argument("--batch", type=int, default=492)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--check-prompts", type=int, default=64)
    ap.add_argument("--tiny", action="store_true", help="a two-layer random model (dry run, CPU or GPU)")
    args = ap.parse_args()

    from kvpilot import SamplingParams
    from kvpilot.tools.bench_offline import random_prompts

    cfg = TINY if args.tiny else LLAMA31_8B
    path = Path("/tmp/kvpilot-tiny-random" if args.tiny else args.model_dir)
    if not (path / "config.json").exists():
        write_random_llama(path, cfg, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
    log = StepLog()
    t0 = time.perf_counter()
    kv_dtype = "auto" if args.tiny else args.kv_dtype
    llm = build(path, kv_dtype, args.tiny, log)
    core = llm._core
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{dev}: engine ({kv_dtype} KV) in {time.perf_counter() - t0:.1f} s; async scheduling by "
          f"default: {core.async_scheduling}", flush=True)
    V = cfg["vocab_size"]
    in_len = 1000 if not args.tiny else 100

    def mode(on: bool) -> None:
        core.async_scheduling = on

    # Warm-up: every kernel and graph the runs use, in both modes.
    for on in (False, True):
        mode(on)
        generate(llm, random_prompts(8, 128, V, seed=99), SamplingParams(max_tokens=8, ignore_eos=True,
                                                                          temperature=0, detokenize=False))

    failed = False
    check = random_prompts(args.check_prompts, 128, V, seed=1)
    for name, params in (("greedy", SamplingParams(max_tokens=64, ignore_eos=True, temperature=0, detokenize=False)),
                         ("top-k 50 + top-p 0.9, seeded", SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.8,
                                                                         top_k=50, top_p=0.9, seed=7,
                                                                         detokenize=False))):
        got = {}
        for on in (False, True):
            mode(on)
            over = core.num_overlapped_steps
            got[on] = generate(llm, check, params)[0]
            if on and core.num_overlapped_steps == over:
                print(f"check [{name}]: async scheduling did not engage (no overlapped step)")
                failed = True
        diff = [i for i, (a, b) in enumerate(zip(got[False], got[True])) if a != b]
        print(f"check [{name}]: {len(check)} x 64 tokens, {len(diff)} sequences differ between the modes", flush=True)
        for i in diff[:4]:
            j = next(k for k, (a, b) in enumerate(zip(got[False][i], got[True][i])) if a != b)
            print(f"  prompt {i}: first difference at token {j}: {got[False][i][j:j + 4]} vs {got[True][i][j:j + 4]}")
        failed |= bool(diff)

    print(f"\n{args.batch} x ({in_len} in + {args.output_len} out), greedy, all at once")
    print("| async scheduling | output tok/s | full-batch decode steps | mean step ms | overlapped steps |")
    print("|---|---:|---:|---:|---:|")
    res = {}
    for on in (False, True, False, True):
        mode(on)
        prompts = random_prompts(args.batch, in_len, V, seed=1000 + len(res))  # fresh: no prefix-cache hits
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0, detokenize=False)
        log.rows.clear()
        log.on = True
        over = core.num_overlapped_steps
        toks, secs = generate(llm, prompts, params)
        log.on = False
        full = [r[0] for r in log.rows if r[2] == 0 and r[3] == args.batch]
        ms = 1e3 * statistics.fmean(full) if full else float("nan")
        tps = sum(map(len, toks)) / secs
        res.setdefault(on, []).append((tps, ms))
        print(f"| {'on' if on else 'off'} | {tps:.0f} | {len(full)} | {ms:.2f} | {core.num_overlapped_steps - over} |",
              flush=True)
    off, on = (statistics.fmean(x[1] for x in res[m]) for m in (False, True))
    print(f"decode step: {off:.2f} ms -> {on:.2f} ms ({100 * (off - on) / off:.1f}% shorter)")
    llm.shutdown()
    if failed:
        print("FAILED: the modes disagree (see above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
