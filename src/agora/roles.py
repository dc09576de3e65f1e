"""Process entry points for the swarm roles: bootstrap, stage node, trainer.

Each role is one OS process: hivemind's DHT (its own child process and libp2p daemon), an asyncio loop in the
main thread, and (for nodes) one compute thread. Each writes a JSON summary on exit when asked, so the demo and
benchmarks can add up CPU time, bytes and microbatches across processes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import psutil

from agora.client.trainer import Trainer, TrainerOptions
from agora.config import Manifest
from agora.data import build_datasets
from agora.model import stage_memory_bytes
from agora.net.dht import (
    Endpoint,
    JoinError,
    check_run_manifest,
    install_stop_signals,
    make_dht,
    publish_manifest,
    visible_maddrs,
)
from agora.net.reachability import UNREACHABLE, DialbackServer, Reachability, listening_port, probe
from agora.net.records import ANNOUNCE_PERIOD_S, read_swarm
from agora.net.routing import drop_stale, pick_stage
from agora.ops.metrics import serve_node_metrics
from agora.server.node import NodeOptions, StageNode
from agora.server.runtime import return_freed_memory_to_the_system

logger = logging.getLogger("agora")


def process_cpu_seconds(pid: Optional[int] = None) -> float:
    """CPU seconds of a process (default: this one) and all its descendants (hivemind's DHT/averager processes,
    p2pd): the live ones' own time plus, for each, the time of the children it already reaped. The kernel adds a
    child's time to its parent once the parent waits for it, so an averager shut down (and joined) before this is
    read still counts: a node's final summary is written after ``node.stop()``."""
    total = 0.0
    me = psutil.Process(pid)
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            continue
    return total


