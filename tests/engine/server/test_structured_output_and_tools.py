"""Structured output, tool calls and reasoning through the OpenAI routes, in process (FastAPI's
TestClient as the official openai client's transport) on stories260K.

The model never writes tool calls or ``<think>`` by itself, so the "auto" and reasoning cases make it
write them with a ``structured_outputs`` regex: the reply is real model output, parsed as the
server parses any reply."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from kvpilot import KvCacheConfig, LLM
from kvpilot.server.app import attach_engine, create_app
from kvpilot.server.state import ServerState

MODEL = "stories"
TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
MSG = [{"role": "user", "content": "Once upon a time"}]
HERMES_RE = (r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", "unit": "C"\}\}</tool_call>'
             r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}</tool_call>')


@pytest.fixture(scope="module")
def llm(stories_model_dir):
    with LLM(str(stories_model_dir), device="cpu", max_num_tokens=256,
             kv_cache_config=KvCacheConfig(tokens_per_block=16)) as llm:
        yield llm


def _client(llm, **state_fields):
    state = ServerState(served_model_name=MODEL, model_path="stories", chat_template=TEMPLATE, **state_fields)
    attach_engine(state, llm)
    http = TestClient(create_app(state))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def client(llm):
    return _client(llm, tool_call_parser="hermes")


@pytest.fixture(scope="module")
def reasoning_client(llm):
    return _client(llm, reasoning_parser="qwen3", tool_call_parser="hermes")


def test_response_format_json_schema_and_json_object(client):
    schema = WEATHER["function"]["parameters"]
    for seed in range(2):
        r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=60, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=24, seed=1,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
    r = client.completions.create(model=MODEL, prompt="Once", max_tokens=20, seed=2,
                                  extra_body={"guided_choice": ["red", "blue"]})
    assert r.choices[0].text in ("red", "blue")


def test_vllm_guided_fields_and_structured_outputs(client):
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=20, seed=0,
                                       extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert len(r.choices[0].message.content) == 6 and r.choices[0].message.content[3] == "-"
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=20, seed=0, n=3,
                                       extra_body={"structured_outputs": {"choice": ["up", "down"]}})
    assert {c.message.content for c in r.choices} <= {"up", "down"}
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=20, seed=0,
                                       extra_body={"guided_grammar": 'root ::= "x" [0-9] [0-9]'})
    assert r.choices[0].message.content[0] == "x" and r.choices[0].message.content[1:].isdigit()


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "does not compile"),
    ({"response_format": {"type": "yaml"}}, "response_format", "must be 'text'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"guided_regex": "(", "guided_choice": ["a"]}, "guided_choice", "one structured-output"),
    ({"guided_regex": "(ab"}, "guided_regex", "regex does not compile"),
    ({"structured_outputs": {"yaml": "x"}}, "structured_outputs", "unknown: yaml"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "cannot be combined"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
])
def test_bad_constraints_are_400_naming_the_field(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, extra_body=body)
    assert e.value.body["param"] == param, e.value.body
    assert words in e.value.body["message"]


def test_tool_choice_named_and_required_are_enforced(client):
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=40, seed=3, tools=[WEATHER, TIME],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    for seed in range(2):
        r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=100, seed=seed,
                                           tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
        (call,) = r.choices[0].message.tool_calls
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_auto_tool_calls_parsed_whole_and_streamed(client):
    kw = dict(model=MODEL, messages=MSG, max_tokens=300, seed=0, tools=[WEATHER, TIME],
              extra_body={"structured_outputs": {"regex": HERMES_RE}})
    r = client.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1].function.arguments) == {"zone": "UTC"}
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    args = {0: "", 1: ""}
    for d in deltas:
        args[d.index] += d.function.arguments or ""
    assert args == {0: calls[0].function.arguments, 1: calls[1].function.arguments}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_malformed_tool_output_is_plain_content(client):
    bad = r'<tool_call>\{"name": 5\}</tool_call>'
    for stream in (False, True):
        kw = dict(model=MODEL, messages=MSG, max_tokens=40, seed=0, tools=[WEATHER],
                  extra_body={"structured_outputs": {"regex": bad}})
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert not any(c.choices[0].delta.tool_calls for c in chunks)
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            r = client.chat.completions.create(**kw)
            text = r.choices[0].message.content
            assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
        assert text == '<tool_call>{"name": 5}</tool_call>'


def test_reasoning_content_split_whole_and_streamed(reasoning_client):
    # enable_thinking false: the grammar applies from the first token (else it would wait for
    # </think>), so the regex makes the model write a thinking block
    kw = dict(model=MODEL, messages=MSG, max_tokens=60, seed=0,
              extra_body={"structured_outputs": {"regex": r"<think>[a-z]{3,8} [a-z]{3,8}</think>\n\n[A-Z][a-z]{2,6}"},
                          "chat_template_kwargs": {"enable_thinking": False}})
    r = reasoning_client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert len(msg.reasoning_content.split(" ")) == 2 and "<think>" not in msg.reasoning_content
    assert msg.content[0].isupper() and "</think>" not in msg.content
    chunks = list(reasoning_client.chat.completions.create(stream=True, **kw))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (reasoning, content) == (msg.reasoning_content, msg.content)


def test_constraint_waits_for_the_end_of_reasoning():
    from types import SimpleNamespace

    from kvpilot import SamplingParams
    from kvpilot.server.protocol import ChatCompletionRequest
    from kvpilot.server.serving_chat import ReplyPlan

    body = {"messages": MSG, "tools": [WEATHER], "tool_choice": "required"}
    for parser, kwargs, waits in (("deepseek_r1", None, True), ("qwen3", None, True),
                                  ("qwen3", {"enable_thinking": False}, False), (None, None, False)):
        req = ChatCompletionRequest.model_validate({**body, "chat_template_kwargs": kwargs})
        state = SimpleNamespace(reasoning_parser=parser, tool_call_parser=None)
        params = ReplyPlan.of(state, req).adjust(SamplingParams(), req)
        assert params.guided_decoding.start_after == ("</think>" if waits else None)
