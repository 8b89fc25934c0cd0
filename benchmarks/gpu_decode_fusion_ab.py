"""Batch-1 decode layers with and without the eighth session's fusions, timed inside one CUDA graph.

Usage (one H200 after `pip install -e .`; about 2 minutes):

    python3 benchmarks/gpu_decode_fusion_ab.py [--layers 32] [--contexts 128 512 2048]
        [--bound 4096] [--kv-dtype fp8|bf16] [--rounds 3] [--json PATH]

Variants (the rest of the layer as the engine runs it at batch 1: fused GEMVs, PDL):

- ``base``: rotary + KV write, decode attention and its split merge as three launches
  (``KVPILOT_FUSED_DECODE_ATTENTION=0``); the RMSNorm GEMVs' norm pass a loop over K tiles.
- ``attn``: the one-launch decode attention (`kvpilot.kernels.decode_attention_rotary`).
- ``gemv``: the RMSNorm GEMVs' norm pass as one load per row (both) and gate/up's first weight tile
  issued before it (``norm_one_load``, ``early_weight`` in ``kernels/gemv.py``).
- ``both``: ``attn`` + ``gemv`` (today's defaults).
- ``both_qkv_early``: ``both`` + QKV's early weight tile (3 programs per SM: more registers).
- ``both_chunk8``, ``both_chunk16``: ``both`` with the in-kernel split merge reading 8 or 16 splits
  per step (``TUNING["decode"]["fused_merge_chunk"]``, default 16; 4 measured slower). Launches of
  more than ``TUNING["decode"]["fused_merge_max_splits"]`` splits keep the merge kernel.
(Commit d88174a also had ``pre_o``, ``pre_o_down``, ``pre_all``: first weight tiles loaded before
the PDL wait; BENCHMARKS.md, eighth session.)

Microseconds per layer (32 layers in one graph, median of 20 replays), rounds alternating the
variants; each variant's output after one layer is compared with ``base``'s (max |a-b| / (1+|b|)).
Also a race check of the in-kernel split merge: 2,000 replays of one fused attention launch at
5,000 keys (64 splits) must give bit-identical outputs (the merge is deterministic whichever
program arrives last). Exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_decode_layer as D  # noqa: E402
from kernels_gpu import copy_bandwidth_gbs  # noqa: E402

import kvpilot.kernels as K  # noqa: E402
from kvpilot.kernels import attention  # noqa: E402
from kvpilot.kernels import gemv as G  # noqa: E402

MERGE_CHUNK = attention.TUNING["decode"]["fused_merge_chunk"]

RMS = G.CONFIGS["rmsnorm"]
# op -> (prologue, index of its M = 1 row in CONFIGS[prologue])
ROWS = {"gate_up": ("rmsnorm", 0), "qkv": ("rmsnorm", 1), "o": ("plain", 0), "down": ("silu", 0)}
TABLE = {op: G.CONFIGS[pro][i][2] for op, (pro, i) in ROWS.items()}
PLAIN = dict(TABLE, **{op: dict(TABLE[op], norm_one_load=False, early_weight=0) for op in ("gate_up", "qkv")})


VARIANTS = {
    "base": (False, PLAIN),
    "attn": (True, PLAIN),
    "gemv": (False, TABLE),
    "both": (True, TABLE),
    "both_qkv_early": (True, dict(TABLE, qkv=dict(TABLE["qkv"], early_weight=1, programs_per_sm=3))),
}
# Merge chunk of the in-kernel split merge (kernels/attention.py TUNING["decode"]["fused_merge_chunk"]).
CHUNKS = {"both_chunk8": 8, "both_chunk16": 16}
VARIANTS.update({name: (True, TABLE) for name in CHUNKS})


def apply(variant: str) -> None:
    fused_attn, table = VARIANTS[variant]
    attention.TUNING["decode"]["fused_merge_chunk"] = CHUNKS.get(variant, MERGE_CHUNK)
    os.environ["KVPILOT_FUSED_DECODE_ATTENTION"] = "1" if fused_attn else "0"
    for op, (pro, i) in ROWS.items():
        mm, nn, _ = G.CONFIGS[pro][i]
        G.CONFIGS[pro][i] = (mm, nn, table[op])


def race_check(kv_dtype: torch.dtype, replays: int = 2000) -> int:
    """Mismatching replays of the fused attention (in-kernel merge of 64 splits) against the first."""
    g = torch.Generator(device="cuda").manual_seed(1)
    ctx, heads, kvh, hd, bs = 5000, D.HEADS, D.KV_HEADS, D.HEAD_DIM, D.BLOCK
    blocks = -(-ctx // bs)
    kv = torch.randn(2, blocks + 4, bs, kvh, hd, device="cuda", generator=g).to(kv_dtype)
    table = torch.randperm(blocks + 4, device="cuda", generator=g)[:blocks].int()[None]
    pos = ctx - 1
    slot = torch.tensor([int(table[0, pos // bs]) * bs + pos % bs], device="cuda")
    qkv = torch.randn(1, (heads + 2 * kvh) * hd, device="cuda", generator=g, dtype=torch.bfloat16)
    q, k, v = qkv.split([heads * hd, kvh * hd, kvh * hd], dim=-1)
    q, k, v = q.view(1, heads, hd), k.view(1, kvh, hd), v.view(1, kvh, hd)
    cos_sin = K.build_rope_cache(hd, 8192, 500000.0, D.LLAMA3_SCALING, device="cuda")
    args = (q, k, v, torch.tensor([pos], device="cuda"), cos_sin, kv[0], kv[1], slot, table,
            torch.tensor([ctx], dtype=torch.int32, device="cuda"), torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
            hd ** -0.5, 8192)
    out = K.decode_attention_rotary(*args)  # warm-up (compile, counters)
    ref = K.decode_attention_rotary_ref(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    err = D.rel_err(out.cpu(), ref)
    print(f"race check: fused vs reference max err {err:.3g}")
    static = torch.empty_like(out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static.copy_(K.decode_attention_rotary(*args))
    first, bad = None, 0
    for _ in range(replays):
        graph.replay()
        if first is None:
            torch.cuda.synchronize()
            first = static.clone()
        elif not torch.equal(static, first):
            bad += 1
    torch.cuda.synchronize()
    print(f"race check: {bad} of {replays - 1} replays differ from the first")
    return bad + (0 if err < 0.05 else 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--bound", type=int, default=4096, help="max_seq_len passed (a graph bucket's bound)")
    ap.add_argument("--kv-dtype", default="fp8", choices=["fp8", "bf16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    kv_dtype = torch.float8_e4m3fn if a.kv_dtype == "fp8" else torch.bfloat16
    copy_gbs = copy_bandwidth_gbs()
    failures = race_check(kv_dtype)
    results = {}
    for ctx in a.contexts:
        mods, caches, meta, positions, cos_sin, hidden0 = D.build_layers(a.layers, ctx)
        caches = [c.to(kv_dtype) for c in caches]
        meta = dataclasses.replace(meta, max_seq_len=max(a.bound, ctx))
        for m in mods:
            m.fused_gemv = True
        pristine = [c.clone() for c in caches]
        floor_us = sum(p.numel() * p.element_size() for p in mods[0].parameters()) / copy_gbs / 1e3
        outs, times = {}, {v: [] for v in a.variants}
        with torch.no_grad():
            for r in range(a.rounds):
                for v in a.variants:
                    apply(v)
                    for c, p in zip(caches, pristine):
                        c.copy_(p)
                    if r == 0:
                        h, res = D.run_layers(mods[:1], caches[:1], meta, positions, cos_sin, hidden0)
                        outs[v] = (h.float() + res.float()).clone()
                        caches[0].copy_(pristine[0])
                    run = lambda: D.run_layers(mods, caches, meta, positions, cos_sin, hidden0)  # noqa: E731
                    times[v].append(D.graph_ms(run, 1, replays=20) / a.layers * 1e3)
        apply("both")
        print(f"\ncontext {ctx} (bound {meta.max_seq_len}), {a.kv_dtype} KV, {a.layers} layers; floor "
              f"{floor_us:.1f} us per layer (copy {copy_gbs:.0f} GB/s)")
        print("| variant | us per layer (rounds) | median | vs base | % of floor | err vs base |")
        print("|---|---|---:|---:|---:|---:|")
        base = statistics.median(times["base"]) if "base" in times else None
        for v in a.variants:
            med = statistics.median(times[v])
            err = D.rel_err(outs[v], outs["base"]) if "base" in outs else 0.0
            if not err < 0.05:
                failures += 1
            rel = f"{100 * (med / base - 1):+.1f}%" if base else ""
            print(f"| {v} | {', '.join(f'{t:.2f}' for t in times[v])} | {med:.2f} | {rel} | "
                  f"{100 * floor_us / med:.1f}% | {err:.2g} |", flush=True)
        results[ctx] = dict(floor_us=floor_us, times=times)
        del mods, caches, pristine
        torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps(dict(copy_gbs=copy_gbs, results=results), indent=1))
    print("FAILURES:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
