"""kvpilot: a continuous-batching, paged-KV-cache LLM engine (and the operator that runs it).

Public API (TensorRT-LLM's LLM API)::

    from kvpilot import LLM, SamplingParams, KvCacheConfig, RequestOutput, CompletionOutput
"""

from .config import KvCacheConfig
from .llm import LLM, EngineDeadError
from .outputs import CompletionOutput, Logprob, RequestAborted, RequestError, RequestOutput
from .sampling_params import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "KvCacheConfig",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestError",
    "RequestAborted",
    "EngineDeadError",
]
__version__ = "0.1.0"
