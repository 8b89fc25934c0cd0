"""Server pieces without a server process: protocol validation, error mapping, sampling parameters,
chat-template rendering, Prometheus series from synthetic engine stats, health while loading."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import ValidationError

from kvpilot.server.app import create_app
from kvpilot.server.chat_template import load_chat_template, render_chat
from kvpilot.server.errors import APIError, loc_to_param, validation_error
from kvpilot.server.metrics import PrometheusStatLogger, build_1_2_5_buckets
from kvpilot.server.protocol import ChatCompletionRequest, CompletionRequest, DeltaMessage
from kvpilot.server.sampling import chat_params, check_context, completion_params
from kvpilot.server.state import ServerState
from kvpilot.server.streaming import SSE_DONE, sse
from kvpilot.core.stats import FinishedRequestStats, IterationStats, KvCacheStats


def _first_error(model, body) -> APIError:
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return validation_error(RequestValidationError(e.value.errors()))


# ---- protocol -----------------------------------------------------------------------------------

def test_prompt_forms():
    assert CompletionRequest.model_validate({"prompt": "a"}).prompts() == ["a"]
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    assert CompletionRequest.model_validate({"prompt": [1, 2]}).prompts() == [[1, 2]]
    assert CompletionRequest.model_validate({"prompt": [[1], [2, 3]]}).prompts() == [[1], [2, 3]]
    for bad in (5, [], [1, "a"], [[1], []], [True], None):
        err = _first_error(CompletionRequest, {"prompt": bad})
        assert err.param == "prompt" and err.status == 400, bad


def test_strict_types_name_the_field():
    err = _first_error(CompletionRequest, {"prompt": "x", "max_tokens": "5"})
    assert (err.param, err.message) == ("max_tokens", "max_tokens: Input should be a valid integer, got '5'")
    err = _first_error(CompletionRequest, {"prompt": "x", "echo": 1})
    assert err.param == "echo"
    err = _first_error(ChatCompletionRequest, {"messages": [{"role": "user", "content": 3}]})
    assert err.param == "messages[0].content"
    err = _first_error(ChatCompletionRequest, {"messages": []})
    assert (err.param, err.message) == ("messages", "messages must contain at least one message")
    err = _first_error(ChatCompletionRequest, {"messages": [{"content": "x"}]})
    assert (err.param, err.message) == ("messages[0].role", "messages[0].role is required")
    # ints are valid floats, unknown fields are ignored (and reported)
    req = CompletionRequest.model_validate({"prompt": "x", "temperature": 1, "foo": 2})
    assert req.temperature == 1.0 and req.unknown_fields() == ["foo"]


def test_loc_to_param():
    assert loc_to_param(("body", "messages", 0, "content", "str")) == "messages[0].content"
    assert loc_to_param(("body", "stop", "list[str]", 1)) == "stop"
    assert loc_to_param(("body",)) is None


def test_delta_drops_unset_fields():
    assert DeltaMessage(role="assistant", content="").model_dump() == {"role": "assistant", "content": ""}
    assert DeltaMessage(content="hi").model_dump() == {"content": "hi"}
    assert DeltaMessage().model_dump() == {}


def test_sse_framing():
    assert sse('{"a":1}') == 'data: {"a":1}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"


# ---- sampling parameters ------------------------------------------------------------------------

def test_completion_params_mapping():
    req = CompletionRequest.model_validate({
        "prompt": "x", "temperature": 0, "top_p": 0.5, "n": 2, "seed": 3, "stop": "END", "echo": True,
        "logprobs": 2, "logit_bias": {"7": -100}, "top_k": 5, "min_p": 0.1, "min_tokens": 1, "ignore_eos": True,
        "stop_token_ids": [9], "include_stop_str_in_output": True, "repetition_penalty": 1.2})
    p = completion_params(req, max_tokens=7)
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.seed, p.stop) == (7, 0.0, 0.5, 2, 3, ["END"])
    assert (p.logprobs, p.prompt_logprobs, p.logit_bias) == (2, 2, {7: -100.0})
    assert (p.top_k, p.min_p, p.min_tokens, p.ignore_eos, p.stop_token_ids) == (5, 0.1, 1, True, [9])
    assert (p.include_stop_str_in_output, p.repetition_penalty) == (True, 1.2)
    default = completion_params(CompletionRequest.model_validate({"prompt": "x"}), max_tokens=16)
    assert (default.temperature, default.top_p, default.top_k, default.logprobs, default.prompt_logprobs) == \
        (1.0, 1.0, 0, None, None)


@pytest.mark.parametrize("body,param", [
    ({"temperature": -0.5}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 0}, "n"),
    ({"min_p": 2}, "min_p"), ({"logprobs": 21}, "logprobs"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"suffix": "s"}, "suffix"), ({"min_tokens": 9}, "min_tokens"),
])
def test_completion_params_errors_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        completion_params(CompletionRequest.model_validate({"prompt": "x", **body}), max_tokens=4)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_chat_params_renames_fields():
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                                "top_logprobs": 3})
    assert chat_params(req, max_tokens=5).logprobs == 3
    with pytest.raises(APIError) as e:
        chat_params(req.model_copy(update={"top_logprobs": 30}), max_tokens=5)
    assert e.value.param == "top_logprobs" and e.value.message.startswith("top_logprobs must be")
    with pytest.raises(APIError) as e:
        chat_params(req.model_copy(update={"logprobs": False}), max_tokens=5)
    assert e.value.param == "top_logprobs"


def test_check_context():
    assert check_context(10, None, 512, "max_tokens") == 502
    assert check_context(10, 502, 512, "max_tokens") == 502
    with pytest.raises(APIError) as e:
        check_context(10, 503, 512, "max_completion_tokens")
    assert e.value.param == "max_completion_tokens" and "513 tokens (10 in the prompt, 503" in e.value.message
    with pytest.raises(APIError) as e:
        check_context(512, None, 512, "max_tokens")
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as e:
        check_context(5, 0, 512, "max_tokens")
    assert e.value.param == "max_tokens"


# ---- chat template ------------------------------------------------------------------------------

class _Tok:
    """A tokenizer stand-in: transformers' template rendering, characters as token ids."""

    bos_token = "<s>"

    def __init__(self, template=None):
        self.chat_template = template

    def apply_chat_template(self, conversation, chat_template=None, tokenize=False, add_generation_prompt=True,
                            **kw):
        from jinja2 import Environment
        tmpl = Environment().from_string(chat_template or self.chat_template)
        return tmpl.render(messages=conversation, bos_token=self.bos_token,
                           add_generation_prompt=add_generation_prompt, **kw)

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]


