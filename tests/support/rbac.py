"""Check the requests the operator made against the RBAC that the Helm chart renders.

:func:`chart_rules` runs the real ``helm template`` (support.kube_tools) and collects the rules
of every ClusterRole and Role it renders. :func:`request_attributes` turns one recorded HTTP
request into the attributes the API server's RBAC authorizer checks (API group, resource with
its subresource, verb), following the Kubernetes request-attribute rules: GET of a name is
``get``, of a collection ``list``, with ``watch=true`` ``watch``; POST ``create``; PATCH ``patch``;
PUT ``update``; DELETE of a name ``delete``, of a collection ``deletecollection``. Discovery paths
(``/api``, ``/apis/group/version``, ``/version``) are non-resource URLs every authenticated user
may read, so they are not checked.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

import yaml

from support import kube_tools

CHART = Path(__file__).resolve().parents[2] / "charts" / "kvpilot"
RELEASE_NAMESPACE = "kvpilot-system"


@lru_cache(maxsize=None)
def _render(set_args: tuple[str, ...]) -> tuple[dict[str, Any], ...]:
    args = ["template", "kvpilot", str(CHART), "--namespace", RELEASE_NAMESPACE]
    for item in set_args:
        args += ["--set", item]
    out = kube_tools.run("helm", *args).stdout
    return tuple(d for d in yaml.safe_load_all(out) if d)


def rendered(*set_args: str) -> list[dict[str, Any]]:
    """Every object ``helm template`` renders for the chart with ``--set`` ``set_args``."""
    return [dict(d) for d in _render(tuple(set_args))]


def chart_rules(*set_args: str, namespace: str | None = None) -> list[dict[str, Any]]:
    """The rules of all ClusterRoles, and of the Roles in ``namespace``, the chart renders."""
    rules: list[dict[str, Any]] = []
    for doc in rendered(*set_args):
        if doc["kind"] == "ClusterRole" or (doc["kind"] == "Role" and doc["metadata"].get("namespace") == namespace):
            rules += doc.get("rules") or []
    return rules


def request_attributes(method: str, path: str, query: dict[str, str]) -> tuple[str, str, str] | None:
    """(API group, resource[/subresource], verb) of one request, or None for a non-resource URL."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 2:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        return None
    if not rest:
        return None  # discovery of a group version
    if rest[0] == "namespaces" and len(rest) >= 3:
        rest = rest[2:]  # a namespaced resource
    resource, name, sub = rest[0], rest[1] if len(rest) > 1 else None, rest[2] if len(rest) > 2 else None
    watching = str(query.get("watch", "")).lower() in ("1", "true")
    verb = {
        "GET": "watch" if watching else ("get" if name else "list"),
        "POST": "create", "PATCH": "patch", "PUT": "update",
        "DELETE": "delete" if name else "deletecollection",
    }[method.upper()]
    return group, f"{resource}/{sub}" if sub else resource, verb


def allows(rules: Iterable[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    """Whether any rule grants ``verb`` on ``group``/``resource`` (``*`` honoured, as RBAC does)."""
    for rule in rules:
        if (group in rule.get("apiGroups", ()) or "*" in rule.get("apiGroups", ())) and \
                (resource in rule.get("resources", ()) or "*" in rule.get("resources", ())) and \
                (verb in rule.get("verbs", ()) or "*" in rule.get("verbs", ())):
            return True
    return False


def denied(requests: Iterable[tuple[str, str, dict[str, str]]], rules: list[dict[str, Any]]) -> list[str]:
    """``METHOD path -> (group, resource, verb)`` for every request the rules do not allow."""
    out = []
    for method, path, query in requests:
        attrs = request_attributes(method, path, query)
        if attrs is not None and not allows(rules, *attrs):
            out.append(f"{method} {path} -> {attrs}")
    return sorted(set(out))


def grants(rules: Iterable[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """Every (group, resource, verb) triple the rules spell out."""
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
