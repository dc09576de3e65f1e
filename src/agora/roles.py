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
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence

import psutil

from agora.config import Manifest
from agora.net.dht import (
    JoinError,
    check_run_manifest,
    install_stop_signals,
    make_dht,
    publish_manifest,
    visible_maddrs,
)
from agora.net.records import read_swarm

logger = logging.getLogger("agora")


def process_cpu_seconds(pid: Optional[int] = None) -> float:
    """CPU seconds of a process (default: this one) and all its live descendants (hivemind's DHT/averager
    processes, p2pd)."""
    total = 0.0
    me = psutil.Process(pid)
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def _write(path: Optional[str], data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(str(path) + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        os.replace(tmp, path)


def run_bootstrap(manifest: Optional[Manifest], initial_peers: Sequence[str], host: str, port: int,
                  announce_host: Optional[str], identity: Optional[str], maddr_file: Optional[str],
                  certificate: Optional[str] = None) -> int:
    dht = make_dht(initial_peers, host, port, announce_host, identity, manifest=manifest, certificate=certificate)
    maddrs = visible_maddrs(dht)
    print("\n".join(maddrs), flush=True)
    if maddr_file:
        Path(maddr_file).write_text("\n".join(maddrs))
    if manifest is not None:
        check_run_manifest(dht, manifest)

    async def main() -> None:
        stop = asyncio.Event()
        install_stop_signals(asyncio.get_running_loop(), stop)
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


def choose_stage(dht, manifest: Manifest) -> int:
    """The weakest stage, ignoring records that stopped being refreshed (peers that just died)."""
    from agora.net.records import ANNOUNCE_PERIOD_S
    from agora.net.routing import drop_stale, pick_stage

    swarm = read_swarm(dht, manifest.run_id, manifest.n_stages, manifest.hash)
    return pick_stage(drop_stale(swarm, max_age_s=2 * ANNOUNCE_PERIOD_S + 1.5))


def run_node(manifest: Manifest, stage: str, initial_peers: Sequence[str], host: str, port: int,
             announce_host: Optional[str], identity: Optional[str], options, summary: Optional[str] = None,
             resume: Optional[str] = None, metrics_port: Optional[int] = None, attack: Optional[str] = None,
             certificate: Optional[str] = None) -> int:
    from agora.server.checkpoint import load_stage_checkpoint
    from agora.server.node import StageNode

    dht = make_dht(initial_peers, host, port, announce_host, identity, manifest=manifest, certificate=certificate)
    node = None
    exit_through_finally_on_sigterm()
    try:
        check_run_manifest(dht, manifest)
        if stage == "auto":
            # Random jitter so peers started together do not all read the same empty swarm and pick one stage.
            time.sleep(random.uniform(0, 1.0))
            index = choose_stage(dht, manifest)
            logger.info(f"--stage auto chose stage {index}")
        else:
            index = int(stage)
            if not 0 <= index < manifest.n_stages:
                raise JoinError(f"--stage {index} does not exist: the manifest has {manifest.n_stages} stages", 2)
        node = StageNode(manifest, index, dht, options)
        if resume:
            saved = load_stage_checkpoint(resume, manifest, index)
            if saved is None:
                logger.warning(f"--resume {resume}: no checkpoint for stage {index}; starting fresh")
            else:
                node.import_state(*saved)
                logger.info(f"resumed stage {index} at step {node.step} from {resume}")
        if metrics_port is not None:
            from agora.ops.metrics import serve_node_metrics

            serve_node_metrics(node, metrics_port, host=host)  # same interface as the node's listener
        if attack:
            from agora.lab.attacks import install_attack

            install_attack(node, attack)

        async def main() -> None:
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
                    _write(summary, node_summary(node))
                    last_summary = time.monotonic()
            await node.stop()

        asyncio.run(main())
        _write(summary, node_summary(node))
        return 0
    finally:
        dht.shutdown()


def node_summary(node) -> dict:
    sync = node.sync
    return {
        "role": "node",
        "peer_id": node.peer_id,
        "stage": node.stage_index,
        "state": node.state.value,
        "step": node.step,
        "counters": asdict(node.counters),
        "bytes_sent_downstream": node.stats_out.payload_bytes_sent,
        "bytes_received_upstream": node.stats_in.payload_bytes_received,
        "bytes_sent_upstream": node.stats_in.payload_bytes_sent,
        "rounds_ok": sum(s.rounds_ok for s in node._syncs),
        "rounds_failed": sum(s.rounds_failed for s in node._syncs),
        "local_steps": sum(s.local_steps for s in node._syncs),
        "resyncs": sum(s.resyncs for s in node._syncs),
        "aborted_rounds": sum(s.aborted_rounds for s in node._syncs),
        "averaging_bytes_sent": sum(s.bytes_sent for s in node._syncs),
        "moves": node.moves,
        "fingerprint": sync.fingerprint if sync else 0.0,
        "cpu_s": process_cpu_seconds(),
        "events": node.events[-50:],
        # Who this node banned and, per monitored stream, how many messages of each sender it judged (a banned
        # sender is judged no more, so its count is the number of its messages it took to ban it).
        "banned": sorted(node.banned_peers()),
        "sentinel": node.sentinel.summary() if node.sentinel is not None else None,
        "time": time.time(),
    }


def run_trainer(manifest: Manifest, initial_peers: Sequence[str], host: str, port: int,
                identity: Optional[str], shard_index: int, shard_count: int, options,
                max_tokens: Optional[int], summary: Optional[str], val_batches: int = 0,
                certificate: Optional[str] = None) -> int:
    from agora.data import build_datasets
    from agora.client.trainer import Trainer

    train, val, _ = build_datasets(manifest)
    shard = train.shard(manifest.seed, shard_index, shard_count)
    dht = make_dht(initial_peers, host, port, None, identity, client_mode=True, manifest=manifest,
                   certificate=certificate)
    t0 = time.time()
    exit_through_finally_on_sigterm()
    try:
        check_run_manifest(dht, manifest)
        trainer = Trainer(manifest, dht, shard, options)

        async def main() -> dict:
            stop = asyncio.Event()
            install_stop_signals(asyncio.get_running_loop(), stop)
            await trainer.start()
            stats = await trainer.run(stop, max_tokens=max_tokens)
            val_loss = None
            if val_batches:  # a stop signal ends training; the validation pass still runs (bounded by timeouts)
                val_loss = await trainer.evaluate(val.fixed_batches(manifest.batch.microbatch_size, val_batches))
            trainer.close()
            return {"val_loss": val_loss, "stats": asdict(stats)}

        out = asyncio.run(main())
        result = {
            "role": "trainer",
            "peer_id": str(dht.peer_id),
            "shard": [shard_index, shard_count],
            "tokens": out["stats"]["tokens"],
            "microbatches": out["stats"]["counts"],
            "errors": out["stats"]["errors"],
            "loss_curve": out["stats"]["loss_curve"],
            "started_at": trainer.started_at,  # unix time of the loss curve's wall_s = 0
            "val_loss": out["val_loss"],
            "bytes_sent": trainer.transfer.payload_bytes_sent,
            "wall_s": time.time() - t0,
            "cpu_s": process_cpu_seconds(),
        }
        _write(summary, result)
        logger.info(f"trainer done: {result['tokens']} tokens, microbatches {result['microbatches']}")
        return 0
    finally:
        dht.shutdown()
