"""Day-long simulation of KV-cache autoscaling: drives the operator's real ``decide()`` with a
diurnal-plus-bursts request trace through a queueing model of engine replicas.

Model (one step = 1 s):

- requests arrive as a Poisson process with rate lambda(t) (requests/s): a diurnal curve (trough at
  04:00, peak at 16:00) times short bursts (steep 60 s ramps to 1.5-2.2x for 5-20 minutes);
- a router sends each arrival to the Ready, non-draining replica with the fewest requests in
  flight (running + waiting), as a least-load / KV-aware router does;
- a replica runs at most ``slots`` requests at once (its KV pool: ``slots`` requests of average
  footprint), so KV utilisation = running / slots; the rest wait in its queue. Each running
  request finishes with probability dt / service_s per step (exponential service time);
- every ``scrape_interval_s`` the autoscaler reads every pod (starting pods give no metrics),
  calls ``decide()`` and resizes: new replicas become Ready ``startup_s`` later (scheduling plus
  model load); removed replicas are the least-loaded ones (pod-deletion-cost), taken out of the
  router and drained until empty (GPU time is counted until then).

Usage (from the repository root; writes the PNG and prints a Markdown table):

    .venv/bin/python benchmarks/autoscale_sim.py --png docs/autoscale_sim.png
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field

import numpy as np

from kvpilot.operator.autoscaler import PodMetrics, ScalingHistory, ScalingPolicy, decide


@dataclass(frozen=True)
class SimConfig:
    """Knobs of the model; times in seconds, rates in requests/s."""

    duration_s: int = 24 * 3600
    slots: int = 128  # concurrent requests one replica's KV pool holds
    service_s: float = 12.0  # mean time a request holds its KV (prefill + decode)
    startup_s: float = 120.0  # from scale-up decision to Ready
    scrape_interval_s: float = 15.0
    rate_min: float = 8.0  # diurnal trough
    rate_max: float = 60.0  # diurnal peak
    n_bursts: int = 8
    gpus_per_replica: int = 1
    seed: int = 0


@dataclass
class SimResult:
    """Per-second series (length duration_s) and counters of one run."""

    name: str
    rate: np.ndarray  # offered load, requests/s
    kv: np.ndarray  # mean KV utilisation over Ready replicas, 0..1
    replicas: np.ndarray  # workload replicas (starting + Ready, excluding draining)
    waiting: np.ndarray  # requests waiting in engine queues
    gpu_seconds: float = 0.0
    replica_changes: int = 0
    arrivals: int = 0
    events: list[tuple[float, int, int]] = field(default_factory=list)  # (time, from, to)


def load_trace(cfg: SimConfig, rng: np.random.Generator) -> np.ndarray:
    """Offered load per second: diurnal curve times bursts. Shape (duration_s,), float64 req/s."""
    t = np.arange(cfg.duration_s, dtype=np.float64)
    phase = 2 * np.pi * (t - 4 * 3600) / 86400.0
    rate = cfg.rate_min + (cfg.rate_max - cfg.rate_min) * 0.5 * (1 - np.cos(phase))
    factor = np.ones_like(t)
    for _ in range(cfg.n_bursts):
        start = rng.uniform(0.05, 0.95) * cfg.duration_s
        length = rng.uniform(300, 1200)
        height = rng.uniform(0.5, 1.2)
        ramp = np.clip(np.minimum(t - start, start + length - t) / 60.0, 0.0, 1.0)
        factor += height * ramp
    return rate * factor


def _route(loads: np.ndarray, arrivals: int) -> np.ndarray:
    """Integer water-filling: add ``arrivals`` to ``loads`` keeping the maximum lowest."""
    add = np.zeros(len(loads), dtype=np.int64)
    if arrivals == 0:
        return add
    order = np.argsort(loads, kind="stable")
    sorted_loads = loads[order]
    cum = np.cumsum(sorted_loads)
    k = len(loads)
    for j in range(1, len(loads) + 1):
        if j == len(loads) or (arrivals + cum[j - 1]) / j <= sorted_loads[j]:
            k = j
            break
    level = (arrivals + cum[k - 1]) // k
    fill = np.maximum(level - sorted_loads[:k], 0)
    rest = arrivals - int(fill.sum())
    fill[:rest] += 1  # the remainder goes one each to the least loaded
    add[order[:k]] = fill
    return add


def simulate(
    rate: np.ndarray, cfg: SimConfig, policy: ScalingPolicy | None, fixed_replicas: int = 0, name: str = ""
) -> SimResult:
    """Run the model over ``rate``; ``policy=None`` keeps ``fixed_replicas`` Ready all day."""
    rng = np.random.default_rng(cfg.seed + 1)
    # Start the day warm, sized for the first second's load (the fixed deployment: its size).
    n0 = fixed_replicas if policy is None else max(policy.min_replicas, peak_replicas(rate[:1], cfg, policy.target_kv_cache_utilization))
    running = np.zeros(n0, dtype=np.int64)
    waiting = np.zeros(n0, dtype=np.int64)
    ready_at = np.zeros(n0)  # the day starts with warm replicas
    draining = np.zeros(n0, dtype=bool)
    history = ScalingHistory()
    p_done = 1.0 / cfg.service_s
    n = len(rate)
    res = SimResult(name, rate, np.zeros(n), np.zeros(n, dtype=np.int64), np.zeros(n))
    next_decision = cfg.scrape_interval_s
    for t in range(n):
        running -= rng.binomial(running, p_done)
        serving = np.flatnonzero(~draining & (ready_at <= t))
        arrivals = int(rng.poisson(rate[t]))
        res.arrivals += arrivals
        if len(serving):
            waiting[serving] += _route(running[serving] + waiting[serving], arrivals)
        admit = np.minimum(waiting, cfg.slots - running)
        running += admit
        waiting -= admit
        gone = draining & (running + waiting == 0)
        if gone.any():
            keep = ~gone
            running, waiting, ready_at, draining = running[keep], waiting[keep], ready_at[keep], draining[keep]
        res.gpu_seconds += len(running) * cfg.gpus_per_replica
        serving = np.flatnonzero(~draining & (ready_at <= t))
        res.kv[t] = running[serving].mean() / cfg.slots if len(serving) else 0.0
        res.waiting[t] = waiting.sum()
        members = np.flatnonzero(~draining)
        res.replicas[t] = len(members)
        if policy is None or t < next_decision:
            continue
        next_decision += cfg.scrape_interval_s
        samples = [
            PodMetrics(f"r{i}", running[i] / cfg.slots, float(running[i]), float(waiting[i]))
            if ready_at[i] <= t
            else PodMetrics.missing(f"r{i}", "starting")
            for i in members
        ]
        d = decide(samples, len(members), policy, history, float(t))
        history = d.history
        if d.desired_replicas > len(members):
            extra = d.desired_replicas - len(members)
            running = np.concatenate([running, np.zeros(extra, dtype=np.int64)])
            waiting = np.concatenate([waiting, np.zeros(extra, dtype=np.int64)])
            ready_at = np.concatenate([ready_at, np.full(extra, t + cfg.startup_s)])
            draining = np.concatenate([draining, np.zeros(extra, dtype=bool)])
        elif d.desired_replicas < len(members):
            # Starting pods go first (the ReplicaSet deletes not-Ready pods first), then the
            # lowest pod-deletion-cost (fewest requests in flight).
            cost = np.where(ready_at[members] > t, -1, running[members] + waiting[members])
            victims = members[np.argsort(cost, kind="stable")[: len(members) - d.desired_replicas]]
            draining[victims] = True
        if d.scaled:
            res.replica_changes += 1
            res.events.append((float(t), len(members), d.desired_replicas))
    return res


def summarize(res: SimResult, cfg: SimConfig) -> dict[str, float]:
    """The table's numbers: minutes with mean KV > 95%, replica changes, GPU-hours, mean queueing
    delay per request (s, by Little's law: waiting request-seconds / arrivals), peak replicas."""
    return {
        "kv_over_95_min": float((res.kv > 0.95).sum()) / 60.0,
        "replica_changes": res.replica_changes,
        "gpu_hours": res.gpu_seconds / 3600.0,
        "mean_wait_s": float(res.waiting.sum()) / max(res.arrivals, 1),
        "peak_replicas": int(res.replicas.max()),
        "mean_replicas": float(res.replicas.mean()),
    }


def peak_replicas(rate: np.ndarray, cfg: SimConfig, target: float) -> int:
    """Replicas that hold the trace's peak load at ``target`` KV utilisation (Little's law:
    requests in flight = rate x service time)."""
    return math.ceil(float(rate.max()) * cfg.service_s / (cfg.slots * target))


def markdown_table(rows: list[tuple[str, dict[str, float]]]) -> str:
    """The summaries as a Markdown table, the fixed deployment last as the baseline."""
    base = rows[-1][1]["gpu_hours"]
    lines = [
        "| deployment | time with KV > 95% (min) | replica changes | GPU-hours | vs fixed | mean queueing delay (s) | replicas mean / peak |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in rows:
        lines.append(
            f"| {name} | {s['kv_over_95_min']:.1f} | {s['replica_changes']} | {s['gpu_hours']:.1f} | "
            f"{100 * s['gpu_hours'] / base:.0f}% | {s['mean_wait_s']:.2f} | {s['mean_replicas']:.1f} / {s['peak_replicas']} |"
        )
    return "\n".join(lines)


def plot(results: list[SimResult], target: float, path: str) -> None:
    """Three stacked panels over the day: offered load, mean KV utilisation, replicas."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hours = np.arange(len(results[0].rate)) / 3600.0
    fig, (ax_load, ax_kv, ax_rep) = plt.subplots(3, 1, figsize=(11, 8.5), sharex=True)
    ax_load.plot(hours, results[0].rate, lw=0.7, color="black")
    ax_load.set_ylabel("offered load (req/s)")
    colors = ["tab:blue", "tab:orange", "tab:gray"]
    step = 60  # plot per-minute means to keep the lines readable
    for res, color in zip(results, colors):
        m = len(res.kv) // step
        kv = res.kv[: m * step].reshape(m, step).mean(axis=1)
        ax_kv.plot(hours[: m * step : step], kv, lw=0.8, color=color, label=res.name)
        ax_rep.step(hours, res.replicas, where="post", lw=1.0, color=color, label=res.name)
    ax_kv.axhline(target, ls="--", lw=0.8, color="green", label=f"target {target:.2f}")
    ax_kv.axhline(0.95, ls=":", lw=0.8, color="red", label="95%")
    ax_kv.set_ylabel("mean KV utilisation (1-min mean)")
    ax_kv.set_ylim(0, 1.05)
    ax_kv.legend(loc="lower right", fontsize=7)
    ax_rep.set_ylabel("replicas")
    ax_rep.set_xlabel("hour of day")
    ax_rep.legend(loc="upper left", fontsize=7)
    ax_rep.set_xlim(0, hours[-1])
    fig.suptitle("kvpilot autoscaling on KV-cache utilisation: one simulated day")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-s", type=float, default=120.0)
    ap.add_argument("--png", default="docs/autoscale_sim.png")
    args = ap.parse_args(argv)
    cfg = SimConfig(duration_s=int(args.hours * 3600), startup_s=args.startup_s, seed=args.seed)
    rate = load_trace(cfg, np.random.default_rng(cfg.seed))
    target = 0.7
    fixed = peak_replicas(rate, cfg, target)
    common = dict(min_replicas=1, max_replicas=2 * fixed, target_kv_cache_utilization=target,
                  scrape_interval_s=cfg.scrape_interval_s)
    results = [
        simulate(rate, cfg, ScalingPolicy(**common), name="autoscaled, CRD defaults (KV only)"),
        simulate(rate, cfg, ScalingPolicy(**common, target_queue_length=8), name="autoscaled + targetQueueLength 8"),
        simulate(rate, cfg, ScalingPolicy(**common, scale_down_stabilization_s=0), name="autoscaled, no scale-down window"),
        simulate(rate, cfg, None, fixed_replicas=fixed, name=f"fixed {fixed} replicas (peak at target)"),
    ]
    plot([results[0], results[2], results[3]], target, args.png)
    print(markdown_table([(r.name, summarize(r, cfg)) for r in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
