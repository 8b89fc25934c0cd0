"""Batch-1 decoder layers under variants of the M = 1 GEMV launch rows (``early_weight=2``, ``balance``).

Usage (one H200 after `pip install -e .`; about 1 minute):

    python3 benchmarks/gpu_early_weight.py [--layers 32] [--contexts 512 4096] [--rounds 3] [--json PATH]

A kernel launched with programmatic dependent launch (kernels/pdl.py) starts while the kernels before
it still run and waits (``griddepcontrol.wait``) before touching their outputs. Weights are never
written by a kernel, so a GEMV may load its first weight tiles before that wait: for ``o_proj`` at
batch 1 (two K tiles of a 2 x 4096 column tile, 16 KB per program) that is all of its weights, read
while the attention kernels before it run. Builds ``--layers`` Llama-3.1-8B-shaped decoder layers
with random bf16 weights (`gpu_decode_layer`), fused GEMVs, PDL, one CUDA graph per variant, and
times each variant (``VARIANTS``: which M = 1 launch rows get ``early_weight=2``) as microseconds per
layer, alternating the variants ``--rounds`` times. The floor is the layer's weight bytes over the
device copy rate measured here. Every variant's output must equal the current table's bit for bit
(the load order changes nothing computed); exits 1 if not.
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

from kvpilot.kernels import gemv as G  # noqa: E402

# op -> (prologue, row index of CONFIGS[prologue]) at M = 1 for Llama-3.1-8B's TP-1 shapes
ROWS = {"qkv": ("rmsnorm", 2), "o_proj": ("plain", 0), "gate_up": ("rmsnorm", 0), "down": ("silu", 0)}
# variant -> {op: extra launch_config keywords}
VARIANTS: dict[str, dict[str, dict]] = {
    "current": {},
    "o_proj 2 tiles early": {"o_proj": dict(early_weight=2, early_tiles=2)},
    "gate_up balanced": {"gate_up": dict(balance=True)},
    "qkv balanced": {"qkv": dict(balance=True)},
    "o_proj 8/SM balanced": {"o_proj": dict(programs_per_sm=8, balance=True)},
    "o_proj 4/SM balanced": {"o_proj": dict(programs_per_sm=4, balance=True)},
    "down 4/SM balanced": {"down": dict(programs_per_sm=4, balance=True)},
    "qkv + gate_up + o_proj 8/SM balanced": {"gate_up": dict(balance=True), "qkv": dict(balance=True),
                                              "o_proj": dict(programs_per_sm=8, balance=True)},
    "same + all early": {"gate_up": dict(balance=True, early_weight=2), "qkv": dict(balance=True, early_weight=2),
                         "o_proj": dict(programs_per_sm=8, balance=True, early_weight=2, early_tiles=2),
                         "down": dict(early_weight=2)},
}


def apply(base: dict, changes: dict) -> None:
    for op, (pro, i) in ROWS.items():
        mm, nn, _ = G.CONFIGS[pro][i]
        cfg = dict(base[op], **changes.get(op, {}))
        if cfg.get("early_tiles", 1) == 2 and not cfg.get("early_weight"):
            cfg["early_tiles"] = 1
        G.CONFIGS[pro][i] = (mm, nn, G._check_config(cfg))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    copy_gbs = copy_bandwidth_gbs()
    print(f"GPU {torch.cuda.get_device_name()}, copy {copy_gbs:.0f} GB/s")
    base = {op: dict(G.CONFIGS[pro][i][2]) for op, (pro, i) in ROWS.items()}
    print("current M = 1 rows: " + ", ".join(f"{op} {cfg}" for op, cfg in base.items()))
    results, bad = {}, 0
    for ctx in a.contexts:
        mods, caches, meta, positions, cos_sin, hidden0 = D.build_layers(a.layers, ctx)
        for m in mods:
            m.fused_gemv = True
        pristine = [c.clone() for c in caches]
        floor_us = sum(p.numel() * p.element_size() for p in mods[0].parameters()) / copy_gbs / 1e3

        def measure(name: str) -> tuple[float, torch.Tensor]:
            apply(base, VARIANTS[name])
            for c, p in zip(caches, pristine):
                c.copy_(p)
            with torch.no_grad():
                h, r = D.run_layers(mods, caches, meta, positions, cos_sin, hidden0)
                out = torch.cat([h, r], dim=-1).clone()
                for c, p in zip(caches, pristine):
                    c.copy_(p)
                ms = D.graph_ms(lambda: D.run_layers(mods, caches, meta, positions, cos_sin, hidden0), 1,
                                replays=20)
            return ms / a.layers * 1e3, out

        times = {n: [] for n in a.variants}
        outs = {}
        for _ in range(a.rounds):
            for n in a.variants:
                us, outs[n] = measure(n)
                times[n].append(us)
        apply(base, {})
        print(f"\ncontext {ctx}, {a.layers} layers, floor {floor_us:.1f} us per layer")
        print("| variant | us per layer | median | % of floor | output equal to current |\n|---|---|---:|---:|---|")
        for n in a.variants:
            med = statistics.median(times[n])
            same = torch.equal(outs[n], outs[a.variants[0]])
            bad += not same
            print(f"| {n} | {', '.join(f'{t:.2f}' for t in times[n])} | {med:.2f} | {100 * floor_us / med:.1f}% "
                  f"| {same} |")
        results[ctx] = dict(floor_us=floor_us, times=times)
        del mods, caches, pristine
        torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps(dict(copy_gbs=copy_gbs, results=results), indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
