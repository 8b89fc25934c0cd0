"""Check each Triton kernel against its PyTorch reference and time it at Llama-3.1-8B shapes.

Usage (on a CUDA machine, after `pip install -e .`):

    python3 benchmarks/lab/kernels_gpu.py [--sweep] [--json PATH]

Shapes: 32 query heads, 8 kv heads, head_dim 128, KV block 32, hidden 4096, intermediate 14336,
bf16. Times are medians of `triton.testing.do_bench`. Memory-bound kernels report achieved GB/s
(bytes that must cross HBM once) against the measured device-to-device copy bandwidth; prefill
reports causal attention TFLOP/s. `--sweep` also times a few launch configurations of the
attention kernels (kvpilot.kernels.attention.TUNING). Results go into docs/kernels.md.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton.testing

import kvpilot.kernels as K
from kvpilot.kernels import attention as attn_mod

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 32
HIDDEN, INTER = 4096, 14336
DT = torch.bfloat16
BYTES = 2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / (1 + |ref|): one bf16 rounding (2**-8 relative) stays below 0.004."""
    out, ref = out.float(), ref.float()
    return ((out - ref).abs() / (1 + ref.abs())).max().item()


def bench(fn, rep: int = 100) -> float:
    """Median milliseconds over about ``rep`` ms of repetitions."""
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def copy_bandwidth_gbs() -> float:
    n = 1 << 30  # 2 GiB of bf16
    a = torch.empty(n, dtype=DT, device="cuda")
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    return 2 * n * BYTES / ms / 1e6


