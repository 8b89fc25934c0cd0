"""render(): field-by-field for TP 1, TP 4, TP 2 x PP 2 and TP 8 x PP 2 on 8-GPU nodes, and every
rendered object validated against the Kubernetes OpenAPI schema of its kind."""

from __future__ import annotations

import copy

import pytest
import yaml

from kvpilot.operator.crd import InvalidLLMDeployment, normalize
from kvpilot.operator.render import render, selector_string, serving_selector
from support.k8s_validate import validate_all# noqa: F401

LABELS = {
    "app.kubernetes.io/name": "kvpilot",
    "app.kubernetes.io/instance": "llama",
    "app.kubernetes.io/component": "engine",
    "app.kubernetes.io/part-of": "kvpilot",
    "app.kubernetes.io/managed-by": "kvpilot-operator",
    "serving.kvpilot.io/llmdeployment": "llama",
    "app.kubernetes.io/version": "0.1.0",
}
SELECTOR = {"app.kubernetes.io/name": "kvpilot", "app.kubernetes.io/instance": "llama", "app.kubernetes.io/component": "engine"}
OWNER = [{"apiVersion": "serving.kvpilot.io/v1alpha1", "kind": "LLMDeployment", "name": "llama", "uid": "1234",
          "controller": True, "blockOwnerDeletion": True}]
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
MODEL_DIR = f"/models/hub/{MODEL}/main"
HEALTH = {"path": "/health", "port": "http"}
LIVE = {"path": "/v1/health/live", "port": "http"}
SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"}}

def cr(spec_extra: dict | None = None, **parallelism) -> dict:
    spec = {"model": {"name": MODEL}}
    if parallelism:
        spec["parallelism"] = parallelism
    spec.update(spec_extra or {})
    return {"apiVersion": "serving.kvpilot.io/v1alpha1", "kind": "LLMDeployment",
            "metadata": {"name": "llama", "namespace": "ml", "uid": "1234"}, "spec": spec}


def engine_args(tp: int, pp: int) -> list[str]:
    return ["serve", MODEL_DIR, "--host", "0.0.0.0", "--port", "8000", "--tensor-parallel-size", str(tp),
            "--pipeline-parallel-size", str(pp), "--served-model-name", MODEL, "--drain-timeout", "30"]


def check_common(objects: list[dict], workload_kind: str) -> None:
    assert [o["kind"] for o in objects] == [workload_kind, "Service", "PodDisruptionBudget"]
    for obj in objects:
        assert obj["metadata"] == {"name": "llama", "namespace": "ml", "labels": LABELS, "ownerReferences": OWNER}
    validate_all(objects)


