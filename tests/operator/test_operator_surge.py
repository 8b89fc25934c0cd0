"""Crossing the one-node boundary is a surge, not an outage: the real operator against kmock's
emulator, with the test playing the workload controllers (it marks workloads Ready).

The Service is sampled every 20 ms: it must select, at every sample, the serving pods of a
workload that exists and is Ready, and never the new LeaderWorkerSet's workers.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kvpilot.operator.render import LWS_WORKER_INDEX_LABEL, WORKLOAD_LABEL
from support.operator_harness import NAMESPACE, make_cr, operator_env  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(60)

READY = {"status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}}


def _served_by(selector: dict) -> str:
    if selector.get(LWS_WORKER_INDEX_LABEL) == "0":
        return "LeaderWorkerSet"
    return "Deployment" if selector.get(WORKLOAD_LABEL) in (None, "Deployment") else "?"


async def _sample(env, samples: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        svc = env.get("Service", NAMESPACE, "big")
        dep, lws = env.get("Deployment", NAMESPACE, "big"), env.get("LeaderWorkerSet", NAMESPACE, "big")
        samples.append((time.monotonic(), svc and svc["spec"]["selector"], dep, lws))
        await asyncio.sleep(0.02)


def _ready(obj) -> bool:
    return bool(obj) and (obj.get("status") or {}).get("readyReplicas", 0) >= 1


async def test_tp8_to_two_nodes_surges_with_the_service_never_empty(operator_env):
    env = operator_env
    await env.start()
    await env.create_cr(make_cr("big", {"model": {"name": "pvc://weights/llama-405b"}, "parallelism": {"tensor": 8}}))
    await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "big") and env.get("Service", NAMESPACE, "big"))
    await env.patch("Deployment", NAMESPACE, "big", READY, subresource="status")
    await env.settle(quiet=0.5)

    samples: list = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample(env, samples, stop))
    await env.patch("LLMDeployment", NAMESPACE, "big", {"spec": {"parallelism": {"pipeline": 2}}})
    await env.wait_for(lambda: env.get("LeaderWorkerSet", NAMESPACE, "big"))
    await asyncio.sleep(1.5)  # the LWS is starting: the Deployment keeps serving
    assert env.get("Deployment", NAMESPACE, "big") is not None
    svc = env.get("Service", NAMESPACE, "big")["spec"]["selector"]
    assert svc[WORKLOAD_LABEL] == "Deployment" and LWS_WORKER_INDEX_LABEL not in svc
    cr = env.get("LLMDeployment", NAMESPACE, "big")
    progressing = next(c for c in cr["status"]["conditions"] if c["type"] == "Progressing")
    assert progressing["reason"] == "Surging"

    ready_at = time.monotonic()
    await env.patch("LeaderWorkerSet", NAMESPACE, "big", READY, subresource="status")
    await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "big") is None, timeout=5)
    moved = time.monotonic() - ready_at
    await asyncio.sleep(0.2)
    stop.set()
    await sampler
    print(f"Service moved and the Deployment went {moved:.2f} s after the LeaderWorkerSet was Ready")
    assert moved < 2.0

    # At every sample the Service selected the serving pods of an existing, Ready workload.
    for t, selector, dep, lws in samples:
        assert selector is not None, "the Service disappeared"
        kind = _served_by(selector)
        assert kind in ("Deployment", "LeaderWorkerSet"), selector
        assert _ready(dep if kind == "Deployment" else lws), (t, kind, selector)
    # In that order: the Service moved first, then the Deployment was deleted.
    first_lws = next(i for i, s in enumerate(samples) if _served_by(s[1]) == "LeaderWorkerSet")
    assert samples[first_lws][2] is not None or samples[first_lws - 1][2] is not None
    assert env.get("Service", NAMESPACE, "big")["spec"]["selector"][LWS_WORKER_INDEX_LABEL] == "0"


async def test_back_to_one_node_surges_too(operator_env):
    env = operator_env
    await env.start()
    await env.create_cr(make_cr("big", {"model": {"name": "pvc://weights/llama-405b"},
                                        "parallelism": {"tensor": 8, "pipeline": 2}}))
    await env.wait_for(lambda: env.get("LeaderWorkerSet", NAMESPACE, "big"))
    await env.patch("LeaderWorkerSet", NAMESPACE, "big", READY, subresource="status")
    await env.settle(quiet=0.5)
    await env.patch("LLMDeployment", NAMESPACE, "big", {"spec": {"parallelism": {"pipeline": 1}}})
    await env.wait_for(lambda: env.get("Deployment", NAMESPACE, "big"))
    await asyncio.sleep(1.0)
    assert env.get("LeaderWorkerSet", NAMESPACE, "big") is not None
    assert env.get("Service", NAMESPACE, "big")["spec"]["selector"][LWS_WORKER_INDEX_LABEL] == "0"
    await env.patch("Deployment", NAMESPACE, "big", READY, subresource="status")
    await env.wait_for(lambda: env.get("LeaderWorkerSet", NAMESPACE, "big") is None, timeout=5)
    assert LWS_WORKER_INDEX_LABEL not in env.get("Service", NAMESPACE, "big")["spec"]["selector"]
