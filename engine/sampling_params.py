"""`SamplingParams`: how one request is decoded (TensorRT-LLM's LLM API names, vLLM's extras).

Defaults follow TensorRT-LLM's `SamplingParams` where it has the field (``max_tokens=32``) and vLLM's
otherwise (``temperature=1.0``, ``top_p=1.0``, ``top_k=0`` meaning "off"). Every value is checked in
``__post_init__``, so a bad request raises ``ValueError`` (wrong value, naming the field and the
allowed range) or ``TypeError`` (unknown field or wrong type) before it is queued.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

from kvpilot.text import check_text


MAX_N = 128  # OpenAI's limit on `n`; also bounds `best_of` (sequences one request may hold)


@dataclass
class SamplingParams:
    """Decoding settings of one request.

    Length: ``max_tokens`` (>= 1, generated tokens), ``min_tokens`` (EOS, ``stop_token_ids`` and stop
    strings are blocked until this many tokens exist), ``ignore_eos``.
    Sampling: ``temperature`` (0 = greedy), ``top_k`` (0 or -1 = off), ``top_p`` in (0, 1],
    ``min_p`` in [0, 1], ``seed`` (same seed, same text, whatever else is in the batch).
    Several outputs: ``n`` choices, each with its own random stream; ``best_of`` (>= n) candidates of
    which the ``n`` with the highest cumulative log-probability are returned.
    Stops: ``stop`` strings (matched in the detokenized text, across token boundaries),
    ``stop_token_ids``, ``include_stop_str_in_output``.
    Penalties: ``repetition_penalty`` (Hugging Face semantics, over prompt and output tokens),
    ``frequency_penalty`` / ``presence_penalty`` (OpenAI semantics, output tokens only),
    ``logit_bias`` ({token id: bias added to the logit}), ``bad_words`` (strings never generated),
    ``allowed_token_ids``.
    Log-probabilities: ``logprobs`` (top-N per generated token plus the chosen one, from the
    unmodified distribution), ``prompt_logprobs``.
    Output: ``detokenize``, ``skip_special_tokens``, ``return_context_logits``,
    ``return_generation_logits``. ``spaces_between_special_tokens`` is accepted for vLLM
    compatibility; the Hugging Face fast tokenizers kvpilot loads decide that spacing themselves
    (as in vLLM's fast detokenizer).
    TensorRT-LLM's ids: ``end_id`` replaces the model's end-of-sequence ids for this request;
    ``pad_id`` has no effect (batches are ragged, never padded).
    Structured output: ``guided_decoding`` (a `GuidedDecodingParams`: JSON schema, any JSON object,
    regex, EBNF grammar, choice list or structural tag) restricts every token to what the grammar
    allows; the sequence ends (finish_reason "stop") once the grammar is complete and the model
    emits its end token. Not with ``use_beam_search``.

    Raises:
        ValueError: a value outside its allowed range (the message names the field and the range).
        TypeError: an unknown field (from the dataclass constructor) or a value of the wrong type.
    """

    max_tokens: int = 32
    min_tokens: int = 0
    n: int = 1
    best_of: Optional[int] = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    end_id: Optional[int] = None
    pad_id: Optional[int] = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Optional[dict[int, float]] = None
    bad_words: Optional[list[str]] = None
    bad_token_ids: Optional[list[int]] = None
    allowed_token_ids: Optional[list[int]] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_context_logits: bool = False
    return_generation_logits: bool = False
    guided_decoding: Optional["GuidedDecodingParams"] = None
    # Filled in by the engine from `stop` / `bad_words` once a tokenizer is known.
    _bad_words_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check_int("n", self.n, low=1, high=MAX_N)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, low=1, high=MAX_N)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        _check_float("temperature", self.temperature, low=0.0)
        _check_int("top_k", self.top_k, low=-1, high=_MAX_ID)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        _check_float("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("length_penalty", self.length_penalty)
        if self.seed is not None:
            _check_int("seed", self.seed)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise TypeError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        self.stop = list(self.stop or [])
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        for i, s in enumerate(self.stop):
            check_text(f"stop[{i}]", s)
        self.stop_token_ids = _int_list("stop_token_ids", self.stop_token_ids)
        self.bad_token_ids = _int_list("bad_token_ids", self.bad_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _int_list("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty when given")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) and w for w in self.bad_words):
                raise TypeError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
            self.bad_words = list(self.bad_words)
            for i, w in enumerate(self.bad_words):
                check_text(f"bad_words[{i}]", w)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError("logit_bias must be a dict {token_id: bias}")
            bias = {}
            for k, v in self.logit_bias.items():
                try:  # JSON gives string keys ("50256"); anything but an integral value is an error
                    tok = int(k)
                    if isinstance(k, bool) or (isinstance(k, float) and k != tok):
                        raise ValueError
                except (TypeError, ValueError):
                    raise TypeError(f"logit_bias keys must be token ids, got {k!r}") from None
                _check_float(f"logit_bias[{tok}]", v, low=-100.0, high=100.0)
                bias[tok] = float(v)
            self.logit_bias = bias
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if isinstance(value, bool):  # TensorRT-LLM's examples pass prompt_logprobs=True
                value = 1 if value else None
                setattr(self, name, value)
            if value is not None:
                _check_int(name, value, low=0, high=20)
        for name in ("end_id", "pad_id"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low=0, high=_MAX_ID)
        if self.guided_decoding is not None:
            if isinstance(self.guided_decoding, dict):  # e.g. {"json": {...}} from a config file
                self.guided_decoding = GuidedDecodingParams(**self.guided_decoding)
            if not isinstance(self.guided_decoding, GuidedDecodingParams):
                raise TypeError(f"guided_decoding must be a GuidedDecodingParams, got "
                                f"{type(self.guided_decoding).__name__}")
            if self.use_beam_search:
                raise ValueError("guided_decoding cannot be combined with use_beam_search")
        if self.allowed_token_ids is not None and set(self.allowed_token_ids) <= set(self.bad_token_ids):
            raise ValueError("allowed_token_ids and bad_token_ids leave no token that can be generated")

    @property
    def greedy(self) -> bool:
        """True when decoding picks the arg-max token: ``temperature`` below `SAMPLING_EPS` (1e-5).

        vLLM's rule: dividing float32 logits by a tinier temperature overflows to +-inf (garbage
        draws below about 1e-38), while the distribution is already a point mass well before that.
        """
        return self.temperature < SAMPLING_EPS

    @property
    def num_candidates(self) -> int:
        """Sequences generated for the request: ``best_of`` if given, else ``n``."""
        return self.best_of or self.n

    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls) if not f.name.startswith("_")}


GUIDED_KINDS = ("json", "regex", "grammar", "json_object", "choice", "structural_tag")


@dataclass
class GuidedDecodingParams:
    """One structured-output constraint (TensorRT-LLM's `GuidedDecodingParams`; ``choice`` is vLLM's).

    Exactly one field is set:

    - ``json``: a JSON schema (a dict, its JSON text, or a pydantic model class); the output is one
      JSON document that validates against it (xgrammar's strict mode: no properties beyond those
      declared unless the schema allows them; compact separators, no free whitespace).
    - ``json_object=True``: any JSON object.
    - ``regex``: the output matches the regular expression as a whole.
    - ``grammar``: an EBNF grammar in the GBNF dialect (llama.cpp's, as xgrammar reads it), rule ``root``.
    - ``choice``: the output is exactly one of these strings.
    - ``structural_tag``: free text in which tool-call regions are constrained: a dict or JSON
      string, either xgrammar's format or ``{"structures": [{"begin": "<tool_call>", "schema":
      {...}, "end": "</tool_call>"}], "triggers": ["<tool_call>"]}``.

    ``start_after`` (a kvpilot extension, not a constraint): generation is free until the output
    text contains this string (a reasoning model's ``"</think>"``), and the constraint applies from
    the next token on; the server sets it with ``--reasoning-parser``.

    Raises:
        ValueError: none or more than one field set, or an empty value.
        TypeError: a value of the wrong type.
    A constraint that does not compile is refused when the request is queued
    (`kvpilot.sampling.guided.GuidedDecodingError`, a ValueError).
    """

    json: Optional[Union[str, dict[str, Any], type]] = None
    regex: Optional[str] = None
    grammar: Optional[str] = None
    json_object: bool = False
    choice: Optional[list[str]] = None
    structural_tag: Optional[Union[str, dict[str, Any]]] = None
    start_after: Optional[str] = None

    def __post_init__(self) -> None:
        if self.start_after is not None and (not isinstance(self.start_after, str) or not self.start_after):
            raise TypeError(f"start_after must be a non-empty string, got {self.start_after!r}")
        if isinstance(self.json, type):  # a pydantic model class
            schema = getattr(self.json, "model_json_schema", None)
            if schema is None:
                raise TypeError(f"json must be a JSON schema (dict or str) or a pydantic model class, "
                                f"got the class {self.json.__name__}")
            self.json = schema()
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise TypeError(f"json must be a JSON schema (dict or str), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a string, got {type(value).__name__}")
        if not isinstance(self.json_object, bool):
            raise TypeError(f"json_object must be a bool, got {type(self.json_object).__name__}")
        if self.choice is not None:
            if (isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, (list, tuple))
                    or not all(isinstance(c, str) for c in self.choice)):
                raise TypeError(f"choice must be a list of strings, got {self.choice!r}")
            self.choice = list(self.choice)
            if not self.choice or not all(self.choice):
                raise ValueError("choice must hold at least one non-empty string")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            raise TypeError(f"structural_tag must be a dict or a JSON string, got {type(self.structural_tag).__name__}")
        set_ = [k for k in GUIDED_KINDS if (getattr(self, k) if k != "json_object" else self.json_object)
                not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"guided_decoding takes exactly one of {', '.join(GUIDED_KINDS)}; got "
                             f"{', '.join(set_) if set_ else 'none'}")
        for k in ("json", "regex", "grammar", "structural_tag"):
            if getattr(self, k) == "":
                raise ValueError(f"guided_decoding {k} must not be empty")

    @property
    def kind(self) -> str:
        """The field that is set: one of `GUIDED_KINDS`."""
        return next(k for k in GUIDED_KINDS if (getattr(self, k) if k != "json_object" else self.json_object)
                    not in (None, False))


SAMPLING_EPS = 1e-5
"""Temperatures below this decode greedily (vLLM's ``_SAMPLING_EPS``)."""

_MAX_ID = 2**31 - 1
"""Upper bound of token-id-like integer fields (top_k, end_id, pad_id): the sampler holds them in
int32/int64 device tensors, and no vocabulary comes near it."""


def _check_int(name: str, value, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be in [{low if low is not None else '-inf'}, "
                         f"{high if high is not None else 'inf'}], got {value}")


def _check_float(name: str, value, low: float | None = None, high: float | None = None,
                 low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high):
        left = "(" if low_open else "["
        raise ValueError(f"{name} must be in {left}{low if low is not None else '-inf'}, "
                         f"{high if high is not None else 'inf'}], got {value}")


def _int_list(name: str, value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a list of token ids, got {value!r}")
    out = list(value)
    for v in out:
        _check_int(f"{name} entry", v, low=0)
    return out
