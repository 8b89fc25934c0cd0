"""Set-up of the one-shot tensor-parallel all-reduce (engine/parallel/custom_all_reduce.py).

`CustomAllReduce.create` must leave both ranks of a TP-2 group together, with buffers or with NCCL,
and never make a collective its peer does not make. Two CPU processes (gloo) run it against fakes
of the GPU-only pieces (PyTorch's symmetric-memory allocation and rendezvous, peer-access queries;
the agreement tensors stay on the host), so the agreement logic itself runs for real:

- the success path turns NVLink multicast off before PyTorch's symmetric memory is touched (its
  rendezvous would otherwise create a multicast object on NVSwitch systems, which fails or hangs on
  some of them) and asks the driver for peer access between the two GPUs;
- GPUs without peer access (PCIe without P2P, MIG instances) keep NCCL on both ranks instead of
  reaching the rendezvous (which fails, or crashes the process, there);
- a rendezvous that fails on one rank only keeps NCCL on both instead of killing the engine.

After each case both ranks make one more all-reduce, which must still pair up (collectives in step).
GPU counterpart: test_custom_all_reduce_create_gpu.py."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

SITES, HIDDEN, MAX_TOKENS = 3, 8, 4
CASES = ("ok", "no_peer_access_on_rank1", "rendezvous_fails_on_rank1")


def _rank(rank: int, port: int, q) -> None:
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from kvpilot.parallel.custom_all_reduce import CustomAllReduce

    for k in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.pop(k, None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    group = dist.new_group([0, 1])
    case = {"name": None}
    seen: dict = {}

    # Fakes of the GPU-only pieces (this is a CPU build of PyTorch). The rendezvous is a collective.
    def fake_empty(n, dtype=None, device=None):
        seen["multicast_env_at_alloc"] = os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST")
        return torch.empty(n, dtype=dtype)

    class FakeHandle:
        def get_buffer(self, peer, sizes, dtype):
            seen["peer_rank"] = peer
            return torch.empty(sizes, dtype=dtype)

    def fake_rendezvous(tensor, grp):
        seen["multicast_env_at_rendezvous"] = os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST")
        dist.barrier(group=grp)
        if case["name"] == "rendezvous_fails_on_rank1" and rank == 1:
            raise RuntimeError("CUDA driver error: invalid argument")
        return FakeHandle()

    def fake_peer_access(a, b):
        seen.setdefault("peer_queries", []).append((a, b))
        return not (case["name"] == "no_peer_access_on_rank1" and rank == 1)

    real_tensor = torch.tensor

    def host_tensor(*args, device=None, **kwargs):  # agreement tensors of a NCCL-less test stay on the host
        return real_tensor(*args, **kwargs)

    symm_mem.empty, symm_mem.rendezvous = fake_empty, fake_rendezvous
    torch.cuda.can_device_access_peer = fake_peer_access
    torch.cuda.synchronize = lambda *a, **k: None
    torch.tensor = host_tensor
    out = {}
    for name in CASES:
        case["name"] = name
        seen.clear()
        try:
            car = CustomAllReduce.create(group, rank, 2, torch.device("cuda", rank), SITES, HIDDEN,
                                         max_tokens=MAX_TOKENS)
            res = None if car is None else (tuple(car.recv.shape), tuple(car.peer_recv.shape))
        except Exception as exc:  # noqa: BLE001 - the test reports it
            res = f"raised {type(exc).__name__}: {exc}"
        t = real_tensor([rank + 1])
        try:
            dist.all_reduce(t, group=group)
            after = int(t.item())
        except Exception as exc:  # noqa: BLE001
            after = f"raised {type(exc).__name__}"
        out[name] = {"result": res, "after": after, **seen}
    q.put((rank, out))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(q.get(timeout=120) for _ in range(2))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return got


def test_create_sets_up_both_ranks_with_multicast_off_and_peer_access_checked(outcomes):
    numel = MAX_TOKENS * HIDDEN
    for rank in (0, 1):
        r = outcomes[rank]["ok"]
        assert r["result"] == ((SITES, numel), (SITES, numel)), r
        assert r["peer_rank"] == 1 - rank
        # multicast off before PyTorch allocates or rendezvouses (read there, per call)
        assert r["multicast_env_at_alloc"] == "1" and r["multicast_env_at_rendezvous"] == "1", r
        assert r.get("peer_queries") == [(rank, 1 - rank)], r  # this GPU -> the peer's GPU
        assert r["after"] == 3


def test_create_keeps_nccl_on_both_ranks_without_peer_access(outcomes):
    for rank in (0, 1):
        r = outcomes[rank]["no_peer_access_on_rank1"]
        assert r["result"] is None, r
        assert "multicast_env_at_rendezvous" not in r, r  # the rendezvous is never reached
        assert r["after"] == 3, r


def test_create_keeps_nccl_on_both_ranks_when_the_rendezvous_fails_on_one(outcomes):
    for rank in (0, 1):
        r = outcomes[rank]["rendezvous_fails_on_rank1"]
        assert r["result"] is None, r  # rank 0 must not keep buffers its peer could not map
        assert r["after"] == 3, r
