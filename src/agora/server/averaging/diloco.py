"""``diloco`` (DiLoCo, METHODS §8): each replica takes ``every`` inner steps on its own gradients with the stage's
optimizer, then a blocking outer round moves every replica to the same outer parameters (Nesterov momentum on the
pseudo-gradient, ``outer_lr``, ``outer_momentum``).

Why a round averages each replica's *proposed* outer state (parameters and momentum) instead of the
pseudo-gradient: the outer update is linear in (outer parameters, momentum, local parameters), so while the
replicas agree on the outer state, as every successful round leaves them, the average of the proposals is exactly
DiLoCo's update with the averaged pseudo-gradient; when they do not (one replica stepped alone because its partners
were gone), the same average pulls them back together, with no leader and no download. The price: a round carries
parameters and momentum, twice a ``full`` round, once every ``every`` steps. The outer state lives in the runtime's
``sync_state``, so it travels with state downloads and checkpoints and a joiner continues the phase it joins.

With ``averaging.codec`` (float16, uint8) a round averages the pseudo-gradient alone, rounded by the codec with
error feedback and compressed on the wire, and every replica takes the outer step from the average: 1/8 (float16)
or ~1/16 (uint8) of an exact round's bytes. hivemind hands each member its own part plus the compressed difference
to the average, so members end a compressed round apart by the codec's rounding, and nothing in such a round pulls
them back; every ``resync_every``-th round (by step, so every replica agrees which) is therefore the exact round
above (docs/AVERAGING.md, "Compressed rounds").
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from agora.net.records import PeerState, StageRecord
from agora.optim.outer import nesterov_outer_step
from agora.server.averaging.allreduce import CountingCompression, GuardedAverager
from agora.server.averaging.sync import ReplicaSync, SyncContext
from agora.server.runtime import SYNC_PREFIX

logger = logging.getLogger("agora.averaging")

OUTER = SYNC_PREFIX + "outer/"  # + parameter name: the outer parameters (where the last round left the replicas)
MOMENTUM = SYNC_PREFIX + "momentum/"  # + parameter name: the outer Nesterov momentum buffer


class DiLoCoSync(ReplicaSync):
    scheme = "diloco"
    gradient_dtype = torch.float32  # inner steps apply the replica's own gradients; nothing is averaged per step

    def __init__(self, ctx: SyncContext):
        super().__init__(ctx)
        cfg = ctx.manifest.averaging
        self.every, self.outer_lr, self.outer_momentum = cfg.every, cfg.outer_lr, cfg.outer_momentum
        self.names = [name for name, _ in ctx.runtime.stage.named_parameters()]
        self.outer: list[torch.Tensor] = []
        self.momentum: list[torch.Tensor] = []
        self._adopt_outer_state()
        self.averager = self._make_payload_averager()
        self.resync_every = cfg.resync_every
        self.codec_compression = CountingCompression(cfg.codec)  # counts the compressed rounds' bytes
        self.codec_averager = self._make_codec_averager() if cfg.codec != "none" else None
        self._codec_round = False  # the round under way averages the compressed pseudo-gradient
        # Error feedback: what the codec's rounding took from our pseudo-gradients and no round delivered yet (added
        # to the next one; an exact or lone step delivers it whole). Local to this replica, as its inner moments are.
        self.residual: list[torch.Tensor] = ([torch.zeros(p.shape, dtype=torch.float32)
                                              for p in ctx.runtime.stage.parameters()]
                                             if self.codec_averager is not None else [])
        self._pending_residual: list[torch.Tensor] = []  # the residual a compressed round under way would leave
        self.codec_rounds = 0  # successful compressed rounds
        self._samples_since_round = 0  # this replica's weight in the next outer round
        self.outer_rounds_alone = 0  # outer steps taken without partners (none alive, or the round failed)
        self.outer_seconds = 0.0  # how long outer rounds blocked this replica, in all

    def _make_payload_averager(self) -> GuardedAverager:
        shapes = [p.shape for p in self.ctx.runtime.stage.parameters()]
        payload = [torch.zeros(s, dtype=torch.float64) for s in shapes + shapes]  # outer params, then momentum
        return GuardedAverager(payload, self.ctx.dht, **self.averager_settings())

    def _make_codec_averager(self) -> Optional[GuardedAverager]:
        """The averager of the compressed rounds: the pseudo-gradient (float32), under its own key prefix."""
        payload = [torch.zeros(p.shape, dtype=torch.float32) for p in self.ctx.runtime.stage.parameters()]
        settings = {**self.averager_settings(), "prefix": f"{self.prefix}_codec",
                    "compression": self.codec_compression}
        return GuardedAverager(payload, self.ctx.dht, **settings)

    def round_averager(self) -> GuardedAverager:
        return self.codec_averager if self._codec_round else self.averager

    def averagers(self) -> list:
        return [self.averager, self.codec_averager]

    def codec_at(self, step: int) -> bool:
        """Whether the outer round after step ``step`` is a compressed one (else exact): every replica of the phase
        computes the same answer from the step."""
        return self.codec_averager is not None and (step // self.every) % self.resync_every != 0

    @property
    def bytes_sent(self) -> int:
        return self.compression.bytes_sent + self.codec_compression.bytes_sent

    def shutdown(self) -> None:
        if self.codec_averager is not None and not self.closed:
            try:
                self.codec_averager.shutdown()
            except Exception as err:  # already gone: nothing left to release
                logger.debug(f"codec averager shutdown: {err!r}")
        super().shutdown()

    # ------------------------------------------------------------------ the outer state
    def _adopt_outer_state(self) -> None:
        """Take the outer state from the runtime's ``sync_state`` (a download, a checkpoint), or start a new phase
        from the current parameters when it is absent or does not fit (a checkpoint of another scheme)."""
        rt = self.ctx.runtime
        state = rt.sync_state
        params = rt.trained_parameters()
        fits = all(state.get(OUTER + n) is not None and state[OUTER + n].shape == p.shape
                   and state.get(MOMENTUM + n) is not None and state[MOMENTUM + n].shape == p.shape
                   for n, p in zip(self.names, params))
        if not fits:
            if any(k.startswith(SYNC_PREFIX) for k in state):
                logger.warning(f"stage {self.ctx.stage_index}: the saved averaging state does not fit DiLoCo's; "
                               f"starting a new outer phase from the current parameters")
            state = {}
            for n, p in zip(self.names, params):
                state[OUTER + n] = p.detach().to("cpu", torch.float32, copy=True)
                state[MOMENTUM + n] = torch.zeros(p.shape, dtype=torch.float32)
        self.outer = [state[OUTER + n].float() for n in self.names]
        self.momentum = [state[MOMENTUM + n].float() for n in self.names]
        rt.sync_state = {**{OUTER + n: t for n, t in zip(self.names, self.outer)},
                         **{MOMENTUM + n: t for n, t in zip(self.names, self.momentum)}}

    def _state_replaced(self) -> None:
        for r in self.residual:
            r.zero_()  # rounding of a trajectory left behind
        self._adopt_outer_state()
        self._samples_since_round = 0

    def _own_proposal(self, step: Optional[int] = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Compute thread: our proposed outer parameters and momentum, per parameter. With ``step`` (a round starts),
        observers of ``"outer_round_start"`` see the inner phase's end state first."""
        local = self.ctx.runtime.trained_parameters()
        if step is not None:
            self.ctx.observers.emit("outer_round_start", step, local)
        ends = [p.detach().cpu() for p in local]
        if self.residual:  # the pseudo-gradient plus what compressed rounds have not delivered yet
            ends = [p.double() - r.double() for p, r in zip(ends, self.residual)]
        return [nesterov_outer_step(outer, mom, p, self.outer_lr, self.outer_momentum)
                for outer, mom, p in zip(self.outer, self.momentum, ends)]

    def _load_proposal(self, step: Optional[int] = None) -> None:
        """Compute thread: our proposal (``_own_proposal``) into the averager's buffers."""
        proposal = self._own_proposal(step)
        n = len(proposal)
        with self.averager.get_tensors() as bufs, torch.no_grad():
            for i, (new_outer, new_mom) in enumerate(proposal):
                bufs[i].copy_(new_outer)
                bufs[n + i].copy_(new_mom)

    def _load_pseudo_gradient(self, step: Optional[int] = None) -> None:
        """Compute thread: our pseudo-gradient ``outer - local`` plus the residual, rounded by the codec, into the
        compressed round's buffers; what the rounding takes waits as the residual if the round succeeds. Rounded
        here, whole tensor by whole tensor, the payload goes through hivemind's parts unchanged (float16 is
        idempotent, ``Uniform8BitCodec`` sends 256 levels exactly)."""
        local = self.ctx.runtime.trained_parameters()
        if step is not None:
            self.ctx.observers.emit("outer_round_start", step, local)
        self._pending_residual = []
        with self.codec_averager.get_tensors() as bufs, torch.no_grad():
            for b, outer, p, r in zip(bufs, self.outer, local, self.residual):
                wanted = outer - p.detach().cpu().float() + r
                b.copy_(self.codec_compression.roundtrip(wanted))
                self._pending_residual.append(wanted - b)

    def _apply_outer(self, averaged: bool, compressed: bool = False) -> None:
        """Compute thread: move to the averaged outer state (or, without a round, to our own proposal, computed
        again: a failed round may have left the buffers half-averaged, and a round we left may still hold them).
        ``compressed``: the round averaged pseudo-gradients; the outer step is taken from their average."""
        n = len(self.outer)
        if averaged and compressed:
            with self.codec_averager.get_tensors() as bufs, torch.no_grad():
                steps = [nesterov_outer_step(outer, mom, outer.double() - b.double(), self.outer_lr,
                                             self.outer_momentum) for outer, mom, b in zip(self.outer, self.momentum, bufs)]
            for i, (new_outer, new_mom) in enumerate(steps):
                self.outer[i].copy_(new_outer)
                self.momentum[i].copy_(new_mom)
            for r, pending in zip(self.residual, self._pending_residual):
                r.copy_(pending)
        elif averaged:
            with self.averager.get_tensors() as bufs, torch.no_grad():
                for i in range(n):
                    self.outer[i].copy_(bufs[i])
                    self.momentum[i].copy_(bufs[n + i])
        else:
            for i, (new_outer, new_mom) in enumerate(self._own_proposal()):
                self.outer[i].copy_(new_outer)
                self.momentum[i].copy_(new_mom)
        if not (averaged and compressed):
            for r in self.residual:
                r.zero_()  # an exact round's proposals and a lone step carried it whole
        self._pending_residual = []
        self.ctx.runtime.load_parameters(self.outer)
        self._set_fingerprint()

    # ------------------------------------------------------------------ the loop
    async def _tick(self) -> None:
        rt = self.ctx.runtime
        banned = await self.banned_replicas()
        others = [r for r in await self.replicas() if r.state == PeerState.SERVING.value and r.peer_id not in banned]
        boundary = (rt.step // self.every + 1) * self.every  # the next outer round
        # A replica past the next outer round took it without us: we can no longer join it; continue from its state
        # (outer parameters, momentum and its inner progress).
        past = [r for r in others if r.step > boundary]
        await self._own_gradient_tick(others, past, f"passed the outer round of step {boundary} without us")

    def _before_step(self, samples: int) -> None:
        self._samples_since_round += samples

    async def _round(self, n_others: int, stalled: bool) -> None:
        await super()._round(n_others, stalled)
        step = self.ctx.runtime.step
        if step % self.every == 0:
            await self._outer_round(step)

    async def _phase_replicas(self, step: int, past: int = 0) -> list[StageRecord]:
        """The other replicas of the phase ending at ``step``: serving, not banned, at its first step (``step -
        every``: they follow our steps to the round) up to ``past`` steps after it, or announcing its round."""
        banned = await self.banned_replicas()
        return [r for r in await self.replicas() if r.state == PeerState.SERVING.value and r.peer_id not in banned
                and (step - self.every <= r.step <= step + past or r.averaging_step == step)]

    async def _round_partners(self, step: int) -> list[StageRecord]:
        return await self._phase_replicas(step)

    async def _outer_round(self, step: int) -> None:
        """The blocking outer round after inner step ``step``: average the proposals with the replicas in the same
        phase, or step alone when none is alive or the round fails (the next round pulls the replicas together)."""
        c = self.ctx
        t0, sent_before = time.monotonic(), self.bytes_sent
        weight, self._samples_since_round = self._samples_since_round, 0
        result: Optional[dict] = None
        busy = self.averager_busy()  # a left round's all-reduce holds the buffers: this round is taken alone
        compressed = self._codec_round = self.codec_at(step)
        load = self._load_pseudo_gradient if compressed else self._load_proposal
        await c.run_compute(self._own_proposal if busy else load, step)
        if not busy and await self._partners_left(step):
            self.averaging_step = step
            try:
                await c.announce()  # partners behind us see the round and follow our step at once
                self.control = await self._start_round(weight, {"outer": step})
                result = await self._await_round(self.control, step, c.averaging_timeout_s)
            except Exception as err:  # a failed round, not a failed node
                logger.warning(f"stage {c.stage_index}: outer round of step {step} raised {err!r}")
                result = None
            finally:
                self.averaging_step, self.control = -1, None
            rounds = {g.get("outer") for g in result.values() if isinstance(g, dict)} if result else set()
            if result is not None and (len(result) < 2 or rounds != {step} or await self._untrusted(result)):
                logger.warning(f"stage {c.stage_index}: outer round of step {step} dropped (group of "
                               f"{len(result)}, rounds {sorted(map(str, rounds))})")
                result = None
            if result is None:
                self.rounds_failed += 1
        await c.run_compute(self._apply_outer, result is not None, compressed)
        self._codec_round = False
        seconds = time.monotonic() - t0
        group = len(result) if result is not None else 1
        if result is not None:
            self.rounds_ok += 1
            self.codec_rounds += int(compressed)
            self.round_bytes.append(self.bytes_sent - sent_before)
        else:
            self.outer_rounds_alone += 1
        self.outer_seconds += seconds
        c.observers.emit("outer_round", result is not None, seconds, group)
        c.log_event("outer_round", step=step, group=group, seconds=seconds, weight=weight, compressed=compressed)
        logger.info(f"stage {c.stage_index}: {'compressed ' if compressed else ''}outer step after step {step} with "
                    f"a group of {group} ({seconds:.2f}s{'' if result is not None else ', alone'})")