class RoundClock:
    """Seconds a node spent in averaging rounds (gradients taken to step applied, waiting included), from the
    node's "round" events."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self, ok: bool, seconds: float, group: int) -> None:
        self.seconds += seconds


def _write(path: Optional[str], data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(str(path) + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        os.replace(tmp, path)


def run_bootstrap(manifest: Optional[Manifest], initial_peers: Sequence[str], endpoint: Endpoint,
                  maddr_file: Optional[str] = None) -> int:
    """A DHT peer to join through: prints its multiaddrs, republishes the manifest hash every 20 s until stopped."""
    dht = make_dht(initial_peers, endpoint, manifest=manifest)
    maddrs = visible_maddrs(dht)
    print("\n".join(maddrs), flush=True)
    if maddr_file:
        Path(maddr_file).write_text("\n".join(maddrs))
    if manifest is not None:
        check_run_manifest(dht, manifest)

    async def main() -> None:
        stop = asyncio.Event()
        install_stop_signals(asyncio.get_running_loop(), stop)
        if manifest is not None:  # joiners ask the bootstrap whether it can connect back to them
            await DialbackServer(await dht.replicate_p2p()).register(manifest.run_id)
        while not stop.is_set():
            if manifest is not None:
                try:
                    publish_manifest(dht, manifest)
                except TimeoutError:  # an overloaded machine or network: the next period publishes again
                    logger.warning("publishing the manifest timed out; retrying in 20 s")
            try:
                await asyncio.wait_for(stop.wait(), timeout=20.0)
            except asyncio.TimeoutError:
                pass

    try:
        asyncio.run(main())
    finally:
        dht.shutdown()
    return 0


def exit_through_finally_on_sigterm() -> None:
    """Until the asyncio loop takes SIGTERM over (for a graceful leave), make SIGTERM raise ``SystemExit``.

    A peer stopped while still starting (building its stage, choosing one) then runs its ``finally`` blocks and
    shuts its DHT process and libp2p daemon down, instead of dying at once and leaving them orphaned.
    """

    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)


def _ignore_sigterm_while_leaving() -> None:
    """Once a role's loop has ended it is already leaving: a SIGTERM then is logged and ignored, so the summary and
    the DHT shutdown still happen (a stuck exit is the caller's to SIGKILL)."""

    def _log(signum, frame):
        logger.info("received SIGTERM while leaving: finishing the summary and shutdown first")

    signal.signal(signal.SIGTERM, _log)


def choose_stage(dht, manifest: Manifest) -> int:
    """The weakest stage, ignoring records that stopped being refreshed (peers that just died)."""
    swarm = read_swarm(dht, manifest.run_id, manifest.n_stages, manifest.hash)
    return pick_stage(drop_stale(swarm, max_age_s=2 * ANNOUNCE_PERIOD_S + 1.5))


@dataclass
class NodeRun:
    """How ``agora node`` runs one node, beyond the node's own options.

    :param stage: a stage index, or "auto" for the weakest stage
    :param summary: write a JSON summary of the node here (every 2 s and on exit)
    :param resume: a checkpoint folder to restore the stage from
    :param metrics_port: serve Prometheus /metrics on this port
    :param setup: called with the node right after it is built, before it serves (e.g. the attack simulator)
    """

    stage: str = "auto"
    summary: Optional[str] = None
    resume: Optional[str] = None
    metrics_port: Optional[int] = None
    setup: Optional[Callable[[StageNode], Any]] = None


def _stage_to_serve(dht, manifest: Manifest, stage: str) -> int:
    if stage == "auto":
        # Random jitter so peers started together do not all read the same empty swarm and pick one stage.
        time.sleep(random.uniform(0, 1.0))
        index = choose_stage(dht, manifest)
        logger.info(f"--stage auto chose stage {index}")
        return index
    index = int(stage)
    if not 0 <= index < manifest.n_stages:
        raise JoinError(f"--stage {index} does not exist: the manifest has {manifest.n_stages} stages", 2)
    return index


def check_memory(manifest: Manifest, stage: Optional[int]) -> None:
    """Refuse, before allocating, a stage (``None``: the whole model, ``train-local``) this machine cannot hold: an
    OOM kill says nothing to its owner."""
    what = "the whole model" if stage is None else f"stage {stage}"
    need, have = stage_memory_bytes(manifest, stage), psutil.virtual_memory().available
    if need > have:
        fix = ("choose a smaller manifest" if stage is None
               else "serve a smaller stage (--stage) or join a run with more stages")
        raise JoinError(f"{what} needs at least {need / 2**30:.1f} GiB of memory (parameters, gradients, optimizer "
                        f"moments) but this machine has {have / 2**30:.1f} GiB available; {fix}", 2)
    logger.info(f"{what} needs at least {need / 2**30:.2f} GiB; {have / 2**30:.1f} GiB available")


def _build_node(dht, manifest: Manifest, options: NodeOptions, run: NodeRun, host: str) -> StageNode:
    index = _stage_to_serve(dht, manifest, run.stage)
    check_memory(manifest, index)
    # The node reads --resume for whichever stage it serves, now or after a move.
    try:
        node = StageNode(manifest, index, dht, replace(options, resume_dir=run.resume) if run.resume else options)
    except ValueError as err:  # e.g. an incoming-request budget this host cannot afford
        raise JoinError(str(err), 2) from err
    if run.metrics_port is not None:
        serve_node_metrics(node, run.metrics_port, host=host)  # same interface as the node's listener
    if run.setup is not None:
        run.setup(node)
    return node


async def _serve(node: StageNode, summary: Optional[str], rounds: RoundClock) -> None:
    stop = asyncio.Event()
    install_stop_signals(asyncio.get_running_loop(), stop)
    await node.start()
    last_summary = 0.0
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=1.0)
        except asyncio.TimeoutError:
            pass
        if summary and time.monotonic() - last_summary > 2.0:
            _write(summary, node_summary(node, rounds))
            last_summary = time.monotonic()
    await node.stop()


def run_node(manifest: Manifest, initial_peers: Sequence[str], endpoint: Endpoint, options: NodeOptions,
             run: Optional[NodeRun] = None) -> int:
    """Serve one stage until SIGTERM/SIGINT, then leave gracefully."""
    run = run or NodeRun()
    return_freed_memory_to_the_system()
    dht = make_dht(initial_peers, endpoint, manifest=manifest)
    exit_through_finally_on_sigterm()
    try:
        check_run_manifest(dht, manifest)
        reach = _probe_before_serving(dht, manifest) if endpoint.reachability == "auto" else None
        if reach is not None and reach.status == UNREACHABLE:
            dht.shutdown()
            dht = make_dht(initial_peers, replace(endpoint, reachability="relay"), manifest=manifest)
        node = _build_node(dht, manifest, options, run, endpoint.host)
        node.reachability = reach  # asked once: peers answer one dial-back per peer per 10 s
        rounds = RoundClock()
        node.observers.subscribe("round", rounds)
        try:
            asyncio.run(_serve(node, run.summary, rounds))
        finally:
            _ignore_sigterm_while_leaving()
        _write(run.summary, node_summary(node, rounds))
        return 0
    finally:
        dht.shutdown()


