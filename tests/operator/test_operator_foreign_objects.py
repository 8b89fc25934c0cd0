"""The operator never takes over an object it does not own: a Deployment or Service named like the
LLMDeployment but created by another tool is left exactly as it was, and the CR says so (condition
``Reconciled=False``, reason ``NameTaken``) with a Warning Event. The real operator runs against
kmock's emulator."""

from __future__ import annotations

import asyncio
import copy

import kmock
import pytest

from kvpilot.operator.apply import resource_path
from kvpilot.operator.config import OperatorConfig
from support.operator_harness import NAMESPACE, make_cr, operator_env  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(60)

CONFIG = OperatorConfig(retry_base_s=0.2, retry_max_s=1.0)

FOREIGN_DEPLOYMENT = {
    "apiVersion": "apps/v1", "kind": "Deployment",
    "metadata": {"name": "llama", "namespace": NAMESPACE, "labels": {"app": "legacy"},
                 "annotations": {"deployment.kubernetes.io/revision": "3"}},
    "spec": {"replicas": 5, "selector": {"matchLabels": {"app": "legacy"}},
             "template": {"metadata": {"labels": {"app": "legacy"}},
                          "spec": {"containers": [{"name": "web", "image": "nginx:1.27"}]}}},
}
FOREIGN_SERVICE = {
    "apiVersion": "v1", "kind": "Service",
    "metadata": {"name": "llama", "namespace": NAMESPACE, "labels": {"app": "legacy"}},
    "spec": {"selector": {"app": "legacy"}, "ports": [{"port": 80, "targetPort": 8080}]},
}


def _condition(env):
    cr = env.get("LLMDeployment", NAMESPACE, "llama") or {}
    return next(((c["status"], c["reason"], c.get("message", "")) for c in (cr.get("status") or {}).get("conditions") or []
                 if c["type"] == "Reconciled"), None)


def _events(env):
    key = kmock.resource("v1/events")
    return [o.raw for (res, _ns, _name), o in env.k.objects.items() if res == key and not o.deleted]


def _unchanged(live: dict, original: dict) -> None:
    assert live["spec"] == original["spec"]
    assert (live["metadata"].get("labels") or {}) == original["metadata"]["labels"]
    assert not live["metadata"].get("ownerReferences")
    assert "serving.kvpilot.io/last-applied" not in (live["metadata"].get("annotations") or {})


@pytest.mark.parametrize("foreign,plural", [(FOREIGN_DEPLOYMENT, "apps/v1/deployments"),
                                            (FOREIGN_SERVICE, "v1/services")], ids=["deployment", "service"])
async def test_foreign_object_is_refused_and_left_as_it_was(operator_env, foreign, plural):
    env = operator_env
    api_version, res = plural.rsplit("/", 1)
    resp = await env.k.post(resource_path(api_version, res, NAMESPACE), json=copy.deepcopy(foreign))
    assert resp.status == 200
    await env.start(config=CONFIG)
    await env.create_cr(make_cr("llama"))
    cond = await env.wait_for(lambda: (c := _condition(env)) and c[0] == "False" and c, timeout=10)
    assert cond[1] == "NameTaken", cond
    assert f"{foreign['kind']} {NAMESPACE}/llama already exists and was not created by kvpilot" in cond[2]
    events = await env.wait_for(lambda: [e for e in _events(env) if e["reason"] == "NameTaken"], timeout=5)
    assert events[0]["type"] == "Warning" and events[0]["involvedObject"]["name"] == "llama"
    # Retries (several, with the short schedule) never write it either.
    await asyncio.sleep(1.5)
    _unchanged(env.get(foreign["kind"], NAMESPACE, "llama"), foreign)
    assert len([e for e in _events(env) if e["reason"] == "NameTaken"]) == 1  # one Event per distinct failure


async def test_own_children_are_still_repaired(operator_env):
    env = operator_env
    await env.start(config=CONFIG)
    await env.create_cr(make_cr("llama"))
    dep = await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "llama"), timeout=10)
    assert dep["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"
    cond = await env.wait_for(lambda: (c := _condition(env)) and c[0] == "True" and c, timeout=10)
    assert cond[1] == "Applied"
