"""Where a tensor/pipeline-parallel decode step's time goes (2 GPUs, Llama-3.1-8B shape, random bf16).

For each layout (default ``1x1``, ``2x1``, ``1x2`` with pipeline-stage decode graphs, ``1x2`` with
eager stages: ``pp_cuda_graphs=0``), one `LLM` in turn on the random model of
``kvpilot.tools.random_model`` (written once to ``--model-dir``, reused when present):

- greedy tokens of 4 fixed prompts x 32 tokens (with each step's top-2 logprobs), compared with the
  first layout's;
- batch-1 inter-token latency: (time of a 1+N-token request - time of a 1-token request) / N,
  median of 3, after a warm-up;
- with ``Tuning.step_timing`` (set here for every layout), the per-phase table of
  `MultiprocExecutor.step_timing` over exactly those ITL runs (front end: send / wait_answer /
  logits / host_between_steps; each rank: idle / recv / prepare_launch / answer / GPU completion).
- with ``--sampled``, the same ITL of a sampled request (temperature 0.8, top-p 0.9, seed 1) after a
  sampled warm-up, with its own step table, the rows that fell back to the exact draw, whether every
  seeded run drew the same tokens (information), and how many steps the TP output rank drew itself
  (asynchronous steps: its own `Sampler`, ``SYNC_SELF``; ``tp_rank_sampling=0`` leaves them to
  the front end's sampler, ``SYNC_GO``).

A layout is ``TxP`` or ``TxP:FIELD=VAL;FIELD=VAL`` (`kvpilot.tuning.Tuning` overrides for that layout); e.g.
``2x1:logits_event=0;pipe_spin_us=0`` is the old answer path (the output worker
synchronizes before answering, no pipe spinning) for an A/B on the same machine.

Self-check (exit status 1): a layout's first generated token differs from the first layout's; two
layouts of the same ``TxP`` shape (A/B variants) differ in a token other than at a bf16 near-tie (the
later layout's token is the earlier one's second choice there, within `NEAR_TIE` nats; a graph step
pads its batch, which may change the rounding of a matrix product); with ``--sampled``, two layouts
whose `Tuning` overrides differ only in ``tp_rank_sampling`` drew different sampled tokens (the
same logits, so the output rank's draw must be the front end's bit for bit); or a pipeline layout with stage
graphs on reports no graph replay on some rank (step timing's ``stage_graph`` phase). Later tokens of a
different shape may diverge on random weights (bf16, another summation order): the first divergence
index is printed. Results also go to ``$OUT/gpu_tp_profile.json``.

Usage (an nvidia-h200-x2, about 2-3 minutes; from the repo root by path, never ``python -m``):
``python3 benchmarks/lab/gpu_tp_profile.py``; the sampling path at TP 2, the output rank's against the
front end's: ``--layouts "1x1,2x1,2x1:tp_rank_sampling=0" --sampled``. A layout is ``TPxPP`` with optional
`kvpilot.tuning.Tuning` overrides after a colon, ``;``-separated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpilot.tools.random_model import LLAMA31_8B, TINY, write_random_llama  # noqa: E402

DEFAULT_LAYOUTS = "1x1,2x1,1x2,1x2:pp_cuda_graphs=0"
NEAR_TIE = 0.15  # nats: graph vs eager PP 2 parted at a 0.094-nat gap on this random model (H200, 2026-11-30)


def twin_mismatch(a: dict, b: dict) -> str | None:
    """Where layout ``b``'s greedy tokens leave ``a``'s other than at a near-tie (None: nowhere).

    A near-tie: at the first differing token, ``b``'s token is in ``a``'s top two with a logprob
    within `NEAR_TIE` of ``a``'s token; later tokens are not compared (their contexts differ)."""
    for k, (ta, tb) in enumerate(zip(a["greedy"], b["greedy"])):
        i = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if i is None:
            if len(ta) != len(tb):
                return f"prompt {k}: {len(tb)} tokens, not {len(ta)}"
            continue
        top = dict(a["top2"][k][i])
        if tb[i] not in top or abs(top[tb[i]] - top[ta[i]]) > NEAR_TIE:
            return f"prompt {k} token {i}: {tb[i]} instead of {ta[i]} (top two there: {top})"
    return None


def _env_but_sampling(layout: str) -> dict:
    """A layout's `Tuning` overrides without ``tp_rank_sampling`` (which only moves the draw)."""
    return {k: v for k, v in _layout(layout)[2].overrides().items() if k not in ("tp_rank_sampling", "step_timing")}


def _layout(text: str):
    """``TPxPP[:field=value;field=value]`` -> (tp, pp, the layout's `kvpilot.tuning.Tuning`)."""
    from kvpilot.tuning import parse_overrides

    shape, _, fields = text.partition(":")
    tp, pp = (int(v) for v in shape.split("x"))
    tuning = parse_overrides(",".join(f for f in fields.split(";") if f))
    return tp, pp, tuning


