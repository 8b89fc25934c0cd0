"""Table tests of the pure autoscaling decision (HPA semantics; see operator/autoscaler.py).

Expected values are worked out by hand in the comments, from the HPA's formulas.
"""

from __future__ import annotations

import json

import pytest

from kvpilot.operator.autoscaler import (
    Decision,
    InvalidPolicyError,
    PodMetrics,
    Recommendation,
    ScalingHistory,
    ScalingPolicy,
    decide,
    deletion_costs,
)

NO_WINDOWS = dict(scale_up_stabilization_s=0, scale_down_stabilization_s=0)


def pods(*kv, waiting=None):
    waiting = waiting or [None] * len(kv)
    return [PodMetrics(f"p{i}", u, None, w) for i, (u, w) in enumerate(zip(kv, waiting))]


def policy(**kw):
    base = dict(min_replicas=1, max_replicas=10, target_kv_cache_utilization=0.5, **NO_WINDOWS)
    base.update(kw)
    return ScalingPolicy(**base)


# (name, per-pod KV (None = missing), current, policy overrides, expected desired)
CASES = [
    # sum 1.6 / 0.5 = 3.2 -> 4
    ("proportional up", (0.9, 0.7), 2, {}, 4),
    # ratio 1.05: inside the 10% band
    ("inside tolerance up", (0.52, 0.53), 2, {}, 2),
    # ratio 0.9 exactly: the band is inclusive
    ("tolerance edge down", (0.45, 0.45), 2, {}, 2),
    # ratio 1.12 -> ceil(2.24) = 3
    ("just outside tolerance", (0.56, 0.56), 2, {}, 3),
    # sum 0.4 / 0.5 = 0.8 -> 1
    ("proportional down", (0.1, 0.1, 0.1, 0.1), 4, {}, 1),
    # 1.4 / 0.7 is 2.0000000000000004 in floats; must give 2, not 3
    ("float noise", (0.7, 0.7, 0.0), 3, dict(target_kv_cache_utilization=0.7), 2),
    # scale-up, a silent pod counts as empty: ratio 1.8 -> (0.9+0.9+0)/3/0.5 = 1.2 -> ceil(3.6) = 4
    ("missing as empty on the way up", (0.9, 0.9, None), 3, {}, 4),
    # scale-down, silent pod at the target: (0.6 + 0.5) / 0.5 = 2.2 -> 3 (without it: ceil(1.2) = 2)
    ("missing at target on the way down", (0.1,) * 6 + (None,), 7, {}, 3),
    # two silent pods at the target: (0.2 + 1.0) / 0.5 = 2.4 -> 3; counted as full they would
    # flip the direction ((0.2 + 2.0) / 4 / 0.5 = 1.1) and hold all 4
    ("missing at target never flips down to up", (0.1, 0.1, None, None), 4, {}, 3),
    # ratio 1.2 with one pod; filled: 0.6/2/0.5 = 0.6 flips to down: stay
    ("missing flips up to down", (0.6, None), 2, {}, 2),
    # pods not created yet (current 2, one sample) count as missing: (1.0+0)/2/0.4 = 1.25 -> ceil(2.5) = 3
    ("padding to current", (1.0,), 2, dict(target_kv_cache_utilization=0.4), 3),
    # a starting pod holds a scale-up back instead of cascading: (0.9+0+0)/3/0.5 = 0.6 flips: stay
    ("starting pods stop a cascade", (0.9,), 3, {}, 3),
    # sum 6.0 / 0.5 = 12 -> clamped to 10
    ("clamp max", (1.0,) * 6, 6, {}, 10),
    # 0 / 0.5 = 0 -> clamped to min 2
    ("clamp min", (0.0, 0.0, 0.0), 3, dict(min_replicas=2), 2),
    # min 0 allows scaling to zero
    ("to zero", (0.0,), 1, dict(min_replicas=0), 0),
]


@pytest.mark.parametrize("name,kv,current,over,expected", CASES, ids=[c[0] for c in CASES])
def test_decide_table(name, kv, current, over, expected):
    d = decide(pods(*kv), current, policy(**over), ScalingHistory(), now=1000.0)
    assert d.desired_replicas == expected
    assert d.metrics_available


