"""The model runner's host work per decode step at large batch, on a GPU: persistent block tables
(`HostBlockTables`) against rewriting every table every step, with a correctness check.

Builds a `ModelRunner` of Llama-3.1-8B's shape (``--layers`` of them, random bf16 weights drawn on
the GPU, no checkpoint) with the H200 offline run's settings (max_batch_size 512, max_seq_len
33,024, CUDA graphs), then for ``--batch`` decodes of ~1,500-token contexts (47 blocks each,
scattered over the pool) over ``--steps`` decode steps (tables grow in place; now and then one is
replaced, as after a preemption):

1. check: every step's graph inputs (ids, positions, slots, lengths, query offsets, block tables:
   what the replay reads) equal those of the code before (`_old_prepare`: each table copied into
   its row every step), and the graph's logits from the persistent
   tables equal those from fresh copies of every table (bitwise) and the eager path's (bf16
   tolerance). Any mismatch prints it and the script exits 1;
2. host time of `DecodeGraphs.prepare` (the graph step's host work before the copy and replay) and
   of the eager `ModelRunner._prepare` for a mixed step (the decodes plus a 1,000-token prefill
   chunk): persistent tables vs the code before them (`_old_prepare`, kept here as the reference)
   and vs fresh lists (every row rewritten through the new path);
3. the wall time of a whole decode step (``runner.execute`` + the sampler's argmax read-back)
   with persistent tables and with fresh copies.

    python3 benchmarks/lab/gpu_host_overhead.py [--layers 2] [--batch 1 64 256 448] [--steps 40]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_decode_profile import build_runner  # noqa: E402


def _old_prepare(g, seqs) -> tuple[int, int]:
    """`DecodeGraphs.prepare` as it was before `HostBlockTables` (the host part of the old ``run``):
    every block table copied into its row every step. The reference of the check and of the times."""
    r = g.runner
    n = len(seqs)
    mb, B, W = g._mb, r.block_size, g.width
    o_qsl, o_tab = g._o_qsl, g._o_tab
    h64, h32 = g._h64, g._h32
    g._copied.synchronize()
    ids = h64[:n]
    pos = h64[mb:mb + n]
    ids[:] = [s.token_ids[0] for s in seqs]
    pos[:] = [s.start_pos for s in seqs]
    max_ctx = int(pos.max()) + 1
    tables = h32[o_tab:o_tab + n * W].reshape(n, W)
    for i, s in enumerate(seqs):
        bt = s.block_table
        tables[i, :len(bt)] = bt
    b, ctx = g._pick(n, max_ctx)
    rows = np.arange(n)
    h64[2 * mb:2 * mb + n] = tables[rows, pos // B].astype(np.int64) * B + pos % B
    h32[:n] = pos + 1
    qsl = h32[o_qsl:o_qsl + mb + 1]
    qsl[:n + 1] = np.arange(n + 1)
    if b > n:
        h64[2 * mb + n:2 * mb + b] = -1
        h64[n:b] = 0
        h64[mb + n:mb + b] = 0
        h32[n:b] = 0
        qsl[n + 1:b + 1] = n
    return b, ctx


class _Workload:
    """``n`` decodes with ~1,500-token contexts over scattered blocks; `advance` is one decode step."""

    def __init__(self, runner, n: int, seed: int = 0) -> None:
        self.B = runner.block_size
        self.rng = random.Random(seed)
        self.free = list(range(runner.num_blocks))
        self.rng.shuffle(self.free)
        self.lens = [self.rng.randrange(1_440, 1_530) for _ in range(n)]
        self.tabs = [[self.free.pop() for _ in range(-(-(ln + 1) // self.B))] for ln in self.lens]

    def seqs(self, fresh: bool = False, id_base: int = 0):
        from kvpilot.runner.model_runner import ScheduledSeq

        return [ScheduledSeq(id_base + i, [5 + i % 100], ln, list(t) if fresh else t, True)
                for i, (ln, t) in enumerate(zip(self.lens, self.tabs))]

    def advance(self, replace: bool = False) -> None:
        for i in range(len(self.lens)):
            self.lens[i] += 1
            if self.lens[i] + 1 > len(self.tabs[i]) * self.B:
                self.tabs[i].append(self.free.pop())  # in place, as KVCacheManager.allocate does
        if replace:  # a preemption: the sequence comes back with a new list of other blocks
            i = self.rng.randrange(len(self.lens))
            self.free[:0] = self.tabs[i]
            self.tabs[i] = [self.free.pop() for _ in range(len(self.tabs[i]))]


def _host_buffers(g, b: int, width: int) -> dict[str, np.ndarray]:
    """The parts of the graph's host buffers a replay of padded batch ``b`` reads."""
    mb = g._mb
    return {"ids": g._h64[:b].copy(), "pos": g._h64[mb:mb + b].copy(), "slots": g._h64[2 * mb:2 * mb + b].copy(),
            "seq_lens": g._h32[:b].copy(), "qsl": g._h32[g._o_qsl:g._o_qsl + b + 1].copy(),
            "tables": g._h_tables[:b, :width].copy()}


