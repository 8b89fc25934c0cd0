"""CPU (gloo) per-step time of the tensor/pipeline-parallel engine on a tiny random Llama.

A step of `TINY` (2 layers, hidden 64) takes microseconds of compute, so on CPU a parallel step's
time is almost all executor overhead: plan pickling and pipes, worker wake-ups, the gloo
collectives, logits on the pipe. This measures it per layout, before/after A/B style:

    cd /tmp && /work/main/.venv/bin/python /work/main/benchmarks/lab/parallel_step_cpu.py --layouts 1x1,2x1,1x2

Per layout: batch-1 inter-token latency ((time of 1+N tokens - time of 1 token) / N, median of 5)
and the time per decode step at batch 32; with ``--tuning step_timing=1`` also the per-phase table
of `MultiprocExecutor.step_timing` for the batch-1 run. Greedy tokens are compared with the first
layout's (exit status 1 on a mismatch).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpilot.tools.random_model import TINY, write_random_llama  # noqa: E402


def run(model: Path, tp: int, pp: int, a) -> dict:
    from kvpilot import LLM, SamplingParams
    from kvpilot.tuning import parse_overrides

    llm = LLM(str(model), tensor_parallel_size=tp, pipeline_parallel_size=pp, skip_tokenizer_init=True,
              max_seq_len=512, max_batch_size=64, device="cpu", dtype="float32", tuning=parse_overrides(a.tuning))
    try:
        prompts = [[1, 7 + i, 99, 250 + i] for i in range(a.batch)]
        sp = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
        greedy = [o.outputs[0].token_ids for o in llm.generate(prompts[:4], sp, use_tqdm=False)]

        def timed(prompts, n):
            t = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
            return time.perf_counter() - t

        timed(prompts[:1], a.tokens + 1)
        timing = getattr(llm._executor, "step_timing", None)
        if timing:
            timing(reset=True)
        itl = statistics.median((timed(prompts[:1], a.tokens + 1) - timed(prompts[:1], 1)) / a.tokens
                                for _ in range(5))
        table = timing() if timing else None
        step = statistics.median((timed(prompts, a.tokens + 1) - timed(prompts, 1)) / a.tokens for _ in range(3))
    finally:
        llm.shutdown()
    return {"itl_ms": itl * 1e3, "step_b32_ms": step * 1e3, "greedy": greedy, "timing": table}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", default="1x1,2x1,1x2")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tuning", default="", help="kvpilot.tuning.Tuning overrides for every layout, e.g. step_timing=1")
    a = p.parse_args()
    import kvpilot.parallel.executor as par

    fmt = getattr(par, "format_step_timing", repr)

    with tempfile.TemporaryDirectory() as d:
        model = Path(d) / "tiny"
        write_random_llama(model, TINY, dtype=__import__("torch").float32)
        ref, ok = None, True
        for text in a.layouts.split(","):
            tp, pp = (int(v) for v in text.split("x"))
            r = run(model, tp, pp, a)
            same = ref is None or r["greedy"] == ref
            ok &= same
            ref = ref or r["greedy"]
            print(f"{text}: batch-1 ITL {r['itl_ms']:.2f} ms, batch-{a.batch} step {r['step_b32_ms']:.2f} ms, "
                  f"greedy {'same' if same else 'DIFFERENT'}")
            if r["timing"]:
                print(fmt(r["timing"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
