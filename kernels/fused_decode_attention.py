"""One launch for the attention part of a small decode batch: rotary embedding, the new token's
KV-cache write, split decode attention and the split merge (`rotary_decode_attention_triton`), for
decode-only batches of at most ``TUNING["decode"]["fused_rotary_max_seqs"]`` sequences.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_common import (_FP8_DTYPES, TUNING, _attend_keys, _decode_launch, _dot_queries, _pow2_at_least,
                               _split_size, score_scales)
from .decode_attention import _first_key
from .kv_cache import _saturate, _to_cache
from .pdl import launch_options, pdl_mode, pdl_trigger, pdl_wait
from .reference import _check_attention_args, _check_rotary_args, _check_write_args, check_window_and_cap

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
@triton.jit(do_not_specialize=["num_splits", "stride_bt", "window"])
def _rotary_decode_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, slot_ptr,
    k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, counter_ptr,
    block_tables_ptr, seq_lens_ptr, qsl_ptr,
    scale_log2, num_splits, window, soft_cap_log2,
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
    WINDOWED: tl.constexpr = False, SOFT_CAP: tl.constexpr = False,
):  # fmt: skip
    """`_rotary_write_kv_kernel` + `_decode_kernel` + `_reduce_kernel` in one launch (decode-only
    batches). Program (sequence, kv head, split) rotates its group's queries in registers; the
    program holding the sequence's last key (the new token) first rotates that token's key and
    writes it and its value to the cache slot (visible to its own threads after a CTA barrier), then
    every program walks its keys as `_decode_kernel` does. With
    splits, each program stores its partial output and log-sum-exp, then counts itself done on the
    (sequence, kv head)'s counter; the last one to finish merges the partials and resets the
    counter to 0 (stream-K style fix-up, as in CUTLASS's split-K serial reduction). With a sliding
    window the splits divide the window's keys only (`_first_key`)."""
    # With PDL (kernels/pdl.py) this kernel waits for the QKV projection only after loading the
    # step's metadata and the rotary table below: no kernel of the step writes them (the metadata is
    # copied before its first kernel). On an H200, 0.9-1.0 us less per layer at 512-16,384 keys
    # (BENCHMARKS.md). tools/pdl_order_check.py allows these loads (EARLY_LOADS).
    pdl_trigger(USE_PDL)
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
        # in the engine: BENCHMARKS.md.)
        tl.debug_barrier()
    acc, m_i, l_i = _attend_keys(
        q, scale_log2, k_cache_ptr, v_cache_ptr, bt_row, kv_head, kv_start, kv_end, d, d_ok,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        BLOCK_G, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, PRECISION, DOT_FP32, False, blk_first, True,
        soft_cap_log2, SOFT_CAP,
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
        num_valid = tl.cdiv(seq_len - kv_first, partition_size)
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
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
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
        sliding_window, logits_soft_cap: as for :func:`kvpilot.kernels.reference.paged_attention_ref`;
            the splits divide each sequence's last ``sliding_window`` keys only.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``. Rows of tokens no sequence covers are
        unwritten (``torch.empty``), and such tokens' K/V are not written to the cache.

    Raises:
        ValueError: on the shape, stride, ``launch_kv_heads``, ``sliding_window`` or
            ``logits_soft_cap`` errors of the two unfused functions.
    """
    sliding_window, logits_soft_cap = check_window_and_cap(sliding_window, logits_soft_cap)
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
    keys_bound = min(max_seq_len, sliding_window) if sliding_window else max_seq_len
    splits, _, block_n, min_split = _decode_launch(num_seqs, launch_kv_heads, keys_bound, head_dim_pad, q.device,
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
    scale_arg, soft_cap_log2 = score_scales(scale, logits_soft_cap)
    _rotary_decode_kernel[(num_seqs, num_kv_heads, splits)](
        q, k, v, positions, cos_sin_cache, slot_mapping,
        k_cache, v_cache, out, part_out, part_lse, counters,
        block_tables, seq_lens, query_start_loc,
        scale_arg, splits, sliding_window or 0, soft_cap_log2,
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
        USE_PDL=pdl > 0, WINDOWED=bool(sliding_window), SOFT_CAP=logits_soft_cap is not None, **launch_options(pdl),
        num_warps=cfg["fused_num_warps" if keys_bound <= cfg["fused_long_keys"] else "fused_num_warps_long"],
        num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out
