"""`CustomAllReduce.create`'s agreement steps (engine/parallel/custom_all_reduce.py) on two GPUs, with
NCCL and PyTorch's real symmetric memory.

Two processes, one GPU each:

1. Both ranks get buffers, with no NVLink multicast mapping (the engine turns multicast off itself);
   one-shot sums of 1, 64 and the default 256 tokens of a 4096-wide bf16 tensor equal NCCL's bit for bit
   on both ranks, and 257 tokens are not taken.
2. ``Tuning.tp_custom_allreduce`` False on one rank only: both ranks keep NCCL, and the next NCCL
   all-reduce still pairs up (no rank waits in a collective its peer never makes).
3. No peer access reported on one rank (as between MIG instances or PCIe GPUs without P2P; faked
   here): both ranks keep NCCL, and the next all-reduce pairs up.

Skipped without two CUDA GPUs. CPU counterpart: test_custom_all_reduce_create.py."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

HIDDEN, SITES = 4096, 4


def _next_all_reduce(rank: int, group, dev) -> int:
    t = torch.tensor([rank + 1], dtype=torch.int64, device=dev)
    dist.all_reduce(t, group=group)
    return int(t.item())


def _rank(rank: int, port: int, q) -> None:
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"  # this workplace's rule, whatever the engine does
    from kvpilot.parallel.custom_all_reduce import CustomAllReduce

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=dev)
    group = dist.new_group([0, 1])
    report = {"mismatch": []}
    # 1. success
    car = CustomAllReduce.create(group, rank, 2, dev, SITES, HIDDEN)
    report["created"] = car is not None
    if car is not None:
        report["multicast_ptr"] = int(getattr(car._handle, "multicast_ptr", 0))
        report["site_numel"] = car.site_numel
        g = torch.Generator(device=dev).manual_seed(rank)
        for tokens in (1, 64, 256):
            for site in range(SITES):
                x = torch.randn(tokens, HIDDEN, generator=g, device=dev).to(torch.bfloat16)
                want = x.clone()
                dist.all_reduce(want, group=group)
                if not car.fits(x, site):
                    report["mismatch"].append(("not taken", tokens, site))
                    continue
                car.all_reduce(x, site)
                if not torch.equal(x, want):
                    report["mismatch"].append((tokens, site))
        report["takes_257"] = car.fits(torch.empty(257, HIDDEN, device=dev, dtype=torch.bfloat16), 0)
    torch.cuda.synchronize()
    # 2. switched off on rank 1 only
    report["off_on_one"] = CustomAllReduce.create(group, rank, 2, dev, SITES, HIDDEN, enabled=rank != 1) is None
    report["after_off_on_one"] = _next_all_reduce(rank, group, dev)
    # 3. no peer access reported on rank 0
    real = torch.cuda.can_device_access_peer
    report["peer_access"] = bool(real(rank, 1 - rank))
    if rank == 0:
        torch.cuda.can_device_access_peer = lambda a, b: False
    report["no_peer"] = CustomAllReduce.create(group, rank, 2, dev, SITES, HIDDEN) is None
    torch.cuda.can_device_access_peer = real
    report["after_no_peer"] = _next_all_reduce(rank, group, dev)
    q.put((rank, report))
    dist.barrier()
    dist.destroy_process_group()


def test_create_agreement_on_two_gpus():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        reports = dict(q.get(timeout=240) for _ in range(2))
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    for rank in (0, 1):
        r = reports[rank]
        assert r["peer_access"], r  # the two GPUs of the test machine reach each other
        assert r["created"] and r["multicast_ptr"] == 0, r
        assert r["site_numel"] == 256 * HIDDEN and not r["takes_257"], r
        assert r["mismatch"] == [], r
        assert r["off_on_one"] and r["after_off_on_one"] == 3, r
        assert r["no_peer"] and r["after_no_peer"] == 3, r
