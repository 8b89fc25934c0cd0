"""OpenAI request bodies -> `kvpilot.SamplingParams`, with errors that name the client's field.

Defaults follow OpenAI's API (``temperature`` 1, ``top_p`` 1, penalties 0, completions
``max_tokens`` 16, chat ``max_completion_tokens`` = what is left of the context) and vLLM's for its
extras (``top_k`` off, ``min_p`` 0, ``repetition_penalty`` 1), except where the checkpoint's
``generation_config.json`` recommends values (``defaults``: `kvpilot.model.config.GenerationDefaults`),
which apply to the fields a request leaves unset (vLLM's ``--generation-config auto``). Range checks are SamplingParams' own;
its ValueError/TypeError messages start with the field name, which becomes the error's ``param``
(translated back to the name the client used, e.g. ``max_completion_tokens``).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, Optional

from kvpilot.sampling_params import GUIDED_KINDS, GuidedDecodingParams, SamplingParams
from kvpilot.server.errors import APIError
from kvpilot.server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields

_FIELD_RE = re.compile(r"^([a-z_]+)")


_INT64 = (-(1 << 63), (1 << 63) - 1)


def _common(req: _SamplingFields, defaults: Optional[dict] = None) -> dict:
    # The sampler keeps seeds in an int64 tensor; a bigger one would fail inside the engine loop.
    if req.seed is not None and not _INT64[0] <= req.seed <= _INT64[1]:
        raise APIError(f"seed must be in [{_INT64[0]}, {_INT64[1]}], got {req.seed}", param="seed")
    bias = None
    if req.logit_bias:
        bias = {}
        for key, value in req.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise APIError(f"logit_bias keys must be token ids (integers as strings), got {key!r}",
                               param="logit_bias") from None
    d = defaults or {}

    def pick(name: str, default):
        value = getattr(req, name)
        return d.get(name, default) if value is None else value

    return dict(
        n=1 if req.n is None else req.n,
        best_of=req.best_of,
        temperature=pick("temperature", 1.0),
        top_p=pick("top_p", 1.0),
        top_k=pick("top_k", 0),
        min_p=pick("min_p", 0.0),
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        repetition_penalty=pick("repetition_penalty", 1.0),
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        logit_bias=bias,
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        guided_decoding=guided_params(req)[0],
    )


_GUIDED_FIELDS = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                  ("guided_grammar", "grammar"))


def guided_params(req: _SamplingFields) -> tuple[Optional[GuidedDecodingParams], Optional[str]]:
    """The request's structured-output constraint and the field it came from (for error ``param``s).

    Sources (at most one per request): OpenAI's ``response_format`` (``{"type": "text"}``: none;
    ``{"type": "json_object"}``; ``{"type": "json_schema", "json_schema": {"name", "schema",
    "strict"}}``: the schema, always enforced strictly), vLLM's ``structured_outputs`` (a dict with
    one of json, regex, choice, grammar, json_object, structural_tag) and its older ``guided_json``,
    ``guided_regex``, ``guided_choice``, ``guided_grammar``.

    Raises:
        APIError: 400 naming the field: several sources, an unknown ``response_format`` type, a
            ``json_schema`` without a ``schema`` object, or a malformed value.
    """
    found: list[tuple[str, dict]] = []
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema") if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise APIError("response_format json_schema needs json_schema.schema, a JSON schema object",
                               param="response_format")
            found.append(("response_format", {"json": schema}))
        elif kind != "text":
            raise APIError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                           param="response_format")
    for name, key in _GUIDED_FIELDS:
        value = getattr(req, name)
        if value is not None:
            found.append((name, {key: value}))
    so = req.structured_outputs
    if so is not None:
        fields = {k: v for k, v in so.items() if v not in (None, False)}
        unknown = sorted(set(fields) - set(GUIDED_KINDS))
        if unknown:
            raise APIError(f"structured_outputs takes {', '.join(GUIDED_KINDS)}; unknown: {', '.join(unknown)}",
                           param="structured_outputs")
        found.append(("structured_outputs", fields))
    if not found:
        return None, None
    if len(found) > 1:
        raise APIError(f"give one structured-output constraint; got {', '.join(n for n, _ in found)}",
                       param=found[1][0])
    name, fields = found[0]
    try:
        return GuidedDecodingParams(**fields), name
    except (ValueError, TypeError) as exc:
        raise APIError(f"{name}: {exc}", param=name) from None


def _build(kwargs: dict, renames: dict[str, str]) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        m = _FIELD_RE.match(message)
        field = m.group(1) if m and m.group(1) in SamplingParams.field_names() else None
        param = renames.get(field, field) if field else None
        if field and param != field:
            message = param + message[len(field):]
        raise APIError(message, param=param) from None


def completion_params(req: CompletionRequest, max_tokens: int, defaults: Optional[dict] = None) -> SamplingParams:
    """SamplingParams of a completions request; ``max_tokens`` is already resolved (>= 1 expected);
    ``defaults``: the model's generation defaults for unset fields (module docstring).

    Raises:
        APIError: 400 naming the field (``suffix`` is not supported; any out-of-range value).
    """
    if req.suffix:
        raise APIError("suffix is not supported", param="suffix")
    kw = _common(req, defaults)
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_logprobs = req.logprobs if prompt_logprobs is None else max(prompt_logprobs, req.logprobs)
    kw.update(max_tokens=max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs)
    return _build(kw, {})


def chat_params(req: ChatCompletionRequest, max_tokens: int, defaults: Optional[dict] = None) -> SamplingParams:
    """SamplingParams of a chat request; ``logprobs=true`` asks for ``top_logprobs`` alternatives;
    ``defaults`` as for `completion_params`.

    Raises:
        APIError: 400 naming the field (``top_logprobs`` without ``logprobs``; any out-of-range value).
    """
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
    kw = _common(req, defaults)
    kw.update(max_tokens=max_tokens, logprobs=(req.top_logprobs or 0) if req.logprobs else None)
    renames = {"logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None or req.max_tokens is None:
        renames["max_tokens"] = "max_completion_tokens"
    return _build(kw, renames)


async def compile_guided(llm: Any, params: SamplingParams, param: Optional[str]) -> None:
    """Compile ``params.guided_decoding`` (if any) in a worker thread, so that a constraint that does
    not compile is a 400 naming ``param`` before anything is queued (the engine's compile of the same
    text is then a cache hit).

    Raises:
        APIError: 400 with xgrammar's reason, or when the server runs without guided decoding.
    """
    if params.guided_decoding is None:
        return
    try:
        backend = llm.guided_backend()
        await asyncio.to_thread(backend.compile, params.guided_decoding)
    except ValueError as exc:
        raise APIError(str(exc), param=param) from None


def generation_defaults(llm) -> dict:
    """The engine's generation defaults (`kvpilot.LLM.generation_defaults`), or none."""
    gd = getattr(llm, "generation_defaults", None)
    return dict(gd.values) if gd is not None else {}


