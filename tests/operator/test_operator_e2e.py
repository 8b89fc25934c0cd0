"""The real operator, run by kopf, against kmock's Kubernetes emulator on localhost."""

from __future__ import annotations

import asyncio
import datetime

import pytest

from kvpilot.operator.render import render
from support.operator_harness import NAMESPACE, make_cr, operator_env  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(60)

OWNER = {"apiVersion": "serving.kvpilot.io/v1alpha1", "kind": "LLMDeployment", "name": "llama",
         "uid": "uid-llama", "controller": True, "blockOwnerDeletion": True}
CHILDREN = ("Deployment", "Service", "PodDisruptionBudget")


def _conditions(cr):
    return {c["type"]: (c["status"], c["reason"]) for c in (cr.get("status") or {}).get("conditions") or []}


async def _settle(env, quiet: float = 1.5, timeout: float = 15.0) -> None:
    """Wait until no request at all has reached the emulator for ``quiet`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    count, since = env.request_count(), loop.time()
    while loop.time() - since < quiet:
        await asyncio.sleep(0.1)
        if env.request_count() != count:
            count, since = env.request_count(), loop.time()
        assert loop.time() < deadline, "the operator never went quiet"


async def test_create_update_restart_and_quiet(operator_env):
    env = operator_env
    await env.start()
    await env.create_cr(make_cr("llama"))

    # Creation: the three children, each with the controller ownerReference and exactly the
    # rendered spec, and a status that says "not ready yet".
    for kind in CHILDREN:
        await env.wait_for(lambda kind=kind: env.get(kind, NAMESPACE, "llama"))
    # The reconcile's own status write (with Reconciled) may follow a child event's.
    cr = await env.wait_for(lambda: "Reconciled" in _conditions(env.get("LLMDeployment", NAMESPACE, "llama") or {})
                            and env.get("LLMDeployment", NAMESPACE, "llama"))
    expected = {o["kind"]: o for o in render(make_cr("llama"))}
    for kind in CHILDREN:
        live = env.get(kind, NAMESPACE, "llama")
        assert live["metadata"]["ownerReferences"] == [OWNER]
        assert live["spec"] == expected[kind]["spec"]
        assert live["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kvpilot-operator"
    assert cr["status"]["endpoint"] == "http://llama.ml.svc:8000/v1"
    assert cr["status"]["selector"] == "app.kubernetes.io/component=engine,app.kubernetes.io/instance=llama,app.kubernetes.io/name=kvpilot"
    assert cr["status"]["desiredReplicas"] == 1 and cr["status"]["parallelism"] == "1x1"
    assert _conditions(cr) == {"Ready": ("False", "ReplicasNotReady"), "Progressing": ("True", "Scaling"),
                               "Degraded": ("False", "AsExpected"), "Reconciled": ("True", "Applied")}
    assert cr["spec"] == make_cr("llama")["spec"], "the operator must never write the spec"

    # Readiness of the child flows into the CR's status.
    await env.patch("Deployment", NAMESPACE, "llama",
                    {"status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}}, subresource="status")
    cr = await env.wait_for(lambda: _conditions(env.get("LLMDeployment", NAMESPACE, "llama"))["Ready"][0] == "True"
                            and env.get("LLMDeployment", NAMESPACE, "llama"))
    assert _conditions(cr) == {"Ready": ("True", "ReplicasReady"), "Progressing": ("False", "Settled"),
                               "Degraded": ("False", "AsExpected"), "Reconciled": ("True", "Applied")}
    assert cr["status"]["readyReplicas"] == 1

    # Settled: no writes at all.
    await _settle(env)
    mark = env.request_count()
    await asyncio.sleep(2.0)
    assert env.writes(mark) == []

    # Changing parallelism re-renders the Deployment: 4 GPUs, --tensor-parallel-size 4.
    await env.patch("LLMDeployment", NAMESPACE, "llama", {"spec": {"parallelism": {"tensor": 4}}})
    dep = await env.wait_for(lambda: (d := env.get("Deployment", NAMESPACE, "llama"))
                             and d["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
                             and d)
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    updated = make_cr("llama", {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "parallelism": {"tensor": 4}})
    assert dep["spec"] == render(updated)[0]["spec"]
    await env.wait_for(lambda: env.get("LLMDeployment", NAMESPACE, "llama")["status"]["parallelism"] == "4x1")
    await _settle(env)

    # A restarted operator resumes, finds everything in place, and creates nothing.
    mark = env.request_count()
    await env.restart()
    await _settle(env)
    writes = env.writes(mark)
    assert not [w for w in writes if not w.startswith("PATCH /apis/serving.kvpilot.io/")], writes
    assert not [w for w in writes if w.startswith("POST")], writes
    for kind in CHILDREN:
        assert env.get(kind, NAMESPACE, "llama") is not None
    assert env.get("Deployment", NAMESPACE, "llama")["spec"] == dep["spec"]

    # ... and once settled again, it stays silent.
    mark = env.request_count()
    await asyncio.sleep(2.0)
    assert env.writes(mark) == []


async def test_growing_past_one_node_swaps_deployment_for_leader_worker_set(operator_env):
    env = operator_env
    await env.start()
    await env.create_cr(make_cr("big", {"model": {"name": "pvc://weights/llama-405b"}, "parallelism": {"tensor": 8}}))
    await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "big"))
    await env.patch("LLMDeployment", NAMESPACE, "big", {"spec": {"parallelism": {"pipeline": 2}}})
    lws = await env.wait_for(lambda: env.get("LeaderWorkerSet", NAMESPACE, "big"))
    # A surge: the Deployment goes only once the LeaderWorkerSet is Ready.
    await env.patch("LeaderWorkerSet", NAMESPACE, "big",
                    {"status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}}, subresource="status")
    await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "big") is None)
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert lws["metadata"]["ownerReferences"][0]["uid"] == "uid-big"
    svc = await env.wait_for(lambda: (s := env.get("Service", NAMESPACE, "big"))
                             and "leaderworkerset.sigs.k8s.io/worker-index" in s["spec"]["selector"] and s)
    assert svc["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    cr = await env.wait_for(lambda: (c := env.get("LLMDeployment", NAMESPACE, "big"))
                            and c["status"].get("workload") == "LeaderWorkerSet" and c)
    assert cr["status"]["parallelism"] == "8x2"
    assert cr["status"]["selector"].endswith(",leaderworkerset.sigs.k8s.io/worker-index=0")
    # LWS readiness flows into the status just like a Deployment's.
    await env.patch("LeaderWorkerSet", NAMESPACE, "big",
                    {"status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}}, subresource="status")
    await env.wait_for(lambda: _conditions(env.get("LLMDeployment", NAMESPACE, "big"))["Ready"] == ("True", "ReplicasReady"))


async def test_peering_pauses_for_a_higher_priority_replica(operator_env):
    env = operator_env
    now = datetime.datetime.now(datetime.timezone.utc).isoformat()
    peering = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "kvpilot"},
               "status": {"other-replica": {"priority": 100, "lifetime": 60, "lastseen": now}}}
    resp = await env.k.post("/apis/kopf.dev/v1/clusterkopfpeerings", json=peering)
    assert resp.status == 200
    await env.start(peering="kvpilot", priority=1, wait_watching=False)
    await env.create_cr(make_cr("llama"))
    await asyncio.sleep(2.0)
    assert env.get("Deployment", NAMESPACE, "llama") is None, "a lower-priority replica must not act"
    # The other replica goes away (its keep-alive entry is removed): this one takes over.
    resp = await env.k.patch("/apis/kopf.dev/v1/clusterkopfpeerings/kvpilot", json={"status": {"other-replica": None}},
                             headers={"Content-Type": "application/merge-patch+json"})
    assert resp.status == 200
    await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "llama"), timeout=15)


async def test_kube_client_filters_listed_pods_by_labels_itself(operator_env):
    """kmock ignores labelSelector; KubeClient.list must still return only matching pods."""
    from kvpilot.operator.apply import KubeClient

    env = operator_env
    for name, instance in (("a-0", "a"), ("a-1", "a"), ("b-0", "b")):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE,
                                                               "labels": {"app.kubernetes.io/instance": instance}}}
        resp = await env.k.post(f"/api/v1/namespaces/{NAMESPACE}/pods", json=pod)
        assert resp.status == 200
    client = KubeClient.from_environment()
    try:
        pods = await asyncio.to_thread(client.list, "Pod", NAMESPACE, {"app.kubernetes.io/instance": "a"})
    finally:
        client.close()
    assert sorted(p["metadata"]["name"] for p in pods) == ["a-0", "a-1"]
    listed = [r for r in env.k if r.method.value == "GET" and r.url.path.endswith("/pods")]
    assert listed[-1].url.query["labelSelector"] == "app.kubernetes.io/instance=a"
