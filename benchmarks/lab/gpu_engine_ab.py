"""A/B of engine switches on steps that carry prefill, in one engine (one load), on a GPU.

The offline run (`gpu_recheck.py`, 1,000 x (1k + 1k)) spends a third of its time in steps of
~8,000 prompt tokens plus a few hundred decodes. This script builds the same engine (Llama-3.1-8B
shape, random bf16 weights, max_batch_size 512, max_num_tokens 8192, ``--kv-dtype``) once and runs
a shorter workload of that kind (``--num-prompts`` x (1,000 in + ``--output-len`` out)) under each
variant, switched at run time between runs:

- ``default``: the tree as it is;
- ``prefill_kernel_decodes``: decode rows of mixed steps left in the prefill kernel
  (``TUNING["prefill"]["decode_rows_to_decode_kernel"] = False``);
- ``torch_sampler``: the engine's sampler on its PyTorch backend (what ``Tuning(triton_sampler=False)`` builds);
- ``default`` again, to show the drift between runs.

For each it prints the mean wall time of decode-only steps and of steps with prefill (the engine's
iteration stats), then profiles (`torch.profiler`, CPU ops and CUDA kernels) a run of steps with
prefill and a run of decode-only steps at batch 256: the GPU's busy time against the span, its
idle gaps longer than 0.2 ms with the host op running meanwhile, and the top kernels; the chrome
traces go to ``--out``. Last, the sampler's cost inside the engine: decode-only step
time at batch ``--sampler-batch`` under greedy, temperature, top-k, top-p and top-k+top-p+min-p.

    python3 benchmarks/lab/gpu_engine_ab.py [--kv-dtype fp8] [--num-prompts 384] [--output-len 32]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpilot.tools.random_model import LLAMA31_8B, write_random_llama  # noqa: E402
from gpu_recheck import StepLog, build  # noqa: E402


def _variants(attention, llm):
    cfg = attention.TUNING["prefill"]

    def set_(decode_kernel: bool, triton_sampler: bool):
        def apply():
            cfg["decode_rows_to_decode_kernel"] = decode_kernel
            llm._core.sampler.backend = "auto" if triton_sampler else "torch"
        return apply

    return [("default", set_(True, True)), ("prefill_kernel_decodes", set_(False, True)),
            ("torch_sampler", set_(True, False)), ("default (again)", set_(True, True))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="/tmp/kvpilot-llama8b-random")
    ap.add_argument("--kv-dtype", default="fp8")
    ap.add_argument("--num-prompts", type=int, default=384)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--profile-prompts", type=int, default=64)
    ap.add_argument("--sampler-batch", type=int, default=256, help="0 skips the sampler-cost section")
    ap.add_argument("--variants", default="1", help="0 skips the A/B variants")
    ap.add_argument("--out", default=None, help="folder for the profiles' chrome traces")
    ap.add_argument("--offline-decode-batch", type=int, default=0,
                    help="profile decode-only steps of the offline regime at this batch (0 skips)")
    ap.add_argument("--no-anatomy", action="store_true", help="skip the batch-1 / batch-256 step split")
    args = ap.parse_args()

    from kvpilot.tools.bench_offline import random_prompts, run_throughput
    from kvpilot.kernels import attention

    path = Path(args.model_dir)
    if not (path / "config.json").exists():
        write_random_llama(path, LLAMA31_8B, dtype=torch.bfloat16, device="cuda")
    log = StepLog()
    llm, load_s = build(path, args.kv_dtype, log)
    print(f"{torch.cuda.get_device_name()}: engine ({args.kv_dtype} KV) loaded in {load_s:.1f} s", flush=True)
    V = LLAMA31_8B["vocab_size"]
    # Every run gets prompts of its own seed: a repeated prompt would hit the prefix cache and skip
    # its prefill.
    fresh = iter(range(100, 10_000))

    def prompts_(n: int, length: int = 1000) -> list[list[int]]:
        return random_prompts(n, length, V, seed=next(fresh))

    run_throughput(llm, prompts_(64), 4)  # warm-up: compile every kernel the variants use
    print(f"\n{args.num_prompts} x (1000 in + {args.output_len} out), fresh prompts per run")
    print("| variant | output tok/s | decode-only steps x ms (batch) | steps with prefill x ms (tokens, decodes) |")
    print("|---|---:|---:|---:|")
    for name, apply in (_variants(attention, llm) if args.variants != "0" else []):
        apply()
        run_throughput(llm, prompts_(32), 4)  # warm the variant's kernels
        log.rows.clear()
        log.on = True
        tp = run_throughput(llm, prompts_(args.num_prompts), args.output_len)
        log.on = False
        s = log.summary()
        d, m = s["decode_only"], s["with_prefill"]
        print(f"| {name} | {tp['output_tokens_per_s']:.0f} | {d.get('steps')} x {d.get('mean_ms', 0):.2f} "
              f"({d.get('mean_generation_requests', 0):.0f}) | {m.get('steps')} x {m.get('mean_ms', 0):.2f} "
              f"({m.get('mean_tokens', 0):.0f}, {m.get('mean_generation_requests', 0):.0f}) |", flush=True)
    _variants(attention, llm)[0][1]()

    if args.offline_decode_batch:
        offline_decode(llm, log, prompts_, args.offline_decode_batch, args.out)
    if not args.no_anatomy:
        anatomy(llm, log, prompts_(1, 128), 256, "batch 1")
        anatomy(llm, log, prompts_(256, 128), 128, "batch 256")
    if args.profile_prompts:
        profile(llm, log, prompts_(args.profile_prompts), 1000, 2, "prefill", args.out)
        profile(llm, log, prompts_(256, 128), 128, 64, "decode", args.out)
    if args.sampler_batch:
        sampler_cost(llm, log, prompts_, args.sampler_batch)
    llm.shutdown()


def _gaps(trace: dict, min_us: float = 200.0) -> tuple[float, float, list[tuple[float, float, str]]]:
    """GPU kernel busy time, span, and the idle gaps longer than ``min_us`` in a chrome trace, each
    with the longest CPU op that overlaps it (what the host was doing while the GPU waited)."""
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    cpu = [e for e in ev if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    if not gpu:
        return 0.0, 0.0, []
    busy, gaps, end = 0.0, [], gpu[0][0]
    for a, b in gpu:
        if a > end + min_us:
            over = [c for c in cpu if c["ts"] < a and c["ts"] + c["dur"] > end]
            name = max(over, key=lambda c: min(a, c["ts"] + c["dur"]) - max(end, c["ts"]))["name"] if over else "-"
            gaps.append((end, a - end, name))
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return busy, end - gpu[0][0], gaps


def profile(llm, log, prompts, input_len: int, output_len: int, name: str, out) -> None:
    """Profile a run (CPU ops + CUDA kernels): kernel busy time against the span of the run, the
    GPU's idle gaps and what the host was doing meanwhile, and the kernels that take the time."""
    import json
    import tempfile

    from kvpilot.tools.bench_offline import run_throughput

    log.rows.clear()
    log.on = True
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        run_throughput(llm, prompts, output_len)
        torch.cuda.synchronize()
    log.on = False
    steps = log.summary()
    path = Path(out or tempfile.mkdtemp()) / f"trace_{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    busy, span, gaps = _gaps(json.loads(path.read_text()))
    idle = sum(g[1] for g in gaps)
    print(f"\nprofile [{name}]: {len(prompts)} x ({input_len} + {output_len}); steps {steps}")
    print(f"GPU busy {busy / 1e3:.1f} ms of a {span / 1e3:.1f} ms span ({100 * busy / max(span, 1):.1f}%); "
          f"{len(gaps)} idle gaps > 0.2 ms, {idle / 1e3:.1f} ms in all")
    by_name: dict[str, list[float]] = {}
    for _, d, n in gaps:
        by_name.setdefault(n, []).append(d)
    print("| host op during the gap | gaps | total ms | mean us |")
    print("|---|---:|---:|---:|")
    for n, ds in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:10]:
        print(f"| {n[:80]} | {len(ds)} | {sum(ds) / 1e3:.2f} | {sum(ds) / len(ds):.0f} |")
    events = prof.key_averages()
    total_us = sum(e.self_device_time_total for e in events)
    print("| kernel | calls | total ms | % of kernel time |")
    print("|---|---:|---:|---:|")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]:
        if e.self_device_time_total <= 0:
            continue
        print(f"| {e.key[:90]} | {e.count} | {e.self_device_time_total / 1e3:.2f} | "
              f"{100 * e.self_device_time_total / total_us:.1f}% |")


