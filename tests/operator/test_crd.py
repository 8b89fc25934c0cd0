"""The LLMDeployment CRD: itself a valid CRD, its defaults, and its admission rules (schema and
CEL, evaluated with cel-python) on the example CRs and on a set of impossible ones."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml

from kvpilot.operator import crd
from kvpilot.operator.render import render
from support.k8s_validate import validate_all
from support.paths import REPO

REPO = REPO
EXAMPLES = sorted((REPO / "examples" / "deployments").glob("*.yaml"))


def base() -> dict:
    return {"apiVersion": "serving.kvpilot.io/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": "m", "namespace": "ml"}, "spec": {"model": {"name": "org/model"}}}


def with_spec(**fields) -> dict:
    obj = base()
    obj["spec"].update(copy.deepcopy(fields))
    return obj


def test_crd_is_a_valid_custom_resource_definition():
    doc = crd.load_crd()
    kubernetes_validate.validate(doc, "1.37.0", strict=True)
    assert (doc["spec"]["group"], doc["spec"]["names"]["kind"], doc["spec"]["names"]["plural"], doc["spec"]["scope"]) == \
        ("serving.kvpilot.io", "LLMDeployment", "llmdeployments", "Namespaced")
    (version,) = doc["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}, "scale": {"specReplicasPath": ".spec.replicas",
                                                               "statusReplicasPath": ".status.replicas",
                                                               "labelSelectorPath": ".status.selector"}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {"Model": ".spec.model.name", "TPxPP": ".status.parallelism", "Ready": ".status.readyReplicas",
                       "Desired": ".status.desiredReplicas", "KV": ".status.kvCacheUtilization",
                       "Endpoint": ".status.endpoint", "Age": ".metadata.creationTimestamp"}


def test_defaults_match_the_issue():
    spec = crd.apply_defaults(base(), crd.openapi_schema())["spec"]
    assert spec == {
        "model": {"name": "org/model"},
        "image": "ghcr.io/kvpilot/kvpilot-engine:0.1.0",
        "parallelism": {"tensor": 1, "pipeline": 1},
        "gpusPerNode": 8,
        "replicas": 1,
        "autoscaling": {"enabled": False, "minReplicas": 1, "targetKVCacheUtilization": 0.7, "scrapeIntervalSeconds": 15,
                        "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 300},
        "engine": {"drainTimeoutSeconds": 30},
        "resources": {"gpuResourceName": "nvidia.com/gpu"},
        "storage": {"type": "EmptyDir"},
        "startup": {"timeoutSeconds": 1800},
        "service": {"type": "ClusterIP", "port": 8000},
        "router": {"enabled": False, "replicas": 1, "imbalance": 0.5, "slack": 8, "scrapeIntervalSeconds": 2,
                   "holdTimeoutSeconds": 60},
    }


def test_explicit_values_are_not_overridden_by_defaults():
    spec = crd.apply_defaults(with_spec(parallelism={"tensor": 4}, hfTokenSecret={"name": "s"}), crd.openapi_schema())["spec"]
    assert spec["parallelism"] == {"tensor": 4, "pipeline": 1}
    assert spec["hfTokenSecret"] == {"name": "s", "key": "token"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_admitted_and_render_valid_objects(path):
    (doc,) = list(yaml.safe_load_all(path.read_text()))
    crd.normalize(doc)
    validate_all(render(doc))


def test_examples_cover_the_three_shapes():
    shapes = {}
    for path in EXAMPLES:
        doc = crd.normalize(yaml.safe_load(path.read_text()))
        par = doc["spec"]["parallelism"]
        shapes[(par["tensor"], par["pipeline"])] = render(doc)[0]["kind"]
    assert shapes == {(1, 1): "Deployment", (4, 1): "Deployment", (8, 2): "LeaderWorkerSet"}


BAD = [
    ("zero tensor", with_spec(parallelism={"tensor": 0}), "spec.parallelism.tensor: 0 is less than the minimum of 1"),
    ("negative pipeline", with_spec(parallelism={"pipeline": -1}), "spec.parallelism.pipeline: -1 is less than the minimum of 1"),
    ("zero gpusPerNode", with_spec(gpusPerNode=0), "spec.gpusPerNode: 0 is less than the minimum of 1"),
    ("negative replicas", with_spec(replicas=-1), "spec.replicas: -1 is less than the minimum of 0"),
    ("12 GPUs on 8-GPU nodes", with_spec(parallelism={"tensor": 4, "pipeline": 3}), "fill whole nodes"),
    ("TP 6 on 4-GPU nodes", with_spec(parallelism={"tensor": 6}, gpusPerNode=4), "fill whole nodes"),
    ("min above max", with_spec(autoscaling={"enabled": True, "minReplicas": 5, "maxReplicas": 2}),
     "minReplicas must not exceed"),
    ("autoscaling without max", with_spec(autoscaling={"enabled": True}), "maxReplicas is required"),
    ("target 0", with_spec(autoscaling={"targetKVCacheUtilization": 0}), "less than or equal to the minimum of 0"),
    ("target above 1", with_spec(autoscaling={"targetKVCacheUtilization": 1.5}), "greater than the maximum of 1"),
    ("free fraction 0", with_spec(engine={"kvCache": {"freeGpuMemoryFraction": 0}}), "less than or equal to the minimum of 0"),
    ("zero max batch", with_spec(engine={"maxBatchSize": 0}), "less than the minimum of 1"),
    ("bad pvc uri", with_spec(model={"name": "pvc://Bad_Claim/x"}), "pvc://CLAIM"),
    ("pvc storage without claim", with_spec(storage={"type": "PersistentVolumeClaim"}), "claimName is required"),
    ("unknown field", with_spec(paralelism={"tensor": 2}), "'paralelism' was unexpected"),
    ("no model", with_spec(model={}), "'name' is a required property"),
    ("bad service type", with_spec(service={"type": "Ingress"}), "'Ingress' is not one of"),
    ("port out of range", with_spec(service={"port": 70000}), "greater than the maximum of 65535"),
    ("short startup", with_spec(startup={"timeoutSeconds": 0}), "less than the minimum of 10"),
    ("TP 3: heads split unevenly", with_spec(parallelism={"tensor": 3}), "power of two"),
    ("TP 5", with_spec(parallelism={"tensor": 5}), "power of two"),
    ("TP larger than a node", with_spec(parallelism={"tensor": 16}), "must divide gpusPerNode"),
    ("TP 3 x PP 4 on 4-GPU nodes", with_spec(parallelism={"tensor": 3, "pipeline": 4}, gpusPerNode=4), "power of two"),
    ("s3 model", with_spec(model={"name": "s3://bucket/llama"}), "other URLs"),
    ("hf model URL", with_spec(model={"name": "hf://meta-llama/Llama-3.1-8B"}), "other URLs"),
    ("memory: lots", with_spec(resources={"memory": "lots"}), "non-negative Kubernetes quantity"),
    ("negative cpu", with_spec(resources={"cpu": "-3"}), "non-negative Kubernetes quantity"),
    ("bad shm size", with_spec(resources={"shmSize": "big"}), "non-negative Kubernetes quantity"),
    ("bad storage size", with_spec(storage={"size": "1 TB"}), "non-negative Kubernetes quantity"),
    ("name with capitals", {**with_spec(), "metadata": {"name": "Bad_Name"}}, "DNS-1035 label"),
    ("name too long", {**with_spec(), "metadata": {"name": "a" * 64}}, "DNS-1035 label"),
]


@pytest.mark.parametrize("name,obj,message", BAD, ids=[b[0] for b in BAD])
def test_bad_crs_are_rejected(name, obj, message):
    with pytest.raises(crd.InvalidLLMDeployment) as info:
        crd.normalize(obj)
    assert any(message in e for e in info.value.errors), info.value.errors


SHAPE_MESSAGES = ("fill whole nodes", "power of two", "must divide gpusPerNode")


@pytest.mark.parametrize("tp,pp,gpus,ok", [(8, 1, 8, True), (3, 1, 8, False), (8, 2, 8, True), (16, 1, 8, False),
                                            (4, 4, 8, True), (3, 3, 8, False), (8, 3, 16, False), (2, 2, 2, True),
                                            (5, 1, 8, False), (3, 4, 4, False), (2, 4, 4, True), (4, 1, 6, False)])
def test_shape_rule(tp, pp, gpus, ok):
    obj = with_spec(parallelism={"tensor": tp, "pipeline": pp}, gpusPerNode=gpus)
    if ok:
        crd.normalize(obj)
    else:
        with pytest.raises(crd.InvalidLLMDeployment) as info:
            crd.normalize(obj)
        assert any(m in e for e in info.value.errors for m in SHAPE_MESSAGES), info.value.errors


def test_every_cel_rule_compiles_and_has_a_message():
    rules = []

    def walk(schema):
        rules.extend(schema.get("x-kubernetes-validations", []))
        for sub in schema.get("properties", {}).values():
            walk(sub)
        if isinstance(schema.get("items"), dict):
            walk(schema["items"])

    walk(crd.openapi_schema())
    # 6 + TP power of two, TP within a node, model URL form, 4 quantities, 4 for lora.adapters,
    # expert parallelism dividing tensor
    assert len(rules) == 18
    for rule in rules:
        assert rule["message"]
        crd._compile_cel(rule["rule"])


def test_kind_and_name_are_checked():
    obj = base()
    obj["kind"] = "Deployment"
    del obj["metadata"]["name"]
    with pytest.raises(crd.InvalidLLMDeployment) as info:
        crd.normalize(obj)
    assert len(info.value.errors) == 2
