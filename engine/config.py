"""Configuration records: `KvCacheConfig`, `MoeConfig`, `QuantConfig` (public, TensorRT-LLM's names)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional, Union

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


class QuantAlgo(str, Enum):
    """TensorRT-LLM's quantization algorithm names (``tensorrt_llm.llmapi.QuantAlgo``). kvpilot
    quantizes on the fly with `FP8` (`QuantConfig`); the others name schemes of pre-quantized
    checkpoints, and those kvpilot does not run are refused with the supported list."""

    FP8 = "FP8"
    FP8_PER_CHANNEL_PER_TOKEN = "FP8_PER_CHANNEL_PER_TOKEN"
    FP8_BLOCK_SCALES = "FP8_BLOCK_SCALES"
    NVFP4 = "NVFP4"
    W4A16_AWQ = "W4A16_AWQ"
    W4A16_GPTQ = "W4A16_GPTQ"
    W4A8_AWQ = "W4A8_AWQ"
    W8A16 = "W8A16"
    W8A8_SQ_PER_CHANNEL = "W8A8_SQ_PER_CHANNEL"
    INT8 = "INT8"
    NO_QUANT = "NO_QUANT"


#: `QuantConfig.quant_algo` values kvpilot applies to a 16/32-bit checkpoint at load
ON_THE_FLY_QUANT_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")


def _algo(value: Union[str, QuantAlgo, None], field: str) -> Optional[str]:
    if value is None:
        return None
    name = value.value if isinstance(value, QuantAlgo) else str(value)
    name = name.upper()
    return None if name in ("", "NONE", "NO_QUANT") else name


@dataclass
class QuantConfig:
    """Quantization the engine applies (TensorRT-LLM's `QuantConfig` fields; docs/quantization.md).

    Attributes:
        quant_algo: None (the checkpoint's own weights: 16/32-bit, or the FP8 scheme a quantized
            checkpoint declares), or "FP8" (`QuantAlgo.FP8`): quantize a 16/32-bit checkpoint's
            linear-layer weights to FP8 E4M3 at load, one float32 scale per output channel,
            activations quantized per token at run time; ``lm_head`` and embeddings stay 16-bit.
            ("FP8_PER_CHANNEL_PER_TOKEN" is the same.)
        kv_cache_quant_algo: None, or "FP8": the FP8 E4M3 KV cache (``KvCacheConfig(dtype="fp8")``).
        exclude_modules: checkpoint module names (``fnmatch`` patterns, e.g. ``"model.layers.0.*"``)
            left unquantized by ``quant_algo``.

    Raises:
        kvpilot.model.quantization.UnsupportedQuantizationError (a ValueError): an algorithm kvpilot
            does not apply on the fly (NVFP4, INT4 AWQ/GPTQ, INT8 SmoothQuant, ...), naming the
            supported ones.
        ValueError: ``exclude_modules`` not a list of strings.
    """

    quant_algo: Optional[Union[str, QuantAlgo]] = None
    kv_cache_quant_algo: Optional[Union[str, QuantAlgo]] = None
    exclude_modules: Optional[list[str]] = None

    def __post_init__(self) -> None:
        self.quant_algo = _algo(self.quant_algo, "quant_algo")
        self.kv_cache_quant_algo = _algo(self.kv_cache_quant_algo, "kv_cache_quant_algo")
        if self.quant_algo is not None and self.quant_algo not in ON_THE_FLY_QUANT_ALGOS:
            from kvpilot.model.quantization import SUPPORTED_SCHEMES, UnsupportedQuantizationError

            raise UnsupportedQuantizationError(
                f"QuantConfig(quant_algo={self.quant_algo!r}) is not supported: kvpilot quantizes 16/32-bit "
                f"checkpoints on the fly with quant_algo='FP8' only (pre-quantized checkpoints it reads: "
                f"{SUPPORTED_SCHEMES})")
        if self.kv_cache_quant_algo not in (None, "FP8"):
            from kvpilot.model.quantization import UnsupportedQuantizationError

            raise UnsupportedQuantizationError(f"kv_cache_quant_algo {self.kv_cache_quant_algo!r} is not "
                                               f"supported; supported: FP8 (or None)")
        if self.exclude_modules is not None:
            if not isinstance(self.exclude_modules, (list, tuple)) or \
                    not all(isinstance(m, str) for m in self.exclude_modules):
                raise ValueError(f"exclude_modules must be a list of module names, got {self.exclude_modules!r}")
            self.exclude_modules = list(self.exclude_modules)

    def to_dict(self) -> dict[str, Any]:
        """The on-the-fly request `kvpilot.model.quantization.get_quantization_method` reads."""
        return {"quant_algo": self.quant_algo, "exclude_modules": list(self.exclude_modules or ())}

    def kv_cache_dtype(self, kv: KvCacheConfig) -> str:
        """``kv``'s dtype with ``kv_cache_quant_algo`` applied ("fp8" for FP8).

        Raises:
            ValueError: ``kv_cache_quant_algo="FP8"`` with a KvCacheConfig dtype other than auto/fp8.
        """
        if self.kv_cache_quant_algo != "FP8":
            return kv.dtype
        if kv.dtype not in ("auto", "fp8"):
            raise ValueError(f"QuantConfig(kv_cache_quant_algo='FP8') conflicts with KvCacheConfig(dtype="
                             f"{kv.dtype!r}); leave one of them unset")
        return "fp8"