def run_layout(model: Path, tp: int, pp: int, a, prompts, tuning=None) -> dict:
    from kvpilot import LLM, SamplingParams

    t0 = time.perf_counter()
    kw = {} if tuning is None else {"tuning": tuning}
    llm = LLM(str(model), tensor_parallel_size=tp, pipeline_parallel_size=pp, skip_tokenizer_init=True,
              max_seq_len=a.max_seq_len, max_batch_size=a.max_batch_size, device=a.device, **kw)
    res: dict = {"tp": tp, "pp": pp, "load_s": round(time.perf_counter() - t0, 1)}
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=a.greedy_len, ignore_eos=True,
                                                    logprobs=2), use_tqdm=False)
        res["greedy"] = [o.outputs[0].token_ids for o in outs]
        res["top2"] = [[[[t, lp.logprob] for t, lp in step.items()] for step in o.outputs[0].logprobs] for o in outs]

        sampled_tokens: list = []  # token ids of each sampled request (seeded: the same every run)

        def timed(n: int, **kw) -> float:
            t = time.perf_counter()
            out = llm.generate(prompts[0], SamplingParams(max_tokens=n, ignore_eos=True,
                                                          **(kw or {"temperature": 0})))
            elapsed = time.perf_counter() - t
            if kw:
                sampled_tokens.append(list(out.outputs[0].token_ids))
            return elapsed

        timed(a.itl_tokens + 1)  # warm-up
        timing = getattr(llm._executor, "step_timing", None)
        if timing is not None:
            timing(reset=True)
        itl = [(timed(a.itl_tokens + 1) - timed(1)) / a.itl_tokens for _ in range(3)]
        res["itl_ms"] = statistics.median(itl) * 1e3
        res["itl_ms_all"] = [round(x * 1e3, 3) for x in itl]
        if timing is not None:
            res["timing"] = timing()
        if a.sampled:  # the front end's sampler every step (top-p, seeded): SYNC_GO at TP
            kw = {"temperature": 0.8, "top_p": 0.9, "seed": 1}
            # Warm-up: the sampling kernels (top-p) are compiled on their first call, which the greedy
            # warm-up never makes; it would otherwise land in the first timed run and the step table.
            timed(a.itl_tokens + 1, **kw)
            sampler = getattr(llm._core, "sampler", None)
            exact0 = getattr(sampler, "exact_rows", None)
            ex = llm._executor
            rank0 = [getattr(ex, k, 0) for k in ("num_rank_sampled_steps", "num_self_steps", "num_rank_redrawn_rows")]
            if timing is not None:
                timing(reset=True)
            sampled = [(timed(a.itl_tokens + 1, **kw) - timed(1, **kw)) / a.itl_tokens for _ in range(3)]
            res["itl_sampled_ms"] = statistics.median(sampled) * 1e3
            res["itl_sampled_ms_all"] = [round(x * 1e3, 3) for x in sampled]
            if timing is not None:
                res["timing_sampled"] = timing()
            # Rows of the timed sampled requests that fell back to the exact draw (not the whole run's),
            # in the front end's sampler or the output rank's; steps the output rank drew / fed itself.
            rank = [getattr(ex, k, 0) - v for k, v in zip(("num_rank_sampled_steps", "num_self_steps",
                                                           "num_rank_redrawn_rows"), rank0)]
            res["sampler_exact_rows"] = None if exact0 is None else sampler.exact_rows - exact0 + rank[2]
            res["rank_sampled_steps"], res["self_steps"] = rank[0], rank[1]
            res["sampled_tokens"] = sampled_tokens[0]
            # Seeded: every run draws the same tokens (a 1-token run, the first of them); information
            # only, since a last-bit difference in the logits may flip a draw at a near-tie.
            first = sampled_tokens[0]
            res["sampled_repeatable"] = all(t == first[:len(t)] for t in sampled_tokens)
    finally:
        llm.shutdown()
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_tp_profile"))
    p.add_argument("--model-dir", default="/tmp/kvpilot_random_8b")
    p.add_argument("--tiny", action="store_true", help="CPU dry run on a tiny model")
    p.add_argument("--device", default="auto")
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS)
    p.add_argument("--greedy-len", type=int, default=32)
    p.add_argument("--sampled", action="store_true",
                   help="also time batch-1 ITL of a sampled request (temperature 0.8, top-p 0.9, seeded)")
    p.add_argument("--itl-tokens", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--max-batch-size", type=int, default=8, help="few graphs to capture: batch 1 is measured")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvpilot.parallel.executor import format_step_timing

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = TINY if a.tiny else LLAMA31_8B
    model = Path(a.model_dir + ("_tiny" if a.tiny else ""))
    t_start = time.perf_counter()
    if not (model / "config.json").is_file():
        write_random_llama(model, cfg, device="cuda" if torch.cuda.is_available() else "cpu")
        print(f"wrote {model} in {time.perf_counter() - t_start:.1f} s", flush=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg["vocab_size"], (n,), generator=g).tolist() for n in (16, 40, 7, 100)]
    results, ok = [], True
    for text in a.layouts.split(","):
        tp, pp, tuning = _layout(text)
        tuning = dataclasses.replace(tuning, step_timing=True)
        try:
            res = run_layout(model, tp, pp, a, prompts, tuning)
        except Exception as e:  # noqa: BLE001 - report it and go on with the next layout
            logging.exception("layout %s failed", text)
            res = {"tp": tp, "pp": pp, "error": repr(e)[:2000]}
            ok = False
        res["layout"] = text
        results.append(res)
        (out / "gpu_tp_profile.json").write_text(json.dumps(results, indent=1))
        if "error" in res:
            print(f"== {text}: FAILED {res['error'][:300]}", flush=True)
            continue
        ref = results[0].get("greedy")
        div = [next((i for i, (x, y) in enumerate(zip(r, o)) if x != y), len(r)) for r, o in zip(ref, res["greedy"])]
        twin = next((r for r in results[:-1] if (r["tp"], r["pp"]) == (tp, pp) and "greedy" in r), None)
        bad_first = any(d == 0 for d in div)
        bad_twin = twin_mismatch(twin, res) if twin is not None else None
        # The sampling path is the only difference: the same logits, so the same draws bit for bit.
        path_twin = next((r for r in results[:-1] if (r["tp"], r["pp"]) == (tp, pp) and "sampled_tokens" in r
                          and _env_but_sampling(r["layout"]) == _env_but_sampling(text)), None)
        if path_twin is not None and "sampled_tokens" in res and path_twin["sampled_tokens"] != res["sampled_tokens"]:
            bad_twin = (bad_twin or "") + f" sampled tokens differ from {path_twin['layout']}'s"
        # Stage graphs on (the default) must have been replayed on every rank.
        graphs_on = (pp > 1 and torch.cuda.is_available() and a.device != "cpu" and tuning.pp_cuda_graphs
                     and tuning.cuda_graphs)
        replays = {r: t.get("stage_graph", {}).get("n", 0) for r, t in res.get("timing", {}).get("ranks", {}).items()}
        res["stage_graph_replays"] = replays
        no_graphs = graphs_on and (not replays or min(replays.values()) == 0)
        ok &= not (bad_first or bad_twin or no_graphs)
        res["first_divergence"] = div
        print(f"== {text}: batch-1 ITL {res['itl_ms']:.3f} ms (runs {res['itl_ms_all']}), load {res['load_s']} s; "
              f"greedy vs {results[0]['layout']}: first divergence per prompt {div} of {a.greedy_len}"
              + (f"; stage graph replays per rank {replays}" if pp > 1 else "")
              + ("  FIRST TOKEN DIFFERS" if bad_first else "")
              + (f"  DIFFERS FROM {twin['layout']}: {bad_twin}" if bad_twin else "")
              + ("  NO STAGE GRAPH REPLAYED" if no_graphs else ""), flush=True)
        if res.get("timing"):
            print(format_step_timing(res["timing"]), flush=True)
        if res.get("timing_sampled"):
            print(f"sampled requests (exact-path rows {res.get('sampler_exact_rows')}, same tokens every run: "
                  f"{res.get('sampled_repeatable')}; steps drawn by the output rank {res.get('rank_sampled_steps')},"
                  f" fed by its own ids {res.get('self_steps')}):\n" + format_step_timing(res["timing_sampled"]),
                  flush=True)
        (out / "gpu_tp_profile.json").write_text(json.dumps(results, indent=1))
    base = results[0].get("itl_ms")
    base_sampled = results[0].get("itl_sampled_ms")
    print("\nlayout                                         ITL ms   vs first   sampled ITL ms  vs first")
    for r in results:
        if "itl_ms" in r:
            sampled = (f"   {r['itl_sampled_ms']:>7.3f}  {r['itl_sampled_ms'] / base_sampled:>6.3f}x"
                       f" (runs {r['itl_sampled_ms_all']})" if "itl_sampled_ms" in r and base_sampled else "")
            print(f"{r['layout']:<46} {r['itl_ms']:>7.3f}   {r['itl_ms'] / base:>6.3f}x{sampled}" if base
                  else r["layout"])
    print(f"total {time.perf_counter() - t_start:.0f} s; {'OK' if ok else 'MISMATCH (see above)'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
