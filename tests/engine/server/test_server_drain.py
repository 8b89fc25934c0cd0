"""`kvpilot serve` without a chat template or API key: the chat 400, and the SIGTERM drain."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from kvpilot.server.launcher import ServerProcess


def _stream_in_thread(url: str, body: dict) -> tuple[threading.Thread, dict]:
    """POST a streaming request from a thread; the dict fills with the chunks, [DONE] and errors."""
    result: dict = {"chunks": [], "done": False, "first": threading.Event()}

    def run():
        try:
            with httpx.stream("POST", url, json=body, timeout=60) as r:
                result["status"] = r.status_code
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        result["done"] = True
                    elif line.startswith("data: "):
                        result["chunks"].append(json.loads(line[6:]))
                        result["first"].set()
        except Exception as exc:  # reported through the dict
            result["error"] = exc
        finally:
            result["first"].set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


def _wait_status(url: str, status: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    got = -1
    while time.monotonic() < deadline:
        got = httpx.get(url, timeout=2).status_code
        if got == status:
            break
        time.sleep(0.02)
    return got


def _check_chat_without_template(srv: ServerProcess) -> None:
    r = httpx.post(srv.base_url + "/chat/completions", timeout=10,
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert "--chat-template" in err["message"] and err["param"] == "messages"
    ok = httpx.post(srv.base_url + "/completions", timeout=10, json={"prompt": "", "max_tokens": 4})
    assert ok.status_code == 200


@pytest.mark.parametrize("drain_timeout,finish_reason", [(30, "length"), (0.3, "abort")])
def test_sigterm_drains_then_exits_0(stories_model_dir, tmp_path, drain_timeout, finish_reason):
    """Running requests finish (or, past --drain-timeout, end with "abort"); health and new requests get
    503 meanwhile; the process exits 0. The first server also checks the chat 400 of a template-less
    model, to save a server start."""
    srv = ServerProcess(stories_model_dir, ["--served-model-name", "m", "--drain-timeout", str(drain_timeout)],
                        log_path=tmp_path / "log").start()
    try:
        if finish_reason == "length":
            _check_chat_without_template(srv)
        # ~2 s of decoding on CPU: still running when SIGTERM arrives.
        body = {"prompt": "", "max_tokens": 500, "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        thread, result = _stream_in_thread(srv.base_url + "/completions", body)
        assert result["first"].wait(10) and "error" not in result
        srv.terminate()
        if finish_reason == "length":  # (past a short deadline the server may already be gone)
            assert _wait_status(srv.url + "/health", 503) == 503
            assert httpx.get(srv.url + "/v1/health/ready", timeout=2).status_code == 503
            late = httpx.post(srv.base_url + "/completions", json={"prompt": "", "max_tokens": 2}, timeout=5)
            assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"
        thread.join(30)
        assert result["status"] == 200 and result["done"], result.get("error")
        last = [c for c in result["chunks"] if c["choices"]][-1]["choices"][0]
        assert last["finish_reason"] == finish_reason
        generated = result["chunks"][-1]["usage"]["completion_tokens"]
        assert (generated == 500) == (finish_reason == "length"), generated
        assert srv.wait(timeout=20) == 0
    finally:
        srv.stop()
