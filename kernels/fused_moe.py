"""Triton mixture-of-experts experts: two kernel launches per layer (after `moe_align`'s PyTorch
ops on the grouped path), then a sum over each token's choices.

`fused_moe_triton(x, w13, w2, topk_weights, topk_ids)` computes `kvpilot.kernels.moe.fused_moe_ref`'s
value (layouts in ``kernels/moe.py``). Every ``(token, slot)`` pair ``p = t * K + k`` gets one row
of an ``act [T * K, I]`` buffer and one row of an ``out [T * K, H]`` buffer; the result is
``out.view(T, K, H).sum(1)`` (each token's ``K`` rows, one reduction, no scatter per expert).

Grouped path (any token count): `kvpilot.kernels.moe.moe_align` sorts the pairs by expert and pads
each expert's run to the row block ``BLOCK_M``. Launch 1, ``_grouped_gate_up_kernel``: one program
per (row block, ``BLOCK_N`` columns of ``I``) multiplies the block's gathered ``x`` rows by its
expert's gate and up tiles (two ``tl.dot`` accumulators) and stores ``silu(gate) * up``. Launch 2,
``_grouped_down_kernel``: the block's ``act`` rows times the expert's ``w2`` tile, scaled by each
pair's routing weight. Blocks past the last expert's run (the grid is an upper bound, so nothing
is read back to the host and the launches can be captured in a CUDA graph) return at once.

Small-token path (``T <= TUNING["small_max_tokens"]``, decode): no sort. One program per (pair,
column tile); the program of the first pair that chose expert ``e`` serves every token that chose
``e`` (the others return, as do pairs of id ``-1``), so each selected expert's weight tile is read
from memory once per step however many tokens share it. Products are broadcast multiply-and-sum in
float32 registers (``T_MAX`` tokens at most), which suits the few rows of a decode batch better
than ``tl.dot``.

Weight tiles of the grouped path come by TMA (host tensor descriptors over the ``[E * 2I, H]`` and
``[E * H, I]`` views; a tile that runs past an expert's rows reads the next expert's, whose columns
are masked at the store) for 16-bit weights on sm_90+; otherwise by pointer loads at 32-bit
offsets from each expert's base (a token count whose buffers 32-bit offsets cannot address is
split into chunks). Compiled for sm_90 with ptxas, the pointer-tile version of the gate/up kernel
used 255 registers and spilled at every tile size tried, from the per-element offset tiles it keeps.

Both accumulate in float32 and round ``act`` and ``out`` to ``x.dtype`` (as the reference rounds
each expert's products); float32 inputs use IEEE ``tl.dot``, not TF32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot import envs

from .moe import _check, moe_align

try:  # host-side TMA descriptors (Triton >= 3.3); without them the weight tiles come by pointer loads
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - old Triton
    TensorDescriptor = None

_I32 = 2 ** 31 - 1

TUNING = {
    # Up to this many tokens the small-token path runs (no sort; see the module docstring).
    "small_max_tokens": 8,
    # Small path: BLOCK_N columns per program; BLOCK_K * T_MAX is kept at this many elements.
    "small_block_n": 16,
    "small_tile": 4096,
    # Grouped path: (max average pairs per expert, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages).
    "grouped": [(16, 16, 64, 128, 1, 4, 3), (64, 32, 64, 64, 4, 4, 3), (None, 64, 128, 64, 8, 8, 3)],
    # Grouped path: weight tiles by TMA where `_use_tma` allows (16-bit weights on sm_90+).
    "tma": True,
}
"""Launch heuristics (benchmarks/gpu_moe.py may override them)."""


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _grouped_gate_up_kernel(
    x_ptr, w_ptr, w_desc, act_ptr, pairs_ptr, block_e_ptr,
    TK, INTER, HIDDEN, num_blocks,
    stride_xt, stride_we, stride_wn, stride_at,
    K_TOP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_n = tl.cdiv(INTER, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_size = min(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size
    e = tl.load(block_e_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)
    valid = pairs < TK
    tok = pairs // K_TOP
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    # 32-bit offsets from per-expert scalar bases (the wrapper keeps them in range). Weight tiles
    # come by TMA where the descriptor exists: per-element offset tiles would take most registers.
    a_off = tok[:, None] * stride_xt + offs_k[None, :]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        row = (e * 2 * INTER).to(tl.int32) + pid_n * BLOCK_N  # rows of the [E * 2I, H] view
        for k0 in range(0, HIDDEN, BLOCK_K):
            if EVEN_K:
                a = tl.load(x_ptr + k0 + a_off, mask=valid[:, None], other=0.0)
            else:
                a = tl.load(x_ptr + k0 + a_off, mask=valid[:, None] & (offs_k < HIDDEN - k0)[None, :], other=0.0)
            g = w_desc.load([row, k0])
            u = w_desc.load([row + INTER, k0])
            acc_g = tl.dot(a, tl.trans(g), acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, tl.trans(u), acc_u, input_precision=PRECISION)
    else:
        w_base = w_ptr + e * stride_we
        g_off = offs_n[None, :] * stride_wn + offs_k[:, None]
        u_off = g_off + INTER * stride_wn
        for k0 in range(0, HIDDEN, BLOCK_K):
            if EVEN_K:
                a = tl.load(x_ptr + k0 + a_off, mask=valid[:, None], other=0.0)
                g = tl.load(w_base + k0 + g_off, mask=n_mask[None, :], other=0.0)
                u = tl.load(w_base + k0 + u_off, mask=n_mask[None, :], other=0.0)
            else:
                k_mask = offs_k < HIDDEN - k0
                a = tl.load(x_ptr + k0 + a_off, mask=valid[:, None] & k_mask[None, :], other=0.0)
                g = tl.load(w_base + k0 + g_off, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                u = tl.load(w_base + k0 + u_off, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
    act = _silu(acc_g.to(act_ptr.dtype.element_ty).to(tl.float32)) * acc_u.to(act_ptr.dtype.element_ty).to(tl.float32)
    tl.store(act_ptr + pairs[:, None] * stride_at + offs_n[None, :], act.to(act_ptr.dtype.element_ty),
             mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _grouped_down_kernel(
    act_ptr, w_ptr, w_desc, out_ptr, weights_ptr, pairs_ptr, block_e_ptr,
    TK, HIDDEN, INTER, num_blocks,
    stride_at, stride_we, stride_wn, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_n = tl.cdiv(HIDDEN, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_size = min(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size
    e = tl.load(block_e_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)
    valid = pairs < TK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < HIDDEN
    offs_k = tl.arange(0, BLOCK_K)
    a_off = pairs[:, None] * stride_at + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        row = (e * HIDDEN).to(tl.int32) + pid_n * BLOCK_N  # rows of the [E * H, I] view
        for k0 in range(0, INTER, BLOCK_K):
            if EVEN_K:
                a = tl.load(act_ptr + k0 + a_off, mask=valid[:, None], other=0.0)
            else:
                a = tl.load(act_ptr + k0 + a_off, mask=valid[:, None] & (offs_k < INTER - k0)[None, :], other=0.0)
            b = w_desc.load([row, k0])
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    else:
        w_base = w_ptr + e * stride_we
        b_off = offs_n[None, :] * stride_wn + offs_k[:, None]
        for k0 in range(0, INTER, BLOCK_K):
            if EVEN_K:
                a = tl.load(act_ptr + k0 + a_off, mask=valid[:, None], other=0.0)
                b = tl.load(w_base + k0 + b_off, mask=n_mask[None, :], other=0.0)
            else:
                k_mask = offs_k < INTER - k0
                a = tl.load(act_ptr + k0 + a_off, mask=valid[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(w_base + k0 + b_off, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    w = tl.load(weights_ptr + pairs, mask=valid, other=0.0)
    y = acc.to(out_ptr.dtype.element_ty).to(tl.float32) * w[:, None]
    tl.store(out_ptr + pairs[:, None] * stride_ot + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _expert_tokens(ids_ptr, p, T, K_TOP: tl.constexpr, T_MAX: tl.constexpr, K_P2: tl.constexpr,
                   PAIRS_P2: tl.constexpr):
    """Expert ``e`` of pair ``p``; how many earlier pairs chose ``e`` (this program serves ``e``
    when none did); the pair row of each token ``[T_MAX]`` that chose ``e`` and which tokens did."""
    e = tl.load(ids_ptr + p)
    earlier = tl.arange(0, PAIRS_P2)
    prev = tl.load(ids_ptr + earlier, mask=earlier < p, other=-1)
    dup = tl.sum((prev == e).to(tl.int32), axis=0)
    t = tl.arange(0, T_MAX)
    kk = tl.arange(0, K_P2)
    ids = tl.load(ids_ptr + t[:, None] * K_TOP + kk[None, :], mask=(t[:, None] < T) & (kk[None, :] < K_TOP),
                  other=-1)
    hit = ids == e
    t_mask = tl.sum(hit.to(tl.int32), axis=1) > 0
    rows = t * K_TOP + tl.sum(tl.where(hit, kk[None, :], 0), axis=1)
    return e.to(tl.int64), dup, rows.to(tl.int64), t_mask


@triton.jit
def _small_gate_up_kernel(
    x_ptr, w_ptr, act_ptr, ids_ptr, T, INTER, HIDDEN,
    stride_xt, stride_we, stride_wn, stride_at,
    K_TOP: tl.constexpr, T_MAX: tl.constexpr, K_P2: tl.constexpr, PAIRS_P2: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, dup, rows, t_mask = _expert_tokens(ids_ptr, p, T, K_TOP, T_MAX, K_P2, PAIRS_P2)
    if (dup > 0) | (e < 0):
        return
    t = tl.arange(0, T_MAX).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((T_MAX, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((T_MAX, BLOCK_N), dtype=tl.float32)
    g_base = w_ptr + e * stride_we + offs_n[:, None] * stride_wn
    for k0 in range(0, HIDDEN, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < HIDDEN
        xs = tl.load(x_ptr + t[:, None] * stride_xt + k[None, :], mask=t_mask[:, None] & k_mask[None, :],
                     other=0.0).to(tl.float32)
        g = tl.load(g_base + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        u = tl.load(g_base + INTER * stride_wn + k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)
        acc_g += tl.sum(xs[:, None, :] * g[None, :, :], axis=2)
        acc_u += tl.sum(xs[:, None, :] * u[None, :, :], axis=2)
    act = _silu(acc_g.to(act_ptr.dtype.element_ty).to(tl.float32)) * acc_u.to(act_ptr.dtype.element_ty).to(tl.float32)
    tl.store(act_ptr + rows[:, None] * stride_at + offs_n[None, :], act.to(act_ptr.dtype.element_ty),
             mask=t_mask[:, None] & n_mask[None, :])


@triton.jit
def _small_down_kernel(
    act_ptr, w_ptr, out_ptr, weights_ptr, ids_ptr, T, HIDDEN, INTER,
    stride_at, stride_we, stride_wn, stride_ot,
    K_TOP: tl.constexpr, T_MAX: tl.constexpr, K_P2: tl.constexpr, PAIRS_P2: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, dup, rows, t_mask = _expert_tokens(ids_ptr, p, T, K_TOP, T_MAX, K_P2, PAIRS_P2)
    if (dup > 0) | (e < 0):
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < HIDDEN
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((T_MAX, BLOCK_N), dtype=tl.float32)
    b_base = w_ptr + e * stride_we + offs_n[:, None] * stride_wn
    for k0 in range(0, INTER, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < INTER
        a = tl.load(act_ptr + rows[:, None] * stride_at + k[None, :], mask=t_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)
        b = tl.load(b_base + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a[:, None, :] * b[None, :, :], axis=2)
    w = tl.load(weights_ptr + rows, mask=t_mask, other=0.0)
    y = acc.to(out_ptr.dtype.element_ty).to(tl.float32) * w[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=t_mask[:, None] & n_mask[None, :])


def _use_tma(w13: torch.Tensor, w2: torch.Tensor, block_k: int) -> bool:
    """Whether the grouped kernels read the weight tiles by TMA: Triton's host descriptors, an sm_90+
    GPU (or the interpreter), 16-bit contiguous weights with 16-byte aligned rows and base, and
    ``block_k`` of at least 16 bytes; ``TUNING["tma"]`` False turns it off."""
    if TensorDescriptor is None or not TUNING.get("tma", True) or w13.element_size() != 2:
        return False
    if w13.device.type == "cuda":
        if torch.version.hip is not None or torch.cuda.get_device_capability(w13.device)[0] < 9:
            return False
    elif not envs.triton_interpret():
        return False
    h, i = w13.shape[2], w2.shape[2]
    return (h * 2) % 16 == 0 and (i * 2) % 16 == 0 and w13.data_ptr() % 16 == 0 and w2.data_ptr() % 16 == 0 \
        and block_k * 2 >= 16


def _grouped_config(pairs: int, num_experts: int):
    avg = pairs / num_experts
    for limit, *cfg in TUNING["grouped"]:
        if limit is None or avg <= limit:
            return cfg
    return TUNING["grouped"][-1][1:]


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, path: str = "auto", partial: bool = False) -> torch.Tensor:
    """`kvpilot.kernels.moe.fused_moe_ref`'s value from the Triton kernels (module docstring).

    ``x`` ``[T, H]``, ``w13`` ``[E, 2I, H]`` and ``w2`` ``[E, H, I]`` in one float dtype, each
    contiguous in its last dimension; ``topk_weights`` ``[T, K]`` float32; ``topk_ids`` ``[T, K]``
    int. ``path``: ``"auto"`` (small-token path up to ``TUNING["small_max_tokens"]`` tokens),
    ``"small"`` or ``"grouped"`` (tests, benchmarks). ``partial``: ``topk_ids`` may hold ``-1``
    (another expert-parallel rank's expert; contributes zero: the per-pair output buffer is zeroed
    first, which the kernels otherwise skip). Returns ``[T, H]`` in ``x.dtype``.

    Raises:
        ValueError: shapes that disagree, an unknown ``path``.
    """
    _check(x, w13, w2, topk_weights, topk_ids)
    if path not in ("auto", "small", "grouped"):
        raise ValueError(f"path must be auto, small or grouped, got {path!r}")
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    pairs = num_tokens * top_k
    if two_i * hidden > _I32 or hidden * inter > _I32:
        raise ValueError(f"one expert's weights ({two_i} x {hidden}) exceed the kernels' 32-bit offsets")
    chunk = _I32 // (top_k * max(hidden, inter))  # tokens whose buffers 32-bit offsets address
    if num_tokens > chunk:
        return torch.cat([fused_moe_triton(x[i:i + chunk], w13, w2, topk_weights[i:i + chunk], topk_ids[i:i + chunk],
                                           path, partial) for i in range(0, num_tokens, chunk)])
    out = (torch.zeros if partial else torch.empty)(pairs, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out[:0]
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    ids = topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    small = path == "small" or (path == "auto" and num_tokens <= TUNING["small_max_tokens"])
    if small:
        t_max = triton.next_power_of_2(num_tokens)
        k_p2 = triton.next_power_of_2(top_k)
        pairs_p2 = triton.next_power_of_2(pairs)
        bn = TUNING["small_block_n"]
        bk = max(16, TUNING["small_tile"] // (t_max * bn))
        common = dict(K_TOP=top_k, T_MAX=t_max, K_P2=k_p2, PAIRS_P2=pairs_p2, BLOCK_N=bn, BLOCK_K=bk)
        _small_gate_up_kernel[(pairs, triton.cdiv(inter, bn))](
            x, w13, act, ids, num_tokens, inter, hidden, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
            **common)
        _small_down_kernel[(pairs, triton.cdiv(hidden, bn))](
            act, w2, out, weights, ids, num_tokens, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1),
            out.stride(0), **common)
    else:
        bm, bn, bk, group_m, warps, stages = _grouped_config(pairs, num_experts)
        sorted_pairs, block_e = moe_align(ids, num_experts, bm)
        blocks = block_e.numel()
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
        tma = _use_tma(w13, w2, bk)
        launch = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, PRECISION=precision, USE_TMA=tma,
                      num_warps=warps, num_stages=stages)
        # A descriptor per launch (cheap; inside a CUDA graph only at capture).
        d13 = TensorDescriptor.from_tensor(w13.view(-1, hidden), block_shape=[bn, bk]) if tma else w13
        d2 = TensorDescriptor.from_tensor(w2.view(-1, inter), block_shape=[bn, bk]) if tma else w2
        _grouped_gate_up_kernel[(blocks * triton.cdiv(inter, bn),)](
            x, w13, d13, act, sorted_pairs, block_e, pairs, inter, hidden, blocks,
            x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), K_TOP=top_k, EVEN_K=hidden % bk == 0,
            **launch)
        _grouped_down_kernel[(blocks * triton.cdiv(hidden, bn),)](
            act, w2, d2, out, weights, sorted_pairs, block_e, pairs, hidden, inter, blocks,
            act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), EVEN_K=inter % bk == 0, **launch)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
