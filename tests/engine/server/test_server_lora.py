"""The server's LoRA adapters: an adapter is a model name (``--lora-modules``), listed by /v1/models
with the base as ``parent``; an unknown model is a 404; adapters load and unload at run time
(vLLM's endpoints, behind the API key). A completion for an adapter gives the tokens the Python API
gives with that adapter's `LoRARequest`."""

from __future__ import annotations

import argparse

import pytest
import torch
from fastapi.testclient import TestClient

from support.engine import make_tiny_llama
from support.lora import make_peft_adapter

from kvpilot import LLM, KvCacheConfig, SamplingParams
from kvpilot.executor import LoRARequest
from kvpilot.server import cli
from kvpilot.server.app import create_app
from kvpilot.server.state import ServerState

pytest.importorskip("peft")

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _adapter(base, out, seed, r):
    return make_peft_adapter(base, out, seed, std=0.2, r=r, lora_alpha=2 * r,
                             target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("srv")
    base = make_tiny_llama(d / "base", seed=7, layers=1)
    a, b = _adapter(base, d / "a", 1, 4), _adapter(base, d / "b", 2, 8)
    parser = argparse.ArgumentParser()
    cli.configure_parser(parser)
    args = parser.parse_args([str(base), "--device", "cpu", "--enable-lora", "--lora-modules", f"sql={a}",
                              "--max-lora-rank", "8", "--max-loras", "2"])
    cli.preflight(args)
    kwargs = cli._engine_kwargs(args)
    kwargs["kv_cache_config"] = KvCacheConfig(max_tokens=512, tokens_per_block=4)
    llm = LLM(str(base), skip_tokenizer_init=True, **kwargs)
    state = ServerState(served_model_name="base", model_path=str(base), api_key=KEY, lora_enabled=True)
    for name, path in args.lora_modules:
        state.add_lora(name, path)
    cli.load_lora_modules(llm, state)
    state.llm = llm
    with TestClient(create_app(state)) as client:
        yield client, llm, state, a, b
    llm.shutdown()


PROMPT = [1, 30, 200, 7, 99, 12]


def _complete(client, model):
    r = client.post("/v1/completions", headers=AUTH,
                    json={"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    return r


def _python(llm, lr):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), lora_request=lr)
    return list(out.outputs[0].token_ids)


def _tokens(r):
    assert r.status_code == 200, r.text
    body = r.json()
    return body["model"], body


def test_models_lists_adapters_with_their_parent(served):
    client, llm, state, a, b = served
    data = client.get("/v1/models", headers=AUTH).json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [("base", None), ("sql", "base")]
    assert data[1]["root"] == str(a)


def test_completion_for_an_adapter_matches_the_python_api(served):
    client, llm, state, a, b = served
    sp = {"model": "sql", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
          "logprobs": 0}
    body = client.post("/v1/completions", headers=AUTH, json=sp).json()
    assert body["model"] == "sql"
    base = client.post("/v1/completions", headers=AUTH, json={**sp, "model": "base"}).json()
    lp = body["choices"][0]["logprobs"]["token_logprobs"]
    want = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0),
                        lora_request=state.lora_modules["sql"])
    c = want.outputs[0]
    torch.testing.assert_close(torch.tensor(lp), torch.tensor([e[t].logprob for t, e in zip(c.token_ids, c.logprobs)]),
                               rtol=0, atol=1e-5)
    assert base["choices"][0]["logprobs"]["token_logprobs"] != lp


def test_unknown_model_is_404(served):
    client = served[0]
    r = _complete(client, "nope")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and "`sql`" in err["message"]


