"""One-shot all-reduce for two tensor-parallel GPUs: buffers, set-up and the engine's switch.

At batch 1 a tensor-parallel decode step of a 32-layer Llama issues 65 all-reduces of one hidden
vector (8 KB in bf16). NCCL takes about 7.5 us for each on two H200s, and its kernels break the
PDL chain (kernels/pdl.py) of the Triton kernels around them (BENCHMARKS.md).
`kvpilot.kernels.allreduce.two_rank_all_reduce` sums such small tensors in one PDL kernel that
writes straight into the peer GPU's memory.

`CustomAllReduce.create` (called by every rank of a tensor-parallel group, collectively, before
the model is built and the KV cache sized) allocates one float32 receive buffer per call site in
PyTorch's symmetric memory (``torch.distributed._symmetric_memory``: CUDA IPC mappings of each
rank's buffer in its peers) and maps the peer's. It returns None, and the engine keeps NCCL, unless
every rank can: CUDA (not ROCm: the kernel's flag protocol is measured on NVIDIA GPUs only), exactly
two ranks in the group, ``Tuning.tp_custom_allreduce`` not 0 on both, peer access between the two
GPUs (none between PCIe GPUs without P2P, e.g. two GeForce cards, nor between MIG instances; there
PyTorch's rendezvous fails, or crashes), and a symmetric-memory allocation and rendezvous that
succeed on both. Every step that can fail on one rank only is followed by an agreement over the
group, so the ranks always leave together, with buffers or with NCCL, and make the same collectives
in the same order (a rank that failed where its peer went on would leave the peer waiting).

NVLink multicast is never used: the kernel needs only peer mappings, and PyTorch's rendezvous would
otherwise create a multicast object wherever the driver reports support (a step that fails, or
hangs, on some systems: H20, misconfigured Fabric Manager), so set-up sets
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` (and ``NVSHMEM_DISABLE_NVLS=1``) in the worker process before
its first symmetric-memory call (PyTorch reads it at each allocation and rendezvous).

Switches (read once, at set-up):

- ``Tuning.tp_custom_allreduce`` (default 1): 0 keeps NCCL for every all-reduce.
- ``Tuning.tp_custom_allreduce_max_tokens``: the largest all-reduce (in tokens of
  ``hidden_size`` elements) the one-shot kernel takes; larger ones (prefill) use NCCL. Default: 256
  tokens (on two H200s the one-shot kernel beat NCCL at every size up to 256 tokens of Llama-3.1-8B,
  BENCHMARKS.md), fewer where the buffers would pass 512 MB. Memory:
  ``sites * max_tokens * hidden_size * 4`` bytes per GPU (65 sites x 256 x 4096 x 4 = 273 MB for
  Llama-3.1-8B), taken before the KV cache is sized. Should the two ranks read different values,
  both use the smaller.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from kvpilot import envs

from kvpilot.kernels.allreduce import fill_sentinel, two_rank_all_reduce

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
DEFAULT_MAX_BYTES = 512 << 20


def custom_all_reduce_max_tokens(num_sites: int = 1, hidden_size: int = 1, max_tokens: Optional[int] = None) -> int:
    """``max_tokens`` (`Tuning.tp_custom_allreduce_max_tokens`), or by default `DEFAULT_MAX_TOKENS`
    capped so that ``num_sites`` float32 buffers of ``hidden_size``-element tokens stay within
    `DEFAULT_MAX_BYTES` (at least 1)."""
    if max_tokens is not None:
        return max_tokens
    return max(1, min(DEFAULT_MAX_TOKENS, DEFAULT_MAX_BYTES // (4 * max(1, num_sites * hidden_size))))


def _exchange(group, tp_rank: int, device: torch.device, values: list[int]) -> list[list[int]]:
    """Every rank's ``values`` (int64), as ``[rank][i]``: one all-reduce over ``group`` (on ``device``
    for NCCL, on the host for gloo)."""
    backend = str(dist.get_backend(group))
    comm = device if "nccl" in backend else torch.device("cpu")
    table = torch.zeros((2, len(values)), dtype=torch.int64, device=comm)
    table[tp_rank] = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(table, group=group)
    return table.tolist()


def _all_ok(group, tp_rank: int, device: torch.device, ok: bool) -> bool:
    """True when ``ok`` holds on both ranks (collective)."""
    return all(row[0] for row in _exchange(group, tp_rank, device, [int(ok)]))


class CustomAllReduce:
    """Receive buffers of one rank of a two-rank group and the switch between them and NCCL.

    recv: ``[num_sites, site_numel]`` float32, this rank's receive buffers (symmetric memory).
    peer_recv: the same shape, the peer's buffers mapped into this process.
    """

    def __init__(self, recv: torch.Tensor, peer_recv: torch.Tensor) -> None:
        self.recv = recv
        self.peer_recv = peer_recv
        self.num_sites, self.site_numel = recv.shape
        self.calls = 0  # kernels launched (captured launches count once); tests read it

    def fits(self, x: torch.Tensor, site: int) -> bool:
        """True when the one-shot kernel takes ``x`` at ``site``: on CUDA, contiguous, at most
        ``site_numel`` elements, and a site this object has a buffer for. Every rank decides alike."""
        return (x.is_cuda and x.is_contiguous() and 0 < x.numel() <= self.site_numel
                and 0 <= site < self.num_sites)

    def all_reduce(self, x: torch.Tensor, site: int) -> torch.Tensor:
        """Sum ``x`` over the two ranks in place (`two_rank_all_reduce`); returns ``x``."""
        self.calls += 1
        return two_rank_all_reduce(x, self.recv[site], self.peer_recv[site])

    @classmethod
    def create(cls, group, tp_rank: int, tp_size: int, device: torch.device, num_sites: int,
               hidden_size: int, enabled: bool = True, max_tokens: Optional[int] = None) -> Optional["CustomAllReduce"]:
        """Collective over ``group`` (every rank calls it, in the same order as its other
        collectives): the buffers of ``num_sites`` call sites of up to
        `custom_all_reduce_max_tokens` x ``hidden_size`` elements, or None where any rank cannot
        (module docstring). With ``tp_size == 2`` on CUDA every rank makes the same three small
        all-reduces over ``group`` (switches and device, local set-up, rendezvous) whatever its
        own outcome, so no rank is left waiting in one. ``enabled`` (`Tuning.tp_custom_allreduce`)
        False on a rank keeps NCCL on both; ``max_tokens``: `custom_all_reduce_max_tokens`'s.
        """
        device = torch.device(device)
        if tp_size != 2 or device.type != "cuda":
            return None  # the same on every rank: the layout and device come from one spec
        enabled = enabled and torch.version.hip is None
        numel = custom_all_reduce_max_tokens(num_sites, hidden_size, max_tokens) * hidden_size if enabled else 0
        index = device.index if device.index is not None else torch.cuda.current_device()
        # 1. Both ranks' switches, sizes and GPUs.
        rows = _exchange(group, tp_rank, device, [int(enabled), numel, index])
        if not all(r[0] for r in rows):
            logger.info("tp rank %d: one-shot all-reduce off on tp rank(s) %s (Tuning.tp_custom_allreduce False, or "
                        "ROCm); NCCL sums every all-reduce", tp_rank, [i for i, r in enumerate(rows) if not r[0]])
            return None
        numel = min(r[1] for r in rows)
        peer_index = rows[1 - tp_rank][2]
        # 2. Local set-up: peer access, then the buffer.
        envs.set_external("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # module docstring; read by PyTorch at set-up
        envs.set_external("NVSHMEM_DISABLE_NVLS", "1")
        local, reason = None, ""
        try:
            import torch.distributed._symmetric_memory as symm_mem

            if peer_index == index or not torch.cuda.can_device_access_peer(index, peer_index):
                raise RuntimeError(f"cuda:{index} has no peer access to cuda:{peer_index} (no NVLink or PCIe P2P)")
            local = symm_mem.empty(num_sites * numel, dtype=torch.float32, device=device)
            fill_sentinel(local)
            torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 - any failure keeps NCCL, on every rank
            local, reason = None, f"{type(exc).__name__}: {exc}"
        if not _all_ok(group, tp_rank, device, local is not None):
            logger.warning("tp rank %d: one-shot all-reduce unavailable (%s); NCCL sums every all-reduce",
                           tp_rank, reason or "the other rank could not set it up; its log says why")
            return None
        # 3. The rendezvous (collective: both ranks reach it) maps the peer's buffer; it can still
        # fail on one rank (IPC refused, driver errors), so the ranks agree once more.
        handle = peer = None
        try:
            handle = symm_mem.rendezvous(local, group)
            peer = handle.get_buffer(1 - tp_rank, (num_sites * numel,), torch.float32)
        except Exception as exc:  # noqa: BLE001
            peer, reason = None, f"{type(exc).__name__}: {exc}"
        if not _all_ok(group, tp_rank, device, peer is not None):
            logger.warning("tp rank %d: one-shot all-reduce unavailable (rendezvous: %s); NCCL sums every "
                           "all-reduce", tp_rank, reason or "failed on the other rank; its log says why")
            return None
        logger.info("tp rank %d: one-shot all-reduce for up to %d elements at %d sites (%.1f MB)", tp_rank,
                    numel, num_sites, local.numel() * 4 / 1e6)
        car = cls(local.view(num_sites, numel), peer.view(num_sites, numel))
        car._handle = handle  # keeps the mapping alive
        return car
