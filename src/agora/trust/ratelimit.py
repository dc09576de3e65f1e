"""Per-caller token buckets for data-plane RPC rate limiting.

Why: a forward-backward call costs the callee real compute, and today anyone can send as many as they like.
A token bucket per caller bounds the sustained rate (``rate`` per second) while allowing bursts (``burst``), so an
honest upstream with a pipeline of microbatches is never slowed but a flooding peer is refused cheaply, before any
tensor is decoded into work. Costs may be weighted, e.g. by tokens in the microbatch.

Pure and deterministic: the clock is injected (``clock=time.monotonic`` by default; tests pass a fake), nothing is
shared between limiters, and idle callers are evicted (a full bucket carries no information, so forgetting a caller
that has been idle long enough to refill is exact).

Used by ``agora.server.handler.StageHandler.admit`` before a request is validated: a caller over its rate gets
``rate_limited`` (in ``net.protocol.RETRYABLE``: the router tries another replica).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class TokenBucket:
    """``tokens`` refill at ``rate`` per second up to ``burst``; a call costing c passes iff c tokens are there."""

    rate: float
    burst: float
    tokens: float
    updated: float

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
            self.updated = now

    def take(self, cost: float, now: float) -> bool:
        self.refill(now)
        if cost <= self.tokens:
            self.tokens -= cost
            return True
        return False

    def wait_time(self, cost: float, now: float) -> float:
        """Seconds until ``cost`` tokens are available (inf if ``cost`` exceeds the burst: it never will be)."""
        self.refill(now)
        if cost > self.burst:
            return float("inf")
        if cost <= self.tokens:
            return 0.0
        return (cost - self.tokens) / self.rate if self.rate > 0 else float("inf")


class RateLimiter:
    """One ``TokenBucket`` per caller id, created full on first sight, evicted LRU beyond ``max_callers``."""

    def __init__(self, rate: float, burst: float, max_callers: int = 10_000,
                 clock: Callable[[], float] = time.monotonic):
        if rate < 0 or burst <= 0:
            raise ValueError(f"rate must be >= 0 and burst > 0 (got rate={rate}, burst={burst})")
        self.rate, self.burst, self.max_callers, self.clock = float(rate), float(burst), max_callers, clock
        self._buckets: "OrderedDict[str, TokenBucket]" = OrderedDict()
        self.refused: dict[str, int] = {}

    def _bucket(self, caller: str, now: float) -> TokenBucket:
        bucket = self._buckets.get(caller)
        if bucket is None:
            bucket = TokenBucket(self.rate, self.burst, self.burst, now)
            self._buckets[caller] = bucket
            while len(self._buckets) > self.max_callers:
                self._buckets.popitem(last=False)  # least recently used; re-created full if it returns
        else:
            self._buckets.move_to_end(caller)
        return bucket

    def allow(self, caller: str, cost: float = 1.0, now: Optional[float] = None) -> bool:
        """Take ``cost`` tokens from ``caller``'s bucket; False (and nothing taken) if there are not enough."""
        now = self.clock() if now is None else now
        ok = self._bucket(caller, now).take(cost, now)
        if not ok:
            self.refused[caller] = self.refused.get(caller, 0) + 1
        return ok

    def retry_after(self, caller: str, cost: float = 1.0, now: Optional[float] = None) -> float:
        now = self.clock() if now is None else now
        return self._bucket(caller, now).wait_time(cost, now)

    def __len__(self) -> int:
        return len(self._buckets)
