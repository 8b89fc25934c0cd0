"""The Helm chart: the CRD copy, the values schema, the peering CRDs, and that the RBAC rules grant
exactly the verbs the operator's code uses (the e2e tests check every request against the RBAC
that ``helm template`` renders; see support/rbac.py)."""

from __future__ import annotations

import json
import re

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvpilot.operator import crd
from support.paths import REPO

REPO = REPO
CHART = REPO / "charts" / "kvpilot"


def test_chart_crd_is_identical_to_crds_dir():
    source = (REPO / "crds" / crd.CRD_FILENAME).read_bytes()
    assert (CHART / "files" / "llmdeployments.crd.yaml").read_bytes() == source
    assert b"{{" not in source, "the CRD is shipped as a Helm template: no template syntax allowed"


def test_chart_metadata_matches_the_default_engine_image():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "kvpilot"
    image = crd.apply_defaults({"spec": {}}, crd.openapi_schema())["spec"]["image"]
    assert image.endswith(":" + chart["appVersion"])


def _values_schema():
    return json.loads((CHART / "values.schema.json").read_text())


def test_default_values_satisfy_the_schema():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(_values_schema()).validate(values)
    assert values["replicaCount"] == 2 and values["peering"]["enabled"] is True


@pytest.mark.parametrize("change,message", [
    ({"replicaCount": 2, "peering": {"enabled": False, "name": "kvpilot"}}, "is greater than the maximum of 1"),
    ({"watchNamespaces": ["Bad_NS"]}, "does not match"),
    ({"logLevel": "LOUD"}, "is not one of"),
    ({"imageTag": "x"}, "Additional properties are not allowed"),
])
def test_bad_values_are_rejected(change, message):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    values.update(change)
    with pytest.raises(jsonschema.ValidationError, match=message):
        jsonschema.Draft7Validator(_values_schema()).validate(values)


def test_kopf_peering_crds_are_valid():
    docs = list(yaml.safe_load_all((CHART / "crds" / "kopf-peering.yaml").read_text()))
    assert sorted(d["metadata"]["name"] for d in docs) == ["clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.37.0", strict=True)


def _namespaced_rules(peering: bool) -> list[dict]:
    text = (CHART / "templates" / "_helpers.tpl").read_text()
    block = re.search(r'define "kvpilot.namespacedRules" -}}\n(.*?)\n{{- end -}}', text, re.S).group(1)
    # Resolve the one conditional in the block by hand, then it is plain YAML.
    block = re.sub(r"{{- /\*.*?\*/}}\n", "", block)
    block = re.sub(r"{{- if and \.Values\.peering\.enabled \.Values\.watchNamespaces }}\n(.*?){{- end }}",
                   r"\1" if peering else "", block, flags=re.S)
    return yaml.safe_load(block)


def _grants(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def test_rbac_grants_what_the_operator_does():
    from support import rbac

    grants = _grants(_namespaced_rules(peering=True))
    # What helm renders (cluster-wide, peering on) is the same set plus kopf's cluster-scoped reads.
    cluster = rbac.grants(rbac.chart_rules())
    assert cluster - grants == {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")} \
        | {("", "namespaces", v) for v in ("list", "watch")} \
        | {("kopf.dev", "clusterkopfpeerings", v) for v in ("get", "list", "watch", "patch")}
    assert grants - cluster == {("kopf.dev", "kopfpeerings", v) for v in ("get", "list", "watch", "patch")}
    # Watching namespaces: a Role per namespace with the namespaced peering objects.
    role = rbac.grants(rbac.chart_rules("watchNamespaces={ml}", namespace="ml"))
    assert role == grants | {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")} \
        | {("", "namespaces", v) for v in ("list", "watch")}  # the discovery ClusterRole
    needed = {
        # kopf: watch the CRs; its annotations (progress, diff base) are patches.
        ("serving.kvpilot.io", "llmdeployments", v) for v in ("get", "list", "watch", "patch")
    } | {("serving.kvpilot.io", "llmdeployments/status", v) for v in ("get", "patch")} | {
        # apply(): get, create, merge-patch; delete for the stale workload kind; kopf watches every
        # child kind to repair drift.
        (g, r, v) for g, r in (("apps", "deployments"), ("leaderworkerset.x-k8s.io", "leaderworkersets"),
                               ("", "services"), ("policy", "poddisruptionbudgets"))
        for v in ("get", "list", "watch", "create", "patch", "delete")
    } \
      | {("", "pods", v) for v in ("list", "watch", "patch")} | {("", "events", "create")} \
      | {("autoscaling", "horizontalpodautoscalers", v) for v in ("list", "watch")} \
      | {("keda.sh", "scaledobjects", "list")} \
      | {("kopf.dev", "kopfpeerings", v) for v in ("get", "list", "watch", "patch")}
    assert grants == needed  # least privilege: nothing more than that
    assert not any(r[1] == "kopfpeerings" for r in _grants(_namespaced_rules(peering=False)))
    assert not any("*" in part for grant in grants for part in grant)
