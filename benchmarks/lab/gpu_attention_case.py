"""One large-batch decode attention case on synthetic paged caches, for Nsight Compute.

Builds a KV cache of Llama-3.1-8B's per-layer shape (8 kv heads x 128 dims, 32 query heads,
``--block-size``-token blocks (16), scattered at random) in ``--kv-dtype`` (bf16 or fp8), ``--batch`` decodes of
``--context`` keys each, checks the Triton kernel against the PyTorch reference once, then calls it
``--calls`` times. Meant to run under ``ncu`` to see what limits the decode kernel:

    ncu --kernel-name _decode_kernel --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis python3 benchmarks/lab/gpu_attention_case.py --kv-dtype fp8

Without ``ncu`` it prints the kernel's time (CUDA events, mean of ``--calls``) and % of the copy
bandwidth.
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="fp8")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1280)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=16, help="tokens per cache page (the engine's default: 32)")
    args = ap.parse_args()

    from kvpilot.kernels import attention
    from kvpilot.kernels.reference import paged_attention_ref

    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: TRITON_INTERPRET=1 dry run
    H, KVH, D, BS = 32, 8, 128, args.block_size
    per_seq = -(-args.context // BS)
    num_blocks = args.batch * per_seq + 16
    dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16
    kv = (torch.randn(2, num_blocks, BS, KVH, D, device=dev) * 0.5).to(dtype)
    perm = torch.randperm(num_blocks, device=dev)[: args.batch * per_seq]
    tables = perm.view(args.batch, per_seq).to(torch.int32)
    seq_lens = torch.full((args.batch,), args.context, dtype=torch.int32, device=dev)
    qsl = torch.arange(args.batch + 1, dtype=torch.int32, device=dev)
    q = torch.randn(args.batch, H, D, dtype=torch.bfloat16, device=dev)
    scale = D ** -0.5

    def call():
        return attention.paged_attention_triton(q, kv[0], kv[1], tables, seq_lens, qsl, scale, 1, args.context)

    out = call()
    ref = paged_attention_ref(q[:8].float(), kv[0].float(), kv[1].float(), tables[:8], seq_lens[:8], qsl[:9],
                              scale, 1, args.context)
    err = (out[:8].float() - ref).abs().max().item()
    print(f"max |triton - reference| over 8 sequences: {err:.3g}")
    if err > 5e-2:
        raise SystemExit("MISMATCH")
    if dev == "cpu":
        return
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(args.calls):
        call()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / args.calls
    nbytes = 2 * args.batch * args.context * KVH * D * kv.element_size()
    print(f"{args.kv_dtype} decode attention, {args.batch} x {args.context}: {us:.1f} us per call, "
          f"{nbytes / us / 1e3:.0f} GB/s of KV read")


if __name__ == "__main__":
    main()
