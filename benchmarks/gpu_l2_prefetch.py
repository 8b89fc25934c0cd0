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

MB = 1 << 20
# name -> (o_proj, gate_up, down, qkv) budgets in bytes, or None for "off"
VARIANTS: dict[str, tuple[int, int, int, int] | None] = {
    "off": None,
    "o_proj only": (64 * MB, 0, 0, 0),
    "o_proj + 4 MB": (64 * MB, 4 * MB, 4 * MB, 4 * MB),
    "o_proj + 8 MB": (64 * MB, 8 * MB, 8 * MB, 8 * MB),
    "o_proj + 16 MB": (64 * MB, 16 * MB, 16 * MB, 16 * MB),
    "16 MB of o_proj + 8 MB": (16 * MB, 8 * MB, 8 * MB, 8 * MB),
    "tails 8 MB only": (0, 8 * MB, 8 * MB, 8 * MB),
}


def run(mods, caches, meta, positions, cos_sin, hidden0):
    hidden, residual = hidden0, None
    for i, (layer, kv) in enumerate(zip(mods, caches)):
        nxt = mods[i + 1].self_attn.qkv_proj.weight if i + 1 < len(mods) else None
        hidden, residual = layer(positions, hidden, residual, meta, kv, cos_sin, nxt)
    return hidden, residual


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    copy_gbs = copy_bandwidth_gbs()
    props = torch.cuda.get_device_properties(0)
    print(f"GPU {props.name}, L2 {props.L2_cache_size / MB:.0f} MiB, copy {copy_gbs:.0f} GB/s")
    saved = dict(llama.L2_PREFETCH_BYTES)
    results, bad = {}, 0
    for ctx in a.contexts:
        mods, caches, meta, positions, cos_sin, hidden0 = D.build_layers(a.layers, ctx)
        for m in mods:
            m.fused_gemv = True
        pristine = [c.clone() for c in caches]
        floor_us = sum(p.numel() * p.element_size() for p in mods[0].parameters()) / copy_gbs / 1e3

        def measure(name: str) -> tuple[float, torch.Tensor]:
            budgets = VARIANTS[name]
            for m in mods:
                m.l2_prefetch = budgets is not None
            if budgets is not None:
                llama.L2_PREFETCH_BYTES.update(zip(("o_proj", "gate_up", "down", "qkv"), budgets))
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
