"""Run the real kvpilot operator (kopf, in-process) against kmock's Kubernetes emulator.

Reusable by any operator e2e test (the autoscaler's too)::

    from support.operator_harness import operator_env  # noqa: F401  (the fixture)

    async def test_something(operator_env):
        await operator_env.start()
        await operator_env.create_cr(make_cr("m"))
        dep = await operator_env.wait_for(lambda: operator_env.get("Deployment", "ns", "m"))

What the emulator needs that a real cluster has anyway (kmock 0.8): every resource kopf or
the operator touches is declared in ``kmock.resources`` with its kind and verbs, including
``apiextensions.k8s.io/v1/customresourcedefinitions`` (kopf watches it for new CRDs) and
``v1/namespaces`` (kopf waits for it even when cluster-wide). The emulator assigns no
``uid``, ``resourceVersion`` or ``generation``, so CRs get a ``uid`` from :func:`make_cr`.
Without resourceVersions, kopf may process a fresh object's creation twice; reconcile is
idempotent, so that costs reads, not writes.

Every request the operator sends (those carrying its bearer token; the test's own requests carry
none) is checked at teardown against the ClusterRoles that ``helm template`` renders for the chart
(support.rbac): a request the chart's RBAC would refuse fails the test.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from typing import Any, Callable

import kmock
import kopf
import pytest_asyncio
import yaml

from kvpilot.operator import handlers  # noqa: F401  (registers the handlers in kopf's default registry)
from kvpilot.operator.apply import RESOURCES, resource_path

NAMESPACE = "ml"
WRITE_METHODS = {"POST", "PATCH", "PUT", "DELETE"}

# plural path -> (kind, namespaced, subresources)
EMULATED = {
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, set()),
    "v1/namespaces": ("Namespace", False, set()),
    "v1/events": ("Event", True, set()),
    "v1/pods": ("Pod", True, {"status"}),
    "v1/services": ("Service", True, {"status"}),
    "apps/v1/deployments": ("Deployment", True, {"status", "scale"}),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", True, {"status"}),
    "serving.kvpilot.io/v1alpha1/llmdeployments": ("LLMDeployment", True, {"status", "scale"}),
    "kopf.dev/v1/clusterkopfpeerings": ("ClusterKopfPeering", False, set()),
    "autoscaling/v2/horizontalpodautoscalers": ("HorizontalPodAutoscaler", True, {"status"}),
}
KEDA = {"keda.sh/v1alpha1/scaledobjects": ("ScaledObject", True, {"status"})}
LWS = {"leaderworkerset.x-k8s.io/v1/leaderworkersets": ("LeaderWorkerSet", True, {"status", "scale"})}


def make_cr(name: str, spec: dict[str, Any] | None = None, namespace: str = NAMESPACE) -> dict[str, Any]:
    """An LLMDeployment with a ``uid`` (the emulator assigns none)."""
    return {
        "apiVersion": "serving.kvpilot.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": copy.deepcopy(spec) if spec is not None else {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}},
    }


class OperatorEnv:
    """The emulator, its URL in a kubeconfig, and the operator running as an asyncio task."""

    def __init__(self, emulator: kmock.KubernetesEmulator, server: kmock.Server, kubeconfig: str):
        self.k = emulator
        self.server = server
        self.kubeconfig = kubeconfig
        self._thread: threading.Thread | None = None
        self._stop: threading.Event | None = None
        self.error: BaseException | None = None
        #: ``--set`` values for the chart whose RBAC the operator's requests are checked against.
        self.chart_values: tuple[str, ...] = ()

    async def start(self, timeout: float = 10.0, peering: str | None = None, priority: int = 0,
                    wait_watching: bool = True, config: Any = None) -> None:
        """Start the operator and wait until kopf is watching LLMDeployments.

        Standalone unless ``peering`` names a ClusterKopfPeering (then kopf takes part in
        peering with ``priority``, and a paused operator may never open its watch: pass
        ``wait_watching=False``). ``config`` is an ``OperatorConfig`` (retry timings), default the
        operator's own.

        kopf runs in its own thread and event loop: on exit it waits for every task it did not
        start, which would include the emulator's never-ending watch streams in a shared loop.
        """
        assert self._thread is None, "operator already running"
        self._stop, ready = threading.Event(), threading.Event()

        def main() -> None:
            try:
                asyncio.run(kopf.operator(clusterwide=True, standalone=peering is None, peering_name=peering,
                                          priority=priority, stop_flag=self._stop, ready_flag=ready,
                                          settings=kopf.OperatorSettings(), memo=kopf.Memo(config=config)))
            except BaseException as exc:  # surfaced by stop()
                self.error = exc

        self._thread = threading.Thread(target=main, name="kopf-operator", daemon=True)
        self._thread.start()
        await self.wait_for(ready.is_set, timeout=timeout)
        if not wait_watching:
            return
        # ready_flag fires before the watch streams are open; wait for the CR watch.
        await self.wait_for(lambda: any("watch=true" in str(r.url) and "llmdeployments" in str(r.url) for r in self.k),
                            timeout=timeout)

    async def stop(self) -> None:
        """Stop the operator and wait for its thread; re-raise what killed it, if anything."""
        if self._thread is None:
            return
        assert self._stop is not None
        self._stop.set()
        thread, self._thread = self._thread, None
        await asyncio.to_thread(thread.join, 15)
        if thread.is_alive():
            raise TimeoutError("the operator did not stop within 15 s")
        error, self.error = self.error, None
        if isinstance(error, TimeoutError) and not str(error):
            # kopf's own shutdown: a handler still running in its thread pool (its requests to a
            # slow emulator on a loaded machine) outlived kopf's cancellation wait. The operator
            # did stop (the thread joined); what the handler did is checked by the test itself.
            return
        if error is not None:
            raise error

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    # --- talking to the emulator over HTTP, as kubectl would

    async def create_cr(self, cr: dict[str, Any]) -> None:
        ns = cr["metadata"]["namespace"]
        resp = await self.k.post(resource_path("serving.kvpilot.io/v1alpha1", "llmdeployments", ns), json=cr)
        assert resp.status == 200, await resp.text()

    async def patch(self, kind: str, ns: str, name: str, patch: dict[str, Any], subresource: str | None = None) -> None:
        api_version, plural = RESOURCES[kind]
        resp = await self.k.patch(resource_path(api_version, plural, ns, name, subresource), json=patch,
                                  headers={"Content-Type": "application/merge-patch+json"})
        assert resp.status == 200, await resp.text()

    def get(self, kind: str, ns: str, name: str) -> dict[str, Any] | None:
        """The stored object, or None if absent or deleted."""
        api_version, plural = RESOURCES[kind]
        key = (kmock.resource(f"{api_version}/{plural}"), ns, name)
        if key not in self.k.objects or self.k.objects[key].deleted:
            return None
        return copy.deepcopy(self.k.objects[key].raw)

    def writes(self, since: int = 0) -> list[str]:
        """``METHOD path`` of every write request after the first ``since`` requests."""
        return [f"{r.method.value} {r.url.path}" for r in list(self.k)[since:] if r.method.value in WRITE_METHODS]

    def operator_requests(self) -> list[tuple[str, str, dict[str, str]]]:
        """(method, path, query) of every request the operator (kopf or KubeClient) sent."""
        return [(r.method.value, r.url.path, dict(r.url.query)) for r in list(self.k)
                if (r.headers.get("Authorization") or "").startswith("Bearer ")]

    def rbac_denials(self) -> list[str]:
        """The operator's requests that the chart's rendered RBAC does not allow."""
        from support import rbac

        return rbac.denied(self.operator_requests(), rbac.chart_rules(*self.chart_values, namespace=NAMESPACE))

    def request_count(self) -> int:
        return len(list(self.k))

    async def settle(self, quiet: float = 1.0, timeout: float = 15.0) -> None:
        """Wait until no request at all has reached the emulator for ``quiet`` seconds."""
        deadline = time.monotonic() + timeout
        count, since = self.request_count(), time.monotonic()
        while time.monotonic() - since < quiet:
            await asyncio.sleep(0.1)
            if self.request_count() != count:
                count, since = self.request_count(), time.monotonic()
            if time.monotonic() > deadline:
                raise TimeoutError("the operator never went quiet")

    async def wait_for(self, predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05) -> Any:
        """Poll ``predicate`` until it returns something truthy; return that."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"condition not met within {timeout}s")
            await asyncio.sleep(interval)


