#!/usr/bin/env python3
"""kvpilot on one GPU: correctness against transformers, and the five GPU benchmarks, in one run.

Usage (from the repo root; never ``python -m``: the repo's operator/ folder shadows the stdlib)::

    python3 benchmarks/gpu_bench.py --out $OUT            # H200: Llama-3.1-8B shape, bf16
    python3 benchmarks/gpu_bench.py --tiny --out /tmp/gb  # CPU dry run of every code path

Order: measured ceilings (device copy bandwidth, bf16 matrix-product rate) -> stories260K golden
text on the device -> a random-weight checkpoint written with `kvpilot.tools.random_model` -> the kvpilot
phase (KV capacity, 512-token prefill logits, greedy tokens of 32 prompts, decode step timings with
the LM head inside/outside the CUDA graph and eagerly, batch-1 latency, 8k prefill, the batch-64
workload, the concurrency and context sweeps, offline throughput) -> the transformers phase (same
logits and greedy tokens, `generate` with a static cache at batch 1 and 64) -> comparison, plots,
a table. Results go to ``OUT/gpu_bench.json`` after every section, so a run cut short keeps what it
measured; sections that would overrun ``--budget-s`` are skipped and say so.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

from kvpilot.tools.random_model import LLAMA31_8B, TINY, write_random_llama  # noqa: E402

log = logging.getLogger("gpu_bench")


class Run:
    """Result store with a time budget; each section's failure is recorded, not fatal."""

    def __init__(self, out: Path, budget_s: float, name: str = "gpu_bench.json") -> None:
        self.out = out
        self.name = name
        self.t0 = time.monotonic()
        self.budget = budget_s
        self.res: dict = {"sections": {}}

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    @contextmanager
    def section(self, name: str, need_s: float = 0.0):
        info = self.res["sections"].setdefault(name, {})
        if self.left() < need_s:
            info["skipped"] = f"{self.left():.0f} s left, section needs ~{need_s:.0f} s"
            log.warning("skip %s: %s", name, info["skipped"])
            yield None
            return
        t = time.monotonic()
        log.info("== %s (%.0f s left)", name, self.left())
        try:
            yield info
        except Exception as e:  # keep measuring the other sections
            info["error"] = f"{type(e).__name__}: {e}"
            info["traceback"] = traceback.format_exc()[-3000:]
            log.error("section %s failed:\n%s", name, info["traceback"])
        info["seconds"] = round(time.monotonic() - t, 2)
        self.save()

    def save(self) -> None:
        (self.out / self.name).write_text(json.dumps(self.res, indent=1, default=str))


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def bench_ms(fn, dev: str, reps: int) -> float:
    """Median milliseconds of ``fn()`` (triton's do_bench with CUDA events on GPU, wall clock on CPU)."""
    if dev.startswith("cuda"):
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=300, rep=max(reps * 10, 200), return_mode="median"))
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def ceilings(info: dict, dev: str, tiny: bool) -> None:
    n = (1 << 20) if tiny else (1 << 30)  # float32 elements: 4 MB or 4 GB
    a = torch.randn(n, device=dev)
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a), dev, 20)
    info["copy_bytes"] = 2 * a.numel() * 4
    info["copy_bandwidth_Bps"] = info["copy_bytes"] / (ms / 1e3)
    del a, b
    m = 512 if tiny else 8192
    dt = torch.float32 if tiny else torch.bfloat16
    x, y = (torch.randn(m, m, device=dev, dtype=dt) for _ in range(2))
    ms = bench_ms(lambda: x @ y, dev, 10)
    info["matmul_shape"] = m
    info["matmul_flops_per_s"] = 2 * m ** 3 / (ms / 1e3)


def stories_golden(info: dict, dev: str) -> None:
    from kvpilot.tools.convert_llama2c import STORIES260K_GREEDY as GOLDEN
    from kvpilot import LLM, KvCacheConfig, SamplingParams
    from kvpilot.tools.convert_llama2c import ensure_stories260k

    path = ensure_stories260k()
    for dtype in ("float32", "bfloat16"):
        with LLM(str(path), device=dev, dtype=dtype, max_batch_size=8,
                 kv_cache_config=KvCacheConfig(max_tokens=8192)) as llm:
            text = llm.generate("", SamplingParams(temperature=0, max_tokens=120)).outputs[0].text
        ok = text.startswith(GOLDEN) or GOLDEN.startswith(text)
        info[dtype] = {"matches_golden": ok, "text": text[:300]}


