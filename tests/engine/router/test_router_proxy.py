"""``kvpilot router`` end to end, in process: the real aiohttp proxy in front of fake engine endpoints
(``/metrics`` with kvpilot's gauges, ``/v1/completions`` streaming or not), all on localhost."""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import pytest
from aiohttp import web

from kvpilot.router.app import ROUTE_HEADER, Router, RouterConfig, build_app

pytestmark = pytest.mark.timeout(60)

INTERVAL = 0.2  # scrape interval, seconds


class FakeEngine:
    """One engine endpoint: counts what it served, streams SSE chunks, notices disconnects."""

    def __init__(self, name: str):
        self.name = name
        self.served: list[dict] = []
        self.headers: list[dict] = []
        self.active = 0
        self.cancelled = 0
        self.metrics_status = 200
        self.chunks, self.gap_s, self.delay_s = 3, 0.0, 0.0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def metrics(self, _request):
        if self.metrics_status != 200:
            return web.Response(status=self.metrics_status, text="broken")
        return web.Response(text=f"kvpilot:num_requests_running {self.active}\nkvpilot:num_requests_waiting 0\n"
                                 f"kvpilot:kv_cache_usage_perc 0.25\nkvpilot:prefix_cache_hits_total 30\n"
                                 f"kvpilot:prefix_cache_queries_total 40\n")

    async def completions(self, request):
        body = await request.json()
        self.served.append(body)
        self.headers.append(dict(request.headers))
        self.active += 1
        try:
            if not body.get("stream"):
                await asyncio.sleep(self.delay_s)
                return web.json_response({"object": "text_completion", "engine": self.name,
                                          "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(self.chunks):
                await resp.write(f"data: {json.dumps({'i': i, 'engine': self.name})}\n\n".encode())
                await asyncio.sleep(self.gap_s)
            await resp.write(b"data: [DONE]\n\n")
            return resp
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1

    async def start(self):
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def stop(self):
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


async def _serve_router(config: RouterConfig):
    router = Router(config)
    runner = web.AppRunner(build_app(router), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return router, runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


@pytest.fixture
async def fleet():
    engines = [FakeEngine(f"e{i}") for i in range(3)]
    for e in engines:
        await e.start()
    started = []

    async def router(**kw):
        config = RouterConfig(upstreams=[e.url for e in engines], scrape_interval_s=INTERVAL, **kw)
        r, runner, url = await _serve_router(config)
        started.append(runner)
        return r, url

    try:
        yield engines, router
    finally:
        for runner in started:
            await runner.cleanup()
        for e in engines:
            await e.stop()


def _owner(engines, url):
    return next(e.name for e in engines if e.url == url)


async def test_shared_prefixes_stick_to_one_replica_and_the_choice_is_explained(fleet):
    engines, start = fleet
    for e in engines:
        e.delay_s = 0.02
    router, url = await start()
    rng = random.Random(1)
    tenants = [[rng.randrange(32000) for _ in range(2000)] for _ in range(4)]
    routed: dict[int, list[str]] = {t: [] for t in range(4)}
    headers = []

    async def one(session, t):
        prompt = tenants[t] + [rng.randrange(32000) for _ in range(rng.randrange(5, 100))]
        async with session.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}) as resp:
            assert resp.status == 200
            headers.append(resp.headers[ROUTE_HEADER])
            routed[t].append((await resp.json())["engine"])

    async with aiohttp.ClientSession() as session:
        for batch in range(10):
            await asyncio.gather(*(one(session, rng.randrange(4)) for _ in range(8)))
        for t, names in routed.items():
            top = max(set(names), key=names.count)
            assert names.count(top) / len(names) >= 0.95, (t, names)
        assert all(h.startswith("replica=http://127.0.0.1:") and "reason=" in h for h in headers)
        assert sum("reason=prefix;" in h for h in headers) >= len(headers) - 4  # all but first sights
        assert any("matched-blocks=62/" in h for h in headers)  # the 2,000-token prefix: 62 blocks of 32
        async with session.get(url + "/router/debug") as resp:
            debug = await resp.json()
        async with session.get(url + "/metrics") as resp:
            metrics = await resp.text()
    assert len(debug["decisions"]) == 80 and {d["reason"] for d in debug["decisions"]} <= {"prefix", "least-load"}
    assert debug["predicted_prefix_hit_rate"] > 0.8
    assert {r["engine_prefix_hit_rate"] for r in debug["replicas"]} == {0.75}  # 30 / 40 from each engine
    assert 'kvpilot_router_requests_total{replica="' in metrics
    assert "kvpilot_router_engine_prefix_cache_hits 90.0" in metrics


async def test_stream_is_passed_through_chunk_by_chunk(fleet):
    engines, start = fleet
    for e in engines:
        e.chunks, e.gap_s = 3, 0.4
    _, url = await start()
    async with aiohttp.ClientSession() as session:
        t0 = time.monotonic()
        async with session.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "stream": True}) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            arrivals, data = [], b""
            async for chunk in resp.content.iter_any():
                arrivals.append(time.monotonic() - t0)
                data += chunk
    events = [line for line in data.decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and len(events) == 4
    assert arrivals[0] < 0.3 and arrivals[-1] > 1.0  # the first chunk came before the engine finished


async def test_client_disconnect_aborts_the_upstream_request(fleet):
    engines, start = fleet
    for e in engines:
        e.chunks, e.gap_s = 50, 0.1
    _, url = await start()
    async with aiohttp.ClientSession() as session:
        resp = await session.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "stream": True})
        await resp.content.readany()
        resp.close()  # the client goes away mid-stream
    for _ in range(40):
        if sum(e.cancelled for e in engines) == 1:
            break
        await asyncio.sleep(0.05)
    assert sum(e.cancelled for e in engines) == 1, "the engine must see the disconnect (and abort)"
    assert sum(e.active for e in engines) == 0


