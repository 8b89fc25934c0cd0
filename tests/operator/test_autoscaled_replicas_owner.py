"""The autoscaler alone owns an autoscaled workload's ``spec.replicas``: reconcile (also from a
stale kopf body) and drift repair set it only when they create the workload, and never write it
back afterwards; with autoscaling off, ``spec.replicas`` rules again.

Pure parts run ``apply`` and the real ``reconcile`` handler against an in-memory API; the drift
part runs the operator against kmock's emulator.
"""

from __future__ import annotations

import asyncio
import copy
import logging

import kopf
from kvpilot.operator import apply as kube
from kvpilot.operator import handlers
from kvpilot.operator.render import render
from support.operator_harness import NAMESPACE, make_cr, operator_env  # noqa: F401  (fixture)
from test_apply import FakeApi, cr

AUTO = {"enabled": True, "minReplicas": 1, "maxReplicas": 6}


def test_create_sets_replicas_then_patches_leave_them():
    api = FakeApi()
    dep = render(cr(autoscaling=AUTO))[0]
    assert kube.apply(api, dep, leave=kube.REPLICAS).action == "created"
    assert api.get("Deployment", "ml", "m")["spec"]["replicas"] == 1
    api.objects[("Deployment", "ml", "m")]["spec"]["replicas"] = 5  # the autoscaler's write
    assert kube.in_sync(dep, api.get("Deployment", "ml", "m"), kube.REPLICAS)
    assert kube.apply(api, dep, leave=kube.REPLICAS).action == "unchanged"
    changed = render(cr(autoscaling=AUTO, image="kvpilot/engine:2"))[0]
    writes = len(api.writes)
    assert kube.apply(api, changed, leave=kube.REPLICAS).action == "patched"
    live = api.get("Deployment", "ml", "m")
    assert live["spec"]["replicas"] == 5 and live["spec"]["template"] == changed["spec"]["template"]
    assert len(api.writes) == writes + 1


def test_switching_autoscaling_on_does_not_remove_replicas_and_off_restores_spec():
    api = FakeApi()
    kube.apply(api, render(cr(replicas=2))[0])  # autoscaling off: replicas owned, in last-applied
    api.objects[("Deployment", "ml", "m")]["spec"]["replicas"] = 4  # the autoscaler, once on
    on = render(cr(replicas=2, autoscaling=AUTO))[0]
    kube.apply(api, on, leave=kube.REPLICAS)  # a merge patch with "replicas": null would reset it to 1
    assert api.get("Deployment", "ml", "m")["spec"]["replicas"] == 4
    off = render(cr(replicas=2))[0]
    assert kube.apply(api, off).action == "patched"
    assert api.get("Deployment", "ml", "m")["spec"]["replicas"] == 2


class ReconcileApi(FakeApi):
    """FakeApi plus the lists (for foreign autoscalers) and Event POSTs reconcile makes."""

    def list(self, kind, ns, labels):
        return [copy.deepcopy(o) for (k, n, _), o in self.objects.items() if k == kind and n == ns]

    def request(self, method, path, body=None, **_):
        self.writes.append(f"{method} {path}")


def _stored_cr(desired: int, image: str = "kvpilot/engine:1") -> dict:
    obj = cr(autoscaling=AUTO, image=image)
    obj["status"] = {"desiredReplicas": desired}
    return obj


def _reconcile(api, body):
    handlers.reconcile(body=copy.deepcopy(body), memo=kopf.Memo(kube=api), logger=logging.getLogger("test"))


def test_reconcile_from_a_stale_body_keeps_the_autoscalers_replicas():
    api = ReconcileApi()
    api.objects[("LLMDeployment", "ml", "m")] = _stored_cr(1)
    _reconcile(api, _stored_cr(1))
    # The autoscaler decides 3: status first, then the workload.
    api.objects[("LLMDeployment", "ml", "m")]["status"]["desiredReplicas"] = 3
    api.objects[("Deployment", "ml", "m")]["spec"]["replicas"] = 3
    # A spec change whose body kopf read before that decision.
    stale = _stored_cr(1, image="kvpilot/engine:2")
    api.objects[("LLMDeployment", "ml", "m")]["spec"]["image"] = "kvpilot/engine:2"
    _reconcile(api, stale)
    dep = api.get("Deployment", "ml", "m")
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "kvpilot/engine:2"
    assert dep["spec"]["replicas"] == 3


def test_reconcile_creates_a_missing_workload_from_the_fresh_decision():
    api = ReconcileApi()
    api.objects[("LLMDeployment", "ml", "m")] = _stored_cr(4)
    _reconcile(api, _stored_cr(2))  # the body still says 2
    assert api.get("Deployment", "ml", "m")["spec"]["replicas"] == 4
    assert api.get("LLMDeployment", "ml", "m")["status"]["desiredReplicas"] == 4  # not written back by reconcile


def _reconciled(env) -> bool:
    conditions = ((env.get("LLMDeployment", NAMESPACE, "llama") or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Reconciled" and c["status"] == "True" for c in conditions)


async def test_drift_repair_leaves_autoscaled_replicas_to_the_autoscaler(operator_env):
    """With autoscaling on (and no pod answering, so the autoscaler keeps what it finds, as the
    HPA does without metrics) a replica count set on the Deployment stays through drift repair
    and a spec change. (With autoscaling off it is reverted: test_operator_drift.py.)"""
    env = operator_env
    spec = {"model": {"name": "org/m"}, "replicas": 1, "autoscaling": {**AUTO, "scrapeIntervalSeconds": 1}}
    await env.start()
    await env.create_cr(make_cr("llama", spec))
    await env.wait_for(lambda: _reconciled(env))
    await env.patch("Deployment", NAMESPACE, "llama", {"spec": {"replicas": 3}})
    await env.patch("LLMDeployment", NAMESPACE, "llama", {"spec": {"image": "kvpilot/engine:2"}})
    await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "llama")["spec"]["template"]["spec"]
                       ["containers"][0]["image"] == "kvpilot/engine:2", timeout=5)
    await asyncio.sleep(1.5)  # an autoscaler round and any drift repair
    await env.settle(quiet=0.5)  # let the last reconcile finish before the operator stops
    assert env.get("Deployment", NAMESPACE, "llama")["spec"]["replicas"] == 3