def _probe_before_serving(dht, manifest: Manifest) -> Optional[Reachability]:
    """``--reachability auto``: whether peers can connect back to us. When none can, the caller restarts the libp2p
    daemon to serve through circuit relays. Why not leave that to libp2p: its AutoNAT needs several peers' probes to
    call a peer private and in a young swarm did not (measured: a firewalled peer stayed unreachable for minutes),
    while one dial-back answers in seconds."""
    try:
        reach = probe(dht, manifest.run_id, listening_port(visible_maddrs(dht)))
    except Exception as err:  # noqa: BLE001 (no answer is no evidence: serve as configured)
        logger.warning(f"could not ask peers whether they can connect back: {err!r}")
        return None
    if reach.status == UNREACHABLE:
        logger.warning(f"reachability: {reach.explain()}. Restarting this peer's libp2p daemon in relay mode (as "
                       f"--reachability relay): it will open connections to the peers that call it")
    return reach


def _router_view(router) -> dict:
    """Per peer of the stage a router calls: results delivered to us and their calls' mean duration (s)."""
    if router is None:
        return {}
    return {peer: {"delivered": router.acks.get(peer, 0), "latency_s": router.latency.get(peer)}
            for peer in sorted(set(router.acks) | set(router.latency))}


def node_summary(node: StageNode, rounds: Optional[RoundClock] = None) -> dict:
    """What a node writes to ``--summary``: its counters, averaging, and where its CPU goes: ``compute_tid`` (the
    compute thread's native id) and ``helper_pids`` (its DHT and averager processes) let a parent process
    attribute the CPU of its threads and children (``agora.lab.cpu_meter``)."""
    sync, syncs = node.sync, node.syncs
    return {
        "role": "node",
        "peer_id": node.peer_id,
        "stage": node.stage_index,
        # how this peer computes (RuntimeOptions: device, precision, backward mode, offload, block checkpointing,
        # curvature tracking), its device's peak of allocated tensors (CUDA) and its host resident set now and at peak
        "compute": {**asdict(node.opts.compute), **node.runtime.memory()},
        # What peers said when asked to connect back at start (net/reachability.py); None until one answered.
        "reachability": asdict(node.reachability) if node.reachability is not None else None,
        # Which connections crossed a circuit relay (sampled every 5 s): the path bytes took, whatever the above said.
        "connections": node.connections.summary(),
        # Nobody could dial us: connections we opened to the peers that call us, so they reach us without a relay.
        "reverse_dial": node.reverse.summary() if node.reverse is not None else None,
        "state": node.state.value,
        "step": node.step,
        "counters": asdict(node.counters),
        "bytes_sent_downstream": node.stats_out.payload_bytes_sent,
        "bytes_received_upstream": node.stats_in.payload_bytes_received,
        "bytes_sent_upstream": node.stats_in.payload_bytes_sent,
        "averaging_timeout_s": sync.ctx.averaging_timeout_s if sync else None,
        "rounds_ok": sum(s.rounds_ok for s in syncs),
        "rounds_failed": sum(s.rounds_failed for s in syncs),
        # of those, all-reduces hivemind finished with part of the average missing (GuardedAverager.partial_rounds)
        "partial_rounds": sum(s.partial_rounds for s in syncs),
        "local_steps": sum(s.local_steps for s in syncs),
        "resyncs": sum(s.resyncs for s in syncs),
        "share_redirects": sum(s.share_redirects for s in syncs),
        "share_overflows": sum(s.share_overflows for s in syncs),
        # global-norm clipping (server/averaging/clip.py): steps clipped by the norm of every stage, steps that gave
        # up waiting for another stage's norm and clipped by their own, and partial steps taken because the rest
        # of a batch left with a replica (``ReplicaSync._left_behind``)
        "clip_global_steps": sum(s.clipper.global_steps for s in syncs),
        "clip_fallbacks": sum(s.clipper.fallbacks for s in syncs),
        "realigned_steps": sum(s.realigned_steps for s in syncs),
        # replicas at our step whose fingerprint differed but whose sampled parameters were within
        # averaging.agreement_tolerance (rounding: another device or optimizer kernel), and the last distance seen
        "agreed_within_tolerance": sum(s.tolerated for s in syncs),
        "agreement_distance": sync.agreement_distance if sync else None,
        "agreement_max_distance": sync.agreement_max_distance if sync else None,
        "duplicate_microbatches": node.handler.exactly_once.duplicates,
        # Training requests dropped before they committed: their callers had gone (a hedge won elsewhere) or this
        # process was frozen while they were in flight (server/freeze.py); and the freezes themselves.
        "dropped_microbatches": node.handler.dropped,
        # hedged pairs (server/exactly_once.py): microbatches dropped here because the replica called first had
        # applied them, and claims we granted to a hedge target (our run then dropped the microbatch)
        "hedge_claims_lost": node.handler.claims_lost,
        "hedge_claims_granted": node.handler.claims_granted,
        "hedges_downstream": node.downstream.router.hedges if node.downstream is not None else 0,
        "called": _router_view(node.downstream.router if node.downstream is not None else None),
        "freezes": node.freeze.epoch,
        "frozen_s": round(node.freeze.frozen_s, 3),
        "aborted_rounds": sum(s.aborted_rounds for s in syncs),
        # a replica of a round that did not answer a probe (frozen, cut off), and all-reduces left because of one
        "probe_failures": sum(s.probe_failures for s in syncs),
        "left_rounds": sum(s.left_rounds for s in syncs),
        "averaging_bytes_sent": sum(s.bytes_sent for s in syncs),
        # DiLoCo: outer steps taken alone (no partner alive, or the round failed) and the seconds outer rounds
        # blocked this replica (inner steps wait for them).
        "outer_rounds_alone": sum(getattr(s, "outer_rounds_alone", 0) for s in syncs),
        "outer_round_s": sum(getattr(s, "outer_seconds", 0.0) for s in syncs),
        # gossip: bytes of blocking (phase end) and background (Mix1) exchanges, and exchanges that found no pair
        "gossip_blocking_bytes": sum(getattr(s, "blocking_bytes", 0) for s in syncs),
        "gossip_background_bytes": sum(getattr(s, "background_bytes", 0) for s in syncs),
        "gossip_exchanges_failed": sum(getattr(s, "exchanges_failed", 0) for s in syncs),
        # gossip with a codec: exchanges sent compressed, and those discarded for a reference the pair did not share
        "gossip_exchanges_compressed": sum(getattr(s, "exchanges_compressed", 0) for s in syncs),
        "gossip_reference_mismatches": sum(getattr(s, "reference_mismatches", 0) for s in syncs),
        "moves": node.moves,
        # compute seconds over seconds alive; the replicas' sampled relative parameter spread at one step
        "utilisation": node.utilisation(),
        "consensus_distance": sync.consensus_distance if sync else None,
        # the stage's top preconditioned Hessian eigenvalue, lr x it against the stability threshold, alarms
        "curvature": node.runtime.curvature.summary() if node.runtime.curvature is not None else None,
        # architecture warm-up: the blocks active, the clock they follow and (mode curvature) the steps it was held
        "warmup": ({"active_depth": node.runtime.stage.active_depth, "clock": node.runtime.warmup_clock,
                    "held_steps": sum(s.warmup_brake.held_steps for s in syncs)}
                   if node.manifest.training.warmup_depth is not None else None),
        # NAdam look-ahead (optimizer.lookahead): training forwards that ran while a step was pending, on weights
        # extrapolated one predicted update ahead
        "lookahead_forwards": node.counters.lookahead_forwards if node.runtime.lookahead else None,
        # UPM: frames drawn, received, refused, sent; this stage's frame epochs and the rotations due
        "upm": node.rotations.summary() if node.rotations is not None else None,
        **node.state_access.summary(),
        "maddrs": node.maddrs,
        "fingerprint": sync.fingerprint if sync else 0.0,
        "cpu_s": process_cpu_seconds(),
        "compute_tid": node.compute_thread_id,
        "helper_pids": {"dht": getattr(node.dht, "pid", None),
                        "averagers": [p for s in syncs if (p := getattr(getattr(s, "averager", None), "pid", None))]},
        "round_s": rounds.seconds if rounds is not None else None,
        "events": node.events[-50:],
        # Who this node banned and, per monitored stream, how many messages of each sender it judged (a banned
        # sender is judged no more, so its count is the number of its messages it took to ban it).
        "banned": sorted(node.banned_peers()),
        "sentinel": node.sentinel.summary() if node.sentinel is not None else None,
        "incoming": node.incoming.snapshot(),  # limits on incoming requests: budget, peak, refusals by reason
        "time": time.time(),
    }