def model_flops(cfg: dict, T: int) -> float:
    """Forward FLOPs of a T-token causal prefill (matrix products + attention; LM head for one token)."""
    h, inter, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    nh, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // nh
    per_tok = L * (h * (nh + 2 * kvh) * hd + nh * hd * h + 3 * h * inter)
    attn = L * 2 * 2 * nh * hd * T * (T + 1) / 2
    return 2 * per_tok * T + attn + 2 * h * cfg["vocab_size"]


def direct_seqs(runner, token_lists, all_logits=False, start_pos=None):
    """ScheduledSeqs on consecutive fresh blocks (only while the engine is idle and nothing is cached)."""
    from kvpilot.runner.model_runner import ScheduledSeq

    B, blk, seqs = runner.block_size, 0, []
    for i, toks in enumerate(token_lists):
        start = 0 if start_pos is None else start_pos
        nb = -(-(start + len(toks)) // B)
        seqs.append(ScheduledSeq(-1 - i, list(toks), start, list(range(blk, blk + nb)), True, all_logits))
        blk += nb
    return seqs


def decode_step_ms(runner, b: int, ctx: int, iters: int) -> float:
    """Wall ms of one decode step of ``b`` sequences at context ``ctx``, argmax read back (as the sampler)."""
    seqs = direct_seqs(runner, [[5]] * b, start_pos=ctx - 1)
    for _ in range(3):
        runner.execute(seqs)[0].argmax(-1).tolist()
    t = time.perf_counter()
    for _ in range(iters):
        runner.execute(seqs)[0].argmax(-1).tolist()
    return (time.perf_counter() - t) / iters * 1e3


def kvpilot_phase(run: Run, a, model_dir: Path, cfg: dict, store: dict) -> None:
    from kvpilot import LLM, KvCacheConfig, SamplingParams
    from kvpilot.tools.bench_offline import random_prompts, run_latency, run_throughput
    from kvpilot.runner.cuda_graphs import DecodeGraphs

    V, tiny, dev = cfg["vocab_size"], a.tiny, a.device
    bw = run.res["sections"].get("ceilings", {}).get("copy_bandwidth_Bps")
    with run.section("kvpilot_load") as info:
        t = time.monotonic()
        llm = LLM(str(model_dir), skip_tokenizer_init=True, device=dev, dtype=a.dtype,
                  max_batch_size=a.max_batch_size, max_num_tokens=a.max_num_tokens, max_seq_len=a.max_seq_len,
                  kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.9))
        runner = llm._executor
        info.update(wall_s=time.monotonic() - t, weights_s=runner.load_seconds, weight_bytes=runner.weight_bytes,
                    graphs=len(runner.graphs.graphs) if runner.graphs else 0,
                    graph_capture_s=runner.graphs.capture_seconds if runner.graphs else 0)
        per_tok = runner.bytes_per_block // runner.block_size
        run.res["kv_capacity"] = {
            "pool_tokens": llm.pool_tokens, "bytes_per_token": per_tok, "free_bytes_after_profile": runner.free_bytes_for_kv,
            "profile_peak_bytes": runner.profile_peak_bytes, "fraction": 0.9,
            "expected_tokens": int(0.9 * runner.free_bytes_for_kv // per_tok),
        }
    if "error" in run.res["sections"]["kvpilot_load"]:
        return
    embed_bytes = V * cfg["hidden_size"] * runner.model.embed_tokens.weight.element_size()
    weight_read = runner.weight_bytes - embed_bytes + cfg["hidden_size"] * 2
    with run.section("kvpilot_direct") as info:
        logits, _ = runner.execute(direct_seqs(runner, [store["prompt512"]], all_logits=True))
        store["kv_logits"] = logits.float().cpu()
        T = a.prefill_len
        times = []
        for it in range(4):
            seqs = direct_seqs(runner, [random_prompts(1, T, V, seed=9000 + it)[0]])
            sync(dev)
            t = time.perf_counter()
            runner.execute(seqs)[0].argmax(-1).tolist()
            times.append(time.perf_counter() - t)
        flops = model_flops(cfg, T)
        t_med = statistics.median(times[1:])
        mm = run.res["sections"].get("ceilings", {}).get("matmul_flops_per_s")
        run.res["prefill"] = {"tokens": T, "seconds_runner": t_med, "all_s": times, "flops": flops,
                              "flops_per_s": flops / t_med, "pct_of_matmul": 100 * flops / t_med / mm if mm else None}
        steps = {}
        ctx = 384
        for b in a.step_batches:
            steps[f"eager_b{b}"] = None
            if runner.graphs is not None:
                steps[f"graph_lm_in_b{b}"] = decode_step_ms(runner, b, ctx, a.step_iters)
            saved = runner.graphs
            runner.graphs = None
            steps[f"eager_b{b}"] = decode_step_ms(runner, b, ctx, max(3, a.step_iters // 5))
            runner.graphs = saved
        if runner.graphs is not None:
            alt = DecodeGraphs(runner, batch_sizes=list(a.step_batches), lm_head_in_graph=False)
            alt.capture()
            saved, runner.graphs = runner.graphs, alt
            for b in a.step_batches:
                steps[f"graph_lm_out_b{b}"] = decode_step_ms(runner, b, ctx, a.step_iters)
            runner.graphs = saved
            del alt
        run.res["decode_steps_ms_ctx384"] = steps
    with run.section("correctness_kvpilot") as info:
        sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, detokenize=False)
        store["kv_greedy"] = [o.outputs[0].token_ids for o in llm.generate(store["prompts32"], sp, use_tqdm=False)]
    with run.section("latency_b1") as info:
        lat = run_latency(llm, 128, a.lat_out, 1, num_iters=3, num_warmup=1, seed=128)
        kv_bytes = per_tok * (128 + (a.lat_out - 1) / 2)
        floor = (weight_read + kv_bytes) / bw if bw else None
        lat.update(weight_bytes_read_per_step=weight_read, kv_bytes_per_step_mean=kv_bytes, floor_itl_s=floor,
                   pct_of_floor_speed=100 * floor / lat["itl_s"] if floor else None)
        run.res["latency_b1"] = lat
    with run.section("prefill_llm", need_s=20) as info:
        ts = []
        for it in range(3):
            p = random_prompts(1, a.prefill_len, V, seed=7000 + it)[0]
            t = time.monotonic()
            llm.generate(p, SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False))
            ts.append(time.monotonic() - t)
        run.res["prefill"]["seconds_llm_ttft"] = statistics.median(ts[1:])
    with run.section("batch64_kvpilot", need_s=30) as info:
        run.res["batch64_kvpilot"] = run_throughput(llm, store["prompts64"], a.b64_out, max_concurrency=64)
    with run.section("concurrency_sweep", need_s=40) as info:
        sweep = []
        for c in a.sweep:
            r = run_throughput(llm, random_prompts(c, 128, V, seed=100 + c), 128, max_concurrency=c)
            sweep.append({"concurrency": c, "output_tokens_per_s": r["output_tokens_per_s"], "elapsed_s": r["elapsed_s"]})
        run.res["concurrency_sweep"] = sweep
    with run.section("itl_vs_context", need_s=30) as info:
        pts = []
        for ctx in a.contexts:
            r = run_latency(llm, ctx, 64, 1, num_iters=1, num_warmup=0, seed=ctx)
            fl = (weight_read + per_tok * (ctx + 32)) / bw if bw else None
            pts.append({"context": ctx, "itl_s": r["itl_s"], "floor_itl_s": fl, "ttft_s": r["ttft_s"]})
        run.res["itl_vs_context"] = pts
    with run.section("throughput", need_s=min(a.tp_need_s, 30)) as info:
        n = a.tp_prompts
        if not tiny and run.left() < a.tp_need_s:  # fewer requests rather than none; the JSON says how many
            n = max(100, int((run.left() - 20) / 0.1))
        prompts = random_prompts(n, a.tp_in, V, seed=1000)
        run.res["throughput"] = run_throughput(llm, prompts, a.tp_out)
    with run.section("kvpilot_shutdown") as info:
        llm.shutdown()
        del llm, runner
        gc.collect()
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
            info["allocated_after"] = torch.cuda.memory_allocated()


def make_prompts(a, V: int) -> dict:
    """The prompts both phases use (fixed seeds, so the transformers subprocess draws the same)."""
    from kvpilot.tools.bench_offline import random_prompts

    return {"prompt512": random_prompts(1, 512 if not a.tiny else 64, V, seed=512)[0],
            "prompts32": random_prompts(32, 64, V, seed=32), "prompt128": random_prompts(1, 128, V, seed=128)[0],
            "prompts64": random_prompts(64, a.b64_in, V, seed=64)}


def hf_phase(run: Run, a, model_dir: Path, store: dict, refs_path: Path) -> None:
    """transformers on the same checkpoint: reference logits and greedy tokens (saved to ``refs_path``),
    then `generate` with a static cache (its auto-compile and CUDA graphs) at batch 1 and 64."""
    from transformers import LlamaForCausalLM

    dev = a.device
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[a.dtype]
    with run.section("hf_load") as info:
        kw = {"device_map": dev} if dev.startswith("cuda") else {}  # device_map needs accelerate
        model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **kw).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
    if "error" in run.res["sections"]["hf_load"]:
        return
    gen_kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, temperature=None, top_p=None, top_k=None)
    with torch.inference_mode():
        with run.section("correctness_hf") as info:
            logits = model(torch.tensor([store["prompt512"]], device=dev)).logits[0].float().cpu()
            ids = torch.tensor(store["prompts32"], device=dev)
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64,
                               output_logits=True, return_dict_in_generate=True, **gen_kw)
            torch.save({"logits": logits, "greedy": g.sequences[:, ids.shape[1]:].tolist(),
                        "step_logits": torch.stack([x.float().cpu() for x in g.logits])}, refs_path)
            del g
        for name, prompts, out_len, need in (("hf_static_b1", [store["prompt128"]], a.lat_out, 100),
                                             ("hf_static_b64", store["prompts64"], a.b64_out, 90)):
            with run.section(name, need_s=need if not a.tiny else 0) as info:
                ids = torch.tensor(prompts, device=dev)
                kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=out_len, min_new_tokens=out_len,
                          cache_implementation="static", **gen_kw)
                times, compiled = [], True
                for i in range(3 if name.endswith("b1") else 2):  # the first call compiles
                    sync(dev)
                    t = time.perf_counter()
                    try:
                        out = model.generate(ids, **kw)
                    except Exception as e:  # no compiler on the machine: say so, time it uncompiled
                        if not compiled:
                            raise
                        info["compile_error"] = f"{type(e).__name__}: {e}"[:500]
                        compiled, kw["disable_compile"] = False, True
                        out = model.generate(ids, **kw)
                    sync(dev)
                    times.append(time.perf_counter() - t)
                    assert out.shape[1] == ids.shape[1] + out_len
                info.update(first_call_s=times[0], timed_s=times[1:])
                run.res[name] = {"batch": len(prompts), "input_len": ids.shape[1], "output_len": out_len,
                                 "compiled": compiled,
                                 "output_tokens_per_s": len(prompts) * out_len / statistics.median(times[1:])}


