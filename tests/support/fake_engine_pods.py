"""Pod objects in kmock's emulator backed by tiny local ``/metrics`` servers, for autoscaler tests.

``FakePods.add(n, labels)`` starts ``n`` aiohttp servers on 127.0.0.1 answering kvpilot's three
gauges from the shared ``load`` dict (``kv``: KV-cache utilisation 0..1) and posts one Ready Pod per
server (``podIP`` 127.0.0.1, the server's port as the container port named ``http``).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvpilot.operator.apply import resource_path


class FakePods:
    def __init__(self, env: Any, namespace: str, load: dict[str, float] | None = None):
        self.env, self.namespace = env, namespace
        self.load = load if load is not None else {"kv": 0.0}
        self.runners: list[web.AppRunner] = []

    async def _server(self) -> int:
        async def metrics(_request):
            return web.Response(text=f"kvpilot:kv_cache_usage_perc {self.load['kv']}\n"
                                     "kvpilot:num_requests_running 1\nkvpilot:num_requests_waiting 0\n")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.runners.append(runner)
        return site._server.sockets[0].getsockname()[1]

    async def add(self, count: int, labels: dict[str, str], prefix: str = "llama") -> None:
        for _ in range(count):
            port = await self._server()
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": f"{prefix}-{len(self.runners) - 1}", "namespace": self.namespace,
                                "labels": labels},
                   "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]},
                   "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}
            resp = await self.env.k.post(resource_path("v1", "pods", self.namespace), json=pod)
            assert resp.status == 200, await resp.text()

    async def close(self) -> None:
        for runner in self.runners:
            await runner.cleanup()
        self.runners.clear()
