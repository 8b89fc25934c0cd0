"""Fused decode GEMVs (kvpilot.kernels.gemv) against cuBLAS + separate norm/activation kernels.

Usage (on a CUDA machine, after `pip install -e .`; about a minute, `--sweep` two more):

    python3 benchmarks/lab/gpu_gemv.py [--sweep] [--json PATH]

1. Device-to-device copy bandwidth (bytes read + written), the ceiling for "% copy".
2. Checks, at Llama-3.1-8B shapes in bf16 and M = 1, 2, 4, 8, 16 rows: each fused kernel against
   its reference composition (rms_norm_ref / silu_and_mul_ref + F.linear), ``h`` bit-exact.
3. Per op: cuBLAS alone (torch.matmul), the unfused pair (kvpilot's Triton rms_norm /
   silu_and_mul + torch.matmul) and the fused kernel, each timed as us per call inside a CUDA graph
   of back-to-back calls over rotating weight copies (>= 300 MB, so weights come from HBM); "% copy"
   counts the weight plus the activations' bytes once. The last two columns are
   ``triton.testing.do_bench`` medians of unfused and fused: do_bench zeroes a 256 MB buffer
   before each call, and writing back those dirty L2 lines slows a 10-50 us kernel by 20-50%, so
   they read low (kept for comparison with other benchmarks).
4. Whole layers: a CUDA graph of 32 repetitions of one layer's four products (rms_norm -> qkv,
   o_proj, rms_norm -> gate_up, silu_and_mul -> down; no attention, o_proj reads the q slice),
   with 8 distinct weight sets so that nothing stays in L2: unfused, all four fused (Triton at
   every M), and through the dispatchers (fused up to ``FUSED_MAX_ROWS``, what the engine would
   run). Reported per layer, against the weight-read floor.
``--sweep`` first times launch configurations of each op at each M (``--sweep-ops``,
``--sweep-rows`` narrow it) and prints the best three; all times are from CUDA graphs.
Exits 1 on a mismatch, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys

from pathlib import Path

import torch

try:
    import kvpilot.kernels as K
except ModuleNotFoundError:  # not installed: map the package onto this checkout (engine/ + kernels/)
    import types

    _root = Path(__file__).resolve().parents[2]
    _pkg = types.ModuleType("kvpilot")
    _pkg.__path__ = [str(_root / "engine"), str(_root)]
    sys.modules["kvpilot"] = _pkg
    import kvpilot.kernels as K
from kvpilot.kernels import gemv as G

HIDDEN, INTER, QKV = 4096, 14336, 6144
EPS = 1e-5
DT = torch.bfloat16
ROWS = (1, 2, 4, 8, 16)
LAYERS, WEIGHT_SETS = 32, 8
# op -> (K, N, prologue); the prologue is what the layer fuses into that product.
SHAPES = {
    "qkv": (HIDDEN, QKV, "rmsnorm"),
    "o_proj": (HIDDEN, HIDDEN, "plain"),
    "gate_up": (HIDDEN, 2 * INTER, "rmsnorm"),
    "down": (INTER, HIDDEN, "silu"),
}


def bench(fn, rep: int = 60) -> float:
    """Median microseconds of ``triton.testing.do_bench`` (used for the copy only: its L2 flush
    leaves ~60 MB of dirty lines that a short kernel then writes back, so it is not used for ops)."""
    import triton.testing

    return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def replay_us(run, replays: int = 7):
    """Capture ``run()`` in a CUDA graph (after two eager warm-up calls, which compile and pick
    cuBLAS kernels); return (median us per replay, clones of what ``run`` returned)."""
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    res = sorted(times)[len(times) // 2], [t.clone() for t in out or ()]
    del g
    return res


def graph_us(calls) -> float:
    """Median microseconds per call of a CUDA graph that runs ``calls`` (callables) back to back.

    The calls cycle over several weight copies (``Op``), so each reads its weight from HBM, and
    the launch gaps inside a graph are included, as in the engine's decode graphs.
    """

    def run():
        for c in calls:
            c()

    return replay_us(run)[0] / len(calls)


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy, read + write counted."""
    a = torch.empty(1 << 30, dtype=DT, device="cuda").normal_()
    b = torch.empty_like(a)
    return 2 * a.numel() * 2 / (bench(lambda: b.copy_(a)) * 1e-6)


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64; NaN anywhere gives inf."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


