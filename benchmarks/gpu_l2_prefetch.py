"""Batch-1 decoder layers with and without the L2 prefetch of the next weight (``L2_PREFETCH_BYTES``).

Usage (one H200 after `pip install -e .`; about 1 minute):

    python3 benchmarks/gpu_l2_prefetch.py [--layers 32] [--contexts 512 4096] [--rounds 3] [--json PATH]

Builds ``--layers`` Llama-3.1-8B-shaped decoder layers with random bf16 weights (`gpu_decode_layer`),
fused GEMVs, PDL, one CUDA graph per variant, and times each variant as microseconds per layer,
alternating the variants ``--rounds`` times. A variant is a ``L2_PREFETCH_BYTES`` table (bytes
prefetched of o_proj / gate_up / down / the next layer's QKV); "off" is ``l2_prefetch = False``.
The floor is the layer's weight bytes over the device copy rate measured here. Every variant's
output after all the layers must equal "off"'s bit for bit (the prefetch is a hint); exits 1 if not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_decode_layer as D  # noqa: E402
from kernels_gpu import copy_bandwidth_gbs  # noqa: E402

from kvpilot import llama  # noqa: E402
from kvpilot.kernels import gemv as G  # noqa: E402

MB = 1 << 20
# name -> ((o_proj, gate_up, down, qkv) budgets in bytes, or None for "off"; kernels.gemv's
# L2_PREFETCH_MODE (1 bulk, 3 per line); L2_PREFETCH_UNIT (bytes, bulk only))
VARIANTS: dict[str, tuple] = {
    "off": (None, 1, 128),
    "o_proj only, bulk 128 B": ((64 * MB, 0, 0, 0), 1, 128),
    "o_proj only, bulk 8 KB": ((64 * MB, 0, 0, 0), 1, 8192),
    "o_proj only, lines": ((64 * MB, 0, 0, 0), 3, 128),
    "16 MB of o_proj, lines": ((16 * MB, 0, 0, 0), 3, 128),
    "tails 8 MB, bulk 8 KB": ((0, 8 * MB, 8 * MB, 8 * MB), 1, 8192),
    "tails 8 MB, lines": ((0, 8 * MB, 8 * MB, 8 * MB), 3, 128),
    "o_proj + tails 4 MB, lines": ((64 * MB, 4 * MB, 4 * MB, 4 * MB), 3, 128),
}


def set_variant(name: str, mods) -> None:
    budgets, mode, unit = VARIANTS[name]
    for m in mods:
        m.l2_prefetch = budgets is not None
    if budgets is not None:
        llama.L2_PREFETCH_BYTES.update(zip(("o_proj", "gate_up", "down", "qkv"), budgets))
    G.L2_PREFETCH_MODE, G.L2_PREFETCH_UNIT = mode, unit


def pair_section(copy_gbs: float, copies: int = 4, reps: int = 16) -> None:
    """QKV (RMSNorm GEMV) then o_proj, with a sleep kernel standing in for attention between them,
    over ``copies`` rotating weight copies (cold in L2): us per pair, by prefetch mechanism."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    dt = torch.bfloat16
    wq = [torch.randn(6144, 4096, device="cuda", dtype=dt, generator=gen) * 0.02 for _ in range(copies)]
    wo = [torch.randn(4096, 4096, device="cuda", dtype=dt, generator=gen) * 0.02 for _ in range(copies)]
    x = torch.randn(1, 4096, device="cuda", dtype=dt, generator=gen)
    res = torch.randn(1, 4096, device="cuda", dtype=dt, generator=gen)
    nw = torch.ones(4096, device="cuda", dtype=dt)
    a = torch.randn(1, 4096, device="cuda", dtype=dt, generator=gen)
    floor = (wq[0].numel() + wo[0].numel()) * 2 / copy_gbs / 1e3
    print(f"\nQKV + o_proj pairs (floor {floor:.1f} us for both), us per pair")
    print("| variant | sleep 0 | sleep ~4 us | QKV alone |\n|---|---:|---:|---:|")
    for name, mode, unit in (("off", 0, 128), ("bulk 128 B", 1, 128), ("bulk 8 KB", 1, 8192),
                             ("lines", 3, 128)):
        G.L2_PREFETCH_MODE, G.L2_PREFETCH_UNIT = max(mode, 1), unit
        plans = [G.l2_prefetch_plan(w, 64 * MB, "plain") if mode else None for w in wo]
        row = []
        for sleep, with_o in ((0, True), (8000, True), (0, False)):
            def fn():
                for i in range(reps):
                    j = i % copies
                    G.rmsnorm_gemv(x, res, nw, 1e-5, wq[j], l2_prefetch=plans[j])
                    if sleep:
                        torch.cuda._sleep(sleep)
                    if with_o:
                        G.gemv(a, wo[j])
            row.append(D.graph_ms(fn, 1, replays=20) * 1e3 / reps)
        print(f"| {name} | {row[0]:.2f} | {row[1]:.2f} | {row[2]:.2f} |")
    G.L2_PREFETCH_MODE, G.L2_PREFETCH_UNIT = 1, 128


