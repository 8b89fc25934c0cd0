"""All chunks of one stream share one ``id`` and one ``created`` (as OpenAI's and vLLM's do), also
when the stream lasts across several seconds."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from kvpilot import LLM, KvCacheConfig
from kvpilot.server.app import create_app
from kvpilot.server.state import ServerState

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def client(stories_model_dir):
    with LLM(str(stories_model_dir), max_num_tokens=256, kv_cache_config=KvCacheConfig(tokens_per_block=16)) as llm:
        # A slow engine (8 ms a step), so that a 150-token stream lasts over a second: it crosses a second boundary.
        llm.add_stat_logger(lambda stats: time.sleep(0.008))
        state = ServerState(served_model_name="stories", model_path="stories", llm=llm, chat_template=CHAT_TEMPLATE)
        with TestClient(create_app(state)) as c:
            yield c


def _chunks(client, path: str, body: dict) -> list[dict]:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    events = [line[len("data: "):] for line in r.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "", "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}]}),
], ids=["completions", "chat"])
def test_stream_chunks_share_id_and_created(client, path, body):
    body = {**body, "max_tokens": 150, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.time()
    chunks = _chunks(client, path, body)
    assert time.time() - t0 > 1.0  # the stream really lasted across a second boundary
    assert len(chunks) > 60
    assert len({c["id"] for c in chunks}) == 1
    assert len({c["created"] for c in chunks}) == 1
    assert abs(chunks[0]["created"] - t0) <= 1
    assert chunks[-1]["usage"]["completion_tokens"] == 150 * body.get("n", 1)
