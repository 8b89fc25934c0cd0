"""One-shot all-reduce of two tensor-parallel ranks over peer-mapped memory (Lamport flags).

Each rank owns a float32 receive buffer that its peer can write (CUDA IPC through PyTorch's
symmetric memory, `kvpilot.engine.custom_all_reduce`). Every element of a receive buffer holds
the *sentinel* (-0.0, bits ``0x80000000``) while it is empty. One kernel per all-reduce:

1. waits for the kernel that wrote ``x`` (PDL, kernels/pdl.py);
2. stores its own ``x`` as float32 into the **peer's** receive buffer, with -0.0 stored as +0.0
   so that no real value looks empty;
3. re-reads its **own** receive buffer until no element in its block is the sentinel (the peer's
   stores have all landed: each element is its own flag, so no barrier or fence is needed);
4. writes ``x + peer`` (float32 sum, rounded once to ``out``'s dtype) and puts the sentinel back
   into the elements it read.

This is the "Lamport" one-shot all-reduce of TensorRT-LLM's custom all-reduce kernels (the
sentinel trick is Lamport's, "A New Solution of Dijkstra's Concurrent Programming Problem",
1974, applied per element); vLLM's custom all-reduce instead uses a flag barrier. One NVLink
write crosses per element and no round trip is waited for.

Buffer reuse: every call site of a model (embedding, each layer's ``o_proj`` and ``down_proj``)
has its own receive buffer, used once per forward pass. A peer can only write site ``s`` again
after this rank has pushed its data for a later site, i.e. after the kernel that reset site ``s``
has finished (stream order), so one buffer per site is enough and no rotation is needed. The
argument holds because (a) both ranks make the same sequence of calls (`ParallelContext.all_reduce`
routes by the tensor's size alone, and every forward pass uses all of a model's sites, at least two,
in the same order: with one site used twice in a row a peer could write it before this rank's reset);
(b) every kernel launched with PDL between two calls waits for its predecessor before it finishes
(kernels/pdl.py's rule), so "finished" is transitive along the stream. A grid larger than what a GPU
holds at once (about 2,100 programs of 4 warps on an H200; `block_size` keeps every grid at
1,024 programs at most, which GPUs with fewer SMs may not hold at once) relies on both GPUs
starting programs roughly in index order, since program ``i`` waits for the peer's program ``i``.

Both ranks compute ``x_0 + x_1`` in float32 and round once; addition is commutative, so the two
ranks' results are bit-identical and equal NCCL's two-rank bf16 sum (which also adds in float32
and rounds once), except that two -0.0 partials sum to +0.0 here (-0.0 marks an empty element).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .pdl import launch_options, pdl_mode, pdl_trigger, pdl_wait

SENTINEL_BITS = -(2 ** 31)
"""int32 bits of the empty-element marker, float32 -0.0."""
_SENTINEL = tl.constexpr(SENTINEL_BITS)

MIN_BLOCK, MAX_PROGRAMS = 256, 1024
BLOCK: Optional[int] = None
"""Elements per program; None (the default): `block_size`. Benchmarks set it to sweep."""


def block_size(n: int) -> int:
    """Elements per program for an all-reduce of ``n`` elements: 256, or more where 256 would need
    more than 1,024 programs (a power of two). On two H200s 256 was fastest at 8 KB to 512 KB of
    bf16 (3.2 against 3.4 us at 1024 for 8 KB; ``benchmarks/lab/gpu_allreduce.py --block-sweep``,
    BENCHMARKS.md), and 1,024 programs stay resident on one GPU at once."""
    return max(MIN_BLOCK, triton.next_power_of_2(triton.cdiv(n, MAX_PROGRAMS)))


@triton.jit
def _two_rank_all_reduce_kernel(x_ptr, out_ptr, recv_ptr, peer_recv_ptr, n,
                                BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)  # ``x`` is written by the kernel before this one
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 == 0.0: store +0.0, never the sentinel
    tl.store(peer_recv_ptr + offs, x, mask=mask)
    pdl_trigger(USE_PDL)
    sentinel = tl.full([BLOCK_N], _SENTINEL, tl.int32)
    got = tl.load(recv_ptr + offs, mask=mask, other=0.0, volatile=True)
    pending = tl.sum(((got.to(tl.int32, bitcast=True) == sentinel) & mask).to(tl.int32), axis=0)
    while pending > 0:
        got = tl.load(recv_ptr + offs, mask=mask, other=0.0, volatile=True)
        pending = tl.sum(((got.to(tl.int32, bitcast=True) == sentinel) & mask).to(tl.int32), axis=0)
    tl.store(out_ptr + offs, (x + got).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(recv_ptr + offs, sentinel.to(tl.float32, bitcast=True), mask=mask)


def empty_receive_buffer(numel: int, device) -> torch.Tensor:
    """A float32 receive buffer of ``numel`` elements, every one the sentinel (module docstring)."""
    return torch.full((numel,), SENTINEL_BITS, dtype=torch.int32, device=device).view(torch.float32)


def fill_sentinel(buf: torch.Tensor) -> torch.Tensor:
    """Mark every element of the float32 ``buf`` empty (in place); returns ``buf``."""
    buf.view(torch.int32).fill_(SENTINEL_BITS)
    return buf


def two_rank_all_reduce(x: torch.Tensor, recv: torch.Tensor, peer_recv: torch.Tensor,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sum ``x`` with the other rank's ``x`` (module docstring).

    x: contiguous, any float dtype, ``n`` elements (e.g. ``[T, hidden]`` bf16).
    recv: this rank's float32 receive buffer for this call site, at least ``n`` elements, empty
        (sentinel) except for what the peer has already pushed for this call.
    peer_recv: the peer's receive buffer for the same call site, mapped into this process.
    out: result, same shape and dtype as ``x`` (default: ``x``, in place).

    Returns ``out``. Both ranks must call it for the same site with the same ``n``; a rank whose
    peer never calls spins forever (as an NCCL all-reduce would wait). Raises ``ValueError`` for
    a non-contiguous ``x`` or buffers that are too small or not float32.
    """
    n = x.numel()
    if not x.is_contiguous():
        raise ValueError("two_rank_all_reduce needs a contiguous input")
    for name, b in (("recv", recv), ("peer_recv", peer_recv)):
        if b.dtype != torch.float32 or b.numel() < n:
            raise ValueError(f"{name} must be float32 with at least {n} elements, got {b.dtype} {b.numel()}")
    out = x if out is None else out
    if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError("out must be contiguous and match x's shape and dtype")
    if n == 0:
        return out
    rows = x.shape[0] if x.dim() > 1 else 1
    pdl = pdl_mode(x.device, rows)
    block = BLOCK or block_size(n)
    _two_rank_all_reduce_kernel[(triton.cdiv(n, block),)](
        x, out, recv, peer_recv, n, BLOCK_N=block, USE_PDL=pdl > 0, num_warps=4, **launch_options(pdl))
    return out


def two_rank_all_reduce_ref(x: torch.Tensor, peer_x: torch.Tensor) -> torch.Tensor:
    """Reference: ``x + peer_x`` summed in float32 and rounded once to ``x.dtype``."""
    return (x.float() + peer_x.float()).to(x.dtype)
