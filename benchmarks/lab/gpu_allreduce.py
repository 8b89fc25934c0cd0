"""All-reduce latency on one node: NCCL, PyTorch's symmetric-memory one-shot kernel, and kvpilot's
two-rank one-shot kernel (kernels/allreduce.py, the engine's default at TP 2 for small tensors).

The one-shot kernels (every rank maps its peers' buffers and one kernel exchanges and sums) are what
vLLM and TensorRT-LLM call a custom all-reduce; this measures what they save in the engine's
tensor-parallel decode steps.

Two processes (one per GPU) reduce bf16 vectors of several sizes, 64 back-to-back all-reduces of
distinct tensors captured in one CUDA graph (as a decode step of 32 layers issues them), each after a
copy in; ``kvpilot`` runs its kernel at 64 distinct call sites, as the engine does. Every result is
checked against the exact sum. Prints microseconds per all-reduce (copy included; the copy alone is
its own column).

    python3 benchmarks/lab/gpu_allreduce.py [--world 2] [--block-sweep]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [4096, 16384, 65536, 131072, 262144, 524288, 1048576]  # Llama-8B tokens 1..256: 8 KB .. 2 MB bf16
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


def _worker(rank: int, world: int, port: int, out, sweep: bool = False) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    group = dist.new_group(list(range(world)))

    dev = torch.device("cuda", rank)
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(max(SIZES), dtype=torch.bfloat16, device=dev)
    symm_mem.rendezvous(buf, group)
    from kvpilot.parallel.custom_all_reduce import CustomAllReduce

    car = (CustomAllReduce.create(group, rank, world, dev, REPS, 4096, max_tokens=max(SIZES) // 4096)
           if world == 2 else None)
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
        for name in ("copy", "nccl", "symm_one_shot", "kvpilot"):
            if name == "kvpilot" and car is None:
                continue
            work = [b.clone() for b in base]

            def fn(work=work, name=name):
                for i, t in enumerate(work):
                    t.copy_(base[i])
                    if name == "nccl":
                        dist.all_reduce(t, group=group)
                    elif name == "symm_one_shot":
                        torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf[:n], t, "sum", group.group_name, t)
                    elif name == "kvpilot":
                        car.all_reduce(t, i)

            us = _graph_time_us(fn, REPS)
            ok = name == "copy" or all(torch.equal(w, x) for w, x in zip(work, want))
            res[name] = (us, ok)
        rows.append((n, res))
    sweep_rows = []
    if sweep and car is not None:
        # programs of BLOCK elements each (kernels/allreduce.py): fewer, larger blocks or more, smaller ones
        from kvpilot.kernels import allreduce as A

        default_block = A.BLOCK
        for n in (4096, 65536, 262144):
            base = [torch.randint(-8, 8, (n,), device=dev, generator=torch.Generator(dev).manual_seed(i + rank))
                    .to(torch.bfloat16) for i in range(REPS)]
            work = [b.clone() for b in base]
            for block in (256, 512, 1024, 2048, 4096):
                A.BLOCK = block

                def fn(work=work, base=base):
                    for i, t in enumerate(work):
                        t.copy_(base[i])
                        car.all_reduce(t, i)

                sweep_rows.append((n, block, _graph_time_us(fn, REPS)))
        A.BLOCK = default_block
    if rank == 0:
        out.put((rows, sweep_rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--block-sweep", action="store_true", help="also time kvpilot's kernel at several block sizes")
    a = ap.parse_args()
    if torch.cuda.device_count() < a.world:
        sys.exit(f"needs {a.world} GPUs, found {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, a.world, port, q, a.block_sweep)) for r in range(a.world)]
    for p in procs:
        p.start()
    rows, sweep_rows = q.get(timeout=300)
    for p in procs:
        p.join(60)
    names = ["nccl", "symm_one_shot", "kvpilot"]
    print("| elements (bf16) | bytes | copy alone us | NCCL us | symm-mem one-shot us | kvpilot one-shot us "
          "| results exact |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    bad = False
    for n, res in rows:
        ok = all(res[k][1] for k in names if k in res)
        bad |= not ok
        cells = " | ".join(f"{res[k][0]:.1f}" if k in res else "n/a" for k in ["copy"] + names)
        print(f"| {n} | {2 * n} | {cells} | {ok} |")
    if sweep_rows:
        print("\n| elements | elements per program | kvpilot one-shot us (incl. a copy) |\n|---:|---:|---:|")
        for n, block, us in sweep_rows:
            print(f"| {n} | {block} | {us:.1f} |")
    if bad or any(p.exitcode for p in procs):
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    main()