def declare_resources(emulator: kmock.KubernetesEmulator, with_lws: bool = True, with_keda: bool = False) -> None:
    """Declare every resource the operator uses, so discovery (kopf's and ours) finds them;
    KEDA's ScaledObjects only with ``with_keda`` (a cluster without KEDA is the default)."""
    extra = {**(LWS if with_lws else {}), **(KEDA if with_keda else {})}
    for path, (kind, namespaced, subresources) in {**EMULATED, **extra}.items():
        emulator.resources[path] = {
            "kind": kind, "singular": kind.lower(), "namespaced": namespaced, "subresources": subresources,
            "verbs": {"get", "list", "watch", "create", "patch", "delete"},
        }


def kubeconfig_for(url: str) -> dict[str, Any]:
    """A kubeconfig pointing at ``url`` with a dummy bearer token (the emulator checks none)."""
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": url.rstrip("/")}}],
        "users": [{"name": "kmock", "user": {"token": "kmock"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
    }


@pytest_asyncio.fixture
async def operator_env(tmp_path, monkeypatch):
    """An :class:`OperatorEnv` (operator not yet started; call ``start()``), stopped at teardown."""
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        declare_resources(emulator)
        path = tmp_path / "kubeconfig.yaml"
        path.write_text(yaml.safe_dump(kubeconfig_for(str(server.url))))
        monkeypatch.setenv("KUBECONFIG", str(path))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        env = OperatorEnv(emulator, server, str(path))
        try:
            yield env
        finally:
            await env.stop()
        denials = env.rbac_denials()
        assert not denials, "requests the chart's RBAC refuses:\n" + "\n".join(denials)


__all__ = ["OperatorEnv", "make_cr", "operator_env", "declare_resources", "kubeconfig_for", "NAMESPACE"]
