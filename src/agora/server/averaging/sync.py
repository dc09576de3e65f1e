"""Per-stage data parallelism: replicas of a stage decide together when to step, and repair divergence.

``ReplicaSync`` holds what every averaging scheme shares: the decision (from facts in the DHT records: when the
replicas at our step together hold the target batch, all of them join a round), the round's bounded wait, the
repairs (download the state of a replica ahead of us, or of the leader when parameters differ at one step), and
what a round must exclude (banned or uncertified members). What a round moves is a subclass, one per manifest
``averaging.scheme``: ``full.FullSync``, ``powersgd.PowerSGDSync``, ``sparse.SparseSync`` (``averaging.make_sync`` picks).

It works on explicit inputs (``SyncContext``: the stage's runtime, the DHT, the P2P, the manifest, the node's
callbacks), never on the node. The why of each rule is in ``docs/AVERAGING.md``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Sequence

import torch
from hivemind import DHT

from agora.config import Manifest
from agora.model import tied_parameter
from agora.net.errors import NO_ANSWER
from agora.net.members import RunMembers
from agora.net import transport
from agora.net.protocol import INFO, OVER_SHARE
from agora.net.state_transfer import PAGE_BYTES, fetch_state
from agora.net.records import (RECORD_TTL_S, PeerState, StageRecord, read_stage, read_swarm_bans,
                               sampled_relative_distance,
                                sampled_consensus_distance, trainers_training)
from agora.net.transport import RpcError
from agora.server.averaging.allreduce import CountingCompression
from agora.server.averaging.clip import GlobalClip
from agora.server.averaging.tied import TiedExchange
from agora.server.averaging.warmup_brake import WarmupBrake
from agora.server.observers import Observers
from agora.server.runtime import StageRuntime, trim_heap
from agora.server.stage_records import StageRecords

logger = logging.getLogger("agora.averaging")

POLL_S = 0.3
SHARE_WAIT_S = 3.0  # how long a retried microbatch over our share waits for the others' counts before it is taken
ZERO_SAMPLE_WEIGHT = 1e-6  # hivemind requires positive weights; this keeps an empty replica's influence < fp32 eps
# A round's partner is probed (a small ``info`` call) when the round waits: a frozen replica's record outlives its
# last announcement by up to RECORD_TTL_S, and hivemind waits for a frozen all-reduce member for its sender and
# reducer timeouts. A partner that does not answer within PROBE_TIMEOUT_S is left out of our decisions (rounds,
# batch shares) for UNRESPONSIVE_S, by when its record has expired unless it came back and announced again.
PROBE_TIMEOUT_S = 2.0
UNRESPONSIVE_S = RECORD_TTL_S
# An all-reduce that runs longer than this many times the typical one (at least ALLREDUCE_PROBE_MIN_S) has its
# partners probed; if one does not answer, our side leaves the round and steps on its own gradients.
ALLREDUCE_PROBE_FACTOR = 4.0
ALLREDUCE_PROBE_MIN_S = 3.0
# ``agora node --averaging-timeout`` when not given: at least this long, and long enough for a stage's float64
# gradients at AVERAGING_MIN_RATE (a 2-replica all-reduce sends and receives about that many bytes per replica).
AVERAGING_TIMEOUT_MIN_S = 20.0
AVERAGING_MIN_RATE_BYTES_PER_S = 2**20  # ~8.4 Mbit/s
# A stage holding part of its batch, idle (nothing admitted here or at its replicas) for this long, checks whether the
# other stages already took the step (``_left_behind``); also the least time between two such checks.
LEFT_BEHIND_QUIET_S = 2.0
# With microbatches in flight here or at a replica, the quiet must last this long (or three microbatches' compute):
# once every other stage has published its norm of our step, a backward of our batch still on its way arrives within
# the downstream's reply and our own backward, while a microbatch the other stages hold for their *next* step (our
# batches shifted against theirs by lost samples) never does until they step. Below the clip wait (10 s), so the
# other stages get our norm before they give up on it.
HELD_QUIET_S = 5.0
CLIP_WAIT_MIN_S = 10.0  # the least a step waits for the other stages' gradient norms (``default_clip_wait_s``)
# A state download (a joining, moving or repairing replica) shares the source's link with its rounds: pages and the
# whole download are given time for STATE_MIN_RATE, and never less than the minimums.
STATE_MIN_RATE_BYTES_PER_S = 2**19  # ~4.2 Mbit/s
STATE_PAGE_TIMEOUT_MIN_S = 60.0
STATE_SYNC_TIMEOUT_MIN_S = 120.0
# Probes in a row (each waiting twice as long as the one before) a partner must miss before we leave the all-reduce:
# one missed probe also happens to a live partner whose link the round itself saturates.
ALLREDUCE_PROBE_STRIKES = 2


def batch_shares(target: int, microbatch: int, peers: list[tuple[str, float]]) -> dict[str, int]:
    """Each replica's share of a target batch, in samples: whole microbatches, split by measured throughput
    (``peers``: peer id and tokens/s; equal split while any throughput is unknown), at least one each when there
    are enough, the remainder to the largest fractions (ties by peer id), so every replica computes the same split
    from the same records and the shares add up to the batch."""
    units = max(1, target // max(1, microbatch))
    ids = sorted(p for p, _ in peers)
    rate = dict(peers)
    weights = [rate[p] for p in ids] if all(rate[p] > 0 for p in ids) else [1.0] * len(ids)
    floor = 1 if units >= len(ids) else 0
    spare = units - floor * len(ids)
    exact = [spare * w / sum(weights) for w in weights]
    given = [floor + int(x) for x in exact]
    by_fraction = sorted(range(len(ids)), key=lambda i: (-(exact[i] - int(exact[i])), ids[i]))
    for i in by_fraction[:units - sum(given)]:
        given[i] += 1
    return {p: g * microbatch for p, g in zip(ids, given)}


def tensors_fingerprint(tensors: Sequence[torch.Tensor]) -> float:
    """An exact checksum of a list of tensors: equal floats iff (almost surely) equal tensors, in this order."""
    with torch.no_grad():
        total = 0.0
        for i, t in enumerate(tensors):
            total += float(t.double().sum()) * (1 + i * 1e-3) + float(t.double().abs().sum()) * 1e-7
        return total


def parameter_fingerprint(module: torch.nn.Module) -> float:
    """An exact checksum of the parameters: equal floats iff (almost surely) equal parameters."""
    with torch.no_grad():
        total = tensors_fingerprint(list(module.parameters()))
        m = getattr(module, "boundary_map", None)  # UPM: replicas in another output frame are not at our version
        if m is not None:
            total += float((m.double() * torch.arange(1, m.numel() + 1, dtype=torch.float64).reshape(m.shape)).sum())
        return total


def default_averaging_timeout_s(n_parameters: int) -> float:
    """How long a round may take to form and then to all-reduce, for a stage of ``n_parameters`` trainable
    parameters. On 20 Mbit/s links 20 s failed about 6 of 50 rounds of ``small`` by timeout (its tail's all-reduce
    outgrew it; docs/bench/convergence/2026-12-03-capped-rounds). A longer timeout costs nothing on fast links: a
    frozen or dead partner is detected by probes and broken streams."""
    return max(AVERAGING_TIMEOUT_MIN_S, n_parameters * 8 / AVERAGING_MIN_RATE_BYTES_PER_S)


def state_page_timeout_s(state_bytes: int) -> float:
    """How long one page of a ``get_state`` download may take, for a stage whose state is ``state_bytes``. A flat 60 s
    failed a move into ``small``'s tail at 20 Mbit/s: its first page is 64 MiB, and the source's link also carried
    its all-reduce (docs/bench/convergence/2026-12-03-capped-rounds)."""
    return max(STATE_PAGE_TIMEOUT_MIN_S, min(state_bytes, PAGE_BYTES) / STATE_MIN_RATE_BYTES_PER_S)


def default_clip_wait_s(stage_parameters: list[int], averaging_timeout_s: Optional[float] = None) -> float:
    """How long a step waits for the other stages' gradient norms (``GlobalClip``): a stage publishes its norm after
    its round, so the norms arrive about as late as the slowest stage's all-reduce (``stage_parameters``: every
    stage's trainable parameters, from the manifest): the slowest stage's float64 gradients at
    ``AVERAGING_MIN_RATE``, no longer than the ``averaging_timeout_s`` the node was given, at least
    ``CLIP_WAIT_MIN_S``. A flat 10 s expired at every step of ``small``'s stages 0 and 1 at 20 Mbit/s (the tail's
    all-reduce took 40 s): they clipped by their own norms and each step waited the 10 s
    (docs/bench/convergence/2026-12-03-capped-overlap)."""
    wait = max(stage_parameters, default=0) * 8 / AVERAGING_MIN_RATE_BYTES_PER_S
    if averaging_timeout_s is not None:
        wait = min(wait, averaging_timeout_s)
    return max(CLIP_WAIT_MIN_S, wait)


def stage_state_bytes(stage: torch.nn.Module) -> int:
    """About what a ``get_state`` download of ``stage`` moves: every parameter, plus two fp32 optimizer moments per
    trainable one (Adam's; Muon keeps one, so this is an upper bound), plus a little for the scalars (steps)."""
    params = list(stage.parameters())
    return sum(p.numel() * p.element_size() for p in params) + \
        sum(8 * p.numel() for p in params if p.requires_grad) + 4096


def default_sync_timeout_s(state_bytes: int) -> float:
    """How long a joining or moving replica tries to download a stage's state, all attempts together."""
    return max(STATE_SYNC_TIMEOUT_MIN_S, 60.0 + state_bytes / STATE_MIN_RATE_BYTES_PER_S)


@dataclass
class SyncContext:
    """What a replica sync works with, passed explicitly by the node that owns it.

    :param run_compute: ``await run_compute(fn, *args)`` runs ``fn`` on the node's compute thread
    :param run_io: the same on the node's DHT thread pool
    :param announce: publishes the node's record now (replicas decide from each other's records)
    :param log_event: the node's event log (``info`` RPC, summaries)
    :param is_serving: whether the node serves its stage now (no rounds otherwise)
    :param local_bans: peers this node's SENTINEL banned
    :param members: who may take part in an allow-listed run (None in an open run)
    """

    manifest: Manifest
    runtime: StageRuntime
    dht: DHT
    p2p: Any
    peer_id: str
    averaging_timeout_s: float
    stall_step_s: float
    run_compute: Callable[..., Awaitable[Any]]
    run_io: Callable[..., Awaitable[Any]]
    announce: Callable[[], Awaitable[None]]
    log_event: Callable[..., None]
    is_serving: Callable[[], bool]
    local_bans: Callable[[], set]
    members: Optional[RunMembers]
    observers: Observers
    clip_wait_s: float = CLIP_WAIT_MIN_S  # how long a step waits for the other stages' gradient norms (averaging/clip.py)
    state_bytes: int = 0  # about what a ``get_state`` download of this stage moves (its download timeouts scale with it)
    # the node's reads of stage records, shared with its other parts (None: reads of this sync's own)
    records: Optional[StageRecords] = None

    def __post_init__(self) -> None:
        if self.records is None:
            m = self.manifest
            self.records = StageRecords(lambda stage: self.run_io(read_stage, self.dht, m.run_id, stage, m.hash))

    @property
    def state_page_timeout_s(self) -> float:
        return state_page_timeout_s(self.state_bytes)

    @property
    def stage_index(self) -> int:
        return self.runtime.stage_index


class ReplicaSync:
    """The shared loop of every scheme; a subclass says what a round moves (see the module docstring)."""

    scheme = "full"
    gradient_dtype = torch.float64  # what ``round`` takes the accumulated gradients as (a scheme may compute on them)

    def __init__(self, ctx: SyncContext):
        self.ctx = ctx
        tied = tied_parameter(ctx.runtime.stage)
        self.tied = TiedExchange(ctx) if tied is not None else None
        tied_index = next((i for i, p in enumerate(ctx.runtime.stage.parameters()) if p is tied), None)
        self.clipper = GlobalClip(ctx, tied_index if tied is not None else None, ctx.clip_wait_s)
        self.warmup_brake = WarmupBrake(ctx)  # a curvature-driven architecture warm-up (off otherwise)
        m = ctx.manifest
        self.target = m.batch.target_batch_size
        self.prefix = f"{m.run_id}_s{ctx.stage_index}_{m.hash}_grads"  # no dots: hivemind splits keys on '.'
        # measures the all-reduce bytes this replica sends, in the scheme's wire format (``wire_codec``)
        self.compression = CountingCompression(self.wire_codec())
        self.round_bytes: deque[int] = deque(maxlen=100)  # all-reduce payload bytes we sent, per successful round
        self.fingerprint = parameter_fingerprint(ctx.runtime.stage)
        self.fingerprint_step = ctx.runtime.step  # the step ``fingerprint`` was computed at
        self.lock = asyncio.Lock()  # held for a whole tick: a stage move waits for it, so never stops a round midway
        self.control = None  # hivemind's StepControl of the round in progress (its stage shows where it is)
        self.closed = False
        self.rounds_ok = self.rounds_failed = self.local_steps = self.resyncs = self.aborted_rounds = 0
        self.partial_rounds = 0  # rounds hivemind finished with part of our average missing (counted as failed)
        # The step our last failed round made on our own gradients while replicas were at that step: until we
        # step again or load a state, replicas at that step with other parameters keep theirs (``repair_source``).
        self.fallback_step = -1
        self.averaging_step = -1
        self._epoch = 0  # bumped by every state download
        self._announced_counts, self._announced_at = (0, 0), 0.0
        self._banned: set[str] = set()
        self._banned_at = 0.0
        self.unresponsive: dict[str, float] = {}  # replicas that failed a probe, and when (see PROBE_TIMEOUT_S)
        self.replica_ids: set[str] = set()  # the other replicas in the stage's records at the last read
        self.left_rounds = 0  # all-reduces our side left because a partner stopped answering
        self.probe_failures = 0  # probes of replicas that got no answer (``probe``)
        self.typical_allreduce_s: Optional[float] = None  # moving average of finished all-reduces (from their start)
        self._left_control = None  # the StepControl of the last round we left; its all-reduce may still run
        self._trainers, self._trainers_read_at = 0, 0.0
        self.admitted = 0  # samples of training microbatches admitted here and not finished yet (``admit_training``)
        self.others_samples = 0  # what the replicas at our step announced they accumulated (``_note_replicas``)
        self.others_reserved = 0  # that, plus what they announced as admitted and still in flight
        self.share_peers: list[tuple[str, float]] = []  # replicas around our step and their throughput (shares)
        # Relative spread of the replicas' parameter samples at one step (records' ``param_sample``); None: never
        # seen two replicas at one step. 0 for bit-identical schemes (full, powersgd) at every step.
        self.consensus_distance: Optional[float] = None
        self.stepping = False  # between taking the batch's gradients and applying the step (``round``)
        # Agreement within tolerance (``agrees_with``): at how many steps a replica's other fingerprint was rounding
        # only, the sampled relative distance measured the last time, and the largest one accepted.
        self.tolerated = 0
        self._tolerated_step = -1
        self.agreement_distance: Optional[float] = None
        self.agreement_max_distance: Optional[float] = None
        self.share_overflows = 0  # retried microbatches taken beyond our share (the others' counts looked stale)
        self.share_redirects = 0  # training microbatches sent to another replica: this one had its share
        self.realigned_steps = 0  # partial steps taken because the rest of the batch was lost (``_left_behind``)
        self._left_behind_read_at = 0.0
        # (step, samples) at the last look that found us left behind (``_left_behind`` confirms at the next one)
        self._left_behind_seen: Optional[tuple[int, int]] = None
        ctx.runtime.fingerprint_at = lambda step: self.fingerprint if self.fingerprint_step == step else None

    def wire_codec(self) -> str:
        """How the main averager's parts travel (``allreduce.CODECS``): exactly, except where a scheme says."""
        return "none"

    def averager_settings(self) -> dict:
        """hivemind ``DecentralizedAverager`` settings shared by every scheme."""
        return dict(
            start=True,
            prefix=self.prefix,
            min_group_size=2,
            min_matchmaking_time=1.0,
            request_timeout=0.5,  # below min_matchmaking_time, else matchmaking can deadlock
            allreduce_timeout=self.ctx.averaging_timeout_s,
            next_chunk_timeout=5.0,
            allow_state_sharing=False,
            shutdown_timeout=2,
            compression=self.compression,
        )

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.averager.shutdown()
        except Exception as err:  # already gone: nothing left to release
            logger.debug(f"averager shutdown: {err!r}")

    @property
    def bytes_sent(self) -> int:
        """All-reduce payload bytes this replica sent to the other members of its rounds, so far."""
        return self.compression.bytes_sent

    # ------------------------------------------------------------------ what a round moves (per scheme)
    def round_averager(self) -> Any:
        """The hivemind averager the round whose payload ``_load_buffers`` loaded runs in (``powersgd`` has a
        second one for its dense steps)."""
        return self.averager

    def averagers(self) -> list:
        """Every hivemind averager this scheme runs rounds in (``round_averager`` picks one per round)."""
        return [self.averager]

    def partial_count(self) -> int:
        """All-reduces finished with part of the average missing, over all of this scheme's averagers. A round
        was partial iff this grew while it ran: only one round runs at a time. (Why the sum: which averager a
        round runs in is only known once ``_load_buffers`` has run, and a count read from one averager before and
        from another after once took every PowerSGD dense round after a first partial one for a failed round.)"""
        return sum(getattr(a, "partial_rounds", 0) for a in self.averagers() if a is not None)

    def _load_buffers(self, grads: list[torch.Tensor], step: int) -> None:
        """Compute thread: put this round's payload into the averager's buffers."""
        raise NotImplementedError

    def _averaged(self) -> list[torch.Tensor]:
        """Compute thread, after a successful round: the averaged update, one tensor per parameter."""
        raise NotImplementedError

    def _not_averaged(self, grads: list[torch.Tensor], alone: bool) -> list[torch.Tensor]:
        """Compute thread: what to apply when no round result exists (``alone``: there was nobody to average with)."""
        return grads

    def _state_replaced(self) -> None:
        """Compute thread, after a state download: drop what belongs to the trajectory left behind."""

    def _after_step(self) -> None:
        """Compute thread, right after a step: a scheme may start background work from the new state."""

    async def _tick(self) -> None:
        """One look at the replicas: repair, join a round that started, or step once the batch is complete."""
        raise NotImplementedError

    # ------------------------------------------------------------------ reading the replicas
    async def replicas(self) -> list[StageRecord]:
        c = self.ctx
        recs = await c.records.get(c.stage_index)
        self.replica_ids = {r.peer_id for r in recs if r.peer_id != c.peer_id}
        others = [r for r in recs if r.peer_id != c.peer_id and not self._is_unresponsive(r.peer_id)]
        self._note_replicas(others)
        return others

    def _is_unresponsive(self, peer_id: str) -> bool:
        since = self.unresponsive.get(peer_id)
        if since is not None and time.monotonic() - since > UNRESPONSIVE_S:
            del self.unresponsive[peer_id]
            return False
        return since is not None

    async def probe(self, peers: list[StageRecord], timeout: float = PROBE_TIMEOUT_S,
                    mark: bool = True) -> list[bool]:
        """Whether each of ``peers`` answers a small call within ``timeout``; with ``mark``, those that do not are
        left out of :meth:`replicas` for ``UNRESPONSIVE_S`` (frozen, or cut off: their records still look alive)."""
        c = self.ctx

        async def answers(peer: StageRecord) -> bool:
            try:
                await transport.call(c.p2p, peer.peer_id, c.manifest.run_id, INFO, {}, [], timeout)
                return True
            except Exception as err:
                if isinstance(err, RpcError) and err.code not in NO_ANSWER:
                    return True  # it refused (busy, rate-limited, ...): alive, it answered
                if not mark:
                    logger.info(f"stage {c.stage_index}: replica {peer.peer_id[-8:]} did not answer a probe within "
                                f"{timeout:g}s ({getattr(err, 'code', type(err).__name__)}); probing it again")
                    return False
                logger.warning(f"stage {c.stage_index}: replica {peer.peer_id[-8:]} did not answer a probe "
                               f"within {timeout:g}s ({getattr(err, 'code', type(err).__name__)}); "
                               f"leaving it out for {UNRESPONSIVE_S:g}s")
                self.unresponsive[peer.peer_id] = time.monotonic()
                self.probe_failures += 1
                return False

        return list(await asyncio.gather(*(answers(p) for p in peers)))

    async def banned_replicas(self) -> set[str]:
        """Replicas banned by SENTINEL (ours, or published by ``BAN_QUORUM`` other peers), refreshed at most every 2 s."""
        c, m = self.ctx, self.ctx.manifest
        if time.monotonic() - self._banned_at > 2.0:
            self._banned_at = time.monotonic()
            try:
                published = await c.run_io(read_swarm_bans, c.dht, m.run_id, m.n_stages, m.hash)
            except Exception as err:  # keep the previous view; bans only ever grow
                logger.debug(f"reading bans failed: {err!r}")
                published = set()
            self._banned = self._banned | published | c.local_bans()
        return self._banned

    async def _round_partners(self, step: int) -> list[StageRecord]:
        """The other replicas that could still be in our round for ``step`` (records alive in the DHT)."""
        recs = await self.replicas()
        return [r for r in recs
                if r.state == PeerState.SERVING.value and (r.step == step or r.averaging_step == step)]

    async def _partners_left(self, step: int) -> bool:
        """Whether any replica that could still be in our round for ``step`` is alive in the DHT and answers."""
        partners = await self._round_partners(step)
        return bool(partners) and any(await self.probe(partners))

    def averager_busy(self) -> bool:
        """Whether the all-reduce of a round we left still runs in hivemind's averager: it holds the averager's
        buffers until its own timeouts end, so a round now would block the compute thread loading them."""
        return self._left_control is not None and not self._left_control.done()

    async def _untrusted(self, result: dict) -> bool:
        """Whether a finished round's group holds a member whose contribution must not reach our parameters.

        hivemind's matchmaking cannot exclude anyone, so this is checked after the all-reduce: a replica banned by
        SENTINEL, or, in an allow-listed run (its matchmaking keys carry no certificate), a member without a
        certified record of this stage. If the replicas cannot be read, every other member counts as unknown.
        """
        c = self.ctx
        members = {str(p) for p in result} - {c.peer_id}
        frames = c.runtime.frames
        if frames is not None:
            ours = [frames.epoch_in, frames.epoch_out]
            other = [str(p) for p, g in result.items() if not isinstance(g, dict) or g.get("frame") != ours]
            if other:
                logger.warning(f"stage {c.stage_index}: replicas {[p[-8:] for p in other]} averaged in another UPM "
                               f"frame than ours ({ours}); discarding the round")
                return True
        if members & self._banned:
            logger.warning(f"stage {c.stage_index}: a banned replica joined the round; discarding it")
            return True
        if c.members is None or not members:
            return False
        try:
            outsiders = members - {r.peer_id for r in await self.replicas()}
        except Exception as err:
            logger.warning(f"stage {c.stage_index}: reading the replicas failed: {err!r}")
            outsiders = members
        if outsiders:
            logger.warning(f"stage {c.stage_index}: uncertified peers {sorted(outsiders)} joined the round; "
                           f"discarding it")
        return bool(outsiders)

    # ------------------------------------------------------------------ repairs
    async def download_from_any(self, candidates: list[StageRecord], timeout: Optional[float] = None,
                                keep_grads: bool = False) -> bool:
        """``download_from`` one of ``candidates`` (equally good sources) that answers a probe; False when none
        does. A frozen replica's record looks alive for up to its TTL, and a download from it would wait for the
        whole ``timeout``: with freezes overlapping, a replica that woke up spent 30 s and more that way."""
        order = random.sample(candidates, len(candidates))
        live = [r for r, ok in zip(order, await self.probe(order)) if ok]
        if not live:
            logger.info(f"stage {self.ctx.stage_index}: no replica to download the state from answers; trying again")
            return False
        return await self.download_from(live[0], timeout=timeout, keep_grads=keep_grads)

    async def download_from(self, peer: StageRecord, timeout: Optional[float] = None, keep_grads: bool = False) -> bool:
        """Copy parameters + optimizer state + step from ``peer``; each page bounded by ``timeout`` (default: the
        stage's ``state_page_timeout_s``).

        ``keep_grads``: keep the gradients accumulated toward the next step (a same-step repair); a download that
        changes the step drops them, since they belong to a step the replicas already took.
        """
        c, rt = self.ctx, self.ctx.runtime
        meta = {"run_id": c.manifest.run_id, "manifest_hash": c.manifest.hash, "stage": c.stage_index}
        timeout = c.state_page_timeout_s if timeout is None else timeout
        t0 = time.monotonic()
        try:
            reply, names, tensors = await fetch_state(c.p2p, peer.peer_id, c.manifest.run_id, meta, timeout)
        except RpcError as err:
            logger.warning(f"state download from {peer.peer_id[-8:]} failed: {err}")
            return False

        def load() -> None:
            rt.import_state(reply["step"], names, tensors, keep_grads=keep_grads)
            self.fallback_step = -1
            self._epoch += 1
            self._state_replaced()
            self._set_fingerprint()

        try:
            await c.run_compute(load)
        except ValueError as err:  # a malformed state must not replace ours
            logger.warning(f"state from {peer.peer_id[-8:]} refused: {err}")
            return False
        finally:
            reply = names = tensors = None  # drop our references (the closure holds them too)
            await c.run_io(trim_heap)  # the received copy is freed now
        self.resyncs += 1
        c.log_event("synced", source=peer.peer_id, step=rt.step, seconds=time.monotonic() - t0)
        logger.info(f"stage {c.stage_index}: loaded step {rt.step} from {peer.peer_id[-8:]} in "
                    f"{time.monotonic() - t0:.1f}s")
        return True

    def _set_fingerprint(self) -> None:
        """Compute thread only, right after the parameters changed, so record and parameters agree."""
        self.fingerprint = parameter_fingerprint(self.ctx.runtime.stage)
        self.fingerprint_step = self.ctx.runtime.step

    @property
    def fingerprint_valid(self) -> bool:
        return self.fingerprint_step == self.ctx.runtime.step

    def agrees_with(self, other: StageRecord) -> Optional[bool]:
        """Whether we hold the parameters of ``other``, a replica at our step: the same fingerprint, or parameter
        samples (``StageRecord.param_sample``) within ``averaging.agreement_tolerance`` of each other (relative
        distance). None when that cannot be told yet: a sample taken at another step (the record is a moment
        behind the parameters); the caller looks again at its next tick.

        Why a tolerance: replicas that apply one averaged update stay bit-identical only when their optimizer
        steps round alike; a replica on a GPU (other kernels, fused multiply-adds) or with a fused optimizer drifts
        from a CPU one by a few units in the last place per step, a random walk that stays far below the change of
        a single missed or extra step (docs/AVERAGING.md). Downloading the state at every such mismatch would never end.
        On agreement we announce ``other``'s fingerprint as ours: the replicas then claim one version, and
        SENTINEL keeps comparing their messages as it does for bit-identical replicas (they differ by rounding,
        within its audit tolerance)."""
        if other.fingerprint == self.fingerprint:
            return True
        averaging = self.ctx.manifest.averaging
        # Only schemes whose replicas apply one update have a tolerance (the others differ between rounds by design).
        tolerance = averaging.agreement_tolerance if averaging.scheme in ("full", "powersgd") else 0.0
        self.agreement_distance = None
        fingerprint = other.fingerprint  # announced as ours on agreement: a real number, whatever the record says
        if (tolerance <= 0 or not other.param_sample or isinstance(fingerprint, bool)
                or not isinstance(fingerprint, (int, float)) or not math.isfinite(fingerprint)):
            return False
        rt = self.ctx.runtime
        sample_step, sample = rt.parameter_sample
        if other.param_sample_step != rt.step or sample_step != rt.step or not self.fingerprint_valid:
            return None
        distance = sampled_relative_distance(sample, other.param_sample)
        if distance is None:
            return False
        self.agreement_distance = distance
        if distance > tolerance:
            return False
        if self._tolerated_step != rt.step:
            self.tolerated += 1
            self._tolerated_step = rt.step
            if distance > tolerance / 10:  # far above rounding (~1e-8): a small divergence we accept, said once
                logger.info(f"stage {self.ctx.stage_index}: parameters {distance:.2g} from replica "
                            f"{other.peer_id[-8:]} at step {rt.step}, within the agreement tolerance {tolerance:g}")
        self.agreement_max_distance = max(self.agreement_max_distance or 0.0, distance)
        self.fingerprint = float(fingerprint)
        return True

    async def initial_sync(self, timeout: Optional[float] = None, attempts: int = 5) -> bool:
        """Take the state of the freshest serving replica before serving; bounded by ``timeout`` (default:
        ``default_sync_timeout_s`` of the stage's state) and ``attempts``.

        True when in sync with the freshest replica (or when there is none: the first replica starts from the seed
        or its checkpoint). Replicas may step while we download, so we check again after each download. False when
        replicas exist but none delivered its state: the caller decides (a joining node still serves and resyncs
        later, a moving node goes back to its old stage).
        """
        rt = self.ctx.runtime
        timeout = default_sync_timeout_s(self.ctx.state_bytes) if timeout is None else timeout
        t0 = time.monotonic()
        deadline = t0 + timeout
        failures = 0
        while failures < attempts and time.monotonic() < deadline:
            serving = [r for r in await self.replicas() if r.state == PeerState.SERVING.value]
            if not serving:
                return True
            best = max(r.step for r in serving)
            freshest = [r for r in serving if r.step == best]
            known = [r for r in freshest if r.fingerprint]
            same_state = not known or (best == rt.step and any(self.agrees_with(r) for r in known))
            if best < rt.step or (best == rt.step and same_state):
                return True
            left = max(1.0, min(self.ctx.state_page_timeout_s, deadline - time.monotonic()))
            if await self.download_from_any(freshest, timeout=left):
                continue
            failures += 1
            await asyncio.sleep(0.5)
        logger.warning(f"stage {self.ctx.stage_index}: could not get the state of a replica ({failures} failed "
                       f"downloads in {time.monotonic() - t0:.0f}s); at step {rt.step}")
        return False

    # ------------------------------------------------------------------ one target batch per step
    def batch_open(self) -> bool:
        """Whether the stage may take another training microbatch toward its next step: what we accumulated, what
        we admitted that is still in flight here, and what the replicas at our step announced, stay below the
        target batch. Every microbatch passes every stage, so stages that each step once per target batch take the
        same number of steps (a slow all-reduce no longer folds several batches into one step)."""
        if self.stepping and not self.ctx.manifest.batch.overlap_rounds:
            return False  # the next step's forwards wait for this step's weights (batch.overlap_rounds)
        return self.ctx.runtime.samples + self.admitted + self.others_reserved < self.target

    def share(self) -> int:
        """This replica's share of the next step's batch, in samples (``batch_shares`` over the replicas around
        our step): replicas that each admit only their share cannot overshoot the batch together, which they
        would when each admits up to the target before the others' announcements reach it."""
        me = (self.ctx.peer_id, self.ctx.runtime.throughput)
        return batch_shares(self.target, self.ctx.manifest.batch.microbatch_size, [*self.share_peers, me])[me[0]]

    def within_share(self) -> bool:
        return self.ctx.runtime.samples + self.admitted < self.share()

    async def admit_training(self, samples: int, limit_s: float, first_attempt: bool = True) -> None:
        """Wait (up to ``limit_s``) until ``batch_open``, then count ``samples`` as admitted; the caller calls
        ``release`` when the microbatch is done, whatever happened. ``batch_full`` (retryable) after ``limit_s``.

        When the batch has room but this replica holds its share of it (``share``), a microbatch on its
        ``first_attempt`` is redirected (``over_share``: its sender tries another replica of the stage), and a
        retry waits up to ``SHARE_WAIT_S`` for the others' announcements to close the batch or for a step to open a
        new share; it is then taken whatever the share: the shares come from records that may be stale (a replica
        that just died keeps one until its record expires), and a share must never stall a stage or abandon work.
        The conditions are checked together on every pass, with nothing awaited between the last check and the
        count, so microbatches released together by a step still take only the share.
        """
        t0 = time.monotonic()
        over_share_since: Optional[float] = None
        logged = False
        while True:
            now = time.monotonic()
            if self.batch_open():
                if self.within_share():
                    break
                if first_attempt:
                    self.share_redirects += 1
                    raise RpcError(OVER_SHARE, f"this replica of stage {self.ctx.stage_index} holds its share "
                                               f"({self.share()} samples) of step {self.ctx.runtime.step + 1}'s batch")
                over_share_since = over_share_since or now
                if now - over_share_since > SHARE_WAIT_S:
                    self.share_overflows += 1
                    logger.info(f"stage {self.ctx.stage_index}: took a retried microbatch beyond this replica's "
                                f"share after {SHARE_WAIT_S:g}s (step {self.ctx.runtime.step + 1}: ours "
                                f"{self.ctx.runtime.samples} + {self.admitted} in flight, the others' "
                                f"{self.others_reserved}, share {self.share()} of {self.target} among "
                                f"{len(self.share_peers) + 1})")
                    break
            else:
                over_share_since = None
                if now - t0 > limit_s:
                    raise RpcError("batch_full", f"stage {self.ctx.stage_index} holds its whole target batch and has "
                                                 f"not taken step {self.ctx.runtime.step + 1} for {now - t0:.0f}s")
                if not logged and now - t0 > 5.0:
                    logged = True
                    logger.info(f"stage {self.ctx.stage_index}: holding a training microbatch until step "
                                f"{self.ctx.runtime.step + 1} is taken (the target batch is complete)")
            await asyncio.sleep(0.05)
        self.admitted += samples

    def release(self, samples: int) -> None:
        self.admitted = max(0, self.admitted - samples)

    def _note_replicas(self, recs: list[StageRecord]) -> None:
        """Remember what the replicas at our step (or one ahead: they applied the step we are still applying)
        accumulated toward the next step."""
        step = self.ctx.runtime.step
        serving = [r for r in recs if r.state == PeerState.SERVING.value]
        around = [r for r in serving if step <= r.step <= step + 1]
        self.others_samples = sum(r.samples for r in around)
        self.others_reserved = self.others_samples + sum(r.admitted for r in around)
        # A replica one step behind is about to join our step (it is averaging or just stepping): it has a share.
        self.share_peers = [(r.peer_id, r.throughput) for r in serving if step - 1 <= r.step <= step + 1]
        sample_step, sample = self.ctx.runtime.parameter_sample  # one read: the compute thread replaces the pair
        me = StageRecord(peer_id=self.ctx.peer_id, stage=self.ctx.stage_index, state=PeerState.SERVING.value,
                         manifest_hash=self.ctx.manifest.hash, param_sample_step=sample_step, param_sample=list(sample))
        distance = sampled_consensus_distance([me, *serving])
        if distance is not None:  # (kept otherwise: a moment without a replica at our step says nothing)
            self.consensus_distance = distance

    async def _watch_during_rounds(self) -> None:
        """While a round runs the tick loop waits for it: keep ``others_samples`` and our announced count fresh."""
        while True:
            await asyncio.sleep(1.0)
            if self.averaging_step == -1 or not self.ctx.is_serving():
                continue
            try:
                await self._announce_samples(min_interval_s=0.0)
                await self.replicas()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # the next second retries
                logger.debug(f"stage {self.ctx.stage_index}: watching replicas failed: {err!r}")

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        watcher = asyncio.create_task(self._watch_during_rounds(), name="round-watch")
        try:
            await self._loop()
        finally:
            watcher.cancel()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            try:
                async with self.lock:
                    if self.ctx.is_serving():
                        await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # keep the node alive; the next tick retries with fresh records
                logger.warning(f"stage {self.ctx.stage_index} sync tick failed: {err!r}", exc_info=True)

    async def _announce_samples(self, min_interval_s: float) -> None:
        """Publish our record when our sample count changed (at most every ``min_interval_s``): replicas decide
        when to step, and how much to admit, from each other's counts."""
        counts = (self.ctx.runtime.samples, self.admitted)
        if counts != self._announced_counts and time.monotonic() - self._announced_at > min_interval_s:
            self._announced_counts, self._announced_at = counts, time.monotonic()
            await self.ctx.announce()

    async def _step_when_ready(self, others_samples: int, n_others: int, others_admitted: int = 0) -> None:
        """Announce our sample count while it changes; step once the replicas at our step together hold the
        target batch (``others_samples`` + ours), or, with a partial batch, once the rest of it is lost
        (``_left_behind``; ``others_admitted``: what those replicas announced as in flight), or when no sample
        arrived for ``stall_step_s`` and no trainer is training any more."""
        c, rt = self.ctx, self.ctx.runtime
        await self._announce_samples(min_interval_s=0.5)
        total = rt.samples + others_samples
        if total >= self.target:
            await self.round(n_others)
        elif await self._left_behind(total, others_admitted):
            self.realigned_steps += 1
            logger.warning(f"stage {c.stage_index}: the other stages took step {rt.step + 1} while this stage holds "
                           f"{total} of its {self.target} samples, and no more came for "
                           f"{time.monotonic() - rt.last_sample_time:.0f}s: the rest left with a replica that moved or "
                           f"died; stepping on the partial batch to stay in step with them")
            c.log_event("realigned", step=rt.step, samples=total, target=self.target)
            await self.round(n_others)
        elif time.monotonic() - rt.last_sample_time > c.stall_step_s and not await self._trainers_training():
            # A partial batch is stepped only once no trainer is in its training loop (the end of a run, or every
            # trainer gone). While one trains, a stage that waits for samples is only waiting for a slower stage:
            # stepping then would give stages different step counts and batch sizes (docs/AVERAGING.md).
            await self.round(n_others, stalled=True)

    async def _left_behind(self, total: int, others_admitted: int) -> bool:
        """Whether the rest of our step's batch will never come: every other stage has published its gradient norm
        of our step (so has its whole batch), no sample came for ``LEFT_BEHIND_QUIET_S`` (``HELD_QUIET_S`` while
        microbatches are in flight here or at our replicas: the other stages may hold them for their next step),
        and that held at two looks ``LEFT_BEHIND_QUIET_S`` apart with the same ``total`` (ours and our replicas'
        samples): a replica's record lags its count by up to a second, and one look at a lagging record took a
        complete batch for a partial one (a sparse run of ``small``, 2026-12-04). Requiring nothing in flight, as
        before 2026-12-04, never fired once the lagging stage had admitted the next microbatches: a demo run then
        waited the whole clip wait at every step after a move (docs/bench/mixed/2026-12-04).

        Every microbatch of a stage's batch passed through this stage first (forward) and back (backward), and a
        stage counts a microbatch once its backward here finished. Samples counted elsewhere but not here were lost
        here: accumulated by a replica that moved away (a move drains in-flight work, not the accumulated
        gradient) or died. Waiting for them deadlocks: the other stages hold their next microbatches until they
        step, and they wait for this stage's norm (``GlobalClip``) for the whole clip wait, at every step from
        then on, since the lost samples shift this stage's batches against theirs for good. Stepping on the
        partial batch realigns the stages at the cost of a smaller batch once."""
        rt = self.ctx.runtime
        now = time.monotonic()
        in_flight = self.admitted or others_admitted
        if now - rt.last_sample_time < (self._held_quiet_s() if in_flight else LEFT_BEHIND_QUIET_S):
            self._left_behind_seen = None
            return False
        if now - self._left_behind_read_at < LEFT_BEHIND_QUIET_S:
            return False
        self._left_behind_read_at = now
        if not await self.clipper.others_reported(rt.step):
            self._left_behind_seen = None
            return False
        seen, self._left_behind_seen = self._left_behind_seen, (rt.step, total)
        return seen == (rt.step, total)

    def _held_quiet_s(self) -> float:
        """How long samples must have stopped coming, with microbatches in flight, before they count as held by the
        other stages (``HELD_QUIET_S``, or three microbatches' compute at this stage's measured throughput)."""
        m, rt = self.ctx.manifest, self.ctx.runtime
        tokens = m.batch.microbatch_size * m.model.seq_len
        return max(HELD_QUIET_S, 3 * tokens / rt.throughput) if rt.throughput > 0 else HELD_QUIET_S

    async def _own_gradient_tick(self, others: list[StageRecord], ahead: list[StageRecord], why: str) -> None:
        """The tick of schemes whose replicas step on their own gradients (``sparse``, ``diloco``): download the
        freshest of ``ahead`` (replicas too far ahead to meet again; ``why`` says how, for the log); else follow a
        replica that took the step we are still collecting for; else step once the replicas at our step together
        hold the target batch (``others``: the serving, unbanned replicas)."""
        rt = self.ctx.runtime
        if ahead:
            best = max(r.step for r in ahead)
            logger.info(f"stage {self.ctx.stage_index}: replica at step {best} {why} (we are at {rt.step}); "
                        f"resyncing")
            await self.download_from_any([r for r in ahead if r.step == best])
            return
        if any(r.step > rt.step for r in others):
            await self.round(0)  # the stage took this step: follow on our own gradients
            return
        if rt.samples == 0:
            return
        same = [r for r in others if r.step == rt.step]
        await self._step_when_ready(sum(r.samples for r in same), n_others=0,
                                    others_admitted=sum(r.admitted for r in same))

    async def _trainers_training(self) -> bool:
        """Whether a live trainer of the run is in its training loop (read at most every 2 s; True if unreadable)."""
        c, m = self.ctx, self.ctx.manifest
        if time.monotonic() - self._trainers_read_at > 2.0:
            self._trainers_read_at = time.monotonic()
            try:
                self._trainers = await c.run_io(trainers_training, c.dht, m.run_id, m.hash)
            except Exception as err:  # keep waiting: a wrong partial step is worse than a late one
                logger.debug(f"reading the trainers failed: {err!r}")
                self._trainers = 1
        return self._trainers > 0

    def expected_group_size(self) -> int:
        """The most replicas a round can hold: us and every other replica of the stage in the records at the last
        read, whatever its state or step. An upper bound on purpose: a group that reaches it starts its all-reduce
        at once, and one set too low would leave a replica that joins out of the group (``set_target_group_size``).
        Replicas that do not join (behind, syncing, dead but not yet expired) only cost the rest of the matchmaking
        time, as every round did before."""
        return 1 + len(self.replica_ids)

    async def _start_round(self, weight: float, gather: dict) -> Any:
        """Start a hivemind round with our buffers (already loaded); returns its StepControl."""
        timeout = self.ctx.averaging_timeout_s
        averager, size = self.round_averager(), self.expected_group_size()

        def start() -> Any:
            averager.set_target_group_size(max(2, size))  # a lone replica's round still needs a partner
            return averager.step(weight=max(float(weight), ZERO_SAMPLE_WEIGHT), gather=gather, timeout=timeout,
                                 allow_retries=True, wait=False)

        return await self.ctx.run_io(start)

    async def _average(self, samples: int, grads: list[torch.Tensor]) -> Optional[dict]:
        """One averaging round with the replicas at our step; None if it failed or was given up."""
        step = self.ctx.runtime.step
        if self.averager_busy():
            logger.warning(f"stage {self.ctx.stage_index}: the all-reduce of a round we left is still running; "
                           f"step {step + 1} is taken without averaging")
            return None
        await self.ctx.run_compute(self._load_buffers, grads, step)
        gather = {"step": step, "samples": samples}
        frames = self.ctx.runtime.frames
        if frames is not None:  # UPM: gradients of replicas in other frames must not be averaged (``_untrusted``)
            gather["frame"] = [frames.epoch_in, frames.epoch_out]
        self.control = await self._start_round(samples, gather)
        try:
            return await self._await_round(self.control, step, self.ctx.averaging_timeout_s)
        finally:
            self.control = None

    async def _await_round(self, control, step: Optional[int], timeout: float,
                           alive: Optional[Callable[[], Awaitable[bool]]] = None) -> Optional[dict]:
        """Wait for hivemind's round; gathered metadata by peer, or None. With ``step``, give up early once no
        replica that could join the round for ``step`` is left; with ``alive``, once it says the partners are gone
        (a pairwise exchange knows its one partner). Without either only the timeout ends a round."""
        stage = self.ctx.stage_index
        # Hard bound: matchmaking (timeout) + one all-reduce (allreduce_timeout) + slack. hivemind enforces both;
        # this only guards against a wedged averager process.
        hard_deadline = time.monotonic() + 2 * timeout + 10.0
        next_check = time.monotonic() + 2.0
        began_at: Optional[float] = None
        strikes = 0  # probes in a row during the all-reduce that a partner did not answer
        while not control.done():
            await asyncio.sleep(0.1)
            now = time.monotonic()
            if now > hard_deadline:
                logger.warning(f"stage {stage}: averaging did not finish within {2 * timeout + 10:.0f}s")
                control.cancel()
                return None
            if control.began_allreduce and began_at is None:
                began_at = now
            if began_at is not None and step is not None and now > next_check \
                    and now - began_at > self._allreduce_probe_after():
                next_check = now + 1.0
                partners = await self._round_partners(step)
                if not partners:
                    continue
                last = strikes + 1 >= ALLREDUCE_PROBE_STRIKES
                if all(await self.probe(partners, self._allreduce_probe_timeout() * 2 ** strikes, mark=last)):
                    strikes = 0
                elif not last:
                    strikes += 1  # a probe queued behind a saturated link is late too: ask again, waiting longer
                else:
                    # A member froze mid-all-reduce: hivemind would hold us for its sender + reducer timeouts and
                    # then average only part of the vector anyway. Our side leaves; the averager finishes the round
                    # in the background (``averager_busy``) and the replicas' states are repaired by a download.
                    self._left_control = control
                    self.left_rounds += 1
                    logger.warning(f"stage {stage}: a replica stopped answering during the all-reduce of step "
                                   f"{step} ({time.monotonic() - began_at:.1f}s); leaving the round")
                    return None
            if (step is not None or alive is not None) and now > next_check and not control.began_allreduce:
                next_check = now + 1.0
                if not await (alive() if alive is not None else self._partners_left(step)):
                    # Everyone we could average with is gone (records expired: crashed, or moved on without us):
                    # waiting for the matchmaking timeout would only stall this stage.
                    control.cancel()
                    self.aborted_rounds += 1
                    logger.warning(f"stage {stage}: no replica left for the round of step {step}; going on without")
                    return None
        try:
            result = control.result(timeout=0)
        except BaseException as err:  # hivemind raises when no group formed; a failed round, not a crash
            logger.warning(f"stage {stage}: averaging failed: {err!r}")
            return None
        if began_at is not None:
            took = time.monotonic() - began_at
            self.typical_allreduce_s = took if self.typical_allreduce_s is None \
                else 0.8 * self.typical_allreduce_s + 0.2 * took
        return result

    def _allreduce_probe_timeout(self) -> float:
        """How long a partner has to answer a probe while the all-reduce runs. The probe queues behind the round's
        own bulk transfer on the same connection (and the partner's reply behind its): on a capped link that takes
        up to about a typical all-reduce, and a 2 s probe then took live partners for frozen ones (4 of 52 rounds
        left for nothing at 20 Mbit/s in ``agora bench convergence``)."""
        return max(PROBE_TIMEOUT_S, self.typical_allreduce_s or 0.0)

    def _allreduce_probe_after(self) -> float:
        """Seconds into an all-reduce after which its partners are probed."""
        typical = self.typical_allreduce_s or 0.0
        return max(ALLREDUCE_PROBE_MIN_S, ALLREDUCE_PROBE_FACTOR * typical)

    async def _group_average(self, samples: int, grads: list[torch.Tensor], n_others: int) -> tuple[Optional[list], int]:
        """Average with ``n_others`` replicas: (the averaged update or None if the round failed, group size)."""
        c = self.ctx
        self.averaging_step = c.runtime.step
        sent_before = self.bytes_sent
        partial_before = self.partial_count()
        try:
            await c.announce()  # tells replicas to join now, instead of when their own counts catch up
            result = await self._average(samples, grads)
        except Exception as err:  # e.g. the DHT failed the announce: a failed round, handled below
            logger.warning(f"stage {c.stage_index}: averaging round raised {err!r}")
            result = None
        finally:
            self.averaging_step = -1
        if result is not None and self.partial_count() > partial_before:
            # Parts of our average are our own values (a reducer did not answer in time); the replicas that got
            # every part applied the true average. A failed round: the repair then adopts one of their states.
            self.partial_rounds += 1
            logger.warning(f"stage {c.stage_index}: the all-reduce of step {c.runtime.step} finished with part of "
                           f"the average missing; counted as a failed round")
            result = None
        if result is not None and await self._untrusted(result):
            result = None
        if result is None:
            self.rounds_failed += 1
            logger.warning(f"stage {c.stage_index}: all-reduce with {n_others} replicas failed; stepping locally")
            return None, 1
        steps = {g.get("step") for g in result.values() if isinstance(g, dict)}
        if len(steps) > 1:
            logger.warning(f"stage {c.stage_index}: averaged with replicas at steps {sorted(steps)}")
        averaged = await c.run_compute(self._averaged)
        self.rounds_ok += 1
        self.round_bytes.append(self.bytes_sent - sent_before)
        return averaged, len(result)

    async def round(self, n_others: int, stalled: bool = False) -> None:
        """Take this replica's next step: averaged with ``n_others`` replicas at our step, or on our own."""
        self.stepping = True
        try:
            await self._round(n_others, stalled)
        finally:
            self.stepping = False
            # A round that failed between taking the gradients and the step leaves no step pending (the runtime
            # clears it when the step is applied): the next forwards are not one step late.
            self.ctx.runtime.step_pending = False

    async def _round(self, n_others: int, stalled: bool) -> None:
        c, rt = self.ctx, self.ctx.runtime
        t0 = time.monotonic()
        samples, grads = await c.run_compute(rt.take_gradients, self.gradient_dtype)
        t_taken = time.monotonic()
        averaged, group = await self._group_average(samples, grads, n_others) if n_others > 0 else (None, 1)
        local = averaged is None
        if local:
            averaged = await c.run_compute(self._not_averaged, grads, n_others == 0)
        if self.tied is not None:  # the other end's gradient of a tied embedding joins ours
            averaged = await self.tied.offer_and_fetch(rt.step, averaged)
        t_averaged = time.monotonic()
        inactive = {id(p) for p in rt.stage.inactive_parameters()}  # bypassed blocks: no gradient, no norm
        positions = [i for i, p in enumerate(rt.stage.parameters()) if id(p) in inactive]
        scale = await self.clipper.scale(rt.step, averaged, positions)  # the global clipping factor (None: our own)
        hold = await self.warmup_brake.hold(rt.step)
        t_clipped = time.monotonic()

        def step() -> None:
            rt.apply_step([g.float() for g in averaged], clip_scale=scale, hold_warmup=hold)
            self._set_fingerprint()
            self._after_step()

        self._before_step(samples)
        await c.run_compute(step)
        if local:  # counted once the step is applied: a scrape never sees more local steps than steps
            self.local_steps += 1
        self.fallback_step = rt.step if local and n_others > 0 else -1
        self._step_taken()
        dt = time.monotonic() - t0
        # Where a round's time went: waiting for the compute thread to hand over the gradients, the group's
        # all-reduce (matchmaking included), the stages' global norm (clipping) and the step itself.
        phases = {"take_s": t_taken - t0, "average_s": t_averaged - t_taken, "clip_s": t_clipped - t_averaged,
                  "step_s": time.monotonic() - t_clipped}
        c.observers.emit("round", n_others == 0 or group > 1, dt, group)
        c.log_event("step", step=rt.step, samples=samples, group=group, seconds=dt, stalled=stalled,
                    **{k: round(v, 3) for k, v in phases.items()})
        logger.info(f"stage {c.stage_index}: step {rt.step} ({samples} local samples, group of {group}, {dt:.2f}s: "
                    + ", ".join(f"{k[:-2]} {v:.2f}" for k, v in phases.items()) + ")")
        await self.warmup_brake.publish()
        await c.announce()

    def _before_step(self, samples: int) -> None:
        """A scheme's hook, on the event loop: this replica's next step takes ``samples`` local samples."""

    def _step_taken(self) -> None:
        """A scheme's hook, on the event loop right after a step was applied."""
