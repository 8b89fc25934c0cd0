"""The LLMDeployment's ``status``, computed from its workload child: pure functions.

Conditions follow the Kubernetes API conventions (``metav1.Condition``: ``type``, ``status``
"True"/"False"/"Unknown", ``reason`` in CamelCase, ``message``, ``lastTransitionTime`` that
moves only when ``status`` flips). kvpilot sets ``Ready``, ``Progressing`` and ``Degraded``;
conditions of other types (the autoscaler's ``MetricsAvailable``, ...) are carried over as
they are, so two writers do not erase each other's conditions.
"""

from __future__ import annotations

import datetime
from typing import Any

from .render import (desired_replicas, endpoint, router_endpoint, selector_string, serving_selector, shape_of,
                     workload_kind)

OWN_CONDITIONS = ("Ready", "Progressing", "Degraded")


def now_rfc3339() -> str:
    """The current UTC time as Kubernetes writes timestamps (seconds, trailing ``Z``)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(type_: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}


def workload_conditions(cr: dict[str, Any], child: dict[str, Any] | None) -> list[dict[str, Any]]:
    """``Ready``, ``Progressing`` and ``Degraded`` for a (defaulted) CR and its live workload.

    ``child`` is the Deployment or LeaderWorkerSet as read from the API (None if missing).
    Readiness counts replicas (whole engines): an LWS replica is ready when its group is.
    """
    desired = desired_replicas(cr)
    kind = workload_kind(cr)
    if child is None:
        return [_condition("Ready", False, "WorkloadMissing", f"the {kind} does not exist yet"),
                _condition("Progressing", True, "Creating", f"creating the {kind}"),
                _condition("Degraded", False, "AsExpected", "")]
    st = child.get("status") or {}
    replicas, ready, updated = (int(st.get(k) or 0) for k in ("replicas", "readyReplicas", "updatedReplicas"))
    generation = (child.get("metadata") or {}).get("generation")
    observed = st.get("observedGeneration")
    seen = generation is None or observed is None or observed >= generation
    child_conditions = {c.get("type"): c for c in st.get("conditions") or []}

    if desired == 0:
        ready_cond = _condition("Ready", False, "ScaledToZero", "no replicas requested")
    elif ready >= desired:
        ready_cond = _condition("Ready", True, "ReplicasReady", f"{ready}/{desired} replicas ready")
    else:
        ready_cond = _condition("Ready", False, "ReplicasNotReady", f"{ready}/{desired} replicas ready")

    if not seen:
        progressing = _condition("Progressing", True, "ObservingChange", f"the {kind} controller has not seen the change yet")
    elif updated < replicas:
        progressing = _condition("Progressing", True, "RollingOut", f"{updated}/{replicas} replicas updated")
    elif replicas != desired or ready < desired:
        progressing = _condition("Progressing", True, "Scaling", f"{ready} ready of {desired} desired")
    else:
        progressing = _condition("Progressing", False, "Settled", f"{ready}/{desired} replicas ready and up to date")

    deadline = child_conditions.get("Progressing") or {}
    failure = child_conditions.get("ReplicaFailure") or {}
    if deadline.get("status") == "False" and deadline.get("reason") == "ProgressDeadlineExceeded":
        degraded = _condition("Degraded", True, "ProgressDeadlineExceeded", deadline.get("message") or "")
    elif failure.get("status") == "True":
        degraded = _condition("Degraded", True, "ReplicaFailure", failure.get("message") or "")
    else:
        degraded = _condition("Degraded", False, "AsExpected", "")
    return [ready_cond, progressing, degraded]


def merge_conditions(old: list[dict[str, Any]], new: list[dict[str, Any]], now: str,
                     generation: int | None = None) -> list[dict[str, Any]]:
    """Replace the conditions of ``new``'s types in ``old``, keeping the others.

    ``lastTransitionTime`` is kept from ``old`` while a condition's status stays the same,
    and set to ``now`` when it changes; ``observedGeneration`` is set when known.
    """
    by_type = {c["type"]: c for c in old or []}
    for cond in new:
        prev = by_type.get(cond["type"])
        merged = dict(cond)
        same = prev is not None and prev.get("status") == cond["status"]
        merged["lastTransitionTime"] = prev.get("lastTransitionTime", now) if same else now
        if generation is not None:
            merged["observedGeneration"] = generation
        elif prev is not None and "observedGeneration" in prev:
            merged["observedGeneration"] = prev["observedGeneration"]
        by_type[cond["type"]] = merged
    order = [c["type"] for c in old or []] + [c["type"] for c in new if c["type"] not in {o["type"] for o in old or []}]
    return [by_type[t] for t in order]


def model_status(spec: dict[str, Any]) -> dict[str, str]:
    """``status.model``: the model name and, for a Hugging Face Hub id (downloaded by the pods),
    the revision the pods download (``spec.model.revision``, default ``main``)."""
    model = spec["model"]
    name = model["name"]
    if name.startswith("pvc://") or name.startswith("/"):
        return {"name": name}
    return {"name": name, "revision": model.get("revision") or "main"}


def desired_status(cr: dict[str, Any], child: dict[str, Any] | None, now: str,
                   observed_generation: bool = False) -> dict[str, Any]:
    """The status kvpilot owns, for a defaulted CR and its live workload.

    Args:
        cr: the LLMDeployment (defaults applied).
        child: its Deployment or LeaderWorkerSet, or None.
        now: RFC 3339 time for condition transitions.
        observed_generation: set ``observedGeneration`` to the CR's generation; only the
            reconcile that has just applied the spec may claim that.
    """
    old = cr.get("status") or {}
    spec = cr["spec"]
    shape = shape_of(spec)
    st = (child or {}).get("status") or {}
    generation = (cr.get("metadata") or {}).get("generation")
    status: dict[str, Any] = {
        "replicas": int(st.get("replicas") or 0),
        "readyReplicas": int(st.get("readyReplicas") or 0),
        "updatedReplicas": int(st.get("updatedReplicas") or 0),
        "selector": selector_string(serving_selector(cr)),
        "endpoint": endpoint(cr),
        "parallelism": f"{shape.tensor}x{shape.pipeline}",
        "workload": workload_kind(cr),
        "model": model_status(spec),
        "routerEndpoint": router_endpoint(cr),
        "conditions": merge_conditions(old.get("conditions") or [], workload_conditions(cr, child), now,
                                       generation if observed_generation else None),
    }
    if not spec["autoscaling"]["enabled"]:
        # With autoscaling on, desiredReplicas is the autoscaler's to write.
        status["desiredReplicas"] = desired_replicas(cr)
    if observed_generation and generation is not None:
        status["observedGeneration"] = generation
    return status


def status_patch(cr: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``desired`` whose values differ from ``cr.status``; empty when settled."""
    old = cr.get("status") or {}
    return {k: v for k, v in desired.items() if old.get(k) != v}


