"""Reasoning parsers: a reply's ``<think>...</think>`` part -> ``reasoning_content``, the rest -> ``content``.

``--reasoning-parser`` picks one (vLLM's names):

- ``deepseek_r1``: the reasoning runs from the start of the reply (an opening ``<think>`` is
  optional: DeepSeek-R1's template puts it in the prompt) to ``</think>``; a reply without
  ``</think>`` is all reasoning (it was cut off while thinking).
- ``qwen3``: the reply reasons only when it starts with ``<think>``; then up to ``</think>`` is
  reasoning. A reply without ``<think>`` (``enable_thinking: false`` in ``chat_template_kwargs``
  makes the template close the thinking block in the prompt) is all content.

`split_reasoning` splits a whole reply; `ReasoningStream` splits a streamed one, sending nothing
that may still turn out to be part of a tag.
"""

from __future__ import annotations

from typing import Optional

REASONING_PARSERS = ("deepseek_r1", "qwen3")
_START, _END = "<think>", "</think>"


def _held(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _parse(style: str, text: str, final: bool) -> tuple[str, str, bool]:
    """(stable reasoning, stable content, reasoning ended) of the reply so far."""
    body = text
    stripped = body.lstrip()
    if stripped.startswith(_START):
        body = stripped[len(_START):]
    elif not final and _START.startswith(stripped):  # maybe the start of "<think>"
        return "", "", False
    elif style == "qwen3":
        return "", text, True
    j = body.find(_END)
    if j < 0:
        return (body if final else body[:len(body) - _held(body, _END)]), "", False
    return body[:j], body[j + len(_END):].lstrip("\n"), True


def check_parser(name: str) -> str:
    """``name`` if it is a known reasoning parser.

    Raises:
        ValueError: an unknown name (the message lists `REASONING_PARSERS`).
    """
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; expected one of {', '.join(REASONING_PARSERS)}")
    return name


def split_reasoning(style: str, text: str) -> tuple[Optional[str], str]:
    """(reasoning_content or None, content) of a whole reply."""
    reasoning, content, _ = _parse(check_parser(style), text, True)
    return (reasoning or None), content


class ReasoningStream:
    """Splits a streamed reply: `feed` returns (reasoning piece, content piece) for each new piece
    of text; `finish` returns what was held back. ``ended`` turns True once the reasoning is over
    (content follows)."""

    def __init__(self, style: str) -> None:
        self.style = check_parser(style)
        self.text = ""
        self._r = 0
        self._c = 0
        self.ended = False

    def feed(self, piece: str) -> tuple[str, str]:
        self.text += piece
        return self._diff(False)

    def finish(self) -> tuple[str, str]:
        return self._diff(True)

    def _diff(self, final: bool) -> tuple[str, str]:
        reasoning, content, ended = _parse(self.style, self.text, final)
        self.ended = self.ended or ended
        r = reasoning[self._r:] if len(reasoning) > self._r else ""
        c = content[self._c:] if len(content) > self._c else ""
        self._r = max(self._r, len(reasoning))
        self._c = max(self._c, len(content))
        return r, c
