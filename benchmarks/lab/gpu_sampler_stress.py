"""Stress the Triton sampler's pivot path on a GPU with random garbage in its scratch memory.

The pivot path's scratch buffers are uninitialised (`kernels/sampling.py`, `_carve`): whatever a
kernel reads before a pass writes it must never feed an address. Before each call this script fills
the caching allocator's free blocks (small and large pools) with random 32-bit words, so a read of
unwritten scratch that reaches an address shows up as an illegal memory access (or, with
``--check``, as a clamped, recorded index that `draw` raises on: `Tuning.sampling_check`). Each call's
tokens are compared with ``Sampler("torch")`` (the PyTorch candidate path, same noise).

    python3 benchmarks/lab/gpu_sampler_stress.py --calls 400          # exits 1 on a mismatch
    python3 benchmarks/lab/gpu_sampler_stress.py --calls 400 --check

Scenarios (batch 256 x 128,256 float32 by default): top-p 0.9 / 0.3 / 0.05, min-p 0.05, top-p +
min-p, and a mix with top-k rows (window path) beside pivot rows; flat (std 1), LLM-like (std 1.3)
and peaked (std 4) logits; CONFIG variants: generation caps 1-4, M-pass blocks 512/1024, fused or
not.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch


def _junk(dev: torch.device, rng: torch.Generator) -> None:
    """Fill freed device memory of both allocator pools with random words, then free it again."""
    keep = []
    if dev.type != "cuda":
        return
    for n in (1 << 10, 1 << 14, 1 << 17, 1 << 19):  # small-pool blocks (< 1 MB) ...
        keep += [torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), dtype=torch.int32, device=dev, generator=rng)
                 for _ in range(8)]
    keep.append(torch.randint(-2 ** 31, 2 ** 31 - 1, (64 << 20,), dtype=torch.int32, device=dev,
                              generator=rng))  # ... and a large one
    del keep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1")
    ap.add_argument("--check", action="store_true", help="the pivot kernels' index checks (draw(check=True))")
    args = ap.parse_args()
    from kvpilot.kernels import sampling as ks
    from kvpilot.sampling.sampler import Sampler, SamplingRow

    dev = torch.device(args.device)
    rng = torch.Generator(device=dev).manual_seed(args.seed)
    pick = random.Random(args.seed)
    base = torch.randn(args.batch, args.vocab, device=dev, generator=rng)
    dists = {"flat": base, "llama": base * 1.3, "peaked": base * 4}
    kinds = {
        "top_p": dict(top_p=0.9), "top_p_low": dict(top_p=0.3), "top_p_tiny": dict(top_p=0.05),
        "min_p": dict(min_p=0.05), "top_p_min_p": dict(top_p=0.9, min_p=0.05), "mix": None,
    }
    fast, ref = Sampler("triton", check=args.check), Sampler("torch")
    default = dict(ks.CONFIG)
    bad = calls = 0
    t0 = time.perf_counter()
    seen = set()
    for c in range(args.calls):
        kind = pick.choice(list(kinds))
        dist = pick.choice(list(dists))
        cfg = dict(pivot_rounds=pick.choice([1, 2, 3, 4, 4, 4]), pivot_block=pick.choice([512, 1024]),
                   pivot_fuse=pick.choice([0, 0, 1]))
        rows = []
        for i in range(args.batch):
            r = SamplingRow(temperature=0.8, seed=pick.randrange(2 ** 62), step=pick.randrange(10 ** 6))
            spec = kinds[kind] or [dict(top_p=0.9), dict(top_k=50), dict(top_p=0.3, min_p=0.02),
                                   dict(top_k=20, top_p=0.8), dict()][i % 5]
            for k, v in spec.items():
                setattr(r, k, v)
            rows.append(r)
        ks.CONFIG.clear()
        ks.CONFIG.update(default, **cfg)
        _junk(dev, rng)
        try:
            got = fast(dists[dist], rows).token_ids
        finally:
            ks.CONFIG.clear()
            ks.CONFIG.update(default)
        want = ref(dists[dist], rows).token_ids
        calls += 1
        diff = sum(a != b for a, b in zip(got, want))
        key = (kind, dist, tuple(sorted(cfg.items())))
        if diff or key not in seen:
            print(f"call {c}: {kind:12s} {dist:7s} {cfg} -> {'ok' if not diff else f'MISMATCH {diff} rows'}",
                  flush=True)
        seen.add(key)
        bad += diff > 0
    print(f"{calls} calls, {len(seen)} distinct scenarios, {bad} with mismatches, "
          f"{time.perf_counter() - t0:.1f} s")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
