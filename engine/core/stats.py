"""Per-step statistics the engine reports to stat loggers (Prometheus) and to `LLM.get_stats`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class FinishedRequestStats:
    """One finished (or aborted) request. Times are `time.monotonic()` seconds."""

    request_id: int
    finish_reason: str  # "stop", "length" or "abort"
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens: int
    n: int
    arrival_time: float
    first_scheduled_time: Optional[float]
    first_token_time: Optional[float]
    finished_time: float

    @property
    def e2e_latency(self) -> float:
        return self.finished_time - self.arrival_time

    @property
    def queue_time(self) -> Optional[float]:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class KvCacheStats:
    """TensorRT-LLM's `KvCacheStats` fields. Blocks are counts; the hit rate is cumulative, 0..1."""

    max_num_blocks: int
    free_num_blocks: int
    used_num_blocks: int
    tokens_per_block: int
    alloc_total_blocks: int = 0
    alloc_new_blocks: int = 0
    reused_blocks: int = 0
    missed_blocks: int = 0
    cache_hit_rate: float = 0.0

    @property
    def usage(self) -> float:
        """Used blocks / total blocks (0..1): what the autoscaler reads as KV-cache utilisation."""
        return self.used_num_blocks / self.max_num_blocks if self.max_num_blocks else 0.0


@dataclass
class SpecDecodeStats:
    """Speculation in one engine step: sequences that verified drafts (``num_drafts``), drafted
    tokens verified, drafted tokens accepted, and accepted tokens per draft position (index 0 =
    the first draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verifying sequence and step (accepted drafts + 1)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def to_dict(self) -> dict[str, Any]:
        """TensorRT-LLM's ``specDecodingStats`` names (plus the per-position counts)."""
        return {"numRequestsWithDraftTokens": self.num_drafts, "numDraftTokens": self.num_draft_tokens,
                "numAcceptedTokens": self.num_accepted_tokens, "acceptanceLength": self.mean_accepted_length,
                "acceptedPerPosition": list(self.accepted_per_pos)}


@dataclass
class IterationStats:
    """What one engine step did, reported after the step.

    Counters (``num_*_tokens``, ``num_preemptions``, ``prefix_cache_*``) are for this step only;
    gauges (``num_running``, ``num_waiting``, ``kv_cache``) are the state after it.
    ``ttft`` and ``inter_token_latencies`` hold seconds observed in this step, for histograms.
    LoRA (``max_lora`` > 0: the engine's ``LoraConfig.max_loras``): the names of the adapters of
    the running and of the waiting sequences after the step, sorted.
    """

    iter: int
    timestamp: float  # wall clock, seconds since the epoch
    iter_latency_s: float
    num_running: int
    num_waiting: int
    kv_cache: KvCacheStats
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_scheduled_tokens: int = 0
    num_context_requests: int = 0
    num_generation_requests: int = 0
    gpu_mem_usage: int = 0
    ttft: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    spec_decode: Optional[SpecDecodeStats] = None  # speculative decoding in this step, if any
    max_lora: int = 0
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """TensorRT-LLM's iteration-stats JSON field names (`get_stats()` entries)."""
        kv = self.kv_cache
        return {
            "iter": self.iter,
            "timestamp": self.timestamp,
            "iterLatencyMS": self.iter_latency_s * 1e3,
            "gpuMemUsage": self.gpu_mem_usage,
            "cpuMemUsage": 0,
            "pinnedMemUsage": 0,
            "numActiveRequests": self.num_running,
            "numQueuedRequests": self.num_waiting,
            "numCompletedRequests": len(self.finished),
            "kvCacheStats": {
                "maxNumBlocks": kv.max_num_blocks,
                "freeNumBlocks": kv.free_num_blocks,
                "usedNumBlocks": kv.used_num_blocks,
                "tokensPerBlock": kv.tokens_per_block,
                "allocTotalBlocks": kv.alloc_total_blocks,
                "allocNewBlocks": kv.alloc_new_blocks,
                "reusedBlocks": kv.reused_blocks,
                "missedBlocks": kv.missed_blocks,
                "cacheHitRate": kv.cache_hit_rate,
            },
            "inflightBatchingStats": {
                "numScheduledRequests": self.num_context_requests + self.num_generation_requests,
                "numContextRequests": self.num_context_requests,
                "numGenRequests": self.num_generation_requests,
                "numCtxTokens": self.num_prompt_tokens,
                "numPausedRequests": 0,
                "microBatchId": 0,
            },
            **({"specDecodingStats": self.spec_decode.to_dict()} if self.spec_decode is not None else {}),
        }
