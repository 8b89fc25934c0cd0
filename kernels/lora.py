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
  projection for all adapters of the batch, a per-token gather of the slot (programs over
  ``(token, R block)`` and ``(token, N block)``; a token with slot -1 loads nothing and writes
  nothing in the expand). Runs on CUDA or under ``TRITON_INTERPRET=1`` on CPU tensors.
- `lora_apply`: Triton for CUDA tensors, the reference otherwise.

Errors: ``ValueError`` for mismatched shapes (`_check`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["lora_apply", "lora_apply_ref", "lora_apply_triton", "lora_shrink_triton", "lora_expand_triton"]


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


_kernels = None


def _build():
    global _kernels
    if _kernels is not None:
        return _kernels
    import triton
    import triton.language as tl

    @triton.jit
    def _shrink_kernel(x_ptr, a_ptr, slot_ptr, y_ptr, K, R, stride_x, stride_as, stride_ar, stride_y,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        t = tl.program_id(0)
        rb = tl.program_id(1)
        s = tl.load(slot_ptr + t)
        K_used = K * (s >= 0).to(tl.int32)  # 0 for a token without an adapter: nothing is loaded
        s = tl.maximum(s, 0).to(tl.int64)
        r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = r < R
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K_used
            xv = tl.load(x_ptr + t.to(tl.int64) * stride_x + k, mask=kmask, other=0.0).to(tl.float32)
            av = tl.load(a_ptr + s * stride_as + r[:, None] * stride_ar + k[None, :],
                         mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)
        tl.store(y_ptr + t.to(tl.int64) * stride_y + r, acc, mask=rmask)

    @triton.jit
    def _expand_kernel(y_ptr, b_ptr, slot_ptr, out_ptr, N, R, stride_y, stride_bs, stride_bn, stride_out,
                       BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
        t = tl.program_id(0)
        nb = tl.program_id(1)
        s = tl.load(slot_ptr + t)
        used = (s >= 0).to(tl.int32)  # 0 for a token without an adapter: nothing is loaded or stored
        N_used = N * used
        R_used = R * used
        s = tl.maximum(s, 0).to(tl.int64)
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N_used
        r = tl.arange(0, BLOCK_R)
        rmask = r < R_used
        yv = tl.load(y_ptr + t.to(tl.int64) * stride_y + r, mask=rmask, other=0.0)
        bv = tl.load(b_ptr + s * stride_bs + n[:, None] * stride_bn + r[None, :],
                     mask=nmask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
        delta = tl.sum(bv * yv[None, :], axis=1)
        optr = out_ptr + t.to(tl.int64) * stride_out + n
        old = tl.load(optr, mask=nmask, other=0.0).to(tl.float32)
        tl.store(optr, (old + delta).to(out_ptr.dtype.element_ty), mask=nmask)

    _kernels = (_shrink_kernel, _expand_kernel)
    return _kernels


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """``y[t] = x[t] @ a[slot[t]].T`` in float32 (``[T, R]``; zeros where ``slot[t] < 0``), one launch."""
    shrink, _ = _build()
    T, K = x.shape
    R = a.shape[1]
    y = torch.empty(T, R, dtype=torch.float32, device=x.device)
    if T == 0:
        return y
    block_r = min(_next_pow2(R), 64)
    block_k = min(_next_pow2(K), 128)
    shrink[(T, -(-R // block_r))](x, a, slot, y, K, R, x.stride(0), a.stride(0), a.stride(1), y.stride(0),
                                  BLOCK_R=block_r, BLOCK_K=block_k)
    return y


def lora_expand_triton(y: torch.Tensor, b: torch.Tensor, slot: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[t] += y[t] @ b[slot[t]].T`` in place where ``slot[t] >= 0`` (``y`` ``[T, R]`` float32), one
    launch; returns ``out``."""
    _, expand = _build()
    T, N = out.shape
    R = b.shape[2]
    if T == 0:
        return out
    block_n = min(_next_pow2(N), 128)
    expand[(T, -(-N // block_n))](y, b, slot, out, N, R, y.stride(0), b.stride(0), b.stride(1), out.stride(0),
                                  BLOCK_N=block_n, BLOCK_R=_next_pow2(R))
    return out


def lora_apply_triton(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      slot: torch.Tensor, slots: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Triton batched LoRA (module docstring): shrink then expand, one launch each. ``slots`` is
    accepted for the reference's signature and unused."""
    _check(x, out, a, b, slot)
    if not (out.is_contiguous() and a.is_contiguous() and b.is_contiguous()):
        raise ValueError("lora_apply_triton needs contiguous out, a and b")
    x = x.contiguous()
    return lora_expand_triton(lora_shrink_triton(x, a, slot), b, slot, out)


def lora_apply(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slot: torch.Tensor,
               slots: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Batched LoRA in place on ``out`` (module docstring): Triton on CUDA, the reference otherwise."""
    if x.is_cuda:
        from kvpilot.kernels import triton_available

        if triton_available():
            return lora_apply_triton(x, out, a, b, slot)
    return lora_apply_ref(x, out, a, b, slot, slots)
