"""core/v1 Events on an LLMDeployment, as ``kubectl describe`` shows them."""

from __future__ import annotations

import uuid
from typing import Any

from .crd import KIND
from .status import now_rfc3339

EVENT_SOURCE = "kvpilot-operator"


def warning_event(cr: dict[str, Any], reason: str, message: str) -> dict[str, Any]:
    """A core/v1 Warning Event on the CR (named ``{cr name}.{random hex}``, as kubectl shows them)."""
    meta = cr["metadata"]
    ns = meta.get("namespace") or "default"
    stamp = now_rfc3339()
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": ns},
        "involvedObject": {"apiVersion": cr.get("apiVersion"), "kind": cr.get("kind", KIND), "name": meta["name"],
                           "namespace": ns, "uid": meta.get("uid")},
        "type": "Warning", "reason": reason, "message": message[:1000],
        "source": {"component": EVENT_SOURCE}, "reportingComponent": EVENT_SOURCE,
        "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
    }
