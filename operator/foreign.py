"""Other autoscalers that scale an LLMDeployment's engines: HPAs and KEDA ScaledObjects.

Two controllers writing one replica count fight (each undoes the other every round). A foreign
scaler can reach an LLMDeployment's engines two ways:

- its ``scaleTargetRef`` names the child workload (the ``apps/v1`` Deployment or the
  ``leaderworkerset.x-k8s.io`` LeaderWorkerSet, both named after the CR): it writes the
  workload's ``spec.replicas`` itself, so kvpilot must write them neither from its autoscaler nor
  from reconcile or drift repair (which would put back ``spec.replicas``);
- it names the LLMDeployment, through the CRD's ``scale`` subresource: it writes the CR's
  ``spec.replicas``, so kvpilot's own autoscaler stands down and ``spec.replicas`` rules, as
  with autoscaling off.

Either way the CR says so: ``ScalingActive=False`` with reason ``ForeignAutoscaler`` and a
message naming the other scaler, and a Warning Event when that first happens.

Objects read: ``autoscaling/v2`` HorizontalPodAutoscalers and ``keda.sh/v1alpha1``
ScaledObjects in the CR's namespace. A cluster without KEDA answers 404 for ScaledObjects; that
is no error. The HPA that KEDA creates for a ScaledObject (owned by it, named ``keda-hpa-*``) is
reported as its ScaledObject.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from . import apply as kube
from .crd import GROUP, KIND
from .events import warning_event
from .status import merge_conditions, now_rfc3339
from .status_writer import update_status

logger = logging.getLogger(__name__)

HPA = "HorizontalPodAutoscaler"
SCALED_OBJECT = "ScaledObject"
REASON = "ForeignAutoscaler"

# scaleTargetRef kind -> the API groups that kind may name for it.
_WORKLOAD_GROUPS = {"Deployment": {"apps"}, "LeaderWorkerSet": {"leaderworkerset.x-k8s.io"}}


@dataclass(frozen=True)
class ForeignScaler:
    """One HPA or ScaledObject whose ``scaleTargetRef`` reaches an LLMDeployment.

    Attributes:
        kind: ``HorizontalPodAutoscaler`` or ``ScaledObject``.
        namespace, name: the scaler object.
        target_kind: what it scales: ``Deployment``, ``LeaderWorkerSet`` or ``LLMDeployment``.
    """

    kind: str
    namespace: str
    name: str
    target_kind: str

    @property
    def on_workload(self) -> bool:
        """True when it writes the child workload's replicas directly."""
        return self.target_kind != KIND

    def describe(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name} (scaleTargetRef {self.target_kind})"


def _group(api_version: str | None) -> str:
    return (api_version or "").rpartition("/")[0] if "/" in (api_version or "") else ""


def scale_target(obj: dict[str, Any]) -> tuple[str, str, str] | None:
    """(API group, kind, name) of a scaler's ``spec.scaleTargetRef``, or None if it has none.

    A ScaledObject's ref defaults to ``apps/v1`` Deployment, as KEDA defaults it.
    """
    ref = (obj.get("spec") or {}).get("scaleTargetRef") or {}
    if not ref.get("name"):
        return None
    if obj.get("kind") == SCALED_OBJECT:
        return _group(ref.get("apiVersion") or "apps/v1"), ref.get("kind") or "Deployment", ref["name"]
    return _group(ref.get("apiVersion")), ref.get("kind") or "", ref["name"]


def targets(obj: dict[str, Any], name: str) -> str | None:
    """The kind of object ``obj`` (an HPA or ScaledObject) scales for LLMDeployment ``name``:
    ``Deployment``, ``LeaderWorkerSet``, ``LLMDeployment``, or None when it scales something else."""
    target = scale_target(obj)
    if target is None or target[2] != name:
        return None
    group, kind, _ = target
    if kind == KIND and group == GROUP:
        return KIND
    if group in _WORKLOAD_GROUPS.get(kind, ()):
        return kind
    return None


def _made_by_keda(obj: dict[str, Any]) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("kind") == SCALED_OBJECT and str(r.get("apiVersion", "")).startswith("keda.sh/") for r in refs)


def find(client: kube.KubeClient, namespace: str, name: str) -> list[ForeignScaler]:
    """The HPAs and ScaledObjects in ``namespace`` that scale LLMDeployment ``name`` or its
    workload, sorted by kind and name.

    Raises:
        ApiError: a list failed for another reason than the kind not being served (404).
    """
    found: list[ForeignScaler] = []
    for kind in (HPA, SCALED_OBJECT):
        try:
            items = client.list(kind, namespace, {})
        except kube.ApiError as exc:
            if exc.status != 404:  # 404: KEDA (or the autoscaling/v2 API) is not installed
                raise
            continue
        for obj in items:
            if (obj.get("metadata") or {}).get("deletionTimestamp"):
                continue
            if kind == HPA and _made_by_keda(obj):
                continue  # its ScaledObject is listed instead
            target_kind = targets({**obj, "kind": kind}, name)
            if target_kind is not None:
                found.append(ForeignScaler(kind, namespace, obj["metadata"]["name"], target_kind))
    return sorted(found, key=lambda s: (s.kind, s.name))


def condition(scalers: list[ForeignScaler], autoscaling_enabled: bool) -> dict[str, str]:
    """``ScalingActive=False``, reason ``ForeignAutoscaler``, with a message naming the scalers
    and saying what kvpilot does about them. ``scalers`` must not be empty."""
    names = ", ".join(s.describe() for s in scalers)
    if any(s.on_workload for s in scalers):
        what = ("scales the workload directly; kvpilot leaves its replicas to it"
                + (" and its own autoscaler stands by" if autoscaling_enabled else ""))
    else:
        what = ("scales this LLMDeployment through its scale subresource; kvpilot's autoscaler stands by "
                "and spec.replicas rules" if autoscaling_enabled else
                "scales this LLMDeployment through its scale subresource; spec.replicas rules")
    advice = (" Use one autoscaler: delete the other one, or set spec.autoscaling.enabled=false."
              if autoscaling_enabled else "")
    return {"type": "ScalingActive", "status": "False", "reason": REASON, "message": f"{names} {what}.{advice}"}


def report(client: kube.KubeClient, cr: dict[str, Any], scalers: list[ForeignScaler], autoscaling_enabled: bool,
           log: Any = logger) -> bool:
    """Write :func:`condition` to the CR's status and, when it is new (or names other scalers),
    post a Warning Event with reason ``ForeignAutoscaler``. Best effort: a failed write is logged.

    Returns True when the condition changed.
    """
    meta = cr["metadata"]
    ns, name = meta.get("namespace") or "default", meta["name"]
    cond = condition(scalers, autoscaling_enabled)
    changed = []

    def compute(fresh: dict[str, Any]) -> dict[str, Any] | None:
        old = (fresh.get("status") or {}).get("conditions") or []
        prev = next((c for c in old if c.get("type") == cond["type"]), {})
        if (prev.get("status"), prev.get("reason"), prev.get("message")) == (cond["status"], REASON, cond["message"]):
            return None
        changed.append(True)
        return {"conditions": merge_conditions(old, [cond], now_rfc3339())}

    try:
        update_status(client, ns, name, compute)
        if changed:
            log.warning("%s/%s: %s", ns, name, cond["message"])
            client.request("POST", kube.resource_path("v1", "events", ns), warning_event(cr, REASON, cond["message"]))
    except (kube.ApiError, OSError) as exc:
        log.warning("could not report %s on %s/%s: %s", REASON, ns, name, exc)
    return bool(changed)

