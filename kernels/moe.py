"""Mixture-of-experts ops: routing, the PyTorch reference, token alignment, and the dispatcher.

Layouts (one MoE layer, ``E`` experts of intermediate size ``I`` on this rank, hidden size ``H``):

- ``w13`` ``[E, 2 * I, H]``: each expert's gate rows ``[0, I)`` then its up rows ``[I, 2I)``
  (``[gate | up]`` as `kvpilot.model.mlp.GatedMLP` stores them, one matrix per expert);
- ``w2`` ``[E, H, I]``: each expert's down projection;
- ``topk_ids`` ``[T, K]`` int (the ``K`` experts each of the ``T`` tokens is routed to, distinct per
  token; ``-1``: a choice whose expert another expert-parallel rank holds, which contributes zero
  here) and ``topk_weights`` ``[T, K]`` float32 (their routing weights).

`select_experts` turns router logits into those two; `fused_moe_ref` is the reference (a loop over
the experts that received tokens, what the engine runs on CPU); `moe_align` sorts the
``(token, slot)`` pairs by expert and pads each expert's run to a multiple of the GEMM row block
(the grouped GEMM's schedule); `fused_moe` runs the Triton kernels of ``kernels/fused_moe.py`` on
CUDA (backend ``"TRITON"``) and the reference otherwise (CPU, or backend ``"TORCH"``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MOE_BACKENDS = ("TRITON", "TORCH")
"""The values `fused_moe` (and `kvpilot.config.MoeConfig.backend`) accepts."""


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts (in float32), the ``top_k`` largest, optionally renormalised.

    ``router_logits`` ``[T, E]`` (any float dtype). Returns ``(topk_weights [T, top_k] float32,
    topk_ids [T, top_k] int64)``; ``renormalize`` divides the kept weights by their sum (Mixtral,
    Qwen3-MoE's ``norm_topk_prob``), as transformers' routers do (ties broken by `torch.topk`).

    Raises:
        ValueError: ``top_k`` outside ``[1, E]``.
    """
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _check(x, w13, w2, topk_weights, topk_ids) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe expects x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    e, two_i, h = w13.shape
    if two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2) or x.shape[1] != h:
        raise ValueError(f"fused_moe shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both "
                         f"be [T={x.shape[0]}, K]")


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """``sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with ``e = topk_ids[t, k]``.

    A loop over the experts that received tokens: each one's tokens gathered, its two matrix
    products in ``x.dtype``, the weighted outputs summed per token in float32 and rounded once to
    ``x.dtype``. Shapes: module docstring; returns ``[T, H]`` in ``x.dtype``. During a CUDA graph
    capture (where the loop's host read of the chosen experts is not allowed) every expert runs on
    every token, weighted by zero where not chosen: the same value, E times the work.

    Raises:
        ValueError: shapes that disagree.
    """
    _check(x, w13, w2, topk_weights, topk_ids)
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    flat_w = topk_weights.reshape(-1).float()
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        # Inside a CUDA graph nothing may be read back to the host: every expert over every token,
        # weighted by its routing weight (zero where not chosen).
        for e in range(w13.shape[0]):
            gate_up = F.linear(x, w13[e])
            y = F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w2[e])
            out += y.float() * (topk_weights.float() * (topk_ids == e)).sum(-1, keepdim=True)
        return out.to(x.dtype)
    tokens = torch.arange(x.shape[0], device=x.device).repeat_interleave(topk_ids.shape[1])
    for e in torch.unique(flat_ids).tolist():
        if e < 0:
            continue
        sel = (flat_ids == e).nonzero().squeeze(1)
        tok = tokens[sel]
        gate_up = F.linear(x[tok], w13[e])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(act, w2[e])
        out.index_add_(0, tok, y.float() * flat_w[sel, None])
    return out.to(x.dtype)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the ``(token, slot)`` pairs by expert, each expert's run padded to a multiple of ``block_m``.

    Pair ``p = t * K + k`` is token ``t``'s ``k``-th choice. Returns ``(sorted_pairs [B * block_m]
    int32, block_experts [B] int32)`` with ``B = ceil(T * K / block_m) + min(E, T * K)`` (an upper
    bound on the blocks, so nothing is read back to the host): row block ``b`` holds pairs of expert
    ``block_experts[b]`` (``-1``: an unused block, skipped by the kernels), padding slots hold
    ``T * K``. Experts that receive no token get no block; pairs of id ``-1`` (another rank's
    expert) are in blocks marked ``-1``. Stable: an expert's pairs keep token order. ``B`` counts
    one more run (``min(E + 1, T * K)``) for those.
    """
    flat = topk_ids.reshape(-1).long()
    flat = torch.where(flat < 0, num_experts, flat)  # another rank's choices: a run of their own, skipped
    tk = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    rank = torch.arange(tk, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_e]
    blocks = -(-tk // block_m) + min(num_experts + 1, tk)
    sorted_pairs = torch.full((blocks * block_m,), tk, dtype=torch.int32, device=device)
    sorted_pairs[starts[sorted_e] + rank] = order.to(torch.int32)
    block_e = torch.searchsorted(ends, torch.arange(blocks, device=device) * block_m, right=True)
    block_e = torch.where(block_e < num_experts, block_e, -1).to(torch.int32)
    return sorted_pairs, block_e


def check_backend(backend: str) -> str:
    """``backend`` upper-cased if `fused_moe` implements it.

    Raises:
        ValueError: any other value; the message names the supported backends.
    """
    name = str(backend).upper()
    if name not in MOE_BACKENDS:
        raise ValueError(f"MoE backend {backend!r} is not supported; kvpilot implements "
                         f"{', '.join(repr(b) for b in MOE_BACKENDS)} (TensorRT-LLM's CUTLASS, TRTLLM, DEEPGEMM, "
                         f"... kernels are not part of kvpilot)")
    return name


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, backend: str = "TRITON", partial: bool = False) -> torch.Tensor:
    """The MoE experts' output ``[T, H]`` in ``x.dtype`` (`fused_moe_ref`'s contract).

    ``backend`` ``"TRITON"``: ``kernels/fused_moe.py`` when ``x`` is on CUDA and Triton imports,
    else the reference; ``"TORCH"``: the reference everywhere. ``partial``: ``topk_ids`` may hold
    ``-1`` (expert parallelism; the Triton path then zeroes the rows those choices leave unwritten).
    """
    from kvpilot.kernels import triton_available

    if check_backend(backend) == "TRITON" and x.is_cuda and triton_available():
        from kvpilot.kernels.fused_moe import fused_moe_triton

        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, partial=partial)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
