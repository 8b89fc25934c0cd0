"""kopf handlers for LLMDeployment: thin wrappers over render(), apply() and desired_status().

What triggers what:

- ``on.create`` / ``on.update`` (spec changes only) / ``on.resume`` (operator start) of an
  LLMDeployment: :func:`reconcile` renders the children and applies them idempotently (create,
  or merge-patch what differs), deletes a child of the other workload kind when the shape
  crossed the one-node boundary, and writes the status. Status-only changes of the CR do not
  trigger it (kopf diffs ``spec`` only), and nothing is written when nothing differs.
- ``on.event`` of a child Deployment, LeaderWorkerSet, Service or PodDisruptionBudget (labelled
  ``managed-by: kvpilot-operator``), including the initial listing at start: :func:`child_changed`
  repairs drift (a deleted child is recreated; a hand edit of a field kvpilot owns, such as
  replicas, the image, or an extra selector key, is reverted) and, for the workload, recomputes
  the owner's status (ready replicas, conditions), patching ``/status`` only if it changed.

Autoscaling lives in operator/autoscale_daemon.py: a kopf daemon per LLMDeployment with
``autoscaling.enabled`` scrapes the Ready pods, calls the pure ``autoscaler.decide(...)``, and writes
``status.desiredReplicas`` (and the windows' history) before the child's ``spec.replicas``. While
autoscaling is on, the autoscaler alone writes the workload's ``spec.replicas``: reconcile and
drift repair set it only when they create the workload (from a fresh read of
``status.desiredReplicas``, clamped to min/max) and otherwise leave it as it is
(:func:`replicas_left`).
"""

from __future__ import annotations

import copy
import logging
import random
from typing import Any

import kopf

from . import apply as kube
from .config import OperatorConfig
from .crd import GROUP, KIND, PLURAL, VERSION, normalize
from .render import (COMPONENT, LWS_API_VERSION, MANAGED_BY, OWNER_LABEL, desired_replicas, render, router_children,
                     surge_selector, workload_kind)
from .status import desired_status, lora_status, merge_conditions, now_rfc3339, status_patch
from . import engine_failures, foreign
from .events import EVENT_SOURCE, warning_event  # noqa: F401  (EVENT_SOURCE re-exported)
from .status_writer import update_status
# Registers the autoscaling daemon (one per LLMDeployment with spec.autoscaling.enabled).
from . import autoscale_daemon  # noqa: F401

logger = logging.getLogger(__name__)

ANNOTATION_PREFIX = "serving.kvpilot.io"
CHILD_LABELS = {"app.kubernetes.io/managed-by": MANAGED_BY}
WORKLOAD_KINDS = ("Deployment", "LeaderWorkerSet")


def configure(settings: kopf.OperatorSettings, config: OperatorConfig | None = None) -> None:
    """kopf settings shared by ``kvpilot operator`` and the tests.

    kopf's progress and diff-base records go to annotations under ``serving.kvpilot.io``,
    not to ``status``: the CRD's structural schema would prune ``status.kopf``. Events are
    posted only for warnings and errors, so a settled operator writes nothing. kopf's own
    request retries (its patches, watch restarts) follow the same capped exponential schedule
    as reconcile retries.
    """
    config = config or OperatorConfig()
    settings.peering.lifetime = config.peering_lifetime_s
    settings.networking.error_backoffs = [min(config.retry_max_s, config.retry_base_s * 2 ** i) for i in range(8)]
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/finalizer"
    settings.posting.level = logging.WARNING


@kopf.on.login()
def _login(**_: Any) -> kopf.ConnectionInfo:
    """kopf's credentials from the same source as :class:`KubeClient` (see ``load_configuration``)."""
    cfg = kube.load_configuration()
    auth = (cfg.api_key or {}).get("authorization") or (cfg.api_key or {}).get("BearerToken")
    scheme, _, token = (auth or "").partition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        scheme=scheme or None,
        token=token or None,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )


