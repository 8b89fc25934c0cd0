"""Batched LoRA: every token of a ragged batch gets the low-rank update of its own adapter.

A LoRA-wrapped projection keeps all resident adapters stacked in GPU slots (`kvpilot.lora`):

- ``a`` ``[S, R, K]``: the shrink matrices (``lora_A`` of each adapter, rows past an adapter's rank
  are zero), ``S`` slots, ``R`` the padded rank (``parts * max_lora_rank`` for fused q/k/v or
  gate/up projections), ``K`` the input features;
- ``b`` ``[S, N, R]``: the expand matrices (``lora_B``, already multiplied by the adapter's
  scaling), block-diagonal over the parts of a fused projection;
- ``slot`` ``[T]`` int32: each token's slot, ``-1`` for a token with no adapter.

``lora_apply(x, out, a, b, slot)`` adds ``((x[t] @ a[s].T) @ b[s].T)`` to ``out[t]`` in place for
every token ``t`` with ``s = slot[t] >= 0`` and returns ``out``. Shapes: ``x`` ``[T, K]``, ``out``
``[T, N]``, both contiguous; the shrink accumulates in float32, the product is added to ``out`` in
float32 and rounded once to ``out.dtype``.

Implementations:

- `lora_apply_ref`: PyTorch, one segment per distinct slot (``index_select`` of its tokens, two
  matmuls, ``index_add_``); what the engine runs on CPU. ``slots`` (the distinct slots, host ints)
  may be given to avoid reading ``slot`` back from the device.
- `lora_shrink_triton` then `lora_expand_triton` (`lora_apply_triton`): one launch each per
  projection for all adapters of the batch. The step's tokens with an adapter are grouped by slot
  into tiles of at most 16 tokens (`lora_tiles`, built once per step on the host: a permutation
  ``order`` and ``(start, length, slot)`` per tile); a program owns one tile and one block of
  ``R`` (shrink: ``tl.dot`` of the gathered ``x`` rows with ``a[slot].T`` over K) or of ``N``
  (expand: the tile's ``y`` rows times ``b[slot].T``, added to the scattered ``out`` rows), so an
  adapter's matrices are read once per tile, not once per token, and prefill chunks run on the
  tensor cores. Tokens without an adapter are in no tile. Runs on CUDA or under
  ``TRITON_INTERPRET=1`` on CPU tensors.
- `lora_apply`: Triton for CUDA tensors, the reference otherwise.

Errors: ``ValueError`` for mismatched shapes (`_check`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["LoRATiles", "lora_apply", "lora_apply_ref", "lora_apply_triton", "lora_expand_triton", "lora_shrink_triton",
           "lora_tiles"]


def _check(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slot: torch.Tensor) -> None:
    if x.dim() != 2 or out.dim() != 2 or a.dim() != 3 or b.dim() != 3 or slot.dim() != 1:
        raise ValueError(f"lora_apply: expected x [T, K], out [T, N], a [S, R, K], b [S, N, R], slot [T]; got "
                         f"{tuple(x.shape)}, {tuple(out.shape)}, {tuple(a.shape)}, {tuple(b.shape)}, "
                         f"{tuple(slot.shape)}")
    T, K = x.shape
    S, R, Ka = a.shape
    if Ka != K or out.shape[0] != T or slot.shape[0] != T or tuple(b.shape) != (S, out.shape[1], R):
        raise ValueError(f"lora_apply: inconsistent shapes x {tuple(x.shape)}, out {tuple(out.shape)}, "
                         f"a {tuple(a.shape)}, b {tuple(b.shape)}, slot {tuple(slot.shape)}")


def lora_apply_ref(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slot: torch.Tensor,
                   slots: Optional[Sequence[int]] = None) -> torch.Tensor:
    """PyTorch batched LoRA (module docstring): a loop over the distinct slots of ``slot``."""
    _check(x, out, a, b, slot)
    if slots is None:
        slots = [int(s) for s in torch.unique(slot).tolist() if s >= 0]
    for s in slots:
        rows = torch.nonzero(slot == s, as_tuple=True)[0]
        if rows.numel() == 0:
            continue
        xs = x.index_select(0, rows).float()
        delta = (xs @ a[s].float().t()) @ b[s].float().t()
        out.index_copy_(0, rows, (out.index_select(0, rows).float() + delta).to(out.dtype))
    return out


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


class LoRATiles:
    """A step's tokens grouped by slot for the Triton kernels (`lora_tiles`): ``order`` [L] int32,
    the tokens that have an adapter sorted by slot (stable: flat-batch order within a slot);
    ``tiles`` [n, 3] int32, per tile of at most ``block_m`` of them its start in ``order``, its
    length and its slot. Host ints ``num_tiles`` and ``block_m``."""

    def __init__(self, order: torch.Tensor, tiles: torch.Tensor, num_tiles: int, block_m: int) -> None:
        self.order = order
        self.tiles = tiles
        self.num_tiles = num_tiles
        self.block_m = block_m


def lora_tiles(slot: Sequence[int], device: torch.device, block_m: int = 16) -> LoRATiles:
    """Group the tokens of ``slot`` (host ints, ``-1``: no adapter) by slot into tiles of at most
    ``block_m`` tokens (`LoRATiles`), on ``device``. Each tile's ``a`` / ``b`` are read once for
    all its tokens: at batch 64 with 8 adapters, 8 reads of each adapter's matrices instead of 64."""
    import numpy as np

    s = np.asarray(slot, dtype=np.int64)
    order = np.flatnonzero(s >= 0)
    order = order[np.argsort(s[order], kind="stable")]
    tiles = []
    i, n = 0, len(order)
    while i < n:
        sl = s[order[i]]
        j = i
        while j < n and s[order[j]] == sl:
            j += 1
        for t in range(i, j, block_m):
            tiles.append((t, min(block_m, j - t), sl))
        i = j
    tiles_t = torch.tensor(tiles if tiles else [(0, 0, 0)], dtype=torch.int32)
    order_t = torch.tensor(order if n else [0], dtype=torch.int32)
    if device.type == "cuda":
        tiles_t, order_t = tiles_t.pin_memory().to(device, non_blocking=True), order_t.pin_memory().to(
            device, non_blocking=True)
    return LoRATiles(order_t, tiles_t, len(tiles), block_m)


