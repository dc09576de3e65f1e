"""A curvature-driven architecture warm-up (``training.warmup_depth.mode: curvature``) in a swarm: whether the
warm-up clock advances with a step, decided alike by every replica of every stage.

Each stage measures its own curvature every ``curvature_every`` steps and publishes ``lr * lambda`` under the
measurement's step in the DHT. A step reads the measurement ``WARMUP_LAG_STEPS`` or more steps old
(``agora.model.warmup_measurement``): by then every replica has published its own, so every reader sees the same
records and takes the same decision. The decision: hold the clock when the largest stage's value (median over its
replicas) is above ``hold_above`` x the stability threshold in magnitude (a negative value: a negative eigenvalue
dominated the measurement, and the curvature is no smaller for it). No record at all (no stage measured): the clock
advances, as in mode ``steps``. A replica that decides otherwise (a record arrived late) ends up with another depth
than its partners; its parameters then differ, and the fingerprint check downloads a partner's state, clock
included. Why a clock and not a depth: docs/OPTIMIZER.md ("Architecture warm-up").
"""

from __future__ import annotations

import logging
import math
from typing import Optional

from agora.model import warmup_end, warmup_measurement
from agora.net.records import announce, read_subkeys, stage_medians
from agora.optim.curvature import alarm_threshold, warmup_holds

logger = logging.getLogger("agora.warmup")

CURVATURE_TTL_S = 600.0  # read within a few steps of the measurement; then expires on its own


def curvature_key(run_id: str, step: int) -> str:
    return f"{run_id}_curv{step}"


class WarmupBrake:
    """One replica's part in a curvature-driven warm-up.

    :param ctx: the replica's ``SyncContext`` (manifest, runtime, DHT, peer id, DHT thread pool)
    """

    def __init__(self, ctx):
        self.ctx = ctx
        m = ctx.manifest
        warm = m.training.warmup_depth
        self.enabled = warm is not None and warm.mode == "curvature"
        self.limit = warm.hold_above * alarm_threshold(m.optimizer.betas[0]) if self.enabled else math.inf
        self.end = warmup_end(m) if self.enabled else 0
        self.held_steps = 0  # steps this replica took without advancing the warm-up clock
        self.decisions: dict[int, Optional[float]] = {}  # measurement step -> the swarm's value (None: no record)
        self.published = -1  # the last measurement step this replica published

    async def hold(self, step: int) -> bool:
        """Whether optimizer step ``step`` (taken from ``step`` to ``step + 1``) leaves the warm-up clock where it is."""
        rt = self.ctx.runtime
        if not self.enabled or rt.warmup_clock >= self.end:
            return False
        m = warmup_measurement(self.ctx.manifest, step)
        if m is None:
            return False
        if m not in self.decisions:
            self.decisions[m] = await self._swarm_value(m)
            value = self.decisions[m]
            verdict = "holds" if self._holds(value) else "lets"
            logger.info(f"stage {self.ctx.stage_index}: curvature of step {m}: lr x lambda "
                        f"{'unknown' if value is None else f'{value:.3g}'} (limit {self.limit:.3g}): {verdict} the "
                        f"warm-up clock at {rt.warmup_clock}")
        held = self._holds(self.decisions[m])
        self.held_steps += held
        return held

    def _holds(self, value: Optional[float]) -> bool:
        m = self.ctx.manifest
        return warmup_holds(value, m.training.warmup_depth.hold_above, m.optimizer.betas[0])

    async def publish(self) -> None:
        """Publish this replica's latest measurement once (after the step that took it)."""
        c = self.ctx
        curvature = c.runtime.curvature
        if not self.enabled or curvature is None or curvature.last is None:
            return
        step, value = curvature.last
        if step <= self.published:
            return
        self.published = step
        record = {"stage": c.stage_index, "lr_lambda": value, "manifest_hash": c.manifest.hash}
        try:
            await c.run_io(announce, c.dht, curvature_key(c.manifest.run_id, step), c.peer_id, record,
                           CURVATURE_TTL_S)
        except Exception as err:  # noqa: BLE001 (the DHT is slow or down: the other replicas' records decide)
            logger.warning(f"stage {c.stage_index}: could not publish the curvature of step {step}: {err!r}")

    async def _swarm_value(self, m: int) -> Optional[float]:
        """The value of the stage whose median over its replicas of ``lr * lambda`` measured at step ``m`` is largest
        in magnitude."""
        c = self.ctx
        try:
            found = await c.run_io(read_subkeys, c.dht, curvature_key(c.manifest.run_id, m))
        except Exception as err:  # noqa: BLE001 (decided as if nobody measured: the clock advances)
            logger.warning(f"stage {c.stage_index}: could not read the curvature of step {m}: {err!r}")
            return None
        medians = stage_medians(found, c.manifest.hash, c.manifest.n_stages, "lr_lambda")
        return max(medians.values(), key=abs) if medians else None

    def summary(self) -> dict:
        return {"mode": "curvature", "clock": self.ctx.runtime.warmup_clock, "end": self.end,
                "held_steps": self.held_steps, "limit": self.limit}
