"""A stage server: one peer holding one pipeline stage, serving recursive forward-backward calls.

Threads and loops: the asyncio loop (this process's main thread) does all networking and DHT traffic; one
compute thread runs every forward, backward and optimizer step, so the stage's parameters are only ever touched
from one thread and an optimizer step can never interleave with half a backward.

The data path is stage to stage: the trainer calls a head peer with token ids; each stage computes its forward,
calls a peer of the next stage with the compressed boundary, receives the gradient of its output, runs its
backward and returns the gradient of its input. Activations never return through the trainer.

Optimizer steps vs microbatches in flight: a microbatch keeps its autograd graph while downstream stages work.
The forward runs on a snapshot of the weights of the current parameter version (one snapshot per version,
shared by its microbatches), so a step taken in between changes neither the graph nor the function its backward
differentiates; the gradient is then moved to the live parameters. ``version`` counts every change of the
parameters (steps and state imports alike) and decides when a new snapshot is taken.

Lifecycle: joining -> syncing -> serving -> leaving, announced in the DHT with a short expiry. A graceful leave
(SIGTERM/SIGINT, or ``stop()``) stops taking work, drains in-flight microbatches up to a deadline, announces
``leaving`` and shuts the averager down; a killed peer simply stops refreshing its record, and callers route around
it at once through failed calls (bans). A serving peer may also move to another stage when that lifts the swarm's
bottleneck (``routing.plan_rebalance``): it leaves its stage the same way, rebuilds stage, optimizer and averager for
the new one, downloads the state of a replica there (going back to its old stage if that fails) and serves again.
One peer moves at a time: the plan names a single mover, and a DHT lock with expiry covers differing views.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from hivemind import DHT
from hivemind.p2p import PeerID

from agora.config import Manifest
from agora.model import Stage
from agora.optim import build_optimizer, set_lr
from agora.net import transport
from agora.net.records import (
    ANNOUNCE_PERIOD_S,
    PeerState,
    StageRecord,
    acks_key,
    bans_key,
    announce,
    read_stage,
    read_subkeys,
    read_swarm,
    stage_key,
)
from agora.net.routing import BanList, Move, pick_peer_or_fallback, plan_rebalance
from agora.trust.ratelimit import RateLimiter
from agora.sentinel import AUDIT_RATE, SentinelConfig, SentinelMonitor, node_config, version_key
from agora.net.members import RunMembers
from agora.net.protocol import BANNABLE, FWD_BWD, GET_STATE, INFO, RETRYABLE
from agora.net.transport import RpcError, TransferStats
from agora.wire import WIRE_DTYPES, Boundary, compress, decompress

logger = logging.getLogger("agora.node")

MAX_AUDITS = 3  # SENTINEL audits in flight at once (each costs one or two recomputations by other replicas)
MOVE_LOCK_TTL_S = 90.0  # a mover that dies mid-move blocks other moves at most this long


def moves_key(run_id: str) -> str:
    """DHT key of the stage-move lock: one subkey per peer that claims (or released) the right to move."""
    return f"{run_id}_moving"


@dataclass
class NodeOptions:
    # SENTINEL monitoring of received activations/gradients, with audits and bans (`agora node --sentinel`). Off by
    # default: it costs CPU per message, audits recompute ``audit_rate`` of the messages on other replicas (overhead
    # not benchmarked yet), and its statistics, which alone decide for a middle stage's messages, drop honest
    # messages early in training (tests/test_security_live.py).
    sentinel: bool = False
    sentinel_log: Optional[str] = None  # JSONL file: one line per message SENTINEL judged (the evidence behind bans)
    # With SENTINEL: the share of accepted messages that other replicas of the sender's stage recompute (flagged ones
    # always; ``SentinelMonitor.recomputed``), where they can: activations of the first stage, gradients of the last.
    # Catches corruption no statistic sees, for this much extra compute. A middle stage's messages would need its
    # whole chain: not audited.
    audit_rate: float = AUDIT_RATE
    rate_limit_per_s: float = 200.0  # fwd_bwd calls per second per caller (burst = 2x)
    hop_timeout_s: float = 30.0  # one stage's compute + its downstream chain, scaled by the stages left
    max_retries: int = 3
    wait_for_peers_s: float = 60.0  # how long a hop waits for an empty next stage before giving up
    ban_s: float = 15.0
    averaging_timeout_s: float = 20.0
    stall_step_s: float = 10.0  # step with what we have if no new samples arrived for this long
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    drain_timeout_s: float = 20.0
    threads: Optional[int] = None
    sync_timeout_s: float = 120.0  # a joining/moving peer's state download, all attempts together
    # Rebalancing (0: off; `agora node` turns it on): every ~N s a serving peer checks whether moving one peer to
    # the bottleneck stage lifts throughput by >= min_move_gain, not before rebalance_dwell_s after it started
    # serving or last moved (measurements of a fresh stage need time to settle).
    rebalance_every_s: float = 0.0
    rebalance_dwell_s: float = 30.0
    min_move_gain: float = 1.3


@dataclass
class Counters:
    """Microbatch accounting of this peer (exported in the DHT record and /metrics)."""

    forward: int = 0
    backward: int = 0
    eval: int = 0
    tokens: int = 0
    retried: int = 0
    failed: int = 0
    rejected: int = 0
    busy_s: float = 0.0
    # Staleness: optimizer steps this stage took between a microbatch's forward and its backward (its gradient is
    # applied at the next step after that). Sum and count give the mean; the max bounds the pipeline's delay.
    staleness_sum: int = 0
    staleness_max: int = 0
    rejected_by_code: dict[str, int] = field(default_factory=dict)


@dataclass
class _Pending:
    """What a microbatch left on this stage between its forward and its backward."""

    tokens: torch.Tensor
    leaf: Optional[torch.Tensor]
    out: torch.Tensor
    step: int
    generation: int = 0  # the node's stage generation: a microbatch of a stage the node left is refused
    fwd_s: float = 0.0  # compute seconds of the forward (throughput counts forward + backward per microbatch)
    weights: Optional[dict] = None  # the stashed parameter snapshot the forward ran on (see StageNode._stashed)
    version: Optional[list] = None  # ``sent_version`` of the weights the forward ran on (read on the compute thread)


def _targets(tokens: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Next-token targets of a microbatch: its tokens shifted by one, then each sequence's following token."""
    return torch.cat([tokens[:, 1:], last[:, None]], dim=1)


