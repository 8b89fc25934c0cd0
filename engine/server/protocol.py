"""The OpenAI HTTP protocol as pydantic models: every request and response body the server speaks.

Shapes follow OpenAI's API reference for ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/models`` (field names, ``object`` values, streaming chunks). Requests also accept vLLM's extra
sampling fields (``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``repetition_penalty``, ...) in the body, so that client code written
for vLLM (``extra_body={...}``) works unchanged. Unknown fields are ignored, as vLLM does.

Scalar fields are strict (``"5"`` is not an integer, ``1`` is not a boolean): a client that sends the
wrong type gets a 400 naming the field rather than a silent coercion. Range checks live in
`kvpilot.SamplingParams`, the single source of truth for what a value may be.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr,
                      ValidationInfo, field_validator, model_serializer,
                      model_validator)

StrictFloat = Annotated[float, Strict()]  # accepts JSON ints too, never strings

# ------------------------------------------------------------------------------------------------
# Errors


class ErrorInfo(BaseModel):
    """OpenAI's error object: ``message`` says what was wrong; ``param`` names the offending field."""

    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    """OpenAI's error body ``{"error": {...}}``."""

    error: ErrorInfo


# ------------------------------------------------------------------------------------------------
# Shared request parts


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> list[str]:
        """Body fields no model declares (ignored, as vLLM does; the server logs them)."""
        return sorted((self.model_extra or {}).keys())


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with empty choices and the usage."""

    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


def _check_stop(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise ValueError("stop must be a string or a list of strings")


class _SamplingFields(_Request):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras."""

    model: Optional[StrictStr] = None
    frequency_penalty: Optional[StrictFloat] = 0.0
    presence_penalty: Optional[StrictFloat] = 0.0
    logit_bias: Optional[dict[str, StrictFloat]] = None
    n: Optional[StrictInt] = 1
    seed: Optional[StrictInt] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[StrictFloat] = None
    top_p: Optional[StrictFloat] = None
    user: Optional[StrictStr] = None
    # vLLM's extra sampling parameters.
    best_of: Optional[StrictInt] = None
    top_k: Optional[StrictInt] = None
    min_p: Optional[StrictFloat] = None
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stop_token_ids: Optional[list[StrictInt]] = None
    include_stop_str_in_output: StrictBool = False
    repetition_penalty: Optional[StrictFloat] = None
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    allowed_token_ids: Optional[list[StrictInt]] = None
    bad_words: Optional[list[StrictStr]] = None
    # Structured output: OpenAI's response_format, vLLM's guided_* fields and structured_outputs
    # (`kvpilot.server.sampling.guided_params` turns them into one GuidedDecodingParams).
    response_format: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[StrictStr, dict[str, Any]]] = None
    guided_regex: Optional[StrictStr] = None
    guided_choice: Optional[list[StrictStr]] = None
    guided_grammar: Optional[StrictStr] = None
    structured_outputs: Optional[dict[str, Any]] = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        return _check_stop(v)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


# ------------------------------------------------------------------------------------------------
# /v1/completions

PromptType = Union[str, list[str], list[int], list[list[int]]]


def _check_prompt(value: Any) -> Any:
    msg = "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(msg if not isinstance(value, list) else "prompt must not be an empty list")
    if all(isinstance(p, str) for p in value):
        return value
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
           for p in value):
        return value
    raise ValueError(msg)


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions``.

    ``prompt`` may be one string, a list of strings, one list of token ids, or a list of them; each
    prompt becomes one engine request with ``n`` choices (choice index = prompt index * n + i).
    ``logprobs`` is the number of top alternatives per token (0..20); with ``echo`` the prompt's
    tokens and their log-probabilities come first. ``max_tokens`` defaults to 16 as in OpenAI's API.
    """

    prompt: Any
    echo: StrictBool = False
    logprobs: Optional[StrictInt] = None
    max_tokens: Optional[StrictInt] = 16
    suffix: Optional[StrictStr] = None
    prompt_logprobs: Optional[StrictInt] = None
    add_special_tokens: StrictBool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        return _check_prompt(v)

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts as a list: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(t, int) for t in p):
            return [p]
        return list(p)


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions ``logprobs`` object, one entry per token of ``text``.

    ``text_offset`` is the character offset of each token in the choice's ``text``;
    ``top_logprobs`` maps decoded token strings to natural-log probabilities (None for the first
    prompt token, which has no prediction).
    """

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One choice; ``prompt_logprobs`` (vLLM's) is present when the request asked for it."""

    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_logprobs: Optional[list[Optional[dict[str, dict[str, Any]]]]] = None

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler):
        body = handler(self)
        if body.get("prompt_logprobs") is None:
            body.pop("prompt_logprobs", None)
        return body


