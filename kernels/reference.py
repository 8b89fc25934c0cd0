"""Plain PyTorch reference implementations of the engine's kernels.

These are the ground truth the Triton kernels are tested against, and what the engine runs on
CPU. They are vectorised (no per-token Python loops) because the CPU engine pushes a few hundred
tiny sequences through them every step.

Conventions (also in docs/kernels.md):

- KV cache per layer: ``k_cache``/``v_cache`` of shape ``[num_blocks, block_size, num_kv_heads,
  head_dim]``; ``slot = block_id * block_size + offset_in_block`` (vLLM's paged layout).
- Ragged queries: tokens of all sequences concatenated; ``query_start_loc`` holds the cumulative
  query lengths, ``seq_lens`` the context length including this step's tokens.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

__all__ = [
    "write_kv_cache_ref",
    "paged_attention_ref",
    "rms_norm_ref",
    "apply_rotary_ref",
    "rotary_write_kv_cache_ref",
    "build_rope_cache",
    "silu_and_mul_ref",
    "gelu_tanh_and_mul_ref",
    "check_window_and_cap",
]


def _check_kv_shapes(k: torch.Tensor, k_cache: torch.Tensor, name: str = "k") -> None:
    if k_cache.dim() != 4:
        raise ValueError(
            f"cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)}"
        )
    if k.dim() != 3 or tuple(k.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(
            f"{name} must be [num_tokens, {k_cache.shape[2]}, {k_cache.shape[3]}] to match the cache, "
            f"got {tuple(k.shape)}"
        )


def _check_write_args(k, v, k_cache, v_cache, slot_mapping) -> None:
    _check_kv_shapes(k, k_cache, "k")
    _check_kv_shapes(v, v_cache, "v")
    if k.shape != v.shape or k_cache.shape != v_cache.shape:
        raise ValueError(f"k/v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"slot_mapping must be [num_tokens={k.shape[0]}], got {tuple(slot_mapping.shape)}"
        )


def write_kv_cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new keys/values into the paged KV cache, in place.

    Args:
        k, v: ``[num_tokens, num_kv_heads, head_dim]``, any float dtype (cast to the cache dtype,
            see `to_cache_dtype`).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; a 16/32-bit float
            dtype, or ``torch.float8_e4m3fn`` (FP8 KV cache).
        slot_mapping: ``[num_tokens]`` int64 or int32; token ``t`` goes to slot
            ``slot_mapping[t] = block_id * block_size + offset``. ``-1`` marks a padded token that is
            skipped (vLLM's convention, used by CUDA-graph padding).

    Raises:
        ValueError: on mismatched shapes or a slot outside ``[-1, num_blocks * block_size)``.
    """
    _check_write_args(k, v, k_cache, v_cache, slot_mapping)
    block_size = k_cache.shape[1]
    num_slots = k_cache.shape[0] * block_size
    slots = slot_mapping.long()
    valid = slots >= 0
    slots = slots[valid]
    if slots.numel() and int(slots.max()) >= num_slots:
        raise ValueError(f"slot {int(slots.max())} out of range for a cache of {num_slots} slots")
    # Advanced indexing on (block, offset) works for non-contiguous caches too, unlike a flat view.
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = to_cache_dtype(k[valid], k_cache.dtype)
    v_cache[blocks, offsets] = to_cache_dtype(v[valid], v_cache.dtype)


FP8_KV_DTYPE = torch.float8_e4m3fn
"""The FP8 KV-cache element type (``KvCacheConfig(dtype="fp8")``): E4M3, largest finite value 448."""
FP8_KV_MAX = 448.0


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Cast keys/values to the cache's dtype; into FP8 with saturation at +-448 (scale 1.0).

    FP8 caches store K/V unscaled (a per-tensor scale of 1.0, vLLM's default for ``kv_cache_dtype
    fp8`` without calibrated scales); values beyond E4M3's range are clamped, not turned to NaN.
    """
    if cache_dtype == FP8_KV_DTYPE:
        x = x.float().clamp(-FP8_KV_MAX, FP8_KV_MAX)
    return x.to(cache_dtype)


def _gather_kv(
    cache: torch.Tensor, block_tables: torch.Tensor, seq_idx: torch.Tensor, num_ctx: int
) -> torch.Tensor:
    """Gather ``[len(seq_idx), num_ctx, num_kv_heads, head_dim]`` cache rows of the given sequences."""
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    nb = -(-num_ctx // block_size)
    # Unused block-table entries may hold any value (often 0 or -1); clamp so gather never fails.
    bt = block_tables[seq_idx, :nb].long().clamp(0, num_blocks - 1)
    kv = cache[bt]  # [S, nb, block_size, Hkv, D]
    return kv.reshape(bt.shape[0], nb * block_size, cache.shape[2], cache.shape[3])[:, :num_ctx]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Masked GQA attention in fp32.

    q: [S, Lq, H, D]; k, v: [S, Lk, Hkv, D]; allowed: [S, Lq, Lk] bool. Returns [S, Lq, H, D] fp32.
    Every query row must allow at least one key. ``logits_soft_cap`` ``c``: scores become
    ``c * tanh(scores / c)`` after the scale, before the mask (Gemma 2).
    """
    s, lq, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    qf = q.float().reshape(s, lq, hkv, g, d)
    # Zero the keys/values that are masked out: stale cache memory may hold NaN/Inf and 0 * NaN
    # would leak into the output.
    key_ok = allowed.any(dim=1)[:, :, None, None]  # [S, Lk, 1, 1]
    kf = torch.where(key_ok, k.float(), 0.0)
    vf = torch.where(key_ok, v.float(), 0.0)
    scores = torch.einsum("sqhgd,skhd->shgqk", qf, kf) * scale
    if logits_soft_cap is not None:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("shgqk,skhd->sqhgd", probs, vf)
    return out.reshape(s, lq, h, d)