def _pod_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_lora_names(pod: dict[str, Any]) -> list[str]:
    """The adapter names an engine pod serves: its engine container's ``--lora-modules name=path ...``."""
    from .render import ENGINE_CONTAINER

    for c in (pod.get("spec") or {}).get("containers") or ():
        if c.get("name") != ENGINE_CONTAINER:
            continue
        args = [str(a) for a in c.get("args") or ()]
        if "--lora-modules" not in args:
            return []
        names = []
        for a in args[args.index("--lora-modules") + 1:]:
            if a.startswith("--"):
                break
            names.append(a.partition("=")[0])
        return names
    return []


def lora_status(cr: dict[str, Any], pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``status.lora``: per adapter, the Ready serving pods (replicas) that serve it.

    An engine is Ready only after it has loaded every adapter of its ``--lora-modules``
    (`kvpilot.server.cli.load_lora_modules`), so a Ready pod whose arguments name an adapter has
    it. Adapters of ``spec.lora.adapters`` come first, in order (0 while none serves them); names
    only older pods still serve (a rollout removing them) follow, sorted.
    """
    from .render import serving_selector

    selector = serving_selector(cr)
    counts: dict[str, int] = {}
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if any(labels.get(k) != v for k, v in selector.items()) or not _pod_ready(pod):
            continue
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        for name in dict.fromkeys(pod_lora_names(pod)):
            counts[name] = counts.get(name, 0) + 1
    wanted = [a["name"] for a in ((cr.get("spec") or {}).get("lora") or {}).get("adapters") or ()]
    names = wanted + sorted(n for n in counts if n not in wanted)
    return [{"name": n, "readyReplicas": counts.get(n, 0)} for n in names]
