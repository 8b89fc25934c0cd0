"""``spec.router.enabled`` adds ``kvpilot router`` in front of the engines: its Deployment and
Service (``NAME-router``) and the headless Service ``NAME-engines`` it discovers the Ready engine
pods by; the plain Service stays. Rendered objects are validated strictly; the operator on kmock's
emulator creates them, reports ``status.routerEndpoint`` and deletes them when switched off."""

from __future__ import annotations

import argparse

import pytest

from kvpilot.operator.render import render
from support.k8s_validate import validate_all
from support.operator_harness import NAMESPACE, make_cr, operator_env  # noqa: F401  (fixture)

HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"


def _objects(**router):
    spec = {"model": {"name": HUB_ID, "revision": "abc123"}, "engine": {"kvCache": {"tokensPerBlock": 16}},
            "router": {"enabled": True, **router}}
    return {(o["kind"], o["metadata"]["name"]): o for o in render(make_cr("llama", spec))}


def test_router_objects_and_their_wiring():
    objs = _objects(replicas=2, imbalance=0.25, slack=4)
    validate_all(list(objs.values()))
    assert set(objs) == {("Deployment", "llama"), ("Service", "llama"), ("PodDisruptionBudget", "llama"),
                         ("Deployment", "llama-router"), ("Service", "llama-router"), ("Service", "llama-engines")}
    engines, plain = objs[("Service", "llama-engines")], objs[("Service", "llama")]
    assert engines["spec"]["clusterIP"] == "None" and engines["spec"]["selector"] == plain["spec"]["selector"]
    router = objs[("Deployment", "llama-router")]
    assert router["spec"]["replicas"] == 2
    pod = router["spec"]["template"]
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "router"
    assert objs[("Service", "llama-router")]["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
    # Router pods are not engine pods: neither the engines' Service nor the PDB selects them.
    assert not set(plain["spec"]["selector"].items()) <= set(pod["metadata"]["labels"].items())
    args = pod["spec"]["containers"][0]["args"]
    from kvpilot.router.cli import configure_parser

    parser = argparse.ArgumentParser()
    configure_parser(parser)
    parsed = parser.parse_args(args[1:])
    assert args[0] == "router"
    assert (parsed.discover, parsed.tokens_per_block, parsed.imbalance, parsed.slack, parsed.hold_timeout) == \
        ("llama-engines.ml.svc:8000", 16, 0.25, 4.0, 60.0)
    assert (parsed.tokenizer, parsed.tokenizer_revision) == (HUB_ID, "abc123")  # the engines' model and revision


def test_without_router_nothing_extra():
    assert len(render(make_cr("llama", {"model": {"name": HUB_ID}}))) == 3


@pytest.mark.timeout(60)
async def test_operator_creates_and_removes_the_router(operator_env):
    env = operator_env
    await env.start()
    await env.create_cr(make_cr("llama", {"model": {"name": HUB_ID}, "router": {"enabled": True}}))
    await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "llama-router")
                       and env.get("Service", NAMESPACE, "llama-engines"), timeout=10)
    status = await env.wait_for(lambda: (env.get("LLMDeployment", NAMESPACE, "llama").get("status") or {})
                                .get("routerEndpoint"), timeout=5)
    assert status == "http://llama-router.ml.svc:8000/v1"
    assert env.get("Service", NAMESPACE, "llama")  # the plain Service stays
    await env.patch("LLMDeployment", NAMESPACE, "llama", {"spec": {"router": {"enabled": False}}})
    await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "llama-router") is None
                       and env.get("Service", NAMESPACE, "llama-router") is None
                       and env.get("Service", NAMESPACE, "llama-engines") is None, timeout=10)
    await env.wait_for(lambda: "routerEndpoint" not in env.get("LLMDeployment", NAMESPACE, "llama")["status"], timeout=5)
    assert env.get("Deployment", NAMESPACE, "llama") and env.get("Service", NAMESPACE, "llama")