@contextlib.contextmanager
def _step_events(llm):
    """Record, for every executor call while active: [sequences, decode-only, CUDA event before the
    call (the GPU is idle then: the last step ended with the sampler's read), event after it returns
    (forward queued), host seconds of the call, event after the sampler's launch (its kernels queued)]."""
    import time

    core = llm._core
    ex, sampler = core.executor, core.sampler
    recs: list[list] = []
    orig_exec, orig_launch = ex.execute, getattr(sampler, "launch", None)

    def execute(plan):
        e0 = torch.cuda.Event(enable_timing=True)
        e0.record()
        t = time.perf_counter()
        r = orig_exec(plan)
        host = time.perf_counter() - t
        e1 = torch.cuda.Event(enable_timing=True)
        e1.record()
        recs.append([len(plan), all(len(p.token_ids) == 1 for p in plan), e0, e1, host, None])
        return r

    def launch(logits, rows):
        h = orig_launch(logits, rows)
        e2 = torch.cuda.Event(enable_timing=True)
        e2.record()
        if recs:
            recs[-1][5] = e2
        return h

    ex.execute = execute
    if orig_launch is not None:
        sampler.launch = launch
    try:
        yield recs
    finally:
        ex.execute = orig_exec
        if orig_launch is not None:
            sampler.launch = orig_launch
        torch.cuda.synchronize()


