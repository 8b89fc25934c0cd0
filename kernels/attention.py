"""Triton paged attention for mixed prefill-chunk / decode batches.

The kernels (docs/kernels.md has the details):

- ``_prefill_kernel``: one program per (work tile, kv head). Sequence ``i`` has
  ``cdiv(q_len_i, BLOCK_Q)`` query tiles; the tiles of all sequences form one flat list, and each
  program finds its (sequence, query tile) from ``query_start_loc`` on the device. The grid is an
  upper bound computed from shapes (`prefill_max_tiles`), so one launch serves any batch of the
  same padded size: CUDA graphs of prefill and mixed steps replay it, and programs past the last
  tile exit at once. The rows of a tile are (query, head-in-group) pairs, so the query heads that
  share a kv head read each K/V tile once. Flash-attention online softmax over the cache,
  gathered page by page through the block table, with the causal limit of the tile's last query.
  Used whenever ``max_query_len > 1``; the decodes of such a mixed batch are one-query tiles.
  (Sending them to the decode kernel instead cost two extra launches and measured slower on an
  H200.) Small steps split each tile's context (`prefill_num_splits`), merged by
  ``_prefill_reduce_kernel``.
- ``_decode_kernel`` + ``_reduce_kernel``: decode-only batches (``max_query_len == 1``). One program
  per (sequence, kv head, context split); the whole GQA group is one tile. With more than one split
  (flash-decoding, for long contexts and few sequences) each program writes a normalised partial
  output and its log-sum-exp, and the reduction kernel merges them.
- ``_rotary_decode_kernel``: the decode kernel with the rotary embedding, the new token's KV-cache write
  and the split merge folded in (one launch instead of three), for decode-only batches of at most
  ``TUNING["decode"]["fused_rotary_max_seqs"]`` sequences (`rotary_decode_attention_triton`).

All accumulation is fp32; softmax uses ``exp2`` with the scale folded into ``log2(e)``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os

import torch
import triton
import triton.language as tl

from .kv_cache import _saturate, _to_cache
from .pdl import launch_options, pdl_enter, pdl_mode, pdl_trigger, pdl_wait

from .reference import _check_attention_args, _check_rotary_args, _check_write_args

logger = logging.getLogger(__name__)

try:  # host-side TMA descriptors (Triton >= 3.3), for `_decode_tma_kernel`
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None

_LOG2E = 1.4426950408889634

# Launch parameters, chosen by benchmarks/kernels_gpu.py on an H200 (docs/kernels.md). Tiles are
# halved for head_dim > 128 to bound registers. Module-level so the benchmark can sweep them.
TUNING = {
    # Decode contexts are split only when (sequences x kv heads) < no_split_per_sm * SMs, into
    # about programs_per_sm * SMs programs.
    "decode": {
        "block_n": 64,
        "num_warps": 4,
        "num_stages": 2,
        "programs_per_sm": 4,
        "no_split_per_sm": 2,
        # Fewest keys one split handles (rounded up to block_n); each sequence splits its own
        # context, so a short one in a graph captured for a long bound still gets several programs.
        # H200, batch 1, 512 keys, graph bound 2,048: 6.6 us with 64, 8.3 with 128, 11.6 with 256.
        "min_split_tokens": 64,
        # Launch of batches that fill the GPU without splits (programs >= no_split_per_sm * SMs):
        # bandwidth-bound, best with more, smaller programs in flight (H200, batch 256 x 1,280 keys:
        # 318 us per layer against 338 us with 4 warps and 2 stages; BENCHMARKS.md).
        "batch_num_warps": 2,
        "batch_num_stages": 3,
        "batch_num_stages_fp8": 2,  # FP8 cache, same case: 254 us with 2 stages, 264 us with 3
        # Register cap of the full-batch launch (ptxas .maxnreg; None = the compiler's choice). The
        # FP8 kernel used 207 registers a thread, so only 4 programs (8 warps) fit an SM and it ran
        # latency-bound at 45% of DRAM bandwidth (ncu). Capped at 168 (6 programs per SM) it took
        # 241.5 instead of 253.5 us per layer at batch 256 x 1,280 keys and 402 instead of 438 us at
        # batch 448 (H200; 128 spilled: 274 us). The bf16 kernel is bandwidth-bound already.
        "batch_maxnreg": None,
        "batch_maxnreg_fp8": 168,
        # Launches without context splits rescale the running output only in key tiles where a
        # row's max moved (alpha is exactly 1 otherwise). FP8 cache, batch 492 x 1,200 keys: 386.4
        # instead of 402.7 us per layer (H200, BENCHMARKS.md sixth session). Not bit-identical on
        # the GPU: the tensor-core sum then accumulates into acc instead of being added to acc *
        # alpha, so 1-3 of ~400k outputs differ by one bf16 ulp (seventh session). Split launches
        # (long contexts at small batch) keep the eager update: lazy measured 6-8% slower there.
        "lazy_rescale": True,
        # Decode-only batches of at most this many sequences run `rotary_decode_attention_triton`
        # (rotary + KV write + split decode + merge in one launch) instead of three launches.
        "fused_rotary_max_seqs": 8,
        # Launch of `rotary_decode_attention_triton` (tests/benchmarks may override them): warps,
        # most context splits (its last split merges them all, `fused_merge_rows` (heads x splits)
        # at a time, one L2 round trip each).
        # Warps: 4 up to `fused_long_keys` keys (the launch's bound), 2 above (H200, batch 1, FP8
        # cache: 0.3-0.6 us per layer more at 512 keys with 2; 3.9 and 8.5 us less at 4,096 and
        # 16,384 keys).
        "fused_num_warps": 4,
        "fused_num_warps_long": 2,
        "fused_long_keys": 2048,
        "fused_max_splits": 64,
        "fused_merge_rows": 64,
        # Full-batch launches (no context splits) through `_decode_tma_kernel`: each page's keys and
        # values of a kv head come by TMA, ``batch_tma_pages`` pages per loop step, through a
        # shared-memory ring that Triton's pipeliner sizes from ``batch_tma_stages``, so they cost no
        # address registers; per cache dtype. One warp per program keeps the row max, the row sum and
        # the probabilities in registers (no barrier per page). H200, FP8 cache, one layer, batch x
        # ~1,200 keys: 91 / 197 / 278 / 327 us at batch 128 / 256 / 384 / 492 against 142 / 227 / 315
        # / 421 us with `_decode_kernel` (75-87% of the copy rate against 52-71%; BENCHMARKS.md,
        # fourteenth session); 2 or 4 warps were slower than the pointer kernel at batch 492. bf16
        # cache, batch 256 / 492: 301 / 566 us against 317 / 570 us.
        "batch_tma": True,
        "batch_tma_fp8": True,
        "batch_tma_pages": 1,
        "batch_tma_warps": 1,
        "batch_tma_stages": 5,
        "batch_tma_maxnreg": None,
    },
    "prefill": {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2, "max_splits": 16,
                "programs_per_sm": 4,
                # Mixed steps: one-token (decode) rows go to the decode kernel, launched after the
                # prefill kernel, instead of a 64-row prefill tile each.
                "decode_rows_to_decode_kernel": True},
}


def decode_tuning_from_json(text: str) -> dict:
    """The ``TUNING["decode"]`` entries of ``text``, a JSON object such as '{"batch_tma_fp8": false}'
    (``KVPILOT_DECODE_TUNING``, applied at import so that benchmarks can A/B launch options in
    engines of their own).

    Raises:
        ValueError: not a JSON object, a key ``TUNING["decode"]`` does not have, or a
            ``batch_tma_pages`` other than 1 or 2.
    """
    try:
        over = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"KVPILOT_DECODE_TUNING is not JSON: {e}") from None
    if not isinstance(over, dict):
        raise ValueError(f"KVPILOT_DECODE_TUNING must be a JSON object, got {type(over).__name__}")
    unknown = sorted(set(over) - set(TUNING["decode"]))
    if unknown:
        raise ValueError(f"KVPILOT_DECODE_TUNING: unknown keys {unknown}; known: {sorted(TUNING['decode'])}")
    if over.get("batch_tma_pages", 1) not in (1, 2):
        raise ValueError(f"KVPILOT_DECODE_TUNING: batch_tma_pages must be 1 or 2, got {over['batch_tma_pages']!r}")
    return over


if os.environ.get("KVPILOT_DECODE_TUNING"):
    TUNING["decode"].update(decode_tuning_from_json(os.environ["KVPILOT_DECODE_TUNING"]))
# Sequences per step of the prefill kernel's tile lookup (it scans query_start_loc in chunks): one
# step for the default 256-sequence batches, so programs past the last tile exit after one load.
_SEQ_CHUNK = 256


@triton.jit
def _prefill_tile(qsl_ptr, num_seqs, t, BLOCK_Q: tl.constexpr, SEQ_CHUNK: tl.constexpr):
    """Work tile ``t`` of the flat tile list -> (its sequence, its query tile there, number of tiles).

    Sequence ``i`` owns ``cdiv(q_len_i, BLOCK_Q)`` consecutive tiles (none for ``q_len 0``). The
    prefix sums are taken here from ``query_start_loc`` in chunks of ``SEQ_CHUNK`` sequences, so the
    map needs no host-side data and the grid depends on shapes only (CUDA-graph safe).
    """
    seq = 0  # sequences whose tiles all come before t
    before = 0  # their tiles
    total = 0
    for c in range(0, num_seqs, SEQ_CHUNK):
        i = c + tl.arange(0, SEQ_CHUNK)
        ok = i < num_seqs
        lo = tl.load(qsl_ptr + i, mask=ok, other=0)
        hi = tl.load(qsl_ptr + i + 1, mask=ok, other=0)
        n_tiles = tl.where(ok, (hi - lo + BLOCK_Q - 1) // BLOCK_Q, 0)
        end = tl.cumsum(n_tiles, 0) + total  # one past each sequence's last tile
        done = end <= t
        seq += tl.sum(done.to(tl.int32), 0)
        before += tl.sum(tl.where(done, n_tiles, 0), 0)
        total += tl.sum(n_tiles, 0)
    return seq, t - before, total


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, seq_lens_ptr, qsl_ptr,
    scale_log2, num_seqs,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, KV_F16: tl.constexpr,
    SEQ_CHUNK: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SKIP_DECODE: tl.constexpr,
):  # fmt: skip
    # Programs walk the tile list backwards: the last tiles of a sequence see the most keys, and
    # starting them first shortens the tail of the launch. Programs past the last tile exit first.
    t = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq, q_tile, num_tiles = _prefill_tile(qsl_ptr, num_seqs, t, BLOCK_Q, SEQ_CHUNK)
    if t >= num_tiles:
        return
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if SKIP_DECODE & (q_len == 1):  # the decode kernel, launched after this one, owns these rows
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = ctx_len + q_idx
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    elif KV_F16:  # an FP8 cache: dots in fp16 (e4m3 -> f16 is one conversion; -> bf16 is several)
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    # The tile's last query bounds the keys any of its rows may see.
    kv_end = tl.minimum(seq_len, ctx_len + (q_tile + 1) * BLOCK_Q)
    if NUM_SPLITS == 1:
        kv_lo = 0
        kv_hi = kv_end
    else:  # split `split` of the context, in whole BLOCK_N tiles
        per = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = tl.program_id(2) * per
        kv_hi = tl.minimum(kv_end, kv_lo + per)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_hi
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        off = n % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr + blk[None, :] * stride_kb + off[None, :] * stride_ks
            + kv_head * stride_kh + d[:, None],
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # fmt: skip
        if DOT_FP32:
            k = k.to(tl.float32)
        else:  # an FP8 cache: dot in the queries' dtype (a no-op for 16-bit caches)
            k = k.to(q.dtype)
        s = tl.dot(q, k, input_precision=PRECISION) * scale_log2
        allowed = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with nothing visible yet (padding rows) keep m = -inf; shift by 0 to avoid NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs
            + kv_head * stride_vh + d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # fmt: skip
        if DOT_FP32:
            v = v.to(tl.float32)
        else:  # an FP8 cache: dot in the queries' dtype (a no-op for 16-bit caches)
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        # part_out: [num_tokens, NUM_HEADS, NUM_SPLITS, HEAD_DIM_PAD]; part_lse: [.., NUM_SPLITS].
        # Every split writes every row of its tile: an empty one (past the context, or before
        # the row's first visible key) writes log2-sum-exp -inf, which the reduction skips.
        row = (token * NUM_HEADS + head) * NUM_SPLITS + tl.program_id(2)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM_PAD + d[None, :], out, mask=row_ok[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(part_lse_ptr + row, lse, mask=row_ok)


@triton.jit
def _prefill_reduce_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):  # fmt: skip
    """Merge the context splits of one (token, head) of `_prefill_kernel`. Tokens no sequence
    covers read unwritten partials and produce garbage rows (allowed: padding)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    row = (token * NUM_HEADS + head) * NUM_SPLITS + sp
    lse = tl.load(part_lse_ptr + row, mask=sp < NUM_SPLITS, other=float("-inf"))
    ok = lse > float("-inf")  # split 0 always holds key 0, so a real row has one
    w = tl.where(ok, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    w = w / tl.sum(w, 0)
    d = tl.arange(0, HEAD_DIM_PAD)
    part = tl.load(part_out_ptr + row[:, None] * HEAD_DIM_PAD + d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(part * w[:, None], 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _split_size(seq_len, num_splits, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """Keys per split of one sequence: its own context over ``num_splits``, in whole ``BLOCK_N``
    tiles and at least ``MIN_SPLIT``. Taken from the sequence's length on the device (not from the
    launch's upper bound), so a CUDA graph captured for a long context bound still spreads a short
    context over several programs; the decode and reduce kernels compute it alike."""
    per = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(per, MIN_SPLIT)


@triton.jit
def _dot_queries(q, DOT_FP32: tl.constexpr, KV_F16: tl.constexpr):
    """Queries in the dtype of the decode kernels' dots: fp32 (``DOT_FP32``), fp16 saturated at
    +-65504 for an FP8 cache (``KV_F16``: e4m3 -> f16 is one conversion, -> bf16 several), else
    unchanged."""
    if DOT_FP32:
        q = q.to(tl.float32)
    elif KV_F16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    return q


@triton.jit
def _attend_keys(
    q, scale_log2, k_cache_ptr, v_cache_ptr, bt_row, kv_head, kv_start, kv_end, d, d_ok,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    BLOCK_G: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, LAZY_RESCALE: tl.constexpr,
    blk_first=None, FIRST_PRELOADED: tl.constexpr = False,
):  # fmt: skip
    """Online softmax of one GQA group's queries ``q`` ``[BLOCK_G, HEAD_DIM_PAD]`` over keys
    ``[kv_start, kv_end)`` of one kv head (scores times ``scale_log2``), gathered tile by tile through
    the block-table row ``bt_row``. Returns ``(acc, m_i, l_i)``: the unnormalised fp32 output
    ``[BLOCK_G, HEAD_DIM_PAD]``, the running max and the softmax denominator (log2 domain), both
    ``[BLOCK_G]``. With
    ``FIRST_PRELOADED``, ``blk_first`` ``[BLOCK_N]`` int64 holds the first tile's cache blocks, loaded
    by the caller (e.g. before its PDL wait)."""
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM_PAD], dtype=tl.float32)
    for start in range(kv_start, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        if FIRST_PRELOADED:
            later = n < tl.where(start != kv_start, kv_end, 0)  # n_ok, except in the first tile
            blk = tl.load(bt_row + n // BLOCK_SIZE, mask=later, other=0).to(tl.int64)
            blk = tl.where(start == kv_start, blk_first, blk)
        else:
            blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        off = n % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr + blk[None, :] * stride_kb + off[None, :] * stride_ks
            + kv_head * stride_kh + d[:, None],
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # fmt: skip
        if DOT_FP32:
            k = k.to(tl.float32)
        else:  # an FP8 cache: dot in the queries' dtype (a no-op for 16-bit caches)
            k = k.to(q.dtype)
        s = tl.dot(q, k, input_precision=PRECISION) * scale_log2
        s = tl.where(n_ok[None, :], s, float("-inf"))
        # Every split has at least one valid key, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if LAZY_RESCALE:  # rescale only when a row's max moved (alpha would be exactly 1 otherwise)
            # Each branch forms l_i as the eager update does (one fused multiply-add on the GPU;
            # fma(l, 1, x) is l + x); acc may differ from the eager kernel's in the last bit.
            if tl.max(m_new - m_i, 0) > 0:
                alpha = tl.exp2(m_i - m_new)
                acc = acc * alpha[:, None]
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                m_i = m_new
            else:
                p = tl.exp2(s - m_i[:, None])
                l_i = l_i + tl.sum(p, 1)
        else:
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs
            + kv_head * stride_vh + d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # fmt: skip
        if DOT_FP32:
            v = v.to(tl.float32)
        else:  # an FP8 cache: dot in the queries' dtype (a no-op for 16-bit caches)
            v = v.to(q.dtype)
        if LAZY_RESCALE:
            acc = acc + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
    return acc, m_i, l_i


# The split count and the block-table row stride change from step to step (eager steps): as runtime
# values that Triton does not specialise on, they do not compile a new kernel variant each time one
# is seen for the first time (each compile stalled an H200 engine step for ~1 s).
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, seq_lens_ptr, qsl_ptr,
    scale_log2, num_splits,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    NUM_HEADS: tl.constexpr, SPLIT: tl.constexpr, MIN_SPLIT: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr, KV_F16: tl.constexpr, LAZY_RESCALE: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(USE_PDL)  # kernels/pdl.py: before any memory access
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    partition_size = _split_size(seq_len, num_splits, BLOCK_N, MIN_SPLIT)
    kv_start = split * partition_size
    if (q_len != 1) | (kv_start >= seq_len):  # q_len 0: a padded sequence
        return
    kv_end = tl.minimum(seq_len, kv_start + partition_size)

    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    token = q_start.to(tl.int64)
    q = tl.load(
        q_ptr + token * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q = _dot_queries(q, DOT_FP32, KV_F16)
    acc, m_i, l_i = _attend_keys(
        q, scale_log2, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head, kv_start,
        kv_end, d, d_ok, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        BLOCK_G, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, PRECISION, DOT_FP32, LAZY_RESCALE,
    )  # fmt: skip

    out = acc / l_i[:, None]
    if not SPLIT:
        tl.store(
            out_ptr + token * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None] & d_ok[None, :],
        )
    else:
        # part_out: [num_seqs, NUM_HEADS, num_splits, HEAD_DIM_PAD]; part_lse: [.., num_splits].
        row = (seq.to(tl.int64) * NUM_HEADS + head) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM_PAD + d[None, :], out, mask=g_ok[:, None])
        tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=g_ok)


@triton.jit
def _tma_tile(
    q, scale_log2, k_desc, v_desc, bt_row, start, seq_len, col, m_i, l_i, acc,
    BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr, MASKED: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, LAZY_RESCALE: tl.constexpr,
):  # fmt: skip
    """One online-softmax step of `_decode_tma_kernel` over ``PAGES`` (1 or 2) cache pages from key
    ``start`` (a page boundary): each page's keys and values of one kv head come as one TMA box
    ``[BLOCK_SIZE, HEAD_DIM]`` (rows ``blk * BLOCK_SIZE`` of the cache's 2-D view, columns ``col``).
    ``MASKED`` (the last tile only): keys past ``seq_len`` get score -inf and their value rows are
    zeroed, since a box reads whole pages and stale bytes may decode to NaN; a page wholly past the
    context reads block 0. Returns the updated ``(m_i, l_i, acc)`` as `_attend_keys` keeps them."""
    page = start // BLOCK_SIZE
    n_a = start + tl.arange(0, BLOCK_SIZE)
    blk_a = tl.load(bt_row + page).to(tl.int32)
    k_a = k_desc.load([blk_a * BLOCK_SIZE, col])
    k_a = k_a.to(tl.float32) if DOT_FP32 else k_a.to(q.dtype)  # FP8: dot in the queries' dtype
    s_a = tl.dot(q, tl.trans(k_a), input_precision=PRECISION) * scale_log2
    if MASKED:
        s_a = tl.where((n_a < seq_len)[None, :], s_a, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s_a, 1))  # finite: the first page has a key
    if PAGES == 2:
        n_b = n_a + BLOCK_SIZE
        if MASKED:
            blk_b = tl.load(bt_row + page + 1, mask=start + BLOCK_SIZE < seq_len, other=0).to(tl.int32)
        else:
            blk_b = tl.load(bt_row + page + 1).to(tl.int32)
        k_b = k_desc.load([blk_b * BLOCK_SIZE, col])
        k_b = k_b.to(tl.float32) if DOT_FP32 else k_b.to(q.dtype)
        s_b = tl.dot(q, tl.trans(k_b), input_precision=PRECISION) * scale_log2
        if MASKED:
            s_b = tl.where((n_b < seq_len)[None, :], s_b, float("-inf"))
        m_new = tl.maximum(m_new, tl.max(s_b, 1))
    moved = True
    if LAZY_RESCALE:  # as in `_attend_keys`: rescale only when a row's max moved
        moved = tl.max(m_new - m_i, 0) > 0
    if moved:
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_new
    p_a = tl.exp2(s_a - m_i[:, None])
    l_i = l_i + tl.sum(p_a, 1)
    v_a = v_desc.load([blk_a * BLOCK_SIZE, col])
    v_a = v_a.to(tl.float32) if DOT_FP32 else v_a.to(q.dtype)
    if MASKED:
        v_a = tl.where((n_a < seq_len)[:, None], v_a, 0.0)
    acc = acc + tl.dot(p_a.to(v_a.dtype), v_a, input_precision=PRECISION)
    if PAGES == 2:
        p_b = tl.exp2(s_b - m_i[:, None])
        l_i = l_i + tl.sum(p_b, 1)
        v_b = v_desc.load([blk_b * BLOCK_SIZE, col])
        v_b = v_b.to(tl.float32) if DOT_FP32 else v_b.to(q.dtype)
        if MASKED:
            v_b = tl.where((n_b < seq_len)[:, None], v_b, 0.0)
        acc = acc + tl.dot(p_b.to(v_b.dtype), v_b, input_precision=PRECISION)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_tma_kernel(
    q_ptr, k_desc, v_desc, out_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
    scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr, KV_F16: tl.constexpr, LAZY_RESCALE: tl.constexpr,
):  # fmt: skip
    # Decode without context splits, grid (seq, kv head): `_decode_kernel`'s full-batch case with the
    # K/V pages fetched by TMA (``k_desc``/``v_desc``: 2-D views [blocks * BLOCK_SIZE, kv heads *
    # HEAD_DIM] of the caches, box [BLOCK_SIZE, HEAD_DIM]), ``PAGES`` pages per loop step. The
    # pipeliner keeps the boxes in flight in shared memory, so they cost no address registers. No PDL:
    # a full batch has more sequences than kernels/pdl.py's PDL_MAX_ROWS.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    if (q_len != 1) | (seq_len <= 0):  # q_len 0: a padded sequence
        return
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    token = q_start.to(tl.int64)
    q = tl.load(q_ptr + token * stride_qt + head[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0)
    q = _dot_queries(q, DOT_FP32, KV_F16)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    col = kv_head * HEAD_DIM
    full_end = seq_len // (BLOCK_SIZE * PAGES) * (BLOCK_SIZE * PAGES)
    for start in range(0, full_end, BLOCK_SIZE * PAGES):
        m_i, l_i, acc = _tma_tile(q, scale_log2, k_desc, v_desc, bt_row, start, seq_len, col, m_i, l_i, acc,
                                  BLOCK_SIZE, PAGES, False, PRECISION, DOT_FP32, LAZY_RESCALE)
    if full_end < seq_len:
        m_i, l_i, acc = _tma_tile(q, scale_log2, k_desc, v_desc, bt_row, full_end, seq_len, col, m_i, l_i, acc,
                                  BLOCK_SIZE, PAGES, True, PRECISION, DOT_FP32, LAZY_RESCALE)
    out = acc / l_i[:, None]
    tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g_ok[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr, qsl_ptr, num_splits,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(USE_PDL)  # kernels/pdl.py: before any memory access
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) - q_start != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_valid = tl.cdiv(seq_len, _split_size(seq_len, num_splits, BLOCK_N, MIN_SPLIT))
    sp = tl.arange(0, SPLITS_PAD)
    sp_ok = (sp < num_valid) & (sp < num_splits)
    row = (seq.to(tl.int64) * NUM_HEADS + head) * num_splits + sp
    lse = tl.load(part_lse_ptr + row, mask=sp_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    d = tl.arange(0, HEAD_DIM_PAD)
    part = tl.load(part_out_ptr + row[:, None] * HEAD_DIM_PAD + d[None, :], mask=sp_ok[:, None], other=0.0)
    out = tl.sum(part * w[:, None], 0)
    tl.store(
        out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


@triton.jit
def _rotate_half(x_ptrs, partner_ptrs, mask, cos, sin, lo):
    """Rotary embedding (rotate-half convention, `kvpilot.kernels.reference.apply_rotary_ref`) of the
    rows at ``x_ptrs``: ``x * cos + rotate_half(x) * sin`` in fp32, where element ``d`` of
    ``rotate_half(x)`` is ``-x[d + HALF]`` for ``d < HALF`` (``lo``) and ``x[d - HALF]`` after;
    ``partner_ptrs`` point at ``x[d +- HALF]`` and ``cos``/``sin`` are repeated over both halves."""
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(partner_ptrs, mask=mask, other=0.0).to(tl.float32)
    return x * cos + tl.where(lo, -xp, xp) * sin


# num_splits and the block-table stride as runtime values, as for _decode_kernel.
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _rotary_decode_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, slot_ptr,
    k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, counter_ptr,
    block_tables_ptr, seq_lens_ptr, qsl_ptr,
    scale_log2, num_splits,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cs,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, SPLIT: tl.constexpr, MIN_SPLIT: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr, KV_F16: tl.constexpr, SATURATE: tl.constexpr,
    MERGE_CHUNK: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """`_rotary_write_kv_kernel` + `_decode_kernel` + `_reduce_kernel` in one launch (decode-only
    batches). Program (sequence, kv head, split) rotates its group's queries in registers; the
    program holding the sequence's last key (the new token) first rotates that token's key and
    writes it and its value to the cache slot (visible to its own threads after a CTA barrier), then
    every program walks its keys as `_decode_kernel` does. With
    splits, each program stores its partial output and log-sum-exp, then counts itself done on the
    (sequence, kv head)'s counter; the last one to finish merges the partials and resets the
    counter to 0 (stream-K style fix-up, as in CUTLASS's split-K serial reduction)."""
    # With PDL (kernels/pdl.py) this kernel waits for the QKV projection only after loading the
    # step's metadata and the rotary table below: no kernel of the step writes them (the metadata is
    # copied before its first kernel). On an H200, 0.9-1.0 us less per layer at 512-16,384 keys
    # (BENCHMARKS.md, thirteenth session). tests/pdl_order_check.py allows these loads (EARLY_LOADS).
    pdl_trigger(USE_PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    partition_size = _split_size(seq_len, num_splits, BLOCK_N, MIN_SPLIT)
    kv_start = split * partition_size
    if (q_len != 1) | (kv_start >= seq_len):  # q_len 0: a padded sequence
        # Idle. Split 0 waits first, so the grid never completes before the kernel it depends on
        # (kernels/pdl.py's rule; the later splits may skip the wait, split 0 of the grid holds it).
        if split == 0:
            pdl_wait(USE_PDL)
        return
    kv_end = tl.minimum(seq_len, kv_start + partition_size)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    n0 = kv_start + tl.arange(0, BLOCK_N)
    blk_first = tl.load(bt_row + n0 // BLOCK_SIZE, mask=n0 < kv_end, other=0).to(tl.int64)

    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    lo = d < HALF
    partner = tl.where(lo, d + HALF, d - HALF)
    token = q_start.to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cs = tl.where(lo, d, d - HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + cs, mask=d_ok, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + cs, mask=d_ok, other=0.0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    pdl_wait(USE_PDL)  # q, k, v: the QKV projection's output
    q_row = q_ptr + token * stride_qt + head[:, None] * stride_qh
    q_ok = g_ok[:, None] & d_ok[None, :]
    q = _rotate_half(q_row + d[None, :], q_row + partner[None, :], q_ok, cos[None, :], sin[None, :], lo[None, :])
    q = _dot_queries(q.to(q_ptr.dtype.element_ty), DOT_FP32, KV_F16)

    if kv_end == seq_len:  # this program's keys end with the new token: write it to its slot first
        if slot >= 0:
            k_row = k_ptr + token * stride_knt + kv_head * stride_knh
            k_new = _rotate_half(k_row + d, k_row + partner, d_ok, cos, sin, lo)
            v_new = tl.load(v_ptr + token * stride_vnt + kv_head * stride_vnh + d, mask=d_ok)
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            # Rounded to k's dtype first, as `_rotary_write_kv_kernel` does.
            tl.store(k_cache_ptr + blk * stride_kb + off * stride_ks + kv_head * stride_kh + d,
                     _to_cache(k_new.to(k_ptr.dtype.element_ty), k_cache_ptr, SATURATE), mask=d_ok)
            tl.store(v_cache_ptr + blk * stride_vb + off * stride_vs + kv_head * stride_vh + d,
                     _to_cache(v_new, v_cache_ptr, SATURATE), mask=d_ok)
        # The whole program reads the slot below: its writes are visible to the CTA after a barrier.
        # (Taking the new key from registers instead, the loop stopping short of it, measured slower
        # in the engine: BENCHMARKS.md, thirteenth session.)
        tl.debug_barrier()
    acc, m_i, l_i = _attend_keys(
        q, scale_log2, k_cache_ptr, v_cache_ptr, bt_row, kv_head, kv_start, kv_end, d, d_ok,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        BLOCK_G, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, PRECISION, DOT_FP32, False, blk_first, True,
    )  # fmt: skip
    out = acc / l_i[:, None]
    if not SPLIT:
        tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_ok)
    else:
        # part_out: [num_seqs, NUM_HEADS, num_splits, HEAD_DIM_PAD]; part_lse: [.., num_splits].
        base = (seq.to(tl.int64) * NUM_HEADS + head) * num_splits
        tl.store(part_out_ptr + (base + split)[:, None] * HEAD_DIM_PAD + d[None, :], out, mask=g_ok[:, None])
        tl.store(part_lse_ptr + base + split, m_i + tl.log2(l_i), mask=g_ok)
        # Every thread's partials are stored before the count (barrier); the atomic is acq_rel at
        # GPU scope, so the program that counts last sees every other program's partials.
        tl.debug_barrier()
        counter = counter_ptr + seq * NUM_KV_HEADS + kv_head
        done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        num_valid = tl.cdiv(seq_len, partition_size)
        if done == num_valid - 1:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch
            # Online merge of the partials, MERGE_CHUNK splits at a time ([GROUP_PAD, chunk, dims]).
            gm = tl.arange(0, GROUP_PAD)
            gm_ok = gm < GROUP
            head_m = kv_head * GROUP + gm
            base_m = (seq.to(tl.int64) * NUM_HEADS + head_m) * num_splits
            m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
            wsum = tl.zeros([GROUP_PAD], dtype=tl.float32)
            o = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
            for c in range(0, num_valid, MERGE_CHUNK):
                sp = c + tl.arange(0, MERGE_CHUNK)
                ok = gm_ok[:, None] & (sp < num_valid)[None, :]
                rows = base_m[:, None] + sp[None, :]
                lse = tl.load(part_lse_ptr + rows, mask=ok, other=float("-inf"), cache_modifier=".cg")
                m_new = tl.where(gm_ok, tl.maximum(m, tl.max(lse, 1)), 0.0)  # finite: split 0 is valid
                alpha = tl.exp2(m - m_new)
                w = tl.exp2(lse - m_new[:, None])
                part = tl.load(part_out_ptr + rows[:, :, None] * HEAD_DIM_PAD + d[None, None, :],
                               mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
                o = o * alpha[:, None] + tl.sum(part * w[:, :, None], 1)
                wsum = wsum * alpha + tl.sum(w, 1)
                m = m_new
            tl.store(out_ptr + token * stride_ot + head_m[:, None] * stride_oh + d[None, :],
                     (o / wsum[:, None]).to(out_ptr.dtype.element_ty), mask=gm_ok[:, None] & d_ok[None, :])


_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 4  # TRITON_INTERPRET=1 on CPU: any small number exercises the split path


def _pow2_at_least(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def prefill_block_q(group: int) -> tuple[int, int]:
    """(queries, rows) of one prefill tile for a GQA group of ``group`` query heads per kv head.

    A tile has ``BLOCK_M`` rows (``TUNING["prefill"]["block_m"]``, at least one group) holding
    ``BLOCK_M // group`` queries times the whole group. (Smaller tiles for small steps did not
    help: every tile still walks the whole context; see `prefill_num_splits`.)
    """
    block_m = max(TUNING["prefill"]["block_m"], triton.next_power_of_2(group))
    return block_m // group, block_m


def prefill_num_splits(num_tokens: int, block_q: int, num_kv_heads: int, sms: int) -> int:
    """Context splits of the prefill kernel, from shapes only (so a CUDA graph's launch stays valid).

    A step of few tokens is few (query tile, kv head) programs, each walking the whole cached
    context: 64 new tokens on a 4,000-token prefix are 32 programs of 64 K/V tiles each on an H200's
    132 SMs. When ``cdiv(num_tokens, block_q) * num_kv_heads`` is under half the SMs, each tile's
    context is cut into up to ``TUNING["prefill"]["max_splits"]`` pieces (about
    ``programs_per_sm`` programs per SM, as for decode), merged by `_prefill_reduce_kernel`.
    """
    cfg = TUNING["prefill"]
    programs = triton.cdiv(num_tokens, block_q) * num_kv_heads
    if 2 * programs >= sms:
        return 1
    return max(1, min(cfg.get("max_splits", 16), triton.cdiv(cfg.get("programs_per_sm", 4) * sms, programs)))


def prefill_max_tiles(num_tokens: int, num_seqs: int, max_query_len: int, block_q: int) -> int:
    """Upper bound of the prefill kernel's work tiles (grid axis 0), from shapes and host bounds only.

    Sequence ``i`` needs ``cdiv(q_len_i, block_q)`` tiles; summed, that is at most
    ``sum(q_len) // block_q`` full tiles plus one partial tile per sequence, and at most
    ``num_seqs * cdiv(max_query_len, block_q)``. A CUDA graph passes its padded token count, its
    padded sequence count and ``max_query_len = num_tokens``, so the bound holds for any batch that
    fits the graph; the kernel's programs past the real tile count exit at once.
    """
    return max(1, min(num_seqs * triton.cdiv(max_query_len, block_q), num_tokens // block_q + num_seqs))


def _num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Context splits for decode: enough programs to keep HBM busy, none shorter than
    ``TUNING["decode"]["min_split_tokens"]`` keys.

    One program per (sequence, kv head) is too few for long contexts and small batches (2 per SM
    reached only 67% of copy bandwidth on an H200), while splitting a batch that already fills the
    GPU costs ~10% (the reduction); see docs/kernels.md.
    """
    sms = _device_sms(device)
    cfg = TUNING["decode"]
    programs = max(1, num_seqs * num_kv_heads)
    if programs >= cfg["no_split_per_sm"] * sms:
        return 1
    want = math.ceil(cfg["programs_per_sm"] * sms / programs)
    return max(1, min(want, math.ceil(max_seq_len / cfg["min_split_tokens"]), 64))


def _decode_launch(num_seqs: int, launch_kv_heads: int, max_seq_len: int, head_dim_pad: int,
                   device: torch.device, num_splits: int | None) -> tuple[int, bool, int, int]:
    """``(splits, full, block_n, min_split)`` of a decode launch: the context splits (``num_splits``
    or `_num_splits`, capped so that each fills ``min_split`` keys of the longest context; each
    sequence then divides its own context over them, `_split_size`), whether the batch fills the GPU
    without splits (the full-batch launch options), the key tile and the fewest keys of a split."""
    cfg = TUNING["decode"]
    splits = num_splits or _num_splits(num_seqs, launch_kv_heads, max_seq_len, device)
    full = splits == 1 and num_seqs * launch_kv_heads >= cfg["no_split_per_sm"] * _device_sms(device)
    block_n = cfg["block_n"] if head_dim_pad <= 128 else cfg["block_n"] // 2
    min_split = max(block_n, triton.cdiv(cfg["min_split_tokens"], block_n) * block_n)
    splits = max(1, min(splits, triton.cdiv(max(max_seq_len, 1), min_split)))
    return splits, full, block_n, min_split


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
    as on a rank holding one shard (engine/model/tp_invariant.py, ``KVPILOT_TP_INVARIANT``; the values of
    one head never depend on the grid). The prefill launch depends only on shapes and these bounds, so a
    CUDA graph captured at padded sizes (padded tokens, sequences with empty query ranges,
    ``max_query_len`` = padded token count) replays it for any batch that fits. The innermost
    dimension of ``q`` and of the caches must be contiguous.

    The output is allocated with ``torch.empty``: rows of tokens that no sequence covers
    (``t >= query_start_loc[-1]``, the padding of a CUDA graph) are left unwritten and may hold
    any value, NaN included. Callers must not read them (the engine never samples them, and every
    later op of the model is row-wise, so they cannot leak into real rows).

    Raises:
        ValueError: on inconsistent shapes, a non-contiguous innermost dimension, or a
            ``launch_kv_heads`` that is not a positive divisor of the KV-head count.
    """
    _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    if launch_kv_heads is None:
        launch_kv_heads = num_kv_heads
    elif not (isinstance(launch_kv_heads, int) and launch_kv_heads >= 1 and num_kv_heads % launch_kv_heads == 0):
        raise ValueError(f"launch_kv_heads must be a positive divisor of the {num_kv_heads} KV heads, "
                         f"got {launch_kv_heads!r}")
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q)  # rows no sequence covers (padding) stay unwritten
    if num_seqs == 0 or num_tokens == 0 or max_query_len <= 0:
        return out
    seq_lens = seq_lens.to(torch.int32)
    query_start_loc = query_start_loc.to(torch.int32)
    head_dim_pad = _pow2_at_least(head_dim)
    # fp32 inputs would otherwise be rounded to tf32 inside tl.dot on recent GPUs.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    scale_log2 = float(scale) * _LOG2E
    # Triton's CPU interpreter computes bf16 tl.dot wrongly (triton 3.9), so upcast there.
    # An FP8 cache is read into fp16 dots (q rounded to fp16, saturating): on an H200 converting e4m3
    # to bf16 made the decode kernel compute-bound at about half the copy bandwidth.
    kv_f16 = k_cache.dtype in _FP8_DTYPES and q.dtype in (torch.bfloat16, torch.float16)
    dot_fp32 = q.dtype == torch.bfloat16 and not q.is_cuda and not kv_f16
    common_strides = (
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
    )  # fmt: skip

    if max_query_len > 1:
        cfg = TUNING["prefill"]
        # With several sequences some may be decodes (q_len 1); their rows are left to the decode
        # kernel below (the prefill reduction may write junk there first; the decode pass overwrites).
        split_decode = bool(cfg["decode_rows_to_decode_kernel"]) and num_seqs > 1
        block_q, block_m = prefill_block_q(group)
        block_n = cfg["block_n"] if head_dim_pad <= 128 else cfg["block_n"] // 2
        tiles = prefill_max_tiles(num_tokens, num_seqs, max_query_len, block_q)
        splits = num_splits or prefill_num_splits(num_tokens, block_q, launch_kv_heads, _device_sms(q.device))
        if splits > 1:
            part_out = torch.empty(num_tokens * num_heads * splits, head_dim_pad, dtype=torch.float32,
                                   device=q.device)
            part_lse = torch.empty(num_tokens * num_heads * splits, dtype=torch.float32, device=q.device)
        else:
            part_out = part_lse = out  # unused
        _prefill_kernel[(tiles, num_kv_heads, splits)](
            q, k_cache, v_cache, out, part_out, part_lse, block_tables, seq_lens, query_start_loc,
            scale_log2, num_seqs, *common_strides,
            GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
            BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision,
            DOT_FP32=dot_fp32, KV_F16=kv_f16,
            SEQ_CHUNK=_SEQ_CHUNK, NUM_HEADS=num_heads, NUM_SPLITS=splits, SKIP_DECODE=split_decode,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )  # fmt: skip
        if splits > 1:
            _prefill_reduce_kernel[(num_tokens, num_heads)](
                out, part_out, part_lse, out.stride(0), out.stride(1),
                NUM_HEADS=num_heads, NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits),
                HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, num_warps=1,
            )  # fmt: skip
        if not split_decode:
            return out
        num_splits = None  # an override above was the prefill kernel's

    cfg = TUNING["decode"]
    splits, full, block_n, min_split = _decode_launch(num_seqs, launch_kv_heads, max_seq_len, head_dim_pad,
                                                      q.device, num_splits)
    if splits > 1:
        part_out = torch.empty(
            num_seqs, num_heads, splits, head_dim_pad, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    pdl = pdl_mode(q.device, num_seqs)
    if splits == 1 and full and _tma_decode_reason(q, k_cache, v_cache, kv_f16) == "":
        _launch_decode_tma(q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, scale_log2,
                           precision, dot_fp32, kv_f16)
        return out
    maxnreg = cfg.get("batch_maxnreg_fp8" if kv_f16 else "batch_maxnreg")
    _decode_kernel[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, out, part_out, part_lse, block_tables, seq_lens, query_start_loc,
        scale_log2, splits, *common_strides,
        NUM_HEADS=num_heads, SPLIT=splits > 1, MIN_SPLIT=min_split, GROUP=group, BLOCK_G=_pow2_at_least(group),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        PRECISION=precision, DOT_FP32=dot_fp32, KV_F16=kv_f16,
        LAZY_RESCALE=bool(cfg.get("lazy_rescale")) and splits == 1,
        USE_PDL=pdl > 0, **launch_options(pdl),
        num_warps=cfg["batch_num_warps"] if full else cfg["num_warps"],
        num_stages=(cfg["batch_num_stages_fp8" if kv_f16 else "batch_num_stages"] if full else cfg["num_stages"]),
        # (a compile option: the CPU interpreter has no registers to cap)
        **({"maxnreg": maxnreg} if full and maxnreg and os.environ.get("TRITON_INTERPRET") != "1" else {}),
    )  # fmt: skip
    if splits > 1:
        _reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, seq_lens, query_start_loc, splits,
            out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, SPLITS_PAD=triton.next_power_of_2(splits),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_N=block_n, MIN_SPLIT=min_split,
            # One warp holds SPLITS_PAD x HEAD_DIM_PAD fp32 partials: past 16 splits of 128 dims
            # ptxas spilled registers (tests/compile_kernels.py), so more warps share them.
            num_warps=1 if triton.next_power_of_2(splits) * head_dim_pad <= 16 * 128 else 4,
            USE_PDL=pdl > 0, **launch_options(pdl),
        )  # fmt: skip
    return out


def _tma_decode_reason(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_f16: bool) -> str:
    """Why a full-batch decode launch cannot take `_decode_tma_kernel` ("" when it can): it must be
    switched on for the cache's dtype (``TUNING["decode"]["batch_tma_fp8"]`` / ``["batch_tma"]``),
    this Triton must have host-side TMA descriptors (and the GPU sm_90+), and each cache must be
    contiguous, with a page size and a head_dim that are powers of two from 16 to 256 and 16-byte
    rows and bases. Otherwise the launch takes `_decode_kernel`."""
    cfg = TUNING["decode"]
    if not cfg.get("batch_tma_fp8" if kv_f16 else "batch_tma"):
        return "switched off"
    if TensorDescriptor is None:
        return "this Triton has no host-side TMA descriptors"
    if q.is_cuda and (torch.version.hip or torch.cuda.get_device_capability(q.device)[0] < 9):
        return "TMA needs an NVIDIA GPU of sm_90 or newer"
    nb, block_size, heads, head_dim = k_cache.shape
    if k_cache.element_size() > 2:
        return "only 8- and 16-bit caches (the ones measured)"
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return "a cache is not contiguous"
    if block_size & (block_size - 1) or head_dim & (head_dim - 1) or not (16 <= min(block_size, head_dim)
                                                                          and max(block_size, head_dim) <= 256):
        return "page size and head_dim must be powers of two from 16 to 256 (tl.dot, TMA box)"
    if block_size * head_dim * k_cache.element_size() > _TMA_MAX_BOX_BYTES:
        return f"a page of one kv head is over {_TMA_MAX_BOX_BYTES} bytes (the kernel's shared memory)"
    if nb * block_size >= 2**31:
        return "more cache rows than a 32-bit TMA coordinate holds"
    if head_dim * k_cache.element_size() % 16 or k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16:
        return "TMA needs 16-byte rows and bases"
    return ""


# Largest TMA box (one page of one kv head) `_decode_tma_kernel` takes: the engine's bf16 page (32 x
# 128 x 2 bytes). Its shared memory grows with the box (K and V, several pipeline buffers, the
# score/probability exchange): a 64 KB box (bf16, 256 x 128) needed 266 KB against an H200's 227 KB
# (sm_90 compile, tests/compile_kernels.py).
_TMA_MAX_BOX_BYTES = 8192


def _launch_decode_tma(q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, scale_log2, precision,
                       dot_fp32, kv_f16) -> None:
    """Launch `_decode_tma_kernel` (one program per (sequence, kv head), no context splits) with the
    ``batch_tma_*`` launch options of ``TUNING["decode"]``."""
    cfg = TUNING["decode"]
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    nb, block_size, num_kv_heads, _ = k_cache.shape
    pages = cfg["batch_tma_pages"]
    if pages not in (1, 2):
        raise ValueError(f'TUNING["decode"]["batch_tma_pages"] must be 1 or 2, got {pages!r}')
    # A descriptor per launch (inside a CUDA graph only at capture), as the GEMV's TMA kind does.
    descs = [TensorDescriptor.from_tensor(c.view(nb * block_size, num_kv_heads * head_dim),
                                          block_shape=[block_size, head_dim]) for c in (k_cache, v_cache)]
    maxnreg = cfg.get("batch_tma_maxnreg")
    group = num_heads // num_kv_heads
    _decode_tma_kernel[(num_seqs, num_kv_heads)](
        q, descs[0], descs[1], out, block_tables, seq_lens, query_start_loc, scale_log2,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, BLOCK_G=_pow2_at_least(group), HEAD_DIM=head_dim, BLOCK_SIZE=block_size, PAGES=pages,
        PRECISION=precision, DOT_FP32=dot_fp32, KV_F16=kv_f16, LAZY_RESCALE=bool(cfg.get("lazy_rescale")),
        num_warps=cfg["batch_tma_warps"], num_stages=cfg["batch_tma_stages"],
        **({"maxnreg": maxnreg} if maxnreg and os.environ.get("TRITON_INTERPRET") != "1" else {}),
    )  # fmt: skip


_SPLIT_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}
_RETIRED_COUNTERS: list[torch.Tensor] = []  # outgrown buffers that captured CUDA graphs may still use


def _split_counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``n`` (sequence, kv head) counters on ``device`` for
    `_rotary_decode_kernel`'s split fix-up. Every launch leaves it zeroed again, so one buffer per
    device serves every layer and every replay of a captured graph; launches on one device must not
    run concurrently on two streams. Grown (never shrunk or freed) past 4,096 counters; a buffer
    needed during CUDA-graph capture that the device's does not cover is private to that graph."""
    key = (device.type, device.index)
    buf = _SPLIT_COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        size = max(4096, triton.next_power_of_2(n))
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Under capture torch.zeros only records a memset: the buffer is zero at each replay of
            # this graph, not now. It stays this graph's (kept alive with it), not the device's.
            buf = torch.zeros(size, dtype=torch.int32, device=device)
            _RETIRED_COUNTERS.append(buf)
            return buf
        if buf is not None:
            _RETIRED_COUNTERS.append(buf)
        buf = torch.zeros(size, dtype=torch.int32, device=device)
        _SPLIT_COUNTERS[key] = buf
    return buf


def rotary_decode_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_seq_len: int,
    *,
    num_splits: int | None = None,
    launch_kv_heads: int | None = None,
) -> torch.Tensor:
    """Rotary embedding, KV-cache write and decode attention of a decode-only batch in one launch.

    Computes what :func:`kvpilot.kernels.kv_cache.rotary_write_kv_cache_triton` followed by
    :func:`paged_attention_triton` with ``max_query_len = 1`` compute (the same rounding: the
    rotated query and key are rounded to ``q``'s and ``k``'s dtype, the key then to the cache's), in
    one kernel instead of three (rotary + write, split decode, split merge): at batch 1 each launch
    cost the layer's dependent chain a few microseconds on an H200. The merge of context splits is
    done by the split that finishes last (a per-(sequence, kv head) counter, `_split_counters`); its
    result can differ from `_reduce_kernel`'s in the last bit of fp32 (another summation order), and
    without splits from `_decode_kernel`'s lazy rescale (``TUNING["decode"]["lazy_rescale"]``) in the
    last bf16 bit of a few outputs on the GPU: this kernel always rescales eagerly.

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` bf16/fp16/fp32 queries before rotary; NOT modified
            (unlike the unfused path, which rotates ``q`` in place).
        k, v: ``[num_tokens, num_kv_heads, head_dim]`` the new keys (before rotary) and values.
        positions, cos_sin_cache, slot_mapping: as for
            :func:`kvpilot.kernels.reference.rotary_write_kv_cache_ref`.
        k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_seq_len: as for
            :func:`kvpilot.kernels.reference.paged_attention_ref`; every sequence's query is one token
            (decode) or none (padding), and its new token is the last of its ``seq_lens`` keys.
        num_splits, launch_kv_heads: as for :func:`paged_attention_triton`.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``. Rows of tokens no sequence covers are
        unwritten (``torch.empty``), and such tokens' K/V are not written to the cache.

    Raises:
        ValueError: on the shape, stride or ``launch_kv_heads`` errors of the two unfused functions.
    """
    _check_rotary_args(q, k, positions, cos_sin_cache)
    _check_write_args(k, v, k_cache, v_cache, slot_mapping)
    _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    for name, t in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("block_tables", block_tables), ("cos_sin_cache", cos_sin_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    if launch_kv_heads is None:
        launch_kv_heads = num_kv_heads
    elif not (isinstance(launch_kv_heads, int) and launch_kv_heads >= 1 and num_kv_heads % launch_kv_heads == 0):
        raise ValueError(f"launch_kv_heads must be a positive divisor of the {num_kv_heads} KV heads, "
                         f"got {launch_kv_heads!r}")
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q)
    if num_seqs == 0 or num_tokens == 0:
        return out
    seq_lens = seq_lens.to(torch.int32)
    query_start_loc = query_start_loc.to(torch.int32)
    head_dim_pad = _pow2_at_least(head_dim)
    kv_f16 = k_cache.dtype in _FP8_DTYPES and q.dtype in (torch.bfloat16, torch.float16)
    cfg = TUNING["decode"]
    splits, _, block_n, min_split = _decode_launch(num_seqs, launch_kv_heads, max_seq_len, head_dim_pad, q.device,
                                                   num_splits)
    if num_splits is None:
        splits = min(splits, cfg["fused_max_splits"])
    group_pad = triton.next_power_of_2(group)
    if splits > 1:
        part_out = torch.empty(num_seqs, num_heads, splits, head_dim_pad, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
        counters = _split_counters(q.device, num_seqs * num_kv_heads)
    else:
        part_out = part_lse = counters = out  # unused
    pdl = pdl_mode(q.device, num_seqs)
    _rotary_decode_kernel[(num_seqs, num_kv_heads, splits)](
        q, k, v, positions, cos_sin_cache, slot_mapping,
        k_cache, v_cache, out, part_out, part_lse, counters,
        block_tables, seq_lens, query_start_loc,
        float(scale) * _LOG2E, splits,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, SPLIT=splits > 1, MIN_SPLIT=min_split,
        GROUP=group, BLOCK_G=_pow2_at_least(group), GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, HALF=head_dim // 2,
        BLOCK_SIZE=block_size, BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_FP32=q.dtype == torch.bfloat16 and not q.is_cuda and not kv_f16, KV_F16=kv_f16,
        SATURATE=_saturate(k_cache),
        # Splits merged per step: [GROUP_PAD, chunk, HEAD_DIM_PAD] fp32 in registers.
        MERGE_CHUNK=max(1, min(triton.next_power_of_2(splits), cfg["fused_merge_rows"] // group_pad)),
        USE_PDL=pdl > 0, **launch_options(pdl),
        num_warps=cfg["fused_num_warps" if max_seq_len <= cfg["fused_long_keys"] else "fused_num_warps_long"],
        num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out