def compare(run: Run, store: dict, refs_path: Path) -> None:
    """kvpilot vs transformers: logits relative error; greedy agreement, divergences at bf16 ties apart.

    A divergence counts as a tie when, at the first differing step, transformers' own logits put
    kvpilot's token within ``3 x`` the RMS logit difference measured on the 512-token prefill.
    """
    refs = torch.load(refs_path)
    ref, kv = refs["logits"], store["kv_logits"]
    diff = kv - ref
    c = run.res["correctness"] = {
        "logits_rel_err": float(diff.norm() / ref.norm()), "logits_max_abs_err": float(diff.abs().max()),
        "logits_rms_abs_err": float(diff.pow(2).mean().sqrt()), "prompt_len": int(ref.shape[0])}
    tol = 3 * c["logits_rms_abs_err"]
    exact, ties, margins = 0, 0, []
    for i, (h, k) in enumerate(zip(refs["greedy"], store["kv_greedy"])):
        t = next((j for j, (x, y) in enumerate(zip(h, k)) if x != y), None)
        if t is None and len(h) == len(k):
            exact += 1
            continue
        step = refs["step_logits"][t, i]
        gap = float(step[h[t]] - step[k[t]])
        margins.append({"prompt": i, "step": t, "hf_margin_over_kvpilot_token": gap})
        ties += gap <= tol
    c.update(greedy_prompts=len(refs["greedy"]), greedy_steps=64, greedy_identical=exact,
             greedy_diverged_at_bf16_tie=int(ties), tie_tolerance=tol, divergences=margins)


