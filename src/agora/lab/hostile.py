"""Hostile clients for a live node's RPCs: they write raw frames where an honest peer would call ``transport.call``.

Each attack opens its own stream to a handler and reports an ``Outcome``: the error code the server answered with
(if any), and when the server closed the stream. Used by ``tests/test_hostile_peers.py`` and ``agora bench
hostile``; what each attack probes and the limits that answer it are in ``docs/TRANSPORT.md`` ("Limits on hostile
peers").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional

import msgpack
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from agora.net.framing import WIRE_VERSION
from agora.net.transport import handler_name

__all__ = ["Outcome", "ATTACKS", "attack", "frame", "header_frame", "chunk_frame"]

CHUNK_BYTES = 2**20


@dataclass
class Outcome:
    """What the server did with one hostile stream."""

    attack: str
    code: Optional[str] = None  # the error code of the server's reply; None: no reply (dropped, or never came)
    replied_after_s: Optional[float] = None  # since the stream opened
    closed_after_s: Optional[float] = None  # when the server closed the stream; None: still open at the timeout
    bytes_sent: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def frame(payload: bytes, marker: bytes = P2P.MESSAGE_MARKER) -> bytes:
    """One frame as hivemind writes it: marker, 8-byte big-endian length, protobuf bytes."""
    return marker + len(payload).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + payload


def header_frame(meta: dict, payload_bytes: int, n: int, tensors: int) -> bytes:
    envelope = {"v": WIRE_VERSION, "meta": meta, "n": n, "tensors": tensors, "bytes": payload_bytes}
    return frame(runtime_pb2.ExpertRequest(metadata=msgpack.packb(envelope, use_bin_type=True)).SerializeToString())


def chunk_frame(buffer: bytes, first_of: Optional[int] = None) -> bytes:
    """A chunk of a float32 tensor; ``first_of``: this chunk starts a tensor of that many chunks."""
    part = runtime_pb2.Tensor(buffer=buffer)
    if first_of is not None:
        part.dtype, part.chunks = "float32", first_of
        part.size.extend([first_of * len(buffer) // 4])
    return frame(runtime_pb2.ExpertRequest(tensors=[part]).SerializeToString())


END_OF_STREAM = frame(P2P.END_OF_STREAM.SerializeToString(), P2P.ERROR_MARKER)
Frames = Callable[[dict], AsyncIterator[bytes]]  # (the run's meta for this handler) -> the frames to write


async def _garbage(meta: dict) -> AsyncIterator[bytes]:
    yield frame(os.urandom(64))  # not a protobuf with a msgpack envelope
    yield END_OF_STREAM


async def _drip(meta: dict) -> AsyncIterator[bytes]:
    """An invalid header, then 1 KiB junk messages every 10 ms, forever."""
    yield frame(b"\x0a\x03bad")
    junk = chunk_frame(os.urandom(1024))
    while True:
        await asyncio.sleep(0.01)
        yield junk


async def _huge(meta: dict) -> AsyncIterator[bytes]:
    """A well-addressed header announcing 200 MiB, then the chunks as fast as the link takes them."""
    n = 200
    yield header_frame(meta, n * CHUNK_BYTES, n, 1)
    buffer = bytes(CHUNK_BYTES)
    yield chunk_frame(buffer, first_of=n)
    for _ in range(n - 1):
        yield chunk_frame(buffer)
    yield END_OF_STREAM


async def _slow(meta: dict) -> AsyncIterator[bytes]:
    """A well-addressed header announcing a small, legitimate-sized payload, then 100 bytes per second."""
    n = 1
    yield header_frame(meta, 16 * 1024, n, 1)
    body = chunk_frame(bytes(16 * 1024), first_of=n)
    for i in range(0, len(body), 100):
        yield body[i:i + 100]
        await asyncio.sleep(1.0)
    yield END_OF_STREAM


async def _huge_frame(meta: dict) -> AsyncIterator[bytes]:
    """A frame whose length prefix claims 1 TiB."""
    yield P2P.MESSAGE_MARKER + (2**40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)
    while True:
        await asyncio.sleep(0.05)
        yield bytes(1024)


async def _silent(meta: dict) -> AsyncIterator[bytes]:
    """Opens a stream and sends nothing."""
    while True:
        await asyncio.sleep(3600)
        yield b""


ATTACKS: dict[str, Frames] = {"garbage": _garbage, "drip": _drip, "huge": _huge, "slow": _slow,
                              "huge_frame": _huge_frame, "silent": _silent}


async def attack(p2p: P2P, peer_id: PeerID, run_id: str, rpc: str, kind: str, meta: dict,
                 timeout: float = 30.0) -> Outcome:
    """Run one hostile stream of ``kind`` (a key of ``ATTACKS``) against ``rpc`` of ``peer_id``, until the server
    closes it or ``timeout`` passes."""
    outcome = Outcome(kind)
    start = time.monotonic()
    try:
        _, reader, writer = await p2p.call_binary_stream_handler(peer_id, handler_name(run_id, rpc))
    except Exception as e:  # noqa: BLE001 (a refused stream is an outcome too)
        outcome.code = f"open_failed: {type(e).__name__}"
        return outcome

    async def send() -> None:
        async for data in ATTACKS[kind](meta):
            writer.write(data)
            await writer.drain()
            outcome.bytes_sent += len(data)

    async def receive() -> None:
        while True:
            try:
                reply, _ = await P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader)
            except (asyncio.IncompleteReadError, OSError):
                outcome.closed_after_s = time.monotonic() - start
                return
            if reply is not None and reply.metadata and outcome.code is None:
                envelope = msgpack.unpackb(reply.metadata, raw=False)
                outcome.code = envelope.get("error", {}).get("code", "ok")
                outcome.replied_after_s = time.monotonic() - start

    sending = asyncio.create_task(send())
    try:
        await asyncio.wait_for(receive(), timeout)
    except asyncio.TimeoutError:
        pass
    finally:
        sending.cancel()
        with contextlib.suppress(BaseException):
            await sending
        writer.close()
    return outcome


# One wave of ``attack_waves``: (kind, streams), spread over the attacking identities; ``silent`` all from one
# identity, more than a node lets one peer hold.
WAVE = (("huge", 16), ("drip", 4), ("garbage", 4), ("slow", 4), ("huge_frame", 4), ("silent", 40))


async def attack_waves(p2ps: list[P2P], peer_id: PeerID, run_id: str, rpc: str, meta: dict,
                       stop: asyncio.Event, timeout: float = 30.0) -> list[Outcome]:
    """Send ``WAVE`` after ``WAVE`` of hostile streams at ``rpc`` of ``peer_id`` until ``stop`` is set (the wave in
    progress is finished); ``p2ps[-1]`` sends the ``silent`` streams, the others the rest, in turn."""
    outcomes: list[Outcome] = []
    while not stop.is_set():
        wave, i = [], 0
        for kind, count in WAVE:
            for _ in range(count):
                p2p = p2ps[-1] if kind == "silent" else p2ps[i % max(1, len(p2ps) - 1)]
                wave.append(attack(p2p, peer_id, run_id, rpc, kind, meta, timeout))
                i += 1
        outcomes += await asyncio.gather(*wave)
    return outcomes
