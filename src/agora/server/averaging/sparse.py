"""``sparse`` (SPARTA, METHODS §3): replicas step together, each on its own gradients; every ``H`` steps a
background round averages a seeded ``rho`` slice of parameters and Adam moments, applied ``k`` steps later with the
delta rule.

Why keep the replicas' steps aligned although nothing is averaged per step: a round pairs the replicas that reach
the same multiple of ``H``; replicas left to step on their own drift apart in steps (routing feeds one more than
the other) and then never meet in a round. What is off compared to ``full``: no adoption of the leader's state on
a fingerprint mismatch (replicas legitimately differ), and a state download only for a replica more than ``H``
steps behind (its state too stale for the rounds to pull it back).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

import torch

from agora.compression.sparse import SparseAverager, SparseSnapshot
from agora.net.records import PeerState
from agora.server.averaging.allreduce import GuardedAverager
from agora.server.averaging.sync import ReplicaSync, SyncContext

logger = logging.getLogger("agora.averaging")


class SparseSync(ReplicaSync):
    scheme = "sparse"

    def __init__(self, ctx: SyncContext):
        super().__init__(ctx)
        m, rt = ctx.manifest, ctx.runtime
        self.sparse = SparseAverager(list(rt.stage.named_parameters()), rt.optimizer, seed=(m.run_id, rt.stage_index),
                                     rho=m.averaging.rho, every=m.averaging.every)
        payload = [torch.zeros(self.sparse.payload_numel(), dtype=torch.float64)]
        self.averager = GuardedAverager(payload, ctx.dht, **self.averager_settings())
        self._sparse_task: Optional[asyncio.Task] = None  # the background round in flight (at most one)
        self._samples_since_round = 0  # the weight of this replica in the next round
        self._may_start = False  # no round in flight when the current step began
        self._snapshot: Optional[tuple[SparseSnapshot, int]] = None  # a due round's starting state and epoch

    async def run(self) -> None:
        try:
            await super().run()
        finally:
            if self._sparse_task is not None:  # a background round must not outlive its sync loop (stage move)
                self._sparse_task.cancel()

    async def _tick(self) -> None:
        rt = self.ctx.runtime
        banned = await self.banned_replicas()  # also keeps the ban list fresh for the background rounds
        others = [r for r in await self.replicas() if r.state == PeerState.SERVING.value and r.peer_id not in banned]
        far = [r for r in others if r.step > rt.step + self.sparse.every]
        await self._own_gradient_tick(others, far, f"is more than {self.sparse.every} steps ahead")

    def _before_step(self, samples: int) -> None:
        self._samples_since_round += samples
        self._may_start = self._sparse_task is None or self._sparse_task.done()

    def _after_step(self) -> None:
        step = self.ctx.runtime.step
        if self._may_start and self.sparse.due(step):
            self._snapshot = self.sparse.snapshot(step), self._epoch  # right after the step: the round's start

    def _step_taken(self) -> None:
        if self._snapshot is None:
            return
        (snap, epoch), self._snapshot = self._snapshot, None
        weight, self._samples_since_round = self._samples_since_round, 0
        self._sparse_task = asyncio.create_task(self._sparse_round(snap, weight, epoch),
                                                name=f"sparta-round-{snap.round_index}")

    async def _sparse_round(self, snap: SparseSnapshot, weight: int, epoch: int) -> None:
        """One background round: all-reduce ``snap``'s payload, then apply the delta rule on the compute thread,
        ``k`` steps after the snapshot. Bounded by hivemind's timeouts and a hard deadline; a failed or mismatched
        round is dropped (its partition class comes back ``N`` rounds later)."""
        c = self.ctx
        sent_before, t0 = self.bytes_sent, time.monotonic()
        result = await self._all_reduce(snap, weight)
        rounds = {g.get("round") for g in result.values() if isinstance(g, dict)} if result is not None else set()
        if result is None or len(result) < 2 or rounds != {snap.round_index} or await self._untrusted(result):
            # No group, a group that mixed replicas of different rounds (different partition classes), a banned
            # or an uncertified member: applying it would corrupt our slice; drop it.
            self.rounds_failed += 1
            logger.warning(f"stage {c.stage_index}: SPARTA round {snap.round_index} dropped "
                           f"({'no group' if result is None else f'rounds {sorted(map(str, rounds))}'})")
            return
        with self.averager.get_tensors() as bufs:
            averaged = bufs[0].clone()
        k = await c.run_compute(self._apply, snap, averaged, epoch)
        if k is None:
            self.rounds_failed += 1
            return
        self.rounds_ok += 1
        self.round_bytes.append(self.bytes_sent - sent_before)
        c.log_event("sparse_round", step=c.runtime.step, round=snap.round_index, group=len(result), delay_steps=k,
                    seconds=time.monotonic() - t0)
        logger.info(f"stage {c.stage_index}: SPARTA round {snap.round_index} (part {snap.part}) with {len(result)} "
                    f"replicas applied {k} steps later, {time.monotonic() - t0:.2f}s")

    async def _all_reduce(self, snap: SparseSnapshot, weight: int) -> Optional[dict]:
        try:
            with self.averager.get_tensors() as bufs:
                bufs[0].copy_(snap.payload)
            control = await self._start_round(weight, {"round": snap.round_index})
            return await self._await_round(control, None, self.ctx.averaging_timeout_s)
        except Exception as err:  # a failed round, not a failed node
            logger.warning(f"stage {self.ctx.stage_index}: SPARTA round {snap.round_index} raised {err!r}")
            return None

    def _apply(self, snap: SparseSnapshot, averaged: torch.Tensor, epoch: int) -> Optional[int]:
        """Compute thread: the delta rule, unless our state was replaced by a download meanwhile (the snapshot is
        then of another trajectory). Returns how many steps after the snapshot it was applied."""
        rt = self.ctx.runtime
        if epoch != self._epoch or rt.step < snap.step:
            return None
        k = self.sparse.apply(snap, averaged, rt.step)
        rt.version += 1  # parameters changed in place: the next forward takes a fresh weight snapshot
        rt.parameter_sample = (rt.step, rt.sample_parameters())
        self._set_fingerprint()
        return k