def check_pod(pod: dict, gpus: int, args: list[str], leader: bool = True, multi_node: bool = False) -> None:
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["terminationGracePeriodSeconds"] == 45  # preStop 5 + drain 30 + margin 10
    assert pod["automountServiceAccountToken"] is False
    assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{gpus}Gi"}},
                              {"name": "models", "emptyDir": {}}]
    (init,) = pod["initContainers"]
    assert init["command"] == ["hf", "download", MODEL, "--revision", "main", "--local-dir", MODEL_DIR]
    (c,) = pod["containers"]
    assert c["name"] == "engine" and c["image"] == "ghcr.io/kvpilot/kvpilot-engine:0.1.0"
    assert c["command"] == ["kvpilot"] and c["args"] == args
    assert c["resources"] == {"requests": {"nvidia.com/gpu": str(gpus)}, "limits": {"nvidia.com/gpu": str(gpus)}}
    assert c["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "models", "mountPath": "/models"}]
    assert c["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "5"]}}}
    assert c["securityContext"] == SECURITY
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HF_HOME"] == "/models/.cache/huggingface"
    if multi_node:
        assert env["MASTER_PORT"] == "29500" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    else:
        assert "MASTER_PORT" not in env
    if leader:
        ports = [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
        if multi_node:
            ports.append({"name": "dist", "containerPort": 29500, "protocol": "TCP"})
        assert c["ports"] == ports
        assert c["startupProbe"] == {"httpGet": HEALTH, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 180}
        assert c["readinessProbe"] == {"httpGet": HEALTH, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3}
        assert c["livenessProbe"] == {"httpGet": LIVE, "periodSeconds": 15, "timeoutSeconds": 10, "failureThreshold": 3}
    else:
        assert not {"ports", "startupProbe", "readinessProbe", "livenessProbe"} & set(c)


def check_deployment(dep: dict, gpus: int, tp: int, pp: int) -> None:
    spec = dep["spec"]
    assert spec["replicas"] == 1
    assert spec["selector"] == {"matchLabels": SELECTOR}
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert spec["progressDeadlineSeconds"] == 1800 + 600
    assert spec["template"]["metadata"]["labels"] == {**LABELS, "serving.kvpilot.io/workload": "Deployment"}
    check_pod(spec["template"]["spec"], gpus, engine_args(tp, pp))


def check_service_and_pdb(objects: list[dict], selector: dict) -> None:
    svc, pdb = objects[1], objects[2]
    assert svc["spec"] == {"type": "ClusterIP", "selector": selector,
                           "ports": [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]}
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": SELECTOR},
                           "unhealthyPodEvictionPolicy": "AlwaysAllow"}


@pytest.mark.parametrize("tp,pp", [(1, 1), (4, 1), (2, 2)])
def test_single_node_deployment(tp, pp):
    objects = render(cr(tensor=tp, pipeline=pp))
    check_common(objects, "Deployment")
    check_deployment(objects[0], tp * pp, tp, pp)
    check_service_and_pdb(objects, SELECTOR)


def test_tp8_pp2_leader_worker_set():
    objects = render(cr(tensor=8, pipeline=2))
    check_common(objects, "LeaderWorkerSet")
    lws = objects[0]["spec"]
    assert lws["replicas"] == 1 and lws["startupPolicy"] == "LeaderCreated"
    assert lws["rolloutStrategy"] == {"type": "RollingUpdate", "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0}}
    group = lws["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    for key, leader in (("leaderTemplate", True), ("workerTemplate", False)):
        assert group[key]["metadata"]["labels"] == {**LABELS, "serving.kvpilot.io/workload": "LeaderWorkerSet"}
        check_pod(group[key]["spec"], 8, engine_args(8, 2), leader=leader, multi_node=True)
    leaders = {**SELECTOR, "leaderworkerset.sigs.k8s.io/worker-index": "0"}
    check_service_and_pdb(objects, leaders)
    assert selector_string(serving_selector(normalize(cr(tensor=8, pipeline=2)))) == (
        "app.kubernetes.io/component=engine,app.kubernetes.io/instance=llama,app.kubernetes.io/name=kvpilot,"
        "leaderworkerset.sigs.k8s.io/worker-index=0")


def test_16_gpus_on_8_gpu_nodes_is_two_pods_of_8_and_tp_stays_in_a_node():
    lws = render(cr(tensor=8, pipeline=2))[0]["spec"]["leaderWorkerTemplate"]
    assert lws["size"] == 2
    assert lws["workerTemplate"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    with pytest.raises(ValueError, match="must divide gpusPerNode"):  # TP 16 would straddle two nodes
        render(cr(tensor=16))


def test_every_engine_setting_becomes_a_flag():
    extra = {
        "engine": {"maxSeqLen": 8192, "maxBatchSize": 64, "maxNumTokens": 4096, "dtype": "bfloat16",
                   "kvCache": {"freeGpuMemoryFraction": 0.85, "enableBlockReuse": False, "dtype": "auto", "tokensPerBlock": 64},
                   "drainTimeoutSeconds": 120, "extraArgs": ["--api-key", "k"],
                   "env": [{"name": "HF_HOME", "value": "/elsewhere"}]},
        "model": {"name": MODEL, "revision": "0e9e39f", "servedModelName": "llama-8b"},
        "resources": {"cpu": "0.5", "memory": "32Gi", "shmSize": "16Gi", "gpuResourceName": "amd.com/gpu"},
        "hfTokenSecret": {"name": "hf"},
        "nodeSelector": {"gpu": "h200"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "storage": {"type": "PersistentVolumeClaim", "claimName": "model-cache"},
        "startup": {"timeoutSeconds": 3600},
        "service": {"type": "LoadBalancer", "port": 80},
    }
    objects = render(cr(extra))
    validate_all(objects)
    pod = objects[0]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    path = f"/models/hub/{MODEL}/0e9e39f"
    assert c["args"] == ["serve", path, "--host", "0.0.0.0", "--port", "8000", "--tensor-parallel-size", "1",
                         "--pipeline-parallel-size", "1", "--served-model-name", "llama-8b", "--drain-timeout", "120",
                         "--max-seq-len", "8192", "--max-batch-size", "64", "--max-num-tokens", "4096",
                         "--dtype", "bfloat16", "--free-gpu-memory-fraction", "0.85", "--kv-cache-dtype", "auto",
                         "--tokens-per-block", "64", "--no-enable-block-reuse", "--api-key", "k"]
    assert c["resources"] == {"requests": {"amd.com/gpu": "1", "cpu": "0.5", "memory": "32Gi"},
                              "limits": {"amd.com/gpu": "1", "memory": "32Gi"}}
    assert c["env"][-1] == {"name": "HF_HOME", "value": "/elsewhere"}  # the user's entry wins (last)
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in c["env"]
    assert pod["initContainers"][0]["command"] == ["hf", "download", MODEL, "--revision", "0e9e39f", "--local-dir", path]
    assert pod["volumes"][0] == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}
    assert pod["volumes"][1] == {"name": "models", "persistentVolumeClaim": {"claimName": "model-cache"}}
    assert pod["nodeSelector"] == {"gpu": "h200"} and pod["tolerations"] == extra["tolerations"]
    assert pod["terminationGracePeriodSeconds"] == 5 + 120 + 10
    assert c["livenessProbe"]["failureThreshold"] == 3  # /v1/health/live stays 200 through the 125 s drain
    assert c["startupProbe"]["failureThreshold"] == 360
    assert objects[1]["spec"]["type"] == "LoadBalancer" and objects[1]["spec"]["ports"][0]["port"] == 80


def test_pvc_model_is_mounted_read_only_and_not_downloaded():
    objects = render(cr({"model": {"name": "pvc://weights/llama/8b"}}))
    validate_all(objects)
    pod = objects[0]["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    c = pod["containers"][0]
    assert c["args"][1] == "/model-source/llama/8b"
    assert c["args"][c["args"].index("--served-model-name") + 1] == "llama"  # the CR's name
    assert {"name": "model-source", "mountPath": "/model-source", "readOnly": True} in c["volumeMounts"]
    assert {"name": "model-source", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod["volumes"]


@pytest.mark.parametrize("status,expected", [(None, 2), ({"desiredReplicas": 5}, 5), ({"desiredReplicas": 99}, 6),
                                             ({"desiredReplicas": 0}, 2)])
def test_replicas_follow_the_autoscaler_within_bounds(status, expected):
    obj = cr({"replicas": 7, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6}})
    if status:
        obj["status"] = status
    assert render(obj)[0]["spec"]["replicas"] == expected


def test_replicas_from_spec_when_autoscaling_is_off():
    obj = cr({"replicas": 3})
    obj["status"] = {"desiredReplicas": 9}
    assert render(obj)[0]["spec"]["replicas"] == 3


def test_render_is_pure_and_yaml_safe():
    obj = cr(tensor=8, pipeline=2)
    before = copy.deepcopy(obj)
    first, second = render(obj), render(obj)
    assert first == second and obj == before
    # Leader and worker templates must be independent objects (no YAML anchors on output).
    text = yaml.safe_dump_all(first)
    assert "&id" not in text


def test_no_owner_reference_without_uid():
    obj = cr()
    del obj["metadata"]["uid"], obj["metadata"]["namespace"]
    for o in render(obj):
        assert "ownerReferences" not in o["metadata"] and o["metadata"]["namespace"] == "default"


def test_impossible_shape_is_rejected():
    with pytest.raises(InvalidLLMDeployment, match="fill whole nodes"):
        render(cr(tensor=4, pipeline=3))


def test_rendered_engine_args_parse_with_kvpilot_serve():
    """The flags the operator renders must be ones `kvpilot serve` accepts, with the CR's values:
    a flag the server does not know would crash every engine pod at start."""
    import argparse

    from kvpilot.server.cli import _engine_kwargs, configure_parser

    engine = {"maxSeqLen": 8192, "maxBatchSize": 64, "maxNumTokens": 4096, "dtype": "bfloat16",
              "kvCache": {"freeGpuMemoryFraction": 0.85, "enableBlockReuse": False, "dtype": "fp8",
                          "tokensPerBlock": 64}}
    for kv_overrides in ({}, {"enableBlockReuse": True, "dtype": "auto"}):
        spec_engine = dict(engine, kvCache=dict(engine["kvCache"], **kv_overrides))
        objects = render(cr({"engine": spec_engine}, tensor=2))
        validate_all(objects)
        args = objects[0]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[0] == "serve"
        parser = argparse.ArgumentParser()
        configure_parser(parser)
        kw = _engine_kwargs(parser.parse_args(args[1:]))
        kv = kw["kv_cache_config"]
        want_kv = spec_engine["kvCache"]
        assert (kw["tensor_parallel_size"], kw["max_seq_len"], kw["max_batch_size"], kw["max_num_tokens"],
                kw["dtype"]) == (2, 8192, 64, 4096, "bfloat16")
        assert (kv.free_gpu_memory_fraction, kv.enable_block_reuse, kv.dtype, kv.tokens_per_block) == (
            0.85, want_kv["enableBlockReuse"], want_kv["dtype"], 64)
