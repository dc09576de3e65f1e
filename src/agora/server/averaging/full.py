"""``full``: replicas at one step all-reduce their float64 gradients and apply the same average.

Why float64: hivemind applies the result as ``local += (average - local)``; in float32 that leaves replicas a
rounding error apart, in float64 the error vanishes when cast back to float32, so replicas stay bit-identical and a
fingerprint mismatch at one step means a real divergence (a failed round, a local fallback step), repaired by
adopting the state of the replica with the smallest peer id.
"""

from __future__ import annotations

import logging
import random

import torch

from agora.net.records import PeerState
from agora.server.averaging.allreduce import GuardedAverager
from agora.server.averaging.sync import ReplicaSync, SyncContext

logger = logging.getLogger("agora.averaging")


class FullSync(ReplicaSync):
    scheme = "full"

    def __init__(self, ctx: SyncContext):
        super().__init__(ctx)
        self.averager = self._make_averager()

    def _make_averager(self):
        gradients = [torch.zeros_like(p, dtype=torch.float64) for p in self.ctx.runtime.stage.parameters()]
        return GuardedAverager(gradients, self.ctx.dht, **self.averager_settings())

    def _load_buffers(self, grads: list[torch.Tensor], step: int) -> None:
        with self.averager.get_tensors() as bufs:
            for b, g in zip(bufs, grads):
                b.copy_(g)

    def _averaged(self) -> list[torch.Tensor]:
        with self.averager.get_tensors() as bufs:
            return [b.clone() for b in bufs]

    async def _tick(self) -> None:
        c, rt = self.ctx, self.ctx.runtime
        others = [r for r in await self.replicas() if r.state in (PeerState.SERVING.value, PeerState.SYNCING.value)]
        ahead = [r for r in others if r.step > rt.step and r.state == PeerState.SERVING.value]
        if ahead:
            best = max(r.step for r in ahead)
            logger.info(f"stage {c.stage_index}: replica at step {best} is ahead of our {rt.step}; resyncing")
            await self.download_from(random.choice([r for r in ahead if r.step == best]))
            return
        banned = await self.banned_replicas()
        same = [r for r in others if r.step == rt.step and r.state == PeerState.SERVING.value
                and r.peer_id not in banned]
        averaging = any(r.averaging_step == rt.step for r in same)
        if not averaging and self.fingerprint_valid:
            # Same step, different parameters (a broken round, a local fallback step): everyone adopts the state of
            # the replica with the smallest peer id. No round is running for this step, so none is cut short.
            known = [r for r in same if r.fingerprint]
            leader = min(known, key=lambda r: r.peer_id, default=None)
            if leader is not None and leader.peer_id < c.peer_id and leader.fingerprint != self.fingerprint:
                logger.warning(f"stage {c.stage_index}: parameters differ from replica {leader.peer_id[-8:]} at "
                               f"step {rt.step}; adopting its state")
                await self.download_from(leader, keep_grads=True)
                return
        if averaging:
            # A replica started the round for our step: join it, even with nothing accumulated, so that every
            # replica applies the same update (a zero-sample member carries a negligible weight).
            await self.round(len(same))
            return
        if rt.samples == 0:
            return
        await self._step_when_ready(sum(r.samples for r in same), n_others=len(same))
