"""Kernels of the kvpilot engine: paged attention, KV-cache write, RMSNorm, rotary, SiLU-and-mul,
GELU(tanh)-and-mul.

The attention ops take keywords ``sliding_window`` (a query at position ``p`` sees keys in
``(p - W, p]``, the Hugging Face convention of Mistral / Qwen2 / Gemma 2-3) and ``logits_soft_cap``
(scores ``c * tanh(s / c)``, Gemma 2); ``scale`` is the softmax scale (Gemma:
``query_pre_attn_scalar ** -0.5``). See :func:`~kvpilot.kernels.reference.paged_attention_ref`.

``rotary_write_kv_cache`` fuses rotary embedding with the KV-cache write (one launch per layer
instead of two); the engine's attention layer calls it before prefill and mixed steps' attention.
``rotary_decode_attention`` fuses both with the decode attention of decode-only batches (one launch
instead of three at small batch sizes).

Every op exists in three names:

- ``<op>_ref``: plain PyTorch (``kernels/reference.py``); what the engine runs on CPU.
- ``<op>_triton``: the Triton kernel (``kernels/attention.py``, ``kv_cache.py``, ``pointwise.py``);
  runs on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
- ``<op>``: dispatches to Triton when the input is on CUDA and Triton is importable, else to the
  reference.

Triton is imported lazily, so ``import kvpilot.kernels`` works on machines without it.
Layouts and algorithms are described in docs/kernels.md.
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch

from .reference import (
    FP8_KV_DTYPE,
    FP8_KV_MAX,
    apply_rotary_ref,
    build_rope_cache,
    check_window_and_cap,
    gelu_tanh_and_mul_ref,
    paged_attention_ref,
    rms_norm_ref,
    rotary_write_kv_cache_ref,
    silu_and_mul_ref,
    write_kv_cache_ref,
)

logger = logging.getLogger(__name__)

__all__ = [
    "FP8_KV_DTYPE",
    "FP8_KV_MAX",
    "write_kv_cache",
    "write_kv_cache_ref",
    "write_kv_cache_triton",
    "paged_attention",
    "paged_attention_ref",
    "paged_attention_triton",
    "rms_norm",
    "rms_norm_ref",
    "rms_norm_triton",
    "apply_rotary",
    "apply_rotary_ref",
    "apply_rotary_triton",
    "rotary_decode_attention",
    "rotary_decode_attention_ref",
    "rotary_decode_attention_triton",
    "rotary_write_kv_cache",
    "rotary_write_kv_cache_ref",
    "rotary_write_kv_cache_triton",
    "build_rope_cache",
    "silu_and_mul",
    "silu_and_mul_ref",
    "silu_and_mul_triton",
    "gelu_tanh_and_mul",
    "gelu_tanh_and_mul_ref",
    "gelu_tanh_and_mul_triton",
    "triton_available",
]


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when the ``triton`` package can be imported (checked once, then cached)."""
    try:
        importlib.import_module("triton")
    except ImportError:
        logger.info("triton is not installed; kernels fall back to the PyTorch references")
        return False
    return True


