"""Gradient clipping by the global norm across stages, as a centralized run clips the whole model's gradient.

No stage holds the whole gradient, so each stage publishes the norms of its (averaged) gradient for a step in the
DHT (each tensor's fp32 norm, and their squared sum) and waits for the other stages' of the same step; every stage
then scales by ``min(1, clip / (global_norm + 1e-6))``, the factor ``torch.nn.utils.clip_grad_norm_`` applies to
the whole model, computed from the tensors' norms in the model's order by the same float32 operations, so that
from the same gradients the factor is bit for bit the centralized one. A tied embedding counts once (the head's
copy). A stage whose peers' norms do not all arrive within ``wait_s`` (a stage stuck), or that misses a stage nobody
serves or whose every serving peer is at least ``FAR_STEPS`` steps from this one (it restarted without its state),
clips by its own norm, as before, and counts a fallback. Why: docs/AVERAGING.md ("Global-norm clipping").
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Collection, Optional

import torch

from agora.net.records import PeerState, announce, read_subkeys, stage_medians

logger = logging.getLogger("agora.averaging")

NORM_TTL_S = 120.0  # a step's norms are read within seconds; they expire on their own
POLL_S = 0.05
EMPTY_CHECK_S = 0.5  # after this long (and as often), check whether a stage whose norm is missing has any peer
# A stage whose every serving peer announces a step this far from ours will not publish our step's norm: while we
# clip step s every stage holds batch s (none takes it before stepping s - 1, none steps s + 1 before we pass it on),
# so its peers are at s or s + 1, and a record read within one step of its announcement is at most one behind. A
# stage that restarted from step 0 in a running swarm (its last replica died) stays that far behind for good.
FAR_STEPS = 2
EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s
# Tensor norms a stage publishes at most: 9 bytes each in a record limited to MAX_VALUE_BYTES (8 KiB, signature and
# certificate included). A stage of agora-8b has ~60 tensors; a stage with more publishes only its squared norm,
# and every stage then computes the factor from the float64 squared norms (the same factor up to float rounding).
MAX_NORMS = 512


def gradnorm_key(run_id: str, step: int) -> str:
    return f"{run_id}_gradnorm{step}"


def clip_scale(total_squared_norm: float, clip: float) -> float:
    """The clipping factor from a float64 squared norm (a stage's own, or stages' that sent no tensor norms)."""
    return min(1.0, clip / (math.sqrt(total_squared_norm) + EPS))


def tensor_norms(grads: list[torch.Tensor], skip: Collection[int] = ()) -> list[float]:
    """Each gradient's L2 norm, computed as ``torch.nn.utils.get_total_norm`` computes a tensor's (float32, the
    dtype a step applies), leaving out the positions in ``skip``."""
    return [float(torch.linalg.vector_norm(g.float(), 2.0)) for i, g in enumerate(grads) if i not in skip]


def clip_scale_of_norms(norms: list[float], clip: float) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s factor from every tensor's norm, in the model's parameter order: the
    same float32 operations on the same values, so the same bits (the order matters: a sum of floats rounds by it)."""
    total = torch.linalg.vector_norm(torch.tensor(norms, dtype=torch.float32), 2.0)
    return float(torch.clamp(clip / (total + EPS), max=1.0))


def checked_norms(value: Any, sq_norm: float) -> Optional[list[float]]:
    """A published list of tensor norms if it is well-formed and adds up to the published squared norm."""
    norms = value.get("norms") if isinstance(value, dict) else None
    if not isinstance(norms, list) or len(norms) > MAX_NORMS:
        return None
    if not all(isinstance(n, (int, float)) and math.isfinite(n) and n >= 0 for n in norms):
        return None
    total = math.fsum(float(n) * float(n) for n in norms)
    return [float(n) for n in norms] if math.isclose(total, sq_norm, rel_tol=1e-9, abs_tol=1e-30) else None


