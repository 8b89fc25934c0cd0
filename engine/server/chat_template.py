"""Chat messages -> prompt token ids, through the model's chat template (or ``--chat-template``).

The template comes from the tokenizer (``tokenizer_config.json``'s ``chat_template``, read by
``transformers``) unless the server was started with ``--chat-template``, which wins. It is rendered
with ``tokenizer.apply_chat_template(..., tokenize=False)`` and the text is then tokenized. Most
templates write the BOS token themselves; to avoid a doubled BOS, special tokens are added by the
tokenizer only when the rendered text does not already start with the BOS string (a template that
renders only the message contents thus gets the BOS the model expects).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from kvpilot.server.errors import APIError
from kvpilot.server.protocol import ChatMessage

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


def render_chat(tokenizer: Any, messages: list[ChatMessage], template: Optional[str],
                add_generation_prompt: bool = True,
                template_kwargs: Optional[dict[str, Any]] = None) -> list[int]:
    """Render ``messages`` with the chat template and tokenize the result.

    Args:
        tokenizer: a transformers tokenizer (the engine's ``llm.tokenizer``).
        messages: the request's messages (content parts are joined into strings).
        template: the ``--chat-template`` text, or None to use the tokenizer's own.
        add_generation_prompt: append the assistant-turn header (templates that support it).
        template_kwargs: extra variables for the template (vLLM's ``chat_template_kwargs``).

    Returns:
        the prompt's token ids.

    Raises:
        APIError: 400 when the model has no chat template (saying how to pass one), when a
            message's content is not text, or when the template rejects the conversation.
    """
    if tokenizer is None:
        raise APIError("this server was started without a tokenizer; chat completions need one",
                       param="messages")
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError("this model has no chat template (tokenizer_config.json has no chat_template); "
                       "start the server with --chat-template FILE (a Jinja template) to use "
                       "/v1/chat/completions, or use /v1/completions", param="messages",
                       code="chat_template_missing")
    conversation = []
    for i, msg in enumerate(messages):
        try:
            conversation.append({"role": msg.role, "content": msg.text()})
        except ValueError as exc:
            raise APIError(str(exc), param=f"messages[{i}].content") from None
        if msg.name is not None:
            conversation[-1]["name"] = msg.name
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             **(template_kwargs or {}))
    except Exception as exc:  # jinja2 errors, raise_exception() inside templates
        raise APIError(f"the chat template could not render these messages: {exc}", param="messages") from None
    bos = getattr(tokenizer, "bos_token", None)
    add_special = not (bos and text.startswith(bos))
    return list(tokenizer.encode(text, add_special_tokens=add_special))
