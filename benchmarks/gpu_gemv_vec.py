"""Batch-1 GEMV launch configurations with vector-summed weight tiles (``vec``), alone and in layers.

Usage (one H200 after `pip install -e .`; about 2 minutes):

    python3 benchmarks/gpu_gemv_vec.py [--layers 32] [--context 512] [--json PATH]

The fma path's register accumulator holds one fp32 partial sum per weight element of a tile
(``[BLOCK_N, BLOCK_K]``: twice the registers of the tile itself), which caps a 4-warp program at 4
per SM and so the weight bytes in flight. ``vec=8`` loads each tile as ``[BLOCK_N, BLOCK_K / 8, 8]``
and sums a thread's 16-byte vector of products at once (a ``[BLOCK_N, BLOCK_K / 8]`` accumulator),
which frees registers for more programs per SM. (An earlier attempt, ``ksub``, reshaped 2-D tiles
instead; Triton then moved data between threads and it ran 1.6-2.8x slower: BENCHMARKS.md, eighth session.)

1. Each of the four batch-1 products (M = 1, Llama-3.1-8B shapes, bf16) alone: the current table's
   configuration, cuBLAS (``torch.matmul``), and the candidates below, as us per call in CUDA
   graphs over rotating weight copies (``gpu_gemv.Op``), each checked against the reference.
2. The best candidate per op (when it beats the current one by more than 1%) and the current table,
   inside ``--layers`` whole decoder layers (fused GEMVs, PDL, one CUDA graph), alternated three
   times (``gpu_gemv_layer_sweep``'s measurement).
Exits 1 on a mismatch.
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
import gpu_gemv as GB  # noqa: E402
from kernels_gpu import copy_bandwidth_gbs  # noqa: E402

from kvpilot.kernels import gemv as G  # noqa: E402

C = G.launch_config
# op -> (prologue, index of its M = 1 row in CONFIGS[prologue], candidates)
OPS = {
    # The eighth session's first run tried gate_up at 8 and 16 columns x 1024 and down at 4-16 columns:
    # all slower than the 2-D table (BENCHMARKS.md). Narrower tiles won for QKV and o_proj, so these
    # are the narrow ones, not yet timed.
    "gate_up": ("rmsnorm", 0, [
        C("fma", 1, n, k, programs_per_sm=p, norm_one_load=True, vec=8)
        for n, k, p in ((4, 2048, 8), (2, 2048, 8), (4, 1024, 8), (4, 2048, 12), (2, 4096, 8))
    ]),
    "down": ("silu", 0, [
        C("fma", 1, n, k, vec=8) for n, k in ((2, 2048), (1, 4096), (2, 4096), (4, 1024), (1, 2048))
    ]),
    "qkv": ("rmsnorm", 1, [
        C("fma", 1, n, k, programs_per_sm=p, norm_one_load=True, vec=8)
        for n, k, p in ((4, 2048, 12), (2, 2048, 8), (2, 2048, 12), (2, 4096, 8), (4, 4096, 8), (4, 1024, 12))
    ] + [C("fma", 1, 4, 2048, programs_per_sm=4, norm_one_load=True)]),  # the previous table's
    "o": ("plain", 0, [
        C("fma", 1, n, k, vec=8) for n, k in ((1, 4096), (2, 4096), (1, 2048), (2, 1024), (4, 4096), (4, 1024))
    ] + [C("fma", 1, 4, 1024)]),  # the previous table's
}
SHAPE = {"gate_up": "gate_up", "qkv": "qkv", "o": "o_proj", "down": "down"}


def label(cfg: dict) -> str:
    s = GB.cfg_str(cfg)
    for key in ("vec", "norm_one_load", "early_weight"):
        if cfg.get(key):
            s += f" {key}" + (f"={cfg[key]}" if key == "vec" else "")
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    copy_gbs = copy_bandwidth_gbs()
    gen = torch.Generator(device="cuda").manual_seed(0)
    current = {op: G.CONFIGS[pro][i][2] for op, (pro, i, _) in OPS.items()}
    best, rows, bad = dict(current), [], 0
    print(f"GPU {torch.cuda.get_device_name()}, copy {copy_gbs:.0f} GB/s")
    for op, (_, _, cands) in OPS.items():
        o = GB.Op(SHAPE[op], 1, gen)
        floor = o.bytes() / (copy_gbs * 1e9) * 1e6
        cub = o.time(o.cublas)
        print(f"\n{op}: floor {floor:.1f} us, cuBLAS {cub:.1f} us ({100 * floor / cub:.0f}%)")
        print("| configuration | us | % of floor | rel err |\n|---|---:|---:|---:|")
        ranked = []
        for cfg in [current[op]] + cands:
            try:
                err = o.check(cfg)
                us = o.time(o.fused, config=cfg)
            except Exception as e:  # noqa: BLE001 - a configuration that does not compile or launch
                print(f"| {label(cfg)} | failed: {type(e).__name__}: {str(e)[:100]} | | |")
                continue
            if not err < 2e-2:
                bad += 1
            tag = " (current)" if cfg is current[op] else ""
            print(f"| {label(cfg)}{tag} | {us:.2f} | {100 * floor / us:.1f}% | {err:.2g} |", flush=True)
            ranked.append((us, cfg))
            rows.append(dict(op=op, config=label(cfg), us=us, err=err, current=cfg is current[op]))
        cur_us = ranked[0][0] if ranked and ranked[0][1] is current[op] else float("inf")
        us, cfg = min(ranked, key=lambda r: r[0])
        if us < 0.99 * cur_us:
            best[op] = cfg
        del o
        torch.cuda.empty_cache()

    mods, caches, meta, positions, cos_sin, hidden0 = D.build_layers(a.layers, a.context)
    for m in mods:
        m.fused_gemv = True
    pristine = [c.clone() for c in caches]
    floor_us = sum(p.numel() * p.element_size() for p in mods[0].parameters()) / copy_gbs / 1e3

    def apply(table: dict) -> None:
        for op, (pro, i, _) in OPS.items():
            mm, nn, _ = G.CONFIGS[pro][i]
            G.CONFIGS[pro][i] = (mm, nn, table[op])

    def measure(table: dict) -> tuple[float, torch.Tensor]:
        apply(table)
        for c, p in zip(caches, pristine):
            c.copy_(p)
        with torch.no_grad():
            h, r = D.run_layers(mods[:1], caches[:1], meta, positions, cos_sin, hidden0)
            out = (h.float() + r.float()).clone()
            caches[0].copy_(pristine[0])
            ms = D.graph_ms(lambda: D.run_layers(mods, caches, meta, positions, cos_sin, hidden0), 1, replays=20)
        return ms / a.layers * 1e3, out

    print(f"\nlayers ({a.layers}, context {a.context}, floor {floor_us:.1f} us): best table "
          + str({op: label(c) for op, c in best.items()}))
    res = {"current": [], "best": []}
    outs = {}
    for _ in range(3):
        for name, table in (("current", current), ("best", best)):
            us, outs[name] = measure(table)
            res[name].append(us)
    err = D.rel_err(outs["best"], outs["current"])
    if not err < 0.05:
        bad += 1
    print("| table | us per layer (3 runs) | median | % of floor |\n|---|---|---:|---:|")
    for name in res:
        med = statistics.median(res[name])
        print(f"| {name} | {', '.join(f'{x:.2f}' for x in res[name])} | {med:.2f} | {100 * floor_us / med:.1f}% |")
    print(f"err best vs current after one layer: {err:.2g}; mismatches: {bad}")
    apply(current)
    if a.json:
        Path(a.json).write_text(json.dumps(dict(copy_gbs=copy_gbs, rows=rows, layers=res,
                                                best={op: label(c) for op, c in best.items()}), indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