def test_load_and_unload_at_run_time(served):
    client, llm, state, a, b = served
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(b)})
    assert r.status_code == 401  # behind the API key
    r = client.post("/v1/load_lora_adapter", headers=AUTH, json={"lora_name": "chat", "lora_path": str(b)})
    assert r.status_code == 200 and "added successfully" in r.text
    assert "chat" in [m["id"] for m in client.get("/v1/models", headers=AUTH).json()["data"]]
    r = client.post("/v1/completions", headers=AUTH, json={"model": "chat", "prompt": PROMPT, "max_tokens": 6,
                                                           "temperature": 0, "ignore_eos": True, "logprobs": 0})
    assert r.status_code == 200
    want = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0),
                        lora_request=LoRARequest("chat2", 99, str(b)))
    got = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    c = want.outputs[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor([e[t].logprob for t, e in zip(c.token_ids, c.logprobs)]),
                               rtol=0, atol=1e-5)
    again = client.post("/v1/load_lora_adapter", headers=AUTH, json={"lora_name": "chat", "lora_path": str(b)})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    r = client.post("/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "chat"})
    assert r.status_code == 200 and "removed successfully" in r.text
    assert _complete(client, "chat").status_code == 404
    r = client.post("/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "chat"})
    assert r.status_code == 404


def test_loading_a_bad_adapter_is_400_with_the_reason(served, tmp_path):
    client = served[0]
    r = client.post("/v1/load_lora_adapter", headers=AUTH, json={"lora_name": "x", "lora_path": str(tmp_path / "none")})
    assert r.status_code == 400 and "no directory" in r.json()["error"]["message"]
    big = _adapter(served[1].model_dir, tmp_path / "big", 3, 16)
    r = client.post("/v1/load_lora_adapter", headers=AUTH, json={"lora_name": "x", "lora_path": str(big)})
    assert r.status_code == 400 and "max_lora_rank 8" in r.json()["error"]["message"]
    assert "x" not in [m["id"] for m in client.get("/v1/models", headers=AUTH).json()["data"]]


def test_lora_flags(tmp_path):
    parser = argparse.ArgumentParser()
    cli.configure_parser(parser)
    args = parser.parse_args(["m", "--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}'])
    assert args.lora_modules == [("a", "/x"), ("b", "/y")]
    cfg = cli._lora_config(args)
    assert cfg.max_loras == 4 and cfg.max_lora_rank == 16 and cfg.max_cpu_loras == 4
    many = parser.parse_args(["m", "--enable-lora", "--max-loras", "2", "--lora-modules", *(f"a{i}=/x{i}" for i in range(6))])
    assert cli._lora_config(many).max_cpu_loras == 6
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--lora-modules", "no-equals-sign"])
    with pytest.raises(ValueError, match="needs --enable-lora"):
        cli.preflight(parser.parse_args([str(tmp_path), "--device", "cpu", "--lora-modules", "a=/x"]))
    with pytest.raises(ValueError, match="used twice"):
        cli.preflight(parser.parse_args([str(tmp_path), "--device", "cpu", "--enable-lora", "--lora-modules",
                                         "a=/x", "a=/y"]))


def test_endpoints_without_enable_lora_are_400(tmp_path):
    state = ServerState(served_model_name="m", model_path="m")
    state.llm = object()
    with TestClient(create_app(state)) as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]


def test_lora_requests_info_metric_follows_the_adapters():
    from prometheus_client import CollectorRegistry, generate_latest

    from kvpilot.core.stats import IterationStats, KvCacheStats
    from kvpilot.server.metrics import PrometheusStatLogger

    reg = CollectorRegistry()
    log = PrometheusStatLogger("base", max_model_len=64, registry=reg, compat_prefixes=("kvpilot:", "vllm:"))
    kv = KvCacheStats(max_num_blocks=10, free_num_blocks=10, used_num_blocks=0, tokens_per_block=4)

    def stats(t, running, waiting):
        return IterationStats(iter=1, timestamp=t, iter_latency_s=0.01, num_running=len(running),
                              num_waiting=len(waiting), kv_cache=kv, max_lora=4, running_lora_adapters=running,
                              waiting_lora_adapters=waiting)

    log(stats(100.0, ["chat", "sql"], ["x"]))
    text = generate_latest(reg).decode()
    for p in ("kvpilot:", "vllm:"):
        assert (p + 'lora_requests_info{max_lora="4",model_name="base",running_lora_adapters="chat,sql",'
                'waiting_lora_adapters="x"} 100.0') in text
    log(stats(101.0, ["sql"], []))
    text = generate_latest(reg).decode()
    assert 'running_lora_adapters="chat,sql"' not in text  # the previous label values are dropped
    assert ('kvpilot:lora_requests_info{max_lora="4",model_name="base",running_lora_adapters="sql",'
            'waiting_lora_adapters=""} 101.0') in text
    plain = CollectorRegistry()
    PrometheusStatLogger("base", max_model_len=64, registry=plain)(IterationStats(
        iter=1, timestamp=1.0, iter_latency_s=0.0, num_running=0, num_waiting=0, kv_cache=kv))
    assert "lora_requests_info{" not in generate_latest(plain).decode()  # no LoRA: no series


def test_a_bad_lora_module_fails_the_start_with_its_name(served, tmp_path):
    llm = served[1]
    state = ServerState(served_model_name="base", model_path="base", lora_enabled=True)
    state._next_lora_id = 1000  # ids the module's engine has not seen
    state.add_lora("sql", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="LoRA adapter 'sql': no directory"):
        cli.load_lora_modules(llm, state)
