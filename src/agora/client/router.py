"""Sending one request to some peer of a stage: pick -> call -> classify -> ban -> retry, written once.

Both callers of the pipeline use it: a trainer sending token ids to a head (``client/trainer.py``) and a stage
sending its boundary to the next stage (``server/downstream.py``). Failures are routed around, not punished
blindly: a peer that fails itself (``protocol.BANNABLE``) is banned for a while; one that is leaving, busy or
reports trouble further down is only skipped for this request. Bans are preferences: when every peer is banned the
request still goes to one of them rather than failing. Retries are bounded; a wait for an empty stage is bounded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional, Protocol, Sequence

import torch

from agora.net import transport
from agora.net.errors import CONNECTION_LOST
from agora.net.protocol import BANNABLE, FWD_BWD, OVER_SHARE, RETRYABLE, held_seconds
from agora.net.records import StageRecord
from agora.net.routing import BanList, pick_peer, pick_peer_or_fallback
from agora.net.transport import RpcError, TransferStats

logger = logging.getLogger("agora.router")

Reply = tuple[dict, list[torch.Tensor]]


class PeerSource(Protocol):
    """Where a router finds the peers of its stage."""

    def candidates(self) -> Sequence[StageRecord]:
        """The current records of the stage's peers that may be called (banned ones left out)."""

    async def refresh(self) -> None:
        """Re-read the records (called while the stage has no usable peer)."""


@dataclass
class RouterOptions:
    max_retries: int = 3
    timeout_s: float = 30.0  # one call, the downstream chain included
    wait_for_peers_s: float = 60.0  # how long a request waits for an empty stage before giving up
    backoff_s: float = 0.5  # pause before calling again a peer this request already tried
    backoff_per_attempt: bool = False  # the pause grows with the attempt number (else with that peer's failed tries)
    use_inflight: bool = True  # prefer peers with fewer of our own calls in flight (the trainer's many microbatches)
    ban_s: float = 15.0
    # Before calling again a peer this request already tried (every other one failed or is banned), wait up to this
    # long for a fresh one: a killed peer's record outlives it by up to its TTL, so retries spent at once on the
    # dead peer and on a replica that refused for a moment abandon work that a short wait would have placed.
    fallback_wait_s: float = 0.0
    # Hedging: a call outstanding longer than ``hedge_factor`` x the peer's typical latency (never sooner than
    # ``hedge_min_s``) is sent to another replica as well; the first answer wins and the other call is cancelled
    # (its peer drops the microbatch before applying it: server/exactly_once.py ``wanted``). 0: never hedge.
    hedge_factor: float = 0.0
    hedge_min_s: float = 3.0
    retryable: frozenset = field(default=RETRYABLE)  # codes worth another replica; others are raised at once
    warn_when_empty: bool = True  # log once per request while the stage has no peer


