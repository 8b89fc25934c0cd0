"""Failures are visible and retried fast: the real operator against kmock's emulator with injected
API errors (500s, a conflict, an outage) and a child name taken by another owner.

The operator runs with a short retry schedule (OperatorConfig: 0.2 s doubling to 2 s, with jitter);
each test bounds the time to recover.
"""

from __future__ import annotations

import asyncio
import time

import kmock
import pytest

from kvpilot.operator.apply import resource_path
from kvpilot.operator.config import OperatorConfig
from support.operator_harness import NAMESPACE, make_cr, operator_env  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(60)

CONFIG = OperatorConfig(retry_base_s=0.2, retry_max_s=2.0)
OUTAGE_S = 10.0
DEPLOYMENT = resource_path("apps/v1", "deployments", NAMESPACE, "llama")


def _condition(env, type_="Reconciled"):
    cr = env.get("LLMDeployment", NAMESPACE, "llama") or {}
    return next(((c["status"], c["reason"], c.get("message", "")) for c in (cr.get("status") or {}).get("conditions") or []
                 if c["type"] == type_), None)


def _events(env):
    key = kmock.resource("v1/events")
    return [o.raw for (res, _ns, _name), o in env.k.objects.items() if res == key and not o.deleted]


async def _watch_conditions(env, seen: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        cond = _condition(env)
        if cond and (not seen or seen[-1] != cond):
            seen.append(cond)
        await asyncio.sleep(0.02)


def test_retry_delay_is_exponential_with_jitter_and_capped():
    import random

    config = OperatorConfig(retry_base_s=1.0, retry_max_s=8.0, retry_jitter=0.5)
    rng = random.Random(0)
    for attempt, ceiling in enumerate([1, 2, 4, 8, 8, 8]):
        delays = [config.retry_delay(attempt, rng) for _ in range(200)]
        assert all(ceiling * 0.5 <= d <= ceiling for d in delays)
        assert max(delays) - min(delays) > 0.3 * ceiling  # jittered, not fixed
    with pytest.raises(ValueError, match="retry_max_s"):
        OperatorConfig(retry_base_s=2.0, retry_max_s=1.0)


async def test_two_server_errors_delay_creation_by_backoff_not_a_minute(operator_env):
    env = operator_env
    env.k[f"get {DEPLOYMENT}"][:2] << 500 << {"kind": "Status", "code": 500, "message": "etcd is sad"}
    await env.start(config=CONFIG)
    seen: list = []
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch_conditions(env, seen, stop))
    start = time.monotonic()
    await env.create_cr(make_cr("llama"))
    await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "llama"), timeout=10)
    elapsed = time.monotonic() - start
    await env.wait_for(lambda: (_condition(env) or ("",))[0] == "True", timeout=5)
    stop.set()
    await watcher
    seen.append(_condition(env))
    print(f"created after two 500s in {elapsed:.2f} s")
    assert elapsed < 3.0
    # The failure was visible while it lasted: a condition with the reason, and a Warning Event.
    assert seen[0][:2] == ("False", "APIError") and "500" in seen[0][2], seen
    assert seen[-1][:2] == ("True", "Applied")
    warnings = [e for e in _events(env) if e["type"] == "Warning" and e["reason"] == "APIError"]
    assert warnings and warnings[0]["involvedObject"]["name"] == "llama"
    assert len(warnings) == 1, "one Event per distinct failure, not one per retry"


async def test_conflict_on_patch_is_retried(operator_env):
    env = operator_env
    await env.start(config=CONFIG)
    await env.create_cr(make_cr("llama"))
    await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "llama"))
    await env.settle(quiet=0.5)
    env.k[f"patch {DEPLOYMENT}"][:1] << 409 << {"kind": "Status", "code": 409, "reason": "Conflict"}
    start = time.monotonic()
    await env.patch("LLMDeployment", NAMESPACE, "llama", {"spec": {"parallelism": {"tensor": 2}}})
    await env.wait_for(lambda: "--tensor-parallel-size" in (a := env.get("Deployment", NAMESPACE, "llama")["spec"]
                       ["template"]["spec"]["containers"][0]["args"]) and a[a.index("--tensor-parallel-size") + 1] == "2",
                       timeout=10)
    elapsed = time.monotonic() - start
    print(f"conflict recovered in {elapsed:.2f} s")
    assert elapsed < 3.0


async def test_api_outage_recovers_within_bound(operator_env):
    env = operator_env
    await env.start(config=CONFIG)
    await env.create_cr(make_cr("llama"))
    await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "llama"))
    await env.settle(quiet=0.5)
    # Every request of the operator (it sends a bearer token; the test's own requests do not) fails.
    outage = env.k[kmock.headers({"Authorization": "Bearer kmock"})] << 503 \
        << {"kind": "Status", "code": 503, "message": "apiserver down"}
    await env.patch("LLMDeployment", NAMESPACE, "llama", {"spec": {"replicas": 3}})
    await asyncio.sleep(OUTAGE_S)  # the 10 s outage
    assert env.get("Deployment", NAMESPACE, "llama")["spec"]["replicas"] == 1
    outage._disabled.set()
    end = time.monotonic()
    await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "llama")["spec"]["replicas"] == 3, timeout=10)
    elapsed = time.monotonic() - end
    print(f"recovered {elapsed:.2f} s after a {OUTAGE_S:g} s outage")
    assert elapsed < CONFIG.retry_max_s + 2.0


async def test_name_taken_by_another_owner_is_reported(operator_env):
    env = operator_env
    foreign = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "llama", "namespace": NAMESPACE,
                            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "other",
                                                 "uid": "uid-other", "controller": True}]},
               "spec": {"selector": {"app": "other"}, "ports": [{"port": 80}]}}
    resp = await env.k.post(resource_path("v1", "services", NAMESPACE), json=foreign)
    assert resp.status == 200
    await env.start(config=CONFIG)
    await env.create_cr(make_cr("llama"))
    cond = await env.wait_for(lambda: (c := _condition(env)) and c[0] == "False" and c, timeout=5)
    assert cond[1] == "NameTaken" and "controlled by Deployment other" in cond[2]
    await env.wait_for(lambda: [e for e in _events(env) if e["reason"] == "NameTaken"], timeout=5)
    assert env.get("Service", NAMESPACE, "llama")["spec"]["selector"] == {"app": "other"}, "never taken over"
