"""A foreign HPA or KEDA ScaledObject that scales an LLMDeployment's workload (or the CR through its
scale subresource) is detected: kvpilot stops writing replicas, says who scales them
(``ScalingActive=False``, reason ``ForeignAutoscaler``) and posts a Warning Event; once the other
scaler is gone kvpilot's autoscaler resumes. Pure parts first, then the real operator against
kmock's emulator (without KEDA installed unless a test declares it).
"""

from __future__ import annotations

import asyncio
import time

import kmock
import pytest

from kvpilot.operator import apply as kube
from kvpilot.operator import foreign
from kvpilot.operator.crd import normalize
from kvpilot.operator.handlers import effective, replicas_left
from kvpilot.operator.render import render
from support.fake_engine_pods import FakePods
from support.operator_harness import NAMESPACE, declare_resources, make_cr, operator_env  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(90)

DETECT_BOUND_S = 5.0


def hpa(name, kind="Deployment", api_version="apps/v1", target="llama", owner=None):
    meta = {"name": name, "namespace": NAMESPACE}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "name": owner,
                                    "uid": f"uid-{owner}", "controller": True}]
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": meta,
            "spec": {"scaleTargetRef": {"apiVersion": api_version, "kind": kind, "name": target},
                     "minReplicas": 1, "maxReplicas": 5,
                     "metrics": [{"type": "Resource", "resource": {"name": "cpu",
                                                                   "target": {"type": "Utilization",
                                                                              "averageUtilization": 60}}}]}}


def scaled_object(name, ref):
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"scaleTargetRef": ref, "triggers": [{"type": "cpu", "metadata": {"value": "60"}}]}}


@pytest.mark.parametrize("obj,expected", [
    (hpa("h"), "Deployment"),
    (hpa("h", "LeaderWorkerSet", "leaderworkerset.x-k8s.io/v1"), "LeaderWorkerSet"),
    (hpa("h", "LLMDeployment", "serving.kvpilot.io/v1alpha1"), "LLMDeployment"),
    (hpa("h", target="other"), None),
    (hpa("h", "StatefulSet"), None),
    (hpa("h", "Deployment", "example.com/v1"), None),  # a Deployment of another API group
    (scaled_object("s", {"name": "llama"}), "Deployment"),  # KEDA's defaults: apps/v1 Deployment
    (scaled_object("s", {"apiVersion": "serving.kvpilot.io/v1alpha1", "kind": "LLMDeployment", "name": "llama"}),
     "LLMDeployment"),
    (scaled_object("s", {}), None),
])
def test_scale_target_recognised(obj, expected):
    assert foreign.targets(obj, "llama") == expected


class ListApi:
    def __init__(self, objects, keda_status=None):
        self.objects, self.keda_status = objects, keda_status

    def list(self, kind, ns, labels):
        if kind == foreign.SCALED_OBJECT and self.keda_status:
            raise kube.ApiError(self.keda_status, "scaledobjects")
        return [o for o in self.objects if o["kind"] == kind]


def test_find_names_scaled_object_not_its_hpa_and_ignores_missing_keda():
    objs = [hpa("keda-hpa-so", owner="so"), scaled_object("so", {"name": "llama"}), hpa("mine"), hpa("x", target="y")]
    assert foreign.find(ListApi(objs), NAMESPACE, "llama") == [
        foreign.ForeignScaler("HorizontalPodAutoscaler", NAMESPACE, "mine", "Deployment"),
        foreign.ForeignScaler("ScaledObject", NAMESPACE, "so", "Deployment"),
    ]
    assert foreign.find(ListApi([hpa("mine")], keda_status=404), NAMESPACE, "llama")[0].name == "mine"
    with pytest.raises(kube.ApiError):
        foreign.find(ListApi([], keda_status=500), NAMESPACE, "llama")


def test_who_owns_replicas():
    auto = normalize(make_cr("llama", {"model": {"name": "org/m"}, "replicas": 2,
                                       "autoscaling": {"enabled": True, "maxReplicas": 4}}))
    manual = normalize(make_cr("llama", {"model": {"name": "org/m"}, "replicas": 2}))
    on_dep = [foreign.ForeignScaler("HorizontalPodAutoscaler", NAMESPACE, "h", "Deployment")]
    on_cr = [foreign.ForeignScaler("ScaledObject", NAMESPACE, "s", "LLMDeployment")]
    dep = render(manual)[0]
    assert replicas_left(manual, dep) == () and replicas_left(manual, dep, on_dep) == kube.REPLICAS
    assert replicas_left(auto, dep) == kube.REPLICAS
    # On the CR's scale subresource: kvpilot's autoscaler stands by and spec.replicas rules.
    stand_by = effective(auto, on_cr)
    assert not stand_by["spec"]["autoscaling"]["enabled"] and render(stand_by)[0]["spec"]["replicas"] == 2
    assert replicas_left(stand_by, render(stand_by)[0], on_cr) == ()
    assert effective(auto, on_dep) is auto and effective(manual, on_cr) is manual
    msg = foreign.condition(on_dep, True)["message"]
    assert msg.startswith("HorizontalPodAutoscaler ml/h (scaleTargetRef Deployment) scales the workload directly")
    assert "set spec.autoscaling.enabled=false" in msg