class Router:
    """Calls ``FWD_BWD`` (or another RPC) on the peers of one stage, with bounded retries on other replicas.

    :param p2p: hivemind's P2P of this process
    :param namespace: the run id (RPC namespace)
    :param stage: the stage called (for messages only)
    :param stats: byte counters of every call made through this router
    :param errors: per error code, how many calls failed with it (incremented)
    """

    def __init__(self, p2p, namespace: str, stage: int, source: PeerSource, options: RouterOptions,
                 stats: Optional[TransferStats] = None, errors: Optional[dict[str, int]] = None,
                 acks: Optional[dict[str, int]] = None):
        self.p2p, self.namespace, self.stage, self.source, self.opts = p2p, namespace, stage, source, options
        self.stats = stats if stats is not None else TransferStats()
        self.errors = errors if errors is not None else {}
        self.bans = BanList(options.ban_s)
        self.inflight: dict[str, int] = {}
        self.latency: dict[str, float] = {}  # per peer: moving average of its successful calls' durations (s)
        self.typical_latency: Optional[float] = None  # the same over every peer of the stage
        self.hedges = 0  # calls also sent to another replica because the first one was slow
        self.hedges_won = 0  # of those, how many the other replica answered first
        # Receiver-side acknowledgements: how many results each peer delivered to us. Published in the DHT under our
        # own id, so a peer's acknowledged work is vouched for by others, never by itself.
        self.acks: dict[str, int] = acks if acks is not None else {}

    def _inflight_view(self) -> Optional[dict[str, int]]:
        """Our calls in flight per peer, for routing to prefer the less loaded (None when that is off)."""
        return self.inflight if self.opts.use_inflight else None

    async def pick(self, tried: list[str], job_tokens: int = 1,
                   stopped: Callable[[], bool] = lambda: False) -> Optional[StageRecord]:
        """A peer for the next attempt: untried and unbanned if possible, else the best of the rest; waits up to
        ``wait_for_peers_s`` while the stage has no peer. None when stopped or nobody appeared in time."""
        deadline = time.monotonic() + self.opts.wait_for_peers_s
        warned = False
        while True:
            peer = pick_peer_or_fallback(self.source.candidates(), job_tokens, tried=tried, bans=self.bans,
                                         inflight=self._inflight_view())
            if peer is not None:
                return peer
            if time.monotonic() > deadline or stopped():
                return None
            if self.opts.warn_when_empty and not warned:
                logger.warning(f"stage {self.stage} has no peers; waiting")
                warned = True
            await asyncio.sleep(0.5)
            await self.source.refresh()

    async def call(self, meta: dict, tensors: list[torch.Tensor], *, job_tokens: int = 1,
                   stopped: Callable[[], bool] = lambda: False,
                   accept: Optional[Callable[[StageRecord, Reply], Awaitable[bool]]] = None,
                   on_retry: Optional[Callable[[], None]] = None, on_failure: Optional[Callable[[], None]] = None,
                   rpc: str = FWD_BWD) -> tuple[StageRecord, Reply]:
        """Call ``rpc`` on a peer of the stage; on a retryable failure, or a reply ``accept`` refuses, try another.

        Raises the peer's ``RpcError`` when its code is not retryable, ``no_peers`` when the stage stayed empty
        (or ``stopped``), ``retries_exhausted`` after ``max_retries`` retries. ``on_retry`` runs before each retry,
        ``on_failure`` after each retryable failure or refused reply (the last one included).
        """
        tried: list[str] = []
        redirects: list[str] = []  # the entries of ``tried`` that only sent us on (``over_share``), not failures
        last_error: Optional[Exception] = None
        same: Optional[StageRecord] = None  # the peer to call again at once (its stream broke; see below)
        redirected = False  # a replica sent us to another one (``over_share``): not a failure, once per request
        attempt = 0  # calls made so far; the callee sees it (``meta["attempt"]``)
        failures = 0
        while failures <= self.opts.max_retries:
            if attempt and on_retry is not None and not redirected:
                on_retry()
            peer = same or await self.pick(tried, job_tokens, stopped)
            if peer is not None and peer is not same and peer.peer_id in tried and not redirected:
                peer = await self._wait_for_fresh(peer, tried, job_tokens, stopped)
            if peer is None:
                raise RpcError("no_peers", f"stage {self.stage} has no reachable peers (tried {len(tried)})")
            if peer.peer_id in tried and peer is not same and not redirected:
                factor = attempt if self.opts.backoff_per_attempt else tried.count(peer.peer_id)
                await asyncio.sleep(self.opts.backoff_s * factor)
            same, redirected = None, False
            try:
                peer, reply = await self._call_hedged(peer, dict(meta, attempt=attempt), tensors, rpc, tried,
                                                      job_tokens, redirects)
            except RpcError as err:
                attempt += 1
                last_error = err
                if err.code == OVER_SHARE and attempt == 1:
                    # That replica holds its share of the stage's batch: another one takes this microbatch (any
                    # replica takes a later attempt, so this happens once per request).
                    tried.append(peer.peer_id)
                    redirects.append(peer.peer_id)
                    redirected = True
                    continue
                self._failed(peer.peer_id, err, tried, failures)
                if err.code == CONNECTION_LOST and tried.count(peer.peer_id) == 1:
                    # The stream broke, maybe after the peer ran the request: once, the same peer again. A labelled
                    # training microbatch is then answered from its run (server/exactly_once.py) instead of being
                    # accumulated a second time by another replica.
                    same = next((r for r in self.source.candidates() if r.peer_id == peer.peer_id), None)
            else:
                if accept is None or await accept(peer, reply):
                    self.acks[peer.peer_id] = self.acks.get(peer.peer_id, 0) + 1
                    return peer, reply
                attempt += 1
                tried.append(peer.peer_id)
                last_error = RpcError("sentinel", f"reply of {peer.peer_id[-8:]} refused")
            failures += 1
            if on_failure is not None:
                on_failure()
        raise RpcError("retries_exhausted",
                       f"stage {self.stage}: {self.opts.max_retries} retries failed; last: {last_error}")

    async def _wait_for_fresh(self, fallback: StageRecord, tried: list[str], job_tokens: int,
                              stopped: Callable[[], bool]) -> Optional[StageRecord]:
        """Every serving peer was tried (or is banned): wait up to ``fallback_wait_s`` for an untried, unbanned one
        to appear, re-reading the records; as soon as the stage's peers change (a dead one's record expired, a peer
        joined), or at the deadline, the best fallback among those then listed."""
        if self.opts.fallback_wait_s <= 0:
            return fallback
        listed = {r.peer_id for r in self.source.candidates()}
        deadline = time.monotonic() + self.opts.fallback_wait_s
        logger.debug(f"stage {self.stage}: every peer was tried; waiting up to {self.opts.fallback_wait_s:.0f}s "
                     f"for a fresh one before calling {fallback.peer_id[-8:]} again")
        while time.monotonic() < deadline and not stopped():
            await asyncio.sleep(0.5)
            await self.source.refresh()
            fresh = pick_peer(self.source.candidates(), job_tokens, exclude=tried, bans=self.bans,
                              inflight=self._inflight_view())
            if fresh is not None:
                return fresh
            if {r.peer_id for r in self.source.candidates()} != listed:
                break
        return await self.pick(tried, job_tokens, stopped)

    def hedge_after(self, peer_id: str) -> Optional[float]:
        """Seconds after which a call to ``peer_id`` is hedged: ``hedge_factor`` x its typical latency (the
        stage's while it has none), at least ``hedge_min_s``; None when hedging is off or nothing was measured."""
        if self.opts.hedge_factor <= 0:
            return None
        typical = self.latency.get(peer_id, self.typical_latency)
        if typical is None:
            return None
        return min(self.opts.timeout_s, max(self.opts.hedge_min_s, self.opts.hedge_factor * typical))

    async def _call_hedged(self, peer: StageRecord, meta: dict, tensors: list[torch.Tensor], rpc: str,
                           tried: list[str], job_tokens: int,
                           redirects: Sequence[str] = ()) -> tuple[StageRecord, Reply]:
        """One attempt on ``peer``; past :meth:`hedge_after` also on the best other replica, first answer wins.
        The slow peer is banned (routed around) until it answers; a failure of the hedge is only recorded, the
        attempt fails with the first peer's error.

        The hedge may go to a replica that sent this request on (``redirects``: it held its share of the stage's
        batch): that was no failure, and the first peer may be frozen. The hedge is sent as a retry
        (``attempt`` >= 1), which a replica takes even beyond its share instead of redirecting it again."""
        first = asyncio.ensure_future(self._call_one(peer.peer_id, meta, tensors, rpc))
        after = self.hedge_after(peer.peer_id)
        second: Optional[asyncio.Future] = None
        try:
            if after is not None:
                await asyncio.wait({first}, timeout=after)
            if first.done() or after is None:
                return peer, await first
            failed = [p for p in set(tried) if tried.count(p) > redirects.count(p)]
            other = pick_peer(self.source.candidates(), job_tokens, exclude=[*failed, peer.peer_id], bans=self.bans,
                              inflight=self._inflight_view())
            if other is None:
                return peer, await first
            self.hedges += 1
            self.bans.ban(peer.peer_id)
            logger.info(f"stage {self.stage} peer {peer.peer_id[-8:]} has not answered in {after:.1f}s; "
                        f"hedging to {other.peer_id[-8:]}")
            # ``hedge_of``: the hedge target claims the microbatch from the first peer before applying it, so that
            # only one of the two applies it (server/exactly_once.py).
            hedge_meta = dict(meta, attempt=max(1, int(meta.get("attempt", 0) or 0)), hedge_of=peer.peer_id)
            second = asyncio.ensure_future(self._call_one(other.peer_id, hedge_meta, tensors, rpc))
            owner = {first: peer, second: other}
            pending = {first, second}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is None:
                        if task is first:
                            self.bans.lift(peer.peer_id)
                        else:
                            self.hedges_won += 1
                        return owner[task], task.result()
                    if task is second:
                        err = task.exception()
                        code = getattr(err, "code", transport.INTERNAL)
                        self.errors[code] = self.errors.get(code, 0) + 1
                        tried.append(other.peer_id)
            return peer, first.result()  # both failed: the attempt fails with the first peer's error
        finally:
            for task in (first, second):
                if task is not None and not task.done():
                    task.cancel()

    async def _call_one(self, peer_id: str, meta: dict, tensors: list[torch.Tensor], rpc: str) -> Reply:
        self.inflight[peer_id] = self.inflight.get(peer_id, 0) + 1
        started = time.monotonic()
        try:
            reply = await transport.call(self.p2p, peer_id, self.namespace, rpc, meta, tensors, self.opts.timeout_s,
                                         stats=self.stats)
        finally:
            self.inflight[peer_id] -= 1
        # The peer's latency for hedging: its work, not the time the request waited for stages' batches to open.
        took = max(0.0, time.monotonic() - started - held_seconds(reply[0]))
        self.latency[peer_id] = took if peer_id not in self.latency else 0.8 * self.latency[peer_id] + 0.2 * took
        self.typical_latency = took if self.typical_latency is None else 0.9 * self.typical_latency + 0.1 * took
        return reply

    def _failed(self, peer_id: str, err: RpcError, tried: list[str], attempt: int) -> None:
        """Classify a failed call: raise it if no replica can do better, else remember the peer (and ban it when
        the failure is its own)."""
        self.errors[err.code] = self.errors.get(err.code, 0) + 1
        if err.code not in self.opts.retryable:
            raise err
        tried.append(peer_id)
        if err.code in BANNABLE:
            self.bans.ban(peer_id)
        final = attempt == self.opts.max_retries
        logger.warning(f"stage {self.stage} peer {peer_id[-8:]} failed ({err.code}: {str(err.message)[:200]}); "
                       f"{'giving up' if final else f'retry {attempt + 1}'}")