@kopf.on.startup()
def _startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    if getattr(memo, "config", None) is None:
        memo.config = OperatorConfig()
    configure(settings, memo.config)
    if getattr(memo, "kube", None) is None:
        memo.kube = kube.KubeClient.from_environment()


@kopf.on.cleanup()
def _cleanup(memo: kopf.Memo, **_: Any) -> None:
    client = getattr(memo, "kube", None)
    if client is not None:
        client.close()


def random_priority() -> int:
    """A peering priority for this replica: the highest-priority live operator acts, others pause."""
    return random.randint(1, 2**30)


RECONCILED = "Reconciled"  # the condition that says whether the last apply worked


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def reconcile(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, retry: int = 0, **_: Any) -> None:
    """Apply the rendered children of one LLMDeployment and write its status.

    A failure sets the condition ``Reconciled=False`` with a reason and message a user can act on
    and posts a Warning Event on the CR (once per distinct failure). An invalid spec is not
    retried; an API error or a name taken by another owner is retried after
    ``OperatorConfig.retry_delay(retry)`` (exponential backoff with jitter).
    """
    client: kube.KubeClient = memo.kube
    config: OperatorConfig = getattr(memo, "config", None) or OperatorConfig()
    cr = _as_dict(body)
    try:
        cr = _with_fresh_status(client, cr)
    except (kube.ApiError, OSError) as exc:
        message = f"the Kubernetes API refused or failed a request (attempt {retry + 1}): {exc}"
        _report_failure(client, cr, "APIError", message, logger)
        raise kopf.TemporaryError(message, delay=config.retry_delay(retry)) from exc
    try:
        cr = normalize(cr)
        objects = render(cr)
    except ValueError as exc:  # the API server admitted something render() rejects: do not retry
        _report_failure(client, cr, "InvalidSpec", str(exc), logger)
        raise kopf.PermanentError(str(exc)) from exc
    try:
        sync(client, cr, logger)
    except kube.NotOwnedError as exc:
        _report_failure(client, cr, "NameTaken", str(exc), logger)
        raise kopf.TemporaryError(str(exc), delay=config.retry_delay(retry)) from exc
    except (kube.ApiError, OSError) as exc:
        reason = "APIForbidden" if getattr(exc, "status", None) == 403 else "APIError"
        message = f"the Kubernetes API refused or failed a request (attempt {retry + 1}): {exc}"
        _report_failure(client, cr, reason, message, logger)
        raise kopf.TemporaryError(message, delay=config.retry_delay(retry)) from exc


def _with_fresh_status(client: kube.KubeClient, cr: dict[str, Any]) -> dict[str, Any]:
    """``cr`` with its ``status`` read now: the body kopf hands a handler may predate the
    autoscaler's latest ``status.desiredReplicas``, which a workload created now must start from."""
    meta = cr.get("metadata") or {}
    fresh = client.get(KIND, meta.get("namespace") or "default", meta["name"])
    if fresh is not None and (fresh.get("metadata") or {}).get("uid") == meta.get("uid"):
        cr = {**cr, "status": fresh.get("status") or {}}
    return cr


def replicas_left(cr: dict[str, Any], obj: dict[str, Any],
                  scalers: list[foreign.ForeignScaler] = ()) -> tuple[tuple[str, ...], ...]:
    """The paths of ``obj`` that reconcile and drift repair leave alone: the workload's
    ``spec.replicas`` when an autoscaler owns them, i.e. kvpilot's (``cr`` autoscaled: set once,
    at creation, from ``status.desiredReplicas``, then written by the autoscaler alone) or a
    foreign HPA/ScaledObject that targets the workload."""
    if obj["kind"] in WORKLOAD_KINDS and obj["metadata"]["name"] == cr["metadata"]["name"] \
            and (cr["spec"]["autoscaling"]["enabled"] or any(s.on_workload for s in scalers)):
        return kube.REPLICAS
    return ()


