"""Autoscaling end to end: the real operator (kopf) against kmock's Kubernetes emulator, with real
``kvpilot serve`` processes on localhost standing in for the engine pods.

The emulator runs no controllers, so the test plays the ReplicaSet: it keeps one Pod object per
Deployment replica (podIP 127.0.0.1, the ``http`` port of a free server, labelled like the pod
template), and on scale-down deletes the pods with the lowest ``pod-deletion-cost`` first.
Load is a fixed number of concurrent streams spread over the Ready pods (least in flight first),
so the sum of KV utilisation over the pods stays about the same whatever the replica count.
Measured with this setup: 7 streams of 40-120 tokens keep one 23-block pool mostly saturated
(median 0.91) and sum to 0.3-1.3 over two pods. With target 0.7 that asks for 2 replicas: 3 would
need a sum over 1.54 (2 x 0.7 plus the 10% tolerance), and the dips below 0.7 are shorter than
the scale-down window.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvpilot.operator import autoscale_daemon  # noqa: F401  (registers the daemon)
from kvpilot.operator.apply import resource_path
from kvpilot.operator.scrape import parse_metrics
from kvpilot.server.launcher import ServerProcess
from support.operator_harness import NAMESPACE, make_cr, operator_env  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(180)

INTERVAL = 1.0  # scrapeIntervalSeconds
DOWN_WINDOW = 8.0  # scaleDownStabilizationSeconds
STREAMS = 7
OVER = 0.7 * 1.1  # over target by more than the tolerance
COST = "controller.kubernetes.io/pod-deletion-cost"
SPEC = {
    "model": {"name": "stories"},
    "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetKVCacheUtilization": 0.7,
                    "scrapeIntervalSeconds": int(INTERVAL), "scaleDownStabilizationSeconds": int(DOWN_WINDOW)},
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Three ``kvpilot serve`` processes on CPU, each with a 23-block x 16-token KV pool."""
    from kvpilot.tools.convert_llama2c import ensure_stories260k

    model = ensure_stories260k()
    old = os.environ.get("KVPILOT_CPU_KVCACHE_GB")
    os.environ["KVPILOT_CPU_KVCACHE_GB"] = "0.0005"  # x 0.9 / 1280 bytes per token = 23 blocks
    logs = tmp_path_factory.mktemp("engines")
    servers = [ServerProcess(model, ["--device", "cpu", "--tokens-per-block", "16"], log_path=logs / f"s{i}.log")
               for i in range(3)]
    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(ServerProcess.start, servers))
        yield servers
    finally:
        for s in servers:
            s.stop(timeout=10)
        if old is None:
            os.environ.pop("KVPILOT_CPU_KVCACHE_GB", None)
        else:
            os.environ["KVPILOT_CPU_KVCACHE_GB"] = old


class FakeReplicaSet:
    """Keeps Pod objects in step with the Deployment's replicas, as the ReplicaSet would."""

    def __init__(self, env, servers):
        self.env, self.servers = env, servers
        self.pods: dict[str, ServerProcess] = {}
        self.deleted: list[tuple[str, dict]] = []  # (pod, its annotations at deletion)
        self.seq = 0

    def pod_names(self) -> list[str]:
        return sorted(self.pods)

    async def _create(self, labels) -> None:
        used = set(map(id, self.pods.values()))
        server = next(s for s in self.servers if id(s) not in used)
        name = f"llama-{self.seq}"
        self.seq += 1
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
            "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": server.port}]}]},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        }
        resp = await self.env.k.post(resource_path("v1", "pods", NAMESPACE), json=pod)
        assert resp.status == 200, await resp.text()
        self.pods[name] = server

    async def _delete_one(self) -> None:
        def cost(name):
            return int(((self.env.get("Pod", NAMESPACE, name) or {}).get("metadata", {}).get("annotations") or {})
                       .get(COST, 0))

        victim = min(self.pods, key=lambda n: (cost(n), n))
        annotations = (self.env.get("Pod", NAMESPACE, victim)["metadata"].get("annotations") or {})
        resp = await self.env.k.delete(resource_path("v1", "pods", NAMESPACE, victim))
        assert resp.status == 200, await resp.text()
        self.deleted.append((victim, dict(annotations)))
        del self.pods[victim]

    async def run(self) -> None:
        while True:
            dep = self.env.get("Deployment", NAMESPACE, "llama")
            if dep is not None:
                want = dep["spec"]["replicas"]
                if len(self.pods) < want:
                    await self._create(dep["spec"]["template"]["metadata"]["labels"])
                    continue
                if len(self.pods) > want:
                    await self._delete_one()
                    continue
            await asyncio.sleep(0.05)


async def load(rs: FakeReplicaSet, streams: int) -> None:
    """``streams`` concurrent completions, each sent to the Ready pod with the fewest in flight."""
    in_flight: dict[str, int] = {}
    rng = random.Random(0)  # varied lengths keep the streams from finishing in lockstep

    async def stream(client):
        while True:
            names = rs.pod_names()
            if not names:
                await asyncio.sleep(0.05)
                continue
            name = min(names, key=lambda n: (in_flight.get(n, 0), n))
            in_flight[name] = in_flight.get(name, 0) + 1
            try:
                await client.post(rs.pods[name].base_url + "/completions", timeout=60,
                                  json={"prompt": "Once upon a time", "max_tokens": rng.randint(40, 120),
                                        "ignore_eos": True})
            except (httpx.HTTPError, KeyError):
                await asyncio.sleep(0.05)
            finally:
                in_flight[name] -= 1

    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(stream(client) for _ in range(streams)))


def replicas(env) -> int:
    return env.get("Deployment", NAMESPACE, "llama")["spec"]["replicas"]


def status(env) -> dict:
    return env.get("LLMDeployment", NAMESPACE, "llama").get("status") or {}