def paged_batch(q_lens, ctx_lens, seed=0):
    """Random paged batch: KV blocks shuffled, block tables padded with -1."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    nblocks = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(nblocks) + 1
    perm = torch.randperm(num_blocks, device="cuda", generator=g).int()
    bt = torch.full((len(q_lens), max(nblocks)), -1, dtype=torch.int32, device="cuda")
    offs = torch.tensor([0] + nblocks, device="cuda").cumsum(0)
    for i, n in enumerate(nblocks):
        bt[i, :n] = perm[offs[i] : offs[i] + n]
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    kc = torch.randn(shape, device="cuda", generator=g, dtype=DT)
    vc = torch.randn(shape, device="cuda", generator=g, dtype=DT)
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, device="cuda", generator=g, dtype=DT)
    qsl = torch.tensor([0] + q_lens, device="cuda").cumsum(0).int()
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return (q, kc, vc, bt, sl, qsl, HEAD_DIM**-0.5, max(q_lens), max(seq_lens)), seq_lens


def attention_case(name, q_lens, ctx_lens, copy_gbs, rows, check=True):
    args, seq_lens = paged_batch(q_lens, ctx_lens)
    out = K.paged_attention_triton(*args)
    err = rel_err(out, K.paged_attention_ref(*args)) if check else float("nan")
    ms = bench(lambda: K.paged_attention_triton(*args))
    kv_bytes = sum(seq_lens) * KV_HEADS * HEAD_DIM * 2 * BYTES
    io_bytes = 2 * sum(q_lens) * HEADS * HEAD_DIM * BYTES
    gbs = (kv_bytes + io_bytes) / ms / 1e6
    flops = sum(
        4 * HEADS * HEAD_DIM * sum(c + j + 1 for j in range(q)) for q, c in zip(q_lens, ctx_lens)
    )
    rows.append(
        dict(kernel="paged_attention", case=name, ms=ms, gbs=gbs, pct_copy=100 * gbs / copy_gbs,
             tflops=flops / ms / 1e9, max_rel_err=err)  # fmt: skip
    )


def attention_sweep(copy_gbs, full: bool = True):
    """Time launch configurations of the decode and prefill kernels; print the best first."""
    results = []
    base = {k: dict(v) for k, v in attn_mod.TUNING.items()}
    split_cases = [("64x4096", [1] * 64, [4095] * 64), ("256x1024", [1] * 256, [1023] * 256),
                   ("8x32768", [1] * 8, [32767] * 8), ("1x131072", [1], [131071])]  # fmt: skip
    print("\nsweep of decode programs_per_sm, always splitting (ms, GB/s per case):")
    for pps in (1, 2, 4, 8, 16):
        attn_mod.TUNING["decode"] = dict(base["decode"], programs_per_sm=pps, no_split_per_sm=0)
        cells = []
        for name, ql, cl in split_cases:
            args, lens = paged_batch(ql, cl)
            t = bench(lambda: K.paged_attention_triton(*args), rep=40)
            cells.append(f"{name}: {t:.4f} ms {sum(lens) * KV_HEADS * HEAD_DIM * 2 * BYTES / t / 1e6:.0f} GB/s")
        print(f"  programs_per_sm={pps}: " + " | ".join(cells))
    attn_mod.TUNING["decode"] = base["decode"]
    if not full:
        return results
    decode_args, decode_lens = paged_batch([1] * 64, [4096] * 64)
    long_args, long_lens = paged_batch([1] * 4, [32768] * 4)
    prefill_args, _ = paged_batch([2048], [0])
    decode_cfgs = [(64, 4, 2), (64, 4, 3), (32, 4, 2), (128, 4, 2), (128, 8, 2), (64, 2, 2), (64, 8, 3), (32, 2, 3)]
    for block_n, warps, stages in decode_cfgs:
        attn_mod.TUNING["decode"] = dict(base["decode"], block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            t1 = bench(lambda: K.paged_attention_triton(*decode_args), rep=40)
            t2 = bench(lambda: K.paged_attention_triton(*long_args), rep=40)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
            print(f"decode {block_n=} {warps=} {stages=}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        results.append(("decode", block_n, warps, stages, t1, t2))
    attn_mod.TUNING["decode"] = base["decode"]
    prefill_cfgs = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 8, 2)]
    for block_m, block_n, warps, stages in prefill_cfgs:
        attn_mod.TUNING["prefill"] = dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            t = bench(lambda: K.paged_attention_triton(*prefill_args), rep=40)
        except Exception as e:  # noqa: BLE001
            print(f"prefill {block_m=} {block_n=} {warps=} {stages=}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        results.append(("prefill", (block_m, block_n), warps, stages, t, 0.0))
    attn_mod.TUNING["prefill"] = base["prefill"]
    kvb = lambda lens: sum(lens) * KV_HEADS * HEAD_DIM * 2 * BYTES  # noqa: E731
    print("\nsweep (decode: 64x4096 ms, GB/s | 4x32768 ms, GB/s; prefill 2048: ms)")
    for r in sorted(results, key=lambda r: (r[0], r[4] + r[5])):
        if r[0] == "decode":
            print(f"  decode block_n={r[1]} warps={r[2]} stages={r[3]}: "
                  f"{r[4]:.4f} ms {kvb(decode_lens) / r[4] / 1e6:.0f} GB/s | "
                  f"{r[5]:.4f} ms {kvb(long_lens) / r[5] / 1e6:.0f} GB/s")  # fmt: skip
        else:
            print(f"  prefill block_m,n={r[1]} warps={r[2]} stages={r[3]}: {r[4]:.4f} ms")
    return results


def pointwise_cases(copy_gbs, rows):
    t = 4096
    x = torch.randn(t, HIDDEN, device="cuda", dtype=DT)
    r = torch.randn_like(x)
    w = torch.randn(HIDDEN, device="cuda", dtype=DT)

    def add(kernel, case, ms, nbytes, err):
        gbs = nbytes / ms / 1e6
        rows.append(dict(kernel=kernel, case=case, ms=ms, gbs=gbs, pct_copy=100 * gbs / copy_gbs,
                         tflops=float("nan"), max_rel_err=err))  # fmt: skip

    y, h = K.rms_norm_triton(x, w, 1e-5, r)
    yr, hr = K.rms_norm_ref(x, w, 1e-5, r)
    err = max(rel_err(y, yr), rel_err(h, hr))
    add("rms_norm+residual", f"{t}x{HIDDEN}", bench(lambda: K.rms_norm_triton(x, w, 1e-5, r)),
        4 * t * HIDDEN * BYTES, err)  # fmt: skip

    gu = torch.randn(t, 2 * INTER, device="cuda", dtype=DT)
    err = rel_err(K.silu_and_mul_triton(gu), K.silu_and_mul_ref(gu))
    add("silu_and_mul", f"{t}x{2 * INTER}", bench(lambda: K.silu_and_mul_triton(gu)),
        3 * t * INTER * BYTES, err)  # fmt: skip

    cache = K.build_rope_cache(HEAD_DIM, 131072, 500000.0, {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, device="cuda")  # fmt: skip
    q = torch.randn(t, HEADS, HEAD_DIM, device="cuda", dtype=DT)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, device="cuda", dtype=DT)
    pos = torch.randint(0, 131072, (t,), device="cuda")
    rq, rk = K.apply_rotary_ref(q, k, pos, cache)
    oq, ok = K.apply_rotary_triton(q.clone(), k.clone(), pos, cache)
    err = max(rel_err(oq, rq), rel_err(ok, rk))
    add("apply_rotary", f"{t} tok", bench(lambda: K.apply_rotary_triton(q, k, pos, cache)),
        2 * t * (HEADS + KV_HEADS) * HEAD_DIM * BYTES + t * HEAD_DIM * 4, err)  # fmt: skip

    num_blocks = 4096
    kc = torch.zeros(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=DT)
    vc = torch.zeros_like(kc)
    kr, vr = kc.clone(), vc.clone()
    kk = torch.randn(t, KV_HEADS, HEAD_DIM, device="cuda", dtype=DT)
    vv = torch.randn_like(kk)
    slots = torch.randperm(num_blocks * BLOCK, device="cuda")[:t]
    K.write_kv_cache_ref(kk, vv, kr, vr, slots)
    K.write_kv_cache_triton(kk, vv, kc, vc, slots)
    err = 0.0 if torch.equal(kc, kr) and torch.equal(vc, vr) else float("inf")
    add("write_kv_cache", f"{t} tok", bench(lambda: K.write_kv_cache_triton(kk, vv, kc, vc, slots)),
        4 * t * KV_HEADS * HEAD_DIM * BYTES, err)  # fmt: skip

    # Fused rotary + KV write on views of one QKV output (what the decode layer runs).
    qkv = torch.randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=DT)
    views = lambda x: (  # noqa: E731
        x[:, : HEADS * HEAD_DIM].view(t, HEADS, HEAD_DIM),
        x[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(t, KV_HEADS, HEAD_DIM),
        x[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(t, KV_HEADS, HEAD_DIM),
    )
    for c in (kr, vr, kc, vc):
        c.zero_()
    q_ref = K.rotary_write_kv_cache_ref(*views(qkv.clone()), pos, cache, kr, vr, slots)
    qf, kf, vf = views(qkv.clone())
    q_out = K.rotary_write_kv_cache_triton(qf, kf, vf, pos, cache, kc, vc, slots)
    err = max(rel_err(q_out, q_ref), rel_err(kc, kr), 0.0 if torch.equal(vc, vr) else float("inf"))
    qf, kf, vf = views(qkv)
    add("rotary_write_kv_cache", f"{t} tok", bench(
        lambda: K.rotary_write_kv_cache_triton(qf, kf, vf, pos, cache, kc, vc, slots)),
        2 * t * HEADS * HEAD_DIM * BYTES + 4 * t * KV_HEADS * HEAD_DIM * BYTES + t * HEAD_DIM * 4, err)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="also sweep attention launch configs")
    ap.add_argument("--sweep-splits", action="store_true", help="only sweep decode programs_per_sm")
    ap.add_argument("--json", help="write the result rows here")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"GPU: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
          f"triton {triton.__version__}; device copy bandwidth {copy_gbs:.0f} GB/s")  # fmt: skip
    print(f"attention TUNING: {attn_mod.TUNING}")
    rows: list[dict] = []
    attention_case("decode 64 x 4096", [1] * 64, [4095] * 64, copy_gbs, rows)
    attention_case("decode 256 x 1024", [1] * 256, [1023] * 256, copy_gbs, rows)
    attention_case("decode 8 x 32768 (split-K)", [1] * 8, [32767] * 8, copy_gbs, rows)
    attention_case("decode 1 x 131072 (split-K)", [1], [131071], copy_gbs, rows)
    attention_case("prefill 1 x 2048", [2048], [0], copy_gbs, rows)
    attention_case("prefill chunk 512 on 3584 cached", [512], [3584], copy_gbs, rows)
    attention_case("mixed 1x512 chunk + 63 decodes @2048", [512] + [1] * 63, [0] + [2047] * 63, copy_gbs, rows)
    pointwise_cases(copy_gbs, rows)

    print("\n| kernel | case | median ms | GB/s | % of copy BW | TFLOP/s | max err vs ref, abs/(1+abs(ref)) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kernel']} | {r['case']} | {r['ms']:.4f} | {r['gbs']:.0f} | {r['pct_copy']:.0f}% | "
              f"{r['tflops']:.1f} | {r['max_rel_err']:.3g} |")  # fmt: skip
    if a.sweep or a.sweep_splits:
        attention_sweep(copy_gbs, full=a.sweep)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": props.name, "copy_gbs": copy_gbs, "rows": rows}, f, indent=1)
    bad = [r for r in rows if not r["max_rel_err"] < 0.02]
    if bad:
        print(f"MISMATCH vs reference: {[(r['kernel'], r['case']) for r in bad]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