def test_decision_numbers_and_limits():
    d = decide(pods(1.0, 1.0, 1.0, 1.0, 1.0, 1.0), 6, policy(), ScalingHistory(), 0.0)
    assert (d.recommendation, d.kv_recommendation, d.queue_recommendation) == (12, 12, None)
    assert (d.stabilized_replicas, d.desired_replicas, d.limited_reason) == (12, 10, "TooManyReplicas")
    assert d.utilization == 1.0 and d.pods_with_metrics == 6 and d.pods_missing == 0
    assert d.message == (
        "6 -> 10 replicas: KV-cache utilisation 1.000 (sum 6.000 over 6 of 6 pods) vs target 0.50 "
        "recommends 12; TooManyReplicas (bounds 1..10)"
    )
    assert d.conditions() == [
        {"type": "ScalingActive", "status": "True", "reason": "ValidMetricFound",
         "message": "the replica count is computed from KV-cache utilisation"},
        {"type": "ScalingLimited", "status": "True", "reason": "TooManyReplicas",
         "message": "the desired count was clamped to the replica bounds"},
        {"type": "MetricsAvailable", "status": "True", "reason": "MetricsScraped",
         "message": "6 of 6 pods reported KV-cache utilisation"},
    ]


# Queue term: (kv, waiting, current, targetQueueLength, expected desired, expected queue rec)
QUEUE_CASES = [
    # KV ratio exactly 1 (stay 2); 18 waiting over 2 pods = 9/pod vs 4 -> ceil(18/4) = 5
    ((0.5, 0.5), (10, 8), 2, 4, 5, 5),
    # 8.4 waiting / 2 pods / 4 = 1.05: inside the band, no opinion
    ((0.5, 0.5), (4, 4.4), 2, 4, 2, None),
    # the queue term never lowers: KV says 1, queue says nothing
    ((0.1, 0.1), (0, 0), 2, 4, 1, None),
    # a silent pod counts 0 waiting: 10 / 2 pods / 4 = 1.25 -> ceil(10/4) = 3
    ((0.5, None), (10, None), 2, 4, 3, 3),
    # KV says 6 (3.0/0.5), queue says ceil(18/4) = 5 (6/pod vs 4): the larger wins
    ((1.0, 1.0, 1.0), (6, 6, 6), 3, 4, 6, 5),
    # 4 waiting/pod is exactly the target: no opinion, KV alone decides
    ((1.0, 1.0, 1.0), (4, 4, 4), 3, 4, 6, None),
]


@pytest.mark.parametrize("kv,waiting,current,target_q,expected,queue_rec", QUEUE_CASES)
def test_queue_term(kv, waiting, current, target_q, expected, queue_rec):
    d = decide(pods(*kv, waiting=list(waiting)), current, policy(target_queue_length=target_q), ScalingHistory(), 0.0)
    assert (d.desired_replicas, d.queue_recommendation) == (expected, queue_rec)
    assert d.queue_length == sum(w for w in waiting if w is not None)


def test_queue_ignored_without_target():
    d = decide(pods(0.5, 0.5, waiting=[100, 100]), 2, policy(), ScalingHistory(), 0.0)
    assert (d.desired_replicas, d.queue_recommendation) == (2, None)


def test_no_metrics_no_scaling():
    hist = ScalingHistory((Recommendation(990.0, 3),))
    d = decide(pods(None, None, None), 3, policy(scale_down_stabilization_s=300), hist, 1000.0)
    assert (d.desired_replicas, d.metrics_available, d.recommendation) == (3, False, None)
    assert d.history == hist  # nothing recorded
    assert d.utilization is None and d.queue_length is None and d.pods_missing == 3
    assert {c["type"]: (c["status"], c["reason"]) for c in d.conditions()} == {
        "ScalingActive": ("False", "FailedGetMetrics"),
        "ScalingLimited": ("False", "DesiredWithinRange"),
        "MetricsAvailable": ("False", "NoPodAnswered"),
    }


@pytest.mark.parametrize(
    "current,kw,expected,reason",
    [(12, {}, 10, "TooManyReplicas"), (0, {}, 1, "TooFewReplicas"), (0, dict(min_replicas=0), 0, "DesiredWithinRange")],
)
def test_no_metrics_still_clamps(current, kw, expected, reason):
    d = decide([], current, policy(**kw), ScalingHistory(), 0.0)
    assert (d.desired_replicas, d.limited_reason, d.metrics_available) == (expected, reason, False)


def run_sequence(pol, current, steps, history=ScalingHistory(), roundtrip=False):
    """steps: (time, KV of every pod) -> desired counts; the workload (and its pods) follow each
    decision."""
    out = []
    for t, kv in steps:
        d = decide(pods(*[kv] * current), current, pol, history, float(t))
        history = d.history
        if roundtrip:  # through JSON, as the CR status would store it
            history = ScalingHistory.from_dict(json.loads(json.dumps(history.to_dict())))
        current = d.desired_replicas
        out.append(current)
    return out


