"""Triton KV-cache writes: scatter each token's K/V rows to its slot in the paged cache.

- ``write_kv_cache_triton``: the plain write, one program per token.
- ``rotary_write_kv_cache_triton``: rotary embedding of q and k fused with the write of rotated k
  and v, in one launch (the decode layer's rotary and cache write were two launches; at batch 1
  each costs a few microseconds even inside a CUDA graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_options, pdl_enter, pdl_mode

from .reference import FP8_KV_DTYPE, FP8_KV_MAX, _check_rotary_args, _check_write_args


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SATURATE: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padded token
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d
    vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d
    tl.store(kc, _to_cache(k, k_cache_ptr, SATURATE), mask=mask)
    tl.store(vc, _to_cache(v, v_cache_ptr, SATURATE), mask=mask)


@triton.jit
def _to_cache(x, cache_ptr, SATURATE: tl.constexpr):
    """Cast to the cache's element type; with SATURATE > 0 (FP8 caches) clamp to +-SATURATE first."""
    if SATURATE > 0:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -SATURATE), SATURATE)
    return x.to(cache_ptr.dtype.element_ty)


def _saturate(cache: torch.Tensor) -> float:
    """The SATURATE constexpr for a cache: E4M3's largest finite value for FP8 caches, else 0 (off)."""
    return FP8_KV_MAX if cache.dtype == FP8_KV_DTYPE else 0.0


