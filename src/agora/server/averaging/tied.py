"""Tied embeddings across two stages: the head's embedding and the tail's LM head stay one matrix.

Head and tail are different peers, so each holds a copy. At every step, after its own replicas averaged, each end
offers its (float32) gradient of the shared matrix for that step and fetches the other end's: both then apply the
same sum, with the same optimizer settings from the same state, and the copies stay equal. The gradient sent is the
stage's average, identical on every replica of the stage, so any replica of the other end can answer. See
docs/ARCHITECTURE.md ("Tied embeddings across stages") for what happens when the exchange fails.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Optional

import torch

from agora.model import tied_parameter
from agora.net import transport
from agora.net.protocol import TIED_GRAD
from agora.net.records import PeerState
from agora.net.state_transfer import PAGE_BYTES
from agora.net.transport import RpcError

logger = logging.getLogger("agora.averaging")

KEEP_STEPS = 2  # offered gradients kept for late askers (each is vocab x d_model floats; stages step in lockstep)
# A replica of the other end that has not answered within HEDGE_FACTOR x a typical fetch (at least HEDGE_MIN_S) may
# be frozen: another one is asked as well (a large matrix is then sent twice, so not sooner).
HEDGE_FACTOR = 4.0
HEDGE_MIN_S = 2.0
RECORDS_MAX_AGE_S = 1.0  # how old the other end's records may be when a fetch picks whom to ask


class TiedExchange:
    """One end's half of the exchange: ``offer_and_fetch`` in the step path, ``serve`` for the other end's calls.

    :param ctx: the replica sync's ``SyncContext`` (manifest, runtime, dht, p2p, timeouts)
    """

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        stage = ctx.runtime.stage
        param = tied_parameter(stage)
        if param is None:
            raise ValueError(f"stage {ctx.stage_index} holds no copy of a tied embedding")
        self.index = next(i for i, p in enumerate(stage.parameters()) if p is param)
        self.shape = tuple(param.shape)
        n = ctx.manifest.n_stages
        self.other_stage = n - 1 if stage.spec.is_head else 0
        self.offered: dict[int, torch.Tensor] = {}
        self.exchanged = 0
        self.failed = 0
        self.hedged = 0  # fetches that also asked another replica because the first one was slow
        self.typical_fetch_s: Optional[float] = None  # moving average of successful fetches

    # ------------------------------------------------------------------ serving the other end
    async def serve(self, meta: dict, tensors: list, caller) -> tuple[dict, list[torch.Tensor]]:
        """Rows ``[start, stop)`` of our gradient of the shared matrix for ``step``."""
        step, rows = meta.get("step"), meta.get("rows")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise RpcError("bad_request", "step must be a non-negative integer")
        if (not isinstance(rows, list) or len(rows) != 2 or not all(isinstance(r, int) and not isinstance(r, bool)
                                                                     for r in rows)
                or not 0 <= rows[0] < rows[1] <= self.shape[0]):
            raise RpcError("bad_request", f"rows must be [start, stop) within [0, {self.shape[0]}]")
        grad = self.offered.get(step)
        if grad is None:
            if step > max(self.offered, default=-1):
                raise RpcError("not_ready", f"step {step} not averaged here yet")
            raise RpcError("too_old", f"step {step}'s gradient is no longer kept here")
        return {"step": step}, [grad[rows[0]:rows[1]].contiguous()]

    # ------------------------------------------------------------------ in the step path
    async def offer_and_fetch(self, step: int, averaged: list[torch.Tensor]) -> list[torch.Tensor]:
        """``averaged`` with the shared matrix's gradient replaced by ours + the other end's for ``step``; unchanged
        (and logged) when no replica of the other end could give it within the averaging timeout."""
        own = averaged[self.index].float().contiguous()
        self.offered[step] = own
        for old in sorted(self.offered)[:-KEEP_STEPS]:
            del self.offered[old]
        other = await self._fetch(step, deadline=time.monotonic() + 2 * self.ctx.averaging_timeout_s)
        if other is None:
            self.failed += 1
            logger.warning(f"stage {self.ctx.stage_index}: no tied-embedding gradient from stage {self.other_stage} "
                           f"for step {step}; applying ours alone (the two copies now differ)")
            return averaged
        self.exchanged += 1
        out = list(averaged)
        out[self.index] = own + other  # float32 addition commutes exactly: both ends apply the very same sum
        return out

    async def _fetch(self, step: int, deadline: float) -> Optional[torch.Tensor]:
        c = self.ctx
        rows_per_page = max(1, PAGE_BYTES // (4 * self.shape[1]))
        while time.monotonic() < deadline and c.is_serving():
            try:
                # up to a second old: the other end's replicas change far more slowly than steps come (and for the
                # head of a two-stage pipeline it is the next stage, whose records the next hop keeps that fresh)
                records = await c.records.get(self.other_stage, RECORDS_MAX_AGE_S)
            except Exception as err:  # a DHT hiccup: try again until the deadline
                logger.debug(f"reading stage {self.other_stage} failed: {err!r}")
                records = []
            peers = [r.peer_id for r in records if r.state in (PeerState.SERVING.value, PeerState.LEAVING.value)]
            random.shuffle(peers)
            got = await self._first_answer(peers, step, rows_per_page, deadline)
            if got is not None:
                return got
            await asyncio.sleep(0.2)
        return None

    def hedge_after_s(self) -> float:
        """How long one replica of the other end may take before the next one is asked as well."""
        return max(HEDGE_MIN_S, HEDGE_FACTOR * self.typical_fetch_s) if self.typical_fetch_s else HEDGE_MIN_S

    async def _first_answer(self, peers: list[str], step: int, rows_per_page: int,
                            deadline: float) -> Optional[torch.Tensor]:
        """The gradient from the first of ``peers`` that gives it. They are asked in turn: the next one as soon as
        the previous one failed (``not_ready``: it has not averaged that step yet), or also when it has not answered
        within ``hedge_after_s`` (a frozen replica would otherwise hold this step until the deadline); the first
        answer wins and the other calls are cancelled."""
        queue, running = list(peers), set()
        try:
            while queue or running:
                if queue:
                    running.add(asyncio.ensure_future(self._timed_fetch(queue.pop(0), step, rows_per_page, deadline)))
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                done, running = await asyncio.wait(running, timeout=min(left, self.hedge_after_s()) if queue else left,
                                                   return_when=asyncio.FIRST_COMPLETED)
                if not done and queue:
                    self.hedged += 1
                for task in done:
                    if task.exception() is None:
                        return task.result()
                    err = task.exception()
                    if not (isinstance(err, RpcError) and err.code == "not_ready"):
                        logger.debug(f"a tied gradient for step {step} failed: {err!r}")
            return None
        finally:
            for task in running:
                task.cancel()

    async def _timed_fetch(self, peer_id: str, step: int, rows_per_page: int, deadline: float) -> torch.Tensor:
        started = time.monotonic()
        grad = await self._fetch_from(peer_id, step, rows_per_page, deadline)
        took = time.monotonic() - started
        self.typical_fetch_s = took if self.typical_fetch_s is None else 0.8 * self.typical_fetch_s + 0.2 * took
        return grad

    async def _fetch_from(self, peer_id: str, step: int, rows_per_page: int, deadline: float) -> torch.Tensor:
        c = self.ctx
        meta = {"run_id": c.manifest.run_id, "manifest_hash": c.manifest.hash, "stage": self.other_stage,
                "step": step}
        parts = []
        for start in range(0, self.shape[0], rows_per_page):
            stop = min(self.shape[0], start + rows_per_page)
            timeout = max(1.0, deadline - time.monotonic())
            _, tensors = await transport.call(c.p2p, peer_id, c.manifest.run_id, TIED_GRAD,
                                              dict(meta, rows=[start, stop]), [], timeout)
            if len(tensors) != 1 or tuple(tensors[0].shape) != (stop - start, self.shape[1]) \
                    or tensors[0].dtype != torch.float32 or not torch.isfinite(tensors[0]).all():
                raise RpcError("bad_reply", "a tied-gradient page of the wrong shape, dtype or with non-finite values")
            parts.append(tensors[0])
        return torch.cat(parts)
