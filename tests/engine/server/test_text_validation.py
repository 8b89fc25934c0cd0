"""Text that is not valid Unicode (a lone UTF-16 surrogate, legal in JSON as ``"\\ud800"``) is a 400
naming the field on every text field of /v1/completions and /v1/chat/completions, and a ValueError
naming the argument in the Python API; the server keeps serving."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from kvpilot import LLM, KvCacheConfig, SamplingParams
from kvpilot.server.app import create_app
from kvpilot.server.state import ServerState

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def llm(stories_model_dir):
    with LLM(str(stories_model_dir), max_num_tokens=256, kv_cache_config=KvCacheConfig(tokens_per_block=16)) as llm:
        yield llm


@pytest.fixture(scope="module")
def client(llm):
    state = ServerState(served_model_name="stories", model_path="stories", llm=llm, chat_template=CHAT_TEMPLATE)
    with TestClient(create_app(state), raise_server_exceptions=False) as c:
        yield c


def _post_raw(client, path: str, raw: str):
    # The body as the client sends it: JSON text with a lone \ud800 escape (valid JSON, invalid Unicode).
    return client.post(path, content=raw.encode("ascii"), headers={"Content-Type": "application/json"})


USER = '{"role": "user", "content": "hi"}'
CASES = [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt[1]"),
    ("/v1/completions", '{"prompt": "ok", "stop": "\\ud83d", "max_tokens": 2}', "stop"),
    ("/v1/completions", '{"prompt": "ok", "stop": ["x", "y\\ud800"], "max_tokens": 2}', "stop[1]"),
    ("/v1/completions", '{"prompt": "ok", "suffix": "\\ud800", "max_tokens": 2}', "suffix"),
    ("/v1/completions", '{"prompt": "ok", "bad_words": ["\\udc00"], "max_tokens": 2}', "bad_words[0]"),
    ("/v1/completions", '{"prompt": "ok", "user": "\\ud800", "max_tokens": 2}', "user"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [%s, {"role": "assistant", "content": "x\\udbff"}]}' % USER,
     "messages[1].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "name": "\\ud800", "content": "x"}]}',
     "messages[0].name"),
    ("/v1/chat/completions", '{"messages": [%s], "stop": ["\\ud800"]}' % USER, "stop[0]"),
    ("/v1/chat/completions", '{"messages": [%s], "tools": [{"type": "function", "function": '
     '{"name": "f", "description": "\\ud800"}}]}' % USER, "tools[0].function.description"),
    ("/v1/chat/completions", '{"messages": [%s, {"role": "assistant", "content": "", "tool_calls": [{"id": "1", '
     '"type": "function", "function": {"name": "f", "arguments": "{\\"a\\": \\"\\ud800\\"}"}}]}]}' % USER,
     "messages[1].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", '{"messages": [%s], "chat_template_kwargs": {"x": "\\ud800"}}' % USER,
     "chat_template_kwargs.x"),
]


@pytest.mark.parametrize("path,raw,param", CASES, ids=[c[2] + ("-chat" if "chat" in c[0] else "") for c in CASES])
def test_lone_surrogate_is_400_naming_the_field(client, path, raw, param):
    json.loads(raw)  # the body is valid JSON
    r = _post_raw(client, path, raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"
    assert "not valid Unicode" in err["message"] and "surrogate" in err["message"], err
    ok = client.post("/v1/completions", json={"prompt": "", "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]


def test_lone_surrogate_in_a_streaming_request_is_400_before_the_stream(client):
    r = _post_raw(client, "/v1/chat/completions",
                  '{"messages": [{"role": "user", "content": "\\ud800"}], "stream": true}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"


def test_surrogate_pairs_are_valid_text(client):
    # An escaped pair is one character (U+1F600): accepted.
    r = _post_raw(client, "/v1/completions", '{"prompt": "\\ud83d\\ude00", "max_tokens": 2, "temperature": 0}')
    assert r.status_code == 200, r.text
    r = _post_raw(client, "/v1/chat/completions",
                  '{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 2, "stop": ["\\ud83d\\ude00"]}')
    assert r.status_code == 200, r.text


def test_python_api_raises_value_error_naming_the_argument(llm):
    with pytest.raises(ValueError, match="prompt is not valid Unicode"):
        llm.generate("a\ud800", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="prompt is not valid Unicode"):
        llm.generate(["fine", "\udc80"], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="prompt is not valid Unicode"):
        llm.generate_async("\udfff")
    with pytest.raises(ValueError, match=r"stop\[1\] is not valid Unicode"):
        SamplingParams(stop=["ok", "\ud800"])
    with pytest.raises(ValueError, match=r"stop\[0\] is not valid Unicode"):
        SamplingParams(stop="\ud800")
    with pytest.raises(ValueError, match=r"bad_words\[0\] is not valid Unicode"):
        SamplingParams(bad_words=["\ud800"])
    out = llm.generate("\U0001F600", SamplingParams(max_tokens=2, temperature=0))
    assert len(out.outputs[0].token_ids) == 2