def _triton_impl(module: str, name: str):
    """Return ``kvpilot.kernels.<module>.<name>``, importing the Triton module on first use."""
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Triton version of :func:`~kvpilot.kernels.reference.write_kv_cache_ref` (same contract)."""
    return _triton_impl("kv_cache", "write_kv_cache_triton")(k, v, k_cache, v_cache, slot_mapping)


def paged_attention_triton(*args, **kwargs):
    """Triton version of :func:`~kvpilot.kernels.reference.paged_attention_ref` (same arguments).

    Also takes keywords ``num_splits``, which overrides the split-K heuristic of the decode path,
    and ``launch_kv_heads`` (see ``kernels/attention.py``); ``sliding_window`` and
    ``logits_soft_cap`` as for the reference.
    """
    return _triton_impl("attention", "paged_attention_triton")(*args, **kwargs)


def rotary_decode_attention_triton(*args, **kwargs):
    """Triton version of :func:`rotary_decode_attention_ref` in one launch (same arguments, plus
    ``num_splits`` and ``launch_kv_heads``; see ``kernels/attention.py``; ``sliding_window`` and
    ``logits_soft_cap`` as for the reference). ``q`` is not modified."""
    return _triton_impl("fused_decode_attention", "rotary_decode_attention_triton")(*args, **kwargs)


def rotary_decode_attention_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables,
                                seq_lens, query_start_loc, scale, max_seq_len, *, sliding_window=None,
                                logits_soft_cap=None):
    """Rotary + KV-cache write + attention of a decode-only batch (every query one token or none).

    Exactly :func:`~kvpilot.kernels.reference.rotary_write_kv_cache_ref` followed by
    :func:`~kvpilot.kernels.reference.paged_attention_ref` with ``max_query_len = 1``; see those for
    shapes, dtypes, ``sliding_window``, ``logits_soft_cap`` and errors. Returns ``[num_tokens, num_heads,
    head_dim]`` in ``q.dtype``; ``q`` is not modified.
    """
    check_window_and_cap(sliding_window, logits_soft_cap)
    q = rotary_write_kv_cache_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, 1, max_seq_len,
                               sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)


def rms_norm_triton(x, weight, eps, residual=None):
    """Triton version of :func:`~kvpilot.kernels.reference.rms_norm_ref` (same contract)."""
    return _triton_impl("pointwise", "rms_norm_triton")(x, weight, eps, residual)


def apply_rotary_triton(q, k, positions, cos_sin_cache):
    """Triton version of :func:`~kvpilot.kernels.reference.apply_rotary_ref`; rotates in place."""
    return _triton_impl("pointwise", "apply_rotary_triton")(q, k, positions, cos_sin_cache)


def rotary_write_kv_cache_triton(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping):
    """Triton version of :func:`~kvpilot.kernels.reference.rotary_write_kv_cache_ref`, one launch.

    Rotates ``q`` in place and returns it; writes rotated ``k`` and ``v`` to the cache.
    """
    return _triton_impl("kv_cache", "rotary_write_kv_cache_triton")(
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping
    )


def silu_and_mul_triton(x):
    """Triton version of :func:`~kvpilot.kernels.reference.silu_and_mul_ref` (same contract)."""
    return _triton_impl("pointwise", "silu_and_mul_triton")(x)


def gelu_tanh_and_mul_triton(x):
    """Triton version of :func:`~kvpilot.kernels.reference.gelu_tanh_and_mul_ref` (same contract)."""
    return _triton_impl("pointwise", "gelu_tanh_and_mul_triton")(x)


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write K/V into the paged cache in place; Triton on CUDA, reference otherwise.

    See :func:`~kvpilot.kernels.reference.write_kv_cache_ref` for shapes and errors.
    """
    fn = write_kv_cache_triton if _use_triton(k) else write_kv_cache_ref
    return fn(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len, max_seq_len,
    *, launch_kv_heads=None, sliding_window=None, logits_soft_cap=None,
):
    """Paged causal attention for mixed prefill/decode batches; Triton on CUDA, reference otherwise.

    See :func:`~kvpilot.kernels.reference.paged_attention_ref` for shapes, semantics, the
    ``sliding_window`` and ``logits_soft_cap`` keywords, and errors. ``launch_kv_heads`` (default
    None: the cache's KV-head count): the KV-head count the Triton kernels' launch decisions assume
    (`kvpilot.kernels.attention.paged_attention_triton`); the reference computes each head alike
    whatever it is.
    """
    window = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    if not _use_triton(q):
        return paged_attention_ref(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len, max_seq_len, **window
        )
    return paged_attention_triton(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len, max_seq_len,
        launch_kv_heads=launch_kv_heads, **window,
    )


def rms_norm(x, weight, eps, residual=None):
    """RMSNorm (+ fused residual add); Triton on CUDA, reference otherwise.

    See :func:`~kvpilot.kernels.reference.rms_norm_ref`.
    """
    fn = rms_norm_triton if _use_triton(x) else rms_norm_ref
    return fn(x, weight, eps, residual)


def apply_rotary(q, k, positions, cos_sin_cache):
    """Rotary embedding (HF half-split); Triton on CUDA (in place), reference otherwise.

    Callers must use the returned tensors. See :func:`~kvpilot.kernels.reference.apply_rotary_ref`.
    """
    fn = apply_rotary_triton if _use_triton(q) else apply_rotary_ref
    return fn(q, k, positions, cos_sin_cache)


