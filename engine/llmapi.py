"""``kvpilot.llmapi``: the names TensorRT-LLM's examples import from ``tensorrt_llm.llmapi``.

Code written for TensorRT-LLM (``from tensorrt_llm.llmapi import KvCacheConfig``) ports by renaming
the package. The objects are the same as ``kvpilot``'s top-level ones.
"""

from kvpilot.config import KvCacheConfig
from kvpilot.llm import LLM
from kvpilot.outputs import CompletionOutput, RequestOutput
from kvpilot.sampling_params import SamplingParams
from kvpilot.spec_decode.config import DraftTargetDecodingConfig, NGramDecodingConfig

__all__ = ["CompletionOutput", "DraftTargetDecodingConfig", "KvCacheConfig", "LLM", "NGramDecodingConfig",
           "RequestOutput", "SamplingParams"]
