"""Tool-call and reasoning parsers on hand-written model outputs of each format, whole and streamed
split at every character: the streamed pieces add up to the whole result, nothing is taken back."""

from __future__ import annotations

import json

import pytest

from kvpilot.server.reasoning import ReasoningStream, split_reasoning
from kvpilot.server.tool_parsers import (ToolStream, extract_tool_calls, get_parser, named_parser, parse_json_array,
                                         required_schema)
from kvpilot.server.protocol import ChatTool

W = {"city": "Paris", "unit": "C"}
# (parser, model output, expected content, expected [(name, arguments dict)])
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
     "Let me check.\n", [("get_weather", W), ("get_time", {"zone": "UTC"})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": {"b": [1, {"c": "}"}]}}}</tool_call>', None,
     [("f", {"a": {"b": [1, {"c": "}"}]}})]),
    ("hermes", "Just text, with a < sign and <tool", "Just text, with a < sign and <tool", []),
    ("hermes", '<tool_call>not json</tool_call>', '<tool_call>not json</tool_call>', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}; '
                    '{"name": "get_time", "parameters": {"zone": "UTC"}}', None,
     [("get_weather", W), ("get_time", {"zone": "UTC"})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}', None, [("f", {})]),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, '
                '{"name": "get_time", "arguments": {"zone": "UTC"}}]', "Sure. ",
     [("get_weather", W), ("get_time", {"zone": "UTC"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "C"}[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}',
     None, [("get_weather", W), ("get_time", {"zone": "UTC"})]),
    ("mistral", "No tools needed [TOOL", "No tools needed [TOOL", []),
]


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parser_whole_and_streamed_at_every_split(name, text, content, calls):
    parser = get_parser(name)
    got_content, got = extract_tool_calls(parser, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    for step in (1, 2, 3, 7):  # pieces of 1 character (every boundary), and coarser ones
        stream = ToolStream(parser)
        text_out, deltas = "", []
        for i in range(0, len(text), step):
            c, d = stream.feed(text[i:i + step])
            text_out += c
            deltas += d
        c, d = stream.finish()
        text_out += c
        deltas += d
        assert text_out == (content or ""), step
        heads = [d for d in deltas if "id" in d]
        assert [(h["index"], h["function"]["name"], h["function"]["arguments"]) for h in heads] == \
            [(i, n, "") for i, (n, _) in enumerate(calls)]
        args = ["".join(d["function"].get("arguments", "") for d in deltas if d["index"] == i) for i in range(len(calls))]
        assert args == [c.arguments for c in got]  # the same strings as the whole reply's
        assert all(d["function"].get("arguments") != "" for d in deltas if "id" not in d)


@pytest.mark.parametrize("name,text", [("hermes", '<tool_call>{"name": "f", "arguments": {"a": {"b": 1}'),
                                       ("llama3_json", '{"name": "f", "parameters": {"a": {"b": 1}')])
def test_cut_off_call_is_content_whole_and_a_partial_call_streamed(name, text):
    """A reply cut off inside a call (finish_reason "length"): whole, it is plain content; streamed,
    the call's name and the arguments up to the cut were already sent (a stream takes nothing back)."""
    parser = get_parser(name)
    assert extract_tool_calls(parser, text) == (text, [])
    stream = ToolStream(parser)
    deltas = [d for ch in text for d in stream.feed(ch)[1]] + stream.finish()[1]
    assert deltas[0]["function"] == {"name": "f", "arguments": ""}
    assert "".join(d["function"].get("arguments", "") for d in deltas) == '{"a": {"b": 1'


def test_parallel_false_keeps_first_call_and_required_array():
    text = CASES[0][1]
    assert [c.name for c in extract_tool_calls(get_parser("hermes"), text, max_calls=1)[1]] == ["get_weather"]
    arr = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    assert [(c.name, c.arguments) for c in extract_tool_calls(parse_json_array, arr)[1]] == \
        [("f", '{"a": 1}'), ("g", "{}")]
    assert extract_tool_calls(named_parser("f"), '{"a": 1}')[1][0].arguments == '{"a": 1}'
    tools = [ChatTool(function={"name": "f", "parameters": {"type": "object"}}), ChatTool(function={"name": "g"})]
    schema = required_schema(tools, parallel=False)
    assert schema["maxItems"] == 1 and [i["properties"]["name"]["const"] for i in schema["items"]["anyOf"]] == ["f", "g"]
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_parser("pythonic")


R_CASES = [
    ("deepseek_r1", "<think>First, 2+2.</think>\n\nIt is 4.", "First, 2+2.", "It is 4."),
    ("deepseek_r1", "Thinking without a start tag</think>Answer", "Thinking without a start tag", "Answer"),
    ("deepseek_r1", "Cut off while thinking <", "Cut off while thinking <", ""),
    ("qwen3", "<think>\nhmm\n</think>\n\nHello", "\nhmm\n", "Hello"),
    ("qwen3", "Hello </think> world", None, "Hello </think> world"),
    ("qwen3", "<thin", None, "<thin"),
]


@pytest.mark.parametrize("style,text,reasoning,content", R_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(R_CASES)])
def test_reasoning_split_whole_and_streamed_at_every_split(style, text, reasoning, content):
    assert split_reasoning(style, text) == (reasoning, content)
    s = ReasoningStream(style)
    r_out = c_out = ""
    for ch in text:
        r, c = s.feed(ch)
        r_out += r
        c_out += c
    r, c = s.finish()
    assert (r_out + r, c_out + c) == (reasoning or "", content)