def chat_max_tokens(req: ChatCompletionRequest) -> Optional[int]:
    """The requested output length of a chat request (``max_completion_tokens`` wins), or None."""
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def check_context(num_prompt_tokens: int, max_tokens: Optional[int], max_seq_len: int,
                  max_tokens_param: str) -> int:
    """Resolve the output length against the context limit, as OpenAI/vLLM phrase it.

    Args:
        num_prompt_tokens: prompt length in tokens (BOS included).
        max_tokens: requested output tokens, or None for "what is left of the context".
        max_seq_len: the model's context limit (prompt + generated tokens).
        max_tokens_param: the field name to report (``max_tokens`` or ``max_completion_tokens``).

    Returns:
        the output length to ask the engine for (>= 1).

    Raises:
        APIError: 400 when the prompt alone fills the context (``param`` "prompt"/"messages" is the
            caller's to set via the message) or prompt + max_tokens exceeds it.
    """
    if max_tokens is not None and (isinstance(max_tokens, bool) or max_tokens < 1):
        raise APIError(f"{max_tokens_param} must be at least 1, got {max_tokens}", param=max_tokens_param)
    if num_prompt_tokens >= max_seq_len:
        raise APIError(f"This model's maximum context length is {max_seq_len} tokens. However, your prompt "
                       f"has {num_prompt_tokens} tokens, which leaves no room for output. Please shorten "
                       f"the prompt.", param="prompt", code="context_length_exceeded")
    if max_tokens is None:
        return max_seq_len - num_prompt_tokens
    if num_prompt_tokens + max_tokens > max_seq_len:
        raise APIError(f"This model's maximum context length is {max_seq_len} tokens. However, you requested "
                       f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                       f"{max_tokens} for the completion). Please reduce the prompt or {max_tokens_param}.",
                       param=max_tokens_param, code="context_length_exceeded")
    return max_tokens
