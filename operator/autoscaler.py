"""Replica autoscaling from engine KV-cache utilisation: the pure decision and its data types.

``decide()`` is a pure function (no clock, no I/O): the operator passes it the per-pod samples it
scraped, the workload's current replica count, the policy from ``spec.autoscaling``, the
recommendation history it keeps in the CR status, and the time. It returns a :class:`Decision`
carrying the desired replica count, the numbers behind it and the new history to store.

The semantics are those of the Kubernetes HorizontalPodAutoscaler (``pkg/controller/podautoscaler``:
``replica_calculator.go`` and ``horizontal.go``), specialised to one per-pod gauge:

- desired = ceil(sum of per-pod KV utilisation / target), i.e. ceil(currentReplicas * ratio) with
  ratio = mean utilisation / target; no change while |ratio - 1| <= tolerance (10%);
- pods without a sample count as empty (0.0) when the others say "scale up" and as exactly at the
  target when they say "scale down" (``calcPlainMetricReplicas``: a silent pod neither pushes a
  scale-down further nor holds it back beyond its own replica); if filling them in flips the
  direction or lands inside the tolerance, the replica count stays put;
- a queue-length term recommends ceil(total waiting / targetQueueLength) when pods queue beyond
  ``targetQueueLength`` (beyond tolerance); it can only raise the recommendation (the larger of the
  two recommendations wins, as with several HPA metrics);
- stabilisation windows: a scale-up goes to the lowest recommendation seen in the scale-up window
  (including this one), a scale-down to the highest seen in the scale-down window;
- no scale-down while a replica is still starting (``loading``): the ReplicaSet would remove
  that one first, wasting its model load;
- the result is clamped to [minReplicas, maxReplicas]; a current count outside that range is
  brought back into it even when no metrics are available.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

log = logging.getLogger(__name__)

#: HPA's default ``--horizontal-pod-autoscaler-tolerance``.
DEFAULT_TOLERANCE = 0.1

# Reasons, in the HPA's vocabulary where one exists (kubectl describe hpa).
REASON_VALID_METRIC = "ValidMetricFound"
REASON_NO_METRICS = "FailedGetMetrics"
REASON_TOO_FEW = "TooFewReplicas"
REASON_TOO_MANY = "TooManyReplicas"
REASON_WITHIN_RANGE = "DesiredWithinRange"


class InvalidPolicyError(ValueError):
    """``spec.autoscaling`` holds values that no autoscaler could honour."""


@dataclass(frozen=True)
class PodMetrics:
    """What one engine pod's ``/metrics`` said, or that it said nothing.

    Attributes:
        pod: pod name.
        kv_cache_usage: fraction of the KV-cache blocks in use, 0..1; ``None`` when the pod gave no
            usable sample (not Ready, unreachable, timed out, no known metric name).
        num_requests_running: requests in the running batch (count), ``None`` when unknown.
        num_requests_waiting: requests queued in the engine (count), ``None`` when unknown.
        error: why the sample is missing, for logs and the status message.
    """

    pod: str
    kv_cache_usage: float | None
    num_requests_running: float | None = None
    num_requests_waiting: float | None = None
    error: str | None = None

    @property
    def available(self) -> bool:
        """True when the pod gave a KV-cache utilisation sample."""
        return self.kv_cache_usage is not None

    @classmethod
    def missing(cls, pod: str, error: str) -> PodMetrics:
        """A pod that gave no sample, with the reason."""
        return cls(pod=pod, kv_cache_usage=None, error=error)


@dataclass(frozen=True)
class ScalingPolicy:
    """The scaling knobs of ``spec.autoscaling`` (CRD ``serving.kvpilot.io/v1alpha1``).

    Attributes:
        min_replicas, max_replicas: bounds on the decision (replicas), 0 <= min <= max, max >= 1.
        target_kv_cache_utilization: per-pod KV utilisation to aim for, fraction in (0, 1].
        target_queue_length: waiting requests per pod beyond which the queue term scales up;
            ``None`` disables the queue term.
        scale_up_stabilization_s, scale_down_stabilization_s: window lengths (seconds, >= 0).
        scrape_interval_s: seconds between decisions (used by the operator, not by ``decide``).
        tolerance: dead band around ratio 1.0 (fraction); the HPA's default 0.1.

    Raises:
        InvalidPolicyError: a value is outside the ranges above.
    """

    min_replicas: int = 1
    max_replicas: int = 1
    target_kv_cache_utilization: float = 0.7
    target_queue_length: float | None = None
    scale_up_stabilization_s: float = 0.0
    scale_down_stabilization_s: float = 300.0
    scrape_interval_s: float = 15.0
    tolerance: float = DEFAULT_TOLERANCE

    def __post_init__(self) -> None:
        if not (0 <= self.min_replicas <= self.max_replicas and self.max_replicas >= 1):
            raise InvalidPolicyError(
                f"need 0 <= minReplicas <= maxReplicas and maxReplicas >= 1, "
                f"got minReplicas={self.min_replicas} maxReplicas={self.max_replicas}"
            )
        if not 0.0 < self.target_kv_cache_utilization <= 1.0:
            raise InvalidPolicyError(
                f"targetKVCacheUtilization must be in (0, 1], got {self.target_kv_cache_utilization}"
            )
        if self.target_queue_length is not None and not self.target_queue_length > 0:
            raise InvalidPolicyError(f"targetQueueLength must be > 0, got {self.target_queue_length}")
        for name in ("scale_up_stabilization_s", "scale_down_stabilization_s", "tolerance"):
            if not getattr(self, name) >= 0:
                raise InvalidPolicyError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.scrape_interval_s > 0:
            raise InvalidPolicyError(f"scrapeIntervalSeconds must be > 0, got {self.scrape_interval_s}")

    @classmethod
    def from_spec(cls, autoscaling: Mapping[str, Any], replicas: int | None = None) -> ScalingPolicy:
        """Build from the CR's ``spec.autoscaling`` (camelCase CRD names, CRD defaults).

        ``minReplicas`` defaults to 1; a missing ``maxReplicas`` becomes the larger of
        ``minReplicas`` and ``replicas`` (``spec.replicas``).
        Raises InvalidPolicyError as the constructor does.
        """
        min_r = int(autoscaling.get("minReplicas", 1))
        max_r = int(autoscaling.get("maxReplicas", max(min_r, 1, replicas or 1)))
        queue = autoscaling.get("targetQueueLength")
        return cls(
            min_replicas=min_r,
            max_replicas=max_r,
            target_kv_cache_utilization=float(autoscaling.get("targetKVCacheUtilization", 0.7)),
            target_queue_length=None if queue is None else float(queue),
            scale_up_stabilization_s=float(autoscaling.get("scaleUpStabilizationSeconds", 0)),
            scale_down_stabilization_s=float(autoscaling.get("scaleDownStabilizationSeconds", 300)),
            scrape_interval_s=float(autoscaling.get("scrapeIntervalSeconds", 15)),
        )


@dataclass(frozen=True)
class Recommendation:
    """One raw recommendation (replicas) made at ``time`` (Unix seconds)."""

    time: float
    replicas: int


def _format_time(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _parse_time(value: Any) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


@dataclass(frozen=True)
class ScalingHistory:
    """The recommendations still inside a stabilisation window, oldest first.

    Kept in the CR status (``to_dict``/``from_dict``) so that a restarted operator resumes the
    windows instead of jumping.
    """

    recommendations: tuple[Recommendation, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: ``{"recommendations": [{"time": RFC 3339 (ms, UTC), "replicas": n}]}``."""
        return {"recommendations": [{"time": _format_time(r.time), "replicas": r.replicas} for r in self.recommendations]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> ScalingHistory:
        """Inverse of ``to_dict``; ``None`` or ``{}`` gives an empty history.

        Raises:
            ValueError: an entry lacks ``time``/``replicas`` or has an unparsable time.
        """
        if not data:
            return cls()
        try:
            recs = [Recommendation(_parse_time(r["time"]), int(r["replicas"])) for r in data.get("recommendations") or ()]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad autoscaling history in status: {exc!r}") from exc
        return cls(tuple(sorted(recs, key=lambda r: r.time)))


@dataclass(frozen=True)
class Decision:
    """The outcome of one ``decide()`` call.

    Attributes:
        desired_replicas: replicas to set on the child workload.
        current_replicas: the count it was decided from.
        recommendation: raw metric recommendation before stabilisation and clamping, ``None``
            when no pod gave metrics.
        kv_recommendation, queue_recommendation: the two terms (``queue_recommendation`` is
            ``None`` when the queue term had nothing to say).
        stabilized_replicas: after the windows, before clamping (``None`` without metrics).
        metrics_available: at least one pod gave a KV sample.
        utilization: mean KV utilisation (0..1) over the pods that answered, ``None`` if none did.
        queue_length: total waiting requests over the pods that answered, ``None`` if none did.
        pods_with_metrics, pods_missing: pod counts (missing includes pods not created yet).
        missing_counted_as: the KV utilisation the missing pods were counted at (0.0 on the way
            up, the target on the way down), ``None`` when no pod was missing or none answered.
        missing_pods: names of the existing pods that gave no sample (pods not created yet
            have no name and are only counted).
        limited_reason: ``TooFewReplicas``/``TooManyReplicas`` when the bounds changed the
            result, else ``DesiredWithinRange``.
        message: one sentence with the numbers, for the Event and the log.
        history: the history to store for the next call.
    """

    desired_replicas: int
    current_replicas: int
    recommendation: int | None
    kv_recommendation: int | None
    queue_recommendation: int | None
    stabilized_replicas: int | None
    metrics_available: bool
    utilization: float | None
    queue_length: float | None
    pods_with_metrics: int
    pods_missing: int
    limited_reason: str
    message: str
    history: ScalingHistory = field(default_factory=ScalingHistory)
    missing_counted_as: float | None = None
    missing_pods: tuple[str, ...] = ()

    @property
    def scaled(self) -> bool:
        """True when the desired count differs from the current one."""
        return self.desired_replicas != self.current_replicas

    def conditions(self) -> list[dict[str, str]]:
        """``ScalingActive``, ``ScalingLimited``, ``MetricsAvailable`` as Kubernetes condition
        dicts (``type``, ``status``, ``reason``, ``message``); the caller adds transition times."""
        n = self.pods_with_metrics + self.pods_missing
        if self.metrics_available:
            metrics_msg = f"{self.pods_with_metrics} of {n} pods reported KV-cache utilisation"
            if self.missing_pods:
                shown = ", ".join(self.missing_pods[:5]) + (", ..." if len(self.missing_pods) > 5 else "")
                metrics_msg += f"; no sample from {shown}"
            metrics = ("True", "MetricsScraped", metrics_msg)
            active_msg = "the replica count is computed from KV-cache utilisation"
            if self.pods_missing:
                active_msg += f" of {self.pods_with_metrics} of {n} pods; {_missing_phrase(self.pods_missing)}"
                if self.missing_counted_as is not None:
                    active_msg += f" (counted at {self.missing_counted_as:g}, " + (
                        "the target, on a scale-down)" if self.missing_counted_as > 0 else "empty, on a scale-up)")
            active = ("True", REASON_VALID_METRIC, active_msg)
        else:
            metrics = ("False", "NoPodAnswered", f"none of {n} pods reported KV-cache utilisation; not scaling")
            active = ("False", REASON_NO_METRICS, "no metrics, so no scaling decision")
        limited = self.limited_reason != REASON_WITHIN_RANGE
        limits = (
            "True" if limited else "False",
            self.limited_reason,
            "the desired count was clamped to the replica bounds" if limited else "the desired count is within the bounds",
        )
        return [
            {"type": t, "status": s, "reason": r, "message": m}
            for t, (s, r, m) in (("ScalingActive", active), ("ScalingLimited", limits), ("MetricsAvailable", metrics))
        ]


def _missing_phrase(n: int) -> str:
    return f"{n} pod gave no metrics" if n == 1 else f"{n} pods gave no metrics"


def _ceil(x: float) -> int:
    # Rounding first keeps 1.4 / 0.7 == 2.0000000000000004 from becoming 3.
    return math.ceil(round(x, 9))


def _kv_recommendation(usages: Sequence[float | None], current: int, target: float,
                       tolerance: float) -> tuple[int, float | None]:
    """HPA's ``calcPlainMetricReplicas`` for one per-pod gauge (``usages``: one entry per pod).

    Returns (recommended replicas, the value the missing pods were counted at or ``None``).
    """
    present = [u for u in usages if u is not None]
    ratio = sum(present) / len(present) / target
    n_missing = len(usages) - len(present)
    if n_missing == 0:
        if abs(1.0 - ratio) <= tolerance:
            return current, None
        return _ceil(ratio * len(present)), None
    # On the way down silent pods count as exactly at the target; otherwise as empty.
    fill = target if ratio < 1.0 else 0.0
    filled = present + [fill] * n_missing
    new_ratio = sum(filled) / len(filled) / target
    if abs(1.0 - new_ratio) <= tolerance or (ratio < 1.0 < new_ratio) or (ratio > 1.0 > new_ratio):
        return current, fill
    desired = _ceil(new_ratio * len(filled))
    if (new_ratio < 1.0 and desired > current) or (new_ratio > 1.0 and desired < current):
        return current, fill
    return desired, fill


def _queue_recommendation(waiting: Sequence[float], n_pods: int, target: float | None, tolerance: float) -> int | None:
    if target is None or n_pods == 0:
        return None
    total = sum(waiting)
    if total / n_pods / target <= 1.0 + tolerance:
        return None
    return _ceil(total / target)


def _stabilize(
    raw: int, current: int, history: ScalingHistory, policy: ScalingPolicy, now: float
) -> tuple[int, ScalingHistory]:
    """HPA's ``stabilizeRecommendationWithBehaviors``: returns (stabilised, new history)."""
    recs = list(history.recommendations)
    if not recs and policy.scale_down_stabilization_s > 0:
        # As the HPA does on its first sight of a target: no scale-down until a window has passed.
        recs = [Recommendation(now, current)]
    up_cut = now - policy.scale_up_stabilization_s
    down_cut = now - policy.scale_down_stabilization_s
    up, down = raw, raw
    for r in recs:
        if r.time > up_cut:
            up = min(up, r.replicas)
        if r.time > down_cut:
            down = max(down, r.replicas)
    stabilized = min(max(current, up), down)
    keep_cut = now - max(policy.scale_up_stabilization_s, policy.scale_down_stabilization_s)
    kept = tuple(r for r in recs if r.time > keep_cut and r.time <= now) + (Recommendation(now, raw),)
    return stabilized, ScalingHistory(kept)


def _clamp(n: int, policy: ScalingPolicy) -> tuple[int, str]:
    if n > policy.max_replicas:
        return policy.max_replicas, REASON_TOO_MANY
    if n < policy.min_replicas:
        return policy.min_replicas, REASON_TOO_FEW
    return n, REASON_WITHIN_RANGE


def decide(
    metrics: Sequence[PodMetrics],
    current: int,
    policy: ScalingPolicy,
    history: ScalingHistory,
    now: float,
    loading: int = 0,
) -> Decision:
    """Decide the replica count for one deployment (pure; HPA semantics, see the module doc).

    Args:
        metrics: one entry per existing, non-terminating engine pod; pods that are not Ready or
            did not answer appear with ``kv_cache_usage=None``. When fewer entries than
            ``current`` are given, the shortfall (pods not created yet) counts as missing.
        current: the workload's current desired replica count (>= 0).
        policy: the autoscaling knobs.
        history: recommendations from earlier calls (from the CR status).
        now: the time of this decision, Unix seconds; must not go backwards between calls.
        loading: replicas still starting (scheduled or loading the model, within their startup
            budget). While any is, the metrics never lower the count: a ReplicaSet removes
            not-Ready pods first, so a scale-down would kill a replica that is still loading.
            Bounds still apply (a count above ``maxReplicas`` comes down).

    Returns:
        A :class:`Decision`; store ``decision.history`` for the next call.

    Raises:
        ValueError: ``current`` is negative, ``now`` is not finite, or a KV sample is outside 0..1.
    """
    if current < 0:
        raise ValueError(f"current replicas must be >= 0, got {current}")
    if not math.isfinite(now):
        raise ValueError(f"now must be a finite Unix time, got {now}")
    for m in metrics:
        if m.kv_cache_usage is not None and not 0.0 <= m.kv_cache_usage <= 1.0 + 1e-9:
            raise ValueError(f"pod {m.pod}: KV-cache utilisation must be a fraction in 0..1, got {m.kv_cache_usage}")
    usages: list[float | None] = [m.kv_cache_usage for m in metrics]
    usages += [None] * max(0, current - len(usages))
    answered = [m for m in metrics if m.available]
    n_missing = len(usages) - len(answered)

    if not answered:
        desired, limited = _clamp(current, policy)
        msg = f"no metrics from any of {len(usages)} pods; keeping {current} replicas"
        if desired != current:
            msg = f"no metrics from any of {len(usages)} pods; {limited}: {current} -> {desired} replicas"
        return Decision(desired, current, None, None, None, None, False, None, None, 0, n_missing, limited, msg, history)

    utilization = sum(m.kv_cache_usage for m in answered) / len(answered)
    queue_length = sum(m.num_requests_waiting or 0.0 for m in answered)
    kv_rec, fill = _kv_recommendation(usages, current, policy.target_kv_cache_utilization, policy.tolerance)
    queue_rec = _queue_recommendation(
        [m.num_requests_waiting or 0.0 for m in answered], len(usages), policy.target_queue_length, policy.tolerance
    )
    raw = kv_rec if queue_rec is None else max(kv_rec, queue_rec)
    stabilized, new_history = _stabilize(raw, current, history, policy, now)
    held_for_loading = loading > 0 and stabilized < current
    desired, limited = _clamp(current if held_for_loading else stabilized, policy)
    msg = (
        f"{current} -> {desired} replicas: KV-cache utilisation {utilization:.3f} (sum "
        f"{sum(m.kv_cache_usage for m in answered):.3f} over {len(answered)} of {len(usages)} pods) "
        f"vs target {policy.target_kv_cache_utilization:.2f} recommends {kv_rec}"
    )
    if n_missing:
        msg += f" ({_missing_phrase(n_missing)}, counted at {fill:g})"
    if queue_rec is not None:
        msg += f"; queue {queue_length:g} waiting vs target {policy.target_queue_length:g}/pod recommends {queue_rec}"
    if stabilized != raw:
        msg += f"; stabilisation windows hold it at {stabilized}"
    if held_for_loading:
        msg += (f"; {loading} {'replica is' if loading == 1 else 'replicas are'} still starting, so no "
                f"scale-down to {stabilized} until {'it is' if loading == 1 else 'they are'} Ready")
    if limited != REASON_WITHIN_RANGE:
        msg += f"; {limited} (bounds {policy.min_replicas}..{policy.max_replicas})"
    log.debug("decide: %s", msg)
    return Decision(
        desired, current, raw, kv_rec, queue_rec, stabilized, True, utilization, queue_length,
        len(answered), n_missing, limited, msg, new_history, fill if n_missing else None,
        tuple(m.pod for m in metrics if not m.available),
    )


def deletion_costs(metrics: Sequence[PodMetrics]) -> dict[str, int]:
    """Values for the ``controller.kubernetes.io/pod-deletion-cost`` annotation, per pod.

    The ReplicaSet controller removes pods with the lowest cost first, so the cost is the pod's
    requests in flight (running + waiting, rounded): the least-loaded pods go on scale-down and
    the busiest stay. Pods without a sample are left out (their annotation is not touched; a
    not-Ready pod is deleted before Ready ones anyway).
    """
    costs = {}
    for m in metrics:
        if m.num_requests_running is None and m.num_requests_waiting is None:
            continue
        costs[m.pod] = int(round((m.num_requests_running or 0.0) + (m.num_requests_waiting or 0.0)))
    return costs

