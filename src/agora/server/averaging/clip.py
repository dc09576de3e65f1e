"""Gradient clipping by the global norm across stages, as a centralized run clips the whole model's gradient.

No stage holds the whole gradient, so each stage publishes the squared norm of its (averaged) gradient for a step
in the DHT and waits for the other stages' of the same step; every stage then scales by
``min(1, clip / (global_norm + 1e-6))``, the factor ``torch.nn.utils.clip_grad_norm_`` applies to the whole model.
A tied embedding counts once (the head's copy). A stage whose peers' norms do not all arrive within ``wait_s``
(a stage stuck or far behind), or that misses a stage nobody serves, clips by its own norm, as before, and counts a
fallback. Why: docs/AVERAGING.md
("Global-norm clipping").
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Optional

import torch

from agora.net.records import PeerState, announce, read_stage, read_subkeys, stage_medians

logger = logging.getLogger("agora.averaging")

NORM_TTL_S = 120.0  # a step's norms are read within seconds; they expire on their own
POLL_S = 0.05
EMPTY_CHECK_S = 0.5  # after this long (and as often), check whether a stage whose norm is missing has any peer
EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def gradnorm_key(run_id: str, step: int) -> str:
    return f"{run_id}_gradnorm{step}"


def squared_norm(grads: list[torch.Tensor], skip: Optional[int] = None) -> float:
    """Sum of squares of ``grads`` (float64 accumulation), leaving out ``grads[skip]``."""
    return float(sum(g.double().pow(2).sum() for i, g in enumerate(grads) if i != skip))


def clip_scale(total_squared_norm: float, clip: float) -> float:
    return min(1.0, clip / (math.sqrt(total_squared_norm) + EPS))


class GlobalClip:
    """One replica's share of global-norm clipping.

    :param ctx: the replica's ``SyncContext`` (manifest, DHT, peer id, DHT thread pool)
    :param tied_index: the position of this stage's tied-embedding copy among its parameters, or None; the tail
      leaves it out of its norm, the head counts it
    :param wait_s: how long to wait for the other stages' norms of a step before clipping by our own
    """

    def __init__(self, ctx, tied_index: Optional[int], wait_s: float = 10.0):
        self.ctx = ctx
        m = ctx.manifest
        self.n_stages, self.clip = m.n_stages, m.optimizer.grad_clip
        self.skip = tied_index if (tied_index is not None and ctx.runtime.is_tail) else None
        self.wait_s = wait_s
        self.global_steps = 0  # steps clipped by the global norm
        self.scaled_steps = 0  # of those, steps whose global norm was above the clip (gradients scaled down)
        self.fallbacks = 0  # steps clipped by this stage's own norm because other stages' norms were missing

    async def scale(self, step: int, grads: list[torch.Tensor]) -> Optional[float]:
        """The factor to scale this step's gradient by, or None to clip by this stage's own norm (fallback)."""
        c = self.ctx
        own = await c.run_compute(squared_norm, grads, self.skip)
        if self.n_stages == 1:
            return self._counted(clip_scale(own, self.clip))
        key = gradnorm_key(c.manifest.run_id, step)
        value = {"stage": c.stage_index, "sq_norm": own, "manifest_hash": c.manifest.hash}
        try:
            await c.run_io(announce, c.dht, key, c.peer_id, value, NORM_TTL_S)
        except Exception as err:  # noqa: BLE001 (the DHT is slow or down: clip by our own norm)
            logger.warning(f"stage {c.stage_index}: could not publish the gradient norm of step {step}: {err!r}")
        start = time.monotonic()
        next_check = start + EMPTY_CHECK_S
        while True:
            norms = await self._read(key)
            if len(norms) == self.n_stages:
                return self._counted(clip_scale(sum(norms.values()), self.clip))
            missing = sorted(set(range(self.n_stages)) - set(norms))
            now = time.monotonic()
            if now > start + self.wait_s:
                return self._fallback(step, f"no gradient norm of stage(s) {missing} within {self.wait_s:g}s")
            if now > next_check:  # a stage nobody serves will never report: do not wait for it
                next_check = now + EMPTY_CHECK_S
                empty = await self._unserved(missing)
                if empty:
                    return self._fallback(step, f"stage(s) {empty} have no serving peer")
            await asyncio.sleep(POLL_S)

    async def others_reported(self, step: int) -> bool:
        """Whether every other stage has published its gradient norm of ``step``, i.e. has collected that step's
        whole batch and averaged it (``ReplicaSync._left_behind`` uses it to tell lost samples from slow ones)."""
        if self.n_stages == 1:
            return False
        norms = await self._read(gradnorm_key(self.ctx.manifest.run_id, step))
        return set(range(self.n_stages)) - {self.ctx.stage_index} <= set(norms)

    def _fallback(self, step: int, why: str) -> None:
        self.fallbacks += 1
        logger.warning(f"stage {self.ctx.stage_index}: step {step} clipped by this stage's own norm: {why}")
        return None

    async def _unserved(self, stages: list[int]) -> list[int]:
        """Those of ``stages`` without a serving peer in the DHT now (an unreadable stage counts as served)."""
        c, empty = self.ctx, []
        for stage in stages:
            try:
                records = await c.run_io(read_stage, c.dht, c.manifest.run_id, stage, c.manifest.hash)
            except Exception:  # noqa: BLE001 (a slow read: keep waiting until the deadline)
                continue
            if not any(r.state == PeerState.SERVING.value for r in records):
                empty.append(stage)
        return empty

    def _counted(self, scale: float) -> float:
        self.global_steps += 1
        self.scaled_steps += scale < 1.0
        return scale

    async def _read(self, key: str) -> dict[int, float]:
        """{stage: squared norm} from the records of ``key``; replicas of a stage that disagree (one stepped
        without averaging) are summarised by their median, so one replica cannot set its stage's norm alone."""
        c = self.ctx
        try:
            found = await c.run_io(read_subkeys, c.dht, key)
        except Exception:  # noqa: BLE001 (a slow read: try again until the deadline)
            return {}
        return stage_medians(found, c.manifest.hash, self.n_stages, "sq_norm", minimum=0.0)