def plots(run: Run, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r, title = run.res, run.res.get("env", {}).get("device", "")
    if r.get("concurrency_sweep"):
        xs = [p["concurrency"] for p in r["concurrency_sweep"]]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(xs, [p["output_tokens_per_s"] for p in r["concurrency_sweep"]], "o-")
        ax.set(xscale="log", xlabel="concurrent requests (128 in / 128 out)", ylabel="output tokens/s",
               title=f"kvpilot, Llama-3.1-8B shape bf16, {title}")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "gpu_concurrency.png", dpi=120)
    if r.get("itl_vs_context"):
        pts = r["itl_vs_context"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([p["context"] for p in pts], [1e3 * p["itl_s"] for p in pts], "o-", label="kvpilot, batch 1")
        if pts[0].get("floor_itl_s"):
            ax.plot([p["context"] for p in pts], [1e3 * p["floor_itl_s"] for p in pts], "--", label="bandwidth floor")
        ax.set(xscale="log", xlabel="context length (tokens)", ylabel="inter-token latency (ms)", title=title)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "gpu_itl_vs_context.png", dpi=120)


def table(run: Run) -> str:
    r = run.res
    g = lambda *ks: _get(r, ks)  # noqa: E731
    lat, hf1, hf64 = g("latency_b1"), g("hf_static_b1"), g("hf_static_b64")
    rows = [
        ("copy bandwidth (TB/s)", _f(g("sections", "ceilings", "copy_bandwidth_Bps"), 1e-12)),
        ("bf16 matmul (TFLOP/s)", _f(g("sections", "ceilings", "matmul_flops_per_s"), 1e-12)),
        ("logits rel err (512 tok)", _f(g("correctness", "logits_rel_err"), 1, "{:.2e}")),
        ("greedy identical / bf16 tie", f"{g('correctness', 'greedy_identical')} / "
                                        f"{g('correctness', 'greedy_diverged_at_bf16_tie')} of 32"),
        ("1. ITL b1 (ms) / floor (ms)", f"{_f(lat and lat['itl_s'], 1e3)} / {_f(lat and lat['floor_itl_s'], 1e3)}"),
        ("1. % of floor speed", _f(lat and lat["pct_of_floor_speed"], 1, "{:.1f}")),
        ("1. tok/s kvpilot / HF static", f"{_f(lat and 1 / lat['itl_s'], 1, '{:.1f}')} / "
                                          f"{_f(hf1 and hf1['output_tokens_per_s'], 1, '{:.1f}')}"),
        ("2. throughput (out tok/s)", _f(g("throughput", "output_tokens_per_s"), 1, "{:.0f}")),
        ("3. b64 kvpilot / HF (out tok/s)", f"{_f(g('batch64_kvpilot', 'output_tokens_per_s'), 1, '{:.0f}')} / "
                                            f"{_f(hf64 and hf64['output_tokens_per_s'], 1, '{:.0f}')}"),
        ("4. prefill 8k TFLOP/s (% mm)", f"{_f(g('prefill', 'flops_per_s'), 1e-12)} "
                                         f"({_f(g('prefill', 'pct_of_matmul'), 1, '{:.1f}')}%)"),
        ("5. KV tokens / expected", f"{g('kv_capacity', 'pool_tokens')} / {g('kv_capacity', 'expected_tokens')}"),
    ]
    return "\n".join(f"{k:34s} {v}" for k, v in rows)


