"""``kvpilot.executor``: the names TensorRT-LLM's examples import from ``tensorrt_llm.executor``."""

from kvpilot.lora.config import LoRARequest

__all__ = ["LoRARequest"]
