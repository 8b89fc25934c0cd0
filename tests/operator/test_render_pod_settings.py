"""Pod settings users need: pull secrets, service account, priority class, labels/annotations,
extra resources (RDMA), hostIPC, sidecars and extra volumes; all valid Kubernetes objects."""

from __future__ import annotations

import kubernetes_validate
import pytest

from kvpilot.operator import crd
from kvpilot.operator.render import render
from support.operator_harness import make_cr

POD = {
    "labels": {"team": "search", "app.kubernetes.io/name": "mine"},
    "annotations": {"prometheus.io/scrape": "true"},
    "imagePullSecrets": [{"name": "regcred"}],
    "serviceAccountName": "engine-sa",
    "priorityClassName": "inference-high",
    "hostIPC": True,
    "extraResources": {"rdma/ib": 1},
    "sidecars": [{"name": "log-shipper", "image": "fluent/fluent-bit:3.0"}],
    "extraVolumes": [{"name": "nccl-topo", "configMap": {"name": "nccl-topo"}}],
    "extraVolumeMounts": [{"name": "nccl-topo", "mountPath": "/etc/nccl", "readOnly": True}],
}


@pytest.mark.parametrize("parallelism", [{"tensor": 4}, {"tensor": 8, "pipeline": 2}])
def test_pod_settings_reach_every_engine_pod(parallelism):
    objects = render(make_cr("m", {"model": {"name": "org/model"}, "parallelism": parallelism, "pod": POD}))
    workload = objects[0]
    templates = ([workload["spec"]["template"]] if workload["kind"] == "Deployment" else
                 [workload["spec"]["leaderWorkerTemplate"][k] for k in ("leaderTemplate", "workerTemplate")])
    for template in templates:
        meta, pod = template["metadata"], template["spec"]
        assert meta["labels"]["team"] == "search"
        assert meta["labels"]["app.kubernetes.io/name"] == "kvpilot", "kvpilot's selector labels win"
        assert meta["annotations"]["prometheus.io/scrape"] == "true"
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
        assert pod["serviceAccountName"] == "engine-sa" and pod["priorityClassName"] == "inference-high"
        assert pod["hostIPC"] is True
        engine = pod["containers"][0]
        assert engine["resources"]["requests"]["rdma/ib"] == "1" == engine["resources"]["limits"]["rdma/ib"]
        assert [c["name"] for c in pod["containers"]] == ["engine", "log-shipper"]
        assert {"name": "nccl-topo", "configMap": {"name": "nccl-topo"}} in pod["volumes"]
        assert {"name": "nccl-topo", "mountPath": "/etc/nccl", "readOnly": True} in engine["volumeMounts"]
    if workload["kind"] == "Deployment":
        kubernetes_validate.validate(workload, "1.35.0", strict=True)


def test_without_pod_settings_nothing_is_added():
    pod = render(make_cr("m", {"model": {"name": "org/model"}}))[0]["spec"]["template"]["spec"]
    assert not {"imagePullSecrets", "serviceAccountName", "priorityClassName", "hostIPC"} & set(pod)
    assert len(pod["containers"]) == 1


def test_bad_extra_resource_quantity_is_rejected():
    with pytest.raises(crd.InvalidLLMDeployment, match="non-negative Kubernetes quantity"):
        crd.normalize(make_cr("m", {"model": {"name": "org/model"}, "pod": {"extraResources": {"rdma/ib": "many"}}}))
