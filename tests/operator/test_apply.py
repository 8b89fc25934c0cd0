"""apply(): create-then-merge-patch with owned fields, against an in-memory API; and the status
conditions computed from a child workload."""

from __future__ import annotations

import copy
import json

import pytest

from kvpilot.operator import apply as kube
from kvpilot.operator.crd import normalize
from kvpilot.operator.render import render
from kvpilot.operator.status import desired_status, merge_conditions, status_patch, workload_conditions


class FakeApi:
    """Stores objects by (kind, ns, name); merge-patches like RFC 7386; records writes."""

    def __init__(self):
        self.objects: dict = {}
        self.writes: list[str] = []

    def get(self, kind, ns, name):
        obj = self.objects.get((kind, ns, name))
        return copy.deepcopy(obj) if obj is not None else None

    def create(self, obj):
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        if key in self.objects:
            raise kube.ApiError(409, "exists")
        self.objects[key] = copy.deepcopy(obj)
        self.writes.append(f"create {obj['kind']}")
        return obj

    def merge_patch(self, kind, ns, name, patch, subresource=None):
        def merge(target, p):
            if not isinstance(p, dict):
                return p
            target = dict(target) if isinstance(target, dict) else {}
            for k, v in p.items():
                if v is None:
                    target.pop(k, None)
                else:
                    target[k] = merge(target.get(k), v)
            return target

        self.objects[(kind, ns, name)] = merge(self.objects[(kind, ns, name)], patch)
        self.writes.append(f"patch {kind}")
        return self.objects[(kind, ns, name)]

    def delete(self, kind, ns, name):
        self.objects.pop((kind, ns, name), None)
        self.writes.append(f"delete {kind}")


def cr(**spec):
    return {"apiVersion": "serving.kvpilot.io/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": "m", "namespace": "ml", "uid": "u1", "generation": 3},
            "spec": {"model": {"name": "org/m"}, **spec}}


def test_create_then_unchanged_then_patch_removes_dropped_fields():
    api = FakeApi()
    dep = render(cr(nodeSelector={"pool": "a"}))[0]
    assert kube.apply(api, dep).action == "created"
    assert kube.apply(api, dep).action == "unchanged"
    assert api.writes == ["create Deployment"]
    # The user drops nodeSelector: the patch must delete it, not leave it behind.
    dep2 = render(cr())[0]
    assert kube.apply(api, dep2).action == "patched"
    live = api.get("Deployment", "ml", "m")
    assert "nodeSelector" not in live["spec"]["template"]["spec"]
    assert live["spec"] == dep2["spec"]
    assert json.loads(live["metadata"]["annotations"][kube.LAST_APPLIED]) == kube.owned_fields(dep2)
    assert kube.apply(api, dep2).action == "unchanged"


def test_server_defaults_and_canonical_quantities_are_not_drift():
    api = FakeApi()
    dep = render(cr(resources={"cpu": "0.5"}))[0]
    kube.apply(api, dep)
    live = api.objects[("Deployment", "ml", "m")]
    container = live["spec"]["template"]["spec"]["containers"][0]
    container["terminationMessagePath"] = "/dev/termination-log"  # server default
    container["resources"]["requests"]["cpu"] = "500m"  # server canonical form of 0.5
    assert kube.apply(api, dep).action == "unchanged"
    container["image"] = "someone/else:edited"  # real drift is repaired
    assert kube.apply(api, dep).action == "patched"
    assert api.get("Deployment", "ml", "m")["spec"]["template"]["spec"]["containers"][0]["image"] == dep["spec"]["template"]["spec"]["containers"][0]["image"]


def test_foreign_object_is_not_taken_over():
    api = FakeApi()
    svc = render(cr())[1]
    foreign = copy.deepcopy(svc)
    foreign["metadata"]["ownerReferences"][0]["uid"] = "other"
    api.objects[("Service", "ml", "m")] = foreign
    with pytest.raises(kube.NotOwnedError):
        kube.apply(api, svc)


