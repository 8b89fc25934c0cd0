"""Failover after an operator crash: a standby takes over once the dead replica's peering record
is older than its lifetime, and kvpilot declares a short one (OperatorConfig.peering_lifetime_s)."""

from __future__ import annotations

import asyncio
import datetime
import time

import kmock
import pytest

from kvpilot.operator.config import OperatorConfig
from support.operator_harness import NAMESPACE, make_cr, operator_env  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(60)


async def test_standby_takes_over_from_a_crashed_replica_within_its_lifetime(operator_env):
    env = operator_env
    lifetime = 3
    now = datetime.datetime.now(datetime.timezone.utc).isoformat()
    # The active replica crashed right now: its record stays, it never says goodbye.
    peering = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "kvpilot"},
               "status": {"crashed-replica": {"priority": 100, "lifetime": lifetime, "lastseen": now}}}
    resp = await env.k.post("/apis/kopf.dev/v1/clusterkopfpeerings", json=peering)
    assert resp.status == 200
    start = time.monotonic()
    await env.start(peering="kvpilot", priority=1, wait_watching=False, config=OperatorConfig(peering_lifetime_s=5))
    await env.create_cr(make_cr("llama"))
    await asyncio.sleep(1.0)
    assert env.get("Deployment", NAMESPACE, "llama") is None, "the crashed replica's record is still fresh"
    await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "llama"), timeout=lifetime + 10)
    elapsed = time.monotonic() - start
    print(f"took over {elapsed:.1f} s after the crash (lifetime {lifetime} s)")
    assert elapsed < lifetime + 5
    # This replica's own record declares the configured lifetime: its failover bound.
    key = (kmock.resource("kopf.dev/v1/clusterkopfpeerings"), None, "kvpilot")
    record = env.k.objects[key].raw
    mine = [v for k, v in (record.get("status") or {}).items() if k != "crashed-replica" and isinstance(v, dict)]
    assert mine and mine[0]["lifetime"] == 5