def test_render_chat_adds_bos_once():
    msgs = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]}]}).messages
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert render_chat(_Tok(), msgs, plain) == [1, ord("S"), ord("a"), ord("\n"), ord("b")]
    with_bos = "{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}{% endfor %}"
    assert render_chat(_Tok(with_bos), msgs, None) == [ord(c) for c in "<s>su"]


def test_render_chat_errors():
    msgs = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]}).messages
    with pytest.raises(APIError) as e:
        render_chat(_Tok(), msgs, None)
    assert e.value.status == 400 and "--chat-template" in e.value.message
    with pytest.raises(APIError) as e:
        render_chat(_Tok(), msgs, "{{ messages[5]['content'] + 1 }}")
    assert e.value.param == "messages"
    image = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}).messages
    with pytest.raises(APIError) as e:
        render_chat(_Tok(), image, "{{ 1 }}")
    assert e.value.param == "messages[0].content"


def test_load_chat_template(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ x }}")
    assert load_chat_template(str(f)) == "{{ x }}"
    assert load_chat_template("{% if 1 %}y{% endif %}") == "{% if 1 %}y{% endif %}"
    assert load_chat_template(None) is None
    with pytest.raises(FileNotFoundError):
        load_chat_template(str(tmp_path / "missing.jinja"))


# ---- metrics ------------------------------------------------------------------------------------

def _stats(**kw) -> IterationStats:
    kv = KvCacheStats(max_num_blocks=100, free_num_blocks=100 - kw.pop("used", 0), used_num_blocks=0,
                      tokens_per_block=32)
    kv.used_num_blocks = kv.max_num_blocks - kv.free_num_blocks
    return IterationStats(iter=1, timestamp=0.0, iter_latency_s=0.01, kv_cache=kv, **kw)


def _sample(registry: CollectorRegistry, name: str, **labels) -> float:
    value = registry.get_sample_value(name, {"model_name": "m", **labels})
    return 0.0 if value is None else value


