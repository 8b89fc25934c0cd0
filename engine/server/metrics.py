"""Prometheus metrics of the engine: vLLM's families, names, semantics and buckets under ``kvpilot:``.

`PrometheusStatLogger` is registered with ``llm.add_stat_logger`` and called from the engine's
background thread after every step and once more when the engine turns idle, so the gauges
(``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc``) fall back to 0 when
nothing runs: ``kvpilot:kv_cache_usage_perc`` is what the operator scales on. prometheus-client's
metrics are thread-safe, so the HTTP thread can render ``/metrics`` while the engine updates them.

Conventions from vLLM's ``vllm/v1/metrics/loggers.py`` (v0.11): counters drop ``_total`` from their
name (prometheus-client appends it on the wire), prefix-cache counters count tokens, every series
has the label ``model_name``, ``request_success`` adds ``finished_reason`` (stop / length / abort).
With LoRA, ``lora_requests_info`` is vLLM's info gauge: one series labelled ``max_lora``,
``running_lora_adapters`` and ``waiting_lora_adapters`` (adapter names joined by commas) whose
value is the time of the last step, in seconds since the epoch; the series of the previous label
values is removed when they change (vLLM keeps every combination it has seen).
With ``compat_prefixes=("kvpilot:", "vllm:")`` the same values are also exported under ``vllm:``
so that vLLM dashboards and KEDA rules work unchanged.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpilot.core.stats import IterationStats

logger = logging.getLogger(__name__)

# vLLM's bucket boundaries (seconds), so histograms line up with vLLM's dashboards.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value`` (inclusive)."""
    out, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


class _Family:
    """One metric under every prefix (``kvpilot:`` and optionally ``vllm:``), bound to ``model_name``."""

    def __init__(self, kind, name: str, doc: str, prefixes: Iterable[str], registry: CollectorRegistry,
                 model_name: str, extra_labels: tuple[str, ...] = (), **kwargs) -> None:
        self._extra = extra_labels
        self._model_name = model_name
        self._metrics = [kind(p + name, doc, ("model_name",) + extra_labels, registry=registry, **kwargs)
                         for p in prefixes]
        self._children = [m.labels(model_name) for m in self._metrics] if not extra_labels else None

    def children(self, *extra: str):
        if self._children is not None:
            return self._children
        return [m.labels(self._model_name, *extra) for m in self._metrics]


