"""Tool-call parsers: the model's text -> OpenAI ``tool_calls``, whole or as streamed deltas.

``--tool-call-parser`` picks one (vLLM's names):

- ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number of them; text before the first tag is the message's ``content``.
- ``llama3_json`` (Llama 3.1/3.2/3.3): the reply is one or more JSON objects ``{"name": ...,
  "parameters": {...}}`` separated by ``;``, optionally after ``<|python_tag|>``; a reply that does
  not start with ``{`` is plain content.
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list of ``{"name", "arguments"}`` objects, or by
  ``name[ARGS]{...}`` (newer Mistral tokenizers); text before it is content. ``[TOOL_CALLS]`` is a
  special token, so replies are decoded with special tokens kept when this parser is active.

Every parser is a pure function ``parse(text, final) -> Parsed`` of the whole text so far. While
streaming (``final=False``) it reports only what can no longer change: content without a
trailing piece that may still become a tag, and each call's name once complete and its arguments
up to the end minus trailing ``}`` and whitespace (which may close the enclosing object), so
`ToolStream` can send differences and never take anything back. ``arguments`` strings are the
model's own JSON text of the arguments, the same streamed and not. Output that does not parse (a
``<tool_call>`` whose body is not a JSON object with a string name and object arguments) makes the
whole reply plain content: malformed tool output never fails the request.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Optional

TOOL_PARSERS = ("hermes", "llama3_json", "mistral")

_WS = " \t\r\n"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_DECODER = json.JSONDecoder()


def tool_call_id() -> str:
    """An id in the style OpenAI gives tool calls (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallState:
    """One tool call as far as it is known: ``name`` None until complete; ``arguments`` the stable
    prefix of the arguments' JSON text (all of it once ``complete``)."""

    name: Optional[str] = None
    arguments: str = ""
    complete: bool = False


@dataclass
class Parsed:
    """What `parse` found: ``content`` (stable prefix, or all of it at the end) and the calls.
    ``valid`` is False when a tool region does not parse (then, at the end, all text is content)."""

    content: str = ""
    calls: list[CallState] = field(default_factory=list)
    valid: bool = True


def _held(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _call_from_obj(obj, raw: str, start: int, end: int) -> Optional[CallState]:
    """A complete call from a decoded object (``raw[start:end]`` its text), or None if it is not
    ``{"name": str, "arguments"|"parameters": object}``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    args = obj.get(key, {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    text = raw[start:end]
    m = _HEAD.match(text)
    if m is not None:  # the model's own text of the arguments, as streamed
        try:
            _, a_end = _DECODER.raw_decode(text, m.end())
            arguments = text[m.end():a_end]
            if json.loads(arguments) == args:
                return CallState(obj["name"], arguments, True)
        except ValueError:
            pass
    return CallState(obj["name"], json.dumps(args, ensure_ascii=False), True)


def _partial_call(text: str) -> CallState:
    """The stable part of an unfinished call's text."""
    m = _HEAD.match(text)
    if m is None:
        return CallState()
    try:
        name = json.loads(f'"{m.group(1)}"')
    except ValueError:
        return CallState()
    return CallState(name, text[m.end():].rstrip("}" + _WS))


def _object_sequence(region: str, final: bool, seps: str) -> tuple[list[CallState], bool]:
    """Calls written as JSON objects one after another (``seps`` between them)."""
    calls: list[CallState] = []
    pos = 0
    n = len(region)
    while True:
        while pos < n and (region[pos] in _WS or region[pos] in seps):
            pos += 1
        if pos >= n:
            return calls, True
        try:
            obj, end = _DECODER.raw_decode(region, pos)
        except ValueError:
            if final:
                return calls, False
            calls.append(_partial_call(region[pos:]))
            return calls, True
        call = _call_from_obj(obj, region, pos, end)
        if call is None:
            return calls, False
        calls.append(call)
        pos = end


def parse_hermes(text: str, final: bool) -> Parsed:
    start, end = "<tool_call>", "</tool_call>"
    i = text.find(start)
    if i < 0:
        return Parsed(text if final else text[:len(text) - _held(text, start)])
    out = Parsed(text[:i])
    pos = i
    while pos >= 0:
        body_start = pos + len(start)
        j = text.find(end, body_start)
        body = text[body_start:j] if j >= 0 else text[body_start:]
        if j < 0 and not final:
            body = body[:len(body) - _held(body, end)]
            out.calls.append(_partial_call(body))
            return out
        try:
            obj, stop = _DECODER.raw_decode(body.strip(_WS))
        except ValueError:
            obj, stop = None, 0
        stripped = body.strip(_WS)
        call = _call_from_obj(obj, stripped, 0, stop) if obj is not None and stripped[stop:].strip(_WS) == "" else None
        if call is None:
            out.valid = False
            return out
        out.calls.append(call)
        if j < 0:
            return out
        pos = text.find(start, j + len(end))
    return out


def parse_llama3_json(text: str, final: bool) -> Parsed:
    tag = "<|python_tag|>"
    body = text.lstrip(_WS)
    if body.startswith(tag):
        body = body[len(tag):].lstrip(_WS)
    elif not final and body and tag.startswith(body):
        return Parsed("")
    if not body:
        return Parsed(text if final else "")
    if not body.startswith("{"):
        return Parsed(text)
    calls, valid = _object_sequence(body, final, ";")
    return Parsed("", calls, valid)


def parse_mistral(text: str, final: bool) -> Parsed:
    tag = "[TOOL_CALLS]"
    i = text.find(tag)
    if i < 0:
        return Parsed(text if final else text[:len(text) - _held(text, tag)])
    out = Parsed(text[:i])
    region = text[i + len(tag):]
    if "[ARGS]" in region or (region.strip(_WS) and not region.lstrip(_WS).startswith("[")):
        # name[ARGS]{...} (several joined by [TOOL_CALLS])
        for part in region.split(tag):
            name, sep, args = part.partition("[ARGS]")
            if not sep:
                if final:
                    out.valid = False
                return out
            try:
                obj, stop = _DECODER.raw_decode(args.strip(_WS))
            except ValueError:
                if final:
                    out.valid = False
                else:
                    out.calls.append(CallState(name.strip(_WS), args.strip(_WS).rstrip("}" + _WS)))
                return out
            if not isinstance(obj, dict):
                out.valid = False
                return out
            out.calls.append(CallState(name.strip(_WS), args.strip(_WS)[:stop], True))
        return out
    body = region.lstrip(_WS)
    if not body:
        out.valid = not final
        return out
    inner = body[1:]
    close = inner.rstrip(_WS)
    if close.endswith("]"):
        inner = close[:-1]
    calls, valid = _object_sequence(inner, final, ",")
    out.calls, out.valid = calls, valid
    return out


def parse_json_array(text: str, final: bool) -> Parsed:
    """The reply of ``tool_choice: "required"``: a JSON list of ``{"name", "parameters"}`` objects
    (what `required_schema` constrains it to)."""
    body = text.lstrip(_WS)
    if not body.startswith("["):
        return Parsed(text if final else "", [], not final)
    inner = body[1:]
    close = inner.rstrip(_WS)
    if close.endswith("]"):
        inner = close[:-1]
    calls, valid = _object_sequence(inner, final, ",")
    return Parsed("", calls, valid)


def named_parser(name: str):
    """The parser of a reply forced to call ``name``: the whole reply is the arguments' JSON."""

    def parse(text: str, final: bool) -> Parsed:
        return Parsed("", [CallState(name, text, final)])

    return parse


def _parameters(tool) -> dict:
    params = tool.function.parameters
    return params if params else {"type": "object", "properties": {}}


def named_schema(tools: list, name: str) -> dict:
    """JSON schema of a reply forced to call ``name``: its parameters.

    Raises:
        ValueError: no tool has that name."""
    for t in tools:
        if t.function.name == name:
            return _parameters(t)
    raise ValueError(f"tool_choice names function {name!r}, which is not in tools "
                     f"({', '.join(t.function.name for t in tools)})")


def required_schema(tools: list, parallel: bool = True) -> dict:
    """JSON schema of a reply that must call one or more of ``tools``: a list (one item when not
    ``parallel``) of ``{"name": one tool's name, "parameters": its parameters}``."""
    items = [{"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)},
              "required": ["name", "parameters"]} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


_PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral}


def get_parser(name: str):
    """The parse function of ``--tool-call-parser NAME``.

    Raises:
        ValueError: an unknown name (the message lists `TOOL_PARSERS`).
    """
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; expected one of {', '.join(TOOL_PARSERS)}") from None


@dataclass
class ToolCallOut:
    """A finished tool call in OpenAI's shape (``function.arguments`` is a JSON string)."""

    id: str
    name: str
    arguments: str

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def extract_tool_calls(parser, text: str, max_calls: Optional[int] = None) -> tuple[Optional[str], list[ToolCallOut]]:
    """(content, tool calls) of a whole reply; malformed tool output -> (text, []).

    ``content`` is None when the reply held only tool calls (and whitespace); ``max_calls`` keeps
    the first calls only (``parallel_tool_calls: false`` keeps one)."""
    p = parser(text, True)
    if not p.valid or not p.calls:
        return text, []
    calls = [ToolCallOut(tool_call_id(), c.name, c.arguments) for c in p.calls if c.complete]
    if max_calls is not None:
        calls = calls[:max_calls]
    content = p.content if p.content.strip(_WS) else None
    return content, calls


class ToolStream:
    """Turns a growing reply into OpenAI streaming deltas: ``content`` pieces and ``tool_calls``
    entries (the first for a call carries ``index``, ``id``, ``type`` and ``function.name`` with
    ``arguments`` ""; later ones ``index`` and an ``arguments`` piece).

    `feed` takes each new piece of text and returns (content piece, tool-call delta list);
    `finish` returns what is left at the end. ``called`` is True once a call has been sent.
    """

    def __init__(self, parser, max_calls: Optional[int] = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self._content_sent = 0
        self._names_sent: list[str] = []  # ids of calls whose header went out
        self._args_sent: list[int] = []

    @property
    def called(self) -> bool:
        return bool(self._names_sent)

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        self.text += piece
        return self._diff(self.parser(self.text, False))

    def finish(self) -> tuple[str, list[dict]]:
        p = self.parser(self.text, True)
        if (not p.valid or not p.calls) and not self.called:
            rest = self.text[self._content_sent:]  # malformed: everything unsent is content
            self._content_sent = len(self.text)
            return rest, []
        return self._diff(p)

    def _diff(self, p: Parsed) -> tuple[str, list[dict]]:
        content = ""
        if len(p.content) > self._content_sent and not self.called:
            content = p.content[self._content_sent:]
            self._content_sent = len(p.content)
        deltas: list[dict] = []
        calls = p.calls if self.max_calls is None else p.calls[:self.max_calls]
        for i, c in enumerate(calls):
            if c.name is None:
                break
            if i == len(self._names_sent):
                cid = tool_call_id()
                self._names_sent.append(cid)
                self._args_sent.append(0)
                deltas.append({"index": i, "id": cid, "type": "function",
                               "function": {"name": c.name, "arguments": ""}})
            sent = self._args_sent[i]
            if len(c.arguments) > sent:
                deltas.append({"index": i, "function": {"arguments": c.arguments[sent:]}})
                self._args_sent[i] = len(c.arguments)
        return content, deltas
