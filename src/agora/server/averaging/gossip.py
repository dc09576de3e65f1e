"""``gossip`` (factored gossip DiLoCo, METHODS §8): DiLoCo's inner phases, but no exact average at the phase end.

* **Mix1**, in the background while the next inner phase runs: each replica averages its phase start with one
  partner of the one-peer exponential graph (``agora.optim.gossip.exponential_edges`` over the live replicas sorted
  by peer id; the partner changes every round, and ``log2 n`` rounds average exactly).
* At the phase end each replica steps from its *mixed* start on its *own* pseudo-gradient and momentum
  (``nesterov_outer_step`` from the mixed start), nothing awaited but its own Mix1.
* **Mix2**, blocking: ``q`` rounds over the ring, each ring taken as its matchings (two, three for an odd count),
  each matching one pairwise average. (The ring's Metropolis-Hastings matrix ``(I + S + S^T) / 3`` needs a
  three-party exchange per replica; a sequence of pairwise averages is symmetric and doubly stochastic too.)

Every exchange is a pair: hivemind's averager with ``target_group_size=2`` and the pair's own group bits (round,
pass, pair index), so a pair meets only its partner. A partner that is dead or late leaves the exchange unmatched:
the replica keeps its own value for that exchange (the dead edge drops out, as Metropolis-Hastings weights do), and
training goes on. ``q = 0`` puts no byte on the wire at a phase end.

With ``averaging.codec`` a pair averages its parameters' *difference from a reference both hold*, compressed: the
common start (the outer state a replica began with, named by its fingerprint), later the result of the pair's last
exact exchange; every ``resync_every``-th round, and any exchange whose reference is that many rounds old, is exact
(docs/AVERAGING.md, "Compressed rounds").
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

import torch

from agora.net.records import DHT_TIMEOUT_S, PeerState
from agora.optim.gossip import exponential_edges
from agora.optim.outer import nesterov_outer_step
from agora.server.averaging.allreduce import GuardedAverager
from agora.server.averaging.diloco import DiLoCoSync
from agora.server.averaging.sync import SyncContext, tensors_fingerprint

logger = logging.getLogger("agora.averaging")

PAIR_BITS = 12  # pair index bits of the group key: up to 4096 pairs (8192 replicas) per exchange


def ring_matchings(n: int) -> list[list[tuple[int, int]]]:
    """The ring's edges split into matchings (no replica twice in one): even-indexed edges, odd ones, and for an odd
    ``n`` the closing edge alone."""
    edges = [(i, i + 1) for i in range(n - 1)]
    out = [edges[0::2], edges[1::2]]
    if n > 2:
        out.append([(0, n - 1)] if n % 2 else [])
        if n % 2 == 0:
            out[1] = out[1] + [(0, n - 1)]
    return [m for m in out if m]


Reference = tuple[str, list[torch.Tensor], int]  # id both ends gather, the parameters both hold, round it dates from


def pair_bits(round_index: int, exchange: int, pair: int) -> str:
    """The group key bits of one pairwise exchange: 2 bits of round, 4 of exchange (0: Mix1, 1..: Mix2 matchings),
    ``PAIR_BITS`` of pair index. Two replicas with the same bits form a group of two; nobody else has them."""
    return f"{round_index % 4:02b}{exchange % 16:04b}{pair % (1 << PAIR_BITS):0{PAIR_BITS}b}"


class GossipSync(DiLoCoSync):
    scheme = "gossip"

    def __init__(self, ctx: SyncContext):
        self.q = ctx.manifest.averaging.q
        super().__init__(ctx)
        self._mix1_task: Optional[asyncio.Task] = None  # the phase start's background pairwise average
        self._mixed: Optional[list[torch.Tensor]] = None  # its result (None: no partner, or the exchange failed)
        self.blocking_bytes = self.background_bytes = 0
        self.exchanges_ok = self.exchanges_failed = 0
        self.exchanges_compressed = 0  # of exchanges_ok: sent as a difference from a shared reference, compressed
        self.reference_mismatches = 0  # exchanges discarded because the pair held different references
        # With a codec, the references this replica shares with its partners: partner peer id -> (reference id, the
        # parameters both hold within float32 rounding, the round they date from). ``_start_reference`` is the outer
        # state this replica began with (round 0), the same on every seeded replica; it stands for any partner
        # without a reference of its own until an exchange shows the partner does not hold it (``_no_start``).
        self._references: dict[str, Reference] = {}
        self._start_reference: Optional[Reference] = None
        self._no_start: set[str] = set()
        if self.codec != "none":
            start = [t.clone() for t in self.outer]
            self._start_reference = (f"start:{tensors_fingerprint(start)!r}", start, 0)

    @property
    def codec(self) -> str:
        return self.ctx.manifest.averaging.codec

    def wire_codec(self) -> str:
        # With a codec, a compressed exchange carries the difference from the pair's reference in the codec's
        # format, an exact one (``compression.set_exact``) the parameters in float32 (docs/AVERAGING.md).
        return self.codec

    def _make_payload_averager(self) -> GuardedAverager:
        shapes = [p.shape for p in self.ctx.runtime.stage.parameters()]
        payload = [torch.zeros(s, dtype=torch.float32) for s in shapes]
        settings = {**self.averager_settings(), "target_group_size": 2, "initial_group_bits": pair_bits(0, 0, 0)}
        return GuardedAverager(payload, self.ctx.dht, **settings)

    async def run(self) -> None:
        try:
            await super().run()
        finally:
            if self._mix1_task is not None:
                self._mix1_task.cancel()

    def _state_replaced(self) -> None:
        super()._state_replaced()
        self._mixed = None  # a Mix1 of the trajectory left behind
        self._references.clear()  # references of the trajectory left behind: the next exchanges are exact
        self._start_reference = None

    # ------------------------------------------------------------------ references (with a codec)
    def _reference_for(self, partner: str, round_index: int) -> Optional[Reference]:
        """The reference to send our difference from in an exchange with ``partner`` in round ``round_index``, or
        None for an exact exchange: no codec, every ``resync_every``-th round, a reference ``resync_every`` rounds
        old or older (a pair the exact rounds never bring together still renews its own), or no reference in
        common. The decision depends only on the round and the reference's id, so two ends holding the same id
        decide alike; ends whose histories differ (one saw an exchange fail that the other completed, a joiner)
        hold different ids, which the exchange's gather shows, and the exchange is discarded."""
        if self.codec == "none" or round_index % self.resync_every == 0:
            return None
        reference = self._references.get(partner)
        if reference is None and partner not in self._no_start:
            reference = self._start_reference
        if reference is None or round_index - reference[2] >= self.resync_every:
            return None
        return reference

    def _forget_reference(self, partner: str) -> None:
        """After a failed, partial or mismatched exchange: our next one with ``partner`` is exact. The partner may
        still hold a reference (it completed the exchange); then the ids differ next time, that exchange is
        discarded at both ends, and the one after it is exact at both."""
        self._references.pop(partner, None)
        self._no_start.add(partner)

    def _prune_references(self, live: list[str], round_index: int) -> None:
        """Drop the references no exchange can use any more (each is a copy of the stage's parameters): those of
        partners that left, and the start once it is ``resync_every`` rounds old."""
        for partner in [p for p in self._references if p not in live]:
            del self._references[partner]
        if self._start_reference is not None and round_index - self._start_reference[2] >= self.resync_every:
            self._start_reference = None

    # ------------------------------------------------------------------ the live graph
    async def _ranked(self, step: int) -> tuple[list[str], int]:
        """The replicas of the phase ending at ``step`` (serving, unbanned, ours included), sorted by peer id, and
        our index among them: every replica computes the same graph from the same records."""
        ids = {r.peer_id for r in await self._phase_replicas(step, past=self.every)}
        ranked = sorted(ids | {self.ctx.peer_id})
        return ranked, ranked.index(self.ctx.peer_id)

    async def _exchange(self, values: list[torch.Tensor], bits: str, label: str, timeout: float,
                        partner: str) -> Optional[list[torch.Tensor]]:
        """Average ``values`` with ``partner``, the one replica that uses group ``bits``; None when no pair formed
        in time, or as soon as the partner's record is gone or no longer serving (it died or left: waiting out the
        timeout would only stall this replica)."""
        c = self.ctx

        async def partner_alive() -> bool:
            return any(r.peer_id == partner and r.state == PeerState.SERVING.value for r in await self.replicas())

        reference = self._reference_for(partner, self._round_of(label))
        reference_id = reference[0] if reference is not None else ""
        partial_before = self.averager.partial_rounds
        control = None
        try:
            await c.run_io(lambda: self.averager.set_group_bits(bits, wait=False).result(timeout=DHT_TIMEOUT_S))
            with self.averager.get_tensors() as bufs:
                # hivemind holds this lock for a whole all-reduce, sending included: an exchange given up on (a
                # cancelled Mix1) that still runs in the averager's process has finished here, so it cannot send
                # with the wire format set for this one
                for i, (b, v) in enumerate(zip(bufs, values)):
                    b.copy_(v if reference is None else v - reference[1][i])
                self.compression.set_exact(reference is None)
            gather = {"exchange": label, "reference": reference_id}
            control = await c.run_io(lambda: self.averager.step(
                weight=1.0, gather=gather, timeout=timeout, allow_retries=True, wait=False))
            result = await self._await_round(control, None, timeout, alive=partner_alive)
        except asyncio.CancelledError:  # the phase end gave up on this Mix1: stop hivemind's step too
            if control is not None:
                control.cancel()
            if self.codec != "none":
                self._forget_reference(partner)
            raise
        except Exception as err:  # an exchange that failed, not a failed node
            logger.info(f"stage {c.stage_index}: gossip exchange {label} raised {err!r}")
            result = None
        gathered = [g for g in result.values() if isinstance(g, dict)] if result else []
        labels = {g.get("exchange") for g in gathered}
        if result is None or len(result) != 2 or labels != {label} or await self._untrusted(result):
            self.exchanges_failed += 1
            if self.codec != "none":
                self._forget_reference(partner)
            return None
        if self.codec == "none":
            self.exchanges_ok += 1
            with self.averager.get_tensors() as bufs:
                return [b.clone() for b in bufs]
        if {g.get("reference") for g in gathered} != {reference_id}:
            # Each end sent a difference from another reference (or one sent its parameters): the average means
            # nothing. Both ends see it; the next exchange of the pair is exact.
            logger.info(f"stage {c.stage_index}: gossip exchange {label} discarded: the pair held different "
                        f"references ({sorted(str(g.get('reference')) for g in gathered)})")
            self.reference_mismatches += 1
            self.exchanges_failed += 1
            self._forget_reference(partner)
            return None
        self.exchanges_ok += 1
        members = sorted(str(p) for p in result)
        with self.averager.get_tensors() as bufs:
            if reference is not None:
                self.exchanges_compressed += 1
                return [r + b for r, b in zip(reference[1], bufs)]
            out = [b.clone() for b in bufs]
        # An exact average: both ends hold it within float32 rounding, and it becomes the pair's reference, under an
        # id naming the round and both members (the ones actually grouped: a replica whose view of the graph differed
        # may have met another partner), unless hivemind left parts of it out (each end kept its own values there).
        other = next(m for m in members if m != c.peer_id)
        if self.averager.partial_rounds > partial_before:
            self._forget_reference(other)
        else:
            self._references[other] = (f"{label}|{members[0]}|{members[1]}", [t.clone() for t in out],
                                       self._round_of(label))
        return out

    def _round_of(self, label: str) -> int:
        """The round index of an exchange, from its label (``mix1-<boundary>``, ``mix2-<step>-<r>-<k>``)."""
        return int(label.split("-")[1]) // self.every

    # ------------------------------------------------------------------ Mix1, in the background
    def _make_codec_averager(self) -> None:
        return None  # a codec compresses the exchanges themselves (``_make_payload_averager``)

    def _start_mix1(self, boundary: int) -> None:
        if self._mix1_task is not None and not self._mix1_task.done():
            self._mix1_task.cancel()
        self._mixed = None
        start = [t.clone() for t in self.outer]
        self._mix1_task = asyncio.create_task(self._mix1(boundary, start), name=f"gossip-mix1-{boundary}")

    async def _mix1(self, boundary: int, start: list[torch.Tensor]) -> None:
        """Average the phase start with this round's exponential-graph partner (the phase that starts at
        ``boundary``); the result waits in ``_mixed`` for the phase end."""
        round_index = boundary // self.every
        ranked, me = await self._ranked(boundary)
        pair = next(((i, j) for i, j in exponential_edges(len(ranked), round_index) if me in (i, j)), None)
        if pair is None:
            return  # alone, or sitting this round out (the count is not a power of two)
        sent = self.bytes_sent
        partner = ranked[pair[1] if pair[0] == me else pair[0]]
        mixed = await self._exchange(start, pair_bits(round_index, 0, pair[0]), f"mix1-{boundary}",
                                     self.ctx.averaging_timeout_s, partner)
        self.background_bytes += self.bytes_sent - sent
        self._mixed = mixed

    # ------------------------------------------------------------------ the phase end
    async def _outer_round(self, step: int) -> None:
        c = self.ctx
        t0, sent = time.monotonic(), self.bytes_sent
        self._samples_since_round = 0
        if self._mix1_task is not None:  # normally long done: it ran during the whole phase
            try:
                await asyncio.wait_for(asyncio.shield(self._mix1_task), timeout=c.averaging_timeout_s)
            except Exception as err:  # noqa: BLE001 -- a failed or late Mix1 mixes nothing
                logger.info(f"stage {c.stage_index}: Mix1 of the phase ending at {step} not used: {err!r}")
                self._mix1_task.cancel()
                self._mixed = None
        mixed, self._mixed = self._mixed, None
        new = await c.run_compute(self._outer_step, mixed, step)
        ranked, me = await self._ranked(step)
        self._prune_references(ranked, step // self.every)
        for r in range(self.q if len(ranked) > 1 else 0):
            for k, matching in enumerate(ring_matchings(len(ranked))):
                pair = next(((i, j) for i, j in matching if me in (i, j)), None)
                if pair is None:
                    continue
                self.averaging_step = step
                partner = ranked[pair[1] if pair[0] == me else pair[0]]
                averaged = await self._exchange(new, pair_bits(step // self.every, 1 + r * 3 + k, pair[0]),
                                                f"mix2-{step}-{r}-{k}", c.averaging_timeout_s, partner)
                self.averaging_step = -1
                if averaged is not None:
                    new = averaged
        await c.run_compute(self._enter_phase, new)
        seconds = time.monotonic() - t0
        self.outer_seconds += seconds
        self.blocking_bytes += self.bytes_sent - sent
        self.rounds_ok += 1  # an outer step, whatever its exchanges did (they are counted one by one)
        if len(ranked) == 1:
            self.outer_rounds_alone += 1
        c.observers.emit("outer_round", mixed is not None, seconds, len(ranked))
        c.log_event("outer_round", step=step, group=len(ranked), seconds=seconds, mixed=mixed is not None, q=self.q)
        logger.info(f"stage {c.stage_index}: gossip outer step after step {step} ({len(ranked)} replicas, Mix1 "
                    f"{'used' if mixed is not None else 'not used'}, {self.q} Mix2 rounds, {seconds:.2f}s)")
        self._start_mix1(step)

    def _outer_step(self, mixed: Optional[list[torch.Tensor]], step: int) -> list[torch.Tensor]:
        """Compute thread: from the (mixed) phase start, our own pseudo-gradient and momentum; returns the new
        parameters (float32) and updates the momentum. Observers of ``"outer_round_start"`` see the phase's end."""
        local = self.ctx.runtime.trained_parameters()
        self.ctx.observers.emit("outer_round_start", step, local)
        out = []
        with torch.no_grad():
            for i, (start, mom, p) in enumerate(zip(self.outer, self.momentum, local)):
                new, velocity = nesterov_outer_step(start, mom, p.detach().cpu(), self.outer_lr, self.outer_momentum,
                                                    mixed[i] if mixed is not None else None)
                out.append(new.float())
                mom.copy_(velocity)
        return out

    def _enter_phase(self, new: list[torch.Tensor]) -> None:
        """Compute thread: the new parameters are the next phase's start."""
        for outer, v in zip(self.outer, new):
            outer.copy_(v)
        self.ctx.runtime.load_parameters(self.outer)
        self._set_fingerprint()