def test_scale_up_window_takes_lowest():
    pol = policy(scale_up_stabilization_s=60)
    # t=0 recommends 2 (inside tolerance); from t=15 on 4 (sum 2.0/0.5 would be 4 with 2 pods at 1.0).
    steps = [(0, 0.5)] + [(t, 1.0) for t in (15, 30, 45, 60)]
    # the t=0 recommendation of 2 stays inside (now-60, now] until t=60
    assert run_sequence(pol, 2, steps) == [2, 2, 2, 2, 4]


def test_scale_up_immediate_with_zero_window():
    assert run_sequence(policy(), 2, [(0, 1.0)]) == [4]


def test_scale_down_window_takes_highest():
    pol = policy(scale_down_stabilization_s=300)
    low = (0.05, 0.05, 0.05, 0.05)  # raw 1
    mid3 = (0.35, 0.35, 0.35, 0.35)  # 1.4/0.5 -> 3
    mid2 = (0.2, 0.2, 0.2, 0.2)  # 0.8/0.5 -> 2
    # first sight seeds the window with the current 4: no scale-down before t=300
    steps = [(0, low), (100, mid3), (200, mid2), (300, low), (400, low), (500, low)]
    # t=300: window (0,300] holds 3 (t=100), 2, 1 -> 3; pods shrink with the workload below,
    # so from then on pass as many pods as replicas
    out, current, history = [], 4, ScalingHistory()
    for t, kv in steps:
        d = decide(pods(*kv[:current]), current, pol, history, float(t))
        history, current = d.history, d.desired_replicas
        out.append(current)
    # t=400: window (100,400] holds 2 (t=200) and raw 1s -> 2; t=500: only 1s -> 1
    assert out == [4, 4, 4, 3, 2, 1]


def test_first_sight_blocks_immediate_scale_down():
    pol = policy(scale_down_stabilization_s=300)
    d = decide(pods(0.0, 0.0, 0.0), 3, pol, ScalingHistory(), 5000.0)
    assert (d.recommendation, d.desired_replicas) == (0, 3)
    assert d.history.recommendations == (Recommendation(5000.0, 3), Recommendation(5000.0, 0))


def test_history_roundtrip_resumes_without_jump():
    pol = policy(scale_up_stabilization_s=30, scale_down_stabilization_s=120)
    steps = [(t, 0.9 if t < 60 else 0.05) for t in range(0, 300, 15)]
    direct = run_sequence(pol, 3, steps)
    stored = run_sequence(pol, 3, steps, roundtrip=True)
    assert direct == stored
    # up: raw 6 (2.7/0.5) from t=0, but the seed 3 (t=0) is in the 30 s up window until t=30;
    # t=45: 6 pods at 0.9 recommend 11, held at 6 by the up window (t=30 said 6);
    # from t=60 raw 1 (0.3/0.5), but the 11 of t=45 stays in the 120 s down window until t=165
    assert direct == [3, 3] + [6] * 9 + [1] * 9


def test_history_pruned_to_longest_window():
    pol = policy(scale_up_stabilization_s=30, scale_down_stabilization_s=100)
    history = ScalingHistory()
    for t in range(0, 1000, 10):
        history = decide(pods(0.5, 0.5), 2, pol, history, float(t)).history
    assert [r.time for r in history.recommendations] == [float(t) for t in range(900, 1000, 10)]


def test_history_to_dict_format():
    h = ScalingHistory((Recommendation(1700000000.25, 3), Recommendation(1700000015.0, 4)))
    assert h.to_dict() == {
        "recommendations": [
            {"time": "2023-11-14T22:13:20.250Z", "replicas": 3},
            {"time": "2023-11-14T22:13:35.000Z", "replicas": 4},
        ]
    }
    assert ScalingHistory.from_dict(h.to_dict()) == h
    assert ScalingHistory.from_dict(None) == ScalingHistory()
    with pytest.raises(ValueError, match="bad autoscaling history"):
        ScalingHistory.from_dict({"recommendations": [{"time": "yesterday", "replicas": 1}]})