def _split(log, recs, batch: int) -> Optional[dict]:
    """Medians (ms) over the decode-only steps of exactly ``batch`` sequences: step wall, executor
    host time, GPU time of the forward (from before the call), sampler kernels, and the rest of the
    wall (host work while the GPU idles)."""
    import statistics

    rows = [r for r in log.rows if r[1]]  # one executor call per step with scheduled tokens
    pairs = [(w, r) for w, r in zip(rows, recs) if r[0] == batch and r[1] and w[2] == 0]
    if not pairs:
        return None
    med = statistics.median
    out = {"steps": len(pairs), "wall": med(w[0] for w, _ in pairs) * 1e3, "host": med(r[4] for _, r in pairs) * 1e3,
           "gpu": med(r[2].elapsed_time(r[3]) for _, r in pairs)}
    smp = [r[3].elapsed_time(r[5]) for _, r in pairs if r[5] is not None]
    out["sampler"] = med(smp) if smp else 0.0
    out["idle"] = out["wall"] - out["gpu"] - out["sampler"]
    return out


def anatomy(llm, log, prompts, output_len: int, name: str) -> None:
    """Where a decode-only engine step's wall time goes, without a profiler (`_step_events`)."""
    from kvpilot.tools.bench_offline import run_throughput

    log.rows.clear()
    log.on = True
    with _step_events(llm) as recs:
        run_throughput(llm, prompts, output_len)
    log.on = False
    a = _split(log, recs, len(prompts))
    if a is None:
        print(f"anatomy [{name}]: no full-batch decode steps")
        return
    print(f"anatomy [{name}], {a['steps']} decode steps at batch {len(prompts)}: step wall {a['wall']:.3f} ms; "
          f"executor call (prepare + copy + graph launch) {a['host']:.3f} ms of host time; GPU from before the "
          f"call to the end of the forward {a['gpu']:.3f} ms; sampler kernels {a['sampler']:.3f} ms; the rest "
          f"of the wall (host work while the GPU idles) {a['idle']:.3f} ms", flush=True)


