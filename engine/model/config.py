"""`ModelConfig`: the parts of a Hugging Face `config.json` the engine uses."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


@dataclass
class ModelConfig:
    """The parts of a Hugging Face `config.json` every family uses (the rest: ``raw``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict[str, Any]]
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str
    bos_token_id: Optional[int]
    eos_token_ids: list[int]
    attention_bias: bool = False
    mlp_bias: bool = False
    architecture: str = "LlamaForCausalLM"
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    #: not from config.json: the MoE kernels' backend (`kvpilot.config.MoeConfig.backend`) and the
    #: expert-parallel size (`LLM`'s ``moe_expert_parallel_size``, `kvpilot.model.moe`)
    moe_backend: str = "TRITON"
    moe_expert_parallel_size: int = 1
    #: an on-the-fly quantization request (`kvpilot.config.QuantConfig.to_dict`), or None
    quantization: Optional[dict[str, Any]] = None

    @classmethod
    def from_dir(cls, model_dir: Path, trust_remote_code: bool = False) -> "ModelConfig":
        """Read ``config.json`` (and ``generation_config.json`` for the stop ids) from a model directory.

        Family-specific keys (sliding windows, soft caps, layer types, rope parameters per layer
        type, ...) stay in ``raw`` for the family's `kvpilot.model.decoder.FamilySpec`.

        Raises:
            FileNotFoundError: no config.json.
            kvpilot.model.registry.UnsupportedArchitectureError: an architecture kvpilot does not
                run (the message lists the supported ones) or one that needs remote code.
        """
        from kvpilot.model.registry import resolve_architecture

        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no config.json; expected a Hugging Face checkpoint directory")
        cfg = json.loads(path.read_text())
        if not cfg.get("quantization_config"):  # ModelOpt's side file (kvpilot.model.quantization)
            from kvpilot.model.quantization import read_hf_quant_config

            modelopt = read_hf_quant_config(model_dir)
            if modelopt is not None:
                cfg["quantization_config"] = modelopt
        arch = resolve_architecture(cfg, trust_remote_code, str(model_dir))
        heads = cfg["num_attention_heads"]
        eos = _as_list(cfg.get("eos_token_id"))
        gen_path = Path(model_dir) / "generation_config.json"
        if gen_path.is_file():
            gen = json.loads(gen_path.read_text())
            eos = list(dict.fromkeys(eos + _as_list(gen.get("eos_token_id"))))
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        # transformers 5 moves rope settings into `rope_parameters`.
        params = cfg.get("rope_parameters")
        if isinstance(params, dict):
            rope_theta = rope_theta or params.get("rope_theta")
            if params.get("rope_type", "default") != "default" and rope_scaling is None:
                rope_scaling = params
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            architecture=arch,
            raw=cfg,
        )


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


#: generation_config.json keys applied as sampling defaults, and their SamplingParams names
GENERATION_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                           "repetition_penalty": "repetition_penalty", "min_p": "min_p"}


@dataclass(frozen=True)
class GenerationDefaults:
    """A checkpoint's recommended sampling settings (``generation_config.json``), applied to a request
    field the request leaves unset, as vLLM's ``--generation-config auto`` does.

    ``values`` maps `kvpilot.SamplingParams` field names to the file's values (only the keys of
    `GENERATION_DEFAULT_KEYS` that the file sets); the end-of-sequence ids of the file are merged
    into `ModelConfig.eos_token_ids` instead.
    """

    values: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dir(cls, model_dir: Path) -> "GenerationDefaults":
        """Read ``generation_config.json`` (none: no defaults).

        Raises:
            ValueError: the file is not a JSON object.
        """
        path = Path(model_dir) / "generation_config.json"
        if not path.is_file():
            return cls()
        gen = json.loads(path.read_text())
        if not isinstance(gen, dict):
            raise ValueError(f"{path} must hold a JSON object")
        return cls({ours: gen[theirs] for theirs, ours in GENERATION_DEFAULT_KEYS.items() if gen.get(theirs) is not None})

    def describe(self) -> str:
        """One line for the start-up log: which defaults apply."""
        if not self.values:
            return "none (generation_config.json sets no sampling defaults)"
        return ", ".join(f"{k}={v}" for k, v in sorted(self.values.items()))