def test_policy_from_spec():
    spec = {"enabled": True, "minReplicas": 2, "maxReplicas": 8, "targetKVCacheUtilization": 0.6,
            "targetQueueLength": 5, "scrapeIntervalSeconds": 5, "scaleUpStabilizationSeconds": 10,
            "scaleDownStabilizationSeconds": 60}
    assert ScalingPolicy.from_spec(spec) == ScalingPolicy(2, 8, 0.6, 5.0, 10.0, 60.0, 5.0, 0.1)
    assert ScalingPolicy.from_spec({"enabled": True}, replicas=3) == ScalingPolicy(1, 3, 0.7, None, 0.0, 300.0, 15.0)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(min_replicas=3, max_replicas=2), "minReplicas <= maxReplicas"),
        (dict(max_replicas=0, min_replicas=0), "maxReplicas >= 1"),
        (dict(target_kv_cache_utilization=0.0), "targetKVCacheUtilization"),
        (dict(target_kv_cache_utilization=1.5), "targetKVCacheUtilization"),
        (dict(target_queue_length=0), "targetQueueLength"),
        (dict(scale_down_stabilization_s=-1), "scale_down_stabilization_s"),
        (dict(scrape_interval_s=0), "scrapeIntervalSeconds"),
    ],
)
def test_policy_rejects(kw, match):
    with pytest.raises(InvalidPolicyError, match=match):
        policy(**kw)


def test_decide_rejects_bad_input():
    with pytest.raises(ValueError, match="current replicas"):
        decide([], -1, policy(), ScalingHistory(), 0.0)
    with pytest.raises(ValueError, match="fraction"):
        decide(pods(1.5), 1, policy(), ScalingHistory(), 0.0)
    with pytest.raises(ValueError, match="finite"):
        decide(pods(0.5), 1, policy(), ScalingHistory(), float("nan"))


def test_deletion_costs_keep_busiest():
    ms = [
        PodMetrics("a", 0.9, 12, 3),
        PodMetrics("b", 0.1, 1, 0),
        PodMetrics("c", 0.5, 4.6, None),
        PodMetrics.missing("d", "timeout"),
    ]
    assert deletion_costs(ms) == {"a": 15, "b": 1, "c": 5}


def test_decision_scaled_flag():
    d: Decision = decide(pods(0.5, 0.5), 2, policy(), ScalingHistory(), 0.0)
    assert not d.scaled
    assert decide(pods(1.0, 1.0), 2, policy(), ScalingHistory(), 0.0).scaled


# Scale-down with pods whose /metrics fail: HPA's calcPlainMetricReplicas counts them at the target.
# (per-pod KV, None = the pod's /metrics failed; current; target; expected desired)
MISSING_DOWN = [
    # idle pods and one broken: (0 + 0 + 0 + 0.7) / 0.7 = 1 -> 1 (counted as full: ceil(1/0.7) = 2)
    ((0.0, 0.0, 0.0, None), 4, 0.7, 1),
    # (0.05 * 3 + 0.7) / 0.7 = 1.21 -> 2: the broken pod keeps only its own replica
    ((0.05, 0.05, 0.05, None), 4, 0.7, 2),
    # two broken of six: (0.4 + 1.0) / 0.5 = 2.8 -> 3 (counted as full: (0.4 + 2.0) / 0.5 = 4.8 -> 5)
    ((0.1, 0.1, 0.1, 0.1, None, None), 6, 0.5, 3),
    # pods not created yet count as missing too: one sample of 0.1 of 3 wanted -> (0.1 + 1.0) / 0.5 = 2.2 -> 3
    ((0.1,), 3, 0.5, 3),
]


@pytest.mark.parametrize("kv,current,target,expected", MISSING_DOWN)
def test_missing_pods_count_at_target_on_scale_down(kv, current, target, expected):
    d = decide(pods(*kv), current, policy(target_kv_cache_utilization=target), ScalingHistory(), 0.0)
    assert d.desired_replicas == expected
    assert d.missing_counted_as == target and d.pods_missing == current - sum(u is not None for u in kv)


def test_scale_down_with_a_broken_pod_reaches_the_bottom():
    """Load drops to zero while one pod's /metrics keeps failing: once the window has passed the
    count falls to one pod for the broken one, not one short of it (the ReplicaSet may keep the
    broken pod; the remaining count must not depend on which pod it keeps)."""
    pol = policy(target_kv_cache_utilization=0.7, max_replicas=4, scale_down_stabilization_s=8)
    history, current, out = ScalingHistory(), 4, []
    for t in range(0, 20):
        samples = [PodMetrics.missing("broken", "HTTPStatusError: 500")] + \
            [PodMetrics(f"p{i}", 0.0, 0, 0) for i in range(current - 1)]
        d = decide(samples, current, pol, history, float(t))
        history, current = d.history, d.desired_replicas
        out.append(current)
    # t=0 seeds the window with 4; from t=8 the highest recommendation left in (t-8, t] is 1
    assert out == [4] * 8 + [1] * 12


