"""The fused Triton MoE kernels against the PyTorch reference, on Qwen3-30B-A3B's MoE layer shape.

Usage (one GPU, after ``pip install -e .``; a few minutes, most of it the reference at 1024 tokens):

    python3 benchmarks/gpu_moe.py [--layers 4] [--tokens 1,64,1024] [--prefill 8192] [--json PATH]
    python3 benchmarks/gpu_moe.py --dry-run      # CPU, tiny shapes, kernels under TRITON_INTERPRET=1

Model: ``--layers`` MoE layers of Qwen3-30B-A3B's shape (hidden 2048, 128 experts of intermediate
768, top 8, renormalised) with random bf16 weights, each layer its own weights (1.2 GB per layer,
so one layer's experts are not in L2 when the next runs). Routing: random router logits through
`kvpilot.kernels.moe.select_experts`, fixed per token count.

Per token count ``T`` (``--tokens``, plus ``--prefill``): the experts' time per layer (routing
excluded) of ``fused_moe_triton`` (``path="auto"``: the small-token path up to 8 tokens, the grouped
GEMM above) and of ``fused_moe_ref`` (loop over experts), CUDA events over all layers in turn;
the bandwidth floor: bytes of the distinct experts the tokens chose (3 * I * H * 2 bytes each)
over the measured device-to-device copy bandwidth, and the kernels' share of it; the grouped
GEMM's TFLOP/s (``2 * T * K * 3 * I * H`` flops) against ``torch.mm``'s on a dense bf16
``[T*K, 2048] x [2048, 1536]`` product; and the largest |difference| between the two outputs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", default="1,64,1024", help="comma-separated token counts")
    p.add_argument("--prefill", type=int, default=8192, help="one more token count, fused only (0: none)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from kvpilot import envs

    if args.dry_run:
        envs.set_external("TRITON_INTERPRET", "1")  # before the kernels' module is imported
    import torch

    from kvpilot.kernels.fused_moe import fused_moe_triton
    from kvpilot.kernels.moe import fused_moe_ref, select_experts

    if args.dry_run:
        device, dtype = "cpu", torch.float32
        hidden, inter, experts, top_k, layers = 64, 32, 8, 2, 2
        tokens, prefill, iters = [1, 4, 16], 0, 1
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --dry-run)", file=sys.stderr)
            return 2
        device, dtype = "cuda", torch.bfloat16
        hidden, inter, experts, top_k, layers = 2048, 768, 128, 8, args.layers
        tokens = [int(t) for t in args.tokens.split(",") if t]
        prefill, iters = args.prefill, args.iters
    g = torch.Generator(device=device).manual_seed(0)
    weights = [(torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype, generator=g) / hidden ** 0.5,
                torch.randn(experts, hidden, inter, device=device, dtype=dtype, generator=g) / inter ** 0.5)
               for _ in range(layers)]
    elt = torch.tensor([], dtype=dtype).element_size()

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(fn, n) -> float:
        """Seconds per call of ``fn()`` (mean of ``n`` after one warm-up)."""
        fn()
        sync()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / n
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n

    big = torch.empty(256 * 2 ** 20 if not args.dry_run else 2 ** 20, dtype=torch.float32, device=device)
    dst = torch.empty_like(big)
    copy_s = timed(lambda: dst.copy_(big), max(iters, 3))
    bandwidth = 2 * big.numel() * 4 / copy_s  # bytes read + written per second
    del big, dst
    results = {"shape": dict(hidden=hidden, inter=inter, experts=experts, top_k=top_k, layers=layers,
                             dtype=str(dtype)), "copy_bandwidth_GBps": bandwidth / 1e9, "rows": []}
    print(f"device copy bandwidth {bandwidth / 1e9:.0f} GB/s; layer: {experts} experts of {inter}, top {top_k}, "
          f"hidden {hidden}, {dtype}")
    print(f"{'tokens':>7} {'fused us':>10} {'ref us':>10} {'speedup':>8} {'floor us':>9} {'floor %':>8} "
          f"{'TFLOP/s':>8} {'mm TFLOP/s':>10} {'max diff':>9}")
    for t in tokens + ([prefill] if prefill else []):
        x = torch.randn(t, hidden, device=device, dtype=dtype, generator=g)
        w, ids = select_experts(torch.randn(t, experts, device=device, generator=g), top_k, renormalize=True)

        def run(fn):
            def all_layers():
                for w13, w2 in weights:
                    fn(x, w13, w2, w, ids)
            return all_layers

        fused_s = timed(run(fused_moe_triton), iters) / layers
        with_ref = t in tokens
        ref_s = timed(run(fused_moe_ref), max(1, iters // 4)) / layers if with_ref else None
        distinct = int(torch.unique(ids).numel())
        floor_s = distinct * 3 * inter * hidden * elt / bandwidth
        flops = 2 * t * top_k * 3 * inter * hidden
        a = torch.randn(t * top_k, hidden, device=device, dtype=dtype, generator=g)
        b = torch.randn(hidden, 2 * inter, device=device, dtype=dtype, generator=g)
        mm_rate = 2 * a.shape[0] * hidden * 2 * inter / timed(lambda: torch.mm(a, b), iters)
        diff = None
        if with_ref:
            diff = (fused_moe_triton(x, *weights[0], w, ids).float() - fused_moe_ref(x, *weights[0], w, ids).float()
                    ).abs().max().item()
        row = dict(tokens=t, fused_us=fused_s * 1e6, ref_us=None if ref_s is None else ref_s * 1e6,
                   distinct_experts=distinct, floor_us=floor_s * 1e6, floor_fraction=floor_s / fused_s,
                   tflops=flops / fused_s / 1e12, mm_tflops=mm_rate / 1e12, max_diff=diff)
        results["rows"].append(row)
        ref_txt = f"{row['ref_us']:10.1f} {ref_s / fused_s:8.2f}" if ref_s else f"{'-':>10} {'-':>8}"
        print(f"{t:7d} {row['fused_us']:10.1f} {ref_txt} {row['floor_us']:9.1f} {100 * row['floor_fraction']:7.1f}% "
              f"{row['tflops']:8.1f} {row['mm_tflops']:10.1f} {'-' if diff is None else f'{diff:9.2e}':>9}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    bad = [r for r in results["rows"] if r["max_diff"] is not None and r["max_diff"] > (1e-4 if args.dry_run else 5e-2)]
    if bad:
        print(f"fused and reference outputs differ at {[r['tokens'] for r in bad]} tokens", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
