"""Generation through the live swarm: a client-driven session with one pinned peer per stage.

The client walks every chunk (the prompt, then one token at a time) through the stages itself: token ids to the
head's pinned peer, the boundary it returns to stage 1's, and so on; the tail returns the logits of the last
position, which the client samples by the rules of local generation (``inference.sample_next``,
``inference.validate_generation``), so greedy output through the swarm is the local model's. Each pinned peer keeps
its stage's KV cache for the session (``server/inference.py``): a new token costs one position per stage. What
crosses the wire is the training boundary (``wire.compress``: k coordinates + token ids in subspace mode, d wide in
dense mode, in the run's wire dtype).

Failover by replay: the client keeps what it sent each stage (token ids, boundaries). When a pinned peer fails
(``protocol.SESSION_LOST``), another replica of that stage gets a new session and that stage's whole input so far
in one chunk, and the session goes on; the other stages keep their sessions, since the replacement receives exactly
what the lost peer had. A request a stage refuses as invalid is raised at once (a replica would refuse it too); a
stage without a working replica raises ``GenerationError`` naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from agora.config import Manifest
from agora.inference import sample_next, validate_generation
from agora.net import transport
from agora.net.protocol import BANNABLE, INFER, SESSION_LOST
from agora.net.records import StageRecord, read_stage
from agora.net.routing import BanList, pick_peer_or_fallback
from agora.net.transport import RpcError, TransferStats
from agora.wire import WIRE_DTYPES

logger = logging.getLogger("agora.generate")


@dataclass
class GenerationOptions:
    call_timeout_s: float = 60.0  # one chunk on one peer (a prefill of up to seq_len positions included)
    max_failovers: int = 3  # per stage and chunk: further peers (or new sessions) tried after a failure
    wait_for_peers_s: float = 10.0  # how long a stage without a serving peer is waited for
    backoff_s: float = 0.5  # pause before calling a peer that already failed this session again
    close_timeout_s: float = 5.0  # closing sessions at the end (best effort)
    ban_s: float = 60.0  # a peer that failed by itself (timeout, unreachable) is avoided this long


class GenerationError(RpcError):
    """Generation through the swarm failed at ``stage``; ``code`` is the last failure's (``no_peers`` when the
    stage had no serving peer, ``retries_exhausted`` when every attempt failed, else the stage's refusal)."""

    def __init__(self, stage: int, code: str, message: str):
        super().__init__(code, f"stage {stage}: {message}")
        self.stage = stage