@dataclass
class TrainerRun:
    """How ``agora train`` runs one trainer, beyond the trainer's own options.

    :param shard: (index, count) of the data shard this trainer feeds
    :param max_tokens: stop after this many tokens (None: until stopped)
    :param summary: write a JSON summary here on exit
    :param val_batches: validation microbatches run through the swarm at the end
    :param settle_s: before that validation pass, wait up to this long for every stage to apply what it was sent
        (``Trainer.wait_settled``), so the validation loss covers every trained token (0: validate at once)
    :param eval_every_steps: also validate on the same batches during training, each time every stage has applied
        this many more optimizer steps (``Trainer.validate_every``; 0: only at the end)
    """

    shard: tuple[int, int] = (0, 1)
    max_tokens: Optional[int] = None
    summary: Optional[str] = None
    val_batches: int = 0
    settle_s: float = 0.0
    eval_every_steps: int = 0


async def _train(trainer: Trainer, val, manifest: Manifest, run: TrainerRun) -> dict:
    stop = asyncio.Event()
    install_stop_signals(asyncio.get_running_loop(), stop)
    batches = val.fixed_batches(manifest.batch.microbatch_size, run.val_batches) if run.val_batches else []
    await trainer.start()
    validating = None
    if run.eval_every_steps and batches:
        validating = asyncio.create_task(trainer.validate_every(batches, run.eval_every_steps, stop))
    stats = await trainer.run(stop, max_tokens=run.max_tokens)
    if validating is not None:  # one still under way would compete with the settling and the final pass
        validating.cancel()
        await asyncio.gather(validating, return_exceptions=True)
    trained_at = time.time()
    settled = await trainer.wait_settled(trained_at, run.settle_s) if run.settle_s > 0 else None
    val_loss = None
    if batches:  # a stop signal ends training; the validation pass still runs (bounded by timeouts)
        # With a curve, its last point: the model the run ended with. A failure here (the DHT gone slow or down)
        # loses the validation loss, not the summary of what was trained.
        try:
            val_loss = await (trainer.validate_point(batches, final=True) if run.eval_every_steps
                              else trainer.evaluate(batches))
        except Exception as err:  # noqa: BLE001
            logger.warning(f"validation failed: {err!r}")
    trainer.close()
    return {"val_loss": val_loss, "stats": asdict(stats), "settled": settled,
            "val_batches_done": trainer.val_batches_done}