class PrometheusStatLogger:
    """Turns the engine's `IterationStats` into Prometheus series (a stat-logger callable).

    Args:
        model_name: value of the ``model_name`` label (the served model name).
        max_model_len: context limit in tokens; bounds the token-count histograms' buckets.
        registry: where the series live; a fresh `CollectorRegistry` by default (``/metrics``
            renders it with `prometheus_client.generate_latest`).
        compat_prefixes: metric-name prefixes; ``("kvpilot:", "vllm:")`` for ``--metrics-compat vllm``.
    """

    def __init__(self, model_name: str, max_model_len: int, registry: Optional[CollectorRegistry] = None,
                 compat_prefixes: tuple[str, ...] = ("kvpilot:",)) -> None:
        # vLLM hides the `_created` series too; they double the exposition for no dashboard's benefit.
        prometheus_client.disable_created_metrics()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name

        def fam(kind, name, doc, extra=(), **kw):
            return _Family(kind, name, doc, compat_prefixes, self.registry, model_name, extra, **kw)

        token_buckets = build_1_2_5_buckets(max(1, max_model_len))
        self.running = fam(Gauge, "num_requests_running", "Number of requests in model execution batches.",
                           multiprocess_mode="mostrecent")
        self.waiting = fam(Gauge, "num_requests_waiting", "Number of requests waiting to be processed.",
                           multiprocess_mode="mostrecent")
        self.kv_usage = fam(Gauge, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                            multiprocess_mode="mostrecent")
        self.prompt_tokens = fam(Counter, "prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = fam(Counter, "generation_tokens", "Number of generation tokens processed.")
        self.preemptions = fam(Counter, "num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prefix_queries = fam(Counter, "prefix_cache_queries",
                                  "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = fam(Counter, "prefix_cache_hits",
                               "Prefix cache hits, in terms of number of cached tokens.")
        self.success = fam(Counter, "request_success", "Count of successfully processed requests.",
                           extra=("finished_reason",))
        self.iteration_tokens = fam(Histogram, "iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                    buckets=ITERATION_TOKEN_BUCKETS)
        self.ttft = fam(Histogram, "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                        buckets=TTFT_BUCKETS)
        self.itl = fam(Histogram, "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                       buckets=ITL_BUCKETS)
        self.tpot = fam(Histogram, "request_time_per_output_token_seconds",
                        "Histogram of time_per_output_token_seconds per request.", buckets=ITL_BUCKETS)
        self.e2e = fam(Histogram, "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                       buckets=REQUEST_LATENCY_BUCKETS)
        self.queue_time = fam(Histogram, "request_queue_time_seconds",
                              "Histogram of time spent in WAITING phase for request.", buckets=REQUEST_LATENCY_BUCKETS)
        self.inference_time = fam(Histogram, "request_inference_time_seconds",
                                  "Histogram of time spent in RUNNING phase for request.",
                                  buckets=REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = fam(Histogram, "request_prompt_tokens", "Number of prefill tokens processed.",
                                         buckets=token_buckets)
        self.request_generation_tokens = fam(Histogram, "request_generation_tokens",
                                             "Number of generation tokens processed.", buckets=token_buckets)
        self.params_n = fam(Histogram, "request_params_n", "Histogram of the n request parameter.",
                            buckets=PARAMS_N_BUCKETS)
        self.params_max_tokens = fam(Histogram, "request_params_max_tokens",
                                     "Histogram of the max_tokens request parameter.", buckets=token_buckets)
        # Speculative decoding (vLLM's spec_decode counters; docs/speculative_decoding.md).
        self.spec_drafts = fam(Counter, "spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = fam(Counter, "spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted = fam(Counter, "spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.spec_accepted_pos = fam(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.", extra=("position",))
        self.lora_info = fam(Gauge, "lora_requests_info", "Running stats on lora requests.",
                             extra=("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
                             multiprocess_mode="mostrecent")
        self._lora_labels: Optional[tuple[str, ...]] = None

    def __call__(self, stats: IterationStats) -> None:
        """Record one engine step (called from the engine thread; never raises into the engine)."""
        try:
            self.record(stats)
        except Exception:  # a metrics bug must not stop the engine loop
            logger.exception("failed to record iteration stats")

    def record(self, stats: IterationStats) -> None:
        """Update every series from ``stats`` (gauges set, counters increased, histograms observed)."""
        for c in self.running.children():
            c.set(stats.num_running)
        for c in self.waiting.children():
            c.set(stats.num_waiting)
        for c in self.kv_usage.children():
            c.set(stats.kv_cache.usage)
        for family, value in ((self.prompt_tokens, stats.num_prompt_tokens),
                              (self.generation_tokens, stats.num_generation_tokens),
                              (self.preemptions, stats.num_preemptions),
                              (self.prefix_queries, stats.prefix_cache_queries),
                              (self.prefix_hits, stats.prefix_cache_hits)):
            if value:
                for c in family.children():
                    c.inc(value)
        if stats.max_lora:
            labels = (str(stats.max_lora), ",".join(stats.waiting_lora_adapters),
                      ",".join(stats.running_lora_adapters))
            if self._lora_labels is not None and self._lora_labels != labels:
                for m in self.lora_info._metrics:
                    m.remove(self.model_name, *self._lora_labels)
            self._lora_labels = labels
            for c in self.lora_info.children(*labels):
                c.set(stats.timestamp)
        step_tokens = stats.num_prompt_tokens + stats.num_generation_tokens
        if step_tokens:
            _observe(self.iteration_tokens, [step_tokens])
        _observe(self.ttft, stats.ttft)
        _observe(self.itl, stats.inter_token_latencies)
        spec = stats.spec_decode
        if spec is not None:
            for family, value in ((self.spec_drafts, spec.num_drafts), (self.spec_draft_tokens, spec.num_draft_tokens),
                                  (self.spec_accepted, spec.num_accepted_tokens)):
                for c in family.children():
                    c.inc(value)
            for pos, value in enumerate(spec.accepted_per_pos):
                for c in self.spec_accepted_pos.children(str(pos)):
                    c.inc(value)
        for req in stats.finished:
            for c in self.success.children(req.finish_reason):
                c.inc()
            _observe(self.e2e, [req.e2e_latency])
            if req.queue_time is not None:
                _observe(self.queue_time, [req.queue_time])
            if req.first_scheduled_time is not None:
                _observe(self.inference_time, [req.finished_time - req.first_scheduled_time])
            if req.first_token_time is not None and req.num_generation_tokens > 1:
                per_token = (req.finished_time - req.first_token_time) / (req.num_generation_tokens - 1)
                _observe(self.tpot, [per_token])
            _observe(self.request_prompt_tokens, [req.num_prompt_tokens])
            _observe(self.request_generation_tokens, [req.num_generation_tokens])
            _observe(self.params_n, [req.n])
            _observe(self.params_max_tokens, [req.max_tokens])


def _observe(family: _Family, values: Iterable[float]) -> None:
    children = family.children()
    for v in values:
        for c in children:
            c.observe(v)