def check(runner, n: int, steps: int) -> list[str]:
    """Part 1; returns the mismatches found."""
    g = runner.graphs
    w = _Workload(runner, n, seed=1)
    bad: list[str] = []
    for step in range(steps):
        seqs = w.seqs()
        width = max(len(s.block_table) for s in seqs)
        g._h_tables[:n] = 0
        key_old = _old_prepare(g, seqs)
        old = _host_buffers(g, key_old[0], width)
        key_new = g.prepare(seqs)
        new = _host_buffers(g, key_new[0], width)
        diff = [k for k in old if not np.array_equal(old[k], new[k])]
        if key_old != key_new or diff:
            bad.append(f"step {step}: graph {key_new} vs {key_old}; host buffers that differ from the old code's: {diff}")
        got = runner.execute(seqs)[0].clone()
        ref = runner.execute(w.seqs(fresh=True, id_base=100_000))[0].clone()
        if not torch.equal(got, ref):
            bad.append(f"step {step}: graph logits with persistent tables != with fresh tables "
                       f"(max abs diff {(got - ref).abs().max().item():.3g})")
        if step % 8 == 0:
            saved, runner.graphs = runner.graphs, None
            eager = runner.execute(w.seqs(fresh=True, id_base=200_000))[0]
            runner.graphs = saved
            err = ((got - eager).norm() / eager.norm()).item()
            agree = (got.argmax(-1) == eager.argmax(-1)).float().mean().item()
            if err > 2e-2:
                bad.append(f"step {step}: graph vs eager relative error {err:.3g} (argmax agreement {agree:.3f})")
        w.advance(replace=step % 7 == 6)
        if len(bad) > 5:
            break
    return bad


def _time(fn, iters: int) -> float:
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def host_times(runner, n: int, iters: int = 64) -> dict[str, float]:
    """Part 2, microseconds per call."""
    g = runner.graphs
    w = _Workload(runner, n, seed=2)
    plans = []
    for k in range(iters):  # the decode steps a run would see, built beforehand (not timed)
        plans.append((w.seqs(id_base=300_000), w.seqs(fresh=True, id_base=400_000)))
        w.advance(replace=k % 16 == 15)
    out = {}
    it = iter(range(iters))
    g.prepare(plans[0][0])
    out["graph prepare, persistent"] = _time(lambda: g.prepare(plans[next(it)][0]), iters - 1) * 1e6
    it = iter(range(iters))
    out["graph prepare, old code"] = _time(lambda: _old_prepare(g, plans[next(it)][0]), iters) * 1e6
    it = iter(range(iters))
    out["graph prepare, fresh lists"] = _time(lambda: g.prepare(plans[next(it)][1]), iters) * 1e6
    from kvpilot.runner.model_runner import ScheduledSeq

    chunk = ScheduledSeq(999_999, list(range(10, 1010)), 0, list(range(64)), True)
    mixed = [p[0] + [chunk] for p in plans]
    runner._prepare(mixed[0])
    it = iter(range(iters))
    out["eager _prepare (+1,000-token chunk), persistent"] = _time(lambda: runner._prepare(mixed[next(it)]), iters - 1) * 1e6
    mixed_fresh = [p[1] + [ScheduledSeq(chunk.seq_id + 1, chunk.token_ids, 0, list(chunk.block_table), True)]
                   for p in plans]
    it = iter(range(iters))
    out["eager _prepare (+1,000-token chunk), fresh lists"] = _time(lambda: runner._prepare(mixed_fresh[next(it)]), iters) * 1e6
    torch.cuda.synchronize()
    return out


def step_times(runner, n: int, iters: int = 30) -> dict[str, float]:
    """Part 3, milliseconds per decode step (execute + argmax read-back)."""
    w = _Workload(runner, n, seed=3)
    out = {}
    for label, fresh in (("persistent", False), ("fresh lists", True)):
        plans = []
        for k in range(iters + 3):
            plans.append(w.seqs(fresh=fresh, id_base=500_000 if not fresh else 600_000))
            w.advance(replace=k % 16 == 15)
        for p in plans[:3]:
            runner.execute(p)[0].argmax(-1).tolist()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for p in plans[3:]:
            runner.execute(p)[0].argmax(-1).tolist()
        out[label] = (time.perf_counter() - t) / iters * 1e3
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256, 448])
    ap.add_argument("--steps", type=int, default=40, help="decode steps of the check")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    t = time.perf_counter()
    runner = build_runner(args.layers, 33024, max_batch_size=512)
    if runner.graphs is None:
        print("decode CUDA graphs were not captured", file=sys.stderr)
        return 1
    need = max(args.batch) * 52 + 100
    if runner.num_blocks < need:
        print(f"the KV pool has {runner.num_blocks} blocks, the workload needs {need}: use fewer --layers",
              file=sys.stderr)
        return 2
    for cache in runner.kv_caches:
        cache.normal_()
    print(f"{torch.cuda.get_device_name()}: runner of {args.layers} layers, {runner.num_blocks} blocks, "
          f"{len(runner.graphs.graphs)} decode graphs, built in {time.perf_counter() - t:.1f} s")

    bad = check(runner, max(args.batch), args.steps)
    print(f"check ({max(args.batch)} decodes x {args.steps} steps): {'OK' if not bad else 'MISMATCH'}")
    for b in bad:
        print("  " + b)

    print("\n| batch | " + " | ".join(host_times(runner, 1, 4)) + " |")  # header (and a warm-up)
    print("|---:|" + "---:|" * 5)
    for n in args.batch:
        h = host_times(runner, n)
        print(f"| {n} | " + " | ".join(f"{v:.1f} us" for v in h.values()) + " |")

    print("\n| batch | decode step, persistent tables | decode step, fresh lists |")
    print("|---:|---:|---:|")
    for n in args.batch:
        s = step_times(runner, n)
        print(f"| {n} | {s['persistent']:.3f} ms | {s['fresh lists']:.3f} ms |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
