"""What the paged-attention kernels share: launch tuning, the split heuristics, the online-softmax
key loop (`_attend_keys`) and the per-launch shape record (`AttentionShape`).

All accumulation is fp32; softmax uses ``exp2`` with the scale folded into ``log2(e)``.

Sliding windows (``window`` keys, the Hugging Face convention: a query at ``p`` sees keys in
``(p - window, p]``) start each program's key range at its first visible key, so pages wholly before
the window are never loaded; logit soft-capping (``c * tanh(s / c)``) is applied to each score tile
(`_soft_cap`), with the scale folded in as ``s = tanh(qk * scale / c) * c * log2(e)``.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvpilot import envs

_LOG2E = 1.4426950408889634

# Launch parameters, chosen by benchmarks/lab/kernels_gpu.py on an H200 (docs/kernels.md). Tiles are
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
        # instead of 402.7 us per layer (H200, BENCHMARKS.md). Not bit-identical on
        # the GPU: the tensor-core sum then accumulates into acc instead of being added to acc *
        # alpha, so 1-3 of ~400k outputs differ by one bf16 ulp. Split launches
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
        # / 421 us with `_decode_kernel` (75-87% of the copy rate against 52-71%; BENCHMARKS.md);
        # 2 or 4 warps were slower than the pointer kernel at batch 492. bf16
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
    (benchmarks A/B launch options by updating ``TUNING["decode"]`` with it in their own process,
    e.g. ``benchmarks/lab/gpu_recheck.py --decode-tuning``).

    Raises:
        ValueError: not a JSON object, a key ``TUNING["decode"]`` does not have, or a
            ``batch_tma_pages`` other than 1 or 2.
    """
    try:
        over = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"decode tuning is not JSON: {e}") from None
    if not isinstance(over, dict):
        raise ValueError(f"decode tuning must be a JSON object, got {type(over).__name__}")
    unknown = sorted(set(over) - set(TUNING["decode"]))
    if unknown:
        raise ValueError(f"decode tuning: unknown keys {unknown}; known: {sorted(TUNING['decode'])}")
    if over.get("batch_tma_pages", 1) not in (1, 2):
        raise ValueError(f"decode tuning: batch_tma_pages must be 1 or 2, got {over['batch_tma_pages']!r}")
    return over

@triton.jit
def _split_size(seq_len, num_splits, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """Keys per split of one sequence: its own context over ``num_splits``, in whole ``BLOCK_N``
    tiles and at least ``MIN_SPLIT``. Taken from the sequence's length on the device (not from the
    launch's upper bound), so a CUDA graph captured for a long context bound still spreads a short
    context over several programs; the decode and reduce kernels compute it alike."""
    per = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(per, MIN_SPLIT)


@triton.jit
def _soft_cap(s, soft_cap_log2):
    """``tanh(s) * soft_cap_log2`` of fp32 scores ``s`` that already hold ``qk * scale / cap``:
    Gemma 2's ``cap * tanh(qk * scale / cap)`` in the log2 domain. tanh as
    ``1 - 2 / (exp(2x) + 1)`` of ``x`` clamped to +-15 (tanh(15) is 1 in fp32; no exp2 overflow)."""
    x = tl.minimum(tl.maximum(s, -15.0), 15.0)
    t = 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)
    return t * soft_cap_log2


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
    soft_cap_log2=0.0, SOFT_CAP: tl.constexpr = False,
):  # fmt: skip
    """Online softmax of one GQA group's queries ``q`` ``[BLOCK_G, HEAD_DIM_PAD]`` over keys
    ``[kv_start, kv_end)`` of one kv head (scores times ``scale_log2``), gathered tile by tile through
    the block-table row ``bt_row``. Returns ``(acc, m_i, l_i)``: the unnormalised fp32 output
    ``[BLOCK_G, HEAD_DIM_PAD]``, the running max and the softmax denominator (log2 domain), both
    ``[BLOCK_G]``. With
    ``FIRST_PRELOADED``, ``blk_first`` ``[BLOCK_N]`` int64 holds the first tile's cache blocks, loaded
    by the caller (e.g. before its PDL wait). With ``SOFT_CAP``, ``scale_log2`` is ``scale / cap`` and
    scores are soft-capped (`_soft_cap`)."""
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
        if SOFT_CAP:
            s = _soft_cap(s, soft_cap_log2)
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



