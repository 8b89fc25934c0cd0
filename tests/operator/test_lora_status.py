"""``status.lora``: per LoRA adapter of ``spec.lora.adapters``, the Ready replicas that serve it
(read from the Ready serving pods' ``--lora-modules`` arguments: an engine turns Ready only once it
has loaded them all). Pure parts first, then the real operator against kmock's emulator: pods
turning Ready, a pod of an older template, a pod going away."""

from __future__ import annotations

import copy

import pytest

from kvpilot.operator.apply import resource_path
from kvpilot.operator.crd import normalize
from kvpilot.operator.render import render
from kvpilot.operator.status import lora_status, pod_lora_names
from support.operator_harness import NAMESPACE, make_cr, operator_env  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(60)

LORA = {"adapters": [{"name": "sql", "source": "/models/a/sql"}, {"name": "support", "source": "acme/support-lora"}]}


def _cr(lora=LORA):
    return make_cr("llama", {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "lora": copy.deepcopy(lora)})


def _pod(cr, name, ready=True, lora=None):
    """A pod of ``cr``'s rendered template (or, with ``lora``, of a template with those adapters)."""
    src = _cr(lora) if lora is not None else cr
    tpl = render(normalize(src))[0]["spec"]["template"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": tpl["metadata"]["labels"]},
            "spec": tpl["spec"],
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_counts_ready_serving_pods_per_adapter():
    cr = normalize(_cr())
    old = {"adapters": [{"name": "sql", "source": "/models/a/sql"}, {"name": "legacy", "source": "/models/a/old"}]}
    pods = [_pod(cr, "a"), _pod(cr, "b"), _pod(cr, "c", ready=False), _pod(cr, "d", lora=old)]
    assert pod_lora_names(pods[0]) == ["sql", "support"]
    assert lora_status(cr, pods) == [{"name": "sql", "readyReplicas": 3}, {"name": "support", "readyReplicas": 2},
                                     {"name": "legacy", "readyReplicas": 1}]
    assert lora_status(cr, []) == [{"name": "sql", "readyReplicas": 0}, {"name": "support", "readyReplicas": 0}]


async def test_operator_reports_adapters_per_ready_replica(operator_env):
    env = operator_env
    await env.start()
    cr = _cr()
    await env.create_cr(cr)
    await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "llama"))

    def lora():
        return ((env.get("LLMDeployment", NAMESPACE, "llama") or {}).get("status") or {}).get("lora")

    norm = normalize(cr)
    for name, ready in (("llama-0", True), ("llama-1", False)):
        resp = await env.k.post(resource_path("v1", "pods", NAMESPACE), json=_pod(norm, name, ready))
        assert resp.status == 200
    await env.wait_for(lambda: lora() == [{"name": "sql", "readyReplicas": 1}, {"name": "support", "readyReplicas": 1}])
    one = {"adapters": [{"name": "sql", "source": "/models/a/sql"}]}
    resp = await env.k.post(resource_path("v1", "pods", NAMESPACE), json=_pod(norm, "llama-2", lora=one))
    assert resp.status == 200
    await env.wait_for(lambda: lora() == [{"name": "sql", "readyReplicas": 2}, {"name": "support", "readyReplicas": 1}])
    resp = await env.k.delete(resource_path("v1", "pods", NAMESPACE, "llama-0"))
    assert resp.status == 200
    await env.wait_for(lambda: lora() == [{"name": "sql", "readyReplicas": 1}, {"name": "support", "readyReplicas": 0}])
    assert not env.rbac_denials()
