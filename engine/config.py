"""Configuration records: `KvCacheConfig` (public, TensorRT-LLM's names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvpilot import envs


KV_CACHE_DTYPES = ("auto", "fp8", "bfloat16", "float16", "float32", "bf16", "fp16", "fp32")
"""Accepted values of `KvCacheConfig.dtype`."""


@dataclass
class KvCacheConfig:
    """How the paged KV cache is sized and reused (TensorRT-LLM's `KvCacheConfig` fields).

    Attributes:
        free_gpu_memory_fraction: fraction (0, 1] of the GPU memory still free after the weights are
            loaded and a profiling forward pass at ``max_num_tokens`` has run, given to the KV pool.
            On CPU it applies to ``KVPILOT_CPU_KVCACHE_GB`` (default 4 GiB), as vLLM's CPU backend
            does with its KV-cache space setting.
        enable_block_reuse: reuse cached full blocks of a shared prompt prefix (chained block hash).
        dtype: "auto" (the model's dtype), "fp8" (FP8 E4M3 keys and values, unscaled and saturated
            at +-448: half the bytes per token of a 16-bit cache; TensorRT-LLM's name), or a torch
            dtype name ("bfloat16", "float16", "float32").
        tokens_per_block: tokens in one KV block (the page size).
        max_tokens: optional cap on the pool, in tokens (rounded down to whole blocks).
    """

    free_gpu_memory_fraction: float = 0.9
    enable_block_reuse: bool = True
    dtype: str = "auto"
    tokens_per_block: int = 32
    max_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        if not (0.0 < float(self.free_gpu_memory_fraction) <= 1.0):
            raise ValueError(f"free_gpu_memory_fraction must be in (0, 1], got {self.free_gpu_memory_fraction}")
        if not isinstance(self.tokens_per_block, int) or self.tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be an integer >= 1, got {self.tokens_per_block}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < self.tokens_per_block):
            raise ValueError(f"max_tokens must be an integer >= tokens_per_block ({self.tokens_per_block}), "
                             f"got {self.max_tokens}")
        if self.dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"dtype must be one of auto, fp8, bfloat16, float16, float32, got {self.dtype!r}")


def cpu_kv_cache_bytes() -> int:
    """Bytes the CPU backend may give its KV pool (``KVPILOT_CPU_KVCACHE_GB``, default 4)."""
    return envs.cpu_kv_cache_bytes()
