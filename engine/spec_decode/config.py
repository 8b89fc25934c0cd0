"""Speculative decoding settings: TensorRT-LLM's config classes (``LLM(speculative_config=...)``).

`NGramDecodingConfig` drafts by prompt lookup (tokens copied from earlier in the sequence, no extra
model); `DraftTargetDecodingConfig` drafts with a smaller model of the same vocabulary, which gets
its own weights and its own paged KV pool. `parse_speculative_config` turns the JSON object of
``kvpilot serve --speculative-config`` into one of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

MAX_DRAFT_LEN = 32
"""The largest ``max_draft_len`` accepted (a verification step computes ``max_draft_len + 1``
positions per sequence)."""


def _check_int(name: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


@dataclass
class NGramDecodingConfig:
    """Prompt-lookup drafting (TensorRT-LLM's `NGramDecodingConfig`; vLLM's ``method: ngram``).

    Each step, for every decoding sequence, the last ``n`` tokens (``n`` from
    ``max_matching_ngram_size`` down to 1, the longest that matches) are looked up in the sequence's
    earlier tokens (prompt and output); the tokens that followed the most recent earlier occurrence
    become the draft, at most ``max_draft_len`` of them. The target model verifies them in one
    forward pass (docs/speculative_decoding.md).

    Attributes:
        max_draft_len: drafted tokens per sequence and step, 1..32.
        max_matching_ngram_size: longest suffix looked up, in tokens, 1..32.
        max_concurrency: speculate only in steps with at most this many running sequences (None:
            always); TensorRT-LLM's field. Past the batch size where verification costs more than
            the accepted tokens save, plain decoding is faster (benchmarks/gpu_spec_decode.py).

    Raises:
        ValueError: a field outside its range.
    """

    max_draft_len: int = 4
    max_matching_ngram_size: int = 4
    max_concurrency: Optional[int] = None

    decoding_type = "NGram"

    def __post_init__(self) -> None:
        _check_int("max_draft_len", self.max_draft_len, 1, MAX_DRAFT_LEN)
        _check_int("max_matching_ngram_size", self.max_matching_ngram_size, 1, 32)
        if self.max_concurrency is not None:
            _check_int("max_concurrency", self.max_concurrency, 1, 1 << 20)


@dataclass
class DraftTargetDecodingConfig:
    """Draft-model speculation (TensorRT-LLM's `DraftTargetDecodingConfig`).

    A smaller model with the target's vocabulary proposes ``max_draft_len`` tokens per sequence
    and step, autoregressively, from its own paged KV cache; the target verifies them in one forward
    pass. The draft samples with each request's own temperature, top-k, top-p and min-p, and
    rejection sampling keeps the output distribution exactly the target's.

    Attributes:
        max_draft_len: drafted tokens per sequence and step, 1..32.
        speculative_model: the draft's Hugging Face checkpoint directory or Hub id. Its
            ``vocab_size`` must equal the target's (same tokenizer).
        speculative_model_dir: TensorRT-LLM's older name of ``speculative_model``; either may be given.
        max_concurrency: as `NGramDecodingConfig.max_concurrency`.

    Raises:
        ValueError: no model given, both names given with different values, or ``max_draft_len``
            outside its range.
    """

    max_draft_len: int = 4
    speculative_model: Optional[str] = None
    speculative_model_dir: Optional[str] = None
    max_concurrency: Optional[int] = None

    decoding_type = "DraftTarget"

    def __post_init__(self) -> None:
        _check_int("max_draft_len", self.max_draft_len, 1, MAX_DRAFT_LEN)
        if self.max_concurrency is not None:
            _check_int("max_concurrency", self.max_concurrency, 1, 1 << 20)
        a, b = self.speculative_model, self.speculative_model_dir
        if a is not None and b is not None and str(a) != str(b):
            raise ValueError(f"speculative_model ({a!r}) and speculative_model_dir ({b!r}) differ; give one")
        model = a if a is not None else b
        if model is None or not str(model):
            raise ValueError("DraftTargetDecodingConfig needs speculative_model (the draft checkpoint)")
        self.speculative_model = self.speculative_model_dir = str(model)


SpeculativeConfig = Union[NGramDecodingConfig, DraftTargetDecodingConfig]

_TYPES = {"ngram": NGramDecodingConfig, "drafttarget": DraftTargetDecodingConfig,
          "draftmodel": DraftTargetDecodingConfig}


def parse_speculative_config(value: Union[str, dict, SpeculativeConfig, None]) -> Optional[SpeculativeConfig]:
    """A speculative config from a config object (returned as is), a dict, or its JSON text.

    The dict holds ``decoding_type`` ("NGram", or "DraftTarget" / "Draft_Target"; TensorRT-LLM's
    values, case and underscores ignored) and the class's fields, e.g.
    ``{"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 2}``.

    Raises:
        ValueError: not JSON, not an object, no or an unknown ``decoding_type``, an unknown field,
            or a field the class rejects.
    """
    if value is None or isinstance(value, (NGramDecodingConfig, DraftTargetDecodingConfig)):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative config must be a JSON object, got {type(value).__name__}")
    d: dict[str, Any] = dict(value)
    kind = d.pop("decoding_type", None)
    if not isinstance(kind, str):
        raise ValueError('speculative config needs "decoding_type": "NGram" or "DraftTarget"')
    cls = _TYPES.get(kind.replace("_", "").replace("-", "").lower())
    if cls is None:
        raise ValueError(f'unknown speculative decoding_type {kind!r}; expected "NGram" or "DraftTarget"')
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown field(s) {unknown} for {cls.__name__}; expected {sorted(known)}")
    return cls(**d)
