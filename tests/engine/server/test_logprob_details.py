"""Logprob details that add up: chat ``bytes`` are the token's own bytes, ``text_offset`` indexes the
echoed text, a token-id prompt is echoed without its BOS, ``prompt_logprobs`` comes back on its
own, ``top_logprobs`` keeps every alternative, and a 503 says when to retry."""

from __future__ import annotations

import shutil

import pytest
from fastapi.testclient import TestClient

from support.engine import make_tiny_llama
from kvpilot import LLM, KvCacheConfig
from kvpilot.server.app import create_app
from kvpilot.server.state import ServerState

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
BYTE_PIECES = ["<0xE2>", "<0x82>", "<0xAC>", "<0xC3>", "<0xA9>", "<0xF0>", "<0x9F>"]


@pytest.fixture(scope="module")
def llm(stories_model_dir, tmp_path_factory):
    # stories260K's SentencePiece tokenizer (byte fallback: <0x00>..<0xFF> are 256 of its 512 ids) on a
    # random-weight Llama, whose top alternatives are spread over the vocabulary, byte pieces included.
    path = tmp_path_factory.mktemp("randstories")
    for f in stories_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    make_tiny_llama(path, seed=1, vocab=512)
    with LLM(str(path), max_num_tokens=256, device="cpu", kv_cache_config=KvCacheConfig(tokens_per_block=16)) as llm:
        yield llm


@pytest.fixture(scope="module")
def client(llm):
    state = ServerState(served_model_name="stories", model_path="stories", llm=llm, chat_template=CHAT_TEMPLATE)
    with TestClient(create_app(state)) as c:
        yield c


def _byte_ids(llm) -> list[int]:
    return llm.tokenizer.convert_tokens_to_ids(BYTE_PIECES)


def test_chat_logprob_bytes_are_the_tokens_own_bytes(client, llm):
    ids = _byte_ids(llm)
    # Only the bytes of "€" (E2 82 AC) may be generated: the reply is that character, one byte a token.
    body = {"messages": [{"role": "user", "content": "Once"}], "max_tokens": 3, "temperature": 0,
            "logprobs": True, "top_logprobs": 20, "allowed_token_ids": [ids[0]]}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [e["bytes"] for e in content] == [[0xE2], [0xE2], [0xE2]]
    pieces = 0
    for e in content + [t for e in content for t in e["top_logprobs"]]:
        if "\ufffd" in e["token"]:  # a byte piece that is no character here: its own one byte
            pieces += 1
            assert len(e["bytes"]) == 1 and e["bytes"] != list("\ufffd".encode()), e
        else:
            assert e["bytes"] == list(e["token"].encode()), e
    assert pieces > 3


def test_chat_logprob_bytes_rebuild_the_text(client, llm):
    ids = _byte_ids(llm)
    for forced, want in ((ids[0], 0xE2), (ids[3], 0xC3), (ids[6], 0x9F)):
        body = {"messages": [{"role": "user", "content": "Once"}], "max_tokens": 2, "temperature": 0,
                "logprobs": True, "allowed_token_ids": [forced]}
        r = client.post("/v1/chat/completions", json=body)
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert [e["bytes"] for e in content] == [[want], [want]]
        # The bytes rebuild the reply as the tokenizer decodes it.
        text = r.json()["choices"][0]["message"]["content"]
        assert bytes(b for e in content for b in e["bytes"]).decode("utf-8", "replace") == text


def test_echo_text_offset_indexes_the_echoed_text(client):
    prompt = "Once upon a time"
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0, "echo": True,
                                             "logprobs": 1})
    choice = r.json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert text.startswith(prompt)
    assert lp["tokens"][0] == "<s>" and lp["text_offset"][0] == 0
    for tok, off in zip(lp["tokens"][1:], lp["text_offset"][1:]):
        assert text[off:off + len(tok)] == tok, (tok, off, text)
    assert lp["text_offset"][1] == 0  # the first real token starts the text; BOS takes no room in it


def test_echo_of_a_token_id_prompt_has_no_bos_text(client, llm):
    ids = [1] + llm.tokenizer.encode("Once upon", add_special_tokens=False)
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 3, "temperature": 0, "echo": True})
    text = r.json()["choices"][0]["text"]
    assert text.startswith("Once upon") and "<s>" not in text
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 3, "temperature": 0, "echo": True,
                                             "stream": True})
    assert "<s>" not in r.text and "Once upon" in r.text


def test_prompt_logprobs_returned_without_echo_or_logprobs(client, llm):
    prompt = "Once upon a time"
    n_prompt = len(llm.tokenizer.encode(prompt))
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                             "prompt_logprobs": 2})
    choice = r.json()["choices"][0]
    plp = choice["prompt_logprobs"]
    assert len(plp) == n_prompt and plp[0] is None
    ids = llm.tokenizer.encode(prompt)
    for tok, entry in zip(ids[1:], plp[1:]):
        assert str(tok) in entry and len(entry) in (2, 3)
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 for v in entry.values())
    # Not asked: not there.
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert "prompt_logprobs" not in r.json()["choices"][0]


def test_top_logprobs_keep_alternatives_that_decode_alike(client, llm):
    r = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 8, "temperature": 0, "logprobs": 10})
    lp = r.json()["choices"][0]["logprobs"]
    collided = 0
    for top in lp["top_logprobs"]:
        assert len(top) >= 10, top
        collided += sum(k.startswith("bytes:\\x") for k in top)
        for k in top:
            if k.startswith("bytes:"):  # one byte, written as OpenAI writes non-UTF-8 token text
                assert len(k) == len("bytes:\\xNN") and int(k[-2:], 16) < 256
    assert collided > 0  # several byte pieces were among the alternatives
    # The streaming form keys them the same way.
    r2 = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 8, "temperature": 0, "logprobs": 10,
                                              "stream": True})
    import json as _json
    streamed = [t for line in r2.text.split("\n") if line.startswith("data: {")
                for c in _json.loads(line[6:])["choices"] if c["logprobs"] for t in c["logprobs"]["top_logprobs"]]
    assert streamed == lp["top_logprobs"]


def test_503_while_loading_has_retry_after():
    import threading
    from types import SimpleNamespace

    release = threading.Event()

    def load():
        release.wait(30)
        raise RuntimeError("no model")

    state = ServerState(served_model_name="m", model_path="m")
    with TestClient(create_app(state, load=load)) as c:
        for path in ("/health", "/v1/health/ready"):
            r = c.get(path)
            assert r.status_code == 503 and int(r.headers["Retry-After"]) > 0
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and int(r.headers["Retry-After"]) > 0
        release.set()
    state.draining = True
    state.llm = SimpleNamespace(max_seq_len=64)
    with TestClient(create_app(state)) as c:
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and int(r.headers["Retry-After"]) > 0
        assert c.get("/v1/models").status_code == 200