def run(mods, caches, meta, positions, cos_sin, hidden0):
    hidden, residual = hidden0, None
    for i, (layer, kv) in enumerate(zip(mods, caches)):
        nxt = mods[i + 1].self_attn.qkv_proj.weight if i + 1 < len(mods) else None
        hidden, residual = layer(positions, hidden, residual, meta, kv, cos_sin, nxt)
    return hidden, residual


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-pairs", action="store_true", help="skip the QKV + o_proj pair timing")
    a = ap.parse_args(argv)
    copy_gbs = copy_bandwidth_gbs()
    props = torch.cuda.get_device_properties(0)
    print(f"GPU {props.name}, L2 {props.L2_cache_size / MB:.0f} MiB, copy {copy_gbs:.0f} GB/s")
    saved = dict(llama.L2_PREFETCH_BYTES)
    if not a.no_pairs:
        pair_section(copy_gbs)
    results, bad = {}, 0
    for ctx in a.contexts:
        mods, caches, meta, positions, cos_sin, hidden0 = D.build_layers(a.layers, ctx)
        for m in mods:
            m.fused_gemv = True
        pristine = [c.clone() for c in caches]
        floor_us = sum(p.numel() * p.element_size() for p in mods[0].parameters()) / copy_gbs / 1e3

        def measure(name: str) -> tuple[float, torch.Tensor]:
            set_variant(name, mods)
            for c, p in zip(caches, pristine):
                c.copy_(p)
            with torch.no_grad():
                h, r = run(mods, caches, meta, positions, cos_sin, hidden0)
                out = torch.cat([h, r], dim=-1).clone()
                for c, p in zip(caches, pristine):
                    c.copy_(p)
                ms = D.graph_ms(lambda: run(mods, caches, meta, positions, cos_sin, hidden0), 1, replays=20)
            return ms / a.layers * 1e3, out

        times = {n: [] for n in a.variants}
        outs = {}
        for _ in range(a.rounds):
            for n in a.variants:
                us, outs[n] = measure(n)
                times[n].append(us)
        print(f"\ncontext {ctx}, {a.layers} layers, floor {floor_us:.1f} us per layer")
        print("| variant | us per layer | median | % of floor | output equal to off |\n|---|---|---:|---:|---|")
        for n in a.variants:
            med = statistics.median(times[n])
            same = torch.equal(outs[n], outs[a.variants[0]])
            bad += not same
            print(f"| {n} | {', '.join(f'{t:.2f}' for t in times[n])} | {med:.2f} | {100 * floor_us / med:.1f}% "
                  f"| {same} |")
        results[ctx] = dict(floor_us=floor_us, times=times)
        del mods, caches, pristine
        torch.cuda.empty_cache()
    llama.L2_PREFETCH_BYTES.clear()
    llama.L2_PREFETCH_BYTES.update(saved)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(copy_gbs=copy_gbs, results=results), indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
