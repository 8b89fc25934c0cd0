"""The autoscaler's life cycle against kmock's emulator: no finalizer, conditions that do not
overwrite each other when autoscaling is switched off, and no status writes while nothing changes."""

from __future__ import annotations

import asyncio

import pytest

from kvpilot.operator.apply import resource_path
from support.fake_engine_pods import FakePods
from support.operator_harness import NAMESPACE, make_cr, operator_env  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(90)

SPEC = {
    "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
    "replicas": 1,
    "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetKVCacheUtilization": 0.5,
                    "scrapeIntervalSeconds": 1, "scaleDownStabilizationSeconds": 0},
}


def _conditions(env):
    cr = env.get("LLMDeployment", NAMESPACE, "llama") or {}
    return {c["type"]: (c["status"], c["reason"]) for c in (cr.get("status") or {}).get("conditions") or []}


async def _autoscaled(env, pods: FakePods, kv: float = 0.3):
    pods.load["kv"] = kv
    await env.start()
    await env.create_cr(make_cr("llama", SPEC))
    dep = await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "llama"))
    await pods.add(1, dep["spec"]["template"]["metadata"]["labels"])
    await env.wait_for(lambda: _conditions(env).get("MetricsAvailable", ("",))[0] == "True", timeout=10)


async def test_autoscaled_cr_has_no_finalizer_and_deletes_while_operator_is_down(operator_env):
    env = operator_env
    pods = FakePods(env, NAMESPACE)
    try:
        await _autoscaled(env, pods)
        await asyncio.sleep(1.5)  # kopf would have added its finalizer by now
        assert not env.get("LLMDeployment", NAMESPACE, "llama")["metadata"].get("finalizers")
        await env.stop()
        resp = await env.k.delete(resource_path("serving.kvpilot.io/v1alpha1", "llmdeployments", NAMESPACE, "llama"))
        assert resp.status == 200
        assert env.get("LLMDeployment", NAMESPACE, "llama") is None, "deletion must not wait for the operator"
    finally:
        await pods.close()


@pytest.mark.parametrize("trial", range(3))
async def test_switching_autoscaling_off_sets_scaling_active_false(operator_env, trial):
    env = operator_env
    pods = FakePods(env, NAMESPACE)
    try:
        await _autoscaled(env, pods)
        assert _conditions(env)["ScalingActive"][0] == "True"
        await env.patch("LLMDeployment", NAMESPACE, "llama", {"spec": {"autoscaling": {"enabled": False}}})
        await env.wait_for(lambda: _conditions(env).get("ScalingActive") == ("False", "ScalingDisabled"), timeout=10)
        await env.settle(quiet=1.5)
        conditions = _conditions(env)
        assert conditions["ScalingActive"] == ("False", "ScalingDisabled")
        assert conditions["Reconciled"] == ("True", "Applied")  # neither writer erased the other's
        status = env.get("LLMDeployment", NAMESPACE, "llama")["status"]
        assert status.get("kvCacheUtilization") is None and status.get("autoscaling") is None, status
    finally:
        await pods.close()


async def test_steady_autoscaler_writes_no_status(operator_env):
    env = operator_env
    pods = FakePods(env, NAMESPACE)
    try:
        await _autoscaled(env, pods, kv=0.3)
        await asyncio.sleep(1.5)  # the first rounds settle the numbers
        mark = env.request_count()
        await asyncio.sleep(3.5)  # three more scrape rounds with the same numbers
        assert [w for w in env.writes(mark) if "/llmdeployments/" in w] == []
    finally:
        await pods.close()
