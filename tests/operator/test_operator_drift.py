"""Drift repair: the real operator against kmock's emulator puts back what a hand deleted or edited.

Bounds: every repair below must land within DRIFT_BOUND_S of the edit (kopf watches the children;
the repair is one event away, measured well under a second here).
"""

from __future__ import annotations

import time

import pytest

from kvpilot.operator.apply import resource_path
from kvpilot.operator.render import render
from support.operator_harness import NAMESPACE, make_cr, operator_env  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(60)

DRIFT_BOUND_S = 3.0
PATHS = {"Deployment": ("apps/v1", "deployments"), "Service": ("v1", "services"),
         "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets")}


async def _started(env, name="llama", spec=None):
    await env.start()
    await env.create_cr(make_cr(name, spec))
    for kind in PATHS:
        await env.wait_for(lambda kind=kind: env.get(kind, NAMESPACE, name))
    await env.settle(quiet=0.5)
    return {o["kind"]: o for o in render(make_cr(name, spec))}


async def _timed(env, predicate) -> float:
    start = time.monotonic()
    await env.wait_for(predicate, timeout=DRIFT_BOUND_S + 2)
    elapsed = time.monotonic() - start
    print(f"repaired in {elapsed:.2f} s")
    assert elapsed < DRIFT_BOUND_S, f"repaired in {elapsed:.2f} s"
    return elapsed


@pytest.mark.parametrize("kind", sorted(PATHS))
async def test_deleted_child_is_recreated_within_bound(operator_env, kind):
    env = operator_env
    expected = await _started(env)
    api_version, plural = PATHS[kind]
    resp = await env.k.delete(resource_path(api_version, plural, NAMESPACE, "llama"))
    assert resp.status == 200, await resp.text()
    assert env.get(kind, NAMESPACE, "llama") is None
    await _timed(env, lambda: env.get(kind, NAMESPACE, "llama"))
    live = env.get(kind, NAMESPACE, "llama")
    assert live["spec"] == expected[kind]["spec"]
    assert live["metadata"]["ownerReferences"][0]["uid"] == "uid-llama"


async def test_hand_edits_to_replicas_and_image_are_reverted_within_bound(operator_env):
    env = operator_env
    expected = await _started(env)
    image = expected["Deployment"]["spec"]["template"]["spec"]["containers"][0]["image"]
    await env.patch("Deployment", NAMESPACE, "llama", {"spec": {"replicas": 5}})
    await _timed(env, lambda: env.get("Deployment", NAMESPACE, "llama")["spec"]["replicas"] == 1)
    dep = env.get("Deployment", NAMESPACE, "llama")
    containers = dep["spec"]["template"]["spec"]["containers"]
    containers[0]["image"] = "evil/image:latest"
    await env.patch("Deployment", NAMESPACE, "llama", {"spec": {"template": {"spec": {"containers": containers}}}})
    await _timed(env, lambda: env.get("Deployment", NAMESPACE, "llama")["spec"]["template"]["spec"]
                 ["containers"][0]["image"] == image)
    assert env.get("Deployment", NAMESPACE, "llama")["spec"] == expected["Deployment"]["spec"]


async def test_extra_service_selector_key_is_removed_also_after_restart(operator_env):
    env = operator_env
    expected = await _started(env)
    selector = expected["Service"]["spec"]["selector"]
    await env.patch("Service", NAMESPACE, "llama", {"spec": {"selector": {"tier": "gold"}}})
    await _timed(env, lambda: env.get("Service", NAMESPACE, "llama")["spec"]["selector"] == selector)
    # While the operator is down, the key is added again: the restarted operator removes it.
    await env.stop()
    await env.patch("Service", NAMESPACE, "llama", {"spec": {"selector": {"tier": "gold"}}})
    await env.patch("PodDisruptionBudget", NAMESPACE, "llama", {"spec": {"selector": {"matchLabels": {"x": "y"}}}})
    await env.start()
    await env.settle(quiet=0.5)
    await _timed(env, lambda: env.get("Service", NAMESPACE, "llama")["spec"]["selector"] == selector)
    await env.wait_for(lambda: env.get("PodDisruptionBudget", NAMESPACE, "llama")["spec"]
                       == expected["PodDisruptionBudget"]["spec"], timeout=DRIFT_BOUND_S)