def rotary_write_kv_cache(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping):
    """Rotary embedding of q and k plus the KV-cache write of rotated k and v, in one op.

    Triton on CUDA (one launch; ``q`` rotated in place), reference otherwise. Callers must use the
    returned queries. See :func:`~kvpilot.kernels.reference.rotary_write_kv_cache_ref` for shapes
    and errors.
    """
    if not _use_triton(q):
        return rotary_write_kv_cache_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    global _fused_rotary_failed
    if not _fused_rotary_failed:
        try:
            return rotary_write_kv_cache_triton(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
        except Exception:  # noqa: BLE001 - e.g. a Triton version that cannot compile it
            # The first call is the runner's profiling pass, before any CUDA graph is captured, so
            # the switch happens once, up front. The two-launch pair computes the same values.
            logger.warning("fused rotary + KV-cache write kernel failed; using the two-kernel path", exc_info=True)
            _fused_rotary_failed = True
    q, k = apply_rotary_triton(q, k, positions, cos_sin_cache)
    write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping)
    return q


_fused_rotary_failed = False


def rotary_decode_attention(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables,
                            seq_lens, query_start_loc, scale, max_seq_len, *, launch_kv_heads=None,
                            sliding_window=None, logits_soft_cap=None):
    """Rotary, KV-cache write and attention of a decode-only batch (``max_query_len == 1``).

    On CUDA with Triton: one launch (`rotary_decode_attention_triton`) for batches of at most
    ``TUNING["decode"]["fused_rotary_max_seqs"]`` sequences (4.18 against 4.25 ms batch-1 ITL at
    512 keys, and faster at every context measured, BENCHMARKS.md), else `rotary_write_kv_cache` then `paged_attention`; elsewhere `rotary_decode_attention_ref`.
    Callers must use the returned output only (``q`` may or may not be rotated in place).
    ``launch_kv_heads`` as for `paged_attention`. The one-launch kernel writes K/V only for tokens in
    a sequence's one-token query range (the engine's padding has slot -1, so the paths agree there).
    ``sliding_window`` and ``logits_soft_cap`` as for
    :func:`~kvpilot.kernels.reference.paged_attention_ref`.

    Raises:
        ValueError: bad shapes or arguments (from the kernel's checks; no switch of path). Any other
            error of the one-launch kernel (e.g. a Triton that cannot compile it), except running out
            of GPU memory, switches this process to the unfused launches for good, with a warning.
    """
    window = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    if not _use_triton(q):
        return rotary_decode_attention_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                           block_tables, seq_lens, query_start_loc, scale, max_seq_len, **window)
    global _fused_decode_failed
    tuning = _triton_impl("attention", "TUNING")["decode"]
    if (not _fused_decode_failed
            and seq_lens.shape[0] <= tuning.get("fused_rotary_max_seqs", 0)):
        try:
            return rotary_decode_attention_triton(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                                  block_tables, seq_lens, query_start_loc, scale, max_seq_len,
                                                  launch_kv_heads=launch_kv_heads, **window)
        except (ValueError, torch.cuda.OutOfMemoryError):
            raise
        except Exception:  # noqa: BLE001 - e.g. a Triton version that cannot compile it
            # As for the fused rotary kernel: the switch happens in an eager step, before capture.
            logger.warning("fused decode attention kernel failed; using the unfused launches", exc_info=True)
            _fused_decode_failed = True
    q = rotary_write_kv_cache(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, 1, max_seq_len,
                           launch_kv_heads=launch_kv_heads, **window)


_fused_decode_failed = False


def silu_and_mul(x):
    """``silu(x[..., :d]) * x[..., d:]``; Triton on CUDA, reference otherwise.

    See :func:`~kvpilot.kernels.reference.silu_and_mul_ref`.
    """
    fn = silu_and_mul_triton if _use_triton(x) else silu_and_mul_ref
    return fn(x)


def gelu_tanh_and_mul(x):
    """``gelu_tanh(x[..., :d]) * x[..., d:]`` (GeGLU, Gemma); Triton on CUDA, reference otherwise.

    See :func:`~kvpilot.kernels.reference.gelu_tanh_and_mul_ref`.
    """
    fn = gelu_tanh_and_mul_triton if _use_triton(x) else gelu_tanh_and_mul_ref
    return fn(x)
