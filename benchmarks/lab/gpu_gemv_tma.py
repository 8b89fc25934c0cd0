"""Batch-1 GEMV weight streaming through TMA (tensor descriptors, multi-stage shared-memory pipeline)
against the current fused GEMVs and cuBLAS, per Llama-3.1-8B shape.

Usage (one H200 after `pip install -e .`; about 1 minute):

    python3 benchmarks/lab/gpu_gemv_tma.py [--ops gate_up down qkv o_proj] [--json PATH]
    python3 benchmarks/lab/gpu_gemv_tma.py --layers 32 [--contexts 512 4096] [--kv-fp8] [--graph-bound 33024]

Question: the fused fma GEMVs read weights at 3.9-4.1 TB/s in steady state, while cuBLAS's LM head
reads at 4.5 TB/s. The fma kernel keeps each weight tile in registers (no pipelining: one tile in
flight per program). Here ``y = x @ W.T`` (M = 1, no prologue) is computed by a kernel whose weight
tiles arrive by TMA into a ``num_stages``-deep shared-memory ring (Triton's pipeliner, descriptor
loads), so the bytes in flight no longer cost registers. Variants: tile ``[BLOCK_N, BLOCK_K]``,
stages, warps, and persistent grids (one flattened (tile, K step) loop per program). Each is timed as
us per call in CUDA graphs over rotating weight copies (`gpu_gemv.Op`) and checked against
``F.linear`` (relative error < 1e-2); exits 1 on a mismatch or a failed compile of every variant.

``--layers N``: instead, N Llama-3.1-8B-shaped decoder layers (`gpu_decode_layer`, fused GEMVs, PDL,
one CUDA graph) under ``LAYER_VARIANTS`` of the M = 1 launch rows (``kernels/gemv.py``'s "tma" kind,
the fused kernel with its prologue, against the previous fma rows), alternated ``--rounds`` times,
as us per layer against the weight floor; each variant's output after one layer must stay within
2e-2 of the first's (the difference after all layers is printed: with random weights, summation-order
differences grow over the layers).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_gemv as GB  # noqa: E402
from kernels_gpu import copy_bandwidth_gbs  # noqa: E402


@triton.jit
def _tma_gemv(x_ptr, w_desc, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    # One column tile per program, K in BLOCK_K steps through a STAGES-deep TMA ring.
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = w_desc.load([pid * BLOCK_N, k0])
        a = tl.load(x_ptr + k0 + offs_k)
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
    out = tl.sum(acc, axis=1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + offs_n, out.to(y_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _tma_gemv_persistent(x_ptr, w_desc, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         STAGES: tl.constexpr):
    # Column tiles pid, pid + grid, ...; one flattened loop over (tile, K step), so the TMA ring stays
    # full across tile boundaries.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_tiles = tl.cdiv(N, BLOCK_N)
    my_tiles = tl.cdiv(num_tiles - pid, nprog)
    k_steps = tl.cdiv(K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for it in tl.range(0, my_tiles * k_steps, num_stages=STAGES):
        t = it // k_steps
        ks = it - t * k_steps
        tile = pid + t * nprog
        w = w_desc.load([tile * BLOCK_N, ks * BLOCK_K])
        a = tl.load(x_ptr + ks * BLOCK_K + offs_k)
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
        if ks == k_steps - 1:
            out = tl.sum(acc, axis=1)
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(y_ptr + offs_n, out.to(y_ptr.dtype.element_ty), mask=offs_n < N)
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)


def _alloc(size: int, alignment: int, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


class TmaGemv:
    """y = x @ W.T by one of the kernels above; descriptors built once per weight copy."""

    def __init__(self, o: GB.Op, bn: int, bk: int, stages: int, warps: int, pps: int = 0):
        self.o, self.bn, self.bk, self.stages, self.warps, self.pps = o, bn, bk, stages, warps, pps
        self.descs = [TensorDescriptor.from_tensor(w, block_shape=[bn, bk]) for w in o.ws]
        self.x = o.x[:, : o.k].contiguous()
        self.ys = [torch.empty(1, o.n, device="cuda", dtype=o.x.dtype) for _ in range(2)]
        tiles = triton.cdiv(o.n, bn)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.grid = (min(tiles, pps * sms),) if pps else (tiles,)

    def __call__(self, i=0):
        y = self.ys[i % 2]
        kern = _tma_gemv_persistent if self.pps else _tma_gemv
        kern[self.grid](self.x, self.descs[i % self.o.copies], y, self.o.n, self.o.k, BLOCK_N=self.bn,
                        BLOCK_K=self.bk, STAGES=self.stages, num_warps=self.warps)
        return y

    def label(self) -> str:
        return f"tma {self.bn}x{self.bk} s{self.stages} w{self.warps}" + (f" p{self.pps}" if self.pps else "")


CANDIDATES = [  # (BLOCK_N, BLOCK_K, stages, warps, programs per SM or 0)
    (8, 256, 4, 4, 0), (8, 256, 8, 4, 0), (16, 256, 4, 4, 0), (16, 128, 8, 4, 0), (8, 512, 4, 4, 0),
    (32, 128, 4, 4, 0), (16, 256, 6, 8, 0), (8, 256, 6, 4, 4), (16, 256, 4, 4, 4), (16, 128, 8, 4, 6),
    (32, 128, 6, 4, 2), (16, 256, 6, 8, 2),
]


# op -> (prologue, row index of kernels.gemv.CONFIGS[prologue]) for Llama-3.1-8B's TP-1 shapes at M = 1
ROWS = {"qkv": ("rmsnorm", None), "o_proj": ("plain", None), "gate_up": ("rmsnorm", None), "down": ("silu", None)}
FMA = {  # the launch rows before the "tma" kind (the vector-summed GEMV table)
    "qkv": dict(kind="fma", block_m=1, block_n=4, block_k=2048, programs_per_sm=8, norm_one_load=True, vec=8),
    "o_proj": dict(kind="fma", block_m=1, block_n=2, block_k=2048, vec=8),
    "gate_up": dict(kind="fma", block_m=1, block_n=8, block_k=1024, programs_per_sm=4, norm_one_load=True,
                    early_weight=True),
    "down": dict(kind="fma", block_m=1, block_n=8, block_k=1024, num_stages=3),
}


def _tma(bn: int, bk: int, stages: int = 4, warps: int = 4, late: bool = False) -> dict:
    return dict(kind="tma", block_m=1, block_n=bn, block_k=bk, num_stages=stages, num_warps=warps, late_trigger=late)


LAYER_VARIANTS: dict[str, dict[str, dict]] = {
    "fma (previous rows)": {},
    "late gate_up + down 8x512, qkv fma": {"gate_up": _tma(16, 256, late=True),
                                                   "down": _tma(8, 512, late=True)},
    "late, down 8x512": {"gate_up": _tma(16, 256, late=True), "down": _tma(8, 512, late=True),
                         "qkv": _tma(16, 256, late=True)},
    "late gate_up + down 8x512, qkv entry trigger": {"gate_up": _tma(16, 256, late=True),
                                                     "down": _tma(8, 512, late=True), "qkv": _tma(16, 256)},
}


def _row_index(prologue: str, n: int) -> int:
    from kvpilot.kernels import gemv as G

    for i, (max_m, min_n, _) in enumerate(G.CONFIGS[prologue]):
        if 1 <= max_m and n >= min_n:
            return i
    raise ValueError(prologue)


def layers_main(a) -> int:
    import statistics

    import gpu_decode_layer as D
    from kvpilot.kernels import gemv as G

    copy_gbs = copy_bandwidth_gbs()
    print(f"GPU {torch.cuda.get_device_name()}, copy {copy_gbs:.0f} GB/s")
    shapes = {"qkv": 6144, "o_proj": 4096, "gate_up": 28672, "down": 4096}
    idx = {op: _row_index(ROWS[op][0], shapes[op]) for op in ROWS}
    saved = {op: G.CONFIGS[ROWS[op][0]][idx[op]] for op in ROWS}

    def apply(changes: dict) -> None:
        for op, (pro, _) in ROWS.items():
            mm, nn, _ = G.CONFIGS[pro][idx[op]]
            kw = dict(changes.get(op, FMA[op]))
            G.CONFIGS[pro][idx[op]] = (mm, nn, G.launch_config(kw.pop("kind"), kw.pop("block_m"), kw.pop("block_n"),
                                                                  kw.pop("block_k"), **kw))

    bad, results = 0, {}
    for ctx in a.contexts:
        mods, caches, meta, positions, cos_sin, hidden0 = D.build_layers(a.layers, ctx)
        if a.kv_fp8:  # the engine benchmarks' cache (KvCacheConfig(dtype="fp8"))
            caches = [c.to(torch.float8_e4m3fn) for c in caches]
        if a.graph_bound:  # attention launched for this many keys, as the engine's decode graphs are
            meta.max_seq_len = max(a.graph_bound, ctx)
        for m in mods:
            m.fused_gemv = True
        pristine = [c.clone() for c in caches]
        floor_us = sum(p.numel() * p.element_size() for p in mods[0].parameters()) / copy_gbs / 1e3

        def measure(name: str):
            apply(LAYER_VARIANTS[name])
            for c, p in zip(caches, pristine):
                c.copy_(p)
            with torch.no_grad():
                h, r = D.run_layers(mods[:1], caches[:1], meta, positions, cos_sin, hidden0)
                one = torch.cat([h, r], dim=-1).float()
                caches[0].copy_(pristine[0])
                h, r = D.run_layers(mods, caches, meta, positions, cos_sin, hidden0)
                out = (torch.cat([h, r], dim=-1).float(), one)
                for c, p in zip(caches, pristine):
                    c.copy_(p)
                ms = D.graph_ms(lambda: D.run_layers(mods, caches, meta, positions, cos_sin, hidden0), 1,
                                replays=20)
            return ms / a.layers * 1e3, out

        names = list(LAYER_VARIANTS)
        times = {n: [] for n in names}
        outs = {}
        for _ in range(a.rounds):
            for n in names:
                us, outs[n] = measure(n)
                times[n].append(us)
        print(f"\ncontext {ctx}, {a.layers} layers, floor {floor_us:.1f} us per layer")
        print("| variant | us per layer | median | % of floor | rel. diff to first: 1 layer | all layers |\n"
              "|---|---|---:|---:|---:|---:|")
        for n in names:
            med = statistics.median(times[n])
            err1 = D.rel_err(outs[n][1], outs[names[0]][1])
            err = D.rel_err(outs[n][0], outs[names[0]][0])
            bad += not err1 < 2e-2
            print(f"| {n} | {', '.join(f'{t:.2f}' for t in times[n])} | {med:.2f} | {100 * floor_us / med:.1f}% "
                  f"| {err1:.2g} | {err:.2g} |")
        results[ctx] = dict(floor_us=floor_us, times=times)
        del mods, caches, pristine
        torch.cuda.empty_cache()
    for op, (pro, _) in ROWS.items():
        mm, nn, _ = G.CONFIGS[pro][idx[op]]
        G.CONFIGS[pro][idx[op]] = (mm, nn, saved[op])
    if a.json:
        Path(a.json).write_text(json.dumps(dict(copy_gbs=copy_gbs, layers=results), indent=1))
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", nargs="+", default=["gate_up", "down", "qkv", "o_proj"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--layers", type=int, default=0, help="time whole layers under LAYER_VARIANTS instead")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-fp8", action="store_true", help="--layers: FP8 KV caches (as the engine benchmarks)")
    ap.add_argument("--graph-bound", type=int, default=0,
                    help="--layers: launch attention for this many keys (the engine's graphs: max_seq_len, "
                         "e.g. 33024; default: the context)")
    a = ap.parse_args(argv)
    if a.layers:
        return layers_main(a)
    triton.set_allocator(_alloc)
    copy_gbs = copy_bandwidth_gbs()
    print(f"GPU {torch.cuda.get_device_name()}, copy {copy_gbs:.0f} GB/s")
    gen = torch.Generator(device="cuda").manual_seed(0)
    bad, res = 0, {}
    for op in a.ops:
        o = GB.Op(op, 1, gen)
        floor = o.n * o.k * 2 / (copy_gbs * 1e9) * 1e6
        rows = [("current fused (with prologue)", o.time(o.fused)), ("cuBLAS (no prologue)", o.time(o.cublas))]
        ref = torch.nn.functional.linear(o.x[:, : o.k].float(), o.ws[0].float())
        for cand in CANDIDATES:
            t = TmaGemv(o, *cand)
            try:
                y = t(0).float()
                err = ((y - ref).norm() / ref.norm()).item()
                us = o.time(lambda i: t(i))
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"  {t.label()}: failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            if not err < 1e-2:
                bad += 1
                print(f"  {t.label()}: MISMATCH rel err {err:.3g}")
            rows.append((t.label(), us))
        print(f"\n{op} [{o.n}, {o.k}]: floor {floor:.1f} us at the copy rate")
        print("| kernel | us | % of floor speed | TB/s |\n|---|---:|---:|---:|")
        for name, us in sorted(rows, key=lambda r: r[1]):
            print(f"| {name} | {us:.2f} | {100 * floor / us:.1f}% | {o.n * o.k * 2 / us / 1e6:.2f} |")
        res[op] = dict(floor_us=floor, rows=rows)
        del o
        torch.cuda.empty_cache()
    if len(res) == 0:
        bad += 1
    if a.json:
        Path(a.json).write_text(json.dumps(dict(copy_gbs=copy_gbs, results=res), indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
