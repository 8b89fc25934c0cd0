"""The autoscaling loop: one kopf daemon per LLMDeployment with ``spec.autoscaling.enabled``.

Every ``scrapeIntervalSeconds`` it reads the CR and its workload, scrapes the Ready engine pods
(operator/scrape.py), calls the pure ``decide()`` (operator/autoscaler.py) and writes, in this
order:

1. before lowering replicas, ``controller.kubernetes.io/pod-deletion-cost`` on every pod that
   answered (its requests in flight), so the ReplicaSet removes the least-loaded pods;
2. the CR status: ``desiredReplicas``, ``kvCacheUtilization``, ``queueLength``,
   ``lastScaleTime``, the window history (``status.autoscaling``) and the conditions
   ``ScalingActive``, ``ScalingLimited``, ``MetricsAvailable``;
3. the child workload's ``spec.replicas``, and a ``SuccessfulRescale`` Event with the numbers.

The user's ``spec`` is never written. render() takes replicas from ``status.desiredReplicas``
while autoscaling is on, so a later reconcile re-applies the same count. When autoscaling is
switched off, kopf stops the daemon (its ``when`` filter) and it sets ``ScalingActive=False``.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
import uuid
from typing import Any

import httpx
import kopf

from . import apply as kube
from . import foreign
from .autoscaler import Decision, ScalingHistory, ScalingPolicy, decide, deletion_costs
from .crd import GROUP, KIND, PLURAL, VERSION, normalize
from .render import serving_selector, workload_kind
from .scrape import scrape_workload_pods
from .status import merge_conditions
from .status_writer import update_status

logger = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
HISTORY_KEY = "autoscaling"  # status.autoscaling: {"recommendations": [...]}
DEFAULT_INTERVAL_S = 15.0
EVENT_SOURCE = "kvpilot-operator"
MAX_SCRAPE_TIMEOUT_S = 2.0


def rfc3339(t: float) -> str:
    """Unix seconds as a Kubernetes timestamp (UTC, seconds, trailing ``Z``)."""
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def autoscaling_status(decision: Decision, old_status: dict[str, Any], now: float) -> dict[str, Any]:
    """The status keys the autoscaler owns, for a merge patch of ``/status``.

    ``kvCacheUtilization`` (mean over the pods that answered, 0..1, 4 decimals) and
    ``queueLength`` (total waiting requests) become ``None`` (deleted by the merge patch) when no
    pod answered, so no stale number is shown. ``lastScaleTime`` moves only when the count changes.
    """
    util = None if decision.utilization is None else round(decision.utilization, 4)
    status: dict[str, Any] = {
        "desiredReplicas": decision.desired_replicas,
        "kvCacheUtilization": util,
        "queueLength": decision.queue_length,
        HISTORY_KEY: decision.history.to_dict(),
        "conditions": merge_conditions(old_status.get("conditions") or [], decision.conditions(), rfc3339(now)),
    }
    if decision.scaled:
        status["lastScaleTime"] = rfc3339(now)
    return status


def starting_pods(pods: list[dict[str, Any]], now: float, startup_timeout_s: int) -> int:
    """Engine pods that are still starting: not terminating, not Ready, and either not started
    yet (pending) or started less than ``startup_timeout_s`` (``spec.startup.timeoutSeconds``)
    ago; older not-Ready pods are stuck, not loading, and do not hold a scale-down."""
    from .scrape import pod_is_ready

    n = 0
    for pod in pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp") or pod_is_ready(pod):
            continue
        started = (pod.get("status") or {}).get("startTime")
        if started:
            try:
                age = now - datetime.datetime.fromisoformat(str(started).replace("Z", "+00:00")).timestamp()
            except ValueError:
                age = 0.0
            if age >= startup_timeout_s:
                continue
        n += 1
    return n


def autoscaling_enabled(spec: Any, **_: Any) -> bool:
    """kopf ``when`` filter: the CR asks for autoscaling."""
    return bool(((spec or {}).get("autoscaling") or {}).get("enabled"))


async def autoscale_once(client: kube.KubeClient, namespace: str, name: str, http: httpx.AsyncClient,
                         now: float | None = None, history: ScalingHistory | None = None) -> tuple[float, Decision | None]:
    """One scrape-decide-write round for one LLMDeployment.

    Args:
        history: the windows' history from the previous round of this process; read from
            ``status.autoscaling`` when None (the first round after a start).

    The status is written only when something other than the history changed (the decision,
    the rounded metrics, a condition), so an idle or steady deployment causes no writes; the
    history rides along with those writes, so a restarted operator resumes the windows from the
    last one.

    An HPA or KEDA ScaledObject that scales the workload or the CR (operator/foreign.py) stops
    the round before anything is written but the ``ForeignAutoscaler`` condition.

    Returns:
        (seconds until the next round, the decision or None when there was nothing to decide:
        the CR is gone, invalid, not autoscaled, its workload does not exist yet, or another
        autoscaler scales it).
    """
    cr = await asyncio.to_thread(client.get, KIND, namespace, name)
    if cr is None:
        return DEFAULT_INTERVAL_S, None
    try:
        cr = normalize(cr)
        auto = cr["spec"]["autoscaling"]
        policy = ScalingPolicy.from_spec(auto, cr["spec"].get("replicas"))
    except ValueError as exc:  # reconcile reports invalid specs
        logger.warning("%s/%s: not autoscaling: %s", namespace, name, exc)
        return DEFAULT_INTERVAL_S, None
    interval = policy.scrape_interval_s
    if not auto.get("enabled"):
        return interval, None
    kind = workload_kind(cr)
    child = await asyncio.to_thread(client.get, kind, namespace, name)
    if child is None:
        return interval, None
    scalers = await asyncio.to_thread(foreign.find, client, namespace, name)
    if scalers:  # another autoscaler owns the replicas: write none, say so
        await asyncio.to_thread(foreign.report, client, cr, scalers, True, logger)
        return interval, None
    current = int((child.get("spec") or {}).get("replicas", 1))
    pods = await asyncio.to_thread(client.list, "Pod", namespace, serving_selector(cr))
    samples = await scrape_workload_pods(pods, timeout_s=min(MAX_SCRAPE_TIMEOUT_S, 0.8 * interval), client=http)
    old_status = cr.get("status") or {}
    if history is None:
        try:
            history = ScalingHistory.from_dict(old_status.get(HISTORY_KEY))
        except ValueError as exc:
            logger.warning("%s/%s: starting a new scaling history: %s", namespace, name, exc)
            history = ScalingHistory()
    now = time.time() if now is None else now
    decision = decide(samples, current, policy, history, now,
                      loading=starting_pods(pods, now, int(cr["spec"]["startup"]["timeoutSeconds"])))

    if decision.desired_replicas < current and kind == "Deployment":
        await _mark_deletion_costs(client, namespace, name, deletion_costs(samples))

    def compute(fresh: dict[str, Any]) -> dict[str, Any] | None:
        if not autoscaling_enabled(fresh.get("spec")):
            return None  # switched off since this round began: the numbers are no longer ours
        fresh_status = fresh.get("status") or {}
        wanted = autoscaling_status(decision, fresh_status, now)
        changed = {k: v for k, v in wanted.items() if k != HISTORY_KEY and fresh_status.get(k) != v}
        return wanted if changed else None

    await asyncio.to_thread(update_status, client, namespace, name, compute)
    if decision.scaled:
        await asyncio.to_thread(client.merge_patch, kind, namespace, name,
                                {"spec": {"replicas": decision.desired_replicas}})
        logger.info("%s/%s: %s", namespace, name, decision.message)
        event = rescale_event(cr, decision, now)
        await asyncio.to_thread(client.request, "POST", kube.resource_path("v1", "events", namespace), event)
    return interval, decision


async def _mark_deletion_costs(client: kube.KubeClient, namespace: str, name: str, costs: dict[str, int]) -> None:
    """Annotate pods with their deletion cost. The cost is a preference of the ReplicaSet, not a
    precondition of the scale-down: a pod that is gone (404) or a refused write (403) is logged
    and the round goes on, so replicas still come down."""
    for pod, cost in costs.items():
        try:
            await asyncio.to_thread(client.merge_patch, "Pod", namespace, pod,
                                    {"metadata": {"annotations": {DELETION_COST: str(cost)}}})
        except kube.ApiError as exc:
            if exc.status not in (403, 404):
                raise
            logger.warning("%s/%s: could not mark pod %s with its deletion cost: %s", namespace, name, pod, exc)


def rescale_event(cr: dict[str, Any], decision: Decision, now: float) -> dict[str, Any]:
    """A core/v1 Event on the CR with the numbers behind a rescale, as the HPA words it
    (reason ``SuccessfulRescale``, message ``New size: N; ...``).

    Named ``{cr name}.{random hex}`` as kubectl-visible events are; set here rather than through
    ``generateName`` so that API emulators without it accept it too.
    """
    meta = cr["metadata"]
    stamp = rfc3339(now)
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": meta.get("namespace") or "default"},
        "involvedObject": {"apiVersion": cr["apiVersion"], "kind": cr["kind"], "name": meta["name"],
                           "namespace": meta.get("namespace") or "default", "uid": meta.get("uid")},
        "type": "Normal", "reason": "SuccessfulRescale",
        "message": f"New size: {decision.desired_replicas}; {decision.message}",
        "source": {"component": EVENT_SOURCE}, "reportingComponent": EVENT_SOURCE,
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }


@kopf.daemon(GROUP, VERSION, PLURAL, id="autoscaler", when=autoscaling_enabled, cancellation_timeout=10.0)
async def autoscaler(name: str, namespace: str, memo: kopf.Memo, stopped: kopf.DaemonStopped,
                     **_: Any) -> None:
    """Run :func:`autoscale_once` every ``scrapeIntervalSeconds`` until kopf stops the daemon or
    the CR is gone (with no finalizer, kopf may not stop it on deletion)."""
    client: kube.KubeClient = memo.kube
    async with httpx.AsyncClient() as http:
        history: ScalingHistory | None = None
        while not stopped:
            interval = DEFAULT_INTERVAL_S
            try:
                cr = await asyncio.to_thread(client.get, KIND, namespace, name)
                if cr is None or (cr.get("metadata") or {}).get("deletionTimestamp"):
                    return
                interval, decision = await autoscale_once(client, namespace, name, http, history=history)
                history = decision.history if decision is not None else None
            except (kube.ApiError, httpx.HTTPError, OSError) as exc:
                logger.warning("%s/%s: autoscaling round failed: %s", namespace, name, exc)
            await stopped.wait(interval)
    if stopped.reason is not None and stopped.reason & kopf.DaemonStoppingReason.FILTERS_MISMATCH:
        await asyncio.to_thread(_mark_disabled, client, namespace, name)


def _without_finalizer(handler_id: str) -> bool:
    """Let the daemon ``handler_id`` run without a finalizer on its CR.

    kopf puts a finalizer on every object that has a daemon, so that it can stop the daemon
    before the object goes; while the operator is down that finalizer makes ``kubectl delete``
    hang. This daemon needs no cleanup (it exits by itself once its CR is gone), so its handler
    is re-registered with ``requires_finalizer=False``, and kopf then also removes the finalizer
    from CRs that carry it. This touches kopf's registry internals: when they are not what this
    expects, the daemon keeps kopf's default (with a finalizer) and a warning says so.
    Returns True when the handler was changed.
    """
    import dataclasses

    try:
        spawning = kopf.get_default_registry()._spawning
        handlers = spawning._handlers
        for i, handler in enumerate(handlers):
            if handler.id == handler_id:
                handlers[i] = dataclasses.replace(handler, requires_finalizer=False)
                return True
    except (AttributeError, TypeError) as exc:
        logger.warning("kopf's registry changed (%s): the autoscaler keeps a finalizer on its CRs", exc)
    return False


FINALIZER_FREE = _without_finalizer("autoscaler")


DISABLED_CONDITION = {"type": "ScalingActive", "status": "False", "reason": "ScalingDisabled",
                      "message": "spec.autoscaling.enabled is false; spec.replicas rules"}


def disabled_status(status: dict[str, Any], now: str) -> dict[str, Any] | None:
    """The status patch for a CR whose autoscaling is off: ``ScalingActive=False`` and the
    autoscaler's numbers and history removed; None when the status already says so."""
    old = status.get("conditions") or []
    patch = {"conditions": merge_conditions(old, [DISABLED_CONDITION], now), HISTORY_KEY: None,
             "kvCacheUtilization": None, "queueLength": None}
    return {k: v for k, v in patch.items() if status.get(k) != v} or None


def _mark_disabled(client: kube.KubeClient, namespace: str, name: str) -> None:
    def compute(fresh: dict[str, Any]) -> dict[str, Any] | None:
        if autoscaling_enabled(fresh.get("spec")):
            return None  # switched on again meanwhile
        return disabled_status(fresh.get("status") or {}, rfc3339(time.time()))

    update_status(client, namespace, name, compute)
