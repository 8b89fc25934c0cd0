"""``kvpilot router``: an asynchronous OpenAI-compatible proxy in front of a deployment's engines.

Per request it picks one engine (:func:`kvpilot.router.policy.pick`: prefix affinity on the
prompt's leading token blocks, hashed as the engine hashes them, within a load bound) and passes
the request through: the body as sent, the response streamed back chunk by chunk as the engine
writes it (server-sent events included), and a client that disconnects closes the upstream
request, so the engine aborts it. Every routed response carries ``x-kvpilot-route`` saying which
replica was chosen and why.

Endpoints of the router itself:

- ``GET /health``: 200 while at least one replica is healthy, else 503 with ``Retry-After``
  (readiness); ``GET /live``: 200 while the process serves (liveness).
- ``GET /router/debug``: JSON with the replicas (load, health, KV use, prefix-cache hit rate the
  engine reports), the last decisions (replica, reason, matched blocks, loads) and the settings.
- ``GET /metrics``: Prometheus text: requests per replica and reason, prompt blocks routed,
  blocks predicted to hit the engine's prefix cache, the engines' own reported prefix-cache hits
  and queries (summed over replicas), upstream errors, healthy replicas.

While no replica is healthy (a deployment scaled to zero, or every replica still loading),
requests are held (``--hold-timeout`` seconds at most, ``--max-held`` at a time) and released as
soon as a replica becomes healthy; the number held is the ``kvpilot_router_held_requests``
gauge (the demand an autoscaler can scale up from zero on). A request that waited too long, or
found the queue full, gets 503 with ``Retry-After``.

Replicas are a static list (``--upstream URL``) and/or a DNS name (``--discover HOST:PORT``, e.g.
the deployment's headless Service, which resolves to the Ready engine pods) re-resolved every
scrape. Every ``--scrape-interval`` seconds each replica's ``/metrics`` is read; a replica whose
scrape (or a proxied connection) failed ``--unhealthy-after`` times in a row is out of rotation
until a scrape succeeds again.

API key: with ``--api-key`` the router answers 401 unless ``Authorization: Bearer KEY`` is sent;
the header is passed to the engine as it came, so engines started with the same key accept it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import secrets
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.router.policy import Decision, NoReplicaError, PrefixIndex, Replica, pick
from kvpilot.router.prefix import PromptTokenizer, block_hashes

logger = logging.getLogger(__name__)

ROUTE_HEADER = "x-kvpilot-route"
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
# Hop-by-hop headers (RFC 9110 section 7.6.1) and those aiohttp sets itself.
_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
        "transfer-encoding", "upgrade", "host", "content-length", "content-encoding"}


@dataclass
class RouterConfig:
    """Settings of one router (``kvpilot router`` flags).

    Attributes:
        upstreams: engine base URLs (``http://host:port``), fixed.
        discover: ``host:port`` whose DNS A/AAAA records are engine replicas, or None.
        tokens_per_block: the engines' ``--tokens-per-block`` (KV block size, tokens).
        max_affinity_blocks: leading blocks hashed per prompt.
        imbalance, slack: the load bound (see :func:`kvpilot.router.policy.pick`).
        scrape_interval_s: seconds between ``/metrics`` scrapes (> 0).
        unhealthy_after: failed scrapes or connections in a row that take a replica out (>= 1).
        request_timeout_s: total seconds one proxied request may take.
        api_key: required bearer token, or None.
        history: decisions kept for ``/router/debug``.
        hold_timeout_s: while no replica is healthy (scaled to zero, all loading), hold a request
            up to this many seconds for one to become healthy; 0 answers 503 at once.
        max_held: requests held at most; more are answered 503 at once.
    """

    upstreams: list[str] = field(default_factory=list)
    discover: str | None = None
    tokens_per_block: int = 32
    max_affinity_blocks: int = 256
    imbalance: float = 0.5
    slack: float = 8.0
    scrape_interval_s: float = 2.0
    unhealthy_after: int = 2
    request_timeout_s: float = 3600.0
    api_key: str | None = None
    history: int = 100
    hold_timeout_s: float = 0.0
    max_held: int = 1000

    def __post_init__(self) -> None:
        if not self.upstreams and not self.discover:
            raise ValueError("give at least one --upstream URL or --discover HOST:PORT")
        for url in self.upstreams:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--upstream must be an http(s) URL, got {url!r}")
        if self.discover is not None:
            host, _, port = self.discover.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--discover must be HOST:PORT, got {self.discover!r}")
        if self.tokens_per_block < 1 or self.max_affinity_blocks < 0:
            raise ValueError("--tokens-per-block must be >= 1 and --max-affinity-blocks >= 0")
        if self.imbalance < 0 or self.slack < 0:
            raise ValueError("--imbalance and --slack must be >= 0")
        if not self.scrape_interval_s > 0 or self.unhealthy_after < 1:
            raise ValueError("--scrape-interval must be > 0 and --unhealthy-after >= 1")
        if self.hold_timeout_s < 0 or self.max_held < 0:
            raise ValueError("--hold-timeout and --max-held must be >= 0")


def _parse_engine_metrics(text: str) -> dict[str, float]:
    """running, waiting, kv_usage, prefix_hits, prefix_queries from an engine's ``/metrics``
    (kvpilot's names, or vLLM's)."""
    wanted = {
        "running": ("kvpilot:num_requests_running", "vllm:num_requests_running"),
        "waiting": ("kvpilot:num_requests_waiting", "vllm:num_requests_waiting"),
        "kv_usage": ("kvpilot:kv_cache_usage_perc", "vllm:kv_cache_usage_perc"),
        "prefix_hits": ("kvpilot:prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
        "prefix_queries": ("kvpilot:prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
    }
    values: dict[str, list[float]] = collections.defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not math.isnan(sample.value):
                values[sample.name].append(float(sample.value))
    out: dict[str, float] = {}
    for key, names in wanted.items():
        name = next((n for n in names if n in values), None)
        if name is not None:
            samples = values[name]
            out[key] = sum(samples) / len(samples) if key == "kv_usage" else sum(samples)
    return out


class Router:
    """The router's state: replicas, the prefix index, counters, recent decisions."""

    def __init__(self, config: RouterConfig, tokenizer: PromptTokenizer | None = None):
        self.config = config
        self.tokenizer = tokenizer or PromptTokenizer()
        self.replicas: dict[str, Replica] = {}
        for url in config.upstreams:
            self.replicas[url] = Replica(name=url, url=url.rstrip("/"))
        self.index = PrefixIndex()
        self.decisions: collections.deque[dict[str, Any]] = collections.deque(maxlen=config.history)
        self.requests: collections.Counter[tuple[str, str]] = collections.Counter()
        self.prompt_blocks = 0
        self.predicted_hit_blocks = 0
        self.upstream_errors = 0
        self.held = 0  # requests waiting for a healthy replica now
        self.held_timeouts = 0
        self.held_refused = 0
        self.available = asyncio.Event()  # set while a replica is healthy
        self.session: aiohttp.ClientSession | None = None
        self._scraper: asyncio.Task | None = None

    # ---- replicas -------------------------------------------------------------------------
    async def _discover(self) -> None:
        if not self.config.discover:
            return
        host, _, port = self.config.discover.rpartition(":")
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError as exc:
            logger.warning("could not resolve %s: %s", self.config.discover, exc)
            return
        found = set()
        for family, _, _, _, addr in infos:
            ip = addr[0]
            url = f"http://[{ip}]:{port}" if family == socket.AF_INET6 else f"http://{ip}:{port}"
            found.add(url)
            self.replicas.setdefault(url, Replica(name=url, url=url))
        static = set(self.config.upstreams)
        for name in [n for n in self.replicas if n not in found and n not in static]:
            del self.replicas[name]
            self.index.forget(name)

    def _failed(self, replica: Replica, why: str) -> None:
        replica.failures += 1
        if replica.healthy and replica.failures >= self.config.unhealthy_after:
            replica.healthy = False
            logger.warning("replica %s out of rotation after %d failures: %s", replica.name, replica.failures, why)
        self._update_available()

    async def scrape_once(self) -> None:
        """Resolve ``--discover`` and read every replica's ``/metrics`` (concurrently)."""
        await self._discover()
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=min(2.0, self.config.scrape_interval_s))

        async def one(replica: Replica) -> None:
            try:
                async with self.session.get(replica.url + "/metrics", timeout=timeout) as resp:
                    resp.raise_for_status()
                    values = _parse_engine_metrics(await resp.text())
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                self._failed(replica, f"/metrics: {exc!r}")
                return
            for key, value in values.items():
                setattr(replica, key, value)
            if not replica.healthy:
                logger.info("replica %s back in rotation", replica.name)
            replica.failures, replica.healthy = 0, True

        await asyncio.gather(*(one(r) for r in list(self.replicas.values())))
        self._update_available()

    async def _scrape_loop(self) -> None:
        while True:
            try:
                await self.scrape_once()
            except Exception:  # a scrape round must never end the loop
                logger.exception("scrape round failed")
            await asyncio.sleep(self.config.scrape_interval_s)

    async def start(self, _app: web.Application | None = None) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_s),
                                             auto_decompress=False)
        await self.scrape_once()
        self._scraper = asyncio.create_task(self._scrape_loop())

    async def stop(self, _app: web.Application | None = None) -> None:
        if self._scraper is not None:
            self._scraper.cancel()
            try:
                await self._scraper
            except asyncio.CancelledError:
                pass
        if self.session is not None:
            await self.session.close()

    # ---- routing --------------------------------------------------------------------------
    def decide(self, path: str, body: dict[str, Any] | None) -> tuple[Decision, list[bytes]]:
        """Pick a replica for one request (raises NoReplicaError)."""
        ids = self.tokenizer.token_ids(path, body) if body is not None and path in ROUTED_PATHS else None
        hashes = [] if ids is None else block_hashes(ids, self.config.tokens_per_block, self.config.max_affinity_blocks)
        decision = pick(list(self.replicas.values()), hashes, self.index, self.config.imbalance, self.config.slack)
        return decision, hashes

    def _record(self, path: str, decision: Decision, hashes: list[bytes]) -> None:
        self.index.record(hashes, decision.replica)
        self.requests[(decision.replica, decision.reason)] += 1
        self.prompt_blocks += decision.prompt_blocks
        self.predicted_hit_blocks += decision.matched_blocks
        self.decisions.append({"time": time.time(), "path": path, "replica": decision.replica,
                               "reason": decision.reason, "matched_blocks": decision.matched_blocks,
                               "prompt_blocks": decision.prompt_blocks, "affine": decision.affine,
                               "loads": decision.loads, "bound": decision.bound})

    def _update_available(self) -> None:
        if any(r.healthy for r in self.replicas.values()):
            self.available.set()
        else:
            self.available.clear()

    async def _hold(self, why: str) -> web.Response | None:
        """Wait, while no replica is healthy (scaled to zero, all loading), for one to become
        healthy: None when one did, else the 503 to answer (``Retry-After`` set)."""
        c = self.config
        if c.hold_timeout_s <= 0:
            return _error(503, f"no engine replica is available: {why}", "service_unavailable", retry_after=2)
        if self.held >= c.max_held:
            self.held_refused += 1
            return _error(503, f"no engine replica is available and {self.held} requests already wait for one "
                               f"(--max-held {c.max_held})", "service_unavailable", retry_after=int(c.hold_timeout_s))
        self.held += 1
        try:
            await asyncio.wait_for(self.available.wait(), c.hold_timeout_s)
            return None
        except asyncio.TimeoutError:
            self.held_timeouts += 1
            return _error(503, f"no engine replica became available within {c.hold_timeout_s:g} s "
                               f"(--hold-timeout); {why}", "service_unavailable", retry_after=int(c.hold_timeout_s))
        finally:
            self.held -= 1

    def _authorized(self, request: web.Request) -> bool:
        if self.config.api_key is None:
            return True
        scheme, _, token = (request.headers.get("Authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.config.api_key.encode())

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        """Pass one request to the chosen replica and stream its answer back."""
        if not self._authorized(request):
            return _error(401, "invalid or missing API key (send Authorization: Bearer KEY)", "authentication_error")
        raw = await request.read()
        body = None
        if raw and request.method == "POST":
            try:
                body = json.loads(raw)
            except ValueError:
                body = None  # the engine answers the 400
            if not isinstance(body, dict):
                body = None
        tried: set[str] = set()
        while True:
            try:
                decision, hashes = self.decide(request.path, body)
            except NoReplicaError as exc:
                refused = await self._hold(str(exc))
                if refused is not None:
                    return refused
                continue
            if decision.replica in tried:
                return _error(502, f"every replica refused the connection ({', '.join(sorted(tried))})", "bad_gateway")
            replica = self.replicas[decision.replica]
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
            # Recorded before any await, so that concurrent requests of one new prefix follow it.
            self._record(request.path, decision, hashes)
            replica.in_flight += 1
            response: web.StreamResponse | None = None
            try:
                assert self.session is not None
                async with self.session.request(request.method, replica.url + request.path_qs, data=raw or None,
                                                headers=headers) as upstream:
                    out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
                    out_headers[ROUTE_HEADER] = decision.header()
                    response = web.StreamResponse(status=upstream.status, headers=out_headers)
                    await response.prepare(request)
                    async for chunk in upstream.content.iter_any():
                        await response.write(chunk)
                    await response.write_eof()
                    return response
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                if response is not None and response.prepared:
                    raise  # mid-stream: the client sees the stream end
                self.upstream_errors += 1
                self._failed(replica, f"connection: {exc!r}")
                tried.add(decision.replica)
                replica.healthy = False  # until its next good scrape
                self._update_available()
                continue
            finally:
                replica.in_flight -= 1

    # ---- the router's own endpoints ---------------------------------------------------------
    async def health(self, _request: web.Request) -> web.Response:
        healthy = sum(r.healthy for r in self.replicas.values())
        if healthy:
            return web.json_response({"status": "ok", "healthy_replicas": healthy})
        return _error(503, "no engine replica is healthy", "service_unavailable", retry_after=2)

    async def debug(self, _request: web.Request) -> web.Response:
        replicas = []
        for r in self.replicas.values():
            replicas.append({"name": r.name, "url": r.url, "healthy": r.healthy, "failures": r.failures,
                             "load": r.load, "in_flight": r.in_flight, "running": r.running, "waiting": r.waiting,
                             "kv_cache_usage": r.kv_usage,
                             "engine_prefix_hit_rate": (r.prefix_hits / r.prefix_queries) if r.prefix_queries else None})
        c = self.config
        return web.json_response({
            "replicas": replicas,
            "decisions": list(self.decisions),
            "prefix_index_blocks": len(self.index),
            "held_requests": self.held,
            "predicted_prefix_hit_rate": (self.predicted_hit_blocks / self.prompt_blocks) if self.prompt_blocks else None,
            "settings": {"tokens_per_block": c.tokens_per_block, "max_affinity_blocks": c.max_affinity_blocks,
                         "imbalance": c.imbalance, "slack": c.slack, "scrape_interval_s": c.scrape_interval_s,
                         "unhealthy_after": c.unhealthy_after},
        })

    async def metrics(self, _request: web.Request) -> web.Response:
        lines = ["# HELP kvpilot_router_requests_total Requests routed, by replica and reason.",
                 "# TYPE kvpilot_router_requests_total counter"]
        for (replica, reason), n in sorted(self.requests.items()):
            lines.append(f'kvpilot_router_requests_total{{replica="{_label(replica)}",reason="{reason}"}} {n}')
        engine_hits = sum(r.prefix_hits for r in self.replicas.values())
        engine_queries = sum(r.prefix_queries for r in self.replicas.values())
        block = self.config.tokens_per_block
        for name, kind, doc, value in (
            ("kvpilot_router_prompt_tokens_hashed_total", "counter",
             "Prompt tokens in the full blocks the router hashed.", self.prompt_blocks * block),
            ("kvpilot_router_predicted_prefix_hit_tokens_total", "counter",
             "Prompt tokens the router predicted the chosen engine holds in its prefix cache.",
             self.predicted_hit_blocks * block),
            ("kvpilot_router_engine_prefix_cache_hits", "gauge",
             "Prefix-cache hit tokens the engines report (sum over replicas, last scrape).", engine_hits),
            ("kvpilot_router_engine_prefix_cache_queries", "gauge",
             "Prefix-cache query tokens the engines report (sum over replicas, last scrape).", engine_queries),
            ("kvpilot_router_upstream_errors_total", "counter",
             "Connections to an engine that failed before a response.", self.upstream_errors),
            ("kvpilot_router_healthy_replicas", "gauge", "Replicas in rotation.",
             sum(r.healthy for r in self.replicas.values())),
            ("kvpilot_router_held_requests", "gauge",
             "Requests waiting for a healthy replica (demand while scaled to zero).", self.held),
            ("kvpilot_router_held_timeouts_total", "counter",
             "Held requests answered 503 after --hold-timeout.", self.held_timeouts),
            ("kvpilot_router_held_refused_total", "counter",
             "Requests answered 503 at once because --max-held were already waiting.", self.held_refused),
        ):
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _error(status: int, message: str, type_: str, retry_after: int | None = None) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.json_response({"error": {"message": message, "type": type_, "code": status}}, status=status,
                             headers=headers)


def build_app(router: Router) -> web.Application:
    """The aiohttp application of ``router`` (its scraper starts and stops with the app)."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    app.router.add_get("/health", router.health)
    app.router.add_get("/live", lambda _request: web.json_response({"status": "ok"}))
    app.router.add_get("/router/debug", router.debug)
    app.router.add_get("/metrics", router.metrics)
    app.router.add_route("*", "/v1/{tail:.*}", router.proxy)
    return app


async def serve(router: Router, host: str, port: int, ready: asyncio.Event | None = None) -> None:
    """Run the router until cancelled. ``handler_cancellation``: a client that disconnects
    cancels its handler, which closes the upstream request, so the engine aborts it."""
    runner = web.AppRunner(build_app(router), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    logger.info("kvpilot router on http://%s:%d, %d replicas", host, port, len(router.replicas))
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


__all__: Iterable[str] = ["Router", "RouterConfig", "build_app", "serve", "ROUTE_HEADER"]