def _log_task_error(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning(f"{task.get_name()} failed: {task.exception()!r}")


class StageNode:
    def __init__(self, manifest: Manifest, stage: int, dht: DHT, options: Optional[NodeOptions] = None):
        self.manifest = manifest
        self.stage_index = stage
        self.dht = dht
        self.opts = options or NodeOptions()
        self.peer_id = str(dht.peer_id)
        self.state = PeerState.JOINING
        self.stage = Stage(manifest, stage)
        self.is_head, self.is_tail = self.stage.spec.is_head, self.stage.spec.is_tail
        self.optimizer = build_optimizer(self.stage, manifest.optimizer)
        self.step = 0
        self.version = 0  # bumped whenever the parameters change (optimizer step, state import, stage move)
        self.generation = 0  # bumped on every stage move
        self.moves = 0
        self.previous_stages: list[int] = []
        self.samples = 0  # samples whose gradients sit in .grad, waiting for the next step
        self.last_sample_time = time.monotonic()
        self.counters = Counters()
        self.stats_in = TransferStats()  # requests from upstream, replies to it
        self.stats_out = TransferStats()  # requests to downstream, replies from it
        self.throughput = 0.0  # tokens/s of compute, EMA
        self.inflight = 0
        self.loss_ema = float("nan")
        self.bans = BanList(self.opts.ban_s)
        self.next_records: list[StageRecord] = []
        self.sync = None  # set by start(): ReplicaSync
        self._compute = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"stage{stage}-compute")
        self._io = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix=f"stage{stage}-dht")
        self._queue = 0
        self._p2p = None
        self._tasks: list[asyncio.Task] = []
        self._audits: set[asyncio.Task] = set()  # SENTINEL audits in flight (see _start_audit)
        self._prev_records: list[StageRecord] = []  # stage 0's records, for audits of activations (stage 1 only)
        self._prev_records_at = 0.0
        self._sync_task: Optional[asyncio.Task] = None
        self._syncs: list = []  # every ReplicaSync this node created: all are shut down on stop
        self._serving_since = time.monotonic()
        self._stopping = False
        self._lock_claimed = False
        self.events: list[dict] = []
        self._wire_dtype = WIRE_DTYPES[manifest.residual.wire_dtype]
        # Observers (e.g. Prometheus metrics) get (kind, seconds, tokens) for every forward/backward: no metrics
        # code in the hot path, and a node without metrics pays nothing.
        self.compute_observers: list = []
        # Receiver-side acknowledgements: how many results each downstream peer delivered to us. Published in the
        # DHT under our own id, so a peer's acknowledged work is vouched for by others, never by itself.
        self.acks: dict[str, int] = {}
        # Weight stashing: forwards of one parameter version share one snapshot of the weights, so a backward that
        # arrives after an optimizer step still differentiates exactly the function its forward computed (no
        # recompute, no autograd version error). Old snapshots die with the last microbatch that holds them.
        self._stash_version = -1
        self._stash_weights: Optional[dict] = None
        # SENTINEL: statistics of what each upstream sender (activations) and downstream peer (gradients) sends us;
        # corrupted senders are banned: their messages dropped, routing avoids them, the ban is published.
        self.sentinel = SentinelMonitor(self._sentinel_config()) if self.opts.sentinel else None
        self.limiter = RateLimiter(rate=self.opts.rate_limit_per_s, burst=2 * self.opts.rate_limit_per_s)
        # Allow-listed runs: only callers holding a certified record of the run are served (see credentials.py).
        self.members = RunMembers(manifest) if manifest.security.allow_list else None
        self._members_lock = asyncio.Lock()
        if self.opts.threads:
            torch.set_num_threads(self.opts.threads)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._p2p = await self.dht.replicate_p2p()
        ns = self.manifest.run_id
        await transport.add_handler(self._p2p, ns, FWD_BWD, self._handle_fwd_bwd, stats=self.stats_in)
        await transport.add_handler(self._p2p, ns, GET_STATE, self._handle_get_state)
        await transport.add_handler(self._p2p, ns, INFO, self._handle_info)
        self._tasks.append(asyncio.create_task(self._announce_loop(), name="announce"))
        self._tasks.append(asyncio.create_task(self._refresh_next_loop(), name="refresh-next"))
        await self._join_stage()
        if self.opts.rebalance_every_s > 0:
            self._tasks.append(asyncio.create_task(self._rebalance_loop(), name="rebalance"))

    async def _join_stage(self, require_state: bool = False) -> bool:
        """syncing -> serving in ``self.stage_index``: averager up, state of the freshest replica, sync loop on.

        With ``require_state`` (a move), a failed download returns False before serving, so the caller can go back.
        """
        from agora.server.averaging.sync import ReplicaSync

        self.state = PeerState.SYNCING
        self.sync = ReplicaSync(self)
        self._syncs.append(self.sync)
        await self.announce()
        synced = await self.sync.initial_sync(timeout=self.opts.sync_timeout_s)
        if not synced and require_state:
            return False
        await self._refresh_next()  # know the next stage before the first request needs it
        self.state = PeerState.SERVING
        self._serving_since = time.monotonic()
        await self.announce()
        self._sync_task = asyncio.create_task(self.sync.run(), name="replica-sync")
        logger.info(f"stage {self.stage_index} peer {self.peer_id[-8:]} serving at step {self.step}")
        return True

    async def _stop_sync(self) -> None:
        """Stop the replica sync loop between two ticks (never inside a round) and shut its averager down."""
        sync, task = self.sync, self._sync_task
        if task is not None:
            async with sync.lock:
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self._sync_task = None
        if sync is not None:
            await self.run_io(sync.shutdown)

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.opts.drain_timeout_s
        if self.inflight:
            logger.info(f"leaving: waiting for {self.inflight} microbatches in flight")
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.inflight:
            logger.warning(f"leaving with {self.inflight} microbatches still in flight after "
                           f"{self.opts.drain_timeout_s:.0f}s")

    async def stop(self) -> None:
        """Graceful leave: stop taking work, finish in-flight microbatches up to a deadline, announce, checkpoint."""
        self._stopping = True
        self.state = PeerState.LEAVING
        try:
            await self.announce()
        except Exception as err:  # the DHT may already be gone; leaving must still finish
            logger.warning(f"could not announce leaving: {err!r}")
        await self._drain()
        tasks = [*self._tasks, *self._audits, *([self._sync_task] if self._sync_task else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._lock_claimed:
            await self._release_move_lock()
        for sync in self._syncs:
            sync.shutdown()
        if self.opts.checkpoint_dir:
            await self.run_compute(self.save_checkpoint)
        self._compute.shutdown(wait=True)
        self._io.shutdown(wait=False)

    async def run_compute(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    async def run_io(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    # ------------------------------------------------------------------ DHT announcements
    def record(self) -> StageRecord:
        c = self.counters
        return StageRecord(
            peer_id=self.peer_id,
            stage=self.stage_index,
            state=self.state.value,
            manifest_hash=self.manifest.hash,
            throughput=self.throughput,
            queue=self._queue,
            step=self.step,
            samples=self.samples,
            fingerprint=self.sync.fingerprint if self.sync and self.sync.fingerprint_valid else 0.0,
            averaging_step=self.sync.averaging_step if self.sync else -1,
            metrics={
                "forward": c.forward, "backward": c.backward, "tokens": c.tokens, "retried": c.retried,
                "failed": c.failed, "rejected": c.rejected, "loss": self.loss_ema,
                "bytes_out": self.stats_out.payload_bytes_sent, "bytes_in": self.stats_in.payload_bytes_received,
                "busy_s": c.busy_s, "moves": self.moves,
            },
        )

    async def announce(self) -> None:
        rec = self.record().to_value()
        await self.run_io(announce, self.dht, stage_key(self.manifest.run_id, self.stage_index), self.peer_id, rec)
        if self.acks:
            acks = {"manifest_hash": self.manifest.hash, "acks": dict(self.acks)}
            await self.run_io(announce, self.dht, acks_key(self.manifest.run_id), self.peer_id, acks)
        banned = self.banned_peers()
        if banned:
            value = {"manifest_hash": self.manifest.hash, "banned": sorted(banned)}
            await self.run_io(announce, self.dht, bans_key(self.manifest.run_id), self.peer_id, value)

    async def _announce_loop(self) -> None:
        while True:
            try:
                await self.announce()
            except Exception as err:  # a DHT hiccup must not kill the node; the record just ages
                logger.warning(f"announce failed: {err!r}")
            await asyncio.sleep(ANNOUNCE_PERIOD_S)

    async def _refresh_next_loop(self) -> None:
        """Keep the next stage's records fresh off the hot path (one DHT read a second at most)."""
        while True:
            await self._refresh_next()
            await asyncio.sleep(1.0)

    async def _refresh_next(self) -> None:
        if self.is_tail:
            return
        nxt = self.stage_index + 1
        try:
            records = await self.run_io(read_stage, self.dht, self.manifest.run_id, nxt, self.manifest.hash)
            if nxt == self.stage_index + 1:  # not moved meanwhile
                self.next_records = records
        except Exception as err:
            logger.warning(f"reading stage {nxt} records failed: {err!r}")

    # ------------------------------------------------------------------ rebalancing
    async def _rebalance_loop(self) -> None:
        while True:
            period = self.opts.rebalance_every_s
            await asyncio.sleep(period * random.uniform(0.75, 1.25) if period > 0 else 1.0)
            if self.opts.rebalance_every_s <= 0 or self.state != PeerState.SERVING or self._stopping:
                continue  # (read again after the sleep: rebalancing can be switched off at run time)
            if time.monotonic() - self._serving_since < self.opts.rebalance_dwell_s:
                continue
            try:
                await self.maybe_move()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # a failed attempt leaves the node serving where it was
                logger.warning(f"rebalancing failed: {err!r}", exc_info=True)

    async def maybe_move(self) -> Optional[Move]:
        """Move to another stage if the swarm-wide plan names this peer as the mover; returns the move made."""
        m = self.manifest
        swarm = await self.run_io(read_swarm, self.dht, m.run_id, m.n_stages, m.hash)
        plan = plan_rebalance(swarm, self.opts.min_move_gain)
        if plan is None or plan[0] != self.peer_id or plan[1].from_stage != self.stage_index:
            return None
        move = plan[1]
        if not await self._claim_move_lock(move):
            return None
        try:
            logger.info(f"rebalancing: moving from stage {move.from_stage} to {move.to_stage} "
                        f"(bottleneck x{move.gain:.2f})")
            moved = await self.move_to(move.to_stage)
        finally:
            await self._release_move_lock()
        return move if moved else None

    def _move_claims(self) -> list[str]:
        """Peers (other than us) holding the move lock of this run and manifest (io thread)."""
        entries = read_subkeys(self.dht, moves_key(self.manifest.run_id))
        return sorted(
            sub for sub, v in entries.items()
            if sub != self.peer_id and isinstance(v, dict) and v.get("manifest_hash") == self.manifest.hash
            and not v.get("released")
        )

    async def _claim_move_lock(self, move: Move) -> bool:
        if await self.run_io(self._move_claims):
            return False
        value = {"manifest_hash": self.manifest.hash, "from": move.from_stage, "to": move.to_stage, "released": False}
        await self.run_io(announce, self.dht, moves_key(self.manifest.run_id), self.peer_id, value, MOVE_LOCK_TTL_S)
        self._lock_claimed = True
        await asyncio.sleep(1.0)  # a concurrent claim (a differing view of the swarm) lands meanwhile
        rivals = await self.run_io(self._move_claims)
        if any(r < self.peer_id for r in rivals):
            await self._release_move_lock()
            return False
        return True

    async def _release_move_lock(self) -> None:
        # A later expiration replaces the claim (hivemind keeps the value that expires last for a subkey).
        value = {"manifest_hash": self.manifest.hash, "released": True}
        try:
            await self.run_io(announce, self.dht, moves_key(self.manifest.run_id), self.peer_id, value,
                              MOVE_LOCK_TTL_S + 1.0)
        except Exception as err:  # the claim then just expires
            logger.warning(f"could not release the move lock: {err!r}")
        self._lock_claimed = False

    async def move_to(self, new_stage: int) -> bool:
        """Serve ``new_stage`` instead of the current one; True if the node serves the new stage afterwards.

        Leave cleanly (announce leaving, drain, stop the averager between rounds), rebuild stage, optimizer and
        replica sync, take the state of a replica of the new stage, serve. If that state cannot be had, go back
        to the old stage with the old modules (kept aside untouched) and resync there.
        """
        old_stage, t0 = self.stage_index, time.monotonic()
        if new_stage == old_stage or not 0 <= new_stage < self.manifest.n_stages:
            raise ValueError(f"cannot move from stage {old_stage} to {new_stage}")
        self.state = PeerState.LEAVING
        await self.announce()
        await self._drain()
        await self._stop_sync()
        kept = (self.stage, self.optimizer, self.step)
        await self.run_compute(self._switch_stage, new_stage, None)
        if await self._join_stage(require_state=True):
            self.moves += 1
            self.log_event("moved", from_stage=old_stage, to_stage=new_stage, step=self.step,
                           seconds=time.monotonic() - t0)
            logger.info(f"moved from stage {old_stage} to {new_stage} in {time.monotonic() - t0:.1f}s")
            return True
        logger.warning(f"could not get the state of stage {new_stage}; going back to stage {old_stage}")
        self.state = PeerState.LEAVING
        await self.announce()
        await self._stop_sync()
        await self.run_compute(self._switch_stage, old_stage, kept)
        await self._join_stage()
        self.log_event("move_failed", from_stage=old_stage, to_stage=new_stage, seconds=time.monotonic() - t0)
        return False

    def _switch_stage(self, stage: int, kept: Optional[tuple]) -> None:
        """Compute thread: swap the served stage, so no forward/backward ever sees half of each."""
        self.previous_stages = [s for s in self.previous_stages if s != stage][-3:] + [self.stage_index]
        self.generation += 1
        self.version += 1
        if kept is None:
            self.stage = Stage(self.manifest, stage)
            self.optimizer = build_optimizer(self.stage, self.manifest.optimizer)
            self.step = 0
        else:
            self.stage, self.optimizer, self.step = kept
            for p in self.stage.parameters():
                p.grad = None
        self.stage_index = stage
        self.is_head, self.is_tail = self.stage.spec.is_head, self.stage.spec.is_tail
        self.samples = 0
        self.throughput = 0.0  # measured on another stage: says nothing about this one
        self.loss_ema = float("nan")
        self.next_records = []
        if self.sentinel is not None:  # which directions can be audited depends on the stage
            self.sentinel.cfg = self._sentinel_config()
        set_lr(self.optimizer, self.manifest.optimizer, self.step)

    # ------------------------------------------------------------------ validation
    def _reject(self, code: str, message: str) -> RpcError:
        self.counters.rejected += 1
        self.counters.rejected_by_code[code] = self.counters.rejected_by_code.get(code, 0) + 1
        return RpcError(code, message)

    def _validate(self, meta: dict, tensors: list[torch.Tensor]) -> None:
        m = self.manifest
        if meta.get("run_id") != m.run_id:
            raise self._reject("wrong_run", f"this peer serves run {m.run_id!r}, not {meta.get('run_id')!r}")
        if meta.get("manifest_hash") != m.hash:
            raise self._reject(
                "manifest_mismatch", f"manifest hash {meta.get('manifest_hash')} != this peer's {m.hash}"
            )
        if meta.get("stage") != self.stage_index:
            if meta.get("stage") in self.previous_stages:  # a caller still routes by our record before a move
                raise RpcError("leaving", f"this peer moved to stage {self.stage_index}")
            raise self._reject("wrong_stage", f"this peer serves stage {self.stage_index}, not {meta.get('stage')}")
        if self.state != PeerState.SERVING:
            raise RpcError("leaving" if self.state == PeerState.LEAVING else "not_serving", f"peer is {self.state.value}")
        expected = 2 if self.is_head else 3
        if len(tensors) != expected:
            raise self._reject("shape_mismatch", f"expected {expected} tensors, got {len(tensors)}")
        tokens, last = tensors[-2], tensors[-1]
        if tokens.dtype != torch.int32 or last.dtype != torch.int32:
            raise self._reject("dtype_mismatch", f"token ids must be int32, got {tokens.dtype} and {last.dtype}")
        if tokens.dim() != 2 or tokens.shape[1] > m.model.seq_len or tokens.shape[0] == 0:
            raise self._reject(
                "shape_mismatch", f"tokens must be [batch, <= {m.model.seq_len}], got {tuple(tokens.shape)}"
            )
        if tokens.shape[0] > 4 * m.batch.target_batch_size:
            raise self._reject("too_large", f"microbatch of {tokens.shape[0]} sequences is larger than allowed")
        if last.shape != (tokens.shape[0],):
            raise self._reject("shape_mismatch", f"last-token ids must be [{tokens.shape[0]}], got {tuple(last.shape)}")
        v = m.model.vocab_size
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= v or int(last.min()) < 0 or int(last.max()) >= v):
            raise self._reject("bad_token", f"token ids must be in [0, {v})")
        if not self.is_head:
            coords = tensors[0]
            width = m.residual.k if m.residual.mode == "subspace" else m.model.d_model
            want = (tokens.shape[0], tokens.shape[1], width)
            if tuple(coords.shape) != want:
                raise self._reject("shape_mismatch", f"boundary must be {want}, got {tuple(coords.shape)}")
            if coords.dtype != self._wire_dtype:
                raise self._reject("dtype_mismatch", f"boundary dtype must be {self._wire_dtype}, got {coords.dtype}")
            if not torch.isfinite(coords).all():
                raise self._reject("non_finite", "boundary contains NaN or Inf")

    # ------------------------------------------------------------------ compute (compute thread only)
    def _check_generation(self, generation: int) -> None:
        if generation != self.generation:
            raise RpcError("leaving", f"this peer moved to stage {self.stage_index}")

    def _forward(
        self, tensors: list[torch.Tensor], train: bool, generation: Optional[int] = None
    ) -> tuple[_Pending, Optional[float]]:
        self._check_generation(self.generation if generation is None else generation)
        t0 = time.perf_counter()
        tokens, last = tensors[-2].long(), tensors[-1].long()
        stash = self._stashed() if train and not self.is_tail else None
        with torch.set_grad_enabled(train):
            leaf, out = self._forward_from(None if self.is_head else tensors[0], tokens, stash)
            loss = None
            if self.is_tail:
                loss_t = self.stage.loss(out, _targets(tokens, last))
                loss = float(loss_t.detach())
                if train:
                    # Sum over sequences of per-sequence mean loss: gradients add up to samples x mean.
                    (loss_t * tokens.shape[0]).backward()
        fwd_s = self._account(t0, tokens.numel(), "forward")
        if self.is_tail and train:
            self._measure(tokens.numel(), fwd_s)  # the tail's forward includes its backward
        pending = _Pending(tokens, leaf, out, self.step, self.generation, fwd_s, stash, self.sent_version(self.step))
        return pending, loss

    def _stashed(self) -> dict:
        """The weight snapshot of the current parameter version (made once per version: one copy per step)."""
        if self._stash_version != self.version or self._stash_weights is None:
            self._stash_weights = {n: p.detach().clone().requires_grad_(True) for n, p in self.stage.named_parameters()}
            self._stash_version = self.version
        return self._stash_weights

    def _forward_from(self, coords: Optional[torch.Tensor], tokens: torch.Tensor, weights: Optional[dict] = None):
        """(leaf, output): ``leaf`` is the received coordinates as a grad-tracking leaf (None on the head).
        With ``weights`` the stage runs on that snapshot instead of its live parameters."""
        run = self.stage if weights is None else functools.partial(torch.func.functional_call, self.stage, weights)
        if self.is_head:
            return None, run(tokens) if weights is None else run((tokens,))
        leaf = coords.detach().float().requires_grad_(torch.is_grad_enabled())
        x = decompress(Boundary(leaf, tokens, self.manifest.residual.mode), self.stage.basis, self.stage.frozen_embed)
        return leaf, run(x) if weights is None else run((x,))

    def _backward(self, pending: _Pending, grad_out: torch.Tensor) -> Optional[torch.Tensor]:
        self._check_generation(pending.generation)
        t0 = time.perf_counter()
        # Every training forward of a stage that sends a boundary ran on a weight snapshot (``_forward``): the
        # backward differentiates exactly that function, whatever steps were taken since. No recompute.
        next_basis = self.stage.basis if self.manifest.residual.mode == "subspace" else None
        sent = pending.out @ next_basis if next_basis is not None else pending.out
        sent.backward(grad_out.to(sent.dtype))
        if pending.weights is not None:
            # The gradient landed on the snapshot: move it to the live parameters, where steps are taken.
            for name, p in self.stage.named_parameters():
                g = pending.weights[name].grad
                if g is not None:
                    p.grad = g if p.grad is None else p.grad.add_(g)
                    pending.weights[name].grad = None
        stale = self.step - pending.step
        self.counters.staleness_sum += stale
        self.counters.staleness_max = max(self.counters.staleness_max, stale)
        self._measure(pending.tokens.numel(), pending.fwd_s + self._account(t0, pending.tokens.numel(), "backward"))
        self.samples += pending.tokens.shape[0]
        self.last_sample_time = time.monotonic()
        if pending.leaf is None:
            return None
        return pending.leaf.grad.to(self._wire_dtype)

    def _finish_tail(self, pending: _Pending) -> Optional[torch.Tensor]:
        self._check_generation(pending.generation)
        self.samples += pending.tokens.shape[0]
        self.last_sample_time = time.monotonic()
        return None if pending.leaf is None else pending.leaf.grad.to(self._wire_dtype)

    def _account(self, t0: float, n_tokens: int, kind: str) -> float:
        dt = time.perf_counter() - t0
        self.counters.busy_s += dt
        for observe in self.compute_observers:
            observe(kind, dt, n_tokens)
        return dt

    def _measure(self, n_tokens: int, seconds: float) -> None:
        """Throughput = tokens per compute second of a whole training microbatch (forward + backward), as an EMA.

        Per microbatch, not per call: averaging a fast forward's rate with a slow backward's would overstate every
        stage but the tail (whose forward includes the backward), and routing and rebalancing compare stages.
        """
        if seconds > 0:
            rate = n_tokens / seconds
            self.throughput = rate if self.throughput == 0 else 0.8 * self.throughput + 0.2 * rate

    # ------------------------------------------------------------------ RPC handlers
    def banned_peers(self) -> set[str]:
        return self.sentinel.banned_peers() if self.sentinel is not None else set()

    def sent_version(self, step: int) -> list:
        """The parameter version a message this stage computed at ``step`` came from: [step, fingerprint]. Sent
        with every boundary and gradient, so that SENTINEL compares messages of replicas holding the same weights
        (the fingerprint is None when it was not computed at that step, e.g. during a state download). Call it on
        the compute thread, with the computation: the fingerprint changes there too."""
        sync = self.sync
        fp = sync.fingerprint if sync is not None and sync.fingerprint_step == step else None
        return [int(step), fp]

    async def _screen(self, sender: str, boundary: int, direction: str, tensor: torch.Tensor,
                      tokens: torch.Tensor, paired: Optional[torch.Tensor] = None, version=None) -> bool:
        """Score one received message with SENTINEL (off the event loop); True if it must be dropped.

        ``version``: the sender's claimed ``sent_version`` (unverified; SENTINEL only uses it to pick whom to compare
        the message with, see ``SentinelMonitor.observe``)."""
        if self.sentinel is None:
            return False
        step = self.step
        verdict = await self.run_io(
            functools.partial(self.sentinel.observe, sender, boundary, direction, tensor, step=step,
                              tokens=tokens, paired=paired, version=version)
        )
        if self.opts.sentinel_log:
            await self.run_io(self._log_verdict, sender, boundary, direction, step, version, verdict)
        if verdict.flagged and not verdict.banned:  # why a message was dropped: the operator's first question
            logger.info(f"SENTINEL flagged {direction} from {sender[-8:]} at step {step} (its version "
                        f"{version}): {verdict.reasons[:3]}")
        if verdict.banned:
            self.log_event("ban", peer_banned=sender, boundary=boundary, direction=direction,
                           reasons=verdict.reasons[:3])
            logger.warning(f"SENTINEL banned {sender[-8:]} ({direction} at boundary {boundary}): {verdict.reasons[:3]}")
        return verdict.flagged or verdict.banned

    def _log_verdict(self, sender: str, boundary: int, direction: str, step: int, version, verdict) -> None:
        line = {"t": round(time.time(), 3), "sender": sender, "boundary": boundary, "direction": direction,
                "step": step, "version": version, "flagged": verdict.flagged, "banned": verdict.banned,
                "score": round(verdict.score, 2) if math.isfinite(verdict.score) else None,
                "reasons": verdict.reasons[:4]}
        with open(self.opts.sentinel_log, "a") as f:
            f.write(json.dumps(line, default=repr) + "\n")  # ``version`` is whatever the peer sent

    async def _authorize(self, caller: str) -> None:
        """Refuse callers without a certified record in an allow-listed run; no-op in open runs.

        An unknown caller triggers one DHT re-read (at most one per second), so a peer that just announced itself
        is served on its first or second try, and an outsider's flood costs one read per second.
        """
        if self.members is None or self.members.known(caller):
            return
        # One refresh at a time: concurrent first calls of a new peer wait for it instead of being refused.
        async with self._members_lock:
            if not self.members.known(caller) and self.members.should_refresh():
                try:
                    await self.run_io(self.members.refresh, self.dht)
                except Exception as err:  # the DHT is slow: refuse now, the caller retries
                    logger.debug(f"membership refresh failed: {err!r}")
        if not self.members.known(caller):
            raise self._reject("unauthorized", f"peer {caller} holds no certified record of run "
                                               f"{self.manifest.run_id!r} (allow-listed run)")

    async def _handle_fwd_bwd(self, meta: dict, tensors: list[torch.Tensor], caller: PeerID):
        sender = str(caller)
        await self._authorize(sender)
        if sender in self.banned_peers():
            raise self._reject("banned", f"peer {sender} is banned here for sending corrupted messages")
        if not self.limiter.allow(sender):
            raise self._reject("rate_limited", f"more than {self.opts.rate_limit_per_s:.0f} calls/s from {sender}")
        try:
            self._validate(meta, tensors)
        except RpcError as err:
            if err.code == "non_finite" and self.sentinel is not None:  # NaN/Inf: let SENTINEL ban the sender
                await self._screen(sender, self.stage_index - 1, "fwd", tensors[0], tensors[-2],
                                   version=meta.get("version"))
            raise
        if meta.get("audit"):
            # Recompute for a replica's receiver; nothing here trains on it, so it is not screened either.
            if not (self.is_tail or self.is_head):
                raise self._reject("wrong_stage", "audits are served by the first and the last stage only")
            recompute = self._recompute_tail if self.is_tail else self._recompute_head
            out, version = await self.run_compute(recompute, tensors, self.generation)
            return {"loss": None, "path": [self.peer_id], "version": version}, [out]
        if not self.is_head and bool(meta.get("train", True)):
            flagged = await self._screen(sender, self.stage_index - 1, "fwd", tensors[0], tensors[-2],
                                         version=meta.get("version"))
            if "fwd" in self._audited() and (flagged or random.random() < self.opts.audit_rate):
                self._start_audit("fwd", sender, meta, tensors, tensors[0], meta.get("version"), flagged=flagged)
            if flagged:
                raise self._reject("sentinel", "activations flagged as corrupted by SENTINEL")
        train = bool(meta.get("train", True))
        generation = self.generation
        self.inflight += 1
        self._queue += 1
        try:
            pending, loss = await self.run_compute(self._forward, tensors, train, generation)
            self._queue -= 1
            n_tokens = pending.tokens.numel()
            self.counters.forward += 1
            self.counters.tokens += n_tokens if train else 0
            if not train:
                self.counters.eval += 1
            if self.is_tail:
                if loss is not None and train:
                    self.loss_ema = loss if math.isnan(self.loss_ema) else 0.9 * self.loss_ema + 0.1 * loss
                grad_in = await self.run_compute(self._finish_tail, pending) if train else None
                if train:
                    self.counters.backward += 1
                return ({"loss": loss, "path": [self.peer_id], "version": pending.version},
                        [grad_in] if grad_in is not None else [])
            boundary = compress(pending.out.detach(), pending.tokens, self.stage.basis, self.manifest.residual.wire_dtype)
            down_meta, down_tensors = await self._call_next(meta, boundary, tensors[-1], pending.version)
            if not train:
                return {"loss": down_meta.get("loss"), "path": [self.peer_id, *down_meta.get("path", [])]}, []
            if len(down_tensors) != 1 or tuple(down_tensors[0].shape) != tuple(boundary.coords.shape):
                raise RpcError("bad_reply", f"stage {self.stage_index + 1} returned a malformed gradient")
            if not torch.isfinite(down_tensors[0]).all():
                raise RpcError("non_finite", f"stage {self.stage_index + 1} returned a non-finite gradient")
            self._queue += 1
            grad_in = await self.run_compute(self._backward, pending, down_tensors[0])
            self._queue -= 1
            self.counters.backward += 1
            reply = {"loss": down_meta.get("loss"), "path": [self.peer_id, *down_meta.get("path", [])],
                     "version": pending.version}
            return reply, ([grad_in] if grad_in is not None else [])
        except RpcError:
            self.counters.failed += 1
            raise
        finally:
            self.inflight -= 1
            self._queue = max(0, self._queue)

    async def _call_next(self, meta: dict, boundary: Boundary, last: torch.Tensor, version: Optional[list] = None):
        """Send the boundary to a peer of the next stage; on failure retry other replicas (bounded).
        ``version``: this stage's ``sent_version`` for the microbatch (the receiver's SENTINEL uses it)."""
        nxt = self.stage_index + 1
        down_meta = dict(meta, stage=nxt, version=version)
        tensors = [boundary.coords, boundary.tokens, last]
        timeout = self.opts.hop_timeout_s * (self.manifest.n_stages - nxt)
        tried: list[str] = []
        last_error: Optional[RpcError] = None
        for attempt in range(self.opts.max_retries + 1):
            peer = await self._wait_for_next_peer(tried)
            if peer is None:
                raise RpcError("no_peers", f"stage {nxt} has no reachable peers (tried {len(tried)})")
            try:
                reply = await transport.call(
                    self._p2p, peer.peer_id, self.manifest.run_id, FWD_BWD, down_meta, tensors, timeout,
                    stats=self.stats_out,
                )
                grads = reply[1]
                if (self.sentinel is not None and meta.get("train", True) and len(grads) == 1
                        and tuple(grads[0].shape) == tuple(boundary.coords.shape)
                        and await self._screen(peer.peer_id, self.stage_index, "bwd", grads[0], boundary.tokens,
                                               paired=boundary.coords, version=reply[0].get("version"))):
                    tried.append(peer.peer_id)
                    self.counters.retried += 1
                    logger.warning(f"gradient from stage {nxt} peer {peer.peer_id[-8:]} flagged; trying another replica")
                    if "bwd" in self._audited():
                        self._start_audit("bwd", peer.peer_id, down_meta, tensors, grads[0],
                                          reply[0].get("version"), flagged=True)
                    continue
                self.acks[peer.peer_id] = self.acks.get(peer.peer_id, 0) + 1
                if (self.sentinel is not None and meta.get("train", True) and len(grads) == 1
                        and "bwd" in self._audited() and random.random() < self.opts.audit_rate):
                    self._start_audit("bwd", peer.peer_id, down_meta, tensors, grads[0], reply[0].get("version"))
                return reply
            except RpcError as err:
                last_error = err
                if err.code not in RETRYABLE:
                    raise
                tried.append(peer.peer_id)
                if err.code in BANNABLE:
                    self.bans.ban(peer.peer_id)
                self.counters.retried += 1
                logger.warning(f"stage {nxt} peer {peer.peer_id[-8:]} failed ({err.code}); retry {attempt + 1}")
        raise RpcError("retries_exhausted", f"stage {nxt}: {self.opts.max_retries} retries failed; last: {last_error}")

    def _sentinel_config(self) -> SentinelConfig:
        return node_config(SentinelConfig(seed=self.manifest.seed), self._audited())

    def _audited(self) -> tuple[str, ...]:
        """Directions whose messages this node can have recomputed: gradients from the last stage (a tail needs
        only the boundary), activations from the first (a head needs only the tokens). A middle stage's messages
        would need its whole upstream or downstream chain: those stay judged by statistics."""
        if self.opts.audit_rate <= 0:
            return ()
        n = self.manifest.n_stages
        return (*(("fwd",) if self.stage_index == 1 else ()), *(("bwd",) if self.stage_index + 1 == n - 1 else ()))

    def _start_audit(self, direction: str, sender: str, meta: dict, tensors: list, message: torch.Tensor, version,
                     flagged: bool = False) -> None:
        """Have other replicas of ``sender``'s stage recompute its message in the background: a random accepted
        one when no audit runs (evidence, not a deadline: skipping one when busy costs nothing), a flagged one
        (statistics only name suspects in audited directions; this convicts or clears) when fewer than
        ``MAX_AUDITS`` run."""
        self._audits = {t for t in self._audits if not t.done()}
        if len(self._audits) >= (MAX_AUDITS if flagged else 1):
            return
        task = asyncio.create_task(self._run_audit(direction, sender, meta, tensors, message, version, flagged),
                                   name="audit")
        task.add_done_callback(_log_task_error)
        self._audits.add(task)

    async def _run_audit(self, direction: str, sender: str, meta: dict, tensors: list, message: torch.Tensor,
                         version, flagged: bool = False) -> None:
        """Ask a replica of the sender's stage at the sender's step for the same message (``audit``: computed, not
        trained on); if it differs, ask a second one, then let SENTINEL judge (``recomputed``)."""
        banned = self.banned_peers()
        claimed = version_key(version)
        if direction == "bwd":
            records, boundary = self.next_records, self.stage_index
        else:
            if time.monotonic() - self._prev_records_at > 2.0:
                self._prev_records = await self.run_io(read_stage, self.dht, self.manifest.run_id, 0,
                                                       self.manifest.hash)
                self._prev_records_at = time.monotonic()
            records, boundary = self._prev_records, self.stage_index - 1
            meta = dict(meta, stage=0)
            tensors = tensors[-2:]  # the head needs the tokens only
        others = [r for r in records if r.peer_id != sender and r.peer_id not in banned
                  and r.state == PeerState.SERVING.value]
        random.shuffle(others)
        # Replicas whose record shows the sender's step first; records lag by seconds, so the others are asked too.
        others.sort(key=lambda r: claimed is None or r.step != claimed[0])
        results: list = []
        for rec in others[:2]:
            try:
                reply, out = await transport.call(self._p2p, rec.peer_id, self.manifest.run_id, FWD_BWD,
                                                  dict(meta, audit=True), tensors, self.opts.hop_timeout_s,
                                                  stats=self.stats_out)
            except RpcError as err:
                logger.debug(f"audit on {rec.peer_id[-8:]} failed: {err}")
                continue
            if len(out) != 1 or tuple(out[0].shape) != tuple(message.shape):
                continue
            results.append((rec.peer_id, out[0], reply.get("version")))
            if self.sentinel.same_message(message, out[0]):
                break  # confirmed: no second opinion needed
        if not results:
            return
        verdict = await self.run_io(functools.partial(self.sentinel.recomputed, sender, boundary, direction, message,
                                                      version, results, flagged))
        if self.opts.sentinel_log:
            await self.run_io(self._log_verdict, sender, boundary, f"audit {direction}", self.step, version, verdict)
        if verdict.flagged:
            self.log_event("audit_failed", peer=sender, direction=direction, reasons=verdict.reasons[:2])
            logger.warning(f"SENTINEL audit: {sender[-8:]}'s {direction} message is not what its weights compute: "
                           f"{verdict.reasons[:1]}{' (banned)' if verdict.banned else ''}")

    def _recompute_head(self, tensors: list[torch.Tensor], generation: int) -> tuple[torch.Tensor, list]:
        """An audit request to a head: the boundary coordinates it sends for these tokens, without training (the
        same computation as a training forward, whose stashed weights equal the live ones of that version)."""
        self._check_generation(generation)
        tokens = tensors[-2].long()
        with torch.no_grad():
            out = self.stage(tokens)
        coords = compress(out, tokens, self.stage.basis, self.manifest.residual.wire_dtype).coords
        return coords, self.sent_version(self.step)

    def _recompute_tail(self, tensors: list[torch.Tensor], generation: int) -> tuple[torch.Tensor, list]:
        """An audit request: the gradient this tail returns for ``tensors``, without training on it (no parameter
        gradients, samples or throughput counted), and the version of the weights used. The same computation as
        ``_forward`` + ``_finish_tail``, so that an honest tail at the same version reproduces it bit for bit."""
        self._check_generation(generation)
        tokens, last = tensors[-2].long(), tensors[-1].long()
        with torch.enable_grad():
            leaf, out = self._forward_from(tensors[0], tokens)
            (grad,) = torch.autograd.grad(self.stage.loss(out, _targets(tokens, last)) * tokens.shape[0], leaf)
        return grad.to(self._wire_dtype), self.sent_version(self.step)

    async def _wait_for_next_peer(self, tried: list[str]) -> Optional[StageRecord]:
        """A next-stage peer for this attempt: untried and unbanned if possible, else the best of the rest (the
        caller bounds the attempts); waits up to ``wait_for_peers_s`` while the next stage has no serving peer."""
        deadline = time.monotonic() + self.opts.wait_for_peers_s
        warned = False
        while True:
            banned = self.banned_peers()
            usable = [r for r in self.next_records if r.peer_id not in banned] if banned else self.next_records
            peer = pick_peer_or_fallback(usable, 1, tried=tried, bans=self.bans)
            if peer is not None:
                if peer.peer_id in tried:
                    await asyncio.sleep(0.5 * tried.count(peer.peer_id))
                return peer
            if time.monotonic() > deadline or self.state == PeerState.LEAVING:
                return None
            if not warned:
                logger.warning(f"stage {self.stage_index + 1} has no peers; waiting")
                warned = True
            await asyncio.sleep(0.5)
            self.next_records = await self.run_io(
                read_stage, self.dht, self.manifest.run_id, self.stage_index + 1, self.manifest.hash
            )

    async def _handle_get_state(self, meta: dict, tensors: list[torch.Tensor], caller: PeerID):
        await self._authorize(str(caller))
        if meta.get("run_id") != self.manifest.run_id or meta.get("manifest_hash") != self.manifest.hash:
            raise RpcError("manifest_mismatch", "state requested for another run or manifest")
        if meta.get("stage") != self.stage_index:
            raise RpcError("wrong_stage", f"this peer serves stage {self.stage_index}")
        if self.state not in (PeerState.SERVING, PeerState.LEAVING) or self.sync is None:
            raise RpcError("not_serving", f"peer is {self.state.value}: its state is not settled")
        step, names, state = await self.run_compute(self.export_state)
        return {"step": step, "names": names, "fingerprint": self.sync.fingerprint}, state

    async def _handle_info(self, meta: dict, tensors: list[torch.Tensor], caller: PeerID):
        return {"record": self.record().to_value(), "events": self.events[-20:]}, []

    # ------------------------------------------------------------------ state (compute thread)
    def export_state(self) -> tuple[int, list[str], list[torch.Tensor]]:
        """Parameters and optimizer moments, as a flat named list (also the checkpoint format)."""
        names, tensors = [], []
        for name, p in self.stage.named_parameters():
            names.append(f"param/{name}")
            tensors.append(p.detach().clone())
            st = self.optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq", "step"):
                if key in st:
                    names.append(f"opt/{key}/{name}")
                    tensors.append(torch.as_tensor(st[key]).detach().clone().reshape(-1) if key == "step" else st[key].detach().clone())
        return self.step, names, tensors

    def import_state(self, step: int, names: list[str], tensors: list[torch.Tensor], keep_grads: bool = False) -> None:
        """Replace parameters, optimizer moments and step (compute thread). ``keep_grads`` keeps the gradients
        accumulated toward the next step (a same-step repair); otherwise they are dropped with their samples."""
        by_name = dict(zip(names, tensors))
        params = dict(self.stage.named_parameters())
        missing = [n for n in params if f"param/{n}" not in by_name]
        if missing:
            raise ValueError(f"state is missing parameters {missing[:3]}")
        with torch.no_grad():
            for name, p in params.items():
                src = by_name[f"param/{name}"]
                if src.shape != p.shape:
                    raise ValueError(f"{name}: state shape {tuple(src.shape)} != {tuple(p.shape)}")
                p.copy_(src)
                if f"opt/exp_avg/{name}" in by_name:
                    self.optimizer.state[p] = {
                        "exp_avg": by_name[f"opt/exp_avg/{name}"].clone(),
                        "exp_avg_sq": by_name[f"opt/exp_avg_sq/{name}"].clone(),
                        "step": by_name[f"opt/step/{name}"].reshape(()).clone().float(),
                    }
                else:
                    self.optimizer.state.pop(p, None)
                if not keep_grads:
                    p.grad = None
        self.version += 1
        self.step = int(step)
        if not keep_grads:
            self.samples = 0
        set_lr(self.optimizer, self.manifest.optimizer, self.step)

    def save_checkpoint(self) -> Optional[Path]:
        from agora.server.checkpoint import save_stage_checkpoint

        step, names, tensors = self.export_state()
        return save_stage_checkpoint(self.opts.checkpoint_dir, self.manifest, self.stage_index, step, names, tensors)

    def apply_step(self, grads: Optional[list[torch.Tensor]]) -> None:
        """One optimizer step with ``grads`` (averaged, mean over samples); gradients accumulated meanwhile survive."""
        params = [p for p in self.stage.parameters()]
        kept = [p.grad for p in params]
        for p, g in zip(params, grads):
            p.grad = g.to(p.dtype)
        torch.nn.utils.clip_grad_norm_(params, self.manifest.optimizer.grad_clip)
        set_lr(self.optimizer, self.manifest.optimizer, self.step)
        self.optimizer.step()
        for p, g in zip(params, kept):
            p.grad = g
        self.version += 1
        self.step += 1
        if self.opts.checkpoint_dir and self.opts.checkpoint_every and self.step % self.opts.checkpoint_every == 0:
            self.save_checkpoint()

    def take_gradients(self) -> tuple[int, list[torch.Tensor]]:
        """Move the accumulated gradient sums out (as means over their samples) and restart accumulation."""
        n = self.samples
        grads = []
        for p in self.stage.parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            grads.append(g.double() / max(n, 1))
            p.grad = None
        self.samples = 0
        return n, grads

    def log_event(self, kind: str, **info) -> None:
        self.events.append({"t": time.time(), "kind": kind, "peer": self.peer_id, "stage": self.stage_index, **info})
        del self.events[:-200]