def write_kv_cache_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton version of :func:`kvpilot.kernels.reference.write_kv_cache_ref` (in place).

    One program per token; a slot of ``-1`` is skipped. Slots are not range-checked on the device
    (that would need a sync); the caller's block manager guarantees them.

    Raises:
        ValueError: on mismatched shapes or a non-contiguous innermost dimension.
    """
    _check_write_args(k, v, k_cache, v_cache, slot_mapping)
    if any(t.stride(-1) != 1 for t in (k, v, k_cache, v_cache)):
        raise ValueError("k, v and the caches must be contiguous in their last dimension")
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1], SATURATE=_saturate(k_cache),
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )  # fmt: skip


TUNING = {
    # Below this many tokens, heads are split over several programs per token so that a batch-1
    # decode spreads its loads over a few SMs; from it on, one q program and one k/v program per
    # token (larger tiles, fewer programs).
    "split_heads_below_tokens": 32,
    # Elements of one half-head tile per program when splitting (q: heads x head_dim/2; the k/v
    # program holds twice that, k and v).
    "split_tile": 512,
}
"""Launch heuristics of :func:`rotary_write_kv_cache_triton` (benchmarks may override them)."""


@triton.jit
def _rotary_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, NUM_Q_PROGRAMS: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, SATURATE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(USE_PDL)  # kernels/pdl.py: before any memory access
    # Grid (token, head block): programs [0, NUM_Q_PROGRAMS) rotate Q_HEADS query heads in place,
    # the rest rotate KV_HEADS key heads and write them and their values to the token's slot.
    # The q/k/v loads come before the position-dependent cos/sin loads, so at batch 1 a program
    # waits for two DRAM round trips, not three.
    token = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    i = tl.arange(0, HALF_PAD)
    i_ok = i < HALF
    if pid < NUM_Q_PROGRAMS:
        hq = pid * Q_HEADS + tl.arange(0, Q_HEADS)[:, None]
        mq = (hq < NUM_HEADS) & i_ok[None, :]
        p1 = q_ptr + token * stride_qt + hq * stride_qh + i[None, :]
        x1 = tl.load(p1, mask=mq, other=0.0).to(tl.float32)
        x2 = tl.load(p1 + HALF, mask=mq, other=0.0).to(tl.float32)
        pos = tl.load(pos_ptr + token).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * stride_cs + i, mask=i_ok, other=0.0)[None, :]
        sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + i, mask=i_ok, other=0.0)[None, :]
        tl.store(p1, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=mq)
        tl.store(p1 + HALF, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=mq)
    else:
        # (Names differ from the q branch: Triton wants one type per name across both branches.)
        hk = (pid - NUM_Q_PROGRAMS) * KV_HEADS + tl.arange(0, KV_HEADS)[:, None]
        mk = (hk < NUM_KV_HEADS) & i_ok[None, :]
        pk = k_ptr + token * stride_kt + hk * stride_kh + i[None, :]
        pv = v_ptr + token * stride_vt + hk * stride_vh + i[None, :]
        k1 = tl.load(pk, mask=mk, other=0.0).to(tl.float32)
        k2 = tl.load(pk + HALF, mask=mk, other=0.0).to(tl.float32)
        v1 = tl.load(pv, mask=mk, other=0.0)
        v2 = tl.load(pv + HALF, mask=mk, other=0.0)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        kpos = tl.load(pos_ptr + token).to(tl.int64)
        kcos = tl.load(cos_sin_ptr + kpos * stride_cs + i, mask=i_ok, other=0.0)[None, :]
        ksin = tl.load(cos_sin_ptr + kpos * stride_cs + HALF + i, mask=i_ok, other=0.0)[None, :]
        # Round the rotated key to k's dtype first, as apply_rotary + write_kv_cache would.
        r1 = _to_cache((k1 * kcos - k2 * ksin).to(k_ptr.dtype.element_ty), k_cache_ptr, SATURATE)
        r2 = _to_cache((k2 * kcos + k1 * ksin).to(k_ptr.dtype.element_ty), k_cache_ptr, SATURATE)
        # Slot -1 (padded token): no head is written.
        mw = (hk < tl.where(slot >= 0, NUM_KV_HEADS, 0)) & i_ok[None, :]
        slot = tl.maximum(slot, 0)
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs + hk * stride_kch + i[None, :]
        vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs + hk * stride_vch + i[None, :]
        tl.store(kc, r1, mask=mw)
        tl.store(kc + HALF, r2, mask=mw)
        tl.store(vc, _to_cache(v1, v_cache_ptr, SATURATE), mask=mw)
        tl.store(vc + HALF, _to_cache(v2, v_cache_ptr, SATURATE), mask=mw)


def rotary_launch_config(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    """Heads per program and warps of :func:`rotary_write_kv_cache_triton` (see ``TUNING``).

    Returns a dict with ``q_heads``, ``kv_heads`` (powers of two), ``num_q_programs``,
    ``num_kv_programs`` (programs per token) and ``num_warps``.
    """
    half_pad = triton.next_power_of_2(head_dim // 2)
    q_heads = triton.next_power_of_2(num_heads)
    kv_heads = triton.next_power_of_2(num_kv_heads)
    if num_tokens < TUNING["split_heads_below_tokens"]:
        per_tile = max(1, TUNING["split_tile"] // half_pad)
        q_heads = min(q_heads, triton.next_power_of_2(per_tile))
        kv_heads = min(kv_heads, triton.next_power_of_2(max(1, per_tile // 2)))
    tile = max(q_heads, 2 * kv_heads) * half_pad
    return dict(
        q_heads=q_heads,
        kv_heads=kv_heads,
        num_q_programs=triton.cdiv(num_heads, q_heads),
        num_kv_programs=triton.cdiv(num_kv_heads, kv_heads),
        num_warps=max(1, min(4, tile // 256)),
    )


def rotary_write_kv_cache_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Triton version of :func:`kvpilot.kernels.reference.rotary_write_kv_cache_ref`, one launch.

    Rotates ``q`` IN PLACE and returns it; ``k`` and ``v`` are read only (the rotated keys go
    to the cache alone). ``q``, ``k``, ``v`` may be strided views (e.g. of a fused QKV output) as
    long as their last dimension is contiguous. Slots are not range-checked on the device (that
    would need a sync); a slot of ``-1`` is skipped, but its token's query is still rotated.

    Raises:
        ValueError: on mismatched shapes, an odd ``head_dim``, or a non-contiguous last dimension.
    """
    _check_rotary_args(q, k, positions, cos_sin_cache)
    _check_write_args(k, v, k_cache, v_cache, slot_mapping)
    if any(t.stride(-1) != 1 for t in (q, k, v, k_cache, v_cache, cos_sin_cache)):
        raise ValueError("q, k, v, the caches and cos_sin_cache must be contiguous in their last dimension")
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return q
    num_kv_heads = k.shape[1]
    cfg = rotary_launch_config(num_tokens, num_heads, num_kv_heads, head_dim)
    half = head_dim // 2
    pdl = pdl_mode(q.device, num_tokens)
    _rotary_write_kv_kernel[(num_tokens, cfg["num_q_programs"] + cfg["num_kv_programs"])](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        Q_HEADS=cfg["q_heads"], KV_HEADS=cfg["kv_heads"], NUM_Q_PROGRAMS=cfg["num_q_programs"],
        HALF=half, HALF_PAD=triton.next_power_of_2(half), BLOCK_SIZE=k_cache.shape[1],
        SATURATE=_saturate(k_cache), USE_PDL=pdl > 0,
        num_warps=cfg["num_warps"], **launch_options(pdl),
    )  # fmt: skip
    return q