def _get(d, ks):
    for k in ks:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _f(x, scale=1.0, fmt="{:.3f}") -> str:
    return "n/a" if x is None else fmt.format(x * scale)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_bench"))
    p.add_argument("--tiny", action="store_true", help="tiny random model (CPU dry run)")
    p.add_argument("--model-dir", default=None, help="where to write the random checkpoint")
    p.add_argument("--budget-s", type=float, default=540)
    p.add_argument("--tp-prompts", type=int, default=None)
    p.add_argument("--skip", default="", help="comma-separated: stories,hf,throughput,sweep")
    p.add_argument("--hf-budget-s", type=float, default=230)
    p.add_argument("--hf-only", action="store_true", help="(internal) the transformers subprocess")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and not a.tiny
    a.device = "cuda" if cuda else "cpu"
    a.dtype = "bfloat16" if cuda else "float32"
    cfg = TINY if a.tiny else LLAMA31_8B
    big = not a.tiny
    a.max_batch_size, a.max_num_tokens = (512, 8192) if big else (16, 256)
    a.max_seq_len = 32768 + 256 if big else 1024
    a.prefill_len, a.lat_out = (8192, 512) if big else (200, 16)
    a.b64_in, a.b64_out = (512, 256) if big else (32, 8)
    a.step_batches, a.step_iters = ((1, 64, 256), 50) if big else ((1, 4), 3)
    a.sweep = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512] if big else [1, 2, 4]
    a.contexts = [128, 1024, 4096, 8192, 16384, 32768] if big else [16, 64, 256]
    a.tp_prompts = a.tp_prompts or (1000 if big else 12)
    a.tp_in, a.tp_out = (1000, 1000) if big else (24, 24)
    a.tp_need_s = a.tp_prompts * 0.12 if big else 0
    skip = set(filter(None, a.skip.split(",")))
    if "throughput" in skip:
        a.tp_need_s = 1e9
    if "sweep" in skip:
        a.sweep = []
    model_dir = Path(a.model_dir or ("/dev/shm/kvpilot-rand" if Path("/dev/shm").is_dir() and big else "/tmp/kvpilot-rand"))
    refs_path = model_dir.parent / "kvpilot-hf-refs.pt"
    if a.hf_only:  # transformers in its own process, so its memory (and compiled graphs) go with it
        run = Run(out, a.budget_s, "hf_bench.json")
        hf_phase(run, a, model_dir, make_prompts(a, cfg["vocab_size"]), refs_path)
        run.save()
        return 0
    run = Run(out, a.budget_s)
    import transformers
    import triton

    run.res["env"] = {"device": torch.cuda.get_device_name() if cuda else "cpu", "date": time.strftime("%Y-%m-%d"),
                      "torch": torch.__version__, "triton": triton.__version__,
                      "transformers": transformers.__version__, "model": "tiny" if a.tiny else "Llama-3.1-8B shape",
                      "dtype": a.dtype, "command": " ".join(sys.argv)}
    with run.section("ceilings") as info:
        ceilings(info, a.device, a.tiny)
    if "stories" not in skip:
        with run.section("stories260k") as info:
            stories_golden(info, a.device)
    with run.section("write_model") as info:
        write_random_llama(model_dir, cfg, dtype=getattr(torch, a.dtype), device=a.device, seed=0)
    store = make_prompts(a, cfg["vocab_size"])
    if "hf" not in skip:
        with run.section("hf_subprocess") as info:
            import subprocess

            budget = min(a.hf_budget_s, run.left() - 200) if big else a.hf_budget_s
            cmd = [sys.executable, __file__, "--hf-only", "--out", str(out), "--budget-s", str(budget),
                   "--model-dir", str(model_dir)] + (["--tiny"] if a.tiny else [])
            info["returncode"] = subprocess.run(cmd, timeout=budget + 90).returncode
            hf = json.loads((out / "hf_bench.json").read_text())
            for k, v in hf.pop("sections").items():
                run.res["sections"]["hf/" + k] = v
            run.res.update(hf)
    kvpilot_phase(run, a, model_dir, cfg, store)
    if refs_path.is_file():
        with run.section("compare") as info:
            compare(run, store, refs_path)
    with run.section("plots") as info:
        plots(run, out)
    run.res["table"] = table(run)
    run.save()
    print("\n" + run.res["table"])
    errors = {k: v["error"] for k, v in run.res["sections"].items() if "error" in v}
    print("errors:", json.dumps(errors, indent=1) if errors else "none")
    print(f"total {time.monotonic() - run.t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