def effective(cr: dict[str, Any], scalers: list[foreign.ForeignScaler]) -> dict[str, Any]:
    """The (defaulted) CR to render: with a foreign scaler on the CR's scale subresource (and
    none on the workload), kvpilot's autoscaler stands by and ``spec.replicas`` rules, as with
    autoscaling off."""
    if cr["spec"]["autoscaling"]["enabled"] and scalers and not any(s.on_workload for s in scalers):
        cr = copy.deepcopy(cr)
        cr["spec"]["autoscaling"]["enabled"] = False
    return cr


def sync(client: kube.KubeClient, cr: dict[str, Any], logger: Any) -> None:
    """Render a defaulted CR (its status fresh), apply its children and write its status,
    leaving replicas to whichever autoscaler owns them (:func:`replicas_left`).

    Raises:
        NotOwnedError, ApiError, OSError: as :func:`kube.apply` does.
    """
    meta = cr["metadata"]
    scalers = foreign.find(client, meta.get("namespace") or "default", meta["name"])
    target = effective(cr, scalers)
    _apply_children(client, target, render(target), logger, scalers, autoscaled=cr["spec"]["autoscaling"]["enabled"])


def _apply_children(client: kube.KubeClient, cr: dict[str, Any], objects: list[dict[str, Any]],
                    logger: Any, scalers: list[foreign.ForeignScaler] = (), autoscaled: bool = False) -> None:
    meta = cr["metadata"]
    ns, name, uid = meta.get("namespace") or "default", meta["name"], meta.get("uid")
    current = workload_kind(cr)
    objects, retire, surging = surge_plan(client, cr, objects)
    results = [kube.apply(client, obj, leave=replicas_left(cr, obj, scalers)) for obj in objects]
    changed = [f"{r.kind}:{r.action}" for r in results if r.action != "unchanged"]
    if changed:
        logger.info("applied %s", ", ".join(changed))
    if retire:
        kube.delete_if_owned(client, retire, ns, name, uid)
        logger.info("the %s is Ready and serves; deleted the %s", current, retire)
    if not cr["spec"]["router"]["enabled"] and (cr.get("status") or {}).get("routerEndpoint"):
        for kind, child_name in router_children(name):  # switched off: the router goes
            if kube.delete_if_owned(client, kind, ns, child_name, uid):
                logger.info("spec.router.enabled is false; deleted %s %s", kind, child_name)
    child = client.get(current, ns, name)
    extra = [_condition(RECONCILED, True, "Applied", "every child matches the spec")]
    if surging:
        extra.append(_surge_condition(current, surging))
    if scalers:
        foreign.report(client, cr, scalers, autoscaled, logger)
    _write_status(client, cr, child, observed_generation=True, extra=extra, foreign_scalers=bool(scalers))


def _surge_condition(new_kind: str, old_kind: str) -> dict[str, Any]:
    return _condition("Progressing", True, "Surging",
                      f"the new {new_kind} is starting; the {old_kind} keeps serving until it is Ready")


def workload_ready(workload: dict[str, Any] | None, cr: dict[str, Any]) -> bool:
    """The workload has as many ready replicas as the CR wants (and has seen its latest spec)."""
    if workload is None:
        return False
    st = workload.get("status") or {}
    generation = (workload.get("metadata") or {}).get("generation")
    observed = st.get("observedGeneration")
    if generation is not None and observed is not None and observed < generation:
        return False
    return int(st.get("readyReplicas") or 0) >= max(1, desired_replicas(cr))