def test_metrics_from_synthetic_stats():
    reg = CollectorRegistry()
    log = PrometheusStatLogger("m", max_model_len=512, registry=reg, compat_prefixes=("kvpilot:", "vllm:"))
    log(_stats(num_running=2, num_waiting=1, used=25, num_prompt_tokens=10, num_generation_tokens=2,
               prefix_cache_queries=10, prefix_cache_hits=4, num_preemptions=1, ttft=[0.03, 0.2],
               inter_token_latencies=[0.02]))
    finished = FinishedRequestStats(request_id=1, finish_reason="stop", num_prompt_tokens=10,
                                    num_generation_tokens=5, max_tokens=16, n=1, arrival_time=100.0,
                                    first_scheduled_time=100.5, first_token_time=101.0, finished_time=103.0)
    log(_stats(num_running=0, num_waiting=0, used=0, num_generation_tokens=3, finished=[finished]))
    for p in ("kvpilot:", "vllm:"):
        assert _sample(reg, p + "num_requests_running") == 0  # the idle report zeroes the gauges
        assert _sample(reg, p + "kv_cache_usage_perc") == 0
        assert _sample(reg, p + "prompt_tokens_total") == 10
        assert _sample(reg, p + "generation_tokens_total") == 5
        assert _sample(reg, p + "prefix_cache_queries_total") == 10
        assert _sample(reg, p + "prefix_cache_hits_total") == 4
        assert _sample(reg, p + "num_preemptions_total") == 1
        assert _sample(reg, p + "request_success_total", finished_reason="stop") == 1
        assert _sample(reg, p + "time_to_first_token_seconds_count") == 2
        assert _sample(reg, p + "time_to_first_token_seconds_bucket", le="0.04") == 1
        assert _sample(reg, p + "time_to_first_token_seconds_bucket", le="0.25") == 2
        assert _sample(reg, p + "inter_token_latency_seconds_bucket", le="0.025") == 1
        assert _sample(reg, p + "e2e_request_latency_seconds_sum") == pytest.approx(3.0)
        assert _sample(reg, p + "e2e_request_latency_seconds_bucket", le="2.5") == 0
        assert _sample(reg, p + "e2e_request_latency_seconds_bucket", le="5.0") == 1
        assert _sample(reg, p + "request_queue_time_seconds_sum") == pytest.approx(0.5)
        assert _sample(reg, p + "request_inference_time_seconds_sum") == pytest.approx(2.5)
        assert _sample(reg, p + "request_time_per_output_token_seconds_sum") == pytest.approx(0.5)
        assert _sample(reg, p + "iteration_tokens_total_sum") == 15
        assert _sample(reg, p + "request_generation_tokens_bucket", le="5.0") == 1
    busy = _stats(num_running=3, num_waiting=2, used=40)
    log(busy)
    assert _sample(reg, "kvpilot:num_requests_running") == 3
    assert _sample(reg, "kvpilot:num_requests_waiting") == 2
    assert _sample(reg, "kvpilot:kv_cache_usage_perc") == pytest.approx(0.4)
    text = generate_latest(reg).decode()
    assert "_created" not in text
    assert 'kvpilot:kv_cache_usage_perc{model_name="m"} 0.4' in text


def test_metrics_logger_never_raises_into_the_engine():
    log = PrometheusStatLogger("m", 512, CollectorRegistry())
    log(SimpleNamespace())  # a malformed report is logged, not raised


def test_token_buckets():
    assert build_1_2_5_buckets(512) == [1, 2, 5, 10, 20, 50, 100, 200, 500]
    assert build_1_2_5_buckets(1) == [1]


# ---- health while loading -----------------------------------------------------------------------

class _FakeLLM:
    max_seq_len = 64
    tokenizer = None

    def __init__(self):
        self.loggers, self.shut = [], False

    def add_stat_logger(self, fn):
        self.loggers.append(fn)

    def shutdown(self):
        self.shut = True


def test_health_503_while_loading_then_200():
    release = threading.Event()
    fake = _FakeLLM()

    def load():
        assert release.wait(10)
        return fake

    state = ServerState(served_model_name="m", model_path="/x")
    app = create_app(state, load=load)
    with TestClient(app) as client:
        for path in ("/health", "/v1/health/ready"):
            r = client.get(path)
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert client.get("/v1/health/live").status_code == 200
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        release.set()
        deadline = time.monotonic() + 5
        while client.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.get("/health").json() == {"object": "health.response", "message": "Service is ready."}
        assert len(fake.loggers) == 1
        state.draining = True
        assert client.get("/health").status_code == 503
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 503
    assert fake.shut


def test_failed_load_keeps_health_503():
    def load():
        raise FileNotFoundError("no config.json")

    state = ServerState(served_model_name="m", model_path="/x")
    with TestClient(create_app(state, load=load)) as client:
        deadline = time.monotonic() + 5
        while state.load_error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        r = client.get("/health")
        assert r.status_code == 503 and "no config.json" in r.json()["error"]["message"]
        assert client.get("/v1/health/live").status_code == 503
