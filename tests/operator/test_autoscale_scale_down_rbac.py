"""Autoscaled deployments scale down under the chart's own RBAC.

The real operator runs against kmock's emulator; four Pod objects point at tiny HTTP servers that
answer ``/metrics`` with a low KV utilisation. The autoscaler marks the pods with a deletion cost
(a Pod patch) before lowering replicas; the harness fails the test when any request the operator
made is not allowed by the ClusterRole that ``helm template`` renders.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from kvpilot.operator.apply import resource_path
from support.operator_harness import NAMESPACE, make_cr, operator_env  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(60)

SPEC = {
    "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
    "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetKVCacheUtilization": 0.5,
                    "scrapeIntervalSeconds": 1, "scaleDownStabilizationSeconds": 0},
}


async def _metrics_server(load: dict[str, float]) -> tuple[web.AppRunner, int]:
    async def metrics(_request):
        return web.Response(text=f"kvpilot:kv_cache_usage_perc {load['kv']}\nkvpilot:num_requests_running 1\n"
                                 f"kvpilot:num_requests_waiting 0\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


async def test_autoscaled_deployment_scales_down_under_chart_rbac(operator_env):
    env = operator_env
    runners = []
    try:
        load = {"kv": 0.95}
        await env.start()
        cr = make_cr("llama", SPEC)
        await env.create_cr(cr)
        dep = await env.wait_for(lambda: (d := env.get("Deployment", NAMESPACE, "llama")) and d)
        labels = dep["spec"]["template"]["metadata"]["labels"]
        for i in range(4):
            runner, port = await _metrics_server(load)
            runners.append(runner)
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": f"llama-{i}", "namespace": NAMESPACE, "labels": labels},
                   "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]},
                   "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}
            resp = await env.k.post(resource_path("v1", "pods", NAMESPACE), json=pod)
            assert resp.status == 200, await resp.text()
        await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "llama")["spec"]["replicas"] == 4, timeout=15)
        load["kv"] = 0.05
        start = time.monotonic()
        await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "llama")["spec"]["replicas"] < 4, timeout=15)
        elapsed = time.monotonic() - start
        assert elapsed < 10, f"scale-down took {elapsed:.1f} s"
        # The pods were marked before the scale-down, and the status follows the decision.
        costs = [(env.get("Pod", NAMESPACE, f"llama-{i}")["metadata"].get("annotations") or {})
                 .get("controller.kubernetes.io/pod-deletion-cost") for i in range(4)]
        assert all(c is not None for c in costs), costs
        status = env.get("LLMDeployment", NAMESPACE, "llama")["status"]
        assert status["desiredReplicas"] < 4
        assert env.rbac_denials() == []
    finally:
        await env.stop()
        for runner in runners:
            await runner.cleanup()
