"""The autoscaling simulation's queueing model, and decide() driven through it on step loads."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

from kvpilot.operator.autoscaler import ScalingPolicy
from support.paths import BENCHMARKS

_PATH = BENCHMARKS / "autoscale_sim.py"
_spec = importlib.util.spec_from_file_location("autoscale_sim", _PATH)
sim = importlib.util.module_from_spec(_spec)
sys.modules["autoscale_sim"] = sim  # dataclasses look their module up there
_spec.loader.exec_module(sim)

# 128 slots, 12 s per request: Little's law gives rate x 12 requests in flight;
# at 28 req/s that is 336 = 4 replicas at 0.656 KV (ratio 0.94, inside the band).
CFG = sim.SimConfig(duration_s=5400, startup_s=120.0, n_bursts=0, seed=3)
POLICY = ScalingPolicy(min_replicas=1, max_replicas=20, target_kv_cache_utilization=0.7)


def test_route_waterfills():
    add = sim._route(np.array([5, 0, 3]), 10)
    assert add.tolist() == [1, 6, 3]  # every replica ends at 6
    assert sim._route(np.array([0, 3]), 4).tolist() == [4, 0]  # 4 and 3: the max is as low as it gets
    assert sim._route(np.array([2, 2]), 0).tolist() == [0, 0]


def test_trace_diurnal_extremes():
    cfg = sim.SimConfig(n_bursts=0)
    rate = sim.load_trace(cfg, np.random.default_rng(0))
    assert rate.shape == (86400,)
    assert rate[4 * 3600] == pytest.approx(cfg.rate_min) and rate[16 * 3600] == pytest.approx(cfg.rate_max)
    assert rate.min() == pytest.approx(cfg.rate_min) and rate.max() == pytest.approx(cfg.rate_max)


def test_steady_load_stays_put_and_matches_littles_law():
    rate = np.full(3600, 28.0)
    res = sim.simulate(rate, CFG, POLICY)
    assert res.replica_changes == 0
    assert set(res.replicas.tolist()) == {4}
    assert res.kv[600:].mean() == pytest.approx(28 * 12 / (4 * 128), abs=0.02)


def test_step_load_up_then_down():
    rate = np.concatenate([np.full(1800, 28.0), np.full(1800, 56.0), np.full(1800, 28.0)])
    res = sim.simulate(rate, CFG, POLICY)
    ups = [e for e in res.events if e[2] > e[1]]
    downs = [e for e in res.events if e[2] < e[1]]
    # the first scale-up comes within two scrape intervals of the step
    assert 1800 < ups[0][0] <= 1800 + 2 * CFG.scrape_interval_s
    # 56 req/s x 12 s = 672 in flight = 7.5 replicas at 0.7 -> 8. The backlog queued during the
    # 120 s start-up briefly saturates the new pods too, so it overshoots, boundedly, first.
    assert res.replicas[3599] == 8 and 8 < res.replicas.max() <= 12
    # after the load drops, nothing comes down before the 300 s scale-down window has passed
    later = [e for e in downs if e[0] >= 3600]
    assert later and later[0][0] >= 3600 + 300
    assert res.replicas[-1] == 4
    s = sim.summarize(res, CFG)
    # GPU-hours equal the integral of replicas plus draining replicas' tails
    assert s["gpu_hours"] >= res.replicas.sum() / 3600.0
    assert s["peak_replicas"] == res.replicas.max()


def test_fixed_deployment_never_changes():
    rate = np.full(600, 28.0)
    res = sim.simulate(rate, CFG, None, fixed_replicas=5)
    assert res.replica_changes == 0 and set(res.replicas.tolist()) == {5}
    assert sim.summarize(res, CFG)["gpu_hours"] == pytest.approx(5 * 600 / 3600)
    assert sim.peak_replicas(rate, CFG, 0.7) == 4  # ceil(336 / 89.6)
