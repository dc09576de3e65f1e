"""In-process link emulation: a token bucket pacing this process's egress at a rate, plus a one-way latency.

Why in the transport at all: the results we compare against were measured over slow links, and the machines we
run on may lack the ``netem`` qdisc, so this is how latency is injected. Each process builds one throttle from
``AGORA_LINK`` ("80mbit,50ms", "50ms" or "80mbit"); ``agora.net.transport`` awaits ``throttle.send(nbytes,
latency=first)`` before each message it writes. Unset, it costs nothing. Only our RPCs are paced: hivemind's
averager and DHT traffic are not (``agora.lab.netem`` caps those with kernel namespaces).
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from typing import Callable, Optional, Tuple


_SPEC = re.compile(r"^\s*(?:(?P<rate>[\d.]+)\s*(?P<unit>[kmg]?)bit)?\s*,?\s*(?:(?P<lat>[\d.]+)\s*ms)?\s*$", re.I)


def parse_link_spec(spec: str) -> Tuple[Optional[float], float]:
    """``"80mbit,50ms"`` -> ``(80.0, 50.0)``; ``"50ms"`` -> ``(None, 50.0)``; ``"1gbit"`` -> ``(1000.0, 0.0)``."""
    match = _SPEC.match(spec or "")
    if not match or not (match["rate"] or match["lat"]):
        raise ValueError(f"link spec must look like '80mbit,50ms', '500kbit' or '20ms', got {spec!r}")
    mbps = None
    if match["rate"]:
        mbps = float(match["rate"]) * {"k": 1e-3, "m": 1.0, "g": 1e3, "": 1e-6}[match["unit"].lower()]
    return mbps, float(match["lat"] or 0.0)


class LinkThrottle:
    """Token bucket pacing one link at ``mbps`` (10^6 bit/s) with a fixed one-way ``latency_ms``.

    Virtual-time implementation (GCRA): ``_tat`` is when the link finishes what was already reserved. A send of
    ``n`` bytes reserves ``n*8/rate`` seconds after that (or after now, minus the burst credit, if the link is
    idle) and sleeps until its bytes are through, plus the latency if asked. Reservation is atomic (a lock), so
    concurrent senders -- tasks of one event loop or threads -- share the rate fairly in FIFO order.

    With ``burst_bytes = 0`` (default) a transfer of B bytes takes at least ``B*8/X`` seconds (+ latency);
    with a burst ``b``, an idle link lets the first ``b`` bytes through immediately: at least ``(B-b)*8/X``.

    :param mbps: rate cap in Mbit/s; None = unlimited (latency only)
    """

    def __init__(self, mbps: Optional[float], latency_ms: float = 0.0, burst_bytes: int = 0,
                 clock: Callable[[], float] = time.monotonic):
        if mbps is not None and mbps <= 0:
            raise ValueError(f"mbps must be positive or None, got {mbps}")
        if latency_ms < 0 or burst_bytes < 0:
            raise ValueError("latency_ms and burst_bytes must be non-negative")
        self.mbps, self.latency_s, self.burst_bytes = mbps, latency_ms / 1e3, burst_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._tat = float("-inf")
        self.bytes_sent = 0
        self.seconds_waited = 0.0

    @classmethod
    def from_spec(cls, spec: str, **kwargs) -> "LinkThrottle":
        mbps, latency_ms = parse_link_spec(spec)
        return cls(mbps, latency_ms, **kwargs)

    @classmethod
    def from_env(cls, var: str = "AGORA_LINK") -> Optional["LinkThrottle"]:
        """A throttle from the env var ``var`` (e.g. ``AGORA_LINK=80mbit,50ms``), or None if unset/empty."""
        spec = os.environ.get(var, "").strip()
        return cls.from_spec(spec) if spec else None

    def seconds_for(self, nbytes: int) -> float:
        return 0.0 if self.mbps is None else nbytes * 8 / (self.mbps * 1e6)

    def reserve(self, nbytes: int) -> float:
        """Book ``nbytes`` on the link; returns the seconds until they have left (excluding latency)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be non-negative, got {nbytes}")
        with self._lock:
            now = self._clock()
            self.bytes_sent += nbytes
            if self.mbps is None:
                return 0.0
            start = max(self._tat, now - self.seconds_for(self.burst_bytes))
            self._tat = start + self.seconds_for(nbytes)
            return max(0.0, self._tat - now)

    async def send(self, nbytes: int, *, latency: bool = True) -> None:
        """Wait until ``nbytes`` would have crossed the link; add the one-way latency if ``latency``.

        Call before writing each chunk, with ``latency=True`` for the first chunk of a message only.
        """
        wait = self.reserve(nbytes) + (self.latency_s if latency else 0.0)
        self.seconds_waited += wait
        if wait > 0:
            await asyncio.sleep(wait)

    def send_blocking(self, nbytes: int, *, latency: bool = True) -> None:
        """:meth:`send` for threads (e.g. a compute thread pushing a checkpoint)."""
        wait = self.reserve(nbytes) + (self.latency_s if latency else 0.0)
        self.seconds_waited += wait
        if wait > 0:
            time.sleep(wait)