def run_trainer(manifest: Manifest, initial_peers: Sequence[str], endpoint: Endpoint, options: TrainerOptions,
                run: Optional[TrainerRun] = None) -> int:
    """Feed a data shard into the pipeline until ``max_tokens`` or a stop signal; write the summary."""
    run = run or TrainerRun()
    train, val, _ = build_datasets(manifest)
    shard = train.shard(manifest.seed, *run.shard)
    # A trainer is a client: it announces no address for others to dial.
    dht = make_dht(initial_peers, replace(endpoint, announce_host=None), manifest=manifest,
                   client_mode=True)
    t0 = time.time()
    exit_through_finally_on_sigterm()
    try:
        check_run_manifest(dht, manifest)
        trainer = Trainer(manifest, dht, shard, options)
        try:
            out = asyncio.run(_train(trainer, val, manifest, run))
        finally:
            # The closed loop handed SIGTERM back to the default (die at once): a stop that lands while the
            # summary is written must not lose it.
            _ignore_sigterm_while_leaving()
        result = {
            "role": "trainer",
            "peer_id": str(dht.peer_id),
            "shard": list(run.shard),
            "tokens": out["stats"]["tokens"],
            "microbatches": out["stats"]["counts"],
            "errors": out["stats"]["errors"],
            # Microbatches also sent to a second head because the first was slow, and how many the second won.
            "hedges": trainer.router.hedges if trainer.router is not None else 0,
            "hedges_won": trainer.router.hedges_won if trainer.router is not None else 0,
            # Per head peer: results it delivered to us, and the moving average of its calls' durations (routing's).
            "called": _router_view(trainer.router),
            "loss_curve": out["stats"]["loss_curve"],
            "val_curve": out["stats"]["val_curve"],  # validation during training (``eval_every_steps``) and at the end
            "started_at": trainer.started_at,  # unix time of the loss curve's wall_s = 0
            "val_loss": out["val_loss"],
            "val_batches_done": out["val_batches_done"],  # validation microbatches that got a loss back
            "max_tokens": run.max_tokens,
            "settled": out["settled"],  # the stages applied every trained sample before validation (None: not asked)
            "bytes_sent": trainer.transfer.payload_bytes_sent,
            "wall_s": time.time() - t0,
            "cpu_s": process_cpu_seconds(),
        }
        _write(run.summary, result)
        logger.info(f"trainer done: {result['tokens']} tokens, microbatches {result['microbatches']}")
        return 0
    finally:
        dht.shutdown()


