"""kvpilot: a continuous-batching, paged-KV-cache LLM engine (and the operator that runs it).

Public API (TensorRT-LLM's LLM API)::

    from kvpilot import LLM, SamplingParams, KvCacheConfig, MoeConfig, RequestOutput, CompletionOutput

Names are resolved lazily (PEP 562), so ``kvpilot.operator`` and ``kvpilot render`` do not import
torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "llm", "EngineDeadError": "outputs",
    "SamplingParams": "sampling_params", "GuidedDecodingParams": "sampling_params",
    "KvCacheConfig": "config", "MoeConfig": "config", "QuantConfig": "config", "QuantAlgo": "config",
    "NGramDecodingConfig": "spec_decode.config", "DraftTargetDecodingConfig": "spec_decode.config",
    "RequestOutput": "outputs", "CompletionOutput": "outputs", "Logprob": "outputs",
    "RequestError": "outputs", "RequestAborted": "outputs", "RequestTooLargeError": "outputs",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpilot' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
