"""`LoraConfig` (TensorRT-LLM's ``tensorrt_llm.llmapi.LoraConfig``) and `LoRARequest`
(``tensorrt_llm.executor.LoRARequest``): how many adapters an engine holds, and which one a request uses."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class LoraConfig:
    """LoRA settings of an `LLM` (TensorRT-LLM's field names and meanings).

    Attributes:
        lora_dir: PEFT adapter directories loaded into host memory when the engine starts (each
            checked against the base model then); requests name them with a `LoRARequest` whose
            ``lora_path`` is the same directory. Adapters not listed load on first use.
        max_lora_rank: the largest rank ``r`` an adapter may have (GPU slots are sized for it).
        max_loras: adapters resident on the device at once (the GPU slots); a step's sequences use
            at most this many distinct adapters, and a request whose adapter would be one more
            waits until a running adapter's sequences finish.
        max_cpu_loras: adapters kept in host memory (an LRU over the loaded adapters; at least
            ``max_loras``); default ``max(max_loras, len(lora_dir))``.
        lora_target_modules: accepted for TensorRT-LLM compatibility; the targets are read from
            each adapter's ``adapter_config.json`` / tensors.

    Raises:
        ValueError: ``lora_dir`` not a path or a list of paths, a non-positive count or rank, or
            ``max_cpu_loras < max_loras``.
    """

    lora_dir: list[str] = field(default_factory=list)
    max_lora_rank: int = 64
    max_loras: int = 4
    max_cpu_loras: Optional[int] = None
    lora_target_modules: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.lora_dir, (str, os.PathLike)):
            self.lora_dir = [self.lora_dir]
        if not isinstance(self.lora_dir, (list, tuple)) or \
                not all(isinstance(d, (str, os.PathLike)) for d in self.lora_dir):
            raise ValueError(f"LoraConfig.lora_dir must be a list of adapter directories, got {self.lora_dir!r}")
        self.lora_dir = [os.fspath(d) for d in self.lora_dir]
        for name in ("max_lora_rank", "max_loras"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LoraConfig.{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = max(self.max_loras, len(self.lora_dir))
        if isinstance(self.max_cpu_loras, bool) or not isinstance(self.max_cpu_loras, int) \
                or self.max_cpu_loras < self.max_loras:
            raise ValueError(f"LoraConfig.max_cpu_loras must be an integer >= max_loras ({self.max_loras}), "
                             f"got {self.max_cpu_loras!r}")


@dataclass(frozen=True)
class LoRARequest:
    """The adapter one request runs with.

    Attributes:
        lora_name: a name for logs and the server's model list.
        lora_int_id: the adapter's id, unique per adapter (an integer >= 0): requests with the same
            id share one loaded copy and their prefix-cache blocks; different ids never share KV blocks.
        lora_path: the PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).
        lora_ckpt_source: ``"hf"`` (PEFT layout), the only source kvpilot reads.

    Raises:
        ValueError: an empty name or path, a negative or non-integer id, another checkpoint source.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_ckpt_source: str = "hf"

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 0:
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 0, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path (the adapter directory) is required")
        if self.lora_ckpt_source != "hf":
            raise ValueError(f"LoRARequest.lora_ckpt_source must be 'hf' (PEFT adapter directories), "
                             f"got {self.lora_ckpt_source!r}")
        object.__setattr__(self, "lora_path", str(self.lora_path))

    # TensorRT-LLM's and vLLM's accessor names
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