@dataclass(frozen=True)
class AttentionShape:
    """The launch-independent facts of one paged-attention call (host ints and flags).

    ``precision``: tl.dot's input precision ("ieee" for fp32 inputs, else "tf32"); ``kv_f16``: an FP8
    cache read into fp16 dots; ``dot_fp32``: bf16 dots upcast to fp32 (Triton's CPU interpreter
    computes bf16 tl.dot wrongly); ``strides``: q, k_cache, v_cache, out and block-table strides in
    the kernels' argument order. ``window``: the sliding window in keys (0: none); ``soft_cap_log2``:
    ``cap * log2(e)`` (0.0: no soft cap), and then ``scale_log2`` holds ``scale / cap``
    (`score_scales`).
    """

    num_tokens: int
    num_heads: int
    head_dim: int
    head_dim_pad: int
    num_kv_heads: int
    launch_kv_heads: int
    block_size: int
    group: int
    num_seqs: int
    scale_log2: float
    precision: str
    kv_f16: bool
    dot_fp32: bool
    strides: tuple
    window: int = 0
    soft_cap_log2: float = 0.0

    def keys_bound(self, max_seq_len: int) -> int:
        """Most keys one decode query reads: ``max_seq_len``, or the window when shorter."""
        return min(max_seq_len, self.window) if self.window else max_seq_len


def score_scales(scale: float, logits_soft_cap: float | None) -> tuple[float, float]:
    """``(scale_arg, soft_cap_log2)`` of the kernels: ``(scale * log2(e), 0.0)`` without a soft cap,
    ``(scale / cap, cap * log2(e))`` with one (`_soft_cap` then gives ``cap * tanh(qk * scale / cap)``
    in the log2 domain)."""
    if logits_soft_cap is None:
        return float(scale) * _LOG2E, 0.0
    return float(scale) / logits_soft_cap, logits_soft_cap * _LOG2E


def attention_shape(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    launch_kv_heads: int | None, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None) -> AttentionShape:
    """The `AttentionShape` of a call (``launch_kv_heads`` None: the cache's KV-head count;
    ``sliding_window``/``logits_soft_cap`` as validated by
    :func:`kvpilot.kernels.reference.check_window_and_cap`).

    Raises:
        ValueError: ``launch_kv_heads`` is not a positive divisor of the KV-head count.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if launch_kv_heads is None:
        launch_kv_heads = num_kv_heads
    elif not (isinstance(launch_kv_heads, int) and launch_kv_heads >= 1 and num_kv_heads % launch_kv_heads == 0):
        raise ValueError(f"launch_kv_heads must be a positive divisor of the {num_kv_heads} KV heads, "
                         f"got {launch_kv_heads!r}")
    # An FP8 cache is read into fp16 dots (q rounded to fp16, saturating): on an H200 converting e4m3
    # to bf16 made the decode kernel compute-bound at about half the copy bandwidth.
    kv_f16 = k_cache.dtype in _FP8_DTYPES and q.dtype in (torch.bfloat16, torch.float16)
    scale_arg, soft_cap_log2 = score_scales(scale, logits_soft_cap)
    return AttentionShape(
        num_tokens=num_tokens, num_heads=num_heads, head_dim=head_dim, head_dim_pad=_pow2_at_least(head_dim),
        num_kv_heads=num_kv_heads, launch_kv_heads=launch_kv_heads, block_size=block_size,
        group=num_heads // num_kv_heads, num_seqs=seq_lens.shape[0], scale_log2=scale_arg,
        precision="ieee" if q.dtype == torch.float32 else "tf32", kv_f16=kv_f16,
        dot_fp32=q.dtype == torch.bfloat16 and not q.is_cuda and not kv_f16,
        strides=(q.stride(0), q.stride(1),
                 k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                 v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                 out.stride(0), out.stride(1), block_tables.stride(0)),
        window=sliding_window or 0, soft_cap_log2=soft_cap_log2)


def interpreting() -> bool:
    """Whether Triton runs on its CPU interpreter (``TRITON_INTERPRET=1``): compile options such as
    ``maxnreg`` have no meaning there."""
    return envs.triton_interpret()