class Op:
    """One product at M rows over ``copies`` weight copies (>= 300 MB in all, 5x the L2).

    ``fused(i)``, ``unfused(i)``, ``cublas(i)``, ``ref(i)`` use copy ``i % copies``.
    """

    def __init__(self, name: str, m: int, gen: torch.Generator):
        k, n, self.prologue = SHAPES[name]
        self.name, self.m, self.k, self.n = name, m, k, n
        rnd = lambda *s: torch.randn(*s, device="cuda", dtype=DT, generator=gen)  # noqa: E731
        self.copies = max(2, -(-300_000_000 // (2 * n * k)))
        self.ws = [rnd(n, k) / k**0.5 for _ in range(self.copies)]
        self.x = rnd(m, 2 * k if self.prologue == "silu" else k)
        self.res = rnd(m, k)
        self.nw = 1 + 0.1 * rnd(k)

    def fused(self, i=0, config=None):
        w = self.ws[i % self.copies]
        if self.prologue == "rmsnorm":
            return G.rmsnorm_gemv_triton(self.x, self.res, self.nw, EPS, w, config=config)
        if self.prologue == "silu":
            return G.silu_mul_gemv_triton(self.x, w, config=config)
        return G.gemv_triton(self.x, w, config=config)

    def unfused(self, i=0):
        w = self.ws[i % self.copies]
        if self.prologue == "rmsnorm":
            y, h = K.rms_norm(self.x, self.nw, EPS, self.res)
            return torch.matmul(y, w.t()), h
        if self.prologue == "silu":
            return torch.matmul(K.silu_and_mul(self.x), w.t())
        return torch.matmul(self.x, w.t())

    def cublas(self, i=0):
        return torch.matmul(self.x[:, : self.k], self.ws[i % self.copies].t())

    def ref(self, i=0):
        w = self.ws[i % self.copies]
        if self.prologue == "rmsnorm":
            return G.rmsnorm_gemv_ref(self.x, self.res, self.nw, EPS, w)
        if self.prologue == "silu":
            return G.silu_mul_gemv_ref(self.x, w)
        return G.gemv_ref(self.x, w)

    def time(self, fn, **kw) -> float:
        """Microseconds per call, in a graph of 4 passes over the weight copies (>= 12 calls)."""
        reps = max(12, 4 * self.copies)
        return graph_us([lambda i=i: fn(i, **kw) for i in range(reps)])

    def bytes(self) -> int:
        """Weight + inputs + outputs, each crossing HBM once."""
        act = {"rmsnorm": 4 * self.m * self.k, "silu": 2 * self.m * self.k, "plain": self.m * self.k}
        return 2 * (self.n * self.k + act[self.prologue] + self.m * self.n)

    def check(self, config=None) -> float:
        """Relative L2 error of the fused output (inf when ``h`` is not bit-exact)."""
        out, ref = self.fused(0, config), self.ref(0)
        if self.prologue == "rmsnorm":
            if not torch.equal(out[1], ref[1]):
                return float("inf")
            out, ref = out[0], ref[0]
        return rel_l2(out, ref)


def sweep_candidates(m: int, prologue: str) -> list[dict]:
    """Launch configurations tried by ``--sweep`` at ``m`` rows (``G.launch_config`` arguments)."""
    bm = 1 << (m - 1).bit_length()
    c = G.launch_config
    if prologue == "rmsnorm":  # persistent programs amortise the norm pass: sweep the grid cap
        pps = (0, 2, 4, 8)
        if m == 1:
            out = [c("fma", 1, n, k, 4, 1, False, p) for n, k in ((4, 1024), (8, 1024)) for p in pps]
            out += [c("fma", 1, 4, 2048, 4, 1, False, p) for p in (2, 4, 6)]
            out += [c("fma", 1, 8, 512, 4, 1, True, 4), c("fma", 1, 8, 1024, 4, 1, False, 3),
                    c("fma", 1, 8, 1024, 4, 1, False, 6), c("fma", 1, 16, 512, 4, 1, False, 4),
                    c("fma", 1, 8, 2048, 8, 1, False, 4), c("fma", 1, 8, 1024, 8, 1, False, 4)]  # fmt: skip
        elif m == 2:
            out = [c("fma", 2, n, k, 4, 1, False, p) for n, k in ((4, 1024), (8, 512)) for p in (0, 4, 8)]
            out += [c("dot", 16, 64, 128, 8, 1, True, p) for p in (0, 4)]
        else:
            out = [c("dot", 16, n, k, 4, 3, False, p) for n, k in ((32, 256), (64, 128)) for p in (0, 2, 4)]
            if m <= 4:
                out += [c("fma", 4, 4, 256, 4, 1, True, p) for p in (0, 4)]
        return out
    fma = {  # (block_n, block_k, warps, stages, prefetch)
        1: [(8, 1024, 4, 1, 0), (4, 1024, 4, 1, 0), (8, 2048, 8, 1, 0), (4, 2048, 4, 1, 0),
            (8, 512, 4, 1, 1), (4, 1024, 4, 1, 1), (8, 1024, 4, 1, 1), (8, 1024, 8, 1, 1),
            (16, 512, 4, 1, 1), (8, 1024, 4, 3, 0), (2, 2048, 4, 1, 0), (4, 512, 4, 1, 1)],
        2: [(8, 512, 4, 1, 0), (4, 512, 4, 1, 1), (8, 512, 4, 1, 1), (8, 256, 4, 1, 1), (4, 1024, 4, 1, 0),
            (4, 1024, 8, 1, 1)],
        4: [(8, 256, 4, 1, 0), (4, 512, 4, 1, 0), (4, 256, 4, 1, 1), (8, 256, 4, 1, 1), (8, 256, 8, 1, 1)],
        8: [(4, 256, 4, 1, 0), (4, 256, 4, 1, 1), (8, 128, 4, 1, 1), (8, 256, 8, 1, 1)],
    }.get(bm, [])  # fmt: skip
    dot = [(32, 256, 4, 3, 0), (64, 128, 4, 3, 0), (32, 256, 4, 1, 1), (64, 128, 4, 1, 1), (32, 128, 4, 1, 1),
           (16, 256, 4, 1, 1), (64, 128, 8, 1, 1), (16, 512, 4, 1, 1), (32, 256, 8, 3, 0)]  # fmt: skip
    out = [c("fma", bm, n, k, w, s, bool(p)) for n, k, w, s, p in fma]
    if m == 1:  # persistent grids, as for the RMSNorm prologue
        out += [c("fma", 1, n, k, 4, s, False, p) for n, k, s in ((4, 1024, 1), (8, 1024, 1), (8, 1024, 3))
                for p in (4, 8)]  # fmt: skip
    if m > 1:
        out += [c("dot", 16, n, k, w, s, bool(p)) for n, k, w, s, p in dot]
    return out


def cfg_str(c: dict) -> str:
    kind = "dot" if c["use_dot"] else "fma"
    pf = " pf" if c.get("prefetch") else ""
    pps = f" p{c['programs_per_sm']}" if c.get("programs_per_sm") else ""
    return f"{kind} m{c['block_m']} n{c['block_n']} k{c['block_k']} w{c['num_warps']} s{c['num_stages']}{pf}{pps}"


def sweep(copy_bps: float, gen: torch.Generator, results: dict, ops=tuple(SHAPES), rows=ROWS) -> bool:
    """Time every candidate configuration of each op at each M; print the best three."""
    ok = True
    print("\n== sweep: best launch configurations per op and M (us, % copy) ==")
    for name in ops:
        for m in rows:
            op = Op(name, m, gen)
            ranked = []
            for cfg in sweep_candidates(m, op.prologue):
                try:
                    err = op.check(cfg)
                    us = op.time(op.fused, config=cfg)
                except Exception as e:  # noqa: BLE001 - a config that fails to compile is skipped
                    print(f"  {name} M={m} {cfg_str(cfg)}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                if err > 2e-2:
                    print(f"  MISMATCH {name} M={m} {cfg_str(cfg)}: rel err {err:.3g}")
                    ok = False
                ranked.append((us, cfg))
            ranked.sort(key=lambda r: r[0])
            default = G.gemv_config(m, op.n, op.k, op.prologue)
            d_us = next((us for us, c in ranked if c == default), float("nan"))
            best = " | ".join(f"{cfg_str(c)} {us:.1f} ({100 * op.bytes() / (us * 1e-6) / copy_bps:.0f}%)"
                              for us, c in ranked[:3])  # fmt: skip
            print(f"  {name:7s} M={m:2d} default {d_us:6.1f} us | best: {best}")
            results.setdefault("sweep", []).append(
                dict(op=name, m=m, default_us=d_us, ranked=[(us, cfg_str(c)) for us, c in ranked])
            )
            del op
    return ok


def per_op(copy_bps: float, gen: torch.Generator, results: dict) -> bool:
    ok = True
    print("\n== per op: us per call in a CUDA graph over rotating weight copies (% of copy bandwidth) ==")
    print(f"{'op':8s} {'M':>3s} {'cuBLAS':>14s} {'unfused':>14s} {'fused':>14s} {'speedup':>8s} {'rel err':>8s}"
          f" {'do_bench unf/fused':>19s}")
    for name in SHAPES:
        for m in ROWS:
            op = Op(name, m, gen)
            err = op.check()
            if not err < 1e-2:
                ok = False
            t_cub, t_unf, t_fus = op.time(op.cublas), op.time(op.unfused), op.time(op.fused)
            db_unf, db_fus = bench(op.unfused, rep=30), bench(op.fused, rep=30)
            pct = lambda us: 100 * op.bytes() / (us * 1e-6) / copy_bps  # noqa: E731
            print(f"{name:8s} {m:3d} {t_cub:7.1f} ({pct(t_cub):3.0f}%) {t_unf:7.1f} ({pct(t_unf):3.0f}%) "
                  f"{t_fus:7.1f} ({pct(t_fus):3.0f}%) {t_unf / t_fus:7.2f}x {err:8.1e} {db_unf:9.1f}/{db_fus:.1f}"
                  + ("  MISMATCH" if not err < 1e-2 else ""))  # fmt: skip
            results.setdefault("per_op", []).append(
                dict(op=name, m=m, cublas_us=t_cub, unfused_us=t_unf, fused_us=t_fus, rel_err=err,
                     do_bench_unfused_us=db_unf, do_bench_fused_us=db_fus,
                     pct_copy_fused=pct(t_fus), pct_copy_unfused=pct(t_unf))  # fmt: skip
            )
            del op
    return ok


class LayerWeights:
    def __init__(self, gen: torch.Generator):
        rnd = lambda *s: torch.randn(*s, device="cuda", dtype=DT, generator=gen)  # noqa: E731
        self.qkv = rnd(QKV, HIDDEN) / HIDDEN**0.5
        self.o = rnd(HIDDEN, HIDDEN) / HIDDEN**0.5
        self.gate_up = rnd(2 * INTER, HIDDEN) / HIDDEN**0.5
        self.down = rnd(HIDDEN, INTER) / INTER**0.5
        self.ln1 = 1 + 0.1 * rnd(HIDDEN)
        self.ln2 = 1 + 0.1 * rnd(HIDDEN)


def layer_unfused(hidden, residual, lw: LayerWeights):
    y, residual = K.rms_norm(hidden, lw.ln1, EPS, residual)
    qkv = torch.matmul(y, lw.qkv.t())
    o = torch.matmul(qkv[:, :HIDDEN], lw.o.t())  # stand-in for attention: o_proj reads q
    y, residual = K.rms_norm(o, lw.ln2, EPS, residual)
    act = K.silu_and_mul(torch.matmul(y, lw.gate_up.t()))
    return torch.matmul(act, lw.down.t()), residual


def layer_fused(hidden, residual, lw: LayerWeights):
    """All four products through the Triton kernels, whatever M."""
    qkv, residual = G.rmsnorm_gemv_triton(hidden, residual, lw.ln1, EPS, lw.qkv)
    o = G.gemv_triton(qkv[:, :HIDDEN], lw.o)
    gate_up, residual = G.rmsnorm_gemv_triton(o, residual, lw.ln2, EPS, lw.gate_up)
    return G.silu_mul_gemv_triton(gate_up, lw.down), residual


def layer_dispatch(hidden, residual, lw: LayerWeights):
    """Through the dispatchers: Triton up to ``G.FUSED_MAX_ROWS`` rows, unfused beyond (what the
    engine would run)."""
    qkv, residual = G.rmsnorm_gemv(hidden, residual, lw.ln1, EPS, lw.qkv)
    o = G.gemv(qkv[:, :HIDDEN], lw.o)
    gate_up, residual = G.rmsnorm_gemv(o, residual, lw.ln2, EPS, lw.gate_up)
    return G.silu_mul_gemv(gate_up, lw.down), residual


def graph_time(layer_fn, sets, hidden, residual):
    """Capture LAYERS layers in one CUDA graph; return (median us per replay, outputs)."""

    def run():
        h, r = hidden, residual
        for i in range(LAYERS):
            h, r = layer_fn(h, r, sets[i % len(sets)])
        return h, r

    return replay_us(run, replays=20)


def layers(copy_bps: float, gen: torch.Generator, results: dict) -> bool:
    ok = True
    sets = [LayerWeights(gen) for _ in range(WEIGHT_SETS)]
    w_bytes = 2 * HIDDEN * (QKV + HIDDEN + 2 * INTER) + 2 * INTER * HIDDEN
    floor_us = w_bytes / copy_bps * 1e6
    print(f"\n== CUDA graph of {LAYERS} layers (4 products each), us per layer; floor {floor_us:.1f} us "
          f"({w_bytes / 1e6:.0f} MB of weights at copy bandwidth) ==")  # fmt: skip
    print(f"{'M':>3s} {'unfused':>16s} {'all fused':>16s} {'dispatch':>16s} {'saved/layer':>11s} "
          f"{'32-layer rel err':>16s}")
    for m in ROWS:
        hidden = torch.randn(m, HIDDEN, device="cuda", dtype=DT, generator=gen)
        residual = torch.randn(m, HIDDEN, device="cuda", dtype=DT, generator=gen)
        t_u, out_u = graph_time(layer_unfused, sets, hidden, residual)
        t_f, out_f = graph_time(layer_fused, sets, hidden, residual)
        t_d, _ = graph_time(layer_dispatch, sets, hidden, residual)
        t_u, t_f, t_d = t_u / LAYERS, t_f / LAYERS, t_d / LAYERS
        # Rounding differences compound over 32 random layers: only a loose agreement is expected.
        err = max(rel_l2(out_f[0], out_u[0]), rel_l2(out_f[1], out_u[1]))
        bad = not err < 0.1
        ok &= not bad
        pct = lambda t: 100 * floor_us / t  # noqa: E731
        print(f"{m:3d} {t_u:8.1f} ({pct(t_u):3.0f}%) {t_f:8.1f} ({pct(t_f):3.0f}%) {t_d:8.1f} ({pct(t_d):3.0f}%) "
              f"{t_u - t_d:11.1f} {err:16.1e}" + ("  MISMATCH" if bad else ""))  # fmt: skip
        results.setdefault("layers", []).append(
            dict(m=m, unfused_us=t_u, fused_us=t_f, dispatch_us=t_d, floor_us=floor_us, err=err)
        )
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="time launch configurations first")
    ap.add_argument("--sweep-ops", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="ops to sweep")
    ap.add_argument("--sweep-rows", nargs="+", type=int, default=list(ROWS), help="M values to sweep")
    ap.add_argument("--no-layers", action="store_true", help="skip the CUDA-graph layer timing")
    ap.add_argument("--json", help="write all results here")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    props = torch.cuda.get_device_properties(0)
    copy_bps = copy_bandwidth()
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    print(f"copy bandwidth {copy_bps / 1e9:.0f} GB/s; fused up to M = {G.FUSED_MAX_ROWS}")
    results: dict = dict(device=props.name, copy_gbs=copy_bps / 1e9)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ok = True
    if a.sweep:
        ok &= sweep(copy_bps, gen, results, a.sweep_ops, a.sweep_rows)
    ok &= per_op(copy_bps, gen, results)
    if not a.no_layers:
        ok &= layers(copy_bps, gen, results)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    print("all outputs match their references" if ok else "MISMATCH: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