class UsageInfo(BaseModel):
    """Token counts: the prompt is counted once per prompt, completions over all choices."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


def _now() -> int:
    return int(time.time())


def random_id(prefix: str) -> str:
    """A response id in OpenAI's style, e.g. ``cmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None


class CompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed completion (same ``object`` as the full response, as OpenAI sends)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


# ------------------------------------------------------------------------------------------------
# /v1/chat/completions


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: Optional[StrictStr] = None


class ChatMessage(BaseModel):
    """One message of ``messages``; ``content`` is a string or a list of ``{"type": "text"}`` parts."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[StrictStr, list[ContentPart]]] = None
    name: Optional[StrictStr] = None

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM's "string" format).

        Raises:
            ValueError: a content part that is not text.
        """
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content parts of type {part.type!r} are not supported; only text")
            texts.append(part.text)
        return "\n".join(texts)


class FunctionDefinition(BaseModel):
    """A tool's ``function``: its name, description and JSON-Schema ``parameters`` (OpenAI)."""

    model_config = ConfigDict(extra="allow")
    name: StrictStr
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None


class ChatTool(BaseModel):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}`` (OpenAI)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(_SamplingFields):
    """Body of ``POST /v1/chat/completions``.

    ``logprobs`` (bool) asks for the chosen tokens' log-probabilities, ``top_logprobs`` (0..20) for
    that many alternatives. ``max_completion_tokens`` (or the deprecated ``max_tokens``) defaults to
    what is left of the context after the prompt.

    The chat template (`kvpilot.server.chat_template.render_chat`) gets ``messages``, ``tools`` (the
    OpenAI tool list, as the template expects it), ``documents`` (retrieval passages, each a dict
    such as ``{"title": ..., "text": ...}``), ``add_generation_prompt``, ``continue_final_message``
    (the reply continues the last, assistant message instead of opening a new turn; not with
    ``add_generation_prompt``) and ``chat_template_kwargs`` (any other template variable, e.g.
    ``enable_thinking``), the variables of ``transformers``' ``apply_chat_template``; these and
    ``echo`` (the reply starts with the last message's content when that message is the
    assistant's) follow vLLM. ``tool_choice``: "none" (reply is text), "auto" (default with tools:
    parsed into ``tool_calls`` by ``--tool-call-parser``, text without one), "required" or
    ``{"type": "function", "function": {"name": ...}}`` (enforced by guided decoding);
    ``parallel_tool_calls: false`` keeps one call (docs/tool_calling.md). Structured output fields
    are `_SamplingFields`' (docs/structured_output.md).
    """

    messages: list[ChatMessage]
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = None
    max_tokens: Optional[StrictInt] = None
    max_completion_tokens: Optional[StrictInt] = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    echo: StrictBool = False
    documents: Optional[list[dict[str, Any]]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tool_choice: Optional[Union[StrictStr, dict[str, Any]]] = None
    tools: Optional[list[ChatTool]] = None
    parallel_tool_calls: Optional[StrictBool] = True

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages must contain at least one message")
        return v

    @field_validator("continue_final_message")
    @classmethod
    def _not_with_generation_prompt(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("add_generation_prompt", True):
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true; "
                             "set add_generation_prompt to false to continue the final message")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if v is None or v in ("none", "auto", "required"):
            return v
        if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict) \
                and isinstance(v["function"].get("name"), str):
            return v
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}}")

    def forced_tool(self) -> Optional[str]:
        """"required", the name of the forced function, or None (no call is forced)."""
        tc = self.tool_choice
        if tc == "required":
            return "required"
        if isinstance(tc, dict):
            return tc["function"]["name"]
        return None


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogprobEntry(ChatLogprob):
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: Optional[list[ChatLogprobEntry]] = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    """One entry of a message's ``tool_calls`` (OpenAI)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    """The reply: ``content``, ``tool_calls`` (present only when the model called tools) and
    ``reasoning_content`` (vLLM's; present only with ``--reasoning-parser``)."""

    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        body = handler(self)
        for k in ("reasoning_content", "tool_calls"):
            if body.get(k) is None:
                body.pop(k, None)
        return body


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None


class DeltaMessage(BaseModel):
    """A streamed delta; unset fields are left out (the first chunk carries ``role``)."""

    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    # OpenAI's incremental form: {"index", "id", "type", "function": {"name", "arguments": ""}} first,
    # then {"index", "function": {"arguments": piece}}.
    tool_calls: Optional[list[dict[str, Any]]] = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None


# ------------------------------------------------------------------------------------------------
# /v1/models


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "kvpilot"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body): the adapter's model name and its PEFT directory."""

    lora_name: StrictStr = Field(min_length=1)
    lora_path: StrictStr = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body): the adapter's model name."""

    lora_name: StrictStr = Field(min_length=1)
    lora_int_id: Optional[int] = None