async def test_replica_with_failing_metrics_leaves_rotation_within_two_scrapes(fleet):
    engines, start = fleet
    router, url = await start()
    engines[0].metrics_status = 500
    t0 = time.monotonic()
    while router.replicas[engines[0].url].healthy:
        await asyncio.sleep(0.02)
        assert time.monotonic() - t0 < 2 * INTERVAL + 0.5, "not out of rotation within 2 scrape intervals"
    async with aiohttp.ClientSession() as session:
        for i in range(12):
            async with session.post(url + "/v1/completions", json={"prompt": [i] * 100}) as resp:
                assert (await resp.json())["engine"] != "e0"
        engines[0].metrics_status = 200  # back after its next good scrape
        await asyncio.sleep(2 * INTERVAL + 0.1)
        assert router.replicas[engines[0].url].healthy


async def test_stopped_replica_is_retried_elsewhere_and_none_left_is_503(fleet):
    engines, start = fleet
    router, url = await start(unhealthy_after=5)
    await engines[0].stop()
    async with aiohttp.ClientSession() as session:
        for i in range(6):
            async with session.post(url + "/v1/completions", json={"prompt": [7] * 100}) as resp:
                assert resp.status == 200 and (await resp.json())["engine"] in ("e1", "e2")
        for e in engines[1:]:
            await e.stop()
        for r in router.replicas.values():
            r.healthy = False
        async with session.post(url + "/v1/completions", json={"prompt": [1]}) as resp:
            assert resp.status == 503 and resp.headers["Retry-After"] == "2"
            assert "no engine replica" in (await resp.json())["error"]["message"]
        async with session.get(url + "/health") as resp:
            assert resp.status == 503


async def test_api_key_is_checked_and_passed_on(fleet):
    engines, start = fleet
    _, url = await start(api_key="s3cret")
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json={"prompt": [1]}) as resp:
            assert resp.status == 401
        async with session.post(url + "/v1/completions", json={"prompt": [1]},
                                headers={"Authorization": "Bearer s3cret"}) as resp:
            assert resp.status == 200
    assert [h.get("Authorization") for e in engines for h in e.headers] == ["Bearer s3cret"]


@pytest.mark.parametrize("kw,match", [
    (dict(), "at least one --upstream"), (dict(upstreams=["10.0.0.1:8000"]), "http"),
    (dict(discover="engines"), "HOST:PORT"), (dict(upstreams=["http://a"], tokens_per_block=0), "tokens-per-block"),
    (dict(upstreams=["http://a"], scrape_interval_s=0), "scrape-interval"),
])
def test_config_rejects(kw, match):
    with pytest.raises(ValueError, match=match):
        RouterConfig(**kw)


async def test_requests_are_held_while_no_replica_is_healthy_and_all_succeed_after(fleet):
    """Scaled to zero (here: every replica failing its scrape): 50 requests wait, the held count
    is the demand signal, and all 50 succeed once a replica becomes healthy; none is lost."""
    engines, start = fleet
    for e in engines:
        e.metrics_status = 500
    router, url = await start(hold_timeout_s=20)
    await asyncio.sleep(2 * INTERVAL + 0.1)
    assert not any(r.healthy for r in router.replicas.values())
    async with aiohttp.ClientSession() as session:
        async def one(i):
            async with session.post(url + "/v1/completions", json={"prompt": [i] * 40}) as resp:
                return resp.status

        jobs = [asyncio.create_task(one(i)) for i in range(50)]
        await asyncio.sleep(0.5)
        assert router.held == 50 and not any(j.done() for j in jobs)
        async with session.get(url + "/metrics") as resp:
            assert "kvpilot_router_held_requests 50" in await resp.text()
        engines[1].metrics_status = 200  # the first replica becomes Ready
        statuses = await asyncio.wait_for(asyncio.gather(*jobs), 5)
    assert statuses == [200] * 50 and router.held == 0
    assert len(engines[1].served) == 50


async def test_held_requests_time_out_and_the_queue_is_bounded(fleet):
    engines, start = fleet
    for e in engines:
        e.metrics_status = 500
    router, url = await start(hold_timeout_s=0.6, max_held=2)
    await asyncio.sleep(2 * INTERVAL + 0.1)
    async with aiohttp.ClientSession() as session:
        async def one():
            t0 = time.monotonic()
            async with session.post(url + "/v1/completions", json={"prompt": [1, 2]}) as resp:
                return resp.status, resp.headers.get("Retry-After"), (await resp.json())["error"]["message"], \
                    time.monotonic() - t0

        first = [asyncio.create_task(one()) for _ in range(2)]
        await asyncio.sleep(0.1)
        status, retry, message, waited = await one()  # a third: the queue is full
        assert status == 503 and "--max-held 2" in message and waited < 0.3
        for status, retry, message, waited in await asyncio.gather(*first):
            assert status == 503 and retry is not None and "--hold-timeout" in message and waited >= 0.55
