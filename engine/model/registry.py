"""From a checkpoint's ``config.json`` ``architectures`` to the kvpilot model class that runs it.

`MODEL_REGISTRY` names each supported architecture's module and class (imported on first use, so
reading a config never imports torch model code). `resolve_architecture` picks the first listed
architecture kvpilot knows; `model_class` returns its class.

Errors name the architecture: an unknown one lists the supported architectures; one whose config
asks for remote code (``auto_map``, i.e. modelling code shipped with the checkpoint) says that
kvpilot does not run remote code, whatever ``trust_remote_code`` says.
"""

from __future__ import annotations

import importlib
from typing import Any

#: architecture -> (module under kvpilot.model, class)
MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}


class UnsupportedArchitectureError(ValueError):
    """A checkpoint whose architecture kvpilot does not implement (or that needs remote code)."""


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def resolve_architecture(hf_config: dict[str, Any], trust_remote_code: bool = False, source: str = "") -> str:
    """The first of ``hf_config["architectures"]`` (default ``["LlamaForCausalLM"]``) in the registry.

    Raises:
        UnsupportedArchitectureError: none is supported; the message names them, says whether the
            config needs remote code, and lists the supported architectures.
    """
    archs = hf_config.get("architectures") or ["LlamaForCausalLM"]
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return arch
    where = f" ({source})" if source else ""
    supported = ", ".join(supported_architectures())
    if hf_config.get("auto_map"):
        verb = "was passed trust_remote_code=True, but" if trust_remote_code else "needs"
        raise UnsupportedArchitectureError(
            f"architecture {', '.join(archs)}{where} {verb} modelling code shipped with the checkpoint "
            f"(auto_map); kvpilot does not run remote code. Supported architectures: {supported}")
    raise UnsupportedArchitectureError(
        f"unsupported architecture {', '.join(archs)}{where}; supported architectures: {supported}")


def model_class(architecture: str):
    """The `torch.nn.Module` class for a registered ``architecture``.

    Raises:
        UnsupportedArchitectureError: ``architecture`` is not registered.
    """
    try:
        module, name = MODEL_REGISTRY[architecture]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {architecture}; supported architectures: "
            f"{', '.join(supported_architectures())}") from None
    return getattr(importlib.import_module(f"kvpilot.model.{module}"), name)
