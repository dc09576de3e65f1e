"""Noticing that this process was frozen (SIGSTOP, a closed laptop lid, a swap storm) and dropping what it held.

While a process is stopped its callers time out or hedge its requests to other replicas (client/router.py), and its
stage's rounds go on without it. When it wakes up, the requests it had in flight, and those that queued up in its
sockets meanwhile, have been answered elsewhere: completing them would accumulate those samples a second time. The
monotonic clock keeps running while a process is stopped, so a gap between two ticks of the event loop measures
the freeze; no help from outside is needed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

logger = logging.getLogger("agora.node")


class FreezeWatch:
    """Counts freezes of this process (gaps of more than ``threshold_s`` between ticks of the event loop).

    ``epoch`` grows at every freeze: a request that saw another epoch when it started is dropped before it commits
    (accumulates its gradient). For ``grace_s`` after a freeze new training requests are refused as well: they were
    sent while this process was stopped and their callers have moved on. ``check`` ticks too, so a request that
    runs before the ticker's first wake-up after a freeze still sees it.
    """

    def __init__(self, threshold_s: float = 5.0, grace_s: float = 2.0, period_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic):
        if threshold_s <= period_s:
            raise ValueError(f"a freeze threshold of {threshold_s}s must exceed the tick period {period_s}s")
        self.threshold_s, self.grace_s, self.period_s, self.clock = threshold_s, grace_s, period_s, clock
        self.epoch = 0
        self.last_tick = clock()
        self.refuse_until = float("-inf")
        self.frozen_s = 0.0  # all freezes, in all
        self.last_freeze_s = 0.0

    def tick(self) -> Optional[float]:
        """The length of the freeze that just ended, or None."""
        now = self.clock()
        gap, self.last_tick = now - self.last_tick, now
        if gap <= self.threshold_s:
            return None
        self.epoch += 1
        self.frozen_s += gap
        self.last_freeze_s = gap
        self.refuse_until = now + self.grace_s
        logger.warning(f"this process was frozen for {gap:.1f}s (stopped, suspended or starved); dropping the "
                       f"training work it held and refusing new training work for {self.grace_s:g}s")
        return gap

    def refusing(self) -> bool:
        """Whether training work arriving now is refused (a freeze just ended)."""
        self.tick()
        return self.clock() < self.refuse_until

    def stale(self, epoch: int) -> bool:
        """Whether a request that started at ``epoch`` lived through a freeze."""
        self.tick()
        return self.epoch != epoch

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            self.tick()