def test_delete_if_owned_only_deletes_our_child():
    api = FakeApi()
    kube.apply(api, render(cr())[0])
    assert not kube.delete_if_owned(api, "Deployment", "ml", "m", "someone-else")
    assert kube.delete_if_owned(api, "Deployment", "ml", "m", "u1")
    assert api.get("Deployment", "ml", "m") is None


@pytest.mark.parametrize("desired,live,ok", [
    ({"a": 1}, {"a": 1, "b": 2}, True), ({"a": [1, 2]}, {"a": [1]}, False), ({"a": "1Gi"}, {"a": "1024Mi"}, True),
    ({"a": "x"}, {"a": "y"}, False), ({"a": 1}, {"a": True}, False), ({"a": {"b": None}}, {"a": {}}, False),
])
def test_is_subset(desired, live, ok):
    assert kube.is_subset(desired, live) is ok


def test_merge_patch_nulls_what_disappeared():
    assert kube.merge_patch({"a": 1, "b": {"c": 1, "d": 2}}, {"b": {"c": 3}, "e": [1]}) == \
        {"a": None, "b": {"d": None, "c": 3}, "e": [1]}


def _deployment_status(**status):
    return {"kind": "Deployment", "metadata": {"generation": 2}, "status": {"observedGeneration": 2, **status}}


def test_conditions_from_a_child():
    spec = normalize(cr(replicas=2))
    assert workload_conditions(spec, None)[0] == {"type": "Ready", "status": "False", "reason": "WorkloadMissing",
                                                  "message": "the Deployment does not exist yet"}
    rolling = workload_conditions(spec, _deployment_status(replicas=2, readyReplicas=2, updatedReplicas=1))
    assert [(c["type"], c["status"], c["reason"]) for c in rolling] == [
        ("Ready", "True", "ReplicasReady"), ("Progressing", "True", "RollingOut"), ("Degraded", "False", "AsExpected")]
    stuck = _deployment_status(replicas=2, readyReplicas=1, updatedReplicas=2, conditions=[
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "too slow"}])
    assert workload_conditions(spec, stuck)[2] == {"type": "Degraded", "status": "True",
                                                   "reason": "ProgressDeadlineExceeded", "message": "too slow"}
    unseen = {"kind": "Deployment", "metadata": {"generation": 3}, "status": {"observedGeneration": 2, "replicas": 2,
                                                                                "readyReplicas": 2, "updatedReplicas": 2}}
    assert workload_conditions(spec, unseen)[1]["reason"] == "ObservingChange"


def test_transition_time_moves_only_on_status_change_and_foreign_conditions_stay():
    old = [{"type": "MetricsAvailable", "status": "True", "reason": "Scraped", "message": "", "lastTransitionTime": "t0"},
           {"type": "Ready", "status": "False", "reason": "ReplicasNotReady", "message": "0/1", "lastTransitionTime": "t0"}]
    same = merge_conditions(old, [{"type": "Ready", "status": "False", "reason": "ReplicasNotReady", "message": "0/2"}], "t1")
    assert same[1]["lastTransitionTime"] == "t0" and same[1]["message"] == "0/2" and same[0] == old[0]
    flipped = merge_conditions(old, [{"type": "Ready", "status": "True", "reason": "ReplicasReady", "message": ""}], "t1", 4)
    assert flipped[1]["lastTransitionTime"] == "t1" and flipped[1]["observedGeneration"] == 4


def test_status_is_not_rewritten_when_settled():
    obj = normalize(cr())
    child = _deployment_status(replicas=1, readyReplicas=1, updatedReplicas=1)
    status = desired_status(obj, child, "t1", observed_generation=True)
    assert status["observedGeneration"] == 3 and status["desiredReplicas"] == 1 and status["readyReplicas"] == 1
    obj["status"] = status
    assert status_patch(obj, desired_status(obj, child, "t2", observed_generation=True)) == {}
    auto = normalize(cr(autoscaling={"enabled": True, "maxReplicas": 3}))
    assert "desiredReplicas" not in desired_status(auto, child, "t1")  # the autoscaler's field
