"""Scraping engine /metrics: the alias table, parsing, pod URL discovery, and concurrent scrapes
against real HTTP servers on localhost."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from kvpilot.operator.autoscaler import PodMetrics
from kvpilot.operator.scrape import (
    MetricsParseError,
    parse_metrics,
    pod_is_ready,
    pod_metrics_url,
    scrape_pods,
    scrape_workload_pods,
)


def exposition(prefix: str, kv: float, running: float, waiting: float, models=("m",)) -> str:
    """Prometheus text as prometheus_client writes it, with the given metric names."""
    reg = CollectorRegistry()
    names = {
        "kvpilot": ("kvpilot:kv_cache_usage_perc", "kvpilot:num_requests_running", "kvpilot:num_requests_waiting"),
        "vllm": ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"),
        "vllm-old": ("vllm:gpu_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"),
        "sglang": ("sglang:token_usage", "sglang:num_running_reqs", "sglang:num_queue_reqs"),
    }[prefix]
    gauges = [Gauge(n, "doc", ["model_name"], registry=reg) for n in names]
    for m in models:
        for g, v in zip(gauges, (kv, running, waiting)):
            g.labels(model_name=m).set(v)
    return generate_latest(reg).decode()


@pytest.mark.parametrize("prefix", ["kvpilot", "vllm", "vllm-old", "sglang"])
def test_parse_each_engine(prefix):
    assert parse_metrics(exposition(prefix, 0.25, 3, 7), "p") == PodMetrics("p", 0.25, 3.0, 7.0)


def test_kvpilot_name_wins_over_compat_alias():
    text = exposition("kvpilot", 0.4, 2, 1) + exposition("vllm", 0.9, 50, 50)
    assert parse_metrics(text, "p") == PodMetrics("p", 0.4, 2.0, 1.0)


def test_several_samples_average_kv_and_sum_counts():
    text = exposition("vllm", 0.0, 0, 0, models=()) + (
        'vllm:kv_cache_usage_perc{engine="0"} 0.2\nvllm:kv_cache_usage_perc{engine="1"} 0.6\n'
        'vllm:num_requests_waiting{engine="0"} 2\nvllm:num_requests_waiting{engine="1"} 5\n'
    )
    assert parse_metrics(text, "p") == PodMetrics("p", pytest.approx(0.4), None, 7.0)


def test_no_kv_metric_is_missing():
    m = parse_metrics("# TYPE other gauge\nother 1\nvllm:num_requests_running 4\n", "p")
    assert (m.kv_cache_usage, m.num_requests_running, m.available) == (None, 4.0, False)
    assert m.error.startswith("no KV-cache utilisation gauge (kvpilot:kv_cache_usage_perc, ")


@pytest.mark.parametrize(
    "text,match", [("kvpilot:kv_cache_usage_perc 1.7\n", "not a fraction"), ("{{{ not prometheus\n", "not Prometheus text")]
)
def test_parse_errors(text, match):
    with pytest.raises(MetricsParseError, match=match):
        parse_metrics(text, "p")


def pod(name, ip="10.0.0.5", port=8000, ready=True, deleting=False, port_name="http"):
    return {
        "metadata": {"name": name, **({"deletionTimestamp": "2024-01-01T00:00:00Z"} if deleting else {})},
        "spec": {"containers": [{"name": "sidecar"}, {"name": "engine", "ports": [{"name": port_name, "containerPort": port}]}]},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_pod_url_and_readiness():
    assert pod_metrics_url(pod("a")) == "http://10.0.0.5:8000/metrics"
    assert pod_metrics_url(pod("a", ip="fd00::7", port=9000)) == "http://[fd00::7]:9000/metrics"
    assert pod_metrics_url(pod("a", port_name="grpc")) is None
    assert pod_metrics_url(pod("a", ip=None)) is None
    assert [pod_is_ready(p) for p in (pod("a"), pod("a", ready=False), pod("a", deleting=True))] == [True, False, False]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def fake_engines():
    """One aiohttp server on localhost with a good, a failing, a slow and a garbage /metrics."""

    async def good(_):
        return web.Response(text=exposition("kvpilot", 0.5, 4, 2))

    async def broken(_):
        return web.Response(status=500, text="boom")

    async def slow(_):
        await asyncio.sleep(1.0)
        return web.Response(text=exposition("kvpilot", 0.9, 1, 1))

    async def garbage(_):
        return web.Response(text="kvpilot:kv_cache_usage_perc 2.0\n")

    app = web.Application()
    app.add_routes([web.get("/metrics", good), web.get("/good/metrics", good), web.get("/broken/metrics", broken),
                    web.get("/slow/metrics", slow), web.get("/garbage/metrics", garbage)])
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_scrape_pods_concurrently_with_timeouts(fake_engines):
    base = fake_engines
    targets = {
        "good": f"{base}/good/metrics",
        "broken": f"{base}/broken/metrics",
        "slow": f"{base}/slow/metrics",
        "garbage": f"{base}/garbage/metrics",
        "closed": f"http://127.0.0.1:{free_port()}/metrics",
        "unready": None,
    }
    loop = asyncio.get_running_loop()
    start = loop.time()
    out = await scrape_pods(targets, timeout_s=0.3)
    assert loop.time() - start < 0.9  # concurrent, and the slow pod is cut at its timeout
    assert [m.pod for m in out] == list(targets)
    assert out[0] == PodMetrics("good", 0.5, 4.0, 2.0)
    assert [m.available for m in out] == [True, False, False, False, False, False]
    errors = {m.pod: m.error for m in out[1:]}
    assert errors["broken"].startswith("HTTPStatusError: Server error '500")
    assert errors["slow"].startswith("ReadTimeout")
    assert errors["garbage"].startswith("MetricsParseError: pod garbage: KV-cache utilisation 2.0")
    assert errors["closed"].startswith("ConnectError")
    assert errors["unready"] == "not Ready or no http port"


async def test_scrape_workload_pods(fake_engines):
    port = int(fake_engines.rsplit(":", 1)[1])
    engine_pods = [
        pod("b-unready", ip="127.0.0.1", port=port, ready=False),
        pod("c-leaving", ip="127.0.0.1", port=port, deleting=True),
        pod("a-ready", ip="127.0.0.1", port=port),
        pod("d-wrong-port", ip="127.0.0.1", port=free_port()),
    ]
    out = await scrape_workload_pods(engine_pods, timeout_s=1.0)
    assert out[0] == PodMetrics("a-ready", 0.5, 4.0, 2.0)
    assert [(m.pod, m.available) for m in out[1:]] == [("b-unready", False), ("d-wrong-port", False)]
    assert out[2].error.startswith("ConnectError")
