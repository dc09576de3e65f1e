"""Per-stage data parallelism: replicas of a stage average gradients and step together.

Why not ``hivemind.Optimizer``: its progress tracker extrapolates when the swarm will reach the target batch, so
replicas sometimes step on partial batches at different moments and drift apart. Here the decision is made from
facts: each replica announces (step, samples accumulated) in its DHT record; when the replicas at our step
together hold the target batch, every one of them joins an all-reduce (hivemind's ``DecentralizedAverager``,
butterfly all-reduce, weights = samples) and applies the same averaged gradient.

Averaging happens in float64. hivemind applies the result as ``local += (average - local)``; in float32 that
leaves replicas a rounding error apart, in float64 the error vanishes when cast back to float32, so replicas stay
bit-identical.

Repair instead of hope: a replica that finds another one ahead of it, or one at the same step with different
parameters (a failed round, a missed step), downloads the full state from it. Joining peers do the same.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING, Optional

import torch
from hivemind.averaging import DecentralizedAverager

from agora.swarm import transport
from agora.swarm.records import PeerState, StageRecord, read_stage
from agora.swarm.transport import RpcError

if TYPE_CHECKING:
    from agora.swarm.node import StageNode

logger = logging.getLogger("agora.averaging")

POLL_S = 0.3
ZERO_SAMPLE_WEIGHT = 1e-6  # hivemind requires positive weights; this keeps an empty replica's influence < fp32 eps


def parameter_fingerprint(module: torch.nn.Module) -> float:
    """An exact checksum of the parameters: equal floats iff (almost surely) equal parameters."""
    with torch.no_grad():
        total = 0.0
        for i, p in enumerate(module.parameters()):
            total += float(p.double().sum()) * (1 + i * 1e-3) + float(p.double().abs().sum()) * 1e-7
        return total


class ReplicaSync:
    def __init__(self, node: "StageNode"):
        self.node = node
        m = node.manifest
        self.target = m.batch.target_batch_size
        self.prefix = f"{m.run_id}_s{node.stage_index}_{m.hash}_grads"  # no dots: hivemind splits keys on '.'
        self.buffers = [torch.zeros_like(p, dtype=torch.float64) for p in node.stage.parameters()]
        self.averager = DecentralizedAverager(
            self.buffers,
            node.dht,
            start=True,
            prefix=self.prefix,
            min_group_size=2,
            min_matchmaking_time=1.0,
            request_timeout=0.5,  # below min_matchmaking_time, else matchmaking can deadlock
            allreduce_timeout=node.opts.averaging_timeout_s,
            next_chunk_timeout=5.0,
            allow_state_sharing=False,
            shutdown_timeout=2,
        )
        self.fingerprint = parameter_fingerprint(node.stage)
        self.rounds_ok = 0
        self.rounds_failed = 0
        self.local_steps = 0
        self.resyncs = 0
        self.round_durations: list[float] = []
        self._announced_samples, self._announced_at = 0, 0.0
        self.averaging_step = -1
        self.round_observers: list = []  # called with (ok: bool, seconds: float, group_size: int)

    def shutdown(self) -> None:
        try:
            self.averager.shutdown()
        except Exception as err:  # already gone: nothing left to release
            logger.debug(f"averager shutdown: {err!r}")

    # ------------------------------------------------------------------ helpers
    async def replicas(self) -> list[StageRecord]:
        n = self.node
        recs = await n.run_io(read_stage, n.dht, n.manifest.run_id, n.stage_index, n.manifest.hash)
        return [r for r in recs if r.peer_id != n.peer_id]

    async def download_from(self, peer: StageRecord, timeout: float = 60.0) -> bool:
        """Copy parameters + optimizer state + step from ``peer``; bounded by ``timeout``."""
        n = self.node
        meta = {"run_id": n.manifest.run_id, "manifest_hash": n.manifest.hash, "stage": n.stage_index}
        t0 = time.monotonic()
        try:
            reply, tensors = await transport.call(n._p2p, peer.peer_id, n.manifest.run_id, "get_state", meta, [], timeout)
        except RpcError as err:
            logger.warning(f"state download from {peer.peer_id[-8:]} failed: {err}")
            return False
        await n.run_compute(n.import_state, reply["step"], reply["names"], tensors)
        self.fingerprint = await n.run_compute(parameter_fingerprint, n.stage)
        self.resyncs += 1
        n.log_event("synced", source=peer.peer_id, step=n.step, seconds=time.monotonic() - t0)
        logger.info(f"stage {n.stage_index}: loaded step {n.step} from {peer.peer_id[-8:]} in {time.monotonic() - t0:.1f}s")
        return True

    async def initial_sync(self, attempts: int = 3) -> None:
        """A joining peer takes the state of the freshest serving replica; the first replica starts from the seed."""
        for _ in range(attempts):
            serving = [r for r in await self.replicas() if r.state == PeerState.SERVING.value]
            if not serving or max(r.step for r in serving) <= self.node.step:
                return
            best = max(r.step for r in serving)
            if await self.download_from(random.choice([r for r in serving if r.step == best])):
                return
        logger.warning(f"stage {self.node.stage_index}: could not download state after {attempts} attempts; "
                       f"serving from step {self.node.step}, will resync when a replica answers")

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        n = self.node
        while True:
            await asyncio.sleep(POLL_S)
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # keep the node alive; the next tick retries with fresh records
                logger.warning(f"stage {n.stage_index} sync tick failed: {err!r}", exc_info=True)

    async def _tick(self) -> None:
        n = self.node
        if n.state == PeerState.LEAVING:
            return
        others = [r for r in await self.replicas() if r.state in (PeerState.SERVING.value, PeerState.SYNCING.value)]
        ahead = [r for r in others if r.step > n.step and r.state == PeerState.SERVING.value]
        if ahead:
            best = max(r.step for r in ahead)
            logger.info(f"stage {n.stage_index}: replica at step {best} is ahead of our {n.step}; resyncing")
            await self.download_from(random.choice([r for r in ahead if r.step == best]))
            return
        same = [r for r in others if r.step == n.step and r.state == PeerState.SERVING.value]
        diverged = [r for r in same if r.fingerprint != self.fingerprint and r.peer_id < n.peer_id and r.samples == 0]
        if diverged and n.samples == 0:
            logger.warning(f"stage {n.stage_index}: parameters differ from replica {diverged[0].peer_id[-8:]} at "
                           f"step {n.step}; adopting its state")
            await self.download_from(diverged[0])
            return
        if any(r.averaging_step == n.step for r in same):
            # A replica started the round for our step: join it, even with nothing accumulated, so that every
            # replica applies the same update (a zero-sample member carries a negligible weight).
            await self.round(len(same))
            return
        if n.samples == 0:
            return
        if n.samples != self._announced_samples and time.monotonic() - self._announced_at > 0.5:
            # Replicas decide from each other's sample counts: keep ours fresh while we accumulate.
            self._announced_samples, self._announced_at = n.samples, time.monotonic()
            await n.announce()
        total = n.samples + sum(r.samples for r in same)
        stalled = time.monotonic() - n.last_sample_time > n.opts.stall_step_s
        if total >= self.target or stalled:
            await self.round(len(same), stalled=stalled and total < self.target)

    async def round(self, n_others: int, stalled: bool = False) -> None:
        n = self.node
        t0 = time.monotonic()
        samples, grads = await n.run_compute(n.take_gradients)
        averaged: Optional[list[torch.Tensor]] = None
        group = 1
        if n_others > 0:
            self.averaging_step = n.step
            await n.announce()  # tells replicas to join now, instead of when their own counts catch up
            with self.averager.get_tensors() as bufs:
                for b, g in zip(bufs, grads):
                    b.copy_(g)
            try:
                result = await n.run_io(
                    lambda: self.averager.step(
                        weight=max(float(samples), ZERO_SAMPLE_WEIGHT), gather={"step": n.step, "samples": samples},
                        timeout=n.opts.averaging_timeout_s, allow_retries=True,
                    )
                )
            except Exception as err:  # hivemind raises when no group formed; that is a failed round, not a crash
                logger.warning(f"stage {n.stage_index}: averaging failed: {err!r}")
                result = None
            finally:
                self.averaging_step = -1
            if result is not None:
                group = len(result)
                steps = {g.get("step") for g in result.values() if isinstance(g, dict)}
                if len(steps) > 1:
                    logger.warning(f"stage {n.stage_index}: averaged with replicas at steps {sorted(steps)}")
                with self.averager.get_tensors() as bufs:
                    averaged = [b.clone() for b in bufs]
                self.rounds_ok += 1
            else:
                self.rounds_failed += 1
                logger.warning(f"stage {n.stage_index}: all-reduce with {n_others} replicas failed; stepping locally")
        if averaged is None:
            averaged = grads
            self.local_steps += 1
        await n.run_compute(n.apply_step, [g.float() for g in averaged])
        self.fingerprint = await n.run_compute(parameter_fingerprint, n.stage)
        dt = time.monotonic() - t0
        self.round_durations.append(dt)
        del self.round_durations[:-100]
        for observe in self.round_observers:
            observe(n_others == 0 or group > 1, dt, group)
        n.log_event("step", step=n.step, samples=samples, group=group, seconds=dt, stalled=stalled)
        logger.info(f"stage {n.stage_index}: step {n.step} ({samples} local samples, group of {group}, {dt:.2f}s)")
        await n.announce()