def surge_plan(client: kube.KubeClient, cr: dict[str, Any], objects: list[dict[str, Any]],
               new_live: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], str | None, str | None]:
    """How to cross the one-node boundary without an outage: as a surge.

    While a workload of the other kind (the old shape) still exists, the new one is created
    next to it and the Service keeps selecting the old workload's serving pods; once the new
    workload is Ready the Service moves to it, and then the old one is deleted.

    Returns:
        (the objects to apply, the kind to delete now or None, the old kind while the surge
        waits for the new workload or None).
    """
    meta = cr["metadata"]
    ns, name, uid = meta.get("namespace") or "default", meta["name"], meta.get("uid")
    current = workload_kind(cr)
    old_kind = next(k for k in WORKLOAD_KINDS if k != current)
    try:
        old = client.get(old_kind, ns, name)
    except kube.ApiError as exc:
        if exc.status != 404:  # the LWS API is not installed: nothing to surge from
            raise
        old = None
    refs = ((old or {}).get("metadata") or {}).get("ownerReferences") or []
    if old is None or not any(r.get("controller") and r.get("uid") == uid for r in refs):
        return objects, None, None
    new = new_live if new_live is not None else client.get(current, ns, name)
    if workload_ready(new, cr):
        return objects, old_kind, None
    held = copy.deepcopy(objects)
    for obj in held:
        if obj["kind"] == "Service" and obj["metadata"]["name"] == name:  # the engines' Service
            obj["spec"]["selector"] = surge_selector(name, old_kind)
    return held, None, old_kind


def _condition(type_: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}


