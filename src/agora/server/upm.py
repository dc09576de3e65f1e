"""UPM in a live swarm: rotating the frame of each stage boundary while the swarm trains (docs/UPM.md).

``FrameLedger`` (one per runtime, compute thread): the frame epochs of this stage's input and output boundaries,
the rotations accepted and due at a step, and the conversions between epochs for messages of the old frame.
``Rotations`` (one per node, event loop): the protocol. The lowest-id serving replica of stage b draws R for
boundary b every ``security.upm.every_s``, names the step after which it applies (``lead_steps`` ahead) and sends it
with the ``frame`` RPC to the replicas of stages b and b+1 only; every holder pushes it on to those it has no
acknowledgement from, so a drawer that dies mid-send still reaches everybody who got one copy. R never enters the
DHT. Replicas of a stage apply it after the same step, so they keep averaging in one frame.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

import torch
from torch import Tensor

from agora.config import Manifest
from agora.frames import (as_signed_permutation, current_gains, enable_frames, frame_drawer, frame_width,
                          input_gradients, input_weights, orthogonality_error, reorthogonalize, rotate_input,
                          rotate_output)
from agora.model import Stage
from agora.net import transport
from agora.net.admission import MIN_RATE_BYTES_PER_S, IncomingLimits
from agora.net.protocol import FRAME
from agora.net.records import PeerState, StageRecord
from agora.net.transport import RpcError

logger = logging.getLogger("agora.upm")

HISTORY = 8  # rotations of the input boundary kept for converting late messages and stale gradients
# Applied rotations of each boundary a holder keeps sending to replicas that have not acknowledged them: a replica
# of the other stage that missed one (the drawer's view of its stage was empty or stale when it drew) still gets it,
# late, instead of refusing every message of the new frame with ``frame_unknown`` for good.
RELAY_EPOCHS = 2
FRAME_EPOCHS = "frame/epochs"  # [input epoch, output epoch] in a stage's state (downloads, checkpoints)
PUSH_EVERY_S = 1.0  # how often a holder of an unacknowledged rotation sends it again to a peer
# How old the stage records the protocol decides from may be. DHT reads cost CPU in every DHT peer they touch: read
# once a second on every node for the pushes, they slowed a 2-core swarm by a third. Membership changes slowly; a
# replica that joins meanwhile gets a rotation at most this much later (or its state download carries it).
RECORDS_MAX_AGE_S = 5.0
# The previous stage's records are read for this protocol alone (the replica sync keeps its own stage's fresh, the
# next hop the next stage's), to relay the rotations of the input boundary back to its drawers' stage. That stage's
# replicas get those rotations from the drawer and from each other, whose views of their own stage are fresh: this
# node is a second path only, so its view may be older. A sender missing from it is still looked up at once.
PREVIOUS_STAGE_MAX_AGE_S = 30.0
CALL_TIMEOUT_S = 5.0  # plus the rotation's transfer time at the slowest rate a server accepts (push_timeout_s)


SERVER_GRACE_S = IncomingLimits.grace_s  # what a receiving node allows before it enforces the minimum rate
SERVER_BUDGET_WAIT_S = IncomingLimits.budget_wait_s  # and how long a request may wait for room in its budget
ROTATION_OVERHEAD_BYTES = 64 * 1024  # a frame request's metadata and framing beyond the matrix itself


def rotation_bytes(manifest: Manifest) -> int:
    """Payload bytes of one rotation: a float64 n x n matrix, n = k (subspace runs) or d_model (dense runs); 0 in
    a run without UPM. Dense runs carry the most: 128 MiB at d = 4096."""
    if manifest.security.upm is None:
        return 0
    n = manifest.residual.k if manifest.residual.mode == "subspace" else manifest.model.d_model
    return 8 * n * n


def push_timeout_s(nbytes: int) -> float:
    """How long a sender waits for one ``frame`` call carrying ``nbytes``: the server's own allowance (its grace
    period, a wait for budget, then ``MIN_RATE_BYTES_PER_S``) with the rate halved for slack, so a large dense
    rotation over a slow link is not abandoned near its end and sent again from the start."""
    return CALL_TIMEOUT_S + SERVER_GRACE_S + SERVER_BUDGET_WAIT_S + 2 * nbytes / MIN_RATE_BYTES_PER_S


@dataclass
class Rotation:
    """R (float64, orthogonal) for ``boundary`` taking its frame from ``epoch - 1`` to ``epoch``, applied right
    after optimizer step ``apply_step``; ``drawer``: the peer id that drew it (the lower one wins a conflict)."""

    boundary: int
    epoch: int
    apply_step: int
    r: Tensor
    drawer: str


class FrameLedger:
    """The frames of one stage's two boundaries (compute thread only, except the plain reads of the epochs).

    Input side: boundary ``stage - 1`` (none on the head); output side: boundary ``stage`` (none on the tail).
    """

    def __init__(self, stage: Stage, v_mode: str = "mixed", moments=None, transforms: str = "rotations"):
        self.stage, self.v_mode, self.moments = stage, v_mode, moments  # moments: parameter -> optimizer state
        # ``signed_permutations``: only those are drawn and accepted, so every transform moves Adam exactly.
        self.transforms = transforms
        self.index, self.n_stages = stage.spec.index, stage.spec.n_stages
        self.width = frame_width(stage)
        self.epoch_in = 0
        self.epoch_out = 0
        self.r_in: dict[int, Tensor] = {}  # input rotations by epoch (applied or due): conversions between epochs
        self.gains_in: dict[int, dict[str, Tensor]] = {}  # gains each applied input rotation folded
        self.due: dict[tuple[int, int], Rotation] = {}  # (boundary, epoch) -> accepted, not applied yet
        # (boundary, epoch) -> the due rotations and the last ``RELAY_EPOCHS`` applied ones of each boundary: what
        # this replica sends on to the replicas of both stages (``relayable``)
        self.known: dict[tuple[int, int], Rotation] = {}
        self.applied = 0
        self.late = 0  # rotations applied after their step had passed (the replica is then repaired by a download)
        enable_frames(stage, moments=moments)

    # ------------------------------------------------------------------ which boundaries are ours
    def sides(self) -> list[int]:
        """The boundaries this stage sits on."""
        return [b for b in (self.index - 1, self.index) if 0 <= b < self.n_stages - 1]

    def epoch_of(self, boundary: int) -> int:
        return self.epoch_in if boundary == self.index - 1 else self.epoch_out

    # ------------------------------------------------------------------ accepting rotations
    def accept(self, rot: Rotation) -> str:
        """``applied``: we are at or past its epoch; ``accepted``: it is due here now (a conflicting rotation of the
        same epoch drawn by a higher peer id is replaced); ``early``: an epoch beyond the next (later)."""
        if rot.boundary not in self.sides():
            raise ValueError(f"stage {self.index} is not on boundary {rot.boundary}")
        if tuple(rot.r.shape) != (self.width, self.width):
            raise ValueError(f"a rotation here is {self.width} x {self.width}, got {tuple(rot.r.shape)}")
        if self.transforms == "signed_permutations" and as_signed_permutation(rot.r) is None:
            raise ValueError("this run's frames are signed permutations (security.upm.transforms)")
        now = self.epoch_of(rot.boundary)
        if rot.epoch <= now:
            return "applied"
        if rot.epoch > now + 1:
            return "early"
        key = (rot.boundary, rot.epoch)
        held = self.due.get(key)
        if held is None or rot.drawer < held.drawer:
            # Kept bit for bit when orthogonal to rounding (what a drawer sends): every replica, whether it got R
            # from the drawer or from a relay, then applies exactly the same matrix.
            drift = orthogonality_error(rot.r)
            r = rot.r.clone() if drift <= 1e-12 else reorthogonalize(rot.r)
            self.due[key] = self.known[key] = Rotation(rot.boundary, rot.epoch, int(rot.apply_step), r, rot.drawer)
            if rot.boundary == self.index - 1:
                self.r_in[rot.epoch] = r
        return "accepted"

    def pending(self) -> list[Rotation]:
        return sorted(self.due.values(), key=lambda r: (r.boundary, r.epoch))

    def relayable(self) -> list[Rotation]:
        """The rotations this replica sends on: every due one and the last ``RELAY_EPOCHS`` applied ones of each
        boundary, by boundary and epoch."""
        return sorted(self.known.values(), key=lambda r: (r.boundary, r.epoch))

    def _trim_known(self) -> None:
        self.known = {k: r for k, r in self.known.items()
                      if r.boundary in self.sides() and r.epoch > self.epoch_of(r.boundary) - RELAY_EPOCHS}

    # ------------------------------------------------------------------ applying them (after an optimizer step)
    def apply_due(self, step: int, grads: dict[str, Optional[Tensor]]) -> dict[str, Optional[Tensor]]:
        """Apply every due rotation whose step has come (``step``: the step just taken); ``grads``: the gradients
        accumulated toward the next step (by parameter name), returned in the new frame. Returns ``grads`` as is
        when nothing was due."""
        # One order on every replica: the two boundaries' updates of the map commute only up to rounding, and
        # replicas must end bit-identical.
        for key in sorted(self.due):
            rot = self.due[key]
            if rot.apply_step > step or rot.epoch != self.epoch_of(rot.boundary) + 1:
                continue
            del self.due[key]
            if rot.apply_step < step:
                self.late += 1
                logger.warning(f"stage {self.index}: rotation {rot.epoch} of boundary {rot.boundary} was due after "
                               f"step {rot.apply_step}, applied after {step}")
            if rot.boundary == self.index:
                rotate_output(self.stage, rot.r)
                self.epoch_out = rot.epoch
            else:
                gains = current_gains(self.stage)
                grads = input_gradients(self.stage, grads, rot.r, gains)
                rotate_input(self.stage, rot.r, self.moments, self.v_mode)
                self.epoch_in = rot.epoch
                self.r_in[rot.epoch], self.gains_in[rot.epoch] = rot.r, gains
            self.applied += 1
        for table in (self.r_in, self.gains_in):
            for e in [e for e in table if e < self.epoch_in - HISTORY]:
                del table[e]
        self._trim_known()
        return grads

    # ------------------------------------------------------------------ messages and gradients of other epochs
    def conversion(self, sender_epoch: Optional[int]) -> Optional[Tensor]:
        """C (float64) with c_ours = c_sender C for coordinates a sender wrote in its frame epoch of our input
        boundary (None: the same frame). A gradient goes back as g_sender = g_ours C^T. Raises ``RpcError``
        (``frame_unknown``, retryable) when the rotations between the two epochs are not known here."""
        if sender_epoch is None or self.index == 0:
            return None
        if isinstance(sender_epoch, bool) or not isinstance(sender_epoch, int) or sender_epoch < 0:
            raise RpcError("bad_request", "'frame' must be a non-negative integer")
        ours = self.epoch_in
        if sender_epoch == ours:
            return None
        lo, hi = sorted((sender_epoch, ours))
        c = torch.eye(self.width, dtype=torch.float64)
        for e in range(lo + 1, hi + 1):
            r = self.r_in.get(e)
            if r is None:
                raise RpcError("frame_unknown", f"boundary {self.index - 1}: no rotation to frame {e} here (sender "
                                                f"at {sender_epoch}, this replica at {ours}); another replica or later")
            c = c @ r
        return c if sender_epoch < ours else c.T

    def stale_gradients(self, grads: dict[str, Optional[Tensor]], epoch: int,
                        weights: dict[str, Tensor]) -> dict[str, Optional[Tensor]]:
        """Gradients of a backward that ran on ``weights`` (a snapshot) of input epoch ``epoch``, moved to the
        current frame (``frames.input_gradients``)."""
        for e in range(epoch + 1, self.epoch_in + 1):
            if e not in self.r_in or e not in self.gains_in:
                raise RpcError("frame_unknown", f"a microbatch of frame {epoch} outlived {HISTORY} rotations")
            if e > epoch + 1:  # its weights in the frame the next rotation started from
                weights = input_weights(self.stage, weights, self.r_in[e - 1], self.gains_in[e - 1])
            grads = input_gradients(self.stage, grads, self.r_in[e], self.gains_in[e], weights)
        return grads

    # ------------------------------------------------------------------ state
    def export(self) -> Tensor:
        return torch.tensor([self.epoch_in, self.epoch_out], dtype=torch.int64)

    def restore(self, epochs: Optional[Tensor]) -> None:
        """After a state import: the epochs it was saved at (a state without them: epoch 0). Rotations of epochs
        the state already holds are dropped; the history of older frames no longer applies to these weights."""
        if epochs is None:
            e_in, e_out = 0, 0
        else:
            if epochs.numel() != 2 or bool((epochs < 0).any()):
                raise ValueError(f"{FRAME_EPOCHS} must be two non-negative integers")
            e_in, e_out = (int(x) for x in epochs.reshape(-1).tolist())
        if self.stage.boundary_map is None and not self.stage.spec.is_tail:
            # A state saved without frames: the identity map. Its gains are folded by the next rotation (folding
            # here would make these weights differ from the replicas' that imported the same state earlier).
            self.stage.boundary_map = torch.eye(self.width, dtype=torch.float64, device=self.stage.rope_cos.device)
        self.epoch_in, self.epoch_out = e_in, e_out
        self.gains_in.clear()
        self.r_in = {e: r for e, r in self.r_in.items() if e > e_in}
        self.due = {k: r for k, r in self.due.items() if r.epoch > self.epoch_of(r.boundary)}
        self._trim_known()

    def summary(self) -> dict:
        return {"epoch_in": self.epoch_in, "epoch_out": self.epoch_out, "applied": self.applied, "late": self.late,
                "due": [[r.boundary, r.epoch, r.apply_step, r.drawer] for r in self.pending()]}


@dataclass
class RotationHooks:
    """What the protocol needs from its node (explicit, so it never holds the node)."""

    peer_id: str
    p2p: Callable[[], Any]
    # a stage's records at most ``max_age_s`` old (the node's ``StageRecords.get``, shared with its other parts)
    records: Callable[[int, float], Awaitable[list[StageRecord]]]
    run_io: Callable[..., Awaitable[Any]]
    run_compute: Callable[..., Awaitable[Any]]
    ledger: Callable[[], Optional[FrameLedger]]  # the served runtime's ledger
    stage: Callable[[], int]
    step: Callable[[], int]
    is_serving: Callable[[], bool]
    is_stopping: Callable[[], bool]
    log_event: Callable[..., None]


# Refusals a resend cannot cure, logged as a warning once per peer and code (a peer that moved away answers
# wrong_stage or leaving, which count as delivered; unauthorized can be a receiver's stale view, retried quietly)
REFUSALS = frozenset({"payload_too_large", "too_large", "bad_request", "manifest_mismatch"})


@dataclass
class _Pushes:
    acked: set[str] = field(default_factory=set)
    last_sent: dict[str, float] = field(default_factory=dict)
    sending: dict[str, asyncio.Task] = field(default_factory=dict)  # transfers in progress, by peer

    def cancel(self) -> None:
        for task in self.sending.values():
            task.cancel()
        self.sending.clear()


class Rotations:
    """The rotation protocol of one node (event loop). See the module docstring."""

    def __init__(self, manifest: Manifest, hooks: RotationHooks):
        self.manifest, self.hooks = manifest, hooks
        self.config = manifest.security.upm
        self.drawn = 0
        self.received = 0  # frame RPCs accepted (new or known)
        self.received_by_boundary: dict[int, int] = {}
        self.refused = 0
        self.sent = 0
        self._pushes: dict[tuple[int, int], _Pushes] = {}
        self._last_drawn: dict[int, float] = {}  # boundary -> monotonic time we drew (or saw) its last rotation
        self._warned: set[tuple[str, str]] = set()  # (peer, error code) refusals already logged as warnings

    # ------------------------------------------------------------------ the RPC
    async def offer(self, meta: dict, tensors: list[Tensor], caller) -> tuple[dict, list]:
        """A rotation from a replica of stage b or b+1 (b = ``meta["boundary"]``): accepted if this node serves one
        of those stages and the sender is a replica of one of them in the DHT."""
        m, h = self.manifest, self.hooks
        if meta.get("run_id") != m.run_id or meta.get("manifest_hash") != m.hash:
            raise RpcError("manifest_mismatch", "a rotation for another run or manifest")
        boundary, epoch, apply_step, drawer = (meta.get(k) for k in ("boundary", "epoch", "apply_step", "drawer"))
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (boundary, epoch, apply_step)) \
                or not isinstance(drawer, str) or not 0 < len(drawer) <= 128:
            raise RpcError("bad_request", "a rotation names boundary, epoch, apply_step (integers) and its drawer")
        if h.is_stopping():
            raise RpcError("leaving", "this peer is leaving the run")
        ledger = h.ledger()
        if ledger is None or boundary not in ledger.sides():
            raise RpcError("wrong_stage", f"stage {h.stage()} is not on boundary {boundary}")
        if len(tensors) != 1 or tensors[0].dtype != torch.float64 or tensors[0].dim() != 2:
            raise RpcError("bad_request", "a rotation carries one float64 matrix")
        r = tensors[0]
        n = ledger.width
        # (an n^3 product: seconds for a dense d x d, so off the event loop)
        if tuple(r.shape) != (n, n) or await h.run_io(orthogonality_error, r) > 1e-6:
            self.refused += 1
            raise RpcError("bad_request", f"a rotation here is an orthogonal {n} x {n} float64 matrix")
        if ledger.transforms == "signed_permutations" and await h.run_io(as_signed_permutation, r) is None:
            self.refused += 1  # a dense rotation would fold gains and move Adam's v inexactly: not this run's kind
            raise RpcError("bad_request", f"a rotation here is a signed {n} x {n} permutation")
        sender = str(caller)
        sides = {r_.peer_id for s in (boundary, boundary + 1) for r_ in await self._replicas(s)}
        if sender not in sides:  # a replica that joined since our last read: look once more (at most 1/s)
            sides = {r_.peer_id for s in (boundary, boundary + 1) for r_ in await self._replicas(s, max_age=1.0)}
        if sender not in sides:
            self.refused += 1
            raise RpcError("unauthorized", f"only replicas of stages {boundary} and {boundary + 1} send its rotations")
        verdict = await h.run_compute(ledger.accept, Rotation(boundary, epoch, apply_step, r, drawer))
        if verdict == "early":
            raise RpcError("not_ready", f"boundary {boundary} is at frame {ledger.epoch_of(boundary)} here")
        self.received += 1
        self.received_by_boundary[boundary] = self.received_by_boundary.get(boundary, 0) + 1
        if verdict == "accepted":
            self._last_drawn[boundary] = time.monotonic()
            self._pushes.setdefault((boundary, epoch), _Pushes()).acked.add(sender)
        return {"verdict": verdict}, []

    # ------------------------------------------------------------------ drawing and pushing
    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(0.5)
                try:
                    await self.tick()
                except asyncio.CancelledError:
                    raise
                except Exception as err:  # a DHT hiccup or a peer gone: the next tick tries again
                    logger.warning(f"rotation tick failed: {err!r}")
        finally:
            for pushes in self._pushes.values():
                pushes.cancel()

    async def tick(self) -> None:
        h = self.hooks
        ledger = h.ledger()
        if ledger is None or not h.is_serving():
            return
        relayable = ledger.relayable()
        held = {(r.boundary, r.epoch) for r in relayable}
        for key in [k for k in self._pushes if k not in held]:
            self._pushes.pop(key).cancel()  # out of the relay window (or replaced by a state import): moot
        for rot in relayable:
            await self._push(rot)
        stage = h.stage()
        if stage in ledger.sides():  # stage b draws for boundary b (its output)
            await self._maybe_draw(ledger, stage)

    async def _maybe_draw(self, ledger: FrameLedger, boundary: int) -> None:
        h = self.hooks
        if any(r.boundary == boundary for r in ledger.pending()):
            return
        since = time.monotonic() - self._last_drawn.setdefault(boundary, time.monotonic())
        if since < self.config.every_s:
            return
        mine = await self._replicas(boundary)
        serving = sorted({r.peer_id for r in mine if r.state == PeerState.SERVING.value} | {h.peer_id})
        if serving[0] != h.peer_id:
            return  # the lowest serving peer id draws; the others wait for its rotation
        # Fresh views of both stages (one read per draw): a replica missing from a stale view would get R only
        # from the relays, possibly after the step it applies at.
        mine = await self._replicas(boundary, max_age=1.0)
        both = mine + await self._replicas(boundary + 1, max_age=1.0)
        step = max([h.step(), *(r.step for r in both)])
        gen = torch.Generator().manual_seed(secrets.randbits(63))
        rot = Rotation(boundary, ledger.epoch_of(boundary) + 1, step + self.config.lead_steps,
                       frame_drawer(self.config.transforms)(ledger.width, gen), h.peer_id)
        if await h.run_compute(ledger.accept, rot) != "accepted":
            return
        self.drawn += 1
        self._last_drawn[boundary] = time.monotonic()
        h.log_event("rotation_drawn", boundary=boundary, epoch=rot.epoch, apply_step=rot.apply_step)
        logger.info(f"stage {boundary}: drew frame {rot.epoch} of boundary {boundary}, applied after step "
                    f"{rot.apply_step}")
        await self._push(rot)

    async def _push(self, rot: Rotation) -> None:
        """Start sending ``rot`` to every replica of stages b and b+1 that has not acknowledged it and is not being
        sent it now (at most every ``PUSH_EVERY_S`` per peer). Each transfer runs as a task of its own: a large
        dense rotation to a slow or frozen peer never holds the protocol's tick (other boundaries, other peers).
        Applied rotations are still sent (``FrameLedger.relayable``) until they leave the relay window."""
        h, m = self.hooks, self.manifest
        state = self._pushes.setdefault((rot.boundary, rot.epoch), _Pushes())
        now = time.monotonic()
        targets = [r.peer_id for s in (rot.boundary, rot.boundary + 1) for r in await self._replicas(s)
                   if r.peer_id != h.peer_id and r.state in (PeerState.SERVING.value, PeerState.SYNCING.value)]
        # One frame at a time per peer, the earliest first: a receiver refuses a frame beyond its next one
        # (``not_ready``), so a later frame sent before the earlier one is acknowledged would be a wasted transfer.
        earlier = [st for (b, e), st in self._pushes.items() if b == rot.boundary and e < rot.epoch]
        targets = [p for p in targets if p not in state.acked and p not in state.sending
                   and now - state.last_sent.get(p, 0.0) >= PUSH_EVERY_S
                   and all(p in st.acked for st in earlier)]
        meta = {"run_id": m.run_id, "manifest_hash": m.hash, "boundary": rot.boundary, "epoch": rot.epoch,
                "apply_step": rot.apply_step, "drawer": rot.drawer}
        timeout = push_timeout_s(rot.r.numel() * rot.r.element_size())

        async def send(peer: str) -> None:
            try:
                reply, _ = await transport.call(h.p2p(), peer, m.run_id, FRAME, meta, [rot.r], timeout)
            except RpcError as err:
                if err.code in ("wrong_stage", "leaving"):
                    state.acked.add(peer)  # it moved away: nothing to send it
                if err.code in REFUSALS and (peer, err.code) not in self._warned:  # a resend will not help: say so
                    self._warned.add((peer, err.code))
                    logger.warning(f"boundary {rot.boundary}: {peer[-8:]} refused frame {rot.epoch}: [{err.code}] "
                                   f"{err}")
                logger.debug(f"rotation {rot.epoch} to {peer[-8:]}: {err.code}")
                return
            except asyncio.CancelledError:
                raise
            except Exception as err:
                logger.debug(f"rotation {rot.epoch} to {peer[-8:]}: {err!r}")
                return
            finally:
                state.sending.pop(peer, None)
                state.last_sent[peer] = time.monotonic()  # the next try waits PUSH_EVERY_S after this one ended
            self.sent += 1
            verdict = reply.get("verdict") if isinstance(reply, dict) else None
            if verdict in ("accepted", "applied"):
                state.acked.add(peer)
            if verdict == "applied":  # it is at this frame or past it: it holds every earlier one too
                for (b, e), other in self._pushes.items():
                    if b == rot.boundary and e < rot.epoch:
                        other.acked.add(peer)

        for peer in targets:
            state.sending[peer] = asyncio.create_task(send(peer), name=f"upm-push-{rot.boundary}-{rot.epoch}")

    async def _replicas(self, stage: int, max_age: Optional[float] = None) -> list[StageRecord]:
        """The stage's records, read again when older than ``max_age`` seconds (default ``RECORDS_MAX_AGE_S``, and
        ``PREVIOUS_STAGE_MAX_AGE_S`` for the stage before this node's). The node's replica sync and next hop keep
        their stages' records younger than that, so of the reads this protocol needs only the previous stage's
        reach the DHT, at most every ``PREVIOUS_STAGE_MAX_AGE_S``."""
        if not 0 <= stage < self.manifest.n_stages:
            return []
        if max_age is None:
            here = self.hooks.stage()
            max_age = PREVIOUS_STAGE_MAX_AGE_S if here is not None and stage < here else RECORDS_MAX_AGE_S
        return await self.hooks.records(stage, max_age)

    def summary(self) -> dict:
        ledger = self.hooks.ledger()
        return {"drawn": self.drawn, "received": self.received, "refused": self.refused, "sent": self.sent,
                **(ledger.summary() if ledger is not None else {})}
