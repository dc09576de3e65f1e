"""The node's RPCs: who may call, what a valid request is, and the path of one microbatch through this stage.

``fwd_bwd`` (``StageHandler.fwd_bwd``): authorize -> rate limit -> validate -> screen (SENTINEL) -> forward on the
compute thread -> ``Downstream.send`` to the next stage -> backward -> reply with the gradient of our input. Audit
requests (``audit: true``) recompute a message without training. ``get_state`` serves parameters and optimizer
moments to a replica that joins or repairs; ``info`` a peer's record and recent events; ``infer`` (generation
sessions) is served by ``inference.py``. Compute lives in ``runtime.py``, the next hop in ``downstream.py``: this
module only frames and orders them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional

import torch
from hivemind.p2p import PeerID

from agora.config import Manifest
from agora.devices import PRECISIONS
from agora.net import transport
from agora.net.state_transfer import StateSnapshots
from agora.net.errors import NO_ANSWER
from agora.net.protocol import CLAIM, FRAME, FWD_BWD, GET_STATE, INFER, INFO, TIED_GRAD, held_seconds
from agora.net.records import PeerState
from agora.net.transport import RpcError
from agora.server.exactly_once import ExactlyOnce, microbatch_key
from agora.frames import FRAME_MAP
from agora.server.runtime import WARMUP_CLOCK, StageRuntime, trim_heap
from agora.server.upm import FRAME_EPOCHS, rotation_bytes
from agora.server.runtime import Pending
from agora.server.screening import Message
from agora.wire import bytes_per_token

# How long a hedge target waits for the first replica's answer to its claim (``StageHandler._claim``); no answer in
# that time means it is frozen or gone, and the target applies the microbatch.
CLAIM_TIMEOUT_S = 2.0
# Answers to a claim that say the first replica will not apply the microbatch (it no longer serves that stage).
WILL_NOT_APPLY = NO_ANSWER | {"leaving", "not_serving", "wrong_stage"}

logger = logging.getLogger("agora.node")
# What a weights-only download (``params_only``: an export) carries besides the parameters: what the weights mean
# (the warm-up's depth, the UPM frame map and epochs).
WEIGHTS_ONLY_EXTRAS = (WARMUP_CLOCK, FRAME_MAP, FRAME_EPOCHS)


def max_microbatch(manifest: Manifest) -> int:
    """The most sequences one ``fwd_bwd`` request may carry: 4x the manifest's microbatch (evaluation batches and
    callers with their own microbatch size fit; it bounds what a request may make a node buffer)."""
    return 4 * manifest.batch.microbatch_size


def largest_request_bytes(manifest: Manifest) -> int:
    """The largest payload a legitimate request to a node of this run carries, whatever stage it serves: a
    ``fwd_bwd`` of ``max_microbatch`` full-length sequences (boundary coordinates, token ids, last-token ids).
    Generation chunks (one sequence) and the other RPCs (no tensors) are smaller."""
    m, r = manifest, manifest.residual
    per_sequence = m.model.seq_len * bytes_per_token(m.model.d_model, r.mode, r.k, r.wire_dtype) + 4
    return max_microbatch(m) * per_sequence


def validate_fwd_bwd(manifest: Manifest, runtime: StageRuntime, meta: dict, tensors: list[torch.Tensor]) -> None:
    """Refuse a ``fwd_bwd`` request this stage cannot compute, with the error code that says why."""
    m = manifest
    expected = 2 if runtime.is_head else 3
    if len(tensors) != expected:
        raise RpcError("shape_mismatch", f"expected {expected} tensors, got {len(tensors)}")
    tokens, last = tensors[-2], tensors[-1]
    if tokens.dtype != torch.int32 or last.dtype != torch.int32:
        raise RpcError("dtype_mismatch", f"token ids must be int32, got {tokens.dtype} and {last.dtype}")
    if tokens.dim() != 2 or tokens.shape[1] > m.model.seq_len or tokens.shape[0] == 0:
        raise RpcError("shape_mismatch", f"tokens must be [batch, <= {m.model.seq_len}], got {tuple(tokens.shape)}")
    if tokens.shape[0] > max_microbatch(m):
        raise RpcError("too_large", f"a microbatch of {tokens.shape[0]} sequences; at most {max_microbatch(m)} "
                                    f"(4x the manifest's microbatch_size)")
    if last.shape != (tokens.shape[0],):
        raise RpcError("shape_mismatch", f"last-token ids must be [{tokens.shape[0]}], got {tuple(last.shape)}")
    v = m.model.vocab_size
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= v or int(last.min()) < 0
                           or int(last.max()) >= v):
        raise RpcError("bad_token", f"token ids must be in [0, {v})")
    if not runtime.is_head:
        coords = tensors[0]
        width = m.residual.k if m.residual.mode == "subspace" else m.model.d_model
        want = (tokens.shape[0], tokens.shape[1], width)
        if tuple(coords.shape) != want:
            raise RpcError("shape_mismatch", f"boundary must be {want}, got {tuple(coords.shape)}")
        if coords.dtype != runtime.wire_dtype:
            raise RpcError("dtype_mismatch", f"boundary dtype must be {runtime.wire_dtype}, got {coords.dtype}")
        if not torch.isfinite(coords).all():
            raise RpcError("non_finite", "boundary contains NaN or Inf")


class StageHandler:
    """Serves the node's RPCs; every refusal is counted per code in the node's counters.

    :param node: the ``StageNode`` that owns this handler (its runtime, downstream, screening and counters)
    """

    def __init__(self, node: Any):
        self.node = node
        self.manifest = node.manifest
        self._members_lock = asyncio.Lock()
        self.snapshots = StateSnapshots()  # state downloads in progress (``get_state`` pages)
        # How long a training microbatch may wait for the stage's step when the target batch is complete: half a
        # hop's timeout, so the caller still has time for our compute and downstream.
        self.hold_limit_s = node.opts.hop_timeout_s / 2
        self.largest_request = largest_request_bytes(self.manifest)
        self.exactly_once = ExactlyOnce()
        self.dropped = 0  # training requests dropped at their commit point (caller gone, or this process frozen)
        self.claims_lost = 0  # hedged microbatches dropped here: the replica first called had already applied them
        self.claims_granted = 0  # claims of hedge targets we granted (our run of that microbatch then drops it)

    async def register(self, p2p) -> None:
        """Serve the RPCs. Each request's header is admitted (``admit_compute`` / ``admit_state`` / ``admit_info``)
        before a byte of its payload is read, within the node's ``incoming`` limits (net/admission.py)."""
        ns, gate = self.manifest.run_id, self.node.incoming
        await transport.add_handler(p2p, ns, FWD_BWD, self.fwd_bwd, stats=self.node.stats_in, gate=gate,
                                    admit=self.admit_compute)
        await transport.add_handler(p2p, ns, GET_STATE, self.get_state, gate=gate, admit=self.admit_state)
        await transport.add_handler(p2p, ns, INFO, self.info, gate=gate, admit=self.admit_info)
        await transport.add_handler(p2p, ns, TIED_GRAD, self.tied_grad, gate=gate, admit=self.admit_compute)
        await transport.add_handler(p2p, ns, CLAIM, self.claim, gate=gate, admit=self.admit_info)
        if self.node.rotations is not None:  # UPM rotations from the replicas of the stages beside us
            await transport.add_handler(p2p, ns, FRAME, self.node.rotations.offer, gate=gate, admit=self.admit_frame)
        # Generation sessions: admission is ours (authorize, bans, rate limit, check_addressed, size).
        inference = self.node.inference
        await transport.add_handler(p2p, ns, INFER, inference.infer, stats=inference.wire, gate=gate,
                                    admit=self.admit_compute)

    def reject(self, code: str, message: str) -> RpcError:
        self._count_rejection(code)
        return RpcError(code, message)

    def _count_rejection(self, code: str) -> None:
        counters = self.node.counters
        counters.rejected += 1
        counters.rejected_by_code[code] = counters.rejected_by_code.get(code, 0) + 1

    # ------------------------------------------------------------------ admission
    async def authorize(self, caller: str) -> None:
        """Refuse callers without a certified record in an allow-listed run; no-op in open runs.

        An unknown caller triggers one DHT re-read (at most one per second), so a peer that just announced itself
        is served on its first or second try, and an outsider's flood costs one read per second.
        """
        node, members = self.node, self.node.members
        if members is None or members.known(caller):
            return
        # One refresh at a time: concurrent first calls of a new peer wait for it instead of being refused.
        async with self._members_lock:
            if not members.known(caller) and members.should_refresh():
                try:
                    await node.run_io(members.refresh, node.dht)
                except Exception as err:  # the DHT is slow: refuse now, the caller retries
                    logger.debug(f"membership refresh failed: {err!r}")
        if not members.known(caller):
            raise self.reject("unauthorized", f"peer {caller} holds no certified record of run "
                                              f"{self.manifest.run_id!r} (allow-listed run)")

    def check_addressed(self, meta: dict) -> None:
        """The request is for this run, manifest and stage, and this peer serves it now."""
        m, node = self.manifest, self.node
        if meta.get("run_id") != m.run_id:
            raise self.reject("wrong_run", f"this peer serves run {m.run_id!r}, not {meta.get('run_id')!r}")
        if meta.get("manifest_hash") != m.hash:
            raise self.reject("manifest_mismatch", f"manifest hash {meta.get('manifest_hash')} != this peer's {m.hash}")
        if meta.get("stage") != node.stage_index:
            if meta.get("stage") in node.previous_stages:  # a caller still routes by our record before a move
                raise RpcError("leaving", f"this peer moved to stage {node.stage_index}")
            raise self.reject("wrong_stage", f"this peer serves stage {node.stage_index}, not {meta.get('stage')}")
        if node.state != PeerState.SERVING:
            raise RpcError("leaving" if node.state == PeerState.LEAVING else "not_serving",
                           f"peer is {node.state.value}")

    async def admit_caller(self, sender: str, meta: dict) -> None:
        """Who may call, from a request's header (before its payload is read): certified (allow-listed runs), not banned, within its rate, and
        addressing this run, manifest and stage while we serve. Every RPC that computes goes through it."""
        await self.admit_identity(sender)
        self.check_addressed(meta)

    async def admit_identity(self, sender: str) -> None:
        """The caller alone, whatever it addresses: certified (allow-listed runs), not banned, within its rate."""
        await self.authorize(sender)
        if sender in self.node.banned_peers():
            raise self.reject("banned", f"peer {sender} is banned here for sending corrupted messages")
        if not self.node.limiter.allow(sender):
            raise self.reject("rate_limited", f"more than {self.node.opts.rate_limit_per_s:.0f} calls/s from {sender}")

    def check_size(self, announced_bytes: int, limit: int, what: str) -> None:
        if announced_bytes > limit:
            raise self.reject("too_large", f"the request announces {announced_bytes} payload bytes; a {what} of "
                                           f"this run carries at most {limit}")

    async def admit_compute(self, meta: dict, announced_bytes: int, caller: PeerID) -> None:
        """The header of a request that computes (``fwd_bwd``, ``infer``, ``tied_grad``): ``admit_caller``, and a
        payload no larger than the manifest allows (``largest_request_bytes``), before any of it is read."""
        await self.admit_caller(str(caller), meta)
        self.check_size(announced_bytes, self.largest_request, "request")

    async def admit_state(self, meta: dict, announced_bytes: int, caller: PeerID) -> None:
        """The header of a ``get_state`` request (it has no tensors: the state is in the reply). A new download
        (no ``snapshot`` token) must pass ``StateAccess.admit_download``: a replica of this stage that holds no
        other, or a reader the manifest names; the pages after the first are served to the same caller only."""
        self.check_size(announced_bytes, 0, "state request")
        sender, access = str(caller), self.node.state_access
        if sender not in access.readers:  # a reader is named in the (signed) manifest: no certificate needed
            await self.authorize(sender)
        if meta.get("snapshot") is not None:
            return  # a later page: get_state checks that the token was issued to this caller
        if meta.get("stage") != self.node.stage_index:
            raise self.reject("wrong_stage", f"this peer serves stage {self.node.stage_index}")
        try:
            await access.admit_download(sender, self.node.stage_index)
        except RpcError as err:
            self._count_rejection(err.code)
            logger.warning(f"stage {self.node.stage_index}: state download by {sender[-8:]} refused: {err}")
            raise

    async def admit_info(self, meta: dict, announced_bytes: int, caller: PeerID) -> None:
        self.check_size(announced_bytes, 0, "info request")

    async def admit_frame(self, meta: dict, announced_bytes: int, caller: PeerID) -> None:
        """A UPM rotation: ``admit_identity`` (a rotation addresses a boundary, not this stage: ``Rotations``
        checks that), and no more than one float64 n x n matrix."""
        await self.admit_identity(str(caller))
        self.check_size(announced_bytes, rotation_bytes(self.manifest) + 4096, "rotation")

    async def admit(self, sender: str, meta: dict, tensors: list[torch.Tensor]) -> None:
        """A decoded ``fwd_bwd`` request (its caller was admitted at the header): still addressed to what we serve
        now, and well-formed for this stage."""
        node = self.node
        self.check_addressed(meta)
        try:
            validate_fwd_bwd(self.manifest, node.runtime, meta, tensors)
        except RpcError as err:
            self._count_rejection(err.code)
            if err.code == "non_finite" and node.screening is not None:  # NaN/Inf: let SENTINEL ban the sender
                await node.screening.screen(self._activations(sender, meta, tensors))
            raise

    def _activations(self, sender: str, meta: dict, tensors: list[torch.Tensor]) -> Message:
        return Message(sender, self.node.stage_index - 1, "fwd", tensors[0], tensors[-2], version=meta.get("version"))

    # ------------------------------------------------------------------ fwd_bwd
    async def fwd_bwd(self, meta: dict, tensors: list[torch.Tensor], caller: PeerID):
        sender = str(caller)
        await self.admit(sender, meta, tensors)
        rt = self.node.runtime
        if meta.get("audit"):
            return await self._audit(rt, meta, tensors)
        train = bool(meta.get("train", True))
        if not rt.is_head and train:
            await self._screen_activations(sender, meta, tensors)
        key = microbatch_key(sender, meta) if train else None  # a retry is not accumulated twice (exactly_once.py)
        return await self.exactly_once.run(key, lambda: self.process(rt, meta, tensors, train,
                                                                     wanted=lambda: self.exactly_once.wanted(key),
                                                                     key=key))

    async def _audit(self, rt: StageRuntime, meta: dict, tensors: list[torch.Tensor]):
        """Recompute for a replica's receiver; nothing here trains on it, so it is not screened either."""
        if not (rt.is_tail or rt.is_head):
            raise self.reject("wrong_stage", "audits are served by the first and the last stage only")
        precision = meta.get("precision")  # the audited sender's (None: ours)
        if precision is not None and precision not in PRECISIONS:
            raise self.reject("bad_request", f"audit precision must be one of {', '.join(PRECISIONS)}")
        try:
            if rt.is_tail:
                out, version = await self.node.run_compute(rt.recompute_tail, tensors, rt.generation,
                                                           meta.get("frame"), precision)
            else:
                out, version = await self.node.run_compute(rt.recompute_head, tensors, rt.generation, precision)
        except ValueError as err:  # a precision this device cannot compute in (bf16 on an old GPU)
            raise self.reject("bad_request", str(err))
        return {"loss": None, "path": [self.node.peer_id], "version": version}, [out]

    async def _screen_activations(self, sender: str, meta: dict, tensors: list[torch.Tensor]) -> None:
        screening = self.node.screening
        if screening is None:
            return
        msg = self._activations(sender, meta, tensors)
        flagged = await screening.screen(msg)
        screening.maybe_audit(msg, meta, tensors, flagged)
        if flagged:
            raise self.reject("sentinel", "activations flagged as corrupted by SENTINEL")

    # ------------------------------------------------------------------ one microbatch through this stage
    async def process(self, rt: StageRuntime, meta: dict, tensors: list[torch.Tensor], train: bool,
                      wanted: Callable[[], bool] = lambda: True, key: Any = None):
        """Forward here, the rest of the pipeline downstream, backward here; the reply goes upstream. ``key``: the
        microbatch's retry key (``exactly_once.microbatch_key``), None for an unlabelled request.

        A hedge (``meta["hedge_of"]``: the peer its caller called first) claims the microbatch from that peer at
        once, so the claim's wait (up to ``CLAIM_TIMEOUT_S`` when that peer is frozen) overlaps admission and the
        forward; it is awaited at the point of no return."""
        first = meta.get("hedge_of") if train else None
        claim: Optional[asyncio.Future] = None
        if key is not None and isinstance(first, str) and first != self.node.peer_id:
            claim = asyncio.ensure_future(self._claim(first, key))
        try:
            return await self._process(rt, meta, tensors, train, wanted, key, claim)
        finally:
            if claim is not None and not claim.done():
                claim.cancel()

    async def _process(self, rt: StageRuntime, meta: dict, tensors: list[torch.Tensor], train: bool,
                       wanted: Callable[[], bool], key: Any, claim: Optional[asyncio.Future]):
        node, counters = self.node, self.node.counters
        generation, downstream = rt.generation, node.downstream  # this request belongs to the stage served now
        rt.check_generation(generation)
        if train and node.freeze.refusing():
            raise RpcError("not_serving", f"this peer was just frozen for {node.freeze.last_freeze_s:.0f}s; it takes "
                                          f"no training work for a moment")
        epoch = node.freeze.epoch
        sync, samples = node.sync, int(tensors[-1].shape[0])
        held_s = 0.0  # seconds this request waited for the stage's batch to open (replies report it: held_seconds)
        if train and sync is not None:  # one target batch per step (ReplicaSync.batch_open)
            attempt = meta.get("attempt", 0)  # the sender's attempt (client/router.py); a retry is never redirected
            admit_started = time.monotonic()
            await sync.admit_training(samples, self.hold_limit_s,
                                      first_attempt=not (isinstance(attempt, int) and attempt > 0))
            held_s = time.monotonic() - admit_started
            try:
                rt.check_generation(generation)  # the node may have moved while this waited
                self._commit_or_drop(epoch, wanted)  # or its caller left (a hedge won elsewhere), or we were frozen
            except BaseException:
                sync.release(samples)
                raise
        node.inflight += 1
        node.queue += 1
        try:
            pending, loss, boundary = await node.run_compute(self._forward, rt, tensors, train, generation,
                                                             meta.get("frame"))
            node.queue -= 1
            counters.forward += 1
            counters.tokens += pending.tokens.numel() if train else 0
            counters.eval += 0 if train else 1
            if rt.is_tail:
                if train:
                    await self._point_of_no_return(epoch, wanted, key, meta, claim)
                reply, grads = await self._finish_tail(rt, pending, loss, train)
                return dict(reply, held_s=held_s), grads
            if train:  # nobody waits for it (a hedge won elsewhere): the next stages must not apply it either
                await self._point_of_no_return(epoch, wanted, key, meta, claim)
            down_meta, down_tensors = await downstream.send(meta, boundary, tensors[-1], pending.version,
                                                            frame=pending.frame_out)
            path = [node.peer_id, *down_meta.get("path", [])]
            if not train:
                return {"loss": down_meta.get("loss"), "path": path}, []
            grad = self._checked_gradient(down_tensors, boundary.coords.shape)
            self._commit_or_drop(epoch, wanted)
            node.queue += 1
            grad_in = await node.run_compute(rt.backward, pending, grad)
            node.queue -= 1
            counters.backward += 1
            return ({"loss": down_meta.get("loss"), "path": path, "version": pending.version,
                     "held_s": held_s + held_seconds(down_meta)}, _tensors(grad_in))
        except RpcError:
            counters.failed += 1
            raise
        finally:
            node.inflight -= 1
            if train and sync is not None:
                sync.release(samples)
            node.queue = max(0, node.queue)

    def _commit_or_drop(self, epoch: int, wanted: Callable[[], bool]) -> None:
        """Before a training microbatch goes on (downstream, or into the accumulated gradient): drop it if its
        caller went away (a hedge to another replica won) or this process was frozen meanwhile (its caller retried
        it elsewhere)."""
        node = self.node
        if node.freeze.stale(epoch):
            self.dropped += 1
            raise RpcError("not_serving", f"this peer was frozen for {node.freeze.last_freeze_s:.0f}s while the "
                                          f"microbatch was in flight; dropped")
        if not wanted():
            self.dropped += 1
            raise RpcError("leaving", "the caller went away before this microbatch was applied; dropped")

    async def _point_of_no_return(self, epoch: int, wanted: Callable[[], bool], key: Any, meta: dict,
                                  claim: Optional[asyncio.Future]) -> None:
        """The last check before a training microbatch is applied (sent downstream, or accumulated at the tail): as
        ``_commit_or_drop``, and exactly one of a hedged pair goes on (server/exactly_once.py): a hedge target's
        ``claim`` on the replica called first (``meta["hedge_of"]``) must have been granted; a run drops it if a
        hedge target's claim came first. Nothing is awaited between the checks and the caller's next step."""
        if claim is not None and not await claim:
            self.claims_lost += 1
            raise RpcError("leaving", f"replica {str(meta.get('hedge_of'))[-8:]}, called first, already applies this "
                                      f"microbatch; dropped here")
        self._commit_or_drop(epoch, wanted)
        if not self.exactly_once.pass_point(key):
            self.dropped += 1
            raise RpcError("leaving", "a hedge to another replica applies this microbatch; dropped")

    async def _claim(self, first: str, key: Any) -> bool:
        """Whether we may apply the microbatch ``key`` that its caller also sent to ``first``: granted, or no
        answer within ``CLAIM_TIMEOUT_S`` (frozen: it drops what it held when it wakes), or it no longer serves."""
        node, m = self.node, self.manifest
        origin, label = key
        request = {"run_id": m.run_id, "manifest_hash": m.hash, "stage": node.stage_index, "origin": origin,
                   "mb": label}
        try:
            reply, _ = await transport.call(node.p2p, first, m.run_id, CLAIM, request, [], CLAIM_TIMEOUT_S)
        except RpcError as err:
            return err.code in WILL_NOT_APPLY
        except Exception as err:  # not an answer we understand: the first peer may apply it, so we do not
            logger.warning(f"claim on {first[-8:]} failed: {err!r}")
            return False
        return isinstance(reply, dict) and reply.get("granted") is True

    async def claim(self, meta: dict, tensors: list[torch.Tensor], caller: PeerID):
        """A replica of our stage that a caller hedged one of our microbatches to asks whether it may apply it."""
        self.check_addressed(meta)
        origin = meta.get("origin")
        key = microbatch_key(origin, meta) if isinstance(origin, str) and 0 < len(origin) <= 128 else None
        if key is None:
            raise self.reject("bad_request", "a claim names the microbatch's caller ('origin') and label ('mb')")
        sync = self.node.sync
        if sync is None or str(caller) not in sync.replica_ids:  # only a replica of this stage may take our work
            return {"granted": False}, []
        granted = self.exactly_once.claim(key)
        self.claims_granted += int(granted)
        return {"granted": granted}, []

    @staticmethod
    def _forward(rt: StageRuntime, tensors: list, train: bool, generation: int, frame) -> tuple:
        """Compute thread: the forward, and for a stage that sends one, its boundary in host memory (compressed and
        copied off the device here, so the event loop never waits on a kernel)."""
        pending, loss = rt.forward(tensors, train, generation, frame)
        return pending, loss, None if rt.is_tail else rt.boundary(pending)

    async def _finish_tail(self, rt: StageRuntime, pending: Pending, loss, train: bool):
        grad_in = None
        if train:
            if loss is not None:
                rt.record_loss(loss)
            grad_in = await self.node.run_compute(rt.finish_tail, pending)
            self.node.counters.backward += 1
        return {"loss": loss, "path": [self.node.peer_id], "version": pending.version}, _tensors(grad_in)

    def _checked_gradient(self, down_tensors: list[torch.Tensor], shape) -> torch.Tensor:
        nxt = self.node.stage_index + 1
        if len(down_tensors) != 1 or tuple(down_tensors[0].shape) != tuple(shape):
            raise RpcError("bad_reply", f"stage {nxt} returned a malformed gradient")
        if not torch.isfinite(down_tensors[0]).all():
            raise RpcError("non_finite", f"stage {nxt} returned a non-finite gradient")
        return down_tensors[0]

    # ------------------------------------------------------------------ state and info
    async def get_state(self, meta: dict, tensors: list[torch.Tensor], caller: PeerID):
        node = self.node  # the caller was admitted at the header (admit_state)
        if meta.get("run_id") != self.manifest.run_id or meta.get("manifest_hash") != self.manifest.hash:
            raise RpcError("manifest_mismatch", "state requested for another run or manifest")
        if meta.get("stage") != node.stage_index:
            raise RpcError("wrong_stage", f"this peer serves stage {node.stage_index}")
        if node.state not in (PeerState.SERVING, PeerState.LEAVING) or node.sync is None:
            raise RpcError("not_serving", f"peer is {node.state.value}: its state is not settled")
        token, owner = meta.get("snapshot"), str(caller)
        kind = "params_only" if meta.get("params_only") else "full"
        if token is None and node.sync.fingerprint_valid:  # another download of this very state shares its copy
            token = self.snapshots.join(node.runtime.step, node.sync.fingerprint, kind, owner=owner)
        if token is None:  # a new download: snapshot the state once, so every page is of one step
            if not self.snapshots.has_room():
                raise RpcError("busy", "other state downloads are in progress here; try another replica or later")
            step, names, state = await node.run_compute(node.runtime.export_state)
            if kind == "params_only":  # an export needs the weights only: a third of the bytes
                kept = [i for i, n in enumerate(names) if n.startswith("param/") or n in WEIGHTS_ONLY_EXTRAS]
                names, state = [names[i] for i in kept], [state[i] for i in kept]
            token = self.snapshots.add(step, node.sync.fingerprint, names, state, kind=kind, owner=owner)
            del state
        reply, page = self.snapshots.serve(token, meta.get("offset", 0), owner=owner)
        if reply["next"] is None:  # the last page: once it is sent, a finished snapshot's copy is free heap
            asyncio.get_running_loop().call_later(5.0, lambda: asyncio.ensure_future(node.run_io(trim_heap)))
        return reply, page

    async def tied_grad(self, meta: dict, tensors: list[torch.Tensor], caller: PeerID):
        """The other end of a tied embedding asks for our gradient of the shared matrix at a step."""
        self.check_addressed(meta)
        tied = self.node.sync.tied if self.node.sync is not None else None
        if tied is None:
            raise self.reject("bad_request", f"stage {self.node.stage_index} holds no tied embedding")
        return await tied.serve(meta, tensors, caller)

    async def info(self, meta: dict, tensors: list[torch.Tensor], caller: PeerID):
        return {"record": self.node.record().to_value(), "events": self.node.events[-20:]}, []


def _tensors(grad: torch.Tensor | None) -> list[torch.Tensor]:
    return [grad] if grad is not None else []
