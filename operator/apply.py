"""Applying rendered objects to the API server: create, then merge-patch the fields kvpilot owns.

Why not server-side apply: it is the right tool on a real cluster, but the Kubernetes emulator
the tests run against (kmock) serves only create, get, list, watch, JSON merge patch and delete.
Create-then-merge-patch is correct on both, provided the patch also removes what kvpilot set
before and no longer renders. So each child records the fields kvpilot last applied in an
annotation (as ``kubectl apply`` does) and the patch nulls the keys that disappeared.

Only objects that carry kvpilot's ownership are written: a controller ownerReference to the
LLMDeployment, or (a child created before its owner had a uid) the last-applied annotation. An
object of the same name that another tool created is left untouched (`NotOwnedError`), as
controller-runtime operators refuse to adopt what they do not own.

Owned fields: ``metadata.labels``, ``metadata.ownerReferences``, the last-applied annotation
and the whole ``spec`` of every rendered object, except what the caller leaves to another
writer (``leave``): on an autoscaled workload ``spec.replicas`` belongs to the autoscaler, so it
is set when the workload is created and never patched, reverted or removed afterwards. A child whose owned fields already match
(server-side defaults and canonicalised quantities ignored) is left alone, so a settled
operator makes no writes. Every write carries ``fieldManager=kvpilot``.

Label selectors are owned exactly (:data:`EXACT_MAPS`): a key someone added by hand to a
Service's ``spec.selector`` (which would leave it with no endpoints) or to a PDB's
``matchLabels`` is removed, while other maps may keep keys that other writers add.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from kvpilot import envs
from .crd import API_VERSION, KIND, PLURAL

logger = logging.getLogger(__name__)

FIELD_MANAGER = "kvpilot"
LAST_APPLIED = "serving.kvpilot.io/last-applied"
MERGE_PATCH = "application/merge-patch+json"

# kind -> (apiVersion, plural) for everything the operator reads or writes.
RESOURCES: dict[str, tuple[str, str]] = {
    "Deployment": ("apps/v1", "deployments"),
    "Service": ("v1", "services"),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
    "LeaderWorkerSet": ("leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    "Pod": ("v1", "pods"),
    "HorizontalPodAutoscaler": ("autoscaling/v2", "horizontalpodautoscalers"),
    "ScaledObject": ("keda.sh/v1alpha1", "scaledobjects"),
    KIND: (API_VERSION, PLURAL),
}


# kind -> paths of maps whose live keys must be exactly the rendered ones.
EXACT_MAPS: dict[str, tuple[tuple[str, ...], ...]] = {
    "Service": (("spec", "selector"),),
    "PodDisruptionBudget": (("spec", "selector", "matchLabels"),),
}


class ApiError(RuntimeError):
    """A non-2xx answer from the API server; ``status`` is the HTTP status code."""

    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(f"HTTP {status}: {message}")


class NotOwnedError(RuntimeError):
    """A child's name is taken by an object that another owner (or nobody) controls."""


def resource_path(api_version: str, plural: str, namespace: str | None, name: str | None = None,
                  subresource: str | None = None) -> str:
    """The REST path of a resource, e.g. ``/apis/apps/v1/namespaces/ns/deployments/name``."""
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = base + (f"/namespaces/{namespace}" if namespace else "") + f"/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def load_configuration() -> Any:
    """A ``kubernetes.client.Configuration``: in-cluster when in a pod, else ``$KUBECONFIG``.

    Raises:
        kubernetes.config.ConfigException: when neither source is usable.
    """
    import os

    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        # The package reads $KUBECONFIG once, at import; read it now instead.
        config.load_kube_config(config_file=envs.external("KUBECONFIG"), client_configuration=configuration)
    return configuration


