"""GPU check of the seventh session's review of beam re-admission (tests/engine/core/test_beam_token_budget.py).

Beam requests and long greedy requests on the CUDA engine (graphs, async scheduling on and off), a
random float32 Llama of the `TINY` shape with peaked distributions (std 0.2, so that no two beam
candidates tie), every request compared with a reference run that neither preempts nor chunks:

- ``pool``: 8 beam requests (width 4) and 8 long greedy ones in a pool a quarter of their demand
  (re-admitted beam requests share their blocks);
- ``budget``: the 8 beam requests alone with ``max_num_tokens`` 4 (their width): before the review's
  fix, forks appended behind later requests left every beam request one beam short of every step's
  budget, and the engine stepped forever (a livelock: reported as such here);
- ``both``: all 16 requests, a pool of 20 blocks and ``max_num_tokens`` 12.

Each run is stepped by hand (as tests/engine/core/test_beam_preemption.py `_drive`) and stops as a livelock
after 400 steps in a row without a new token. Prints one table row per run (steps, preemptions,
wall seconds, generated tokens/s) and exits 1 if any request differs from the reference (tokens, or
cumulative log-probability by more than 1e-3) or a run livelocks. About a minute on an H200.

    python3 benchmarks/gpu_review7.py [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_random_model import TINY, write_random_llama  # noqa: E402


def _workload(beams_only: bool = False) -> list:
    """8 beam requests (width 4, 24 tokens) and, unless ``beams_only``, 8 greedy ones (120 tokens);
    41-token prompts, so that beams share 2 full blocks of 16."""
    from kvpilot import SamplingParams

    beam = SamplingParams(use_beam_search=True, best_of=4, n=2, max_tokens=24, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    kinds = (beam,) if beams_only else (beam, greedy)
    return [([1] + [(7 * i + j) % 500 + 3 for j in range(40)], sp) for i in range(8) for sp in kinds]


def run(model: Path, device: str, items: list, pool_tokens: int, max_num_tokens: int, async_scheduling: bool,
        max_idle: int = 400) -> dict:
    """One engine run of ``items`` ((prompt, SamplingParams) pairs), stepped here; ``results`` is
    None after a livelock."""
    import os

    from kvpilot import LLM, KvCacheConfig

    os.environ["KVPILOT_ASYNC_SCHEDULING"] = "1" if async_scheduling else "0"
    llm = LLM(str(model), skip_tokenizer_init=True, device=device, dtype="float32", max_batch_size=64,
              max_num_tokens=max_num_tokens,
              kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=pool_tokens))
    llm._loop.stop()  # stepped here, so that a livelock is reported instead of hanging
    core = llm._core
    try:
        reqs = [llm._make_request(p, sp, False) for p, sp in items]
        for r in reqs:
            core.add_request(r)
        steps = idle = last = 0
        t0 = time.perf_counter()
        while core.has_work:
            core.step()
            core.flush_outputs()
            steps += 1
            total = sum(len(s.token_ids) for r in reqs for s in r.seqs)
            idle, last = (idle + 1 if total == last else 0), total
            if idle >= max_idle:
                return dict(results=None, steps=steps, preemptions=core.scheduler.num_preemptions,
                            seconds=time.perf_counter() - t0, tokens=0)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        core.flush_outputs()
        results = [r.output.result(timeout=0) for r in reqs]
        tokens = sum(len(o.token_ids) for res in results for o in res.outputs)
        return dict(results=results, steps=steps, preemptions=core.scheduler.num_preemptions, seconds=seconds,
                    tokens=tokens, leaked=core.kv.num_used_blocks)
    finally:
        llm.shutdown()


def same(a, b) -> bool:
    return ([o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
            and all(abs(x.cumulative_logprob - y.cumulative_logprob) <= 1e-3
                    for x, y in zip(a.outputs, b.outputs) if x.cumulative_logprob is not None))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        model = write_random_llama(Path(tmp) / "tiny", TINY, dtype=torch.float32, std=0.2)
        refs = {b: run(model, args.device, _workload(b), 16384, 512, False) for b in (False, True)}
        assert all(r["results"] is not None and r["preemptions"] == 0 for r in refs.values())
        print("| run | async | steps | preemptions | seconds | tokens/s | every request as the reference |")
        print("|---|---|---:|---:|---:|---:|---|")
        for b, ref in refs.items():
            print(f"| reference{' (beams only)' if b else ''} | off | {ref['steps']} | 0 | {ref['seconds']:.2f} | "
                  f"{ref['tokens'] / ref['seconds']:.0f} | - |")
        for name, beams_only, pool, budget in (("pool", False, 640, 512), ("budget", True, 16384, 4),
                                               ("both", False, 320, 12)):
            ref = refs[beams_only]
            for async_scheduling in (False, True):
                r = run(model, args.device, _workload(beams_only), pool, budget, async_scheduling)
                if r["results"] is None:
                    verdict, good = "LIVELOCK", False
                else:
                    bad = [i for i, (a, b) in enumerate(zip(r["results"], ref["results"])) if not same(a, b)]
                    good = not bad and r["leaked"] == 0 and (name == "budget" or r["preemptions"] > 0)
                    verdict = "yes" if good else (f"NO: requests {bad}, leaked {r['leaked']}, "
                                                  f"preemptions {r['preemptions']}")
                ok &= good
                rate = r["tokens"] / r["seconds"] if r["tokens"] else 0.0
                print(f"| {name} | {'on' if async_scheduling else 'off'} | {r['steps']} | {r['preemptions']} | "
                      f"{r['seconds']:.2f} | {rate:.0f} | {verdict} |", flush=True)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