def _scaling(env):
    cr = env.get("LLMDeployment", NAMESPACE, "llama") or {}
    return next(((c["status"], c["reason"], c["message"]) for c in (cr.get("status") or {}).get("conditions") or []
                 if c["type"] == "ScalingActive"), None)


def _events(env, reason):
    key = kmock.resource("v1/events")
    return [o.raw for (res, _ns, _name), o in env.k.objects.items()
            if res == key and not o.deleted and o.raw.get("reason") == reason]


async def _post(env, api_version, plural, obj):
    resp = await env.k.post(kube.resource_path(api_version, plural, NAMESPACE), json=obj)
    assert resp.status == 200, await resp.text()


AUTOSCALED = {"model": {"name": "org/m"}, "replicas": 1,
              "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetKVCacheUtilization": 0.5,
                              "scrapeIntervalSeconds": 1, "scaleDownStabilizationSeconds": 0}}


async def test_hpa_on_the_deployment_stops_kvpilot_writing_replicas(operator_env):
    env = operator_env
    pods = FakePods(env, NAMESPACE, {"kv": 0.0})  # one idle pod: kvpilot wants minReplicas (1)
    try:
        await env.start()
        await env.create_cr(make_cr("llama", AUTOSCALED))
        dep = await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "llama"))
        await pods.add(1, dep["spec"]["template"]["metadata"]["labels"])
        await env.wait_for(lambda: (_scaling(env) or ("",))[0] == "True", timeout=10)
        start = time.monotonic()
        await _post(env, "autoscaling/v2", "horizontalpodautoscalers", hpa("llama-cpu"))
        cond = await env.wait_for(lambda: (c := _scaling(env)) and c[1] == "ForeignAutoscaler" and c, timeout=10)
        elapsed = time.monotonic() - start
        print(f"foreign HPA detected in {elapsed:.2f} s")
        assert elapsed < DETECT_BOUND_S
        assert cond[0] == "False" and "HorizontalPodAutoscaler ml/llama-cpu" in cond[2]
        await env.wait_for(lambda: _events(env, "ForeignAutoscaler"), timeout=5)
        # The HPA scales the Deployment to 3; kvpilot (which would scale back to 1) leaves it.
        await env.patch("Deployment", NAMESPACE, "llama", {"spec": {"replicas": 3}})
        await asyncio.sleep(2.5)  # two autoscaler rounds and any drift repair
        assert env.get("Deployment", NAMESPACE, "llama")["spec"]["replicas"] == 3
        assert len(_events(env, "ForeignAutoscaler")) == 1, "one Event, not one per round"
        reconciled = next(c for c in env.get("LLMDeployment", NAMESPACE, "llama")["status"]["conditions"]
                          if c["type"] == "Reconciled")
        assert reconciled["status"] == "True", "KEDA not installed (404 for ScaledObjects) is no failure"
        # The HPA goes: kvpilot's autoscaler takes over again and scales 3 -> 1 (3 -> 2 -> 1: the
        # two pods that do not exist count at the target on the way down).
        resp = await env.k.delete(kube.resource_path("autoscaling/v2", "horizontalpodautoscalers", NAMESPACE,
                                                     "llama-cpu"))
        assert resp.status == 200
        await env.wait_for(lambda: (_scaling(env) or ("",))[0] == "True", timeout=10)
        await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "llama")["spec"]["replicas"] == 1, timeout=10)
    finally:
        await pods.close()


async def test_scaled_object_on_the_cr_makes_spec_replicas_rule(operator_env):
    env = operator_env
    declare_resources(env.k, with_keda=True)
    await env.start()
    await env.create_cr(make_cr("llama", AUTOSCALED))
    await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "llama"))
    ref = {"apiVersion": "serving.kvpilot.io/v1alpha1", "kind": "LLMDeployment", "name": "llama"}
    await _post(env, "keda.sh/v1alpha1", "scaledobjects", scaled_object("llama-so", ref))
    # KEDA acts through an HPA of its own, owned by the ScaledObject.
    await _post(env, "autoscaling/v2", "horizontalpodautoscalers",
                hpa("keda-hpa-llama-so", "LLMDeployment", "serving.kvpilot.io/v1alpha1", owner="llama-so"))
    cond = await env.wait_for(lambda: (c := _scaling(env)) and c[1] == "ForeignAutoscaler" and c, timeout=DETECT_BOUND_S)
    assert "ScaledObject ml/llama-so (scaleTargetRef LLMDeployment)" in cond[2] and "keda-hpa" not in cond[2]
    # KEDA writes spec.replicas through the scale subresource: it reaches the Deployment.
    await env.patch("LLMDeployment", NAMESPACE, "llama", {"spec": {"replicas": 3}})
    await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "llama")["spec"]["replicas"] == 3, timeout=5)
    await asyncio.sleep(1.5)  # an autoscaler round: it stands by
    await env.settle(quiet=0.5)
    assert env.get("Deployment", NAMESPACE, "llama")["spec"]["replicas"] == 3
