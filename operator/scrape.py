"""Scrape engine pods' Prometheus ``/metrics`` directly (no Prometheus server) for the autoscaler.

An alias table maps the three gauges the autoscaler reads to the names kvpilot, vLLM (current and
pre-rename) and SGLang export, so pods of those engines scale too. Names are tried in table order
and the first one present wins, so a kvpilot pod started with ``--metrics-compat vllm`` (which
emits both) is read once. All three engines export KV usage as a fraction 0..1 despite the
``_perc`` suffix (vLLM ``vllm/v1/metrics/loggers.py``; SGLang ``token_usage``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.operator.autoscaler import PodMetrics

log = logging.getLogger(__name__)

#: PodMetrics field -> metric names, most preferred first.
METRIC_ALIASES: dict[str, tuple[str, ...]] = {
    "kv_cache_usage": (
        "kvpilot:kv_cache_usage_perc",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "sglang:token_usage",
    ),
    "num_requests_running": (
        "kvpilot:num_requests_running",
        "vllm:num_requests_running",
        "sglang:num_running_reqs",
    ),
    "num_requests_waiting": (
        "kvpilot:num_requests_waiting",
        "vllm:num_requests_waiting",
        "sglang:num_queue_reqs",
    ),
}

#: The container port name that carries the engine's HTTP API and /metrics (DESIGN.md).
HTTP_PORT_NAME = "http"


class MetricsParseError(ValueError):
    """The body of ``/metrics`` is not Prometheus text, or a gauge has an impossible value."""


def parse_metrics(text: str, pod: str) -> PodMetrics:
    """Read one pod's KV utilisation and queue gauges from Prometheus text exposition.

    Several samples of one gauge (for example one per ``model_name`` or per vLLM data-parallel
    ``engine``) are combined: KV utilisation is averaged, request counts are summed.

    Returns:
        PodMetrics; ``kv_cache_usage`` is ``None`` (with ``error`` set) when no alias is present.

    Raises:
        MetricsParseError: the text does not parse, or a KV utilisation sample lies outside 0..1.
    """
    values: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not math.isnan(sample.value):
                    values.setdefault(sample.name, []).append(float(sample.value))
    except ValueError as exc:
        raise MetricsParseError(f"pod {pod}: /metrics is not Prometheus text: {exc}") from exc

    found: dict[str, float | None] = {}
    for fld, names in METRIC_ALIASES.items():
        name = next((n for n in names if n in values), None)
        if name is None:
            found[fld] = None
            continue
        samples = values[name]
        found[fld] = sum(samples) / len(samples) if fld == "kv_cache_usage" else sum(samples)
    kv = found["kv_cache_usage"]
    if kv is not None and not -1e-6 <= kv <= 1.0 + 1e-6:
        raise MetricsParseError(f"pod {pod}: KV-cache utilisation {kv} is not a fraction in 0..1")
    return PodMetrics(
        pod=pod,
        kv_cache_usage=None if kv is None else min(max(kv, 0.0), 1.0),
        num_requests_running=found["num_requests_running"],
        num_requests_waiting=found["num_requests_waiting"],
        error=None if kv is not None else "no KV-cache utilisation gauge (" + ", ".join(METRIC_ALIASES["kv_cache_usage"]) + ")",
    )


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    """True for a Pod object whose ``Ready`` condition is ``True`` and that is not terminating."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_metrics_url(pod: Mapping[str, Any], port_name: str = HTTP_PORT_NAME) -> str | None:
    """``http://{status.podIP}:{containerPort named port_name}/metrics``, or ``None`` when the
    pod has no IP yet or no container declares that port name."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    for container in (pod.get("spec") or {}).get("containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == port_name and port.get("containerPort"):
                host = f"[{ip}]" if isinstance(ipaddress.ip_address(ip), ipaddress.IPv6Address) else ip
                return f"http://{host}:{int(port['containerPort'])}/metrics"
    return None


async def scrape_pod(client: httpx.AsyncClient, pod: str, url: str, timeout_s: float) -> PodMetrics:
    """GET ``url`` and parse it; any failure (connection, timeout, HTTP status, bad body) gives
    ``PodMetrics.missing(pod, reason)`` rather than an exception."""
    try:
        response = await client.get(url, timeout=timeout_s)
        response.raise_for_status()
        return parse_metrics(response.text, pod)
    except (httpx.HTTPError, MetricsParseError) as exc:
        log.info("scrape of pod %s at %s failed: %s", pod, url, exc)
        return PodMetrics.missing(pod, f"{type(exc).__name__}: {exc}")


async def scrape_pods(
    targets: Mapping[str, str | None], timeout_s: float = 2.0, client: httpx.AsyncClient | None = None
) -> list[PodMetrics]:
    """Scrape many pods concurrently, one result per target in the mapping's order.

    Args:
        targets: pod name -> metrics URL, or ``None`` for a pod that must count as missing
            (not Ready, no IP, no ``http`` port).
        timeout_s: per-pod timeout in seconds (connect + read).
        client: an ``httpx.AsyncClient`` to reuse; a private one is opened and closed otherwise.
    """

    async def run(c: httpx.AsyncClient) -> list[PodMetrics]:
        jobs = [
            scrape_pod(c, pod, url, timeout_s) if url else _missing(pod, "not Ready or no http port")
            for pod, url in targets.items()
        ]
        return list(await asyncio.gather(*jobs))

    if client is not None:
        return await run(client)
    async with httpx.AsyncClient() as own:
        return await run(own)


async def _missing(pod: str, reason: str) -> PodMetrics:
    return PodMetrics.missing(pod, reason)


async def scrape_workload_pods(
    pods: Sequence[Mapping[str, Any]], timeout_s: float = 2.0, client: httpx.AsyncClient | None = None
) -> list[PodMetrics]:
    """Scrape the Ready pods among ``pods`` (Pod objects as dicts); terminating pods are left
    out, other not-Ready pods come back as missing. Ordered by pod name."""
    targets: dict[str, str | None] = {}
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        targets[meta["name"]] = pod_metrics_url(pod) if pod_is_ready(pod) else None
    return await scrape_pods(targets, timeout_s=timeout_s, client=client)
