"""Greedy tokens of TP 2 and PP 2 against one GPU in bf16, and TP 2's batch-1 ITL (two H200s).

The goal is that TP 2 and PP 2 reproduce the single-GPU greedy tokens of the Llama-3.1-8B-shaped
model. On random weights the top logits of a step are close together, so any change in rounding
flips near-ties after a few tokens. Two causes were examined:

- TP: the row-parallel projections (``o_proj``, ``down_proj``) sum bf16-rounded partial products
  in a bf16 all-reduce, two extra roundings per projection. ``tp_reduce_fp32=1`` (`kvpilot.tuning.Tuning`) reduces in
  float32 and rounds once (engine/model/llama.py). Measured on two H200s: mean logprob difference to one
  GPU 4.4e-2 -> 3.6e-2, no prompt more identical (0/8 both), batch-1 ITL +0.9%; so it stays off by
  default. What remains is fp32 summation order (cuBLAS algorithms for the halved matrices,
  attention's context splits over 4 instead of 8 KV heads).
- PP: one GPU runs prefill steps of up to 256 tokens from CUDA graphs padded to token buckets, the
  stages ran them eagerly at the real token count, so cuBLAS and the attention kernels saw other
  shapes (other algorithms and context splits). Parallel ranks now pad those steps the same way
  (engine/runner/model_runner.py, `prefill_padding`), so a PP 2 stage runs one GPU's kernels at one GPU's
  shapes: with one request at a time its tokens and logprobs are one GPU's exactly (8/8 prompts,
  logprob difference 0, on two H200s).

For each dtype, one `LLM` per layout (``TxP`` or ``TxP:FIELD=VAL;FIELD=VAL``, `Tuning` overrides for that layout's
environment) on the random model of ``kvpilot.tools.random_model`` (written once to
``--model-dir``, reused when present): greedy tokens of ``--prompts`` random prompts (16..200 tokens)
x ``--tokens`` tokens, one request at a time (so every layout runs the same steps), compared with the
first layout; the chosen tokens' logprobs over the common prefix (max and mean difference); and the
batch-1 inter-token latency: (time of a 1+N-token request - time of a 1-token request) / N, median
of 3 after a warm-up (``--itl-tokens`` N).

Tensor-parallel-invariant mode (``tp_invariant=T``, engine/model/tp_invariant.py): every layout computes
a TP-``T`` group's decomposition, so one GPU with ``T = 2`` should give TP 2's tokens and logprobs
exactly. ``--invariant 2`` runs the layouts ``1x1:tp_invariant=2,2x1,1x1`` (TP 1 invariant
first, as the reference; TP 2 with default settings; TP 1 default) and adds a summary line: identical
prompts and the max logprob difference of TP 2 against TP 1 invariant, and the batch-1 ITL of the three.

Self-check (exit status 1): in bf16, a layout that computes the first layout's decomposition (the
same ``tp_invariant``, where TP 2 without it and without ``tp_reduce_fp32`` is ``T = 2``
and TP 1 is ``T = 1``, so PP layouts match TP 1) whose tokens or logprobs differ from the first
layout's at all; the TP 2 layout with the fp32 reduction whose logprobs are not closer to one GPU's
(max difference on the common prefix) than the default layout's (bf16 reduction); in float32
(``--dtypes float32,bfloat16``), any layout whose tokens differ.

    python3 benchmarks/gpu_tp_greedy.py               # nvidia-h200-x2, about 3-4 minutes with model creation
    python3 benchmarks/gpu_tp_greedy.py --invariant 2  # nvidia-h200-x2, three layouts: under 4 minutes
    python3 benchmarks/gpu_tp_greedy.py --tiny [--invariant 2]   # CPU dry run (gloo)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent / "lab")]
from kvpilot.tools.random_model import LLAMA31_8B, TINY, write_random_llama  # noqa: E402
from gpu_tp_profile import _layout  # noqa: E402

DEFAULT_LAYOUTS = "1x1,2x1:tp_reduce_fp32=1,2x1,1x2"


def run(model: Path, tp: int, pp: int, dtype: str, prompts, a, device: str, tuning=None) -> dict:
    """Greedy tokens, their logprobs and the batch-1 ITL of one layout."""
    from kvpilot import LLM, KvCacheConfig, SamplingParams

    t0 = time.perf_counter()
    with LLM(str(model), tensor_parallel_size=tp, pipeline_parallel_size=pp, skip_tokenizer_init=True,
             dtype=dtype, device=device, max_seq_len=1024, max_batch_size=8,
             kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.5), tuning=tuning) as llm:
        load_s = time.perf_counter() - t0
        # One request at a time: every layout then runs the same steps (batch 1), so only the
        # layout differs, never the grouping of requests into steps.
        outs = [llm.generate(p, SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True, logprobs=0))
                for p in prompts]

        def timed(n: int) -> float:
            t = time.perf_counter()
            llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            return time.perf_counter() - t

        timed(a.itl_tokens + 1)  # warm-up
        itl = [(timed(a.itl_tokens + 1) - timed(1)) / a.itl_tokens for _ in range(3)]
    return {"tokens": [o.outputs[0].token_ids for o in outs],
            "logprobs": [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs],
            "itl_ms": statistics.median(itl) * 1e3, "load_s": load_s, "total_s": time.perf_counter() - t0}


def decomposition(tp: int, tuning) -> int | None:
    """The TP size whose rounding a layout computes: ``tuning.tp_invariant`` when set; else TP 1's
    (1), TP 2's default bf16 all-reduce of two partials (2, the invariant sum); None otherwise."""
    if tuning.tp_invariant:
        return tuning.tp_invariant
    if tp == 1:
        return 1
    if tp == 2 and not tuning.tp_reduce_fp32:
        return 2
    return None


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(base: dict, res: dict, n_tokens: int) -> dict:
    """First divergence per prompt, identical prompts, max and mean |logprob difference| on the common prefix."""
    div = [first_divergence(x, y) for x, y in zip(base["tokens"], res["tokens"])]
    diffs = [abs(u - v) for d, x, y in zip(div, base["logprobs"], res["logprobs"]) for u, v in list(zip(x, y))[:d]]
    return {"div": div, "same": sum(d == n_tokens for d in div),
            "max_dlp": max(diffs, default=0.0), "mean_dlp": statistics.fmean(diffs) if diffs else 0.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="/tmp/kvpilot-llama8b-random")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--itl-tokens", type=int, default=64)
    ap.add_argument("--tiny", action="store_true", help="CPU dry run on a tiny model")
    ap.add_argument("--invariant", type=int, default=0,
                    help="T: compare TP T and TP 1 default against TP 1 with tp_invariant=T "
                         "(sets --layouts)")
    a = ap.parse_args()
    if a.invariant:
        a.layouts = f"1x1:tp_invariant={a.invariant},{a.invariant}x1,1x1"
    t_start = time.perf_counter()
    shape, device = (TINY, "cpu") if a.tiny else (LLAMA31_8B, "cuda")
    model = Path(a.model_dir + ("_tiny" if a.tiny else ""))
    if not (model / "config.json").exists():
        write_random_llama(model, shape, dtype=torch.bfloat16, device="cuda" if device == "cuda" else "cpu")
        print(f"wrote {model} in {time.perf_counter() - t_start:.0f} s", flush=True)
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(16, 200, (a.prompts,), generator=g).tolist()
    prompts = [torch.randint(3, shape["vocab_size"], (n,), generator=g).tolist() for n in lengths]
    layouts = [(text, *_layout(text)) for text in a.layouts.split(",")]
    failures = []
    print(f"| dtype | layout | load / total s | batch-1 ITL ms | first divergence per prompt (of {a.tokens}) "
          "| identical prompts | logprob diff on the common prefix: max / mean |")
    print("|---|---|---:|---:|---|---:|---:|")
    base_decomp = decomposition(layouts[0][1], layouts[0][3])
    for dtype in a.dtypes.split(","):
        results: dict[str, dict] = {}
        itls: dict[str, float] = {}
        base = None
        for text, tp, pp, tuning in layouts:
            res = run(model, tp, pp, dtype, prompts, a, device, tuning)
            head = f"| {dtype} | {text} | {res['load_s']:.0f} / {res['total_s']:.0f} | {res['itl_ms']:.3f} |"
            itls[text] = res["itl_ms"]
            if base is None:
                base = res
                print(f"{head} reference | | |", flush=True)
                continue
            c = results[text] = compare(base, res, a.tokens)
            print(f"{head} {c['div']} | {c['same']}/{len(c['div'])} | {c['max_dlp']:.2e} / {c['mean_dlp']:.2e} |",
                  flush=True)
            if dtype == "float32" and c["same"] != len(c["div"]):
                failures.append(f"float32 {text}: tokens differ from the first layout")
            same_decomp = base_decomp is not None and decomposition(tp, tuning) == base_decomp
            if dtype != "float32" and same_decomp and (c["same"] != len(c["div"]) or c["max_dlp"] != 0):
                failures.append(f"{dtype} {text}: computes the first layout's decomposition (TP {base_decomp}), "
                                "so its tokens and logprobs must be the first layout's exactly")
        fp32_tp, bf16_tp = results.get("2x1:tp_reduce_fp32=1"), results.get("2x1")
        if dtype != "float32" and fp32_tp and bf16_tp:
            print(f"TP 2 {dtype}: fp32 reduce max/mean logprob diff {fp32_tp['max_dlp']:.2e} / "
                  f"{fp32_tp['mean_dlp']:.2e}"
                  f", bf16 reduce {bf16_tp['max_dlp']:.2e} / {bf16_tp['mean_dlp']:.2e}", flush=True)
            if fp32_tp["max_dlp"] >= bf16_tp["max_dlp"] and bf16_tp["max_dlp"] > 0:
                failures.append(f"{dtype} TP 2: the fp32 reduction is not closer to one GPU than the bf16 one")
        if a.invariant:
            inv_text, tp_text, plain_text = a.layouts.split(",")
            c = results[tp_text]
            t_inv, t_tp, t_plain = itls[inv_text], itls[tp_text], itls[plain_text]
            print(f"{dtype}: TP {a.invariant} vs TP 1 with tp_invariant={a.invariant}: identical prompts "
                  f"{c['same']}/{len(c['div'])}, max logprob difference {c['max_dlp']:.2e}; batch-1 ITL: TP 1 "
                  f"invariant {t_inv:.3f} ms ({t_inv / t_plain:.3f}x TP 1), TP 1 {t_plain:.3f} ms, TP {a.invariant} "
                  f"{t_tp:.3f} ms ({t_tp / t_plain:.3f}x TP 1); TP 1 default vs invariant: identical prompts "
                  f"{results[plain_text]['same']}/{len(c['div'])}", flush=True)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    for f in failures:
        print("FAILED:", f)
    print("OK" if not failures else "FAILED: see above")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