def conditions(env) -> dict:
    return {c["type"]: (c["status"], c["reason"]) for c in status(env).get("conditions") or []}


async def watch_rise(env, server: ServerProcess, timeout: float = 30.0) -> tuple[float, float]:
    """Poll the pod's KV utilisation until the Deployment has 2+ replicas. Returns (start of the
    first run of samples over OVER lasting 1.3 s, or the rise time if none came first; the rise
    time)."""
    run_start, sustained = None, None
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as http:
        while replicas(env) < 2:
            assert time.monotonic() < deadline, "replicas never rose"
            now = time.monotonic()
            kv = parse_metrics((await http.get(server.url + "/metrics")).text, "p").kv_cache_usage
            if kv > OVER:
                run_start = now if run_start is None else run_start
                if sustained is None and now - run_start >= 1.3 * INTERVAL:
                    sustained = run_start
            else:
                run_start = None
            await asyncio.sleep(0.02)
    t_rise = time.monotonic()
    return (t_rise if sustained is None else sustained), t_rise


async def sample_replicas(env, seconds: float, also=None) -> set[int]:
    """Replica counts seen over ``seconds`` (every 50 ms); ``also()`` is called at each sample."""
    seen, end = set(), time.monotonic() + seconds
    while time.monotonic() < end:
        seen.add(replicas(env))
        if also is not None:
            also()
        await asyncio.sleep(0.05)
    return seen


async def test_autoscaling_end_to_end(operator_env, engines):
    env = operator_env
    await env.start()
    cr = make_cr("llama", SPEC)
    await env.create_cr(cr)
    rs = FakeReplicaSet(env, engines)
    rs_task = asyncio.create_task(rs.run())
    tasks = [rs_task]
    try:
        # Idle: one replica, metrics flowing, zero utilisation.
        await env.wait_for(lambda: conditions(env).get("MetricsAvailable") == ("True", "MetricsScraped"), timeout=15)
        assert await sample_replicas(env, 2 * INTERVAL) == {1}
        assert status(env)["kvCacheUtilization"] == 0.0 and status(env)["queueLength"] == 0.0

        # Load: once the pod's utilisation stays over target (for longer than one scrape round,
        # so that a scrape must have seen it), replicas rise within two scrape intervals.
        tasks.append(asyncio.create_task(load(rs, STREAMS)))
        t_load = time.monotonic()
        t_over, t_rise = await watch_rise(env, rs.pods[rs.pod_names()[0]])
        rise_s = t_rise - t_over
        assert rise_s <= 2 * INTERVAL
        assert replicas(env) == 2
        st = status(env)
        assert st["desiredReplicas"] == 2 and st["lastScaleTime"].endswith("Z")
        assert conditions(env)["ScalingActive"] == ("True", "ValidMetricFound")

        # Steady load: the count stays put.
        await env.wait_for(lambda: len(rs.pods) == 2, timeout=5)
        utils: list[float] = []
        assert await sample_replicas(env, 6 * INTERVAL, lambda: utils.append(status(env)["kvCacheUtilization"])) == {2}
        # The load stays visible in the status (one scrape may land while streams restart, so the
        # busiest scrape of the window is checked, not the last one).
        assert 0.3 < max(utils) and all(0.0 <= u <= 1.0 for u in utils)

        # Load stops: nothing comes down within the scale-down window; the operator restarts in
        # the middle and resumes the window from the status instead of starting a new one.
        tasks.pop().cancel()
        t_stop = time.monotonic()
        logging.getLogger(__name__).info("load stopped")
        await asyncio.sleep(DOWN_WINDOW / 2)
        await env.restart()
        t_back = time.monotonic()
        logging.getLogger(__name__).info("operator restarted")
        await env.wait_for(lambda: replicas(env) == 1, timeout=DOWN_WINDOW + 10 * INTERVAL)
        t_fall = time.monotonic()
        # The window may have begun one scrape before the load stopped (a scrape that lands while the
        # streams restart reads low, as above), hence two intervals of slack; without a window the
        # replica would go within about one interval.
        assert t_fall - t_stop >= DOWN_WINDOW - 2 * INTERVAL, "scaled down inside the window"
        assert t_fall - t_back < DOWN_WINDOW, "the window restarted with the operator"
        await env.wait_for(lambda: len(rs.pods) == 1, timeout=5)
        victim, annotations = rs.deleted[-1]
        assert COST in annotations  # marked before the scale-down
        assert status(env)["desiredReplicas"] == 1

        # Every scale got an Event with its numbers.
        events = [o.raw for (res, _, _), o in env.k.objects.items() if res.plural == "events" and not o.deleted]
        rescales = [e for e in events if e.get("reason") == "SuccessfulRescale"]
        assert [e["message"].split(";")[0] for e in rescales] == ["New size: 2", "New size: 1"]
        assert "KV-cache utilisation" in rescales[0]["message"]

        # No pod answers: MetricsAvailable=False, and no scaling.
        await env.patch("Pod", NAMESPACE, rs.pod_names()[0],
                        {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}, subresource="status")
        await env.wait_for(lambda: conditions(env).get("MetricsAvailable") == ("False", "NoPodAnswered"), timeout=5)
        assert conditions(env)["ScalingActive"] == ("False", "FailedGetMetrics")
        assert await sample_replicas(env, 2 * INTERVAL) == {1}
        assert "kvCacheUtilization" not in status(env)

        # The user's spec was never written.
        assert env.get("LLMDeployment", NAMESPACE, "llama")["spec"] == SPEC
        print(f"rise {t_rise - t_load:.2f} s after load started ({rise_s:.2f} s after KV stayed over {OVER:.2f}); "
              f"fall {t_fall - t_stop:.2f} s after load stopped")
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