def test_missing_pods_named_and_counted_in_conditions():
    samples = [PodMetrics("a", 0.1, 0, 0), PodMetrics("b", 0.1, 0, 0), PodMetrics.missing("c", "ReadTimeout: timed out")]
    d = decide(samples, 4, policy(), ScalingHistory(), 0.0)
    # c and the fourth pod (not created yet) at the target: (0.2 + 1.0) / 0.5 = 2.4 -> 3
    assert d.desired_replicas == 3 and d.pods_missing == 2 and d.missing_pods == ("c",)
    conds = {c["type"]: c for c in d.conditions()}
    assert conds["ScalingActive"]["status"] == "True"
    assert conds["ScalingActive"]["message"] == (
        "the replica count is computed from KV-cache utilisation of 2 of 4 pods; 2 pods gave no metrics "
        "(counted at 0.5, the target, on a scale-down)")
    assert conds["MetricsAvailable"]["message"] == "2 of 4 pods reported KV-cache utilisation; no sample from c"
    assert d.message.endswith("recommends 3 (2 pods gave no metrics, counted at 0.5)")


def test_missing_pod_counted_empty_on_scale_up_in_condition():
    d = decide([PodMetrics("a", 0.9, 0, 0), PodMetrics.missing("b", "500")], 2, policy(), ScalingHistory(), 0.0)
    # up: (0.9 + 0) / 2 / 0.5 = 0.9 -> inside the tolerance: stay
    assert (d.desired_replicas, d.missing_counted_as) == (2, 0.0)
    active = next(c for c in d.conditions() if c["type"] == "ScalingActive")
    assert active["message"].endswith("1 pod gave no metrics (counted at 0, empty, on a scale-up)")


def test_no_missing_pods_keep_the_plain_condition():
    d = decide(pods(0.5, 0.5), 2, policy(), ScalingHistory(), 0.0)
    assert d.missing_counted_as is None and d.missing_pods == ()
    assert next(c for c in d.conditions() if c["type"] == "ScalingActive")["message"] == \
        "the replica count is computed from KV-cache utilisation"


def test_no_scale_down_while_a_replica_is_starting():
    # Two idle pods and one starting (no sample, counted at the target): (0 + 0 + 0.5) / 0.5 = 1,
    # so 3 -> 1, which would remove the starting pod (the ReplicaSet deletes not-Ready pods first).
    samples = [PodMetrics("a", 0.0, 0, 0), PodMetrics("b", 0.0, 0, 0), PodMetrics.missing("c", "not Ready")]
    free = decide(samples, 3, policy(), ScalingHistory(), 0.0)
    held = decide(samples, 3, policy(), ScalingHistory(), 0.0, loading=1)
    assert free.desired_replicas == 1
    assert held.desired_replicas == 3 and held.recommendation == 1
    assert held.message.endswith("1 replica is still starting, so no scale-down to 1 until it is Ready")
    # A scale-up is not held, and the bounds still apply.
    # (1.0 + 1.0 + 0) / 3 / 0.5 = 1.33 -> ceil(4.0) = 4
    up = decide([PodMetrics("a", 1.0, 0, 0), PodMetrics("b", 1.0, 0, 0), PodMetrics.missing("c", "not Ready")], 3,
                policy(), ScalingHistory(), 0.0, loading=1)
    assert up.desired_replicas == 4
    over = decide(samples, 12, policy(), ScalingHistory(), 0.0, loading=1)
    assert over.desired_replicas == 10 and over.limited_reason == "TooManyReplicas"


def test_starting_pods_counts_pending_and_young_not_ready_pods():
    from kvpilot.operator.autoscale_daemon import starting_pods

    def pod(ready=False, start=None, deleting=False):
        meta = {"name": "p", **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
        status = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
        if start:
            status["startTime"] = start
        return {"metadata": meta, "status": status}

    now = 1767225600.0 + 600  # 2026-01-01T00:10:00Z
    pods = [pod(), pod(start="2026-01-01T00:05:00Z"), pod(start="2025-12-31T23:00:00Z"),
            pod(ready=True, start="2026-01-01T00:00:00Z"), pod(deleting=True)]
    # pending; started 5 min ago (budget 30 min); started 70 min ago: stuck; Ready; terminating
    assert starting_pods(pods, now, 1800) == 2
