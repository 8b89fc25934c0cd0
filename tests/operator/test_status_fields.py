"""Every status field the CRD declares is written by the operator (none documented but unused)."""

from __future__ import annotations

from kvpilot.operator.autoscale_daemon import autoscaling_status
from kvpilot.operator.autoscaler import Decision, ScalingHistory, ScalingPolicy, decide
from kvpilot.operator.crd import normalize, openapi_schema
from kvpilot.operator.status import desired_status
from support.operator_harness import make_cr


def test_every_declared_status_field_is_written():
    declared = set(openapi_schema()["properties"]["status"]["properties"])
    cr = make_cr("m")
    cr["metadata"]["generation"] = 1
    cr = normalize(cr)
    written = set(desired_status(cr, None, "2026-01-01T00:00:00Z", observed_generation=True))
    policy = ScalingPolicy.from_spec({"enabled": True, "minReplicas": 1, "maxReplicas": 3}, 1)
    decision: Decision = decide([], 1, policy, ScalingHistory(), 0.0)
    written |= set(autoscaling_status(decision, {}, 0.0)) | {"lastScaleTime"}
    written.add("lora")  # written from pod events (handlers._sync_lora_status, status.lora_status)
    assert declared - written == set(), "declared in the CRD but never written"
    assert "engine" not in declared
