"""Validation of rendered Kubernetes objects: core kinds against the Kubernetes schema of
``K8S_VERSION`` (kubernetes-validate, strict), LeaderWorkerSets against the LWS CRD's schema and its
webhook's rollout rule."""

from __future__ import annotations

import jsonschema
import kubernetes_validate


K8S_VERSION = "1.37.0"


# The LeaderWorkerSet API (leaderworkerset.x-k8s.io/v1), written from
# kubernetes-sigs/lws api/leaderworkerset/v1/leaderworkerset_types.go: the fields, enums and
# minimums of LeaderWorkerSetSpec. The two pod templates are validated separately against
# Kubernetes' own PodTemplateSpec schema (see _validate_lws).
LWS_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["leaderWorkerTemplate"],
            "additionalProperties": False,
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "networkConfig": {"type": "object", "properties": {"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}}},
                "rolloutStrategy": {
                    "type": "object", "required": ["type"], "additionalProperties": False,
                    "properties": {
                        "type": {"enum": ["RollingUpdate"]},
                        "rollingUpdateConfiguration": {
                            "type": "object", "additionalProperties": False,
                            "properties": {"partition": {"type": "integer", "minimum": 0},
                                           "maxUnavailable": {"type": ["integer", "string"]},
                                           "maxSurge": {"type": ["integer", "string"]}},
                        },
                    },
                },
                "leaderWorkerTemplate": {
                    "type": "object", "required": ["workerTemplate"], "additionalProperties": False,
                    "properties": {
                        "leaderTemplate": {"type": "object"},
                        "workerTemplate": {"type": "object"},
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {"enum": ["Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"]},
                        "subGroupPolicy": {"type": "object"},
                        "volumeClaimTemplates": {"type": "array"},
                        "persistentVolumeClaimRetentionPolicy": {"type": "object"},
                    },
                },
            },
        },
    },
}


def _validate_lws(obj: dict) -> None:
    jsonschema.validate(obj, LWS_SCHEMA)
    if obj["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxSurge": 0, "maxUnavailable": 0}:
        raise AssertionError("LWS: maxUnavailable can not be 0 if maxSurge is 0")
    for key in ("leaderTemplate", "workerTemplate"):
        template = obj["spec"]["leaderWorkerTemplate"][key]
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": template}, K8S_VERSION, strict=True)


def validate_all(objects: list[dict]) -> None:
    for obj in objects:
        if obj["kind"] == "LeaderWorkerSet":
            _validate_lws(obj)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
