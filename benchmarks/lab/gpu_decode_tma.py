"""Full-batch decode attention: `_decode_kernel` (pointer loads) against `_decode_tma_kernel` (TMA pages).

One layer of Llama-3.1-8B's attention (32 query heads, 8 kv heads, head_dim 128, 32-token pages) at
the offline benchmark's decode batches: every sequence's pages scattered over a pool (a random
permutation, as after churn), context lengths drawn uniformly around ``--context``. Each variant
runs 20 launches in a CUDA graph (`triton.testing.do_bench` median), is checked against the
pointer kernel's output (max abs difference), and is reported as % of the device copy rate
measured here (bytes of K and V read / time).

    python3 benchmarks/lab/gpu_decode_tma.py [--batches 492 256] [--contexts 1200] [--kv-dtypes fp8 auto]
"""

from __future__ import annotations

import argparse
import json
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_decode_profile import copy_bandwidth  # noqa: E402


def case(batch: int, context: int, kv_dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    bs, kvh, d, h = 32, 8, 128, 32
    lens = torch.randint(int(context * 0.8), int(context * 1.2) + 1, (batch,), generator=g)
    pages = (lens + bs - 1) // bs
    nb = int(pages.sum()) + 1
    perm = torch.randperm(nb - 1, generator=g) + 1
    bt = torch.zeros(batch, int(pages.max()), dtype=torch.int32)
    c = 0
    for i, p in enumerate(pages.tolist()):
        bt[i, :p] = perm[c:c + p]
        c += p
    k = torch.randn(nb, bs, kvh, d, device="cuda").to(kv_dtype)
    v = torch.randn(nb, bs, kvh, d, device="cuda").to(kv_dtype)
    q = torch.randn(batch, h, d, device="cuda", dtype=torch.bfloat16)
    seq_lens = lens.to(torch.int32).cuda()
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    kv_bytes = int(lens.sum()) * kvh * d * 2 * k.element_size()
    return q, k, v, bt.cuda(), seq_lens, qsl, int(lens.max()), kv_bytes


def main() -> None:
    import triton

    from kvpilot.kernels import attention

    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[492, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1200])
    ap.add_argument("--kv-dtypes", nargs="+", default=["fp8", "auto"])
    ap.add_argument("--pages", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--warps", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 5, 7])
    ap.add_argument("--maxnreg", type=int, nargs="+", default=[0, 128])
    ap.add_argument("--no-grid", action="store_true", help="only the pointer kernel and --variants")
    ap.add_argument("--variants", default="[]",
                    help='more variants: a JSON list of TUNING["decode"] overrides, e.g. [{"batch_num_warps": 1}]')
    a = ap.parse_args()
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy {bw / 1e12:.3f} TB/s, triton {triton.__version__}")
    base = dict(attention.TUNING["decode"])
    for dt_name, ctx, b in itertools.product(a.kv_dtypes, a.contexts, a.batches):
        dt = torch.float8_e4m3fn if dt_name == "fp8" else torch.bfloat16
        q, k, v, bt, sl, qsl, mx, kv_bytes = case(b, ctx, dt)
        scale = 128 ** -0.5

        def run():
            return attention.paged_attention_triton(q, k, v, bt, sl, qsl, scale, 1, mx)

        variants = [("pointer kernel (`_decode_kernel`)", dict(batch_tma=False, batch_tma_fp8=False))] + [
            (f"TMA {p} page(s), {w} warps, {s} stages, maxnreg {r or '-'}",
             dict(batch_tma=True, batch_tma_fp8=True, batch_tma_pages=p, batch_tma_warps=w, batch_tma_stages=s,
                  batch_tma_maxnreg=r or None))
            for p, w, s, r in itertools.product(a.pages, a.warps, a.stages, a.maxnreg) if not a.no_grid]
        variants += [(json.dumps(v), v) for v in json.loads(a.variants)]
        print(f"\n| {dt_name} KV, batch {b} x ~{ctx} keys: variant | us | % of copy rate | max diff |")
        print("|---|---:|---:|---:|")
        ref = None
        best = None
        for name, over in variants:
            attention.TUNING["decode"] = dict(base, **over)
            try:
                out = run()
                torch.cuda.synchronize()
                if ref is None:
                    ref = out.float()
                diff = (out.float() - ref).abs().max().item()
                gr = torch.cuda.CUDAGraph()
                with torch.cuda.graph(gr):
                    for _ in range(20):
                        run()
                us = triton.testing.do_bench(gr.replay, warmup=5, rep=60) * 1e3 / 20
            except Exception as e:  # a variant that does not compile or launch
                print(f"| {name} | failed: {type(e).__name__}: {str(e)[:120]} | | |", flush=True)
                continue
            finally:
                attention.TUNING["decode"] = base
            pct = 100 * kv_bytes / (us / 1e6) / bw
            print(f"| {name} | {us:.1f} | {pct:.1f}% | {diff:.2e} |", flush=True)
            if diff > 2e-2 or diff != diff:
                print(f"MISMATCH: {name}")
            elif best is None or us < best[0]:
                best = (us, name, over)
        if best is None:
            print("best: none (every variant failed or mismatched)", flush=True)
            continue
        print(f"best: {best[1]} ({best[0]:.1f} us)", flush=True)
        print("BEST_JSON", dt_name, ctx, b, json.dumps(best[2]), flush=True)


if __name__ == "__main__":
    main()
