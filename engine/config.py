"""Configuration records: `KvCacheConfig`, `MoeConfig` (public, TensorRT-LLM's names)."""

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


@dataclass
class MoeConfig:
    """How mixture-of-experts layers run (TensorRT-LLM's `MoeConfig`; ``LLM(moe_config=...)``).

    Attributes:
        backend: the experts' kernels: ``"TRITON"`` (default; ``kernels/fused_moe.py`` on CUDA, the
            PyTorch reference on CPU) or ``"TORCH"`` (the reference everywhere: a loop over the
            experts that received tokens). Case-insensitive. TensorRT-LLM's other backends
            (``"CUTLASS"``, ``"TRTLLM"``, ``"DEEPGEMM"``, ...) are errors naming the supported ones.

    Raises:
        ValueError: an unsupported ``backend``.
    """

    backend: str = "TRITON"

    def __post_init__(self) -> None:
        from kvpilot.kernels.moe import check_backend

        self.backend = check_backend(self.backend)


def check_moe_parallelism(tensor_parallel_size: int, moe_expert_parallel_size: Optional[int],
                          moe_tensor_parallel_size: Optional[int]) -> int:
    """Check the MoE layout arguments of `kvpilot.LLM` (TensorRT-LLM's names and rule:
    ``tensor_parallel_size = moe_tensor_parallel_size * moe_expert_parallel_size``) and return the
    expert-parallel size.

    Unset values follow from the others: neither set, every expert is split over all
    tensor-parallel ranks (``moe_expert_parallel_size`` 1); one set, the other is
    ``tensor_parallel_size`` divided by it. The attention stays tensor parallel over all ranks
    either way (`kvpilot.model.moe`).

    Raises:
        ValueError: a value that is not a positive integer, one that does not divide
            ``tensor_parallel_size``, or a product other than ``tensor_parallel_size``.
    """
    tp = tensor_parallel_size
    for name, value in (("moe_expert_parallel_size", moe_expert_parallel_size),
                        ("moe_tensor_parallel_size", moe_tensor_parallel_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
        if value is not None and tp % value:
            raise ValueError(f"{name}={value} must divide tensor_parallel_size={tp}")
    ep = moe_expert_parallel_size or (tp // moe_tensor_parallel_size if moe_tensor_parallel_size else 1)
    mtp = moe_tensor_parallel_size or tp // ep
    if ep * mtp != tp:
        raise ValueError(f"moe_tensor_parallel_size={mtp} x moe_expert_parallel_size={ep} must equal "
                         f"tensor_parallel_size={tp}")
    return ep
