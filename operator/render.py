"""``render(cr)``: the pure function from an LLMDeployment to the Kubernetes objects that run it.

One pair of integers, ``parallelism.tensor`` x ``parallelism.pipeline``, decides everything
else: the GPUs each pod requests, the engine's ``--tensor-parallel-size`` and
``--pipeline-parallel-size``, the size of ``/dev/shm``, and whether the workload is a Deployment
(the whole engine fits on one node) or a LeaderWorkerSet of ``TP x PP / gpusPerNode`` pods per
engine (https://github.com/kubernetes-sigs/lws, API ``leaderworkerset.x-k8s.io/v1``).

Every object carries the standard ``app.kubernetes.io/*`` labels and, when the CR has a
``metadata.uid``, a controller ownerReference to it, so that deleting the CR garbage-collects
them. ``kvpilot render CR.yaml`` prints exactly this list.

Multi-node engines: LWS injects ``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE`` and
``LWS_WORKER_INDEX`` into every pod of a group; the engine reads those to join one
``torch.distributed`` group (rendezvous on the leader at ``MASTER_PORT``). Every pod of the
group runs the same ``kvpilot serve`` command; only the leader (worker index 0) serves HTTP, so
only leaders carry probes and receive Service traffic.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from typing import Any

from .crd import API_VERSION, KIND, normalize

FIELD_MANAGER = "kvpilot"
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"

APP_NAME = "kvpilot"
COMPONENT = "engine"
MANAGED_BY = "kvpilot-operator"
OWNER_LABEL = "serving.kvpilot.io/llmdeployment"
# On engine pods: which workload kind runs them, so that while a shape change crosses the one-node
# boundary the Service can keep selecting only the old workload's pods.
WORKLOAD_LABEL = "serving.kvpilot.io/workload"

ENGINE_CONTAINER = "engine"
HTTP_PORT = 8000  # the engine's port inside the pod; the Service port is spec.service.port
DIST_PORT = 29500  # torch.distributed rendezvous on the leader (torch's MASTER_PORT convention)
MODELS_DIR = "/models"  # the storage volume: model downloads and the Hugging Face cache
MODEL_SOURCE_DIR = "/model-source"  # a pvc:// model's claim, mounted read-only
RUN_AS_USER = 1000  # the non-root user of images/engine.Dockerfile

# Pod termination, in order: preStop sleeps so that endpoint removal reaches every proxy
# before SIGTERM; the engine then drains in-flight requests for drainTimeoutSeconds; the grace
# period covers both plus a margin for process exit.
PRESTOP_SLEEP_SECONDS = 5
TERMINATION_MARGIN_SECONDS = 10
STARTUP_PROBE_PERIOD_SECONDS = 10
LIVENESS_PERIOD_SECONDS = 15
# Deployment's default progress deadline (600 s) is shorter than a big model's load; give the
# rollout the startup budget plus this much for scheduling, image pull and download.
PROGRESS_DEADLINE_MARGIN_SECONDS = 600

_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


@dataclass(frozen=True)
class Shape:
    """How one engine (one replica) is laid out on GPUs and nodes.

    Attributes:
        tensor: tensor-parallel size (GPUs that split every layer).
        pipeline: pipeline-parallel size (stages of consecutive layers).
        gpus_per_node: GPUs on each node of the target pool.
    """

    tensor: int
    pipeline: int
    gpus_per_node: int

    @property
    def total_gpus(self) -> int:
        return self.tensor * self.pipeline

    @property
    def multi_node(self) -> bool:
        """True when one engine needs more GPUs than one node has (a LeaderWorkerSet)."""
        return self.total_gpus > self.gpus_per_node

    @property
    def nodes(self) -> int:
        """Pods per engine: 1, or ``TP x PP / gpusPerNode`` (the CRD rejects non-whole splits)."""
        return self.total_gpus // self.gpus_per_node if self.multi_node else 1

    @property
    def gpus_per_pod(self) -> int:
        return self.gpus_per_node if self.multi_node else self.total_gpus


def shape_of(spec: dict[str, Any]) -> Shape:
    """The :class:`Shape` of a defaulted LLMDeployment spec."""
    par = spec["parallelism"]
    return Shape(tensor=int(par["tensor"]), pipeline=int(par["pipeline"]), gpus_per_node=int(spec["gpusPerNode"]))


def selector_labels(name: str) -> dict[str, str]:
    """Labels that select every engine pod of LLMDeployment ``name`` (immutable once created)."""
    return {"app.kubernetes.io/name": APP_NAME, "app.kubernetes.io/instance": name, "app.kubernetes.io/component": COMPONENT}


def serving_selector(cr: dict[str, Any]) -> dict[str, str]:
    """Labels of the pods that serve HTTP (and /metrics): all pods, or LWS leaders only."""
    return serving_selector_of(cr["metadata"]["name"], workload_kind(cr))


def serving_selector_of(name: str, kind: str) -> dict[str, str]:
    """The serving pods of a workload of ``kind`` (``Deployment`` or ``LeaderWorkerSet``)."""
    labels = selector_labels(name)
    if kind == "LeaderWorkerSet":
        labels[LWS_WORKER_INDEX_LABEL] = "0"
    return labels


def surge_selector(name: str, old_kind: str) -> dict[str, str]:
    """The Service selector while a new workload of the other kind starts: the old workload's
    serving pods only (never the new workload's pods, e.g. LWS workers, which serve no HTTP)."""
    return {**serving_selector_of(name, old_kind), WORKLOAD_LABEL: old_kind}


def selector_string(labels: dict[str, str]) -> str:
    """A label selector in the string form of ``status.selector`` (sorted, comma-separated)."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def common_labels(cr: dict[str, Any]) -> dict[str, str]:
    """The standard ``app.kubernetes.io/*`` labels, plus the owner label used to find children."""
    name = cr["metadata"]["name"]
    labels = {
        **selector_labels(name),
        "app.kubernetes.io/part-of": APP_NAME,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        OWNER_LABEL: name,
    }
    tag = _image_tag(cr["spec"]["image"])
    if tag:
        labels["app.kubernetes.io/version"] = tag
    return labels


def _image_tag(image: str) -> str | None:
    if "@" in image:
        return None
    last = image.rsplit("/", 1)[-1]
    tag = last.rsplit(":", 1)[1] if ":" in last else None
    return tag if tag and _LABEL_VALUE.match(tag) else None


def desired_replicas(cr: dict[str, Any]) -> int:
    """Replicas (engines) the workload should run.

    With autoscaling off: ``spec.replicas``. With it on: ``status.desiredReplicas`` (the
    autoscaler's decision) clamped to ``[minReplicas, maxReplicas]``, or ``minReplicas`` before
    the first decision. The operator never writes ``spec``, so GitOps tools see no drift.
    """
    spec = cr["spec"]
    auto = spec["autoscaling"]
    if not auto["enabled"]:
        return int(spec["replicas"])
    lo, hi = int(auto["minReplicas"]), int(auto.get("maxReplicas", auto["minReplicas"]))
    decided = (cr.get("status") or {}).get("desiredReplicas")
    if decided is None:
        return lo
    return max(lo, min(hi, int(decided)))


def endpoint(cr: dict[str, Any]) -> str:
    """The in-cluster OpenAI base URL, e.g. ``http://NAME.NS.svc:8000/v1``."""
    meta = cr["metadata"]
    return f"http://{meta['name']}.{meta.get('namespace') or 'default'}.svc:{cr['spec']['service']['port']}/v1"


def workload_kind(cr: dict[str, Any]) -> str:
    """``Deployment`` or ``LeaderWorkerSet``: the kind of the child that runs the engines."""
    return "LeaderWorkerSet" if shape_of(cr["spec"]).multi_node else "Deployment"


# ---------------------------------------------------------------------------------------------
# The engine container and its pod.


def _model_location(cr: dict[str, Any]) -> tuple[str, str | None, str | None]:
    """Return (path the engine loads, Hub id to download or None, pvc claim or None)."""
    model = cr["spec"]["model"]
    name = model["name"]
    if name.startswith("pvc://"):
        claim, _, sub = name[len("pvc://"):].partition("/")
        return (f"{MODEL_SOURCE_DIR}/{sub}".rstrip("/"), None, claim)
    if name.startswith("/"):
        return (name, None, None)
    revision = model.get("revision") or "main"
    return (f"{MODELS_DIR}/hub/{name}/{revision}", name, None)


def served_model_name(cr: dict[str, Any]) -> str:
    """The model name clients send: ``servedModelName``, else the Hub id, else the CR name."""
    model = cr["spec"]["model"]
    if model.get("servedModelName"):
        return model["servedModelName"]
    name = model["name"]
    if name.startswith("pvc://") or name.startswith("/"):
        return cr["metadata"]["name"]
    return name


def lora_adapters(cr: dict[str, Any]) -> list[tuple[str, str, str | None, str | None]]:
    """``spec.lora.adapters`` as (name, directory the engine reads, Hub id to download or None,
    revision or None). A Hub adapter is downloaded into ``/models/lora/<id>/<revision>``."""
    out = []
    for a in (cr["spec"].get("lora") or {}).get("adapters") or []:
        source = a["source"]
        if source.startswith("/"):
            out.append((a["name"], source, None, None))
        else:
            revision = a.get("revision") or "main"
            out.append((a["name"], f"{MODELS_DIR}/lora/{source}/{revision}", source, revision))
    return out


def engine_args(cr: dict[str, Any]) -> list[str]:
    """Arguments of ``kvpilot`` in the engine container: ``serve MODEL --flag value ...``."""
    spec = cr["spec"]
    shape = shape_of(spec)
    engine = spec["engine"]
    path, _, _ = _model_location(cr)
    args = [
        "serve", path,
        "--host", "0.0.0.0",
        "--port", str(HTTP_PORT),
        "--tensor-parallel-size", str(shape.tensor),
        "--pipeline-parallel-size", str(shape.pipeline),
        "--served-model-name", served_model_name(cr),
        "--drain-timeout", str(engine["drainTimeoutSeconds"]),
    ]
    if spec["parallelism"].get("expert") is not None:  # MoE: expert groups within the TP ranks, no extra GPUs
        args += ["--moe-expert-parallel-size", str(spec["parallelism"]["expert"])]
    for field, flag in (("maxSeqLen", "--max-seq-len"), ("maxBatchSize", "--max-batch-size"),
                        ("maxNumTokens", "--max-num-tokens"), ("dtype", "--dtype")):
        if engine.get(field) is not None:
            args += [flag, str(engine[field])]
    kv = engine.get("kvCache") or {}
    for field, flag in (("freeGpuMemoryFraction", "--free-gpu-memory-fraction"),
                        ("dtype", "--kv-cache-dtype"), ("tokensPerBlock", "--tokens-per-block")):
        if kv.get(field) is not None:
            args += [flag, str(kv[field])]
    if kv.get("enableBlockReuse") is not None:
        args.append("--enable-block-reuse" if kv["enableBlockReuse"] else "--no-enable-block-reuse")
    lora = spec.get("lora") or {}
    adapters = lora_adapters(cr)
    if adapters:
        args += ["--enable-lora", "--lora-modules", *(f"{name}={path}" for name, path, _, _ in adapters)]
        for field, flag in (("maxLoras", "--max-loras"), ("maxLoraRank", "--max-lora-rank"),
                            ("maxCpuLoras", "--max-cpu-loras")):
            if lora.get(field) is not None:
                args += [flag, str(lora[field])]
    return args + [str(a) for a in engine.get("extraArgs") or []]


def _env(cr: dict[str, Any], multi_node: bool) -> list[dict[str, Any]]:
    spec = cr["spec"]
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": f"{MODELS_DIR}/.cache/huggingface"},
        {"name": "HOME", "value": "/tmp"},  # writable scratch for Triton/torch caches under any UID
    ]
    secret = spec.get("hfTokenSecret")
    if secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret["name"], "key": secret["key"]}}})
    if multi_node:
        env += [
            {"name": "MASTER_PORT", "value": str(DIST_PORT)},
            # A dead peer must abort the collective (and let LWS recreate the group), not hang it.
            {"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "1"},
            {"name": "NCCL_DEBUG", "value": "WARN"},
        ]
    # User entries last, so that they override ours (Kubernetes keeps the last duplicate).
    return env + [dict(e) for e in spec["engine"].get("env") or []]


def _quantity(value: Any) -> str:
    return str(value)


def _resources(spec: dict[str, Any], gpus: int) -> dict[str, Any]:
    res = spec["resources"]
    requests: dict[str, str] = {res["gpuResourceName"]: str(gpus)}
    limits: dict[str, str] = {res["gpuResourceName"]: str(gpus)}
    if res.get("cpu") is not None:
        requests["cpu"] = _quantity(res["cpu"])  # no CPU limit: throttling a GPU feeder only slows it
    if res.get("memory") is not None:
        requests["memory"] = limits["memory"] = _quantity(res["memory"])
    for name, value in sorted(((spec.get("pod") or {}).get("extraResources") or {}).items()):
        requests[name] = limits[name] = _quantity(value)  # extended resources: requests == limits
    return {"requests": requests, "limits": limits}


def _http_get(path: str = "/health") -> dict[str, Any]:
    return {"path": path, "port": "http"}


LIVENESS_PATH = "/v1/health/live"  # 200 while the process is healthy, draining included
READINESS_FAILURES = 3  # one slow answer must not take a pod out of the Service


def _probes(spec: dict[str, Any]) -> dict[str, Any]:
    """Startup and readiness on ``/health`` (503 while loading or draining); liveness on
    ``/v1/health/live``, which stays 200 through a drain, so a wedged engine (no answer within
    10 s, three times in a row) is restarted within about 45 s, drain length notwithstanding."""
    startup_budget = int(spec["startup"]["timeoutSeconds"])
    return {
        # Model loading: /health answers 503 until the engine can serve.
        "startupProbe": {"httpGet": _http_get(), "periodSeconds": STARTUP_PROBE_PERIOD_SECONDS, "timeoutSeconds": 5,
                         "failureThreshold": math.ceil(startup_budget / STARTUP_PROBE_PERIOD_SECONDS)},
        "readinessProbe": {"httpGet": _http_get(), "periodSeconds": 5, "timeoutSeconds": 5,
                           "failureThreshold": READINESS_FAILURES},
        "livenessProbe": {"httpGet": _http_get(LIVENESS_PATH), "periodSeconds": LIVENESS_PERIOD_SECONDS,
                          "timeoutSeconds": 10, "failureThreshold": 3},
    }


def _container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _pod_spec(cr: dict[str, Any], leader: bool) -> dict[str, Any]:
    """The engine pod. ``leader`` is False only for LWS workers (no HTTP serving, no probes)."""
    spec = cr["spec"]
    shape = shape_of(spec)
    path, hub_id, claim = _model_location(cr)
    env = _env(cr, shape.multi_node)
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "models", "mountPath": MODELS_DIR}]
    shm = spec["resources"].get("shmSize") or f"{max(1, shape.gpus_per_pod)}Gi"  # NCCL's intra-node buffers
    storage = spec["storage"]
    if storage["type"] == "PersistentVolumeClaim":
        models_volume: dict[str, Any] = {"name": "models", "persistentVolumeClaim": {"claimName": storage["claimName"]}}
    else:
        models_volume = {"name": "models", "emptyDir": ({"sizeLimit": _quantity(storage["size"])} if storage.get("size") else {})}
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": _quantity(shm)}}, models_volume]
    if claim:
        mounts.append({"name": "model-source", "mountPath": MODEL_SOURCE_DIR, "readOnly": True})
        volumes.append({"name": "model-source", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
    pod_settings = spec.get("pod") or {}
    mounts += copy.deepcopy(pod_settings.get("extraVolumeMounts") or [])
    volumes += copy.deepcopy(pod_settings.get("extraVolumes") or [])

    ports = [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}] if leader else []
    if shape.multi_node and leader:
        ports.append({"name": "dist", "containerPort": DIST_PORT, "protocol": "TCP"})
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": spec["image"],
        "command": ["kvpilot"],
        "args": engine_args(cr),
        **({"ports": ports} if ports else {}),
        "env": env,
        "resources": _resources(spec, shape.gpus_per_pod),
        "volumeMounts": mounts,
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}},
        # An engine that refuses to start (e.g. a TP size that does not split the heads) exits
        # with the reason as its last log line; the kubelet keeps it for the ModelLoaded condition.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
    }
    if leader:
        container.update(_probes(spec))
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds":
            PRESTOP_SLEEP_SECONDS + int(spec["engine"]["drainTimeoutSeconds"]) + TERMINATION_MARGIN_SECONDS,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # the engine never talks to the API server
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
                            "fsGroup": RUN_AS_USER, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container] + copy.deepcopy(pod_settings.get("sidecars") or []),
        "volumes": volumes,
    }
    for key in ("imagePullSecrets", "serviceAccountName", "priorityClassName", "hostIPC"):
        if pod_settings.get(key) not in (None, [], ""):
            pod[key] = copy.deepcopy(pod_settings[key])
    downloads = [("download-model", hub_id, spec["model"].get("revision") or "main", path)] if hub_id else []
    # LoRA adapters from the Hub: one download each, into the same volume (every pod: each rank
    # reads the adapters of its layers).
    downloads += [(f"download-lora-{i}", src, rev, dest)
                  for i, (_, dest, src, rev) in enumerate(lora_adapters(cr)) if src is not None]
    if downloads:
        # Download once into the storage volume; the engine then loads a local directory, so a
        # pinned revision is honoured and restarts on a PVC skip the download.
        pod["initContainers"] = [{
            "name": name,
            "image": spec["image"],
            "command": ["hf", "download", repo, "--revision", revision, "--local-dir", dest],
            "env": [copy.deepcopy(e) for e in env if e["name"] in ("HF_HOME", "HOME", "HF_TOKEN")],
            "volumeMounts": [{"name": "models", "mountPath": MODELS_DIR}],
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "securityContext": _container_security(),
        } for name, repo, revision, dest in downloads]
    for key in ("nodeSelector", "tolerations", "affinity"):
        if spec.get(key):
            pod[key] = copy.deepcopy(spec[key])
    return pod


def _pod_template(cr: dict[str, Any], leader: bool = True) -> dict[str, Any]:
    """Pod labels and annotations: the user's (``spec.pod``) first, kvpilot's own on top."""
    settings = cr["spec"].get("pod") or {}
    labels = {**(settings.get("labels") or {}), **common_labels(cr), WORKLOAD_LABEL: workload_kind(cr)}
    annotations = {**(settings.get("annotations") or {}), "kubectl.kubernetes.io/default-container": ENGINE_CONTAINER}
    return {"metadata": {"labels": labels, "annotations": annotations}, "spec": _pod_spec(cr, leader)}


# ---------------------------------------------------------------------------------------------
# The objects.


def _metadata(cr: dict[str, Any]) -> dict[str, Any]:
    meta = cr["metadata"]
    out: dict[str, Any] = {"name": meta["name"], "namespace": meta.get("namespace") or "default",
                           "labels": common_labels(cr)}
    if meta.get("uid"):
        out["ownerReferences"] = [{"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "uid": meta["uid"],
                                   "controller": True, "blockOwnerDeletion": True}]
    return out


def _deployment(cr: dict[str, Any]) -> dict[str, Any]:
    spec = cr["spec"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(cr),
        "spec": {
            "replicas": desired_replicas(cr),
            "selector": {"matchLabels": selector_labels(cr["metadata"]["name"])},
            # Never drop serving capacity during a rollout: bring one new engine up first.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "progressDeadlineSeconds": int(spec["startup"]["timeoutSeconds"]) + PROGRESS_DEADLINE_MARGIN_SECONDS,
            "revisionHistoryLimit": 3,
            "template": _pod_template(cr),
        },
    }


def _leader_worker_set(cr: dict[str, Any]) -> dict[str, Any]:
    shape = shape_of(cr["spec"])
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": _metadata(cr),
        "spec": {
            "replicas": desired_replicas(cr),
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0}},
            "leaderWorkerTemplate": {
                "size": shape.nodes,
                # One engine spans the group: any pod restart must restart all of it.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": _pod_template(cr, leader=True),
                "workerTemplate": _pod_template(cr, leader=False),
            },
        },
    }


def _service(cr: dict[str, Any]) -> dict[str, Any]:
    svc = cr["spec"]["service"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(cr),
        "spec": {
            "type": svc["type"],
            "selector": serving_selector(cr),
            "ports": [{"name": "http", "port": int(svc["port"]), "targetPort": "http", "protocol": "TCP"}],
        },
    }


def _pod_disruption_budget(cr: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(cr),
        "spec": {
            # One pod (so at most one engine) at a time; minAvailable would block node drains.
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(cr["metadata"]["name"])},
            # A pod that never became ready (stuck loading) must not block a drain either.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


# ---------------------------------------------------------------------------------------------
# The router (spec.router.enabled): kvpilot router in front of the engines.

ROUTER_COMPONENT = "router"
ROUTER_PORT = 8080
ENGINE_TOKENS_PER_BLOCK = 32  # the engine's default --tokens-per-block (kvpilot.config.KvCacheConfig)


def router_name(name: str) -> str:
    """The router's Deployment and Service: ``NAME-router``."""
    return f"{name}-router"


def engines_service_name(name: str) -> str:
    """The headless Service whose DNS name resolves to the Ready serving pods: ``NAME-engines``."""
    return f"{name}-engines"


def router_selector(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": APP_NAME, "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": ROUTER_COMPONENT}


def router_endpoint(cr: dict[str, Any]) -> str | None:
    """The router's in-cluster OpenAI base URL, or None without ``spec.router.enabled``."""
    if not cr["spec"]["router"]["enabled"]:
        return None
    meta = cr["metadata"]
    return (f"http://{router_name(meta['name'])}.{meta.get('namespace') or 'default'}.svc:"
            f"{cr['spec']['service']['port']}/v1")


def router_args(cr: dict[str, Any]) -> list[str]:
    """Arguments of ``kvpilot router``: discovery through the headless Service, the engines' block
    size, the model's tokenizer (Hub id and revision, or the path the engines load)."""
    spec, meta = cr["spec"], cr["metadata"]
    router = spec["router"]
    ns = meta.get("namespace") or "default"
    block = (spec["engine"].get("kvCache") or {}).get("tokensPerBlock") or ENGINE_TOKENS_PER_BLOCK
    args = ["router", "--discover", f"{engines_service_name(meta['name'])}.{ns}.svc:{HTTP_PORT}",
            "--host", "0.0.0.0", "--port", str(ROUTER_PORT), "--tokens-per-block", str(block),
            "--imbalance", str(router["imbalance"]), "--slack", str(router["slack"]),
            "--scrape-interval", str(router["scrapeIntervalSeconds"]),
            "--hold-timeout", str(router["holdTimeoutSeconds"])]
    path, hub_id, _claim = _model_location(cr)
    if hub_id:
        args += ["--tokenizer", hub_id, "--tokenizer-revision", spec["model"].get("revision") or "main"]
    else:
        args += ["--tokenizer", path]
    return args


def _router_objects(cr: dict[str, Any]) -> list[dict[str, Any]]:
    spec, name = cr["spec"], cr["metadata"]["name"]
    labels = {**common_labels(cr), **router_selector(name)}
    env: list[dict[str, Any]] = [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/tmp/huggingface"}]
    secret = spec.get("hfTokenSecret")
    if secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret["name"], "key": secret["key"]}}})
    _path, _hub, claim = _model_location(cr)
    mounts = [{"name": "tmp", "mountPath": "/tmp"}]
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    if claim:
        mounts.append({"name": "model-source", "mountPath": MODEL_SOURCE_DIR, "readOnly": True})
        volumes.append({"name": "model-source", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
    container = {
        "name": ROUTER_COMPONENT, "image": spec["image"], "command": ["kvpilot"], "args": router_args(cr),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "env": env,
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        "volumeMounts": mounts,
        "startupProbe": {"httpGet": {"path": "/live", "port": "http"}, "periodSeconds": 5, "failureThreshold": 60},
        # Ready while at least one engine is in rotation; live while the process answers.
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"httpGet": {"path": "/live", "port": "http"}, "periodSeconds": 15, "timeoutSeconds": 5,
                          "failureThreshold": 3},
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
    }
    pod: dict[str, Any] = {
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # it reads DNS and the engines' /metrics only
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
                            "fsGroup": RUN_AS_USER, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": volumes,
    }
    for key in ("imagePullSecrets", "priorityClassName"):
        value = (spec.get("pod") or {}).get(key)
        if value not in (None, [], ""):
            pod[key] = copy.deepcopy(value)
    meta_router = {**_metadata(cr), "name": router_name(name), "labels": labels}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta_router,
        "spec": {
            "replicas": int(spec["router"]["replicas"]),
            "selector": {"matchLabels": router_selector(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "template": {"metadata": {"labels": labels,
                                      "annotations": {"kubectl.kubernetes.io/default-container": ROUTER_COMPONENT}},
                         "spec": pod},
        },
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": copy.deepcopy(meta_router),
        "spec": {"type": spec["service"]["type"], "selector": router_selector(name),
                 "ports": [{"name": "http", "port": int(spec["service"]["port"]), "targetPort": "http",
                            "protocol": "TCP"}]},
    }
    engines = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {**_metadata(cr), "name": engines_service_name(name)},
        # Headless: the router resolves it to the Ready serving pods' addresses.
        "spec": {"clusterIP": "None", "selector": serving_selector(cr),
                 "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}]},
    }
    return [deployment, service, engines]


def router_children(name: str) -> list[tuple[str, str]]:
    """(kind, name) of the router's objects, for deleting them when the router is switched off."""
    return [("Deployment", router_name(name)), ("Service", router_name(name)), ("Service", engines_service_name(name))]


def render(cr: dict[str, Any]) -> list[dict[str, Any]]:
    """Render an LLMDeployment into the objects that serve it.

    Args:
        cr: the custom resource as a dict (``apiVersion``, ``kind``, ``metadata``, ``spec`` and
            optionally ``status``). Defaults from the CRD are applied first, as the API server
            does, so a CR read from a file renders the same as one read from the cluster.

    Returns:
        ``[workload, Service, PodDisruptionBudget]``: the workload is an ``apps/v1`` Deployment
        when ``tensor x pipeline <= gpusPerNode``, else a ``leaderworkerset.x-k8s.io/v1``
        LeaderWorkerSet. All are in the CR's namespace (``default`` if unset), named after it.
        With ``spec.router.enabled`` three more follow: the router's Deployment and Service
        (``NAME-router``) and the headless Service ``NAME-engines`` it discovers the engines by.

    Raises:
        InvalidLLMDeployment: when the CR breaks the CRD's schema or CEL rules.
    """
    cr = normalize(cr)
    workload = _leader_worker_set(cr) if shape_of(cr["spec"]).multi_node else _deployment(cr)
    objects = [workload, _service(cr), _pod_disruption_budget(cr)]
    if cr["spec"]["router"]["enabled"]:
        objects += _router_objects(cr)
    return objects