def exact_norms(found: dict[str, Any], medians: dict[int, float], manifest_hash: str) -> Optional[list[float]]:
    """Every stage's tensor norms in stage order, from a record of each stage whose squared norm is its stage's
    median (the first by peer id: every reader picks the same), or None when a stage has no such record (its
    replicas disagree, or a peer sent no list): the caller then uses the medians."""
    out: list[float] = []
    for stage in sorted(medians):
        chosen = None
        for peer in sorted(found):
            value = found[peer]
            if isinstance(value, dict) and value.get("manifest_hash") == manifest_hash \
                    and value.get("stage") == stage and value.get("sq_norm") == medians[stage]:
                chosen = checked_norms(value, medians[stage])
                if chosen is not None:
                    break
        if chosen is None:
            return None
        out.extend(chosen)
    return out


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

    async def scale(self, step: int, grads: list[torch.Tensor], inactive: Collection[int] = ()) -> Optional[float]:
        """The factor to scale this step's gradient by, or None to clip by this stage's own norm (fallback).
        ``inactive``: positions of parameters a step leaves out (blocks the architecture warm-up bypasses: a
        centralized run has no gradient for them, so they are not in its norm)."""
        c = self.ctx
        skip = set(inactive) | ({self.skip} if self.skip is not None else set())
        norms = await c.run_compute(tensor_norms, grads, skip)
        own = math.fsum(n * n for n in norms)
        if self.n_stages == 1:
            return self._counted(clip_scale_of_norms(norms, self.clip) if math.isfinite(own)
                                 else clip_scale(own, self.clip))
        key = gradnorm_key(c.manifest.run_id, step)
        value = {"stage": c.stage_index, "sq_norm": own, "manifest_hash": c.manifest.hash}
        if len(norms) <= MAX_NORMS:
            value["norms"] = norms
        try:
            await c.run_io(announce, c.dht, key, c.peer_id, value, NORM_TTL_S)
        except Exception as err:  # noqa: BLE001 (the DHT is slow or down: clip by our own norm)
            logger.warning(f"stage {c.stage_index}: could not publish the gradient norm of step {step}: {err!r}")
        start = time.monotonic()
        next_check = start + EMPTY_CHECK_S
        while True:
            found = await self._found(key)
            medians = self._medians(found)
            if len(medians) == self.n_stages:
                exact = exact_norms(found, medians, c.manifest.hash)
                return self._counted(clip_scale_of_norms(exact, self.clip) if exact is not None
                                     else clip_scale(sum(medians.values()), self.clip))
            missing = sorted(set(range(self.n_stages)) - set(medians))
            now = time.monotonic()
            if now > start + self.wait_s:
                return self._fallback(step, f"no gradient norm of stage(s) {missing} within {self.wait_s:g}s")
            if now > next_check:  # a stage nobody serves, or serves at another step, will never report this one
                next_check = now + EMPTY_CHECK_S
                empty, far = await self._not_coming(missing, step)
                if empty:
                    return self._fallback(step, f"stage(s) {empty} have no serving peer")
                if far:
                    return self._fallback(step, "stage(s) " + ", ".join(f"{s} (at step {at})" for s, at in far)
                                          + f" are {FAR_STEPS}+ steps from this one")
            await asyncio.sleep(POLL_S)

    async def others_reported(self, step: int) -> bool:
        """Whether every other stage has published its gradient norm of ``step``, i.e. has collected that step's
        whole batch and averaged it (``ReplicaSync._left_behind`` uses it to tell lost samples from slow ones)."""
        if self.n_stages == 1:
            return False
        medians = self._medians(await self._found(gradnorm_key(self.ctx.manifest.run_id, step)))
        return set(range(self.n_stages)) - {self.ctx.stage_index} <= set(medians)

    def _fallback(self, step: int, why: str) -> None:
        self.fallbacks += 1
        logger.warning(f"stage {self.ctx.stage_index}: step {step} clipped by this stage's own norm: {why}")
        return None

    async def _not_coming(self, stages: list[int], step: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Of ``stages``: those without a serving peer in the DHT now, and (stage, nearest step) of those whose every
        serving peer is ``FAR_STEPS`` or more steps from ``step`` (an unreadable stage counts as served and near)."""
        c, empty, far = self.ctx, [], []
        for stage in stages:
            try:
                records = await c.records.get(stage)  # now (or a read of it under way, shared with the node)
            except Exception:  # noqa: BLE001 (a slow read: keep waiting until the deadline)
                continue
            steps = [r.step for r in records if r.state == PeerState.SERVING.value]
            if not steps:
                empty.append(stage)
            elif all(abs(s - step) >= FAR_STEPS for s in steps):
                far.append((stage, min(steps, key=lambda s: abs(s - step))))
        return empty, far

    def _counted(self, scale: float) -> float:
        self.global_steps += 1
        self.scaled_steps += scale < 1.0
        return scale

    async def _found(self, key: str) -> dict[str, Any]:
        """The records of ``key`` by peer id (empty on a slow read: the caller tries again until its deadline)."""
        c = self.ctx
        try:
            return await c.run_io(read_subkeys, c.dht, key)
        except Exception:  # noqa: BLE001 (a slow read: try again until the deadline)
            return {}

    def _medians(self, found: dict[str, Any]) -> dict[int, float]:
        """{stage: squared norm}; replicas of a stage that disagree (one stepped without averaging) are summarised
        by their median, so one replica cannot set its stage's norm alone."""
        return stage_medians(found, self.ctx.manifest.hash, self.n_stages, "sq_norm", minimum=0.0)
