"""``full``: replicas at one step all-reduce their float64 gradients and apply the same average.

Why float64: hivemind applies the result as ``local += (average - local)``; in float32 that leaves replicas a
rounding error apart, in float64 the error vanishes when cast back to float32, so replicas stay bit-identical and a
fingerprint mismatch at one step means a real divergence (a failed round, a local fallback step), repaired by
adopting the state of one replica that averaged (``repair_source``). Replicas whose steps round differently
(another device or optimizer kernel) agree when their sampled parameters are within
``averaging.agreement_tolerance`` (``ReplicaSync.agrees_with``).
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from agora.net.records import PeerState, StageRecord
from agora.server.averaging.allreduce import GuardedAverager
from agora.server.averaging.sync import ReplicaSync, SyncContext

logger = logging.getLogger("agora.averaging")

# How long a replica holds its step for replicas behind it (a state download of a 100M-parameter stage takes
# 20-40 s on a loaded 2-core machine, seconds on a real one).
CATCH_UP_WAIT_S = 45.0


def repair_source(replicas: list[StageRecord], me: str, fell_back: bool, step: int) -> Optional[StageRecord]:
    """Whose state the replicas at ``step`` adopt when their parameters differ (None: ours, we are the source).

    The smallest peer id among the replicas that averaged that step, ourselves included; among all of them only
    when none did. A replica whose round failed took a step on its own gradients (``fell_back``; a record's
    ``fallback_step``), and one whose all-reduce came back with parts missing counts as failed: taking the smallest
    id among all had the replicas that applied the true average adopt such a partly local step about half the time
    (2026-12-05). Every replica computes the same choice from the same records, so they converge on one state."""
    averaged = [r for r in replicas if r.fallback_step != step]
    if not fell_back:
        pool = [(r.peer_id, r) for r in averaged] + [(me, None)]
    elif averaged:
        pool = [(r.peer_id, r) for r in averaged]
    else:
        pool = [(r.peer_id, r) for r in replicas] + [(me, None)]
    return min(pool, key=lambda item: item[0])[1]


class FullSync(ReplicaSync):
    scheme = "full"
    # The float32 gradients go into the float64 buffers as they are (exact); a float64 copy first would be one more
    # stage-sized allocation at the moment every buffer is live.
    gradient_dtype = torch.float32

    def __init__(self, ctx: SyncContext):
        super().__init__(ctx)
        self.averager = self._make_averager()
        self._catch_up_step, self._catch_up_since, self._catch_up_logged = -1, 0.0, False
        self._gave_up_on: dict[str, int] = {}  # replica -> the step at which we last stopped waiting for it

    def _make_averager(self, prefix: Optional[str] = None):
        """A float64 gradient averager; ``prefix``: another matchmaking prefix than the stage's (``powersgd``'s
        dense steps)."""
        gradients = [torch.zeros_like(p, dtype=torch.float64) for p in self.ctx.runtime.stage.parameters()]
        settings = {**self.averager_settings(), "prefix": prefix or self.prefix}
        return GuardedAverager(gradients, self.ctx.dht, **settings)

    def _load_buffers(self, grads: list[torch.Tensor], step: int) -> None:
        with self.averager.get_tensors() as bufs:
            for b, g in zip(bufs, grads):
                b.copy_(g)

    def _averaged(self) -> list[torch.Tensor]:
        # Cast to the parameters' float32 here (the step casts anyway): half the transient memory of a float64 clone.
        with self.averager.get_tensors() as bufs:
            return [b.float() for b in bufs]

    async def _tick(self) -> None:
        c, rt = self.ctx, self.ctx.runtime
        others = [r for r in await self.replicas() if r.state in (PeerState.SERVING.value, PeerState.SYNCING.value)]
        ahead = [r for r in others if r.step > rt.step and r.state == PeerState.SERVING.value]
        if ahead:
            best = max(r.step for r in ahead)
            logger.info(f"stage {c.stage_index}: replica at step {best} is ahead of our {rt.step}; resyncing")
            await self.download_from_any([r for r in ahead if r.step == best])
            return
        banned = await self.banned_replicas()
        same = [r for r in others if r.step == rt.step and r.state == PeerState.SERVING.value
                and r.peer_id not in banned]
        averaging = any(r.averaging_step == rt.step for r in same)
        if not averaging and self.fingerprint_valid:
            # Same step, different parameters (a broken round, a local fallback step): everyone adopts the state of
            # one replica (``repair_source``). No round is running for this step, so none is cut short.
            leader = repair_source([r for r in same if r.fingerprint], c.peer_id, self.fallback_step == rt.step,
                                   rt.step)
            if leader is not None and self.agrees_with(leader) is False:
                d = self.agreement_distance
                distance = "" if d is None else f" (sampled distance {d:.2g})"
                logger.warning(f"stage {c.stage_index}: parameters differ from replica {leader.peer_id[-8:]} at "
                               f"step {rt.step}{distance}; adopting its state")
                await self.download_from_any([leader], keep_grads=True)
                return
        if averaging:
            # A replica started the round for our step: join it, even with nothing accumulated, so that every
            # replica applies the same update (a zero-sample member carries a negligible weight).
            await self.round(len(same))
            return
        if rt.samples == 0:
            return
        behind = [r for r in others if r.state == PeerState.SERVING.value and r.step < rt.step
                  and r.peer_id not in banned and rt.step - self._gave_up_on.get(r.peer_id, -10**9) > 10]
        if behind and self._waiting_for(behind, rt.step):
            return
        await self._step_when_ready(sum(r.samples for r in same), n_others=len(same),
                                    others_admitted=sum(r.admitted for r in same))

    def _waiting_for(self, behind: list, step: int) -> bool:
        """Whether to hold our step for replicas behind us, which are downloading our state (or finishing the
        round we finished first): at most ``CATCH_UP_WAIT_S`` per step. Stepping on would leave them behind again
        by the time their download lands, and a replica that downloads every step never averages."""
        now = time.monotonic()
        if self._catch_up_step != step:
            self._catch_up_step, self._catch_up_since, self._catch_up_logged = step, now, False
        waited = now - self._catch_up_since
        if waited > 5.0 and not self._catch_up_logged:  # a partner a second behind is the usual case: no log
            self._catch_up_logged = True
            logger.info(f"stage {self.ctx.stage_index}: waiting up to {CATCH_UP_WAIT_S:.0f}s for "
                        f"{', '.join(r.peer_id[-8:] for r in behind)} (behind step {step}) to catch up")
        if waited < CATCH_UP_WAIT_S:
            return True
        logger.warning(f"stage {self.ctx.stage_index}: stepping without {', '.join(r.peer_id[-8:] for r in behind)}, "
                       f"still behind step {step} after {CATCH_UP_WAIT_S:.0f}s")
        for r in behind:  # a replica that did not catch up in time is not waited for again for 10 steps
            self._gave_up_on[r.peer_id] = step
        return False
