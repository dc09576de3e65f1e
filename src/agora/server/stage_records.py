"""One node's reads of stage records from the DHT, shared by the parts of the node that need them.

A DHT read costs CPU in every DHT peer it touches, not only in the reader. The replica sync reads its own stage a few
times a second and the next hop reads the next stage every second; the UPM protocol needs the same records (any age
up to 5 s) and, before this cache, read them again itself: with a transform every 5 s on a 2-core `small` swarm the
DHT processes used 13.5% more CPU than without UPM, 7.4% with the cache (docs/UPM.md, "Whose records"). Here a part
states how old the records it may use are; a read that is already under way is shared instead of repeated.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Awaitable, Callable

from agora.net.records import StageRecord


class StageRecords:
    """The latest records read of each stage and when they were read (event loop only).

    :param read: reads one stage's live records from the DHT (the node's ``read_stage`` on its I/O threads)
    """

    def __init__(self, read: Callable[[int], Awaitable[list[StageRecord]]]):
        self._read = read
        self._latest: dict[int, tuple[float, list[StageRecord]]] = {}  # stage -> (monotonic time read, records)
        self._reading: dict[int, asyncio.Future] = {}  # stage -> the read under way
        self.requests = 0  # calls of ``get``
        self.reads = 0  # DHT reads those made
        self.joined = 0  # calls that waited for a read another call had started

    async def get(self, stage: int, max_age_s: float = 0.0) -> list[StageRecord]:
        """``stage``'s records read at most ``max_age_s`` seconds ago; 0: read now, or join the read of that stage
        already under way (it started before this call by less than one read's duration). A failed read raises to
        every caller that waited for it and leaves the older records in place for callers that accept them."""
        self.requests += 1
        at, records = self._latest.get(stage, (-math.inf, []))
        if max_age_s > 0 and time.monotonic() - at <= max_age_s:
            return list(records)
        pending = self._reading.get(stage)
        if pending is not None:
            self.joined += 1
        else:
            pending = asyncio.ensure_future(self._read_now(stage))
            self._reading[stage] = pending
            pending.add_done_callback(lambda done, s=stage: self._done(s, done))
        # shielded: a caller that is cancelled must not cancel the read other callers wait for
        return list(await asyncio.shield(pending))

    def age_s(self, stage: int) -> float:
        """Seconds since ``stage`` was last read (inf: never)."""
        at, _ = self._latest.get(stage, (-math.inf, []))
        return time.monotonic() - at

    def forget(self) -> None:
        """Drop every record held: the next ``get`` of any stage reads the DHT."""
        self._latest.clear()

    def _done(self, stage: int, read: asyncio.Future) -> None:
        self._reading.pop(stage, None)
        if not read.cancelled():
            read.exception()  # retrieved here too: a read whose only caller was cancelled fails quietly

    async def _read_now(self, stage: int) -> list[StageRecord]:
        started = time.monotonic()  # records are as old as the moment their read started
        self.reads += 1
        records = await self._read(stage)
        self._latest[stage] = (started, records)
        return records
