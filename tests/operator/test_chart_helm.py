"""The chart through the real ``helm`` 4 binary: ``helm lint --strict`` and ``helm template`` with each
values option, every rendered object validated strictly against the Kubernetes schemas."""

from __future__ import annotations

import kubernetes_validate
import pytest

from support import kube_tools, rbac

VALUE_SETS = {
    "default": (),
    "namespaced": ("watchNamespaces={ml,research}",),
    "standalone": ("peering.enabled=false", "replicaCount=1"),
    "no-service-account": ("serviceAccount.create=false", "serviceAccount.name=ops"),
    "pull-secrets": ("imagePullSecrets[0].name=regcred", "priorityClassName=system-cluster-critical"),
}


def test_helm_lint_is_clean():
    out = kube_tools.run("helm", "lint", "--strict", str(rbac.CHART))
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_template_renders_valid_objects(name):
    docs = rbac.rendered(*VALUE_SETS[name])
    kinds = sorted(d["kind"] for d in docs)
    assert "Deployment" in kinds and "ClusterRole" in kinds
    for doc in docs:
        if doc["kind"] in ("KopfPeering", "ClusterKopfPeering"):
            continue  # custom resources: their CRDs are validated in test_chart.py
        kubernetes_validate.validate(doc, "1.35.0", strict=True)


def test_namespaced_install_grants_roles_only_in_watched_namespaces():
    docs = rbac.rendered(*VALUE_SETS["namespaced"])
    roles = sorted(d["metadata"]["namespace"] for d in docs if d["kind"] == "Role")
    assert roles == ["ml", "research"]
    assert not rbac.allows(rbac.chart_rules(*VALUE_SETS["namespaced"], namespace="other"), "apps", "deployments", "get")
    assert rbac.allows(rbac.chart_rules(*VALUE_SETS["namespaced"], namespace="ml"), "apps", "deployments", "get")


def _crds(docs):
    return [d for d in docs if d["kind"] == "CustomResourceDefinition"]


def test_install_crds_false_leaves_the_crd_out():
    import yaml

    source = yaml.safe_load((rbac.CHART.parents[1] / "crds" / "serving.kvpilot.io_llmdeployments.yaml").read_text())
    installed = _crds(rbac.rendered())
    assert installed == [source]  # the release installs (and upgrades) exactly the CRD in crds/
    assert installed[0]["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert _crds(rbac.rendered("installCRDs=false")) == []
    # Everything else is still there.
    kinds = {d["kind"] for d in rbac.rendered("installCRDs=false")}
    assert {"Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"} <= kinds
