"""Triton paged attention of prefill chunks and mixed steps (``max_query_len > 1``).

``_prefill_kernel``: one program per (work tile, kv head). Sequence ``i`` has ``cdiv(q_len_i,
BLOCK_Q)`` query tiles; the tiles of all sequences form one flat list, and each program finds its
(sequence, query tile) from ``query_start_loc`` on the device. The grid is an upper bound computed
from shapes (`prefill_max_tiles`), so one launch serves any batch of the same padded size: CUDA
graphs of prefill and mixed steps replay it, and programs past the last tile exit at once. The rows
of a tile are (query, head-in-group) pairs, so the query heads that share a kv head read each K/V
tile once. Flash-attention online softmax over the cache, gathered page by page through the block
table, with the causal limit of the tile's last query (and, with a sliding window, from the first
key the tile's first query sees). Small steps split each tile's context
(`prefill_num_splits`), merged by ``_prefill_reduce_kernel``. In a step of several sequences the
one-token (decode) rows are left to the decode kernel (``TUNING["prefill"]["decode_rows_to_decode_kernel"]``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import attention_common
from .attention_common import TUNING, AttentionShape, _soft_cap

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


@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "window"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, seq_lens_ptr, qsl_ptr,
    scale_log2, num_seqs, window, soft_cap_log2,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, KV_F16: tl.constexpr,
    SEQ_CHUNK: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SKIP_DECODE: tl.constexpr, WINDOWED: tl.constexpr = False, SOFT_CAP: tl.constexpr = False,
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
    # With a sliding window the tile's first query bounds the first key any of its rows may see.
    kv_begin = 0
    if WINDOWED:
        kv_begin = tl.maximum(ctx_len + q_tile * BLOCK_Q - window + 1, 0)
    if NUM_SPLITS == 1:
        kv_lo = kv_begin
        kv_hi = kv_end
    else:  # split `split` of the tile's keys, in whole BLOCK_N tiles
        per = tl.cdiv(tl.cdiv(kv_end - kv_begin, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = kv_begin + tl.program_id(2) * per
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
        if SOFT_CAP:
            s = _soft_cap(s, soft_cap_log2)
        allowed = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if WINDOWED:
            allowed = allowed & (n[None, :] > q_pos[:, None] - window)
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
    ok = lse > float("-inf")  # a real row sees itself, so one of its splits has a key
    w = tl.where(ok, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    w = w / tl.sum(w, 0)
    d = tl.arange(0, HEAD_DIM_PAD)
    part = tl.load(part_out_ptr + row[:, None] * HEAD_DIM_PAD + d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(part * w[:, None], 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


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



def launch_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                   S: AttentionShape, max_query_len: int, num_splits: int | None) -> bool:
    """Launch the prefill kernel (and its split merge) into ``out``; returns whether the one-token
    rows were left to the decode kernel (the caller then launches it over the same batch)."""
    cfg = TUNING["prefill"]
    # With several sequences some may be decodes (q_len 1); their rows are left to the decode
    # kernel below (the prefill reduction may write junk there first; the decode pass overwrites).
    split_decode = bool(cfg["decode_rows_to_decode_kernel"]) and S.num_seqs > 1
    block_q, block_m = prefill_block_q(S.group)
    block_n = cfg["block_n"] if S.head_dim_pad <= 128 else cfg["block_n"] // 2
    tiles = prefill_max_tiles(S.num_tokens, S.num_seqs, max_query_len, block_q)
    splits = num_splits or prefill_num_splits(S.num_tokens, block_q, S.launch_kv_heads, attention_common._device_sms(q.device))
    if splits > 1:
        part_out = torch.empty(S.num_tokens * S.num_heads * splits, S.head_dim_pad, dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty(S.num_tokens * S.num_heads * splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    _prefill_kernel[(tiles, S.num_kv_heads, splits)](
        q, k_cache, v_cache, out, part_out, part_lse, block_tables, seq_lens, query_start_loc,
        S.scale_log2, S.num_seqs, S.window, S.soft_cap_log2, *S.strides,
        GROUP=S.group, HEAD_DIM=S.head_dim, HEAD_DIM_PAD=S.head_dim_pad, BLOCK_SIZE=S.block_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=S.precision,
        DOT_FP32=S.dot_fp32, KV_F16=S.kv_f16,
        SEQ_CHUNK=_SEQ_CHUNK, NUM_HEADS=S.num_heads, NUM_SPLITS=splits, SKIP_DECODE=split_decode,
        WINDOWED=S.window > 0, SOFT_CAP=S.soft_cap_log2 > 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    if splits > 1:
        _prefill_reduce_kernel[(S.num_tokens, S.num_heads)](
            out, part_out, part_lse, out.stride(0), out.stride(1),
            NUM_HEADS=S.num_heads, NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits),
            HEAD_DIM=S.head_dim, HEAD_DIM_PAD=S.head_dim_pad, num_warps=1,
        )  # fmt: skip
    return split_decode
