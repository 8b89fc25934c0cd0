"""``kvpilot.llmapi``: the names TensorRT-LLM's examples import from ``tensorrt_llm.llmapi``.

Code written for TensorRT-LLM (``from tensorrt_llm.llmapi import KvCacheConfig``) ports by renaming
the package. The objects are the same as ``kvpilot``'s top-level ones.
"""

from kvpilot.config import KvCacheConfig, MoeConfig, QuantAlgo, QuantConfig
from kvpilot.llm import LLM
from kvpilot.lora.config import LoraConfig
from kvpilot.outputs import CompletionOutput, RequestOutput
from kvpilot.sampling_params import GuidedDecodingParams, SamplingParams
from kvpilot.spec_decode.config import DraftTargetDecodingConfig, NGramDecodingConfig

__all__ = ["CompletionOutput", "DraftTargetDecodingConfig", "GuidedDecodingParams", "KvCacheConfig", "LLM",
           "LoraConfig", "MoeConfig", "NGramDecodingConfig", "QuantAlgo", "QuantConfig",
           "RequestOutput", "SamplingParams"]
