"""Chat messages -> prompt token ids, through the model's chat template (or ``--chat-template``).

The template comes from the tokenizer (``tokenizer_config.json``'s ``chat_template``, read by
``transformers``) unless the server was started with ``--chat-template``, which wins. It is rendered
with ``tokenizer.apply_chat_template(..., tokenize=False)`` and the text is then tokenized. Most
templates write the BOS token themselves; to avoid a doubled BOS, special tokens are added by the
tokenizer only when the rendered text does not already start with the BOS string (a template that
renders only the message contents thus gets the BOS the model expects).

The template sees the variables ``transformers`` gives it: ``messages``, ``tools``, ``documents``,
``add_generation_prompt``, the tokenizer's special tokens, and every ``chat_template_kwargs`` entry
(``enable_thinking`` and the like); ``continue_final_message`` leaves the last (assistant) message
open for the reply to continue, as ``transformers`` does. The request's messages go to the template
as they are (no default system prompt is added; a template that adds one when the request has none
does so once). Assistant ``tool_calls`` whose ``function.arguments`` are JSON strings (OpenAI's wire
format) reach the template as objects, the form tool-use templates index into (as vLLM does).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

from kvpilot.server.errors import APIError
from kvpilot.server.protocol import ChatMessage, ChatTool

# apply_chat_template's own arguments, and the names it renders the template with: a
# chat_template_kwargs entry may not replace them (the request has a field for each that is meant
# to be set).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "chat_template", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})

logger = logging.getLogger(__name__)


# Templates shipped in the package (package-data): ``--chat-template NAME`` selects ``NAME.jinja``.
TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"


def bundled_templates() -> list[str]:
    """Names of the chat templates shipped with kvpilot (``plain``: the messages' contents in order)."""
    return sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja"))


def load_chat_template(value: Optional[str]) -> Optional[str]:
    """The ``--chat-template`` argument as template text: a file's contents, the string itself if
    it is inline Jinja (contains ``{{`` or ``{%``), or a bundled template's name (`bundled_templates`).

    Raises:
        FileNotFoundError: ``value`` is none of these.
    """
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    bundled = TEMPLATES_DIR / f"{value}.jinja"
    if "/" not in value and bundled.is_file():
        return bundled.read_text(encoding="utf-8")
    raise FileNotFoundError(f"--chat-template {value!r}: no such file, not an inline Jinja template, and not "
                            f"a bundled template ({', '.join(bundled_templates())})")


def conversation_of(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The request's messages as the template's ``messages``: ``role``, ``content`` (text parts
    joined), ``name`` when given, and any other field as sent (``tool_calls``, ``tool_call_id``,
    ``reasoning_content``...), tool-call arguments that are JSON strings decoded to objects.

    Raises:
        APIError: 400 naming the message whose content is not text.
    """
    conversation = []
    for i, msg in enumerate(messages):
        try:
            entry: dict[str, Any] = {"role": msg.role, "content": msg.text()}
        except ValueError as exc:
            raise APIError(str(exc), param=f"messages[{i}].content") from None
        if msg.name is not None:
            entry["name"] = msg.name
        for key, value in (msg.model_extra or {}).items():
            entry[key] = _decoded_tool_calls(value) if key == "tool_calls" else value
        conversation.append(entry)
    return conversation


def _decoded_tool_calls(calls: Any) -> Any:
    if not isinstance(calls, list):
        return calls
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                call = {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
            except json.JSONDecodeError:
                pass  # not JSON: the template gets the string as sent
        out.append(call)
    return out


def render_chat(tokenizer: Any, messages: list[ChatMessage], template: Optional[str],
                add_generation_prompt: bool = True,
                template_kwargs: Optional[dict[str, Any]] = None, *,
                tools: Optional[list[ChatTool]] = None,
                documents: Optional[list[dict[str, Any]]] = None,
                continue_final_message: bool = False) -> list[int]:
    """Render ``messages`` with the chat template and tokenize the result.

    Args:
        tokenizer: a transformers tokenizer (the engine's ``llm.tokenizer``).
        messages: the request's messages (`conversation_of`).
        template: the ``--chat-template`` text, or None to use the tokenizer's own (a tokenizer with
            several named templates picks ``tool_use`` when there are tools, as transformers does).
        add_generation_prompt: append the assistant-turn header (templates that support it).
        template_kwargs: extra variables for the template (vLLM's ``chat_template_kwargs``, e.g.
            ``{"enable_thinking": False}``); none of `RESERVED_TEMPLATE_KWARGS`.
        tools: the request's tools, given to the template as OpenAI tool dicts.
        documents: retrieval documents for templates that take them (RAG).
        continue_final_message: end the prompt inside the final message (assistant prefill), as
            ``transformers.apply_chat_template(continue_final_message=True)``; not together with
            ``add_generation_prompt``.

    Returns:
        the prompt's token ids.

    Raises:
        APIError: 400 when the model has no chat template (saying how to pass one), when a
            message's content is not text, when ``chat_template_kwargs`` sets a reserved name, when
            ``continue_final_message`` and ``add_generation_prompt`` are both true, or when the
            template rejects the conversation.
    """
    if tokenizer is None:
        raise APIError("this server was started without a tokenizer; chat completions need one",
                       param="messages")
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError("this model has no chat template (tokenizer_config.json has no chat_template); "
                       "start the server with --chat-template FILE (a Jinja template) to use "
                       "/v1/chat/completions, or use /v1/completions", param="messages",
                       code="chat_template_missing")
    if continue_final_message and add_generation_prompt:
        raise APIError("continue_final_message and add_generation_prompt cannot both be true",
                       param="continue_final_message")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(template_kwargs or {}))
    if reserved:
        raise APIError(f"chat_template_kwargs may not set {reserved}: use the request's own fields",
                       param="chat_template_kwargs")
    conversation = conversation_of(messages)
    extra: dict[str, Any] = {}
    if continue_final_message:  # only when asked: a tokenizer without the argument still works
        extra["continue_final_message"] = True
    try:
        text = tokenizer.apply_chat_template(
            conversation, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
            tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None,
            documents=documents or None, **extra, **(template_kwargs or {}))
    except Exception as exc:  # jinja2 errors, raise_exception() inside templates
        raise APIError(f"the chat template could not render these messages: {exc}", param="messages") from None
    bos = getattr(tokenizer, "bos_token", None)
    add_special = not (bos and text.startswith(bos))
    return list(tokenizer.encode(text, add_special_tokens=add_special))