_kernels = None


def _build():
    global _kernels
    if _kernels is not None:
        return _kernels
    import triton
    import triton.language as tl

    @triton.jit
    def _shrink_kernel(x_ptr, a_ptr, order_ptr, tiles_ptr, y_ptr, K, R, stride_x, stride_as, stride_ar, stride_y,
                       BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                       DOT_FP32: tl.constexpr):
        tile = tl.program_id(0)
        rb = tl.program_id(1)
        start = tl.load(tiles_ptr + tile * 3)
        count = tl.load(tiles_ptr + tile * 3 + 1)
        s = tl.load(tiles_ptr + tile * 3 + 2).to(tl.int64)
        m = tl.arange(0, BLOCK_M)
        mmask = m < count
        tok = tl.load(order_ptr + start + m, mask=mmask, other=0).to(tl.int64)
        r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = r < R
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            xv = tl.load(x_ptr + tok[:, None] * stride_x + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            av = tl.load(a_ptr + s * stride_as + r[None, :] * stride_ar + k[:, None],
                         mask=rmask[None, :] & kmask[:, None], other=0.0)  # [BLOCK_K, BLOCK_R]: a[s].T
            if DOT_FP32:
                xv = xv.to(tl.float32)
                av = av.to(tl.float32)
            acc += tl.dot(xv, av, input_precision=PRECISION)
        tl.store(y_ptr + tok[:, None] * stride_y + r[None, :], acc, mask=mmask[:, None] & rmask[None, :])

    @triton.jit
    def _expand_kernel(y_ptr, b_ptr, order_ptr, tiles_ptr, out_ptr, N, R, stride_y, stride_bs, stride_bn, stride_out,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
        tile = tl.program_id(0)
        nb = tl.program_id(1)
        start = tl.load(tiles_ptr + tile * 3)
        count = tl.load(tiles_ptr + tile * 3 + 1)
        s = tl.load(tiles_ptr + tile * 3 + 2).to(tl.int64)
        m = tl.arange(0, BLOCK_M)
        mmask = m < count
        tok = tl.load(order_ptr + start + m, mask=mmask, other=0).to(tl.int64)
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        r = tl.arange(0, BLOCK_R)
        rmask = r < R
        yv = tl.load(y_ptr + tok[:, None] * stride_y + r[None, :], mask=mmask[:, None] & rmask[None, :], other=0.0)
        bv = tl.load(b_ptr + s * stride_bs + n[None, :] * stride_bn + r[:, None],
                     mask=nmask[None, :] & rmask[:, None], other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_N]: b[s].T
        delta = tl.dot(yv, bv, input_precision=PRECISION)
        optr = out_ptr + tok[:, None] * stride_out + n[None, :]
        omask = mmask[:, None] & nmask[None, :]
        old = tl.load(optr, mask=omask, other=0.0).to(tl.float32)
        tl.store(optr, (old + delta).to(out_ptr.dtype.element_ty), mask=omask)

    _kernels = (_shrink_kernel, _expand_kernel)
    return _kernels


def _interpreting() -> bool:
    from kvpilot import envs

    return envs.triton_interpret()


def _tiles_of(slot: torch.Tensor, tiles: Optional[LoRATiles]) -> LoRATiles:
    return tiles if tiles is not None else lora_tiles(slot.tolist(), slot.device)


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, slot: torch.Tensor,
                       tiles: Optional[LoRATiles] = None) -> torch.Tensor:
    """``y[t] = x[t] @ a[slot[t]].T`` in float32 (``[T, R]``; rows of tokens without an adapter are
    not written), one launch over the tiles (`lora_tiles`; built from ``slot`` when not given,
    which reads ``slot`` back to the host)."""
    shrink, _ = _build()
    T, K = x.shape
    R = a.shape[1]
    y = torch.empty(T, R, dtype=torch.float32, device=x.device)
    tiles = _tiles_of(slot, tiles)
    if T == 0 or tiles.num_tiles == 0:
        return y
    block_r = max(16, min(_next_pow2(R), 64))
    block_k = max(16, min(_next_pow2(K), 64))
    fp32 = x.dtype == torch.float32 or _interpreting()
    shrink[(tiles.num_tiles, -(-R // block_r))](
        x, a, tiles.order, tiles.tiles, y, K, R, x.stride(0), a.stride(0), a.stride(1), y.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_R=block_r, BLOCK_K=block_k, PRECISION="ieee" if fp32 else "tf32",
        DOT_FP32=fp32)
    return y


def lora_expand_triton(y: torch.Tensor, b: torch.Tensor, slot: torch.Tensor, out: torch.Tensor,
                       tiles: Optional[LoRATiles] = None) -> torch.Tensor:
    """``out[t] += y[t] @ b[slot[t]].T`` in place where ``slot[t] >= 0`` (``y`` ``[T, R]`` float32), one
    launch over the tiles (`lora_tiles`); returns ``out``."""
    _, expand = _build()
    T, N = out.shape
    R = b.shape[2]
    tiles = _tiles_of(slot, tiles)
    if T == 0 or tiles.num_tiles == 0:
        return out
    block_n = max(16, min(_next_pow2(N), 64))
    expand[(tiles.num_tiles, -(-N // block_n))](
        y, b, tiles.order, tiles.tiles, out, N, R, y.stride(0), b.stride(0), b.stride(1), out.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_R=max(16, _next_pow2(R)), PRECISION="ieee")
    return out


def lora_apply_triton(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      slot: torch.Tensor, slots: Optional[Sequence[int]] = None,
                      tiles: Optional[LoRATiles] = None) -> torch.Tensor:
    """Triton batched LoRA (module docstring): shrink then expand, one launch each over the step's
    slot-grouped tiles (``tiles``, from `lora_tiles`; built from ``slot`` when None). ``slots`` is
    accepted for the reference's signature and unused."""
    _check(x, out, a, b, slot)
    if not (out.is_contiguous() and a.is_contiguous() and b.is_contiguous()):
        raise ValueError("lora_apply_triton needs contiguous out, a and b")
    x = x.contiguous()
    tiles = _tiles_of(slot, tiles)
    return lora_expand_triton(lora_shrink_triton(x, a, slot, tiles), b, slot, out, tiles)


def lora_apply(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slot: torch.Tensor,
               slots: Optional[Sequence[int]] = None, tiles: Optional[LoRATiles] = None) -> torch.Tensor:
    """Batched LoRA in place on ``out`` (module docstring): Triton on CUDA, the reference otherwise."""
    if x.is_cuda:
        from kvpilot.kernels import triton_available

        if triton_available():
            return lora_apply_triton(x, out, a, b, slot, tiles=tiles)
    return lora_apply_ref(x, out, a, b, slot, slots)
