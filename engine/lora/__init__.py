"""LoRA adapters on the serving engine (docs/lora.md).

- `kvpilot.lora.config`: `LoraConfig` (``kvpilot.llmapi.LoraConfig``) and `LoRARequest`
  (``kvpilot.executor.LoRARequest``).
- `kvpilot.lora.adapter`: reading PEFT adapter directories; the host-memory LRU (`AdapterCache`).
- `kvpilot.lora.layers`: the device slots on each projection and the per-step slot index (`LoRASlots`).
- ``kvpilot.kernels.lora``: the batched apply (PyTorch reference and Triton shrink/expand kernels).
"""

from kvpilot.lora.config import LoRARequest, LoraConfig

__all__ = ["LoRARequest", "LoraConfig"]
