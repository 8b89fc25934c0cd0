"""Batch-1 decoder layers with the fused rotary + KV write + decode attention kernel against the three
unfused launches, and launch variants of the fused kernel (GPU).

Usage (one H200, after `pip install -e .`; about 2 minutes):

    python3 benchmarks/lab/gpu_fused_decode_attn.py [--layers 32] [--contexts 512 4096] [--rounds 3] [--bf16-kv]

Each context builds ``--layers`` Llama-3.1-8B-shaped decoder layers (`gpu_decode_layer.build_layers`:
random bf16 weights, fused GEMVs, one shuffled KV pool per layer, FP8 unless ``--bf16-kv``) and
launches attention for the context bound the engine's decode graph of that context would use (the
smallest of 2,048, 8,192, 32,768 keys that holds it). ``VARIANTS`` are timed as microseconds per
layer in one CUDA graph of all layers, alternated ``--rounds`` times:

- ``unfused``: ``fused_rotary_max_seqs`` 0 (rotary + KV write, split decode, split merge);
- ``fused``: today's launch (``kernels.attention.TUNING["decode"]``: 4 warps per program up to a
  bound of ``fused_long_keys``, 2 above);
- ``fused w4`` / ``fused w2``: 4 or 2 warps at every bound;
- ``fused max32 merge128``: at most 32 context splits, 128 (head, split) rows of partials merged per
  round trip instead of 64;
- ``fused w1`` / ``fused w1 short``: one warp per program at every bound / up to ``fused_long_keys``
  (one warp made the full-batch TMA kernel 13-35% faster: no barrier per key tile).
(Earlier runs also timed 8 warps, at least 128 keys per split, at most 16
splits, and the metadata loads after the PDL wait: BENCHMARKS.md.)

Each variant's output after one layer must be within 2e-2 of ``unfused``'s and its last layer's
KV cache must equal ``unfused``'s bit for bit (same new key and value written); exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_decode_layer as D  # noqa: E402
from kernels_gpu import copy_bandwidth_gbs  # noqa: E402

from kvpilot.kernels import attention as A  # noqa: E402

VARIANTS = {  # name -> TUNING["decode"] overrides (fused_rotary_max_seqs 0: every batch unfused)
    "unfused": {"fused_rotary_max_seqs": 0},
    "fused": {},
    "fused w4": {"fused_num_warps_long": 4},
    "fused w2": {"fused_num_warps": 2},
    "fused max32 merge128": {"fused_max_splits": 32, "fused_merge_rows": 128},
    "fused w1": {"fused_num_warps": 1, "fused_num_warps_long": 1},
    "fused w1 short": {"fused_num_warps": 1},
}
BUCKETS = (2048, 8192, 32768)


class Variant:
    def __init__(self, name: str) -> None:
        self.tuning = VARIANTS[name]

    def __enter__(self):
        self.saved = {k: A.TUNING["decode"][k] for k in self.tuning}
        A.TUNING["decode"].update(self.tuning)
        return self

    def __exit__(self, *exc):
        A.TUNING["decode"].update(self.saved)
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bf16-kv", action="store_true", help="bf16 KV caches instead of FP8")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                    help="variants to time (unfused always runs: the others are checked against it)")
    a = ap.parse_args()
    copy_gbs = copy_bandwidth_gbs()
    print(f"GPU {torch.cuda.get_device_name()}, copy {copy_gbs:.0f} GB/s, {'bf16' if a.bf16_kv else 'FP8'} KV")
    bad = 0
    for ctx in a.contexts:
        mods, caches, meta, positions, cos_sin, hidden0 = D.build_layers(a.layers, ctx)
        if not a.bf16_kv:
            caches = [c.to(torch.float8_e4m3fn) for c in caches]
        meta.max_seq_len = next(b for b in BUCKETS if b >= ctx)
        for m in mods:
            m.fused_gemv = True
        pristine = [c.clone() for c in caches]
        floor_us = sum(p.numel() * p.element_size() for p in mods[0].parameters()) / copy_gbs / 1e3

        def measure(name: str):
            with torch.no_grad(), Variant(name):
                for c, p in zip(caches, pristine):
                    c.copy_(p)
                h, r = D.run_layers(mods[:1], caches[:1], meta, positions, cos_sin, hidden0)
                out = (torch.cat([h, r], dim=-1).float(), caches[0].clone())
                for c, p in zip(caches, pristine):
                    c.copy_(p)
                ms = D.graph_ms(lambda: D.run_layers(mods, caches, meta, positions, cos_sin, hidden0), 1, replays=20)
            return ms / a.layers * 1e3, out

        names = ["unfused"] + [n for n in a.variants if n != "unfused"]
        times = {n: [] for n in names}
        outs = {}
        for _ in range(a.rounds):
            for n in names:
                us, outs[n] = measure(n)
                times[n].append(us)
        print(f"\ncontext {ctx} (graph bound {meta.max_seq_len}), {a.layers} layers, weight floor "
              f"{floor_us:.1f} us per layer")
        print("| variant | us per layer | median | % of floor | rel. diff to unfused, 1 layer | same cache bytes |\n"
              "|---|---|---:|---:|---:|---|")
        for n in names:
            med = statistics.median(times[n])
            err = D.rel_err(outs[n][0], outs["unfused"][0])
            same = torch.equal(outs[n][1].view(torch.uint8), outs["unfused"][1].view(torch.uint8))
            bad += not (err < 2e-2 and same)
            print(f"| {n} | {', '.join(f'{t:.2f}' for t in times[n])} | {med:.2f} | {100 * floor_us / med:.1f}% "
                  f"| {err:.2g} | {same} |")
        del mods, caches, pristine
        torch.cuda.empty_cache()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
