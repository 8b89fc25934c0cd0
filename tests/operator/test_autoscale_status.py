"""What the autoscaling daemon writes: the status patch, the Event, and their fit with the CRD."""

from __future__ import annotations

import pytest

from kvpilot.operator.autoscale_daemon import autoscaling_enabled, autoscaling_status, rescale_event, rfc3339
from kvpilot.operator.autoscaler import PodMetrics, ScalingHistory, ScalingPolicy, decide
from kvpilot.operator.crd import openapi_schema

T0 = 1700000000.0  # 2023-11-14T22:13:20Z
POLICY = ScalingPolicy(min_replicas=1, max_replicas=4, target_kv_cache_utilization=0.5,
                       scale_down_stabilization_s=0)
CR = {"apiVersion": "serving.kvpilot.io/v1alpha1", "kind": "LLMDeployment",
      "metadata": {"name": "llama", "namespace": "ml", "uid": "u-1"}}


def scale_up():
    pods = [PodMetrics("a", 0.9, 5, 2), PodMetrics("b", 0.7, 3, 0)]
    return decide(pods, 2, POLICY, ScalingHistory(), T0)


def test_status_after_a_scale_up():
    old = {"conditions": [{"type": "Ready", "status": "True", "reason": "ReplicasReady", "message": "",
                           "lastTransitionTime": "2023-01-01T00:00:00Z"}]}
    st = autoscaling_status(scale_up(), old, T0)
    assert st == {
        "desiredReplicas": 4,  # ceil((0.9 + 0.7) / 0.5)
        "kvCacheUtilization": 0.8,
        "queueLength": 2.0,
        "autoscaling": {"recommendations": [{"time": "2023-11-14T22:13:20.000Z", "replicas": 4}]},
        "lastScaleTime": "2023-11-14T22:13:20Z",
        "conditions": [
            old["conditions"][0],  # another writer's condition is kept as it was
            {"type": "ScalingActive", "status": "True", "reason": "ValidMetricFound",
             "message": "the replica count is computed from KV-cache utilisation",
             "lastTransitionTime": "2023-11-14T22:13:20Z"},
            {"type": "ScalingLimited", "status": "False", "reason": "DesiredWithinRange",
             "message": "the desired count is within the bounds", "lastTransitionTime": "2023-11-14T22:13:20Z"},
            {"type": "MetricsAvailable", "status": "True", "reason": "MetricsScraped",
             "message": "2 of 2 pods reported KV-cache utilisation", "lastTransitionTime": "2023-11-14T22:13:20Z"},
        ],
    }


def test_status_without_metrics_clears_numbers_and_keeps_transition_times():
    first = autoscaling_status(scale_up(), {}, T0)
    d = decide([PodMetrics.missing("a", "timeout")], 4, POLICY, ScalingHistory(), T0 + 15)
    st = autoscaling_status(d, first, T0 + 15)
    assert (st["desiredReplicas"], st["kvCacheUtilization"], st["queueLength"]) == (4, None, None)
    assert "lastScaleTime" not in st  # no change of count, so the last scale time stays
    by_type = {c["type"]: c for c in st["conditions"]}
    assert (by_type["MetricsAvailable"]["status"], by_type["MetricsAvailable"]["lastTransitionTime"]) == \
        ("False", rfc3339(T0 + 15))
    # ScalingLimited stayed False, so its transition time is the old one
    assert by_type["ScalingLimited"]["lastTransitionTime"] == rfc3339(T0)


def test_rescale_event():
    ev = rescale_event(CR, scale_up(), T0)
    name = ev["metadata"].pop("name")
    assert name.startswith("llama.") and len(name) == len("llama.") + 16
    assert ev == {
        "apiVersion": "v1", "kind": "Event", "metadata": {"namespace": "ml"},
        "involvedObject": {"apiVersion": "serving.kvpilot.io/v1alpha1", "kind": "LLMDeployment", "name": "llama",
                           "namespace": "ml", "uid": "u-1"},
        "type": "Normal", "reason": "SuccessfulRescale",
        "message": "New size: 4; 2 -> 4 replicas: KV-cache utilisation 0.800 (sum 1.600 over 2 of 2 pods) "
                   "vs target 0.50 recommends 4",
        "source": {"component": "kvpilot-operator"}, "reportingComponent": "kvpilot-operator",
        "firstTimestamp": "2023-11-14T22:13:20Z", "lastTimestamp": "2023-11-14T22:13:20Z", "count": 1,
    }


@pytest.mark.parametrize("spec,expected", [({"autoscaling": {"enabled": True}}, True),
                                           ({"autoscaling": {"enabled": False}}, False), ({}, False), (None, False)])
def test_daemon_filter(spec, expected):
    assert autoscaling_enabled(spec=spec) is expected


def test_crd_keeps_every_status_field_the_autoscaler_writes():
    status_schema = openapi_schema()["properties"]["status"]
    declared = status_schema.get("properties") or {}
    written = autoscaling_status(scale_up(), {}, T0)
    pruned = [k for k in written if k not in declared and not status_schema.get("x-kubernetes-preserve-unknown-fields")]
    assert pruned == []
    history = declared["autoscaling"]
    assert history.get("x-kubernetes-preserve-unknown-fields") or "recommendations" in history.get("properties", {})
