"""Micro-benchmark of the batched sampler (engine/sampling/sampler.py) at serving batch sizes, self-checking.

Times `Sampler(backend)(logits, rows)` (on CUDA by default the Triton kernels of
kvpilot.kernels.sampling, the engine's default there) for a
[batch, vocab] float32 logits matrix under common settings, median of ``--iters`` calls after
warm-up, synchronising the device around each call (the sampler ends with a device->host copy
anyway). Every scenario runs on two logits distributions:

- ``flat``:   ``randn`` (std 1). The softmax is nearly flat: top-p 0.9 keeps about half of a
  128k vocabulary, the hardest case for the sort-free path (its boundary lies in the dense middle).
- ``peaked``: ``4 * randn`` (std 4): a few tokens hold most of the mass, like a language model's
  next-token distribution.
- ``llama``:  ``1.3 * randn``: the logits of the random-weight Llama-3.1-8B of the engine benchmarks
  (``--dists flat,peaked,llama`` adds it).

``--variants "collect_block=1024;stats_block=128"`` times each scenario again (checked too) under each
``;``-separated set of ``kvpilot.kernels.sampling.CONFIG`` overrides (A/B of kernel parameters), e.g.
``"pivot_rounds=0"`` (top-p rows through the window path, as before the pivot path existed),
``"pivot_fuse=1"``, ``"pivot_levels=4"``, ``"pivot_block=512"``.

Scenarios whose rows take the pivot path (top-p and/or min-p without top-k: ``top_p``,
``top_p_low`` (top_p 0.3), ``top_p_min_p``, ``min_p``, ``mixed``, ``logprobs``) also print how many
of those rows the kernels settle with candidate generations 0, 1, 2, ... (``pivot gens``: the
Triton draw run again with ``pivot_rounds`` = 1, 2, ...; ``exact`` = rows left to the exact path).

Before timing, each scenario is checked: the fast path must choose exactly the tokens of
``Sampler("exact")`` (stable full sort, the reference semantics) for the same inputs at three
output positions; on CUDA the PyTorch candidate path (``Sampler("torch")``) is checked too. The
``exact rows`` column counts rows per call that the fast path handed to the exact path (window
over capacity; expected 0). The penalties scenario also checks the processed logits against a
direct per-row formula (HF repetition penalty over prompt + output, OpenAI frequency/presence over
the output, logit bias), and on CUDA the Triton penalty kernel against the PyTorch path (bit for
bit). Its timed calls each append one token to every row's output, as decoding does (the counts
are then updated incrementally). The script exits with status 1 on any mismatch.

On CUDA two more columns show the host side: ``host ms`` is how long ``Sampler.launch`` (every
device operation queued, nothing read back) keeps the host busy while the GPU is still working on
~50 ms of earlier work, i.e. the sampler's host overhead; ``syncs`` counts synchronising CUDA calls
per call (``torch.cuda.set_sync_debug_mode``; expected 1: the final read). ``launch waited`` flags a
launch that did not return before that earlier work ended (a hidden synchronisation, e.g. an
upload from pageable memory).

Run (GPU):  python3 benchmarks/lab/sampler_bench.py                  (batch 256, vocab 128256)
Run (CPU):  .venv/bin/python benchmarks/lab/sampler_bench.py --device cpu --batch 16 --vocab 32000
Host overhead on a CPU (kernels nearly free at a tiny vocabulary):
            .venv/bin/python benchmarks/lab/sampler_bench.py --device cpu --batch 256 --vocab 256
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch


def _import_kvpilot():
    """kvpilot.sampling.sampler, also from a bare checkout (engine/ -> kvpilot, kernels/ -> kvpilot.kernels)."""
    try:
        import kvpilot.sampling.sampler as sampler  # noqa: F401
    except ImportError:
        root = Path(__file__).resolve().parents[2]
        for name, path in (("kvpilot", root / "engine"), ("kvpilot.kernels", root / "kernels")):
            spec = importlib.util.spec_from_file_location(name, path / "__init__.py",
                                                          submodule_search_locations=[str(path)])
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
    import kvpilot.sampling.sampler as sampler

    return sampler


sampler_mod = _import_kvpilot()
Sampler, SamplingRow = sampler_mod.Sampler, sampler_mod.SamplingRow

STEP_MS = 10.83  # batch-256 decode step of Llama-3.1-8B on one H200 (docs/gpu_benchmarks.md)
KINDS = "greedy,temperature,top_k,top_p,top_k_top_p_min_p,mixed,penalties,logprobs"
EXTRA_KINDS = "top_p_low,top_p_min_p,min_p"  # not run by default


def _rows(batch: int, kind: str, vocab: int) -> list[SamplingRow]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(batch):
        r = SamplingRow(seed=i, step=100)
        if kind == "greedy":
            r.temperature = 0.0
        elif kind == "temperature":
            r.temperature = 0.8
        elif kind == "top_k":
            r.temperature, r.top_k = 0.8, 50
        elif kind == "top_p":
            r.temperature, r.top_p = 0.8, 0.9
        elif kind == "top_k_top_p_min_p":
            r.temperature, r.top_k, r.top_p, r.min_p = 0.8, 100, 0.9, 0.05
        elif kind == "top_p_low":
            r.temperature, r.top_p = 0.8, 0.3
        elif kind == "top_p_min_p":
            r.temperature, r.top_p, r.min_p = 0.8, 0.9, 0.05
        elif kind == "min_p":
            r.temperature, r.min_p = 0.8, 0.05
        elif kind == "mixed":  # a realistic mix of requests in one batch
            r.temperature = [0.0, 0.7, 1.0, 0.8][i % 4]
            r.top_p = [1.0, 0.9, 0.95, 1.0][i % 4]
            r.top_k = [0, 0, 40, 0][i % 4]
        elif kind == "penalties":
            r.temperature, r.top_p = 0.8, 0.9
            r.repetition_penalty, r.frequency_penalty, r.presence_penalty = 1.1, 0.5, 0.5
            r.prompt_token_ids = torch.randint(0, vocab, (1024,), generator=g).tolist()
            r.output_token_ids = torch.randint(0, vocab, (512,), generator=g).tolist()
            r.logit_bias = {int(t): 1.0 for t in torch.randint(0, vocab, (10,), generator=g)}
        elif kind == "logprobs":
            r.temperature, r.top_p, r.logprobs = 0.8, 0.9, 5
        else:
            raise SystemExit(f"unknown scenario {kind!r}; choose from {KINDS},{EXTRA_KINDS}")
        out.append(r)
    return out


def _time(fn, device: torch.device, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _host_launch(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], iters: int,
                 before=None) -> tuple[float, bool]:
    """(median ms that ``sampler.launch`` keeps the host busy while the GPU still runs ~50 ms of
    earlier work, whether any launch returned only after that work had ended). CUDA only."""
    times, waited = [], False
    for _ in range(iters):
        if before is not None:
            before()
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time at 2 GHz, queued ahead of the sampler
        busy = torch.cuda.Event()
        busy.record()
        t0 = time.perf_counter()
        pending = sampler.launch(logits, rows)
        times.append(time.perf_counter() - t0)
        waited |= busy.query()
        pending.finish()
    return statistics.median(times) * 1e3, waited


def _syncs_per_call(fn) -> int:
    """Synchronising CUDA calls made by one ``fn()`` (PyTorch's sync debug mode warnings)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def _check(logits: torch.Tensor, rows: list[SamplingRow], fast: Sampler, refs: list[Sampler]) -> tuple[int, float]:
    """Rows whose token differs between ``fast`` and each reference, over three output positions;
    also the mean number of rows per call that ``fast`` handed to the exact path."""
    bad, handed = 0, []
    for step in (100, 101, 7):
        for r in rows:
            r.step = step
        before = fast.exact_rows
        got = fast(logits, rows)
        handed.append(fast.exact_rows - before)
        for ref in refs:
            bad += sum(a != b for a, b in zip(got.token_ids, ref(logits, rows).token_ids))
    for r in rows:
        r.step = 100
    return bad, statistics.mean(handed)


def _penalties_reference(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The logit bias and penalties by their definitions, row by row (slow, obviously right)."""
    out = logits.clone()
    V = logits.shape[1]
    for i, r in enumerate(rows):
        x = out[i]
        for t, b in (r.logit_bias or {}).items():
            x[t] += b
        seen = torch.tensor(sorted(set(r.prompt_token_ids or []) | set(r.output_token_ids)), dtype=torch.int64,
                            device=x.device)
        v = x[seen]
        x[seen] = torch.where(v > 0, v / r.repetition_penalty, v * r.repetition_penalty)
        counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.int64, device=x.device),
                                minlength=V).float()
        x -= r.frequency_penalty * counts + r.presence_penalty * (counts > 0).float()
    return out


def _check_penalties(logits: torch.Tensor, rows: list[SamplingRow], triton: bool) -> int:
    """Rows whose processed logits differ from `_penalties_reference` (beyond float32 rounding), plus
    with ``triton`` rows where the Triton penalty kernel and the PyTorch path differ at all."""
    apply = sampler_mod.apply_penalties_and_masks
    ref = _penalties_reference(logits, rows)
    got = apply(logits.clone(), rows)
    bad = int((~torch.isclose(got, ref, rtol=1e-5, atol=1e-5)).any(dim=1).sum())
    if triton:
        tri = apply(logits.clone(), rows, use_triton=True)
        bad += int((tri != got).any(dim=1).sum())
    return bad


_STEPS = itertools.count(1)
_PROFILE_CALLS = 5


def _kernel_summary(prof) -> str:
    """One line: GPU microseconds per sampler call of each Triton kernel (launches per call) and
    their total, averaged over the ``_PROFILE_CALLS`` profiled calls."""
    parts, total = [], 0.0
    for evt in prof.key_averages():
        name = evt.key
        if not name.startswith("_") or "_kernel" not in name:
            continue
        us = getattr(evt, "device_time_total", None)
        us = evt.cuda_time_total if us is None else us
        us /= _PROFILE_CALLS
        total += us
        parts.append((us, f"{name} {us:.0f} ({evt.count / _PROFILE_CALLS:.0f}x)"))
    parts.sort(reverse=True)
    return "  kernels us/call: " + ", ".join(p for _, p in parts) + f"; total {total:.0f}"


def _pivot_generations(logits: torch.Tensor, rows: list[SamplingRow]) -> str:
    """'' when no row takes the pivot path, else how many of its rows the Triton draw settles with
    each number of candidate generations (draw run again with pivot_rounds = 1, 2, ...), and how
    many it leaves to the exact path at the configured cap."""
    from kvpilot.kernels import sampling as ksampling

    d = sampler_mod._Draw(rows, logits.shape[1])
    if not d.n_pivot or ksampling.CONFIG["pivot_rounds"] <= 0:
        return ""
    fprm, iprm, order = d.tensors(logits.device)
    n = len(d.plain) + len(d.greedy)
    piv = d.order[len(d.order) - d.n_pivot:]
    saved, cap = dict(ksampling.CONFIG), ksampling.CONFIG["pivot_rounds"]
    counts, prev = [], 0
    try:
        for g in range(1, cap + 1):
            ksampling.CONFIG["pivot_rounds"] = g
            out = ksampling.draw(logits, fprm, iprm, order[:n], order[n:], n_pivot=d.n_pivot).cpu()
            settled = int((out[torch.from_numpy(piv)] >= 0).sum())
            counts.append(settled - prev)
            prev = settled
    finally:
        ksampling.CONFIG.clear()
        ksampling.CONFIG.update(saved)
    return (f"  pivot gens ({d.n_pivot} rows): " + ", ".join(f"{g}: {c}" for g, c in enumerate(counts))
            + f", exact: {d.n_pivot - prev}")


def _decode_one(rows: list[SamplingRow], vocab: int) -> None:
    """Append one token to every row's output (as one decoding step does)."""
    n = next(_STEPS)
    for i, r in enumerate(rows):
        r.output_token_ids.append((n * 7919 + i * 104729) % vocab)


def _number(text: str):
    """A --variants value: int when it reads as one, else float."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--kinds", default=KINDS)
    ap.add_argument("--dists", default="flat,peaked")
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table per scenario")
    ap.add_argument("--variants", default="", help="';'-separated CONFIG overrides of the Triton sampler "
                    "to time too, e.g. 'collect_block=1024;collect_block=256,stats_block=128'")
    ap.add_argument("--backend", default=None, help="Sampler backend to time (default: triton on CUDA, "
                    "the engine's default there; auto on CPU)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    base = torch.randn(args.batch, args.vocab, device=dev, generator=gen)
    dists = {"flat": base, "peaked": base * 4, "llama": base * 1.3}
    from kvpilot.kernels import sampling as ksampling

    default_cfg = dict(ksampling.CONFIG)
    variants = [("", {})] + [(v, {kv.split("=")[0]: _number(kv.split("=")[1]) for kv in v.split(",")})
                             for v in args.variants.split(";") if v]
    fast = Sampler(args.backend or ("triton" if cuda else "auto"))
    refs = [Sampler("exact")] + ([Sampler("torch")] if cuda else [])
    has_launch = hasattr(fast, "launch")
    print(f"device={dev} ({torch.cuda.get_device_name(dev) if cuda else 'cpu'}) batch={args.batch} "
          f"vocab={args.vocab} backend={fast.backend} torch={torch.__version__}")
    print("flat = randn (std 1); peaked = 4 * randn (std 4); float32 logits; "
          f"% step = share of a {STEP_MS} ms batch-256 decode step")
    extra = f" {'host ms':>8s} {'syncs':>5s}" if cuda and has_launch else ""
    print(f"{'scenario':20s} {'logits':7s} {'ms':>8s} {'us/row':>7s} {'% step':>7s}{extra} {'exact rows':>10s}  check")
    mismatches = 0
    for kind in args.kinds.split(","):
        rows = _rows(args.batch, kind, args.vocab)
        for dist, (vname, override) in itertools.product(args.dists.split(","), variants):
            ksampling.CONFIG.clear()
            ksampling.CONFIG.update(default_cfg, **override)
            logits = dists[dist]
            bad, handed = _check(logits, rows, fast, refs)
            if kind == "penalties":
                bad += _check_penalties(logits, rows, fast.backend == "triton" or cuda)
            mismatches += bad
            before = (lambda: _decode_one(rows, args.vocab)) if kind == "penalties" else None

            def call():
                if before is not None:
                    before()
                fast(logits, rows)

            ms = _time(call, dev, args.iters)
            label = f"{kind} [{vname}]" if vname else kind
            line = f"{label:20s} {dist:7s} {ms:8.3f} {ms / args.batch * 1e3:7.2f} {ms / STEP_MS * 100:6.1f}%"
            note = ""
            if cuda and has_launch:
                host, waited = _host_launch(fast, logits, rows, max(3, args.iters // 4), before)
                syncs = _syncs_per_call(lambda: fast(logits, rows))
                line += f" {host:8.3f} {syncs:5d}"
                note = " (launch waited for the GPU)" if waited else ""
            print(f"{line} {handed:10.1f}  {'ok' if not bad else f'MISMATCH ({bad} rows)'}{note}", flush=True)
            if kind != "penalties" and (fast.backend == "triton" or cuda):
                gens = _pivot_generations(logits, rows)
                if gens:
                    print(gens, flush=True)
            if args.profile:
                acts = [torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if cuda else [])
                with torch.profiler.profile(activities=acts) as prof:
                    for _ in range(_PROFILE_CALLS):
                        fast(logits, rows)
                key = "cuda_time_total" if cuda else "cpu_time_total"
                print(prof.key_averages().table(sort_by=key, row_limit=15))
                if cuda:
                    print(_kernel_summary(prof))
    ksampling.CONFIG.clear()
    ksampling.CONFIG.update(default_cfg)
    rows = _rows(args.batch, "mixed", args.vocab)
    ms = _time(lambda: sampler_mod._Draw(rows, args.vocab).tensors(dev), dev, args.iters)
    print(f"{'host_params_mixed':20s} {'':7s} {ms:8.3f} (reference: gathering the rows' parameters on the host)")
    if cuda:
        hidden = torch.randn(args.batch, 4096, device=dev, dtype=torch.bfloat16)
        head = torch.randn(args.vocab, 4096, device=dev, dtype=torch.bfloat16)
        ms = _time(lambda: (hidden @ head.T).float(), dev, args.iters)
        print(f"{'lm_head_8b_bf16':20s} {'':7s} {ms:8.3f} (reference: LM-head matmul + float cast)")
    if mismatches:
        print(f"FAILED: {mismatches} rows differ from the reference")
        sys.exit(1)


if __name__ == "__main__":
    main()
