"""The operator's own settings: one object, filled from ``kvpilot operator`` flags (or by tests).

Retries of a failed reconcile wait ``retry_delay(attempt)`` seconds: exponential backoff with
jitter, ``min(retry_max_s, retry_base_s * 2**attempt)`` scaled by a random factor in
``[1 - retry_jitter, 1]`` (the "equal jitter" family of AWS's "Exponential Backoff And Jitter"),
so that many CRs failing together do not retry in lockstep. With the defaults (1 s, 60 s, 0.5)
the waits are about 0.5-1, 1-2, 2-4, ... s, capped at 30-60 s.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorConfig:
    """Settings of one operator process.

    Attributes:
        retry_base_s: first retry delay in seconds (> 0).
        retry_max_s: cap of the retry delay in seconds (>= retry_base_s).
        retry_jitter: fraction of the delay that is random, 0..1.
        peering_lifetime_s: how long this replica's peering record counts as alive; a standby
            takes over at most this long after the active replica died (kopf's default is 60).
    """

    retry_base_s: float = 1.0
    retry_max_s: float = 60.0
    retry_jitter: float = 0.5
    peering_lifetime_s: int = 15

    def __post_init__(self) -> None:
        if not self.retry_base_s > 0:
            raise ValueError(f"retry_base_s must be > 0, got {self.retry_base_s}")
        if self.retry_max_s < self.retry_base_s:
            raise ValueError(f"retry_max_s ({self.retry_max_s}) must be >= retry_base_s ({self.retry_base_s})")
        if self.peering_lifetime_s < 2:
            raise ValueError(f"peering_lifetime_s must be >= 2, got {self.peering_lifetime_s}")
        if not 0 <= self.retry_jitter <= 1:
            raise ValueError(f"retry_jitter must be in 0..1, got {self.retry_jitter}")

    def retry_delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``attempt`` (0 for the first retry)."""
        ceiling = min(self.retry_max_s, self.retry_base_s * 2 ** min(max(attempt, 0), 62))
        r = (rng or random).random()
        return ceiling * (1.0 - self.retry_jitter * r)
