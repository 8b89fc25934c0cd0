"""`kvpilot serve` end to end: a real server process on stories260K, driven by the official openai client.

One server for the whole module (API key, chat template by flag, vLLM-compatible metrics).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time

import httpx
import openai
import pytest

from kvpilot.server.launcher import ServerProcess

# llama2.c's documented greedy continuation of BOS alone (shared/models/stories260K/SOURCE.md).
GOLDEN = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
          "One day, she saw a big, red ball. She wanted to play with it, but it was too high.")
API_KEY = "test-key-123"
MODEL = "stories"
# Renders only the message contents: one empty user message -> "" -> the BOS-only prompt.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def server(stories_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    template = tmp / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    proc = ServerProcess(stories_model_dir, ["--served-model-name", MODEL, "--api-key", API_KEY,
                                             "--chat-template", str(template), "--metrics-compat", "vllm"],
                         log_path=tmp / "server.log")
    with proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


def metric(server, name: str, **labels) -> float:
    """The value of one series from /metrics (0 when absent)."""
    text = httpx.get(server.url + "/metrics", timeout=5).text
    want = {"model_name": MODEL, **labels}
    for line in text.splitlines():
        m = re.match(r"^([^{\s]+)\{([^}]*)\} (\S+)$", line)
        if m and m.group(1) == name:
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            if got == want:
                return float(m.group(3))
    return 0.0


# ---- golden text ------------------------------------------------------------------------------

def test_completion_greedy_golden(client):
    r = client.completions.create(model=MODEL, prompt="", max_tokens=64, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text.startswith(GOLDEN)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 1 and r.usage.completion_tokens == 64 and r.usage.total_tokens == 65


def test_completion_stream_golden(client):
    stream = client.completions.create(model=MODEL, prompt="", max_tokens=64, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks).startswith(GOLDEN)
    assert [c.choices[0].finish_reason for c in text_chunks[:-1]] == [None] * (len(text_chunks) - 1)
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 64
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_greedy_golden(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ""}],
                                       max_completion_tokens=64, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content.startswith(GOLDEN)
    assert r.usage.prompt_tokens == 1 and r.usage.completion_tokens == 64


def test_chat_stream_golden_and_chunk_shapes(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": ""}], "max_tokens": 64,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["object"] == "chat.completion.chunk"
    content = [c for c in chunks if c["choices"]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    assert text.startswith(GOLDEN)
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    assert content[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length",
                                         "stop_reason": None}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 1, "completion_tokens": 64,
                                                                   "total_tokens": 65}
    assert len({c["id"] for c in chunks}) == 1


def test_chat_assistant_prefill_with_echo_and_tools(server, client):
    """``continue_final_message`` continues the final assistant message, ``echo`` puts its text before
    the reply (both ways of serving), and ``tools`` with ``tool_choice`` "auto" are accepted."""
    prefix = "Once upon a time, there was"
    body = {"messages": [{"role": "assistant", "content": prefix}], "add_generation_prompt": False,
            "continue_final_message": True, "echo": True, "max_tokens": 12, "temperature": 0,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "tool_choice": "auto"}
    r = client.chat.completions.create(model=MODEL, **{k: body[k] for k in ("messages", "max_tokens", "temperature",
                                                                           "tools", "tool_choice")},
                                       extra_body={k: body[k] for k in ("add_generation_prompt",
                                                                        "continue_final_message", "echo")})
    content = r.choices[0].message.content
    assert content.startswith(prefix) and len(content) > len(prefix)
    assert r.usage.completion_tokens == 12
    no_echo = client.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=12, temperature=0,
                                             extra_body={"add_generation_prompt": False,
                                                         "continue_final_message": True})
    assert prefix + no_echo.choices[0].message.content == content
    with httpx.stream("POST", server.base_url + "/chat/completions", json={**body, "model": MODEL, "stream": True},
                      timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as s:
        events = [e for e in s.read().decode().split("\n\n") if e.startswith("data: {")]
    deltas = [json.loads(e[len("data: "):])["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": prefix}
    assert "".join(d.get("content") or "" for d in deltas) == content


# ---- sampling features ------------------------------------------------------------------------

def test_stop_string_held_back(client):
    full = client.completions.create(model=MODEL, prompt="", max_tokens=64, temperature=0).choices[0].text
    cut = full.index(" Lily")
    r = client.completions.create(model=MODEL, prompt="", max_tokens=64, temperature=0, stop=[" Lily"])
    assert r.choices[0].text == full[:cut]
    assert r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt="", max_tokens=64, temperature=0, stop=[" Lily"],
                                         stream=True)
    pieces = [c.choices[0].text for c in streamed]
    assert "".join(pieces) == full[:cut]
    kept = client.completions.create(model=MODEL, prompt="", max_tokens=64, temperature=0, stop=[" Lily"],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == full[:cut] + " Lily"


def test_multi_prompt_and_n(client):
    prompts = ["Once upon a time", "The cat"]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0).choices[0].text
               for p in prompts]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=20, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [singles[0], singles[0], singles[1], singles[1]]
    assert r.usage.completion_tokens == 80
    sampled = client.completions.create(model=MODEL, prompt="Once", max_tokens=30, temperature=1.0, n=2, seed=7)
    again = client.completions.create(model=MODEL, prompt="Once", max_tokens=30, temperature=1.0, n=2, seed=7)
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]
    streamed = client.completions.create(model=MODEL, prompt=prompts, max_tokens=20, temperature=0, stream=True)
    texts: dict[int, str] = {}
    for c in streamed:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert texts == {0: singles[0], 1: singles[1]}


def test_token_id_prompt_and_vllm_extras(client):
    by_text = client.completions.create(model=MODEL, prompt="", max_tokens=30, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=[1], max_tokens=30, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    # top_k=1 is greedy whatever the temperature; min_tokens/ignore_eos force the length.
    r = client.completions.create(model=MODEL, prompt="", max_tokens=30, temperature=0.8,
                                  extra_body={"top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0,
                                              "ignore_eos": True, "min_tokens": 30})
    assert r.choices[0].text == by_text.choices[0].text
    assert r.usage.completion_tokens == 30


def test_echo_and_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=5, temperature=0, echo=True,
                                  logprobs=2)
    choice = r.choices[0]
    assert choice.text.startswith("Once upon a time")
    lp = choice.logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 5 == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for tok_lp, top in zip(lp.token_logprobs[n_prompt:], lp.top_logprobs[n_prompt:]):
        assert tok_lp <= 0 and abs(tok_lp - max(top.values())) < 1e-5  # greedy picks the top token
        assert len(top) == 2
    # BOS takes no room in the echoed text, so it advances the offsets by nothing.
    assert lp.text_offset == list(itertools.accumulate([0] + [0 if t == "<s>" else len(t) for t in lp.tokens[:-1]]))
    assert lp.tokens[0] == "<s>"


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ""}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(e.token for e in content).replace(" ", "") == r.choices[0].message.content.replace(" ", "")
    for e in content:
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert e.bytes == list(e.token.encode())


# ---- concurrency ------------------------------------------------------------------------------

def test_32_concurrent_streams(server, client):
    prompts = ["", "Once upon a time", "The dog", "Tom and Sam"]
    expected = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=40, temperature=0).choices[0].text
                for p in prompts}

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                                  stream=True)
        return prompt, "".join([c.choices[0].text async for c in stream])

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60)
        try:
            return await asyncio.gather(*(one(aclient, prompts[i % 4]) for i in range(32)))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    assert len(results) == 32
    assert all(text == expected[p] for p, text in results)
    assert expected[""].startswith(GOLDEN[:40])


# ---- bad input ----------------------------------------------------------------------------------

def _post(server, path, body, key=API_KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        headers["Content-Type"] = "application/json"
        return httpx.post(server.base_url + path, content=raw, headers=headers, timeout=30)
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=30)


BAD_REQUESTS = [
    # (path, body or raw bytes, status, param, words in the message)
    ("/completions", b'{"prompt": "x", ', 400, None, "not valid JSON"),
    ("/completions", b'[1, 2]', 400, None, "JSON object"),
    ("/completions", {"max_tokens": 5}, 400, "prompt", "required"),
    ("/completions", {"prompt": 5}, 400, "prompt", "prompt must be"),
    ("/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
    ("/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "integer"),
    ("/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "boolean"),
    ("/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", "temperature must be"),
    ("/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", "top_p must be"),
    ("/completions", {"prompt": "x", "n": 0}, 400, "n", "n must be"),
    ("/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs", "logprobs must be"),
    ("/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ("/completions", {"prompt": "x", "stop": 3}, 400, "stop", "stop must be"),
    ("/completions", {"prompt": "x", "top_k": -5}, 400, "top_k", "top_k must be"),
    ("/completions", {"prompt": "x", "top_k": 2 ** 63}, 400, "top_k", "top_k must be"),
    ("/completions", {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias", "token ids"),
    ("/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
    ("/completions", {"prompt": "x", "seed": 2 ** 70}, 400, "seed", "seed must be in"),
    ("/completions", {"prompt": "x", "max_tokens": 1000}, 400, "max_tokens", "maximum context length is 512"),
    ("/completions", {"prompt": [5] * 600}, 400, "prompt", "maximum context length is 512"),
    ("/completions", {"prompt": [1, 99999]}, 400, "prompt", "token ids must be in"),
    ("/chat/completions", {"messages": []}, 400, "messages", "at least one message"),
    ("/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "robot"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 900}, 400,
     "max_completion_tokens", "maximum context length"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs", "requires logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content", "only text"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404, "model",
     "does not exist"),
    ("/completions", b'', 400, None, "JSON"),
    ("/completions", {"prompt": "x", "allowed_token_ids": [99999]}, 400, "allowed_token_ids", "vocabulary"),
    ("/completions", {"prompt": "x", "stop_token_ids": [99999]}, 400, "stop_token_ids", "vocabulary"),
    ("/completions", {"prompt": "x", "n": 1000}, 400, "n", "n must be"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                           "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     400, "response_format", "does not compile"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tool_choice", "not in tools"),
    ("/chat/completions", {"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True},
     400, "continue_final_message", "cannot both be true"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                           "chat_template_kwargs": {"add_generation_prompt": False}}, 400, "chat_template_kwargs",
     "may not set"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400,
     "tools[0].function", "required"),
]


@pytest.mark.parametrize("path,body,status,param,words", BAD_REQUESTS,
                         ids=[f"{i}-{b[3] or 'body'}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_input_is_4xx_and_server_keeps_serving(server, client, path, body, status, param, words):
    r = _post(server, path, None if isinstance(body, bytes) else body,
              raw=body if isinstance(body, bytes) else None)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert words in err["message"], err
    assert err["type"] == "invalid_request_error"
    ok = client.completions.create(model=MODEL, prompt="", max_tokens=8, temperature=0)
    assert GOLDEN.startswith(ok.choices[0].text)


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="other", prompt="x", max_tokens=2)
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert e.value.body["param"] == "messages"


def test_auth(server):
    for key in (None, "wrong"):
        r = _post(server, "/completions", {"prompt": "x", "max_tokens": 2}, key=key)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(server.base_url + "/models", timeout=5)
    assert r.status_code == 401
    bad = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    # Probes and metrics need no key.
    for path in ("/health", "/v1/health/ready", "/v1/health/live", "/metrics"):
        assert httpx.get(server.url + path, timeout=5).status_code == 200, path


def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == 512


# ---- metrics and aborts -----------------------------------------------------------------------

def test_metrics_families_and_vllm_compat(server, client):
    before = metric(server, "kvpilot:generation_tokens_total")
    client.completions.create(model=MODEL, prompt="", max_tokens=10, temperature=0)
    deadline = time.monotonic() + 2
    while metric(server, "kvpilot:generation_tokens_total") < before + 10 and time.monotonic() < deadline:
        time.sleep(0.02)
    after = metric(server, "kvpilot:generation_tokens_total")
    assert after == before + 10
    assert metric(server, "vllm:generation_tokens_total") == after
    text = httpx.get(server.url + "/metrics", timeout=5).text
    for name in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting", "prompt_tokens_total",
                 "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket"):
        for prefix in ("kvpilot:", "vllm:"):
            assert f"{prefix}{name}{{" in text, prefix + name
    assert 'kvpilot:time_to_first_token_seconds_bucket{le="0.001",model_name="stories"}' in text
    assert 'kvpilot:e2e_request_latency_seconds_bucket{le="7680.0",model_name="stories"}' in text


def test_client_disconnect_frees_kv_within_a_second(server):
    aborted_before = metric(server, "kvpilot:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "", "max_tokens": 500, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        lines = r.iter_lines()
        for _ in range(20):
            next(lines)
        assert metric(server, "kvpilot:num_requests_running") == 1
        assert metric(server, "kvpilot:kv_cache_usage_perc") > 0
    closed = time.monotonic()
    while time.monotonic() - closed < 1.0:
        if (metric(server, "kvpilot:num_requests_running") == 0
                and metric(server, "kvpilot:kv_cache_usage_perc") == 0):
            break
        time.sleep(0.02)
    assert metric(server, "kvpilot:num_requests_running") == 0
    assert metric(server, "kvpilot:kv_cache_usage_perc") == 0
    assert metric(server, "kvpilot:request_success_total", finished_reason="abort") == aborted_before + 1


def test_non_streaming_disconnect_aborts(server):
    aborted_before = metric(server, "kvpilot:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "", "max_tokens": 500, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/completions", json=body, timeout=0.5,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and metric(server, "kvpilot:num_requests_running") != 0:
        time.sleep(0.02)
    assert metric(server, "kvpilot:num_requests_running") == 0
    assert metric(server, "kvpilot:kv_cache_usage_perc") == 0
    assert metric(server, "kvpilot:request_success_total", finished_reason="abort") == aborted_before + 1


# ---- the serving benchmark against this server --------------------------------------------------

def test_bench_serve(server):
    from kvpilot.tools.bench import make_prompts, run_serve_benchmark, summarize

    prompts = make_prompts(6, 8, seed=1)
    results, duration = asyncio.run(run_serve_benchmark(server.url, None, prompts, concurrency=3, max_tokens=12,
                                                         api_key=API_KEY))
    s = summarize(results, duration)
    assert s["completed"] == 6 and s["failed"] == 0
    assert s["total_output_tokens"] == 72  # ignore_eos: exactly max_tokens each
    assert all(r.prompt_tokens >= 9 for r in results)  # 8 words + BOS
    assert all(0 < r.ttft <= r.e2e and len(r.itls) >= 1 for r in results)
    assert 0 < s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"]
    from kvpilot.tools.bench import BenchmarkError

    with pytest.raises(BenchmarkError, match="HTTP 401"):
        asyncio.run(run_serve_benchmark(server.url, MODEL, prompts[:1], 1, 4, api_key="wrong"))
