"""Where a large-batch decode step's GPU time goes, and the decode attention kernel's launch tuning.

The offline benchmark (1,000 x (1k in + 1k out), `gpu_recheck.py`) spends most of its time in
decode-only steps of 330-500 sequences at contexts around 1,000-2,000 tokens. This script builds a
`ModelRunner` of Llama-3.1-8B's shape with random bf16 weights drawn on the GPU (as
`gpu_decode_profile.py` does) for each KV-cache dtype asked for, and

1. times the CUDA-graph decode step at the given batch sizes and context, next to a floor:
   weights + KV read at the copy rate, plus the matrix products' FLOPs at ``--matmul-tflops``;
2. profiles one graph replay with `torch.profiler` and prints the kernels that take the time;
3. times the decode attention kernel alone (one layer's cache, the runner's block tables) under
   launch variants (``block_n``, ``num_warps``, ``num_stages``, register cap ``batch_maxnreg``,
   ``min_split_tokens``), batch 1 with a CUDA graph's context bound and the large batches, as % of
   copy bandwidth.

    python3 benchmarks/lab/gpu_batch_profile.py [--kv-dtypes auto fp8] [--batches 256 448] [--context 1280]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_decode_profile import build_runner, copy_bandwidth, decode_seqs, kernel_table, step_ms  # noqa: E402


def attention_variants(runner, bw: float, batches: list[int], ctx: int, top_bound: int, small_cases: bool = True,
                       sweep: str = "launch") -> None:
    import triton

    from kvpilot.kernels import attention

    from kvpilot.kernels import attention_common, decode_attention, fused_decode_attention, prefill_attention  # noqa: F401

    cfg = runner.cfg
    H, D = cfg.num_attention_heads, cfg.head_dim
    kv = runner.kv_caches[0]
    per_tok_layer = runner.bytes_per_block // runner.block_size // cfg.num_hidden_layers
    base = dict(attention.TUNING["decode"])
    cases = ([(1, 512, 2048), (1, 512, top_bound), (1, 4096, 8192), (8, 1024, 2048)] if small_cases else []) + [
        (b, ctx, top_bound) for b in batches]
    small = [dict(min_split_tokens=m) for m in (64, 128, 256)]
    # (block_n, warps, stages) around the best of the last sweep, each in both grid orders and both
    # K tile orders; the stages apply to the cache dtype being measured.
    stages_key = "batch_num_stages_fp8" if runner.kv_dtype in attention_common._FP8_DTYPES else "batch_num_stages"
    # Around the best launch of the last sweeps (64 keys, 2 warps, 2 stages): register caps (the FP8
    # kernel used 207 registers a thread, 8 warps per SM), one stage, 32-key tiles.
    reg_key = "batch_maxnreg_fp8" if runner.kv_dtype in attention_common._FP8_DTYPES else "batch_maxnreg"
    large = [dict(block_n=bn, batch_num_warps=w, **{stages_key: s, reg_key: r})
             for (bn, w, s), r in itertools.product(
                 ((64, 2, 2), (64, 2, 1), (32, 2, 2), (64, 4, 1)), (None, 168, 128, 96))]
    if sweep == "wide":  # more warps and wider key tiles (more loads in flight per program)
        large = [dict(block_n=bn, batch_num_warps=w, **{stages_key: s, reg_key: r})
                 for (bn, w, s), r in itertools.product(
                     ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2), (64, 8, 2), (128, 2, 2)),
                     (None, 168, 128))]
        # and the running output rescaled only in tiles where a row's max moved
        large = [dict(lazy_rescale=True)] + large + [dict(v, lazy_rescale=True) for v in large[::3]]
    print(f"\n| attention alone ({runner.kv_dtype}): batch | context | bound | variant | us | % of copy bandwidth |")
    print("|---:|---:|---:|---|---:|---:|")
    for b, c, bound in cases:
        seqs = decode_seqs(runner, b, c, True)
        _, _, meta, _ = runner.prepare(seqs)
        q = torch.randn(b, H, D, dtype=torch.bfloat16, device="cuda")
        ref = attention.paged_attention_triton(q, kv[0], kv[1], meta.block_tables, meta.seq_lens,
                                               meta.query_start_loc, D ** -0.5, 1, bound)
        best = None
        variants = [dict()] + (small if b <= 8 else large)
        if runner.kv_dtype in attention_common._FP8_DTYPES:
            variants.insert(1, dict(bf16_dots=True))
        for var in variants:
            fp8_types = attention_common._FP8_DTYPES
            if var.get("bf16_dots"):  # the FP8 path as it was: e4m3 converted to bf16 for the dots
                attention_common._FP8_DTYPES = ()
            attention.TUNING["decode"] = dict(base, **{k: v for k, v in var.items() if k != "bf16_dots"})
            try:
                out = attention.paged_attention_triton(q, kv[0], kv[1], meta.block_tables, meta.seq_lens,
                                                       meta.query_start_loc, D ** -0.5, 1, bound)
                err = (out.float() - ref.float()).abs().max().item()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(20):
                        attention.paged_attention_triton(q, kv[0], kv[1], meta.block_tables, meta.seq_lens,
                                                         meta.query_start_loc, D ** -0.5, 1, bound)
                us = triton.testing.do_bench(g.replay, warmup=5, rep=50) * 1e3 / 20
            except Exception as e:  # a variant that does not compile (e.g. out of shared memory)
                print(f"| {b} | {c} | {bound} | {var} | failed: {type(e).__name__} | |")
                continue
            finally:
                attention.TUNING["decode"] = base
                attention_common._FP8_DTYPES = fp8_types
            if err > 2e-2:
                print(f"MISMATCH {var}: max err {err}")
                sys.exit(1)
            pct = 100 * b * c * per_tok_layer / (us / 1e6) / bw
            best = min(best or (us, var), (us, var), key=lambda t: t[0])
            print(f"| {b} | {c} | {bound} | {var} | {us:.1f} | {pct:.1f}% |", flush=True)
        print(f"| {b} | {c} | {bound} | **best** {best[1]} | {best[0]:.1f} | |", flush=True)


def mixed_attention(runner, decodes: int, ctx: int, chunks: int, chunk: int) -> None:
    """One layer's attention in a mixed step (``decodes`` one-token rows at context ``ctx`` plus
    ``chunks`` fresh prompt chunks of ``chunk`` tokens), decode rows in either kernel."""
    import triton

    from kvpilot.kernels import attention

    from kvpilot.kernels import attention_common, decode_attention, fused_decode_attention, prefill_attention  # noqa: F401
    from kvpilot.runner.model_runner import ScheduledSeq

    cfg = runner.cfg
    H, D = cfg.num_attention_heads, cfg.head_dim
    kv = runner.kv_caches[0]
    seqs = decode_seqs(runner, decodes, ctx, True)
    nb = -(-chunk // runner.block_size)
    used = {b for s in seqs for b in s.block_table}
    free = [b for b in range(runner.num_blocks) if b not in used]
    for i in range(chunks):
        seqs.append(ScheduledSeq(10_000 + i, [7] * chunk, 0, free[i * nb:(i + 1) * nb], True))
    _, _, meta, _ = runner.prepare(seqs)
    q = torch.randn(decodes + chunks * chunk, H, D, dtype=torch.bfloat16, device="cuda")
    cfgp = attention.TUNING["prefill"]
    res = {}
    for on in (False, True):
        cfgp["decode_rows_to_decode_kernel"] = on
        fn = lambda: attention.paged_attention_triton(q, kv[0], kv[1], meta.block_tables, meta.seq_lens,  # noqa: E731
                                                      meta.query_start_loc, D ** -0.5, meta.max_query_len,
                                                      meta.max_seq_len)
        res[on] = (fn(), triton.testing.do_bench(fn, warmup=5, rep=100) * 1e3)
    cfgp["decode_rows_to_decode_kernel"] = True
    err = (res[True][0].float() - res[False][0].float()).abs().max().item()
    print(f"\nmixed step attention ({runner.kv_dtype}), {decodes} decodes x {ctx} + {chunks} x {chunk} prompt "
          f"tokens, one layer: decode rows in the prefill kernel {res[False][1]:.1f} us, in the decode kernel "
          f"{res[True][1]:.1f} us (max diff {err:.3g})", flush=True)
    if err > 5e-2:
        print("MISMATCH between the two paths")
        sys.exit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-dtypes", nargs="+", default=["auto", "fp8"])
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 448])
    ap.add_argument("--context", type=int, default=1280)
    ap.add_argument("--matmul-tflops", type=float, default=790.0)
    ap.add_argument("--max-seq-len", type=int, default=8192)
    ap.add_argument("--no-attention-sweep", action="store_true")
    ap.add_argument("--no-small-sweep", action="store_true", help="sweep only the large batches")
    ap.add_argument("--no-step", action="store_true", help="skip the step timing, kernel table and mixed step")
    ap.add_argument("--sweep", choices=["launch", "wide"], default="launch",
                    help="large-batch variants: around the current launch, or more warps and wider key tiles")
    args = ap.parse_args()

    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.3f} TB/s")
    for kv_dtype in args.kv_dtypes:
        t = time.perf_counter()
        runner = build_runner(32, args.max_seq_len, max(args.batches), kv_dtype=kv_dtype, free_gpu_memory_fraction=0.8)
        for cache in runner.kv_caches:
            cache.view(torch.uint8).random_(0, 64)  # finite values in any cache dtype
        cfg = runner.cfg
        embed = cfg.vocab_size * cfg.hidden_size * 2
        weights = runner.weight_bytes - embed
        per_tok = runner.bytes_per_block // runner.block_size
        print(f"\n[{kv_dtype}] runner built in {time.perf_counter() - t:.1f} s; {runner.num_blocks} blocks, "
              f"{per_tok} B/token")
        print("| batch | context | graph ms | floor ms (bytes) | floor ms (bytes + matmul FLOPs) | % of bytes+FLOPs floor |")
        print("|---:|---:|---:|---:|---:|---:|")
        for b in ([] if args.no_step else args.batches):
            seqs = decode_seqs(runner, b, args.context, True)
            ms = step_ms(runner, seqs, iters=10)
            mem = (weights + b * args.context * per_tok) / bw * 1e3
            flops = 2 * (weights / 2) * b / (args.matmul_tflops * 1e12) * 1e3
            print(f"| {b} | {args.context} | {ms:.2f} | {mem:.2f} | {mem + flops:.2f} | "
                  f"{100 * (mem + flops) / ms:.1f}% |", flush=True)
        seqs = decode_seqs(runner, args.batches[0], args.context, True)
        if not args.no_step:
            kernel_table(runner, seqs, f"[{kv_dtype}] graph replay, batch {args.batches[0]}, context {args.context}")
            mixed_attention(runner, 384, args.context, 8, 960)
        if not args.no_attention_sweep:
            attention_variants(runner, bw, args.batches, args.context, args.max_seq_len, not args.no_small_sweep,
                               args.sweep)
        del runner, seqs
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
