"""Triton paged attention for mixed prefill-chunk / decode batches: `paged_attention_triton`
validates a call and launches the prefill kernel (`prefill_attention`) and/or the decode kernel
(`decode_attention`). The one-launch decode of small batches is `fused_decode_attention`. Layouts
and algorithms: docs/kernels.md.
"""

from __future__ import annotations

import torch

from .attention_common import TUNING, attention_shape  # noqa: F401  (TUNING: the launch table)
from .decode_attention import launch_decode
from .prefill_attention import launch_prefill
from .reference import _check_attention_args, check_window_and_cap


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    num_splits: int | None = None,
    launch_kv_heads: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Triton paged attention; same contract as :func:`kvpilot.kernels.reference.paged_attention_ref`.

    ``max_query_len``/``max_seq_len`` must be true upper bounds (they size the grid; no device
    sync happens here). Decode-only batches (``max_query_len == 1``) take the split-K decode
    kernel, all others the prefill kernel; in a step of several sequences the one-token (decode)
    rows are then left to the decode kernel, launched after it
    (``TUNING["prefill"]["decode_rows_to_decode_kernel"]``). ``num_splits`` overrides the first
    kernel's context-split heuristic (tests use it). ``launch_kv_heads`` (default: the cache's KV-head
    count) is the KV-head count every launch decision assumes (the decode and prefill context splits,
    the decode kernel's full-batch launch), while the grids still cover all heads: a caller holding
    several tensor-parallel shards' heads passes one shard's count, so each head is computed exactly
    as on a rank holding one shard (engine/model/tp_invariant.py, ``Tuning.tp_invariant``; the values of
    one head never depend on the grid). The prefill launch depends only on shapes and these bounds, so a
    CUDA graph captured at padded sizes (padded tokens, sequences with empty query ranges,
    ``max_query_len`` = padded token count) replays it for any batch that fits. The innermost
    dimension of ``q`` and of the caches must be contiguous. ``sliding_window`` and
    ``logits_soft_cap`` as for the reference: each program's keys start at the first one its
    queries may see (pages wholly before the window are not read), and the split heuristics count
    at most ``sliding_window`` keys per decode query.

    The output is allocated with ``torch.empty``: rows of tokens that no sequence covers
    (``t >= query_start_loc[-1]``, the padding of a CUDA graph) are left unwritten and may hold
    any value, NaN included. Callers must not read them (the engine never samples them, and every
    later op of the model is row-wise, so they cannot leak into real rows).

    Raises:
        ValueError: on inconsistent shapes, a non-contiguous innermost dimension, or a
            ``launch_kv_heads`` that is not a positive divisor of the KV-head count, or a bad
            ``sliding_window``/``logits_soft_cap``.
    """
    _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    sliding_window, logits_soft_cap = check_window_and_cap(sliding_window, logits_soft_cap)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    out = torch.empty_like(q)  # rows no sequence covers (padding) stay unwritten
    S = attention_shape(q, k_cache, v_cache, out, block_tables, seq_lens, scale, launch_kv_heads, sliding_window,
                        logits_soft_cap)
    if S.num_seqs == 0 or S.num_tokens == 0 or max_query_len <= 0:
        return out
    seq_lens = seq_lens.to(torch.int32)
    query_start_loc = query_start_loc.to(torch.int32)
    if max_query_len > 1:
        if not launch_prefill(q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, S, max_query_len,
                              num_splits):
            return out
        num_splits = None  # an override was the prefill kernel's
    launch_decode(q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, S, max_seq_len, num_splits)
    return out