class KubeClient:
    """A small synchronous REST client over the official ``kubernetes`` package's ApiClient.

    The ApiClient brings authentication (in-cluster service account, or ``KUBECONFIG`` with
    tokens, certificates and exec plugins); this class adds the handful of generic verbs the
    operator needs, for any resource, including custom ones.
    """

    def __init__(self, api_client: Any):
        self._api = api_client

    @classmethod
    def from_environment(cls) -> "KubeClient":
        """A client configured by :func:`load_configuration`."""
        from kubernetes import client

        return cls(client.ApiClient(load_configuration()))

    def close(self) -> None:
        self._api.close()

    def request(self, method: str, path: str, body: Any = None, content_type: str | None = None,
                query: list[tuple[str, str]] | None = None) -> Any:
        """One REST call; returns the decoded JSON body.

        Raises:
            ApiError: for any non-2xx status.
        """
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        if hasattr(self._api, "param_serialize"):  # kubernetes >= 34: the regenerated client
            serialized = self._api.param_serialize(method=method, resource_path=path, query_params=query or [],
                                                   header_params=headers, body=body, auth_settings=["BearerToken"])
            response = self._api.call_api(*serialized)
            response.read()
        else:  # older clients raise for non-2xx themselves
            from kubernetes.client.exceptions import ApiException

            try:
                response = self._api.call_api(path, method, query_params=query or [], header_params=headers, body=body,
                                              auth_settings=["BearerToken"], _preload_content=False,
                                              _return_http_data_only=True)
            except ApiException as exc:
                raise ApiError(exc.status, str(exc.body)[:500]) from exc
        text = response.data.decode("utf-8") if response.data else ""
        if not 200 <= response.status < 300:
            raise ApiError(response.status, text[:500])
        return json.loads(text) if text else None

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None if it does not exist."""
        api_version, plural = RESOURCES[kind]
        try:
            return self.request("GET", resource_path(api_version, plural, namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        """Objects of ``kind`` in ``namespace`` carrying all ``labels``.

        The selector goes to the server and is applied again here, because not every API
        (kmock's emulator, for one) honours ``labelSelector``.
        """
        api_version, plural = RESOURCES[kind]
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        data = self.request("GET", resource_path(api_version, plural, namespace), query=[("labelSelector", selector)])
        items = (data or {}).get("items") or []
        return [item for item in items
                if all(((item.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in labels.items())]

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        api_version, plural = RESOURCES[obj["kind"]]
        return self.request("POST", resource_path(api_version, plural, obj["metadata"]["namespace"]), body=obj,
                            query=[("fieldManager", FIELD_MANAGER)])

    def merge_patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any],
                    subresource: str | None = None) -> dict[str, Any]:
        api_version, plural = RESOURCES[kind]
        return self.request("PATCH", resource_path(api_version, plural, namespace, name, subresource), body=patch,
                            content_type=MERGE_PATCH, query=[("fieldManager", FIELD_MANAGER)])

    def delete(self, kind: str, namespace: str, name: str) -> None:
        api_version, plural = RESOURCES[kind]
        try:
            self.request("DELETE", resource_path(api_version, plural, namespace, name),
                         body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"})
        except ApiError as exc:
            if exc.status != 404:
                raise


# ---------------------------------------------------------------------------------------------
# Pure helpers: what kvpilot owns, whether the live object already has it, and the patch.


Path = tuple[str, ...]

#: What another writer owns on an autoscaled workload: set at creation, never patched after.
REPLICAS: tuple[Path, ...] = (("spec", "replicas"),)


def _without(data: dict[str, Any], leave: tuple[Path, ...]) -> dict[str, Any]:
    """A copy of ``data`` without the keys at the paths in ``leave`` (missing paths ignored)."""
    if not leave:
        return data
    out = json.loads(json.dumps(data))
    for path in leave:
        target = out
        for key in path[:-1]:
            target = target.get(key) if isinstance(target, dict) else None
        if isinstance(target, dict):
            target.pop(path[-1], None)
    return out


def owned_fields(obj: dict[str, Any], leave: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The part of a rendered object that kvpilot owns (see the module docstring), less the
    paths in ``leave`` (fields another writer owns, e.g. :data:`REPLICAS` under an autoscaler)."""
    meta = obj["metadata"]
    owned_meta: dict[str, Any] = {"labels": dict(meta.get("labels") or {})}
    if meta.get("ownerReferences"):
        owned_meta["ownerReferences"] = meta["ownerReferences"]
    return _without({"metadata": owned_meta, "spec": obj["spec"]}, leave)


def last_applied(obj: dict[str, Any], leave: tuple[Path, ...] = ()) -> str:
    """Canonical JSON of ``owned_fields(obj, leave)``, stored on the child under :data:`LAST_APPLIED`."""
    return json.dumps(owned_fields(obj, leave), sort_keys=True, separators=(",", ":"))


def _quantity(value: Any) -> Decimal | None:
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        return None
    try:
        from kubernetes.utils import parse_quantity

        return Decimal(parse_quantity(value))
    except (ValueError, TypeError, InvalidOperation):
        return None


def is_subset(desired: Any, live: Any) -> bool:
    """True when ``live`` already holds every value of ``desired``.

    Dicts may have extra keys in ``live`` (server defaults such as ``protocol`` or
    ``terminationMessagePath``); lists must have the same length and match element-wise;
    strings that are equal as Kubernetes quantities (``"0.5"`` and ``"500m"``) match.
    """
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and is_subset(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(desired) == len(live) and all(map(is_subset, desired, live))
    if desired == live and type(desired) is type(live):
        return True
    if isinstance(desired, str) and isinstance(live, str):
        a, b = _quantity(desired), _quantity(live)
        return a is not None and a == b
    return False


def merge_patch(previous: Any, desired: Any) -> Any:
    """A JSON merge patch (RFC 7386) that turns what kvpilot applied before into ``desired``.

    Keys that ``previous`` had and ``desired`` lacks become ``null`` (deleted); everything in
    ``desired`` is set. Lists are replaced whole, as merge patch does.
    """
    if not isinstance(desired, dict) or not isinstance(previous, dict):
        return desired
    patch: dict[str, Any] = {key: None for key in previous if key not in desired}
    for key, value in desired.items():
        patch[key] = merge_patch(previous.get(key), value) if isinstance(value, dict) else value
    return patch


@dataclass(frozen=True)
class ApplyResult:
    """What :func:`apply` did to one object: ``created``, ``patched`` or ``unchanged``."""

    kind: str
    name: str
    action: str


def _check_controller(live: dict[str, Any], desired: dict[str, Any]) -> None:
    wanted = [r for r in desired["metadata"].get("ownerReferences") or [] if r.get("controller")]
    if not wanted:
        return
    live_meta = live.get("metadata") or {}
    live_refs = [r for r in live_meta.get("ownerReferences") or [] if r.get("controller")]
    where = f"{desired['kind']} {desired['metadata']['namespace']}/{desired['metadata']['name']}"
    if live_refs and live_refs[0].get("uid") != wanted[0]["uid"]:
        raise NotOwnedError(f"{where} is controlled by {live_refs[0].get('kind')} {live_refs[0].get('name')}, not by "
                            f"this {KIND}; rename one of them")
    if not live_refs and LAST_APPLIED not in (live_meta.get("annotations") or {}):
        # Created by someone else (kubectl, Helm, another operator): adopting it would rewrite it.
        raise NotOwnedError(f"{where} already exists and was not created by kvpilot (no controller ownerReference, "
                            f"no {LAST_APPLIED} annotation); it is left as it is: delete or rename it, or rename "
                            f"this {KIND}")


def _get_path(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def extra_keys(obj: dict[str, Any], live: dict[str, Any]) -> dict[tuple[str, ...], list[str]]:
    """Keys that ``live`` has, and ``obj`` lacks, in the maps kvpilot owns exactly (:data:`EXACT_MAPS`)."""
    out: dict[tuple[str, ...], list[str]] = {}
    for path in EXACT_MAPS.get(obj["kind"], ()):
        desired, current = _get_path(obj, path), _get_path(live, path)
        if isinstance(desired, dict) and isinstance(current, dict):
            extra = sorted(k for k in current if k not in desired)
            if extra:
                out[path] = extra
    return out


def in_sync(obj: dict[str, Any], live: dict[str, Any] | None, leave: tuple[Path, ...] = ()) -> bool:
    """True when ``live`` already holds every field kvpilot owns in the rendered ``obj``
    (the paths in ``leave`` not counted)."""
    if live is None:
        return False
    annotations = (live.get("metadata") or {}).get("annotations") or {}
    return annotations.get(LAST_APPLIED) == last_applied(obj, leave) and is_subset(owned_fields(obj, leave), live) \
        and not extra_keys(obj, live)


def apply(client: KubeClient, obj: dict[str, Any], live: dict[str, Any] | None = None,
          leave: tuple[Path, ...] = ()) -> ApplyResult:
    """Make the live object hold ``obj``'s owned fields, writing only when something differs.

    Args:
        live: the object as just read or watched; read with a GET when not given.
        leave: paths (e.g. :data:`REPLICAS`) that another writer owns: a created object gets
            ``obj``'s values there, a patch never sets nor removes them, and a live value that
            differs is not drift.

    Raises:
        NotOwnedError: the name is taken by an object another controller owns, or that another
            tool created (no ownerReference or last-applied annotation of kvpilot's).
        ApiError: the API server refused a request.
    """
    kind, meta = obj["kind"], obj["metadata"]
    ns, name = meta["namespace"], meta["name"]
    applied = last_applied(obj, leave)
    if live is None:
        live = client.get(kind, ns, name)
    if live is None:
        body = json.loads(json.dumps(obj))
        body["metadata"].setdefault("annotations", {})[LAST_APPLIED] = applied
        try:
            client.create(body)
            logger.info("created %s %s/%s", kind, ns, name)
            return ApplyResult(kind, name, "created")
        except ApiError as exc:
            if exc.status != 409:
                raise
            live = client.get(kind, ns, name)  # lost a race with another writer: patch instead
            if live is None:
                raise
    _check_controller(live, obj)
    owned = owned_fields(obj, leave)
    if in_sync(obj, live, leave):
        return ApplyResult(kind, name, "unchanged")
    live_annotations = (live.get("metadata") or {}).get("annotations") or {}
    try:
        previous = json.loads(live_annotations.get(LAST_APPLIED) or "{}")
    except json.JSONDecodeError:
        previous = {}
    # What kvpilot set before at a path it now leaves to another writer stays as it is.
    patch = merge_patch(_without(previous, leave) if isinstance(previous, dict) else {}, owned)
    for path, keys in extra_keys(obj, live).items():
        target = patch
        for key in path:
            target = target.setdefault(key, {})
        target.update({k: None for k in keys})
    patch["metadata"]["annotations"] = {LAST_APPLIED: applied}
    client.merge_patch(kind, ns, name, patch)
    logger.info("patched %s %s/%s", kind, ns, name)
    return ApplyResult(kind, name, "patched")


def delete_if_owned(client: KubeClient, kind: str, namespace: str, name: str, owner_uid: str | None) -> bool:
    """Delete a child that is no longer rendered (e.g. the Deployment after a switch to LWS).

    Only an object whose controller ownerReference points at ``owner_uid`` is deleted.
    Returns True when a delete was sent.
    """
    live = client.get(kind, namespace, name)
    if live is None or owner_uid is None:
        return False
    refs = (live.get("metadata") or {}).get("ownerReferences") or []
    if not any(r.get("controller") and r.get("uid") == owner_uid for r in refs):
        return False
    client.delete(kind, namespace, name)
    logger.info("deleted stale %s %s/%s", kind, namespace, name)
    return True
