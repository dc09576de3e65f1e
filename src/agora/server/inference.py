"""Generation sessions on a stage server: the ``infer`` RPC, with one KV cache per client session.

A client (``client/generation.py``) pins one peer per stage for a session and sends it, chunk by chunk, the
positions after those it already holds: token ids to the head, the previous stage's boundary to the others. The
peer keeps its stage's keys and values (``model.KVCache``, batch 1) under the caller's peer id and a random session
id the client chose, and replies with its own boundary (the tail: the logits of the last position).

Bounded: a session reserves its whole cache up front (``KVCache.nbytes_for`` of the capacity it asked for) against
``NodeOptions.inference_memory_bytes``, and a new session over that cap is refused with ``busy``; a session idle for
``NodeOptions.inference_idle_s`` is dropped. A session belongs to the runtime that opened it: after a stage move it
is gone (``unknown_session``). Why chunks run on the training compute thread: ``InferenceSessions._compute``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from hivemind.p2p import PeerID

from agora.model import KVCache
from agora.net.transport import RpcError, TransferStats
from agora.server.runtime import StageRuntime

logger = logging.getLogger("agora.node")

SESSION_ID = re.compile(r"[A-Za-z0-9_-]{8,64}")  # client-chosen; random in practice (``client/generation.py``)
SWEEP_PERIOD_S = 1.0  # how often idle sessions are looked for


@dataclass
class Session:
    """One client's generation session on this stage (loop-side bookkeeping; the cache is filled on the compute
    thread)."""

    runtime: StageRuntime  # the runtime (stage, generation) that opened it
    capacity: int  # positions the cache holds at most
    nbytes: int  # reserved against the memory cap
    cache: Optional[KVCache] = None  # allocated by the first chunk, on the compute thread
    length: int = 0  # positions cached after the last chunk that finished
    busy: bool = False  # a chunk of it is being computed (never expired meanwhile)
    dropped: bool = False  # closed or expired: a chunk still waiting for the compute thread must not run
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class InferenceStats:
    """What generation cost this peer (kept off the DHT record: training routing reads that)."""

    opened: int = 0
    closed: int = 0
    expired: int = 0
    refused_busy: int = 0
    chunks: int = 0
    tokens: int = 0
    compute_s: float = 0.0


class InferenceSessions:
    """The ``infer`` RPC of one node: admission, session table, memory cap, idle expiry.

    :param node: the ``StageNode`` (its handler's admission checks, runtime, compute thread)
    :param memory_bytes: KV-cache bytes all sessions together may reserve
    :param idle_s: a session not used for this long is dropped
    """

    def __init__(self, node: Any, memory_bytes: int, idle_s: float):
        self.node = node
        self.manifest = node.manifest
        self.memory_bytes, self.idle_s = int(memory_bytes), float(idle_s)
        self.sessions: dict[tuple[str, str], Session] = {}
        self.reserved = 0  # bytes reserved by the sessions in the table
        self.stats = InferenceStats()
        self.wire = TransferStats()  # bytes of generation traffic, apart from training's
        self._gate: Optional[asyncio.Semaphore] = None  # created on the node's loop

    # ------------------------------------------------------------------ the RPC
    async def infer(self, meta: dict, tensors: list[torch.Tensor], caller: PeerID):
        """Admit, validate, then run one chunk of a session (or close it: ``close`` without tensors)."""
        node, handler = self.node, self.node.handler
        sender = str(caller)
        handler.check_addressed(meta)  # the caller was admitted at the header (handler.admit_compute)
        session_id, position, close = self._parse_meta(meta)
        key = (sender, session_id)
        if not tensors:
            if not close:
                raise handler.reject("shape_mismatch", "a chunk needs its tensors (only a close may come without)")
            return {"closed": self._drop(key, "closed"), "length": 0}, []
        rt = node.runtime
        t = self._validate_chunk(rt, tensors)
        session = self._session_for(key, rt, meta, position, t)
        if position + t > session.capacity:
            raise handler.reject("too_large", f"positions {position}..{position + t - 1} do not fit the session's "
                                              f"capacity of {session.capacity} positions")
        session.busy = True
        try:
            out, frame = await self._compute(session, tensors, position, meta.get("frame"))
        except BaseException:
            if session.length == 0:  # a session whose first chunk failed holds nothing worth keeping
                self._drop(key, "closed")
            raise
        finally:
            session.busy = False
            session.last_used = time.monotonic()
        session.length = position + t
        self.stats.chunks += 1
        self.stats.tokens += t
        if close:
            self._drop(key, "closed")
        reply = {"length": session.length, "step": session.runtime.step}
        if frame is not None:
            reply["frame"] = frame  # the UPM frame epoch the returned boundary is written in
        return reply, [out]

    def _parse_meta(self, meta: dict) -> tuple[str, int, bool]:
        reject = self.node.handler.reject
        session_id, position, close = meta.get("session"), meta.get("position"), meta.get("close", False)
        if not isinstance(session_id, str) or not SESSION_ID.fullmatch(session_id):
            raise reject("bad_request", f"session must be 8-64 characters of [A-Za-z0-9_-], got {session_id!r}")
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise reject("bad_request", f"position must be an integer >= 0, got {position!r}")
        if not isinstance(close, bool):
            raise reject("bad_request", f"close must be a boolean, got {close!r}")
        return session_id, position, close

    def _validate_chunk(self, rt: StageRuntime, tensors: list[torch.Tensor]) -> int:
        """The number of new positions of a well-formed chunk for this stage; a clear refusal otherwise."""
        reject, m = self.node.handler.reject, self.manifest
        expected = 1 if rt.is_head else 2
        if len(tensors) != expected:
            what = "[token ids]" if rt.is_head else "[boundary, token ids]"
            raise reject("shape_mismatch", f"stage {rt.stage_index} expects {what}, got {len(tensors)} tensors")
        tokens = tensors[-1]
        if tokens.dtype != torch.int32:
            raise reject("dtype_mismatch", f"token ids must be int32, got {tokens.dtype}")
        if tokens.dim() != 2 or tokens.shape[0] != 1 or tokens.shape[1] < 1:
            raise reject("shape_mismatch", f"token ids must be [1, t >= 1] (one sequence per session), "
                                           f"got {tuple(tokens.shape)}")
        t, v = tokens.shape[1], m.model.vocab_size
        if t > m.model.seq_len:
            raise reject("too_large", f"a chunk of {t} positions is longer than the model's seq_len {m.model.seq_len}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= v:
            raise reject("bad_token", f"token ids must be in [0, {v})")
        if not rt.is_head:
            coords = tensors[0]
            width = m.residual.k if m.residual.mode == "subspace" else m.model.d_model
            if tuple(coords.shape) != (1, t, width):
                raise reject("shape_mismatch", f"boundary must be {(1, t, width)}, got {tuple(coords.shape)}")
            if coords.dtype != rt.wire_dtype:
                raise reject("dtype_mismatch", f"boundary dtype must be {rt.wire_dtype}, got {coords.dtype}")
            if not torch.isfinite(coords).all():
                raise reject("non_finite", "boundary contains NaN or Inf")
        return t

    # ------------------------------------------------------------------ the session table
    def _session_for(self, key: tuple[str, str], rt: StageRuntime, meta: dict, position: int, t: int) -> Session:
        """The caller's session for this chunk: the open one at ``position``, or a new one at position 0."""
        session = self.sessions.get(key)
        if session is not None and session.runtime is not rt:  # opened before a stage move: its cache is void
            self._drop(key, "expired")
            session = None
        if session is None:
            if position != 0:
                raise RpcError("unknown_session", f"no session {key[1]!r} of yours here (never opened, closed, idle "
                                                  f"for over {self.idle_s:.0f}s, or this peer moved): start a new "
                                                  f"one at position 0")
            return self._open(key, rt, meta, t)
        if session.busy:
            raise RpcError("position_mismatch", f"session {key[1]!r} is computing another chunk: send its chunks "
                                                f"one after the other")
        if position != session.length:
            raise RpcError("position_mismatch", f"session {key[1]!r} holds {session.length} positions; this chunk "
                                                f"starts at {position} (replayed or lost chunk)")
        return session

    def _open(self, key: tuple[str, str], rt: StageRuntime, meta: dict, t: int) -> Session:
        m, reject = self.manifest, self.node.handler.reject
        seq_len = m.model.seq_len
        capacity = meta.get("capacity", seq_len)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise reject("bad_request", f"capacity must be an integer >= 1, got {capacity!r}")
        if capacity > seq_len:
            raise reject("too_large", f"a session of {capacity} positions exceeds the model's seq_len {seq_len}")
        dtype = next(rt.stage.parameters()).dtype
        nbytes = KVCache.nbytes_for(m.model, len(rt.stage.layers), 1, capacity, dtype)
        self.expire()
        if self.reserved + nbytes > self.memory_bytes:
            self.stats.refused_busy += 1
            raise RpcError("busy", f"generation sessions here hold {self.reserved / 2**20:.1f} of "
                                   f"{self.memory_bytes / 2**20:.1f} MiB; {capacity} positions need "
                                   f"{nbytes / 2**20:.1f} MiB more: try another replica, or later")
        session = Session(rt, capacity, nbytes)
        self.sessions[key] = session
        self.reserved += nbytes
        self.stats.opened += 1
        return session

    def _drop(self, key: tuple[str, str], why: str) -> bool:
        session = self.sessions.pop(key, None)
        if session is None:
            return False
        self.reserved -= session.nbytes
        session.dropped = True
        session.cache = None  # freed now, or when a chunk still running on it ends
        if why == "expired":
            self.stats.expired += 1
        else:
            self.stats.closed += 1
        return True

    def expire(self) -> None:
        """Drop sessions idle for longer than ``idle_s`` or left behind by a stage move (never one computing)."""
        now, rt = time.monotonic(), self.node.runtime
        for key, s in list(self.sessions.items()):
            if not s.busy and (now - s.last_used > self.idle_s or s.runtime is not rt):
                self._drop(key, "expired")

    def close_all(self) -> None:
        for key in list(self.sessions):
            self._drop(key, "closed")

    async def run(self) -> None:
        """Sweep idle sessions, so their memory comes back even when no new session asks for it."""
        while True:
            self.expire()
            await asyncio.sleep(SWEEP_PERIOD_S)

    # ------------------------------------------------------------------ compute
    async def _compute(self, session: Session, tensors: list[torch.Tensor], position: int,
                       frame: Optional[int] = None) -> tuple[torch.Tensor, Optional[int]]:
        """One chunk on the node's compute thread, with training first.

        Not a thread of its own: optimizer steps, state imports and stage moves change the parameters in place on
        the compute thread, so a decode elsewhere could read half-updated weights, and its matmuls would compete
        with training's for the same cores anyway. Instead every chunk is one job on the compute thread, and at
        most one such job waits in its queue at a time (``_gate``): a training job waits for at most one chunk,
        a prefill of at most seq_len positions of one sequence (less than a training microbatch's forward alone)
        or a single token, and generation is not starved either (the queue is first come, first served).
        """
        if self._gate is None:
            self._gate = asyncio.Semaphore(1)
        async with self._gate:
            return await self.node.run_compute(self._decode, session, tensors, position, frame)

    def _decode(self, session: Session, tensors: list[torch.Tensor], position: int,
                frame: Optional[int]) -> tuple[torch.Tensor, Optional[int]]:
        """Compute thread: allocate the session's cache on its first chunk, then run the chunk; returns its output
        and the UPM frame epoch that output is written in (None without frames, and from the tail)."""
        t0 = time.perf_counter()
        rt = session.runtime
        if session.dropped:
            raise RpcError("unknown_session", "the session was dropped (closed, or the peer moved) while this chunk "
                                              "waited")
        cache = session.cache  # one read: the loop may drop the session meanwhile
        if cache is None:
            cache = session.cache = KVCache.for_stage(rt.stage, 1, session.capacity)
        try:
            return rt.decode(cache, tensors, position, rt.generation, frame), rt.frame_out
        finally:
            self.stats.compute_s += time.perf_counter() - t0
