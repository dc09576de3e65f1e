"""A stage server: one peer holding one pipeline stage; lifecycle and composition of the parts that serve it.

Threads: the asyncio loop (this process's main thread) does all networking and DHT traffic; one compute thread runs
every forward, backward and optimizer step (``runtime.py``); a small pool makes blocking DHT calls.

The parts, one file each: ``handler`` (RPCs, the path of a microbatch through this stage), ``runtime`` (compute),
``downstream`` (the next hop), ``screening`` (SENTINEL), ``averaging`` (replica sync), ``rebalance`` (stage moves),
``checkpoint``, ``inference`` (generation sessions). ``StageNode`` builds them, runs the lifecycle joining ->
syncing -> serving -> leaving (announced in the DHT with a short expiry), and on a stage move builds a new runtime,
downstream and sync rather than resetting fields in place. A graceful leave drains in-flight microbatches up to a
deadline; a killed peer simply stops refreshing its record, and callers route around it through failed calls. See
``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional

import psutil
import torch
from hivemind import DHT

from agora.client.router import RouterOptions
from agora.config import Manifest
from agora.model import count_parameters
from agora.net.dht import EXIT_NOT_REACHABLE, JoinError, visible_maddrs
from agora.net.admission import IncomingGate, IncomingLimits
from agora.net.members import RunMembers
from agora.net.reachability import (DIRECT, UNREACHABLE, ConnectionPaths, DialbackServer, Reachability, ReverseDialer,
                                    check_reachability, listening_port, register_hello)
from agora.net.records import (ANNOUNCE_PERIOD_S, PeerState, StageRecord, acks_key, announce, bans_key, read_stage,
                               read_subkeys, stage_key, trainers_key)
from agora.net.transport import TransferStats
from agora.sentinel import AUDIT_RATE
from agora.server.averaging import make_sync
from agora.server.averaging.sync import (ReplicaSync, SyncContext, default_averaging_timeout_s, default_clip_wait_s,
                                         stage_state_bytes)
from agora.server.checkpoint import load_stage_checkpoint
from agora.server.state_access import StateAccess
from agora.server.downstream import Downstream, DownstreamHooks
from agora.server.freeze import FreezeWatch
from agora.server.handler import StageHandler, largest_request_bytes
from agora.server.inference import InferenceSessions
from agora.server.observers import Observers
from agora.server.rebalance import Rebalancer
from agora.server.runtime import Counters, OutputFilter, RuntimeOptions, StageRuntime
from agora.server.screening import Screening, ScreeningHooks
from agora.server.stage_records import StageRecords
from agora.server.upm import ROTATION_OVERHEAD_BYTES, RotationHooks, Rotations, rotation_bytes
from agora.trust.ratelimit import RateLimiter

logger = logging.getLogger("agora.node")


@dataclass
class NodeOptions:
    # SENTINEL monitoring of received activations/gradients, with audits and bans (`agora node --sentinel`). Off by
    # default: it costs CPU per message, audits recompute ``audit_rate`` of the messages on other replicas, and its
    # statistics, which alone decide for a middle stage's messages, drop honest messages early in training.
    sentinel: bool = False
    sentinel_log: Optional[str] = None  # JSONL file: one line per message SENTINEL judged (the evidence behind bans)
    # With SENTINEL: the share of accepted messages that other replicas of the sender's stage recompute (flagged ones
    # always), where they can: activations of the first stage, gradients of the last.
    audit_rate: float = AUDIT_RATE
    rate_limit_per_s: float = 200.0  # fwd_bwd calls per second per caller (burst = 2x)
    hop_timeout_s: float = 30.0  # one stage's compute + its downstream chain, scaled by the stages left
    max_retries: int = 3
    wait_for_peers_s: float = 60.0  # how long a hop waits for an empty next stage before giving up
    ban_s: float = 15.0
    # A hop outstanding longer than this many times the next peer's typical latency (at least ``hedge_min_s``) is
    # also sent to another replica of the next stage (client/router.py); 0 turns hedging off.
    hedge_factor: float = 4.0
    hedge_min_s: float = 3.0
    # seconds a round may take to form, then to all-reduce; None: ``default_averaging_timeout_s`` of the stage
    averaging_timeout_s: Optional[float] = None
    stall_step_s: float = 10.0  # step with what we have if no new samples arrived for this long
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    # Stage checkpoints to start from (``--resume``): read for whatever stage the node serves, also after a move, so
    # a peer moving into an empty stage of a run started from pretrained weights takes them and not a seeded init.
    resume_dir: Optional[str] = None
    drain_timeout_s: float = 20.0
    threads: Optional[int] = None
    # a joining/moving peer's state download, all attempts together; None: ``default_sync_timeout_s`` of the stage
    sync_timeout_s: Optional[float] = None
    # Rebalancing (0: off; `agora node` turns it on): every ~N s a serving peer checks whether moving one peer to
    # the bottleneck stage lifts throughput by >= min_move_gain, not before rebalance_dwell_s after it started
    # serving or last moved (measurements of a fresh stage need time to settle).
    rebalance_every_s: float = 0.0
    rebalance_dwell_s: float = 30.0
    rebalance_confirm_s: float = 45.0  # the same move must be planned at every check for this long (rebalance.py)
    min_move_gain: float = 1.3
    # Generation sessions (``infer`` RPC, server/inference.py): KV-cache bytes all sessions together may reserve
    # (a new session beyond it is refused with ``busy``), and how long an unused session is kept.
    inference_memory_bytes: int = 1 << 30
    inference_idle_s: float = 60.0
    # Bytes of incoming requests all peers together may have this node buffer (net/admission.py). None: two of the
    # run's largest legitimate requests (at least 4 MiB); refused when above a quarter of the host's free memory.
    incoming_budget_bytes: Optional[int] = None
    # How this peer computes (server/runtime.py RuntimeOptions): device, precision, backward mode.
    compute: RuntimeOptions = RuntimeOptions()
    # How other peers reach this one (net/reachability.py; the DHT's libp2p daemon is started to match,
    # ``Endpoint.reachability``). Peers are asked to dial this node's port back before it serves: "public" refuses
    # to start unless one could; "auto" and "relay" only report it (they serve through circuit relays if needed).
    reachability: str = "auto"


class StageNode:
    """One peer serving one stage of ``manifest`` (``stage``: its index) through ``dht``'s libp2p daemon.

    ``start()`` registers the RPCs and joins the stage; ``stop()`` leaves gracefully; ``move_to()`` serves another
    stage. The served stage's compute is ``runtime``, its next hop ``downstream``, its replica sync ``sync``.
    """

    def __init__(self, manifest: Manifest, stage: int, dht: DHT, options: Optional[NodeOptions] = None):
        self.manifest, self.dht, self.opts = manifest, dht, options or NodeOptions()
        if self.opts.sentinel and manifest.optimizer.lookahead:
            # Audits recompute a message on the live weights of its version; a look-ahead forward ran on weights
            # extrapolated from them, so every honest message sent while a step was pending would fail its audit.
            raise ValueError("--sentinel cannot audit a run with optimizer.lookahead (its forwards run on "
                             "extrapolated weights that an auditor does not hold); run without one of them")
        self.peer_id = str(dht.peer_id)
        self.state = PeerState.JOINING
        self.counters = Counters()
        self.observers = Observers()  # "compute", "round", "sync" (see observers.py); metrics subscribe here
        self.stats_in = TransferStats()  # requests from upstream, replies to it
        self.stats_out = TransferStats()  # requests to downstream, replies from it
        self.events: list[dict] = []  # the node's event log (``info`` RPC, summaries)
        self.acks: dict[str, int] = {}  # results each downstream peer delivered to us (published under our id)
        self.generation = 0  # bumped on every stage move; a runtime serves under one generation
        self.moves = 0
        self.previous_stages: list[int] = []
        self.output_filters: list[OutputFilter] = []
        self.runtime = self._new_runtime(stage)
        self.sync: Optional[ReplicaSync] = None  # set when joining a stage
        self.syncs: list[ReplicaSync] = []  # every sync this node created: all are shut down on stop
        self.inflight = 0
        self.queue = 0  # jobs waiting for or running on the compute thread
        self.serving_since = time.monotonic()
        self.started_at = time.monotonic()  # utilisation: compute seconds over seconds alive
        self.stopping = False
        self.limiter = RateLimiter(rate=self.opts.rate_limit_per_s, burst=2 * self.opts.rate_limit_per_s)
        # Allow-listed runs: only callers holding a certified record of the run are served (see net/members.py).
        self.members = RunMembers(manifest) if manifest.security.allow_list else None
        self.state_access = StateAccess(manifest, self.peer_id, dht, self.run_io)  # who may download our state
        self.left_stage_at: Optional[float] = None  # unix time this node last stopped holding a stage (a move)
        self.compute_thread_id: Optional[int] = None  # native id of the compute thread once it runs (CPU accounting)
        self._compute = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"stage{stage}-compute",
                                                              initializer=self._note_compute_thread)
        self._io = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix=f"stage{stage}-dht")
        self.screening = self._new_screening() if self.opts.sentinel else None
        # The largest legitimate request: a full fwd_bwd, or a UPM rotation (a dense run's d x d float64 is larger)
        largest = max(largest_request_bytes(manifest), rotation_bytes(manifest) + ROTATION_OVERHEAD_BYTES)
        self.incoming = IncomingGate(IncomingLimits.for_requests(
            largest, psutil.virtual_memory().available, self.opts.incoming_budget_bytes))
        self.handler = StageHandler(self)
        self.inference = InferenceSessions(self, self.opts.inference_memory_bytes, self.opts.inference_idle_s)
        self.rebalancer = Rebalancer(self)
        # Stage records read from the DHT, shared by the replica sync, the next hop, UPM and the loops here
        self.records = StageRecords(lambda s: self.run_io(read_stage, dht, manifest.run_id, s, manifest.hash))
        # UPM: the rotations of the frames at this node's boundaries (None: the run does not rotate)
        self.rotations = Rotations(manifest, RotationHooks(
            peer_id=self.peer_id, p2p=lambda: self._p2p, records=self.records.get, run_io=self.run_io,
            run_compute=self.run_compute,
            ledger=lambda: self.runtime.frames, stage=lambda: self.stage_index, step=lambda: self.runtime.step,
            is_serving=lambda: self.state == PeerState.SERVING, is_stopping=lambda: self.stopping,
            log_event=self.log_event,
        )) if manifest.security.upm is not None else None
        self.downstream: Optional[Downstream] = None  # built with the P2P, in start()
        self.maddrs: list[str] = []  # where others can dial this peer (announced: any live peer is a way in)
        self.reachability: Optional[Reachability] = None  # what peers said when asked to dial us back at start
        self.connections = ConnectionPaths()  # which of our connections crossed a relay (sampled)
        self.reverse: Optional[ReverseDialer] = None  # connections we open to our callers when nobody can dial us
        self.dialback: Optional[DialbackServer] = None
        self._p2p = None
        self._tasks: list[asyncio.Task] = []
        self.freeze = FreezeWatch()  # a freeze (SIGSTOP, suspend) drops the training work this process held
        self._sync_task: Optional[asyncio.Task] = None
        if self.opts.threads:
            torch.set_num_threads(self.opts.threads)

    # ------------------------------------------------------------------ the served stage
    @property
    def stage_index(self) -> int:
        return self.runtime.stage_index

    @property
    def step(self) -> int:
        return self.runtime.step

    @property
    def stage(self):
        return self.runtime.stage

    @property
    def is_head(self) -> bool:
        return self.runtime.is_head

    @property
    def is_tail(self) -> bool:
        return self.runtime.is_tail

    @property
    def sentinel(self):
        """This node's SENTINEL monitor (None without ``--sentinel``)."""
        return self.screening.monitor if self.screening is not None else None

    def add_output_filter(self, fn: OutputFilter) -> None:
        """Pass every message this node sends through ``fn(direction, tensor) -> tensor`` (the attack simulator's
        hook; see ``runtime.OutputFilter``). Survives stage moves."""
        self.output_filters.append(fn)  # the runtimes share this list

    def banned_peers(self) -> set[str]:
        return self.screening.banned_peers() if self.screening is not None else set()

    def log_event(self, kind: str, **info) -> None:
        self.events.append({"t": time.time(), "kind": kind, "peer": self.peer_id, "stage": self.stage_index, **info})
        del self.events[:-200]

    def _note_compute_thread(self) -> None:
        self.compute_thread_id = threading.get_native_id()

    @property
    def p2p(self):
        """hivemind's P2P of this node (None before ``start``)."""
        return self._p2p

    async def run_compute(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    async def run_io(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    # ------------------------------------------------------------------ building the parts
    def _new_runtime(self, stage: int) -> StageRuntime:
        rt = StageRuntime(self.manifest, stage, self.counters, self.observers, self.opts.checkpoint_dir,
                          self.opts.checkpoint_every, self.opts.compute)
        rt.output_filters = self.output_filters
        if self.opts.resume_dir:
            saved = load_stage_checkpoint(self.opts.resume_dir, self.manifest, stage)
            if saved is None:
                logger.warning(f"--resume {self.opts.resume_dir}: no checkpoint for stage {stage}; starting fresh")
            else:
                rt.import_state(*saved)
                logger.info(f"stage {stage} starts from step {rt.step} of {self.opts.resume_dir}")
        return rt

    def _new_screening(self) -> Screening:
        hooks = ScreeningHooks(run_io=self.run_io, log_event=self.log_event, step=lambda: self.runtime.step)
        return Screening(self.manifest, self.dht, self.stats_out, self.opts.audit_rate, self.opts.hop_timeout_s,
                         self.opts.sentinel_log, hooks)

    def _new_downstream(self) -> Downstream:
        o, n_stages = self.opts, self.manifest.n_stages
        options = RouterOptions(max_retries=o.max_retries, timeout_s=o.hop_timeout_s * (n_stages - self.stage_index - 1),
                                wait_for_peers_s=o.wait_for_peers_s, backoff_s=0.5, ban_s=o.ban_s, use_inflight=False,
                                hedge_factor=o.hedge_factor, hedge_min_s=o.hedge_min_s)
        hooks = DownstreamHooks(run_io=self.run_io, records=self.records,
                                 is_leaving=lambda: self.state == PeerState.LEAVING,
                                 screening=self.screening, counters=self.counters, stats=self.stats_out, acks=self.acks)
        return Downstream(self.manifest, self.stage_index, self.dht, self._p2p, options, hooks)

    def _new_sync(self) -> ReplicaSync:
        timeout = self.opts.averaging_timeout_s
        if timeout is None:  # resolved per stage: a node that moves gets its new stage's
            timeout = default_averaging_timeout_s(sum(p.numel() for p in self.runtime.stage.parameters()
                                                      if p.requires_grad))
        ctx = SyncContext(
            manifest=self.manifest, runtime=self.runtime, dht=self.dht, p2p=self._p2p, peer_id=self.peer_id,
            averaging_timeout_s=timeout, stall_step_s=self.opts.stall_step_s,
            run_compute=self.run_compute, run_io=self.run_io, announce=self.announce, log_event=self.log_event,
            is_serving=lambda: self.state == PeerState.SERVING, local_bans=self.banned_peers, members=self.members,
            observers=self.observers, state_bytes=stage_state_bytes(self.runtime.stage), records=self.records,
            clip_wait_s=default_clip_wait_s(count_parameters(self.manifest)["per_stage"], self.opts.averaging_timeout_s),
        )
        return make_sync(ctx)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._p2p = await self.dht.replicate_p2p()
        self.maddrs = await self.run_io(visible_maddrs, self.dht)
        logger.info(f"listening at {' '.join(self.maddrs)} (new peers may join through this address)")
        await self.handler.register(self._p2p)
        self.dialback = DialbackServer(self._p2p)
        await self.dialback.register(self.manifest.run_id)
        await register_hello(self._p2p, self.manifest.run_id)
        self.reverse = ReverseDialer(self._p2p, self.manifest.run_id, self._callers)
        if self.opts.reachability == "public":
            await self._check_reachability()  # refuses to start before serving anything
        elif self.reachability is not None:  # asked before the daemon started (roles.run_node, auto)
            self._report_reachability()
        else:  # only reported: serving need not wait for the answer
            self._tasks.append(asyncio.create_task(self._check_reachability(), name="reachability"))
        self._serve_stage_parts()
        self._tasks.append(asyncio.create_task(self._announce_loop(), name="announce"))
        self._tasks.append(asyncio.create_task(self._refresh_next_loop(), name="refresh-next"))
        self._tasks.append(asyncio.create_task(self.inference.run(), name="inference-expiry"))
        self._tasks.append(asyncio.create_task(self._witness_loop(), name="state-ledger"))
        self._tasks.append(asyncio.create_task(self.freeze.run(), name="freeze-watch"))
        self._tasks.append(asyncio.create_task(self.connections.run(self._p2p), name="connection-paths"))
        self._tasks.append(asyncio.create_task(self.reverse.run(), name="reverse-dial"))
        if self.rotations is not None:
            self._tasks.append(asyncio.create_task(self.rotations.run(), name="upm-rotations"))
        await self._join_stage()
        if self.opts.rebalance_every_s > 0:
            self._tasks.append(asyncio.create_task(self.rebalancer.run(), name="rebalance"))

    async def _check_reachability(self) -> None:
        """Ask connected peers to dial us back (``NodeOptions.reachability``); "public" raises ``JoinError`` when
        none could, naming the address and port and what to open."""
        mode = self.opts.reachability
        try:
            self.reachability = await check_reachability(self._p2p, self.manifest.run_id, listening_port(self.maddrs))
        except Exception as err:  # noqa: BLE001 (our own daemon did not answer: say so, the mode decides)
            self.reachability = Reachability("unknown", listening_port(self.maddrs), unanswered=[repr(err)])
        if mode == "public" and self.reachability.status != DIRECT:
            raise JoinError(f"--reachability public: {self.reachability.explain()}", EXIT_NOT_REACHABLE)
        self._report_reachability()

    async def _callers(self) -> list[str]:
        """Peers that must be able to call this node when nobody can dial it (``ReverseDialer``): its own stage's
        replicas (averaging, audits) and the previous stage's, or the trainers for the head. Nothing to do (no DHT
        read) while this node is reachable."""
        unreachable = self.opts.reachability == "relay" or (
            self.reachability is not None and self.reachability.status == UNREACHABLE)
        stage = self.stage_index
        if not unreachable or stage is None:
            return []
        m = self.manifest
        peers = [r.peer_id for r in await self.records.get(stage)]
        if stage > 0:
            peers += [r.peer_id for r in await self.records.get(stage - 1)]
        else:
            trainers = await self.run_io(read_subkeys, self.dht, trainers_key(m.run_id))
            peers += [pid for pid, v in trainers.items() if isinstance(v, dict) and v.get("manifest_hash") == m.hash]
        return peers

    def _report_reachability(self) -> None:
        mode, text = self.opts.reachability, self.reachability.explain()
        if self.reachability.status == DIRECT:
            logger.info(f"reachability: {text}")
        elif self.reachability.status == UNREACHABLE:
            logger.warning(f"reachability: {text}. Serving meanwhile over connections this node opens to the peers "
                           f"that call it (--reachability {mode}); an unreachable peer in an adjacent stage cannot "
                           f"reach this one (libp2p relays reserve a slot only after minutes, if at all)")
        else:
            logger.warning(f"reachability: {text}; serving anyway")

    def _serve_stage_parts(self) -> None:
        """The next hop and SENTINEL's audits follow the stage this node serves."""
        self.downstream = self._new_downstream()
        if self.screening is not None:
            self.screening.p2p = self._p2p
            self.screening.serve_stage(self.stage_index, lambda: self.downstream.records)

    async def _join_stage(self, require_state: bool = False) -> bool:
        """syncing -> serving in the runtime's stage: averager up, state of the freshest replica, sync loop on.

        With ``require_state`` (a move), a failed download returns False before serving, so the caller can go back.
        """
        self.state = PeerState.SYNCING
        self.sync = self._new_sync()
        self.syncs.append(self.sync)
        self.observers.emit("sync", self.sync)
        await self.announce()
        # A stage this identity held within the period (a move, or a restart at another stage) is witnessed in the
        # state ledger: this stage's replicas serve us its state only once the period has passed
        # (server/state_access.py). Meanwhile we hold nothing anybody routes work to.
        wait = self.state_access.wait_after_leaving(self.left_stage_at) if self.left_stage_at is not None else 0.0
        try:
            wait = max(wait, await self.state_access.own_wait(self.stage_index))
        except Exception as err:  # the DHT is slow: a refused download says how long to wait
            logger.warning(f"could not read the state ledger: {err!r}")
        if wait > 0:
            logger.info(f"stage {self.stage_index}: waiting {wait:.0f}s before downloading its state: one "
                        f"identity holds one stage per {self.state_access.period_s:.0f}s "
                        f"(security.state_access.period_s)")
            await asyncio.sleep(wait)
        synced = await self.sync.initial_sync(timeout=self.opts.sync_timeout_s)
        if not synced and require_state:
            return False
        await self.downstream.refresh()  # know the next stage before the first request needs it
        self.state = PeerState.SERVING
        self.serving_since = time.monotonic()
        await self.announce()
        self._sync_task = asyncio.create_task(self.sync.run(), name="replica-sync")
        logger.info(f"stage {self.stage_index} peer {self.peer_id[-8:]} serving at step {self.step} (averaging "
                    f"rounds time out after {self.sync.ctx.averaging_timeout_s:.0f}s, the other stages' gradient norms are "
                    f"awaited {self.sync.ctx.clip_wait_s:.0f}s)")
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
        self.stopping = True
        self.state = PeerState.LEAVING
        try:
            await self.announce()
        except Exception as err:  # the DHT may already be gone; leaving must still finish
            logger.warning(f"could not announce leaving: {err!r}")
        await self._drain()
        audits = self.screening.tasks() if self.screening is not None else []
        tasks = [*self._tasks, *audits, *([self._sync_task] if self._sync_task else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.rebalancer.lock_claimed:
            await self.rebalancer.release_lock()
        for sync in self.syncs:
            sync.shutdown()
        self.inference.close_all()
        if self.opts.checkpoint_dir:
            await self.run_compute(self.runtime.save_checkpoint)
        self._compute.shutdown(wait=True)
        self._io.shutdown(wait=False)

    # ------------------------------------------------------------------ stage moves
    async def move_to(self, new_stage: int) -> bool:
        """Serve ``new_stage`` instead of the current one; True if the node serves the new stage afterwards.

        Leave cleanly (announce leaving, drain, stop the averager between rounds), build a runtime, next hop and
        replica sync for the new stage, take the state of a replica there, serve. If that state cannot be had, go
        back to the old stage with the old runtime (kept aside untouched) and resync there.
        """
        old, t0 = self.runtime, time.monotonic()
        if new_stage == old.stage_index or not 0 <= new_stage < self.manifest.n_stages:
            raise ValueError(f"cannot move from stage {old.stage_index} to {new_stage}")
        await self._leave_stage()
        await self.run_compute(lambda: self._switch_runtime(self._new_runtime(new_stage)))  # built off the loop
        if await self._join_stage(require_state=True):
            self.moves += 1
            self.log_event("moved", from_stage=old.stage_index, to_stage=new_stage, step=self.step,
                           seconds=time.monotonic() - t0)
            logger.info(f"moved from stage {old.stage_index} to {new_stage} in {time.monotonic() - t0:.1f}s")
            return True
        logger.warning(f"could not get the state of stage {new_stage}; going back to stage {old.stage_index}")
        self.state = PeerState.LEAVING
        await self.announce()
        await self._stop_sync()
        await self.run_compute(self._switch_runtime, old)
        await self._join_stage()
        self.log_event("move_failed", from_stage=old.stage_index, to_stage=new_stage, seconds=time.monotonic() - t0)
        return False

    async def _leave_stage(self) -> None:
        self.state = PeerState.LEAVING
        await self.announce()
        self.left_stage_at = time.time()
        await self._drain()
        await self._stop_sync()

    def _switch_runtime(self, runtime: StageRuntime) -> None:
        """Compute thread: serve from ``runtime``, so no forward/backward ever sees half of each stage."""
        stage = runtime.stage_index
        self.previous_stages = [s for s in self.previous_stages if s != stage][-3:] + [self.stage_index]
        self.generation += 1
        self.runtime.retire()  # microbatches still in flight on the stage left are refused (``leaving``)
        runtime.activate(self.generation)
        runtime.output_filters = self.output_filters
        self.runtime = runtime
        self._serve_stage_parts()

    # ------------------------------------------------------------------ DHT announcements
    def record(self) -> StageRecord:
        c, rt, sync = self.counters, self.runtime, self.sync
        sample_step, sample = rt.parameter_sample  # one read: the compute thread replaces the pair
        return StageRecord(
            peer_id=self.peer_id,
            stage=rt.stage_index,
            state=self.state.value,
            manifest_hash=self.manifest.hash,
            throughput=rt.throughput,
            queue=self.queue,
            step=rt.step,
            samples=rt.samples,
            admitted=sync.admitted if sync else 0,
            fingerprint=sync.fingerprint if sync and sync.fingerprint_valid else 0.0,
            averaging_step=sync.averaging_step if sync else -1,
            fallback_step=sync.fallback_step if sync else -1,
            addrs=self.maddrs,
            param_sample_step=sample_step,
            param_sample=list(sample),
            precision=rt.options.precision,
            reachability=self.reachability_label(),
            metrics={
                "forward": c.forward, "backward": c.backward, "tokens": c.tokens, "retried": c.retried,
                "failed": c.failed, "rejected": c.rejected, "loss": rt.loss_ema,
                "bytes_out": self.stats_out.payload_bytes_sent, "bytes_in": self.stats_in.payload_bytes_received,
                "busy_s": c.busy_s, "moves": self.moves, "utilisation": self.utilisation(),
                **self._curvature_metrics(rt),
                **self._memory_metrics(rt),
            },
        )

    def reachability_label(self) -> str:
        """How peers reach this node, for its record: direct, relayed or unknown (net/reachability.py)."""
        return "unknown" if self.reachability is None else self.reachability.label()

    def utilisation(self) -> float:
        """Compute seconds (forward, backward, steps) over seconds alive: what averaging and waiting leave."""
        return self.counters.busy_s / max(1e-9, time.monotonic() - self.started_at)

    @staticmethod
    def _memory_metrics(rt) -> dict:
        """Peak memory for ``agora status``: the device's (CUDA only) and the host resident set's."""
        mem = rt.memory()
        out = {"host_peak_rss_bytes": float(mem["host_peak_rss_bytes"])}
        if mem["device_peak_bytes"] is not None:
            out["device_peak_bytes"] = float(mem["device_peak_bytes"])
        return out

    @staticmethod
    def _curvature_metrics(rt) -> dict:
        """lr x the stage's top preconditioned Hessian eigenvalue against its stability threshold (dashboard)."""
        if rt.curvature is None:
            return {}
        c = rt.curvature.summary()
        return {"curvature_lr_lambda": c["lr_times_value"] if c["lr_times_value"] is not None else float("nan"),
                "curvature_threshold": c["threshold"], "curvature_alarms": c["alarms"]}

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

    async def _witness_loop(self) -> None:
        """Write what we see of our stage to the state ledger: the replicas serving it, ourselves included, a few
        times per ``security.state_access.period_s`` (at most every 20 s), so a peer that served this stage
        cannot take another stage's state within the period (server/state_access.py)."""
        access = self.state_access
        every = min(20.0, max(1.0, access.period_s / 3))
        while True:
            await asyncio.sleep(every)
            if self.state != PeerState.SERVING:
                continue
            stage = self.stage_index
            try:
                recs = await self.records.get(stage)
                serving = {r.peer_id for r in recs if r.state == PeerState.SERVING.value} | {self.peer_id}
                if stage == self.stage_index:  # not moved meanwhile
                    await access.witness(stage, sorted(serving))
            except Exception as err:  # a DHT hiccup; the next period writes again
                logger.debug(f"writing the state ledger failed: {err!r}")

    async def _refresh_next_loop(self) -> None:
        """Keep the next stage's records fresh off the hot path (one DHT read a second at most)."""
        while True:
            await self.downstream.refresh()
            await asyncio.sleep(1.0)