# --------------------------------------------------------------------------- reading a live swarm's model


def download_stages(manifest: Manifest, initial_peers: Sequence[str], timeout: float,
                    identity: Optional[str] = None) -> tuple[list, dict[int, int]]:
    """One replica of every stage of a live swarm (``get_state``), the most advanced serving replica first and
    the next one tried when a download fails: (stages, step of each). Raises ValueError naming a stage that no
    serving peer could provide. Peers serve every stage only to a ``security.state_access.readers`` identity:
    ``identity`` is that key's file."""
    from agora.net.dht import Endpoint

    dht = make_dht(initial_peers, Endpoint(identity=identity), client_mode=True, manifest=manifest, writes=False)
    try:
        return fetch_stages(dht, manifest, timeout)
    finally:
        dht.shutdown()


def fetch_stages(dht, manifest: Manifest, timeout: float) -> tuple[list, dict[int, int]]:
    """``download_stages`` through a DHT client this process already runs."""
    from agora.ops.status import swarm_status

    return asyncio.run(_download_stages(dht, manifest, swarm_status(dht, manifest), timeout))


async def _download_stages(dht, manifest: Manifest, snap: dict, timeout: float) -> tuple[list, dict[int, int]]:
    from agora.net import transport
    from agora.net.state_transfer import fetch_state
    from agora.ops.model_io import stage_from_state

    p2p = await dht.replicate_p2p()
    stages, steps = [], {}
    for st in snap["stages"]:
        index = st["stage"]
        peers = sorted((p for p in st["peers"] if p["state"] == "serving"), key=lambda p: -p["step"])
        if not peers:
            raise ValueError(f"stage {index} has no serving peer in run {manifest.run_id}: nothing to download")
        errors = []
        for peer in peers:
            meta = {"run_id": manifest.run_id, "manifest_hash": manifest.hash, "stage": index}
            logger.info(f"downloading stage {index} from {peer['short_id']} (step {peer['step']})")
            try:
                reply, names, tensors = await fetch_state(p2p, peer["peer_id"], manifest.run_id, meta, timeout,
                                                          params_only=True)
            except transport.RpcError as err:
                errors.append(f"{peer['short_id']}: {err}")
                continue
            stages.append(stage_from_state(manifest, index, names, tensors, int(reply["step"])))
            steps[index] = int(reply["step"])
            break
        else:
            hint = ""
            if any("unauthorized" in e for e in errors):
                hint = (f"; peer {p2p.peer_id} is not a state reader of this run: pass --identity KEYFILE of a peer "
                        f"id listed in the manifest's security.state_access.readers")
            raise ValueError(f"stage {index}: every download failed ({'; '.join(errors)}){hint}")
    return stages, steps


def generate_through_swarm(manifest: Manifest, initial_peers: Sequence[str], prompt_ids: list[int],
                           max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                           seed: Optional[int] = None) -> list[int]:
    """The new token ids after ``prompt_ids``, computed by a live swarm's stages: one generation session pinned to
    one peer per stage (``client.generation``). Raises ValueError for a request that cannot run (checked before
    joining the DHT), ``client.generation.GenerationError`` (an ``RpcError`` naming the stage) when the swarm
    cannot serve it."""
    from agora.client.generation import check_request, generate_in_swarm

    prompt = check_request(manifest, prompt_ids, max_new_tokens, temperature, top_p)
    if max_new_tokens == 0:
        return []
    dht = make_dht(initial_peers, client_mode=True, manifest=manifest, writes=False)
    try:
        return asyncio.run(generate_in_swarm(manifest, dht, prompt, max_new_tokens, temperature, top_p, seed))
    finally:
        dht.shutdown()
