"""Triton paged attention of decode-only batches (``max_query_len == 1``).

``_decode_kernel`` + ``_reduce_kernel``: one program per (sequence, kv head, context split); the
whole GQA group is one tile. With more than one split (flash-decoding, for long contexts and few
sequences) each program writes a normalised partial output and its log-sum-exp, and the reduction
kernel merges them. Batches that fill the GPU without splits take ``_decode_tma_kernel`` where the
cache allows it (`_tma_decode_reason`): each page's keys and values of a kv head come as one TMA box
through a shared-memory ring, one warp per program. With a sliding window of ``W`` keys each
sequence's keys are ``[max(seq_len - W, 0), seq_len)`` (`_first_key`): the splits divide that range
and the TMA kernel starts at its first page, so earlier pages are never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_common import (TUNING, AttentionShape, _attend_keys, _decode_launch, _dot_queries, _pow2_at_least,
                               _soft_cap, _split_size, interpreting)
from .pdl import launch_options, pdl_enter, pdl_mode

try:  # host-side TMA descriptors (Triton >= 3.3), for `_decode_tma_kernel`
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None


@triton.jit
def _first_key(seq_len, window, WINDOWED: tl.constexpr):
    """First key a decode query at position ``seq_len - 1`` sees: 0, or with a sliding window of
    ``window`` keys ``max(seq_len - window, 0)``."""
    if WINDOWED:
        return tl.maximum(seq_len - window, 0)
    return seq_len * 0

@triton.jit(do_not_specialize=["num_splits", "stride_bt", "window"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, seq_lens_ptr, qsl_ptr,
    scale_log2, num_splits, window, soft_cap_log2,
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
    USE_PDL: tl.constexpr = False, WINDOWED: tl.constexpr = False, SOFT_CAP: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(USE_PDL)  # kernels/pdl.py: before any memory access
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_first = _first_key(seq_len, window, WINDOWED)
    partition_size = _split_size(seq_len - kv_first, num_splits, BLOCK_N, MIN_SPLIT)
    kv_start = kv_first + split * partition_size
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
        soft_cap_log2=soft_cap_log2, SOFT_CAP=SOFT_CAP,
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
    kv_first=0, soft_cap_log2=0.0, FIRST_MASKED: tl.constexpr = False, SOFT_CAP: tl.constexpr = False,
):  # fmt: skip
    """One online-softmax step of `_decode_tma_kernel` over ``PAGES`` (1 or 2) cache pages from key
    ``start`` (a page boundary): each page's keys and values of one kv head come as one TMA box
    ``[BLOCK_SIZE, HEAD_DIM]`` (rows ``blk * BLOCK_SIZE`` of the cache's 2-D view, columns ``col``).
    ``MASKED`` (the last tile only): keys past ``seq_len`` get score -inf and their value rows are
    zeroed, since a box reads whole pages and stale bytes may decode to NaN; a page wholly past the
    context reads block 0. ``FIRST_MASKED`` (a sliding window's first tile, ``MASKED`` too): keys
    before ``kv_first`` are masked alike. ``SOFT_CAP``: scores soft-capped (`_soft_cap`). Returns the
    updated ``(m_i, l_i, acc)`` as `_attend_keys` keeps them."""
    page = start // BLOCK_SIZE
    n_a = start + tl.arange(0, BLOCK_SIZE)
    blk_a = tl.load(bt_row + page).to(tl.int32)
    k_a = k_desc.load([blk_a * BLOCK_SIZE, col])
    k_a = k_a.to(tl.float32) if DOT_FP32 else k_a.to(q.dtype)  # FP8: dot in the queries' dtype
    s_a = tl.dot(q, tl.trans(k_a), input_precision=PRECISION) * scale_log2
    if SOFT_CAP:
        s_a = _soft_cap(s_a, soft_cap_log2)
    ok_a = n_a < seq_len
    if FIRST_MASKED:
        ok_a = ok_a & (n_a >= kv_first)
    if MASKED:
        s_a = tl.where(ok_a[None, :], s_a, float("-inf"))
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
        if SOFT_CAP:
            s_b = _soft_cap(s_b, soft_cap_log2)
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
        v_a = tl.where(ok_a[:, None], v_a, 0.0)
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


@triton.jit(do_not_specialize=["stride_bt", "window"])
def _decode_tma_kernel(
    q_ptr, k_desc, v_desc, out_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr,
    scale_log2, window, soft_cap_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr, KV_F16: tl.constexpr, LAZY_RESCALE: tl.constexpr,
    WINDOWED: tl.constexpr = False, SOFT_CAP: tl.constexpr = False,
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
    STEP: tl.constexpr = BLOCK_SIZE * PAGES
    begin = seq_len * 0  # the first whole tile's first key
    if WINDOWED:  # start at the window's first page; a first key inside it makes that tile masked
        kv_first = _first_key(seq_len, window, WINDOWED)
        begin = kv_first // BLOCK_SIZE * BLOCK_SIZE
        if begin < kv_first:
            m_i, l_i, acc = _tma_tile(q, scale_log2, k_desc, v_desc, bt_row, begin, seq_len, col, m_i, l_i, acc,
                                      BLOCK_SIZE, PAGES, True, PRECISION, DOT_FP32, LAZY_RESCALE,
                                      kv_first, soft_cap_log2, True, SOFT_CAP)
            begin = tl.minimum(begin + STEP, seq_len)
    full_end = begin + (seq_len - begin) // STEP * STEP
    for start in range(begin, full_end, STEP):
        m_i, l_i, acc = _tma_tile(q, scale_log2, k_desc, v_desc, bt_row, start, seq_len, col, m_i, l_i, acc,
                                  BLOCK_SIZE, PAGES, False, PRECISION, DOT_FP32, LAZY_RESCALE,
                                  0, soft_cap_log2, False, SOFT_CAP)
    if full_end < seq_len:
        m_i, l_i, acc = _tma_tile(q, scale_log2, k_desc, v_desc, bt_row, full_end, seq_len, col, m_i, l_i, acc,
                                  BLOCK_SIZE, PAGES, True, PRECISION, DOT_FP32, LAZY_RESCALE,
                                  0, soft_cap_log2, False, SOFT_CAP)
    out = acc / l_i[:, None]
    tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g_ok[:, None])


@triton.jit(do_not_specialize=["num_splits", "window"])
def _reduce_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr, qsl_ptr, num_splits, window,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr = False, WINDOWED: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(USE_PDL)  # kernels/pdl.py: before any memory access
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) - q_start != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    keys = seq_len - _first_key(seq_len, window, WINDOWED)
    num_valid = tl.cdiv(keys, _split_size(keys, num_splits, BLOCK_N, MIN_SPLIT))
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



def launch_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                  S: AttentionShape, max_seq_len: int, num_splits: int | None) -> None:
    """Launch the decode kernel (or the TMA kernel) and the split merge into ``out``."""
    cfg = TUNING["decode"]
    splits, full, block_n, min_split = _decode_launch(S.num_seqs, S.launch_kv_heads, S.keys_bound(max_seq_len),
                                                      S.head_dim_pad, q.device, num_splits)
    if splits > 1:
        part_out = torch.empty(
            S.num_seqs, S.num_heads, splits, S.head_dim_pad, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(S.num_seqs, S.num_heads, splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    pdl = pdl_mode(q.device, S.num_seqs)
    if splits == 1 and full and _tma_decode_reason(q, k_cache, v_cache, S.kv_f16) == "":
        _launch_decode_tma(q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, S.scale_log2,
                           S.precision, S.dot_fp32, S.kv_f16, S.window, S.soft_cap_log2)
        return
    maxnreg = cfg.get("batch_maxnreg_fp8" if S.kv_f16 else "batch_maxnreg")
    _decode_kernel[(S.num_seqs, S.num_kv_heads, splits)](
        q, k_cache, v_cache, out, part_out, part_lse, block_tables, seq_lens, query_start_loc,
        S.scale_log2, splits, S.window, S.soft_cap_log2, *S.strides,
        NUM_HEADS=S.num_heads, SPLIT=splits > 1, MIN_SPLIT=min_split, GROUP=S.group, BLOCK_G=_pow2_at_least(S.group),
        HEAD_DIM=S.head_dim, HEAD_DIM_PAD=S.head_dim_pad, BLOCK_SIZE=S.block_size, BLOCK_N=block_n,
        PRECISION=S.precision, DOT_FP32=S.dot_fp32, KV_F16=S.kv_f16,
        LAZY_RESCALE=bool(cfg.get("lazy_rescale")) and splits == 1,
        USE_PDL=pdl > 0, WINDOWED=S.window > 0, SOFT_CAP=S.soft_cap_log2 > 0, **launch_options(pdl),
        num_warps=cfg["batch_num_warps"] if full else cfg["num_warps"],
        num_stages=(cfg["batch_num_stages_fp8" if S.kv_f16 else "batch_num_stages"] if full else cfg["num_stages"]),
        # (a compile option: the CPU interpreter has no registers to cap)
        **({"maxnreg": maxnreg} if full and maxnreg and not interpreting() else {}),
    )  # fmt: skip
    if splits > 1:
        _reduce_kernel[(S.num_seqs, S.num_heads)](
            out, part_out, part_lse, seq_lens, query_start_loc, splits, S.window,
            out.stride(0), out.stride(1),
            NUM_HEADS=S.num_heads, SPLITS_PAD=triton.next_power_of_2(splits),
            HEAD_DIM=S.head_dim, HEAD_DIM_PAD=S.head_dim_pad, BLOCK_N=block_n, MIN_SPLIT=min_split,
            # One warp holds SPLITS_PAD x HEAD_DIM_PAD fp32 partials: past 16 splits of 128 dims
            # ptxas spilled registers (tools/compile_kernels.py), so more warps share them.
            num_warps=1 if triton.next_power_of_2(splits) * S.head_dim_pad <= 16 * 128 else 4,
            USE_PDL=pdl > 0, WINDOWED=S.window > 0, **launch_options(pdl),
        )  # fmt: skip


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
# (sm_90 compile, tools/compile_kernels.py).
_TMA_MAX_BOX_BYTES = 8192


def _launch_decode_tma(q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, scale_log2, precision,
                       dot_fp32, kv_f16, window=0, soft_cap_log2=0.0) -> None:
    """Launch `_decode_tma_kernel` (one program per (sequence, kv head), no context splits) with the
    ``batch_tma_*`` launch options of ``TUNING["decode"]``; ``window``/``soft_cap_log2`` as in
    `AttentionShape` (0: none)."""
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
        q, descs[0], descs[1], out, block_tables, seq_lens, query_start_loc, scale_log2, window, soft_cap_log2,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, BLOCK_G=_pow2_at_least(group), HEAD_DIM=head_dim, BLOCK_SIZE=block_size, PAGES=pages,
        PRECISION=precision, DOT_FP32=dot_fp32, KV_F16=kv_f16, LAZY_RESCALE=bool(cfg.get("lazy_rescale")),
        WINDOWED=window > 0, SOFT_CAP=soft_cap_log2 > 0,
        num_warps=cfg["batch_tma_warps"], num_stages=cfg["batch_tma_stages"],
        **({"maxnreg": maxnreg} if maxnreg and not interpreting() else {}),
    )  # fmt: skip