class SwarmSession:
    """One sequence's generation session across the stages of a run, pinned to one peer per stage.

    ``feed(ids)`` sends the next positions and returns the last position's logits; ``close()`` ends the sessions
    on the peers (best effort). Not reentrant: one ``feed`` at a time.

    :param capacity: positions the session will hold at most (prompt + new tokens - 1); every peer reserves that
    """

    def __init__(self, manifest: Manifest, dht, p2p, capacity: int, options: Optional[GenerationOptions] = None):
        if not 1 <= capacity <= manifest.model.seq_len:
            raise ValueError(f"a session holds 1..{manifest.model.seq_len} positions (seq_len), not {capacity}")
        self.manifest, self.dht, self.p2p = manifest, dht, p2p
        self.capacity = capacity
        self.opts = options or GenerationOptions()
        n = manifest.n_stages
        self.length = 0  # positions every stage holds
        self.pins: list[Optional[str]] = [None] * n  # the peer serving each stage's session
        self.ids: list[str] = [""] * n  # session id at that peer (a new one per pin: a replay never collides)
        self.held: list[int] = [0] * n  # positions the pinned peer holds
        self.sent: list[list[list[torch.Tensor]]] = [[] for _ in range(n)]  # each stage's accepted chunks (replay)
        # the UPM frame epoch each of those chunks' boundary was written in (None: no frames, or the head's tokens)
        self.sent_frames: list[list[Optional[int]]] = [[] for _ in range(n)]
        self.records: list[list[StageRecord]] = [[] for _ in range(n)]
        self.failed: list[list[str]] = [[] for _ in range(n)]  # peers that failed this session, per stage
        self.bans = BanList(self.opts.ban_s)
        self.failovers = 0  # replays on another peer (or a new session) after a pinned peer failed
        self.stats = TransferStats()
        self.broken: Optional[GenerationError] = None  # a failed chunk leaves the stages out of step: no more feeds
        self._closing: set[asyncio.Task] = set()
        self._width = manifest.residual.k if manifest.residual.mode == "subspace" else manifest.model.d_model
        self._wire_dtype = WIRE_DTYPES[manifest.residual.wire_dtype]

    def pinned(self, stage: int) -> Optional[str]:
        """The peer id serving ``stage`` for this session now (None before the first chunk or after a failure)."""
        return self.pins[stage]

    # ------------------------------------------------------------------ one chunk through every stage
    async def feed(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Send the positions ``length .. length + len(token_ids) - 1`` through the stages; returns the logits of
        the last one, [V] fp32. Raises ``GenerationError`` when a stage cannot serve it."""
        if self.broken is not None:
            raise self.broken
        t = len(token_ids)
        if t < 1 or self.length + t > self.capacity:
            raise ValueError(f"{t} more positions do not fit: the session holds {self.length} of {self.capacity}")
        tokens = torch.tensor([list(token_ids)], dtype=torch.int32)
        chunk, frame = [tokens], None
        try:
            for stage in range(self.manifest.n_stages):
                out, out_frame = await self._through(stage, chunk, frame)
                self.sent[stage].append(chunk)
                self.sent_frames[stage].append(frame)
                chunk, frame = [out, tokens], out_frame
        except GenerationError as err:
            self.broken = err
            raise
        self.length += t
        return out[0]

    async def _through(self, stage: int, chunk: list[torch.Tensor],
                       frame: Optional[int]) -> tuple[torch.Tensor, Optional[int]]:
        """The reply of ``stage``'s pinned peer to ``chunk`` (written in UPM frame ``frame``), re-pinning and
        replaying after failures (bounded); returns it with the frame its boundary is written in."""
        errors: list[str] = []
        for attempt in range(self.opts.max_failovers + 1):
            peer = self.pins[stage] or await self._pin(stage, errors)
            # A pin holds the whole session so far, or (fresh) nothing: then it gets the stage's whole input so far
            # and this chunk, one request per run of chunks written in one frame.
            start = self.held[stage]
            requests = [(chunk, frame)] if start == self.length else \
                _frame_runs([*self.sent[stage], chunk], [*self.sent_frames[stage], frame])
            try:
                for tensors, in_frame in requests:
                    meta = {"run_id": self.manifest.run_id, "manifest_hash": self.manifest.hash, "stage": stage,
                            "session": self.ids[stage], "position": self.held[stage], "capacity": self.capacity,
                            "close": False}
                    if in_frame is not None:
                        meta["frame"] = in_frame
                    reply_meta, reply = await transport.call(self.p2p, peer, self.manifest.run_id, INFER, meta,
                                                             tensors, self.opts.call_timeout_s, stats=self.stats)
                    self.held[stage] += tensors[-1].shape[1]
                out = self._checked(stage, reply, tensors[-1].shape[1], chunk[-1].shape[1])
                out_frame = reply_meta.get("frame") if isinstance(reply_meta, dict) else None
                if out_frame is not None and (isinstance(out_frame, bool) or not isinstance(out_frame, int)):
                    raise RpcError("bad_reply", "'frame' must be an integer")
            except RpcError as err:
                if err.code == "rate_limited" and attempt < self.opts.max_failovers:
                    await asyncio.sleep(self.opts.backoff_s * (attempt + 1))  # refused before compute: same pin
                    continue
                if err.code not in SESSION_LOST and err.code != "bad_reply":
                    raise GenerationError(stage, err.code, f"peer {peer[-8:]} refused the request: {err.message}")
                errors.append(f"{peer[-8:]}: {err.code}")
                logger.warning(f"stage {stage} peer {peer[-8:]} failed ({err.code}); "
                               f"{'giving up' if attempt == self.opts.max_failovers else 'replaying on another peer'}")
                self._unpin(stage, peer, bannable=err.code in BANNABLE or err.code == "bad_reply")
                self.failovers += 1
                continue
            return out, out_frame
        raise GenerationError(stage, "retries_exhausted",
                              f"{self.opts.max_failovers + 1} attempts failed ({'; '.join(errors)})")

    def _checked(self, stage: int, reply: list[torch.Tensor], sent: int, new: int) -> torch.Tensor:
        """The part of a reply this chunk needs: the new positions' boundary, or the tail's [1, V] logits."""
        tail = stage == self.manifest.n_stages - 1
        want = (1, self.manifest.model.vocab_size) if tail else (1, sent, self._width)
        dtype = torch.float32 if tail else self._wire_dtype
        if len(reply) != 1 or tuple(reply[0].shape) != want or reply[0].dtype != dtype:
            got = [(tuple(r.shape), r.dtype) for r in reply]
            raise RpcError("bad_reply", f"expected one {dtype} tensor of shape {want}, got {got}")
        if not torch.isfinite(reply[0]).all():
            raise RpcError("bad_reply", "the reply holds NaN or Inf")
        return reply[0] if tail else reply[0][:, sent - new:]

    # ------------------------------------------------------------------ pins
    async def _pin(self, stage: int, errors: list[str]) -> str:
        """A serving peer for ``stage``, with a new session id: untried ones first; a peer that already failed
        this session again after a pause; waits up to ``wait_for_peers_s`` for a stage without serving peers."""
        deadline = asyncio.get_running_loop().time() + self.opts.wait_for_peers_s
        while True:
            await self._refresh(stage)
            peer = pick_peer_or_fallback(self.records[stage], self.capacity, tried=self.failed[stage], bans=self.bans)
            if peer is not None:
                break
            if asyncio.get_running_loop().time() > deadline:
                tried = f" (failed: {'; '.join(errors)})" if errors else ""
                raise GenerationError(stage, "no_peers", f"no serving peer of run {self.manifest.run_id!r} "
                                                         f"within {self.opts.wait_for_peers_s:.0f}s{tried}")
            await asyncio.sleep(0.5)
        if peer.peer_id in self.failed[stage]:
            await asyncio.sleep(self.opts.backoff_s)
        self.pins[stage], self.ids[stage], self.held[stage] = peer.peer_id, secrets.token_hex(16), 0
        return peer.peer_id

    async def _refresh(self, stage: int) -> None:
        try:
            self.records[stage] = await asyncio.get_running_loop().run_in_executor(
                None, read_stage, self.dht, self.manifest.run_id, stage, self.manifest.hash)
        except Exception as err:  # keep the records we had; the pick decides whether that is enough
            logger.warning(f"reading stage {stage} records failed: {err!r}")

    def _unpin(self, stage: int, peer: str, bannable: bool) -> None:
        self.failed[stage].append(peer)
        if bannable:
            self.bans.ban(peer)
        if self.held[stage]:  # it may still hold the session: let it go now rather than at its idle expiry
            self._close_later(stage, peer, self.ids[stage])
        self.pins[stage], self.held[stage] = None, 0

    # ------------------------------------------------------------------ closing
    def _close_later(self, stage: int, peer: str, session_id: str) -> None:
        task = asyncio.create_task(self._close_one(stage, peer, session_id))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_one(self, stage: int, peer: str, session_id: str) -> None:
        meta = {"run_id": self.manifest.run_id, "manifest_hash": self.manifest.hash, "stage": stage,
                "session": session_id, "position": 0, "close": True}
        with contextlib.suppress(RpcError):
            await transport.call(self.p2p, peer, self.manifest.run_id, INFER, meta, [], self.opts.close_timeout_s)

    async def close(self) -> None:
        """End the session on every pinned peer (best effort, concurrently, bounded by ``close_timeout_s``)."""
        for stage, peer in enumerate(self.pins):
            if peer is not None and self.held[stage]:
                self._close_later(stage, peer, self.ids[stage])
            self.pins[stage], self.held[stage] = None, 0
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


def _concat(chunks: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Chunks of one stage's input, joined along the positions into one request."""
    return [torch.cat(parts, dim=1) for parts in zip(*chunks)]


def _frame_runs(chunks: list[list[torch.Tensor]],
                frames: list[Optional[int]]) -> list[tuple[list[torch.Tensor], Optional[int]]]:
    """Consecutive chunks written in one UPM frame, each run joined into one request (a replay)."""
    runs: list[tuple[list[list[torch.Tensor]], Optional[int]]] = []
    for chunk, frame in zip(chunks, frames):
        if runs and runs[-1][1] == frame:
            runs[-1][0].append(chunk)
        else:
            runs.append(([chunk], frame))
    return [(_concat(group), frame) for group, frame in runs]


def _prompt(prompt_ids: Sequence[int], vocab_size: int) -> list[int]:
    ids = list(prompt_ids)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError("prompt_ids must be token ids (ints)")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must lie in [0, {vocab_size}), got {bad[:5]}")
    return ids


def check_request(manifest: Manifest, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                  top_p: float = 1.0) -> list[int]:
    """The prompt as a list, or a ValueError for a request no swarm could serve (checked before any network)."""
    prompt = _prompt(prompt_ids, manifest.model.vocab_size)
    validate_generation(len(prompt), max_new_tokens, manifest.model.seq_len, temperature, top_p)
    return prompt


async def generate_in_swarm(manifest: Manifest, dht, prompt_ids: Sequence[int], max_new_tokens: int,
                            temperature: float = 0.0, top_p: float = 1.0, seed: Optional[int] = None,
                            eos_id: Optional[int] = None, options: Optional[GenerationOptions] = None) -> list[int]:
    """The new token ids after ``prompt_ids``, computed by the swarm's stages (the rules of ``inference.generate``:
    prefill once, then one token per step; temperature 0 is greedy, else a CPU generator seeded with ``seed``).

    ``dht``: this process's DHT of the run (a read-only client is enough). Raises ValueError for a request that
    cannot run, ``GenerationError`` when the swarm cannot serve it.
    """
    prompt = check_request(manifest, prompt_ids, max_new_tokens, temperature, top_p)
    if max_new_tokens == 0:
        return []
    generator = None
    if temperature > 0:  # as ``inference.generate`` does, so a seed draws the same tokens
        generator = torch.Generator()
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
    p2p = await dht.replicate_p2p()
    # The last new token is never fed back, so the sessions need one position less than prompt + new tokens.
    session = SwarmSession(manifest, dht, p2p, len(prompt) + max_new_tokens - 1, options)
    out: list[int] = []
    try:
        logits = await session.feed(prompt)
        while True:
            token = int(sample_next(logits[None], temperature, top_p, generator)[0])
            out.append(token)
            if token == eos_id or len(out) == max_new_tokens:
                return out
            logits = await session.feed([token])
    finally:
        await session.close()