def paged_attention_ref(
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
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of ragged queries over a paged KV cache (mixed prefill chunks and decodes).

    Args:
        q: ``[num_tokens, num_heads, head_dim]``, queries of all sequences concatenated.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, already holding
            this step's keys/values (written by :func:`write_kv_cache_ref`).
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32; unused entries may hold any value.
        seq_lens: ``[num_seqs]`` int32, context length of each sequence *including* its new tokens.
        query_start_loc: ``[num_seqs + 1]`` int32, cumulative query lengths.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        max_query_len, max_seq_len: host-side upper bounds of the query and context lengths.
        sliding_window: ``None`` (full causal attention) or ``W >= 1``: a query at position ``p``
            attends only keys at positions ``p - W < pos <= p`` (``W`` keys, itself included).
            This is the Hugging Face convention (``transformers.masking_utils.sliding_window_overlay``:
            ``kv_idx > q_idx - sliding_window``) that Mistral, Qwen2, Gemma 2 and Gemma 3 configs'
            ``sliding_window`` follows.
        logits_soft_cap: ``None`` or ``c > 0``: scores (after ``scale``) become
            ``c * tanh(score / c)`` before the softmax (Gemma 2's ``attn_logit_softcapping``).

    Query ``j`` of sequence ``i`` (``q_len = qsl[i+1] - qsl[i]``) sits at position
    ``seq_lens[i] - q_len + j`` and attends to cache positions ``0..position`` (inclusive; with a
    sliding window ``W``, ``position - W + 1..position``). Query head
    ``h`` reads kv head ``h // (num_heads // num_kv_heads)`` (GQA). Rows of tokens not covered by
    any sequence (``t >= qsl[-1]``, e.g. CUDA-graph padding) are unspecified: this reference writes
    zeros, the Triton kernels leave them unwritten (any value, NaN included).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``; accumulation is fp32.

    Raises:
        ValueError: on inconsistent shapes, ``num_heads % num_kv_heads != 0``, a sequence whose
            ``q_len`` exceeds its ``seq_len``, lengths above the given bounds, or a
            ``sliding_window``/``logits_soft_cap`` that is not positive (`check_window_and_cap`).

    Decodes (``q_len == 1``) are batched in one padded gather; longer queries (prefill chunks,
    a handful per step) are done one sequence at a time so that padding never scales with the
    longest prefill.
    """
    _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    sliding_window, logits_soft_cap = check_window_and_cap(sliding_window, logits_soft_cap)
    num_tokens, num_heads, head_dim = q.shape
    out = torch.zeros_like(q)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [b - a for a, b in zip(qsl[:-1], qsl[1:])]
    if qsl[-1] > num_tokens:
        raise ValueError(f"query_start_loc[-1]={qsl[-1]} exceeds num_tokens={num_tokens}")
    for i, (ql, sl) in enumerate(zip(q_lens, lens)):
        if ql < 0 or ql > sl:
            raise ValueError(f"sequence {i}: q_len={ql} must be in [0, seq_len={sl}]")
        if ql > max_query_len or sl > max_seq_len:
            raise ValueError(
                f"sequence {i}: q_len={ql}/seq_len={sl} exceed bounds "
                f"max_query_len={max_query_len}/max_seq_len={max_seq_len}"
            )
    device = q.device

    decode = [i for i, ql in enumerate(q_lens) if ql == 1]
    if decode:
        idx = torch.tensor(decode, device=device, dtype=torch.long)
        ctx = max(lens[i] for i in decode)
        k = _gather_kv(k_cache, block_tables, idx, ctx)
        v = _gather_kv(v_cache, block_tables, idx, ctx)
        sl = seq_lens.to(device)[idx].long()
        pos = torch.arange(ctx, device=device)[None, :]
        allowed = pos < sl[:, None]
        if sliding_window is not None:
            allowed &= pos >= sl[:, None] - sliding_window
        tok = query_start_loc.to(device)[idx].long()
        o = _attend(q[tok][:, None], k, v, allowed[:, None, :], scale, logits_soft_cap)
        out[tok] = o[:, 0].to(q.dtype)

    for i, (ql, sl) in enumerate(zip(q_lens, lens)):
        if ql <= 1:
            continue
        idx = torch.tensor([i], device=device, dtype=torch.long)
        k = _gather_kv(k_cache, block_tables, idx, sl)
        v = _gather_kv(v_cache, block_tables, idx, sl)
        qpos = torch.arange(sl - ql, sl, device=device)
        kpos = torch.arange(sl, device=device)[None, :]
        allowed = kpos <= qpos[:, None]
        if sliding_window is not None:
            allowed &= kpos > qpos[:, None] - sliding_window
        o = _attend(q[qsl[i] : qsl[i + 1]][None], k, v, allowed[None], scale, logits_soft_cap)
        out[qsl[i] : qsl[i + 1]] = o[0].to(q.dtype)
    return out


def check_window_and_cap(sliding_window, logits_soft_cap) -> tuple[int | None, float | None]:
    """Validate the ``sliding_window`` and ``logits_soft_cap`` arguments of the attention ops.

    Returns them as ``(int | None, float | None)``.

    Raises:
        ValueError: ``sliding_window`` is not ``None`` or an int >= 1, or ``logits_soft_cap`` is not
            ``None`` or a finite number > 0.
    """
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if logits_soft_cap is not None:
        ok = isinstance(logits_soft_cap, (int, float)) and not isinstance(logits_soft_cap, bool)
        if not ok or not math.isfinite(logits_soft_cap) or logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be None or a finite number > 0, got {logits_soft_cap!r}")
        logits_soft_cap = float(logits_soft_cap)
    return sliding_window, logits_soft_cap


def _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache/v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, cache has {k_cache.shape[3]}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    num_seqs = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [num_seqs={num_seqs}, max_blocks], got {tuple(block_tables.shape)}"
        )
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc must be [num_seqs + 1 = {num_seqs + 1}], got {tuple(query_start_loc.shape)}"
        )


def _check_rms_norm_args(x, weight, residual) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(
            f"x must be [num_tokens, hidden] and weight [hidden], got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm, optionally fused with the residual add (Hugging Face ``LlamaRMSNorm`` semantics).

    Args:
        x: ``[num_tokens, hidden]``.
        weight: ``[hidden]``.
        eps: added to the mean square before the reciprocal square root.
        residual: optional ``[num_tokens, hidden]``, same dtype as ``x``.

    Returns:
        Without ``residual``: ``rmsnorm(x) * weight``. With it: ``(rmsnorm(h) * weight, h)`` where
        ``h = x + residual`` is rounded to ``x.dtype`` (as HF adds in the model dtype). The norm is
        computed in fp32, cast to ``x.dtype`` and only then multiplied by ``weight``; the result is in
        ``x.dtype``.

    Raises:
        ValueError: on mismatched shapes.
    """
    _check_rms_norm_args(x, weight, residual)
    if residual is not None:
        h = (x.float() + residual.float()).to(x.dtype)
    else:
        h = x
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = (weight * normed.to(x.dtype)).to(x.dtype)
    return y if residual is None else (y, h)


def apply_rotary_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding, Hugging Face half-split (``rotate_half``) convention.

    For each head vector ``x = [x1, x2]`` (halves of ``head_dim``) at position ``p``:
    ``[x1 * cos - x2 * sin, x2 * cos + x1 * sin]`` with ``cos, sin = cos_sin_cache[p]`` halves.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``.
        k: ``[num_tokens, num_kv_heads, head_dim]``.
        positions: ``[num_tokens]`` int64 (int32 accepted), absolute token positions.
        cos_sin_cache: ``[max_positions, head_dim]`` float32 from :func:`build_rope_cache`.

    Returns:
        New ``(q, k)`` tensors in the input dtypes (computed in fp32; inputs are not modified).

    Raises:
        ValueError: on mismatched shapes or an odd ``head_dim``.
    """
    _check_rotary_args(q, k, positions, cos_sin_cache)
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rot(q), rot(k)


def rotary_write_kv_cache_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotary embedding of ``q`` and ``k``, then the KV-cache write of rotated ``k`` and ``v``.

    Exactly :func:`apply_rotary_ref` followed by :func:`write_kv_cache_ref` (the fused Triton kernel
    does both in one launch). ``q``, ``k``, ``v`` are typically strided views of one fused QKV
    projection output ``[num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]``.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``.
        k, v: ``[num_tokens, num_kv_heads, head_dim]``.
        positions: ``[num_tokens]`` int64 (int32 accepted), absolute token positions.
        cos_sin_cache: ``[max_positions, head_dim]`` float32 from :func:`build_rope_cache`.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, written in place.
        slot_mapping: ``[num_tokens]`` int64 (int32 accepted); ``-1`` skips the token's write.

    Returns:
        The rotated queries ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``: a new tensor here,
        ``q`` itself (rotated in place) in the Triton version, so callers must use the result. ``k``
        and ``v`` are never modified; the cache receives ``rotate(k)`` rounded to ``k.dtype``, then
        cast to the cache dtype.

    Raises:
        ValueError: on mismatched shapes, an odd ``head_dim``, or a slot outside
            ``[-1, num_blocks * block_size)``.
    """
    _check_rotary_args(q, k, positions, cos_sin_cache)
    _check_write_args(k, v, k_cache, v_cache, slot_mapping)
    q_rot, k_rot = apply_rotary_ref(q, k, positions, cos_sin_cache)
    write_kv_cache_ref(k_rot, v, k_cache, v_cache, slot_mapping)
    return q_rot


def _check_rotary_args(q, k, positions, cos_sin_cache) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            "q must be [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim], "
            f"got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    head_dim = q.shape[2]
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(
            f"cos_sin_cache must be [max_positions, {head_dim}], got {tuple(cos_sin_cache.shape)}"
        )
    if positions.shape != (q.shape[0],):
        raise ValueError(f"positions must be [num_tokens={q.shape[0]}], got {tuple(positions.shape)}")


def _rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None) -> torch.Tensor:
    # Same arithmetic (int64 arange -> float32, then divide) as transformers' default RoPE init.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type in (None, "default"):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        # Llama 3.1 frequency-dependent scaling, as transformers' _compute_llama3_parameters.
        factor = float(rope_scaling["factor"])
        low = float(rope_scaling["low_freq_factor"])
        high = float(rope_scaling["high_freq_factor"])
        old_ctx = float(rope_scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_ctx / low
        high_freq_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(
        f"unsupported rope_scaling type {rope_type!r}; supported: None, 'default', 'linear', 'llama3'"
    )


def build_rope_cache(
    head_dim: int,
    max_positions: int,
    theta: float,
    rope_scaling: dict | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Precompute the rotary cos/sin table.

    Args:
        head_dim: rotary dimension (even).
        max_positions: number of positions (rows) to precompute.
        theta: RoPE base (``rope_theta``).
        rope_scaling: ``None`` or a Hugging Face ``rope_scaling`` dict whose ``rope_type`` (or legacy
            ``type``) is ``"default"``, ``"linear"`` (``factor``) or ``"llama3"`` (``factor``,
            ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``), computed
            exactly as transformers' ``ROPE_INIT_FUNCTIONS``.
        device: where to place the table.

    Returns:
        ``[max_positions, head_dim]`` float32: ``cos(p * inv_freq)`` in the first half and
        ``sin(p * inv_freq)`` in the second half (``head_dim // 2`` columns each).

    Raises:
        ValueError: for an odd/non-positive ``head_dim``, ``max_positions < 1``, or an unsupported
            scaling type. KeyError: a scaling dict missing a required key.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    if max_positions < 1:
        raise ValueError(f"max_positions must be >= 1, got {max_positions}")
    inv_freq = _rope_inv_freq(head_dim, theta, rope_scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: ``silu(gate) * up``.

    Args:
        x: ``[..., 2 * d]`` with the gate projection in the first half and up in the second (the
            layout of a merged gate_up projection, as in vLLM).

    Returns:
        ``[..., d]`` in ``x.dtype``, computed in fp32.

    Raises:
        ValueError: if the last dimension is odd.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"last dimension must be even (gate|up), got {x.shape[-1]}")
    d = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """GeGLU activation with the tanh approximation of GELU: ``gelu_tanh(gate) * up``.

    ``gelu_tanh(x) = 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))``, PyTorch's
    ``F.gelu(x, approximate="tanh")`` and transformers' ``gelu_pytorch_tanh`` (Gemma's
    ``hidden_activation``).

    Args:
        x: ``[..., 2 * d]`` with the gate projection in the first half and up in the second (the
            layout of a merged gate_up projection, as for :func:`silu_and_mul_ref`).

    Returns:
        ``[..., d]`` in ``x.dtype``, computed in fp32.

    Raises:
        ValueError: if the last dimension is odd.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"last dimension must be even (gate|up), got {x.shape[-1]}")
    d = x.shape[-1] // 2
    xf = x.float()
    return (F.gelu(xf[..., :d], approximate="tanh") * xf[..., d:]).to(x.dtype)
