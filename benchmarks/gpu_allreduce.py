"""All-reduce latency on one node: NCCL against PyTorch's symmetric-memory one-shot kernel.

The one-shot kernel (``torch.ops.symm_mem.one_shot_all_reduce_copy_out``: every rank maps its peers'
buffers and one kernel copies, waits and sums) is what vLLM and TensorRT-LLM call a custom
all-reduce; this measures whether it would pay for the engine's tensor-parallel decode steps.

Two processes (one per GPU) reduce bf16 vectors of several sizes, 64 back-to-back all-reduces of
distinct tensors captured in one CUDA graph (as a decode step of 32 layers issues them), and check
every result against the exact sum. Prints microseconds per all-reduce.

    python3 benchmarks/gpu_allreduce.py [--world 2]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [4096, 16384, 65536, 262144, 1048576]  # elements: 8 KB .. 2 MB in bf16
REPS = 64


def _graph_time_us(fn, reps_inside: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    iters = 20
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters / reps_inside


def _worker(rank: int, world: int, port: int, out) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    group = dist.new_group(list(range(world)))

    dev = torch.device("cuda", rank)
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(max(SIZES), dtype=torch.bfloat16, device=dev)
    symm_mem.rendezvous(buf, group)
    rows = []
    for n in SIZES:
        # Small integers are exact in bf16, so the sum is checkable bit for bit.
        base = [torch.randint(-8, 8, (n,), device=dev, generator=torch.Generator(dev).manual_seed(i * 97 + rank))
                .to(torch.bfloat16) for i in range(REPS)]
        want = []
        for i in range(REPS):
            t = base[i].clone()
            dist.all_reduce(t, group=group)
            want.append(t)
        res = {}
        for name in ("nccl", "symm_one_shot"):
            work = [b.clone() for b in base]

            def fn(work=work, name=name):
                for i, t in enumerate(work):
                    t.copy_(base[i])
                    if name == "nccl":
                        dist.all_reduce(t, group=group)
                    else:
                        torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf[:n], t, "sum", group.group_name, t)

            us = _graph_time_us(fn, REPS)
            ok = all(torch.equal(w, x) for w, x in zip(work, want))
            res[name] = (us, ok)
        rows.append((n, res))
    if rank == 0:
        out.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    a = ap.parse_args()
    if torch.cuda.device_count() < a.world:
        sys.exit(f"needs {a.world} GPUs, found {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, a.world, port, q)) for r in range(a.world)]
    for p in procs:
        p.start()
    rows = q.get(timeout=300)
    for p in procs:
        p.join(60)
    print(f"| elements (bf16) | bytes | NCCL us (incl. a copy) | symm-mem one-shot us (incl. a copy) | results exact |")
    print("|---:|---:|---:|---:|---|")
    bad = False
    for n, res in rows:
        ok = res["nccl"][1] and res["symm_one_shot"][1]
        bad |= not ok
        print(f"| {n} | {2 * n} | {res['nccl'][0]:.1f} | {res['symm_one_shot'][0]:.1f} | {ok} |")
    if bad or any(p.exitcode for p in procs):
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    main()
