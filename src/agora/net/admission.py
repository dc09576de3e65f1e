"""What a peer may make a server hold: streams per peer and in all, bytes buffered, a minimum sending rate.

``IncomingLimits`` are the numbers; ``IncomingGate`` is one server's live account of them, shared by all its
handlers (``transport.add_handler(..., gate=...)``). A stream takes a slot (``open_stream``) before its header is
read, and reserves bytes (``Reservation.grow``) before each frame is read, so nothing is buffered beyond the budget:
a stream that finds the budget full waits a little (back-pressure: the sender's writes stall), then gets ``busy``.
Why each limit exists, and the attacks they answer, is in ``docs/TRANSPORT.md`` ("Limits on hostile peers").
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from agora.net.errors import BUSY, PAYLOAD_TOO_LARGE, RpcError

__all__ = ["IncomingLimits", "IncomingGate", "Reservation", "StreamSlot"]

MIB = 2**20
MIN_BUDGET_BYTES = 4 * MIB  # room for a few headers and small requests even when a stage's requests are tiny
# The slowest a request may arrive (after the grace period) before the server drops it; senders of large payloads
# size their deadlines from it.
MIN_RATE_BYTES_PER_S = 64 * 1024


@dataclass(frozen=True)
class IncomingLimits:
    """Limits on incoming requests of one server (one node), whatever handler they are for.

    :param budget_bytes: bytes of incoming request frames all streams together may have buffered (read, not yet
      handed to the handler as tensors)
    :param streams_per_peer: concurrent streams one peer identity may hold open (reading or waiting for a reply)
    :param streams_total: concurrent streams of all peers together
    :param budget_wait_s: how long a stream waits for room in the budget before it is answered ``busy``
    :param min_rate_bytes_per_s: after ``grace_s``, a stream must have delivered at least this many bytes per
      second since it opened (time spent waiting for the budget excluded), or it is answered ``too_slow``
    :param drain_bytes: after a refused or malformed request, at most this many more bytes are read (so that the
      error reply is not lost to a reset) before replying and closing
    :param drain_s: ... and for at most this long
    """

    budget_bytes: int = 64 * MIB
    streams_per_peer: int = 32
    streams_total: int = 256
    budget_wait_s: float = 10.0
    min_rate_bytes_per_s: int = MIN_RATE_BYTES_PER_S
    grace_s: float = 5.0
    drain_bytes: int = 1 * MIB
    drain_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("budget_bytes", "streams_per_peer", "streams_total", "min_rate_bytes_per_s"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"IncomingLimits.{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("budget_wait_s", "grace_s", "drain_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"IncomingLimits.{name} must be positive, got {getattr(self, name)!r}")
        if self.drain_bytes < 0:
            raise ValueError(f"IncomingLimits.drain_bytes must be >= 0, got {self.drain_bytes!r}")

    @classmethod
    def for_requests(cls, largest_request_bytes: int, available_bytes: Optional[int] = None,
                     budget_bytes: Optional[int] = None) -> "IncomingLimits":
        """Limits for a server whose largest legitimate request is ``largest_request_bytes``: a budget of two such
        requests (at least ``MIN_BUDGET_BYTES``), or ``budget_bytes`` if given. A budget above a quarter of
        ``available_bytes`` (the host's free memory) is refused: it would let outsiders push the host into swap."""
        budget = budget_bytes if budget_bytes is not None else max(2 * int(largest_request_bytes), MIN_BUDGET_BYTES)
        if available_bytes is not None and budget > available_bytes // 4:
            raise ValueError(
                f"an incoming-request budget of {budget / MIB:.0f} MiB (two of this run's largest requests or UPM rotations) is more "
                f"than a quarter of the {available_bytes / MIB:.0f} MiB this host has free; free memory or set a "
                f"smaller budget (agora node --incoming-budget-mib)")
        return cls(budget_bytes=int(budget))


class Reservation:
    """Bytes of the budget one stream holds; ``release`` (idempotent) gives them back."""

    def __init__(self, gate: "IncomingGate"):
        self._gate = gate
        self.nbytes = 0

    async def grow(self, nbytes: int) -> float:
        """Hold ``nbytes`` more, waiting for room up to ``budget_wait_s``; returns the seconds waited.

        :raises RpcError: ``payload_too_large`` if the stream would need more than the whole budget, ``busy`` if no
          room came in time
        """
        return await self._gate._grow(self, int(nbytes))

    def release(self) -> None:
        self._gate._release(self)


class StreamSlot:
    """One open stream of one peer; a context manager that frees the slot and the stream's reservation."""

    def __init__(self, gate: "IncomingGate", peer: str):
        self._gate, self.peer = gate, peer
        self.reservation = Reservation(gate)
        self.opened = time.monotonic()

    def __enter__(self) -> "StreamSlot":
        return self

    def __exit__(self, *exc) -> None:
        self.reservation.release()
        self._gate._close(self)


class IncomingGate:
    """One server's live account of ``IncomingLimits``; all of its handlers share it. Not thread-safe: it lives
    on the server's event loop."""

    def __init__(self, limits: Optional[IncomingLimits] = None):
        self.limits = limits or IncomingLimits()
        self.buffered_bytes = 0
        self.peak_buffered_bytes = 0
        self.streams: Counter[str] = Counter()  # open streams per peer
        self.refused: Counter[str] = Counter()  # why streams were refused or cut: busy_streams, busy_budget, ...
        self._waiters: list[asyncio.Future] = []  # streams waiting for room in the budget

    @property
    def open_streams(self) -> int:
        return sum(self.streams.values())

    def count(self, reason: str) -> None:
        self.refused[reason] += 1

    def open_stream(self, peer: str) -> StreamSlot:
        """A slot for a new stream of ``peer``; ``busy`` if that peer or all peers together hold too many."""
        limits = self.limits
        if self.streams[peer] >= limits.streams_per_peer:
            self.count("busy_streams_per_peer")
            raise RpcError(BUSY, f"you have {self.streams[peer]} streams open here, the limit is "
                                 f"{limits.streams_per_peer}; retry in ~1 s")
        if self.open_streams >= limits.streams_total:
            self.count("busy_streams_total")
            raise RpcError(BUSY, f"this server has {self.open_streams} streams open, its limit; retry in ~1 s")
        self.streams[peer] += 1
        return StreamSlot(self, peer)

    def _close(self, slot: StreamSlot) -> None:
        self.streams[slot.peer] -= 1
        if self.streams[slot.peer] <= 0:
            del self.streams[slot.peer]

    async def _grow(self, reservation: Reservation, nbytes: int) -> float:
        budget = self.limits.budget_bytes
        if reservation.nbytes + nbytes > budget:
            self.count("too_large_for_budget")
            raise RpcError(PAYLOAD_TOO_LARGE, f"this request needs {reservation.nbytes + nbytes} bytes buffered, "
                                              f"more than this server's whole budget of {budget} bytes")
        start = time.monotonic()
        deadline = start + self.limits.budget_wait_s
        while self.buffered_bytes + nbytes > budget:
            left = deadline - time.monotonic()
            if left <= 0:
                self.count("busy_budget")
                raise RpcError(BUSY, f"this server's {budget} bytes for incoming requests stayed full for "
                                     f"{self.limits.budget_wait_s:g} s; retry in ~{self.limits.budget_wait_s:g} s")
            room = asyncio.get_running_loop().create_future()
            self._waiters.append(room)
            try:
                await asyncio.wait_for(room, left)
            except asyncio.TimeoutError:
                pass
            finally:
                if room in self._waiters:
                    self._waiters.remove(room)
        self.buffered_bytes += nbytes
        reservation.nbytes += nbytes
        self.peak_buffered_bytes = max(self.peak_buffered_bytes, self.buffered_bytes)
        return time.monotonic() - start

    def _release(self, reservation: Reservation) -> None:
        if reservation.nbytes == 0:
            return
        self.buffered_bytes -= reservation.nbytes
        reservation.nbytes = 0
        waiters, self._waiters = self._waiters, []
        for room in waiters:  # every waiter re-checks: the first ones that fit take the room
            if not room.done():
                room.set_result(None)

    def snapshot(self) -> dict:
        """For ``/metrics`` and status: the budget, what is buffered now and at most, streams, refusals."""
        return {"budget_bytes": self.limits.budget_bytes, "buffered_bytes": self.buffered_bytes,
                "peak_buffered_bytes": self.peak_buffered_bytes, "open_streams": self.open_streams,
                "refused": dict(self.refused)}