def _report_failure(client: kube.KubeClient, cr: dict[str, Any], reason: str, message: str, logger: Any) -> None:
    """``Reconciled=False`` with ``reason``/``message`` on the CR, and a Warning Event when new.

    Best effort: during an API outage these writes fail too, and the retry reports again.
    """
    meta = cr.get("metadata") or {}
    ns, name = meta.get("namespace") or "default", meta.get("name")
    cond = _condition(RECONCILED, False, reason, message[:1000])
    previous: dict[str, Any] = {}

    def compute(fresh: dict[str, Any]) -> dict[str, Any] | None:
        old = (fresh.get("status") or {}).get("conditions") or []
        previous.update(next((c for c in old if c.get("type") == RECONCILED), {}))
        if (previous.get("status"), previous.get("reason"), previous.get("message")) == ("False", reason, cond["message"]):
            return None
        return {"conditions": merge_conditions(old, [cond], now_rfc3339())}

    try:
        update_status(client, ns, name, compute)
        if (previous.get("status"), previous.get("reason")) != ("False", reason):
            client.request("POST", kube.resource_path("v1", "events", ns), warning_event(cr, reason, message))
    except (kube.ApiError, OSError) as exc:
        logger.warning("could not report %s on %s/%s: %s", reason, ns, name, exc)


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
@kopf.on.event(*LWS_API_VERSION.split("/"), "leaderworkersets", labels=CHILD_LABELS)
@kopf.on.event("", "v1", "services", labels=CHILD_LABELS)
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=CHILD_LABELS)
def child_changed(body: kopf.Body, type: str | None, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Repair drift of one child and carry a workload's readiness into its owner's status."""
    child = _as_dict(body)
    owner = next((r for r in child["metadata"].get("ownerReferences") or []
                  if r.get("controller") and r.get("kind") == KIND), None)
    if owner is None:
        return
    client: kube.KubeClient = memo.kube
    ns = child["metadata"].get("namespace") or "default"
    cr = client.get(KIND, ns, owner["name"])
    if cr is None or cr["metadata"].get("uid") != owner.get("uid"):
        return
    try:
        cr = normalize(cr)
        objects = render(cr)
    except ValueError:
        return  # reconcile reports it
    current = workload_kind(cr)
    retire = surging = None
    # The CR's own workload and Service (named after it), not the router's objects.
    is_workload = child["kind"] == current and child["metadata"]["name"] == owner["name"]
    if is_workload or (child["kind"] == "Service" and child["metadata"]["name"] == owner["name"]):
        objects, retire, surging = surge_plan(
            client, cr, objects, new_live=child if is_workload and type != "DELETED" else None)
    wanted = next((o for o in objects if o["kind"] == child["kind"]
                   and o["metadata"]["name"] == child["metadata"]["name"]), None)
    if wanted is None:
        return  # a stale child on its way out
    live = None if type == "DELETED" else child
    if live is not None and live["metadata"].get("deletionTimestamp"):
        return  # being deleted: recreated on its DELETED event
    leave = replicas_left(cr, wanted)
    if is_workload and not kube.in_sync(wanted, live, leave):
        # Drift of the workload: first make sure that no foreign autoscaler owns its replicas.
        scalers = foreign.find(client, ns, owner["name"])
        if scalers:
            target = effective(cr, scalers)
            wanted = next(o for o in render(target) if o["kind"] == child["kind"])
            leave = replicas_left(target, wanted, scalers)
            foreign.report(client, cr, scalers, cr["spec"]["autoscaling"]["enabled"], logger)
    if not kube.in_sync(wanted, live, leave):
        result = kube.apply(client, wanted, live=live, leave=leave)
        logger.info("repaired drift of %s %s/%s: %s", child["kind"], ns, child["metadata"]["name"], result.action)
        if result.action != "unchanged":
            live = client.get(child["kind"], ns, child["metadata"]["name"])
    if retire:  # the new workload has just become Ready: move the Service, then retire the old one
        for obj in objects:
            if obj["kind"] == "Service":
                kube.apply(client, obj)
        kube.delete_if_owned(client, retire, ns, owner["name"], owner.get("uid"))
        logger.info("the %s is Ready and serves; deleted the %s", current, retire)
    if is_workload:
        _write_status(client, cr, live, observed_generation=False,
                      extra=[_surge_condition(current, surging)] if surging else None)


def _write_status(client: kube.KubeClient, cr: dict[str, Any], child: dict[str, Any] | None,
                  observed_generation: bool, extra: list[dict[str, Any]] | None = None,
                  foreign_scalers: bool = False) -> None:
    """Write the status kvpilot owns for ``cr`` (its spec as rendered) and ``child``, computed
    against a fresh read of the status so that other writers' conditions survive."""
    meta = cr["metadata"]

    def compute(fresh: dict[str, Any]) -> dict[str, Any]:
        current = {**cr, "status": fresh.get("status") or {}}
        now = now_rfc3339()
        desired = desired_status(current, child, now, observed_generation=observed_generation)
        if extra:
            desired["conditions"] = merge_conditions(desired["conditions"], extra, now)
        patch = status_patch(current, desired)
        scaling = next((c for c in current["status"].get("conditions") or [] if c.get("type") == "ScalingActive"), None)
        if observed_generation and not cr["spec"]["autoscaling"]["enabled"] and scaling and not foreign_scalers:
            # Switched off (also while no autoscaler ran, e.g. the operator was down): say so.
            off = autoscale_daemon.disabled_status({**current["status"], **patch}, now)
            patch.update(off or {})
        return patch

    update_status(client, meta.get("namespace") or "default", meta["name"], compute)


def _as_dict(body: Any) -> dict[str, Any]:
    """A plain, mutable copy of a kopf body (kopf's bodies are read-only views)."""
    return copy.deepcopy(dict(body))


@kopf.on.event("autoscaling", "v2", "horizontalpodautoscalers")
def foreign_scaler_changed(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """An HPA appeared, changed or went: if it scales an LLMDeployment or its workload
    (``scaleTargetRef`` named like the CR), sync that CR so that kvpilot stops (or resumes)
    writing its replicas and the condition says who scales it.

    A KEDA ScaledObject acts through the HPA that KEDA creates for it (``keda-hpa-*``, same
    target), so its events arrive here too and :func:`foreign.find` names the ScaledObject;
    ScaledObjects themselves are only listed, so a cluster without KEDA costs one 404 per sync
    and no watch.
    """
    obj = _as_dict(body)
    target = foreign.scale_target(obj)
    if target is None or target[1] not in (*WORKLOAD_KINDS, KIND):
        return
    client: kube.KubeClient = memo.kube
    ns = obj["metadata"].get("namespace") or "default"
    cr = client.get(KIND, ns, target[2])
    if cr is None or (cr.get("metadata") or {}).get("deletionTimestamp"):
        return
    try:
        cr = normalize(cr)
        render(cr)
    except ValueError:
        return  # reconcile reports it
    try:
        sync(client, cr, logger)  # with no foreign scaler left, a ForeignAutoscaler condition is replaced
    except (kube.NotOwnedError, kube.ApiError, OSError) as exc:
        logger.warning("could not sync %s/%s after a change of %s %s: %s", ns, target[2], obj.get("kind"),
                       obj["metadata"].get("name"), exc)


def _sync_lora_status(client: kube.KubeClient, ns: str, owner: str, logger: Any) -> None:
    """Write ``status.lora`` (`status.lora_status`: Ready replicas per adapter) when it changed; a CR
    without adapters (and no ``status.lora`` left to clear) costs no pod listing."""

    def compute(fresh: dict[str, Any]) -> dict[str, Any] | None:
        spec_lora = ((fresh.get("spec") or {}).get("lora") or {}).get("adapters")
        old = (fresh.get("status") or {}).get("lora")
        if not spec_lora and not old:
            return None
        try:
            cr = normalize(fresh)
        except ValueError:  # an invalid CR: reconcile reports it
            return None
        pods = client.list("Pod", ns, {OWNER_LABEL: owner})
        new = lora_status(cr, pods)
        return None if new == old else {"lora": new}

    try:
        update_status(client, ns, owner, compute)
    except (kube.ApiError, OSError) as exc:
        logger.warning("could not report status.lora on %s/%s: %s", ns, owner, exc)


@kopf.on.event("", "v1", "pods", labels=CHILD_LABELS)
def pod_changed(body: kopf.Body, type: str | None, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Carry why an engine pod does not start (or that one serves) into its LLMDeployment's
    ``ModelLoaded`` condition (operator/engine_failures.py), with a Warning Event when it turns
    False. Written only when the condition's status or reason changes, so a crash-looping
    deployment does not rewrite its status on every restart."""
    pod = _as_dict(body)
    meta = pod.get("metadata") or {}
    if (meta.get("labels") or {}).get("app.kubernetes.io/component") != COMPONENT:
        return  # a router pod
    owner = (meta.get("labels") or {}).get(OWNER_LABEL)
    if owner:
        _sync_lora_status(memo.kube, meta.get("namespace") or "default", owner, logger)
    if type == "DELETED":
        return
    cond = engine_failures.model_loaded_condition(pod)
    if not owner or cond is None:
        return
    client: kube.KubeClient = memo.kube
    ns = meta.get("namespace") or "default"
    changed: list[dict[str, Any]] = []

    def compute(fresh: dict[str, Any]) -> dict[str, Any] | None:
        old = (fresh.get("status") or {}).get("conditions") or []
        prev = next((c for c in old if c.get("type") == engine_failures.CONDITION), None)
        if prev is None and cond["status"] == "True":
            pass  # the first pod to serve says so
        elif prev is not None and (prev.get("status"), prev.get("reason")) == (cond["status"], cond["reason"]):
            return None
        changed.append(fresh)
        return {"conditions": merge_conditions(old, [cond], now_rfc3339())}

    try:
        update_status(client, ns, owner, compute)
        if changed and cond["status"] == "False":
            logger.warning("%s/%s: %s", ns, owner, cond["message"])
            client.request("POST", kube.resource_path("v1", "events", ns),
                           warning_event(changed[0], cond["reason"], cond["message"]))
    except (kube.ApiError, OSError) as exc:
        logger.warning("could not report %s on %s/%s: %s", engine_failures.CONDITION, ns, owner, exc)