def offline_decode(llm, log, prompts_, batch: int, out, output_len: int = 384) -> None:
    """The decode-only steps of the offline run's regime (``batch`` sequences, 1,000-token prompts,
    contexts 1,000-1,384): the step split of `anatomy`, then a profiler window of ~40 steps once every
    prompt is in, with the kernels' GPU time per step grouped by kernel name."""
    import time

    from kvpilot import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, detokenize=False)
    prompts = prompts_(batch, 1000)
    log.rows.clear()
    log.on = True
    with _step_events(llm) as recs:
        futs = [llm.generate_async(p, params) for p in prompts]
        # Wait until the prefill is over and 20 full-batch decode steps ran, then profile 40 steps.
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120:
            with log.lock:
                full = [r for r in log.rows if r[2] == 0 and r[3] == batch]
            if len(full) >= 20:
                break
            time.sleep(0.01)
        with log.lock:
            n0 = len(log.rows)
        acts = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            while True:
                with log.lock:
                    if len(log.rows) - n0 >= 40:
                        break
                time.sleep(0.002)
            torch.cuda.synchronize()
        with log.lock:
            window = log.rows[n0:]
        for f in futs:
            f.result()
    log.on = False
    a = _split(log, recs, batch)
    if a is not None:
        print(f"offline-regime decode [{batch} x (1000 + {output_len})], {a['steps']} full-batch steps: wall "
              f"{a['wall']:.2f} ms; forward GPU {a['gpu']:.2f} ms; sampler kernels {a['sampler']:.3f} ms; host "
              f"while the GPU idles {a['idle']:.3f} ms; executor host call {a['host']:.3f} ms", flush=True)
    nsteps = max(1, len(window))
    events = prof.key_averages()
    total_us = sum(e.self_device_time_total for e in events)
    print(f"profiler window: {len(window)} steps, mean wall {1e3 * sum(r[0] for r in window) / nsteps:.2f} ms, "
          f"kernel time {total_us / 1e3 / nsteps:.2f} ms per step")
    print("| kernel | calls/step | ms/step | % of kernel time |")
    print("|---|---:|---:|---:|")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:16]:
        if e.self_device_time_total <= 0:
            continue
        print(f"| {e.key[:90]} | {e.count / nsteps:.1f} | {e.self_device_time_total / 1e3 / nsteps:.3f} | "
              f"{100 * e.self_device_time_total / total_us:.1f}% |", flush=True)
    if out:
        prof.export_chrome_trace(str(Path(out) / "trace_offline_decode.json"))


def sampler_cost(llm, log, prompts_, batch: int) -> None:
    """Decode-only step time at ``batch`` sequences (1,024-token prompts, 256 generated tokens each,
    so contexts 1,024-1,280) under greedy and under filtered sampling: the difference is what the
    sampler adds to a step in the engine (its host work overlaps the forward pass; its kernels do
    not). Medians of the full-batch decode steps, split as in `anatomy`."""
    from kvpilot import SamplingParams

    from kvpilot.kernels import sampling as ksampling

    cases = [("greedy", dict(temperature=0.0)), ("temperature 1.0", dict(temperature=1.0)),
             ("top_k 50", dict(temperature=1.0, top_k=50)), ("top_p 0.9", dict(temperature=1.0, top_p=0.9)),
             ("min_p 0.05", dict(temperature=1.0, min_p=0.05)),
             ("top_k 50 + top_p 0.9 + min_p 0.05", dict(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05))]
    if ksampling.CONFIG["pivot_rounds"] > 0:  # A/B: top-p rows through the window path instead
        cases.append(("top_p 0.9, window path (pivot_rounds=0)", dict(temperature=1.0, top_p=0.9)))
    print(f"\nsampler cost in the engine: {batch} x (1024 in + 256 out), decode-only steps (medians)")
    print("| sampling | steps | step ms | vs greedy | forward GPU ms | sampler kernels ms | host while GPU idles ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = None
    default_rounds = ksampling.CONFIG["pivot_rounds"]
    for name, kw in cases:
        ksampling.CONFIG["pivot_rounds"] = 0 if "pivot_rounds=0" in name else default_rounds
        params = SamplingParams(max_tokens=256, ignore_eos=True, detokenize=False, seed=1, **kw)
        # Warm-up with the same parameters: the sampler's kernels compile on their first call, and
        # a compile inside the measured steps would count as sampling time.
        warm = SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False, seed=1, **kw)
        for f in [llm.generate_async(p, warm) for p in prompts_(16, 1024)]:
            f.result()
        prompts = prompts_(batch, 1024)
        log.rows.clear()
        log.on = True
        with _step_events(llm) as recs:
            for f in [llm.generate_async(p, params) for p in prompts]:
                f.result()
        log.on = False
        a = _split(log, recs, batch)
        if a is None:
            print(f"| {name} | 0 | | | | | |")
            continue
        base = a["wall"] if base is None else base
        print(f"| {name} | {a['steps']} | {a['wall']:.2f} | {100 * (a['wall'] - base) / base:+.1f}% | {a['gpu']:.2f} | "
              f"{a['sampler']:.3f} | {a['idle']:.3f} |", flush=True)
    ksampling.CONFIG["pivot_rounds"] = default_rounds


if __name__ == "__main__":
    main()
