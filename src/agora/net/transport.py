"""Streamed tensor RPCs between swarm peers over hivemind's libp2p ``P2P``: ``add_handler`` serves, ``call`` asks.

A call sends ``(meta, tensors)`` (a msgpack-able dict plus CPU tensors) to a named handler of a peer and gets the
same shape back. Tensors always travel over a bidirectional stream, never a unary RPC: hivemind caps unary payloads
at 2 MiB, while one activation batch is easily tens of MiB. ``agora.net.framing`` turns one message into protobufs
and back; this module opens and drives the streams and turns every failure into an ``RpcError`` whose code callers
branch on (``agora.net.errors``). It re-exports both modules' names, so callers need only this one.

What it guarantees, each because it bit us or hivemind's users before (details in ``docs/TRANSPORT.md``):
servers read a valid request to its end before replying, so no reply is lost to a connection reset, and hold
hostile streams within ``agora.net.admission`` limits (frame lengths, admission at the header, a byte budget, stream
caps, a minimum rate, bounded drains); every call runs
under one overall timeout and raises ``RpcTimeout`` naming the peer and handler, which also cancels the remote
handler; a send error after the full reply arrived does not hide the reply; big messages are (de)serialized in a
thread so the event loop keeps serving. ``AGORA_LINK`` emulates a slow uplink for the messages sent here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import closing
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, List, Mapping, Optional, Sequence, Tuple, Union

# framing must be imported before any hivemind module: it turns off hivemind's bf16->fp32 upcast, which hivemind
# reads once, at import. So the agora imports come first here.
from agora.net import errors
from agora.net.admission import IncomingGate, IncomingLimits, Reservation, StreamSlot
from agora.net.errors import (  # noqa: F401  (re-exported, see __all__)
    BAD_METADATA,
    BUSY,
    CONNECTION_LOST,
    INTERNAL,
    MALFORMED,
    NO_HANDLER,
    PAYLOAD_TOO_LARGE,
    TIMEOUT,
    TOO_SLOW,
    TRUNCATED,
    UNREACHABLE,
    UNSUPPORTED_TENSOR,
    RpcError,
    RpcTimeout,
    WireError,
)
from agora.net.framing import (
    DEFAULT_CHUNK_SIZE_BYTES,
    DEFAULT_MAX_PAYLOAD_BYTES,
    MAX_METADATA_BYTES,
    WIRE_VERSION,
    Message,
    MessageDecoder,
    TransferStats,
    decode_message,
    encode_error,
    encode_message,
    payload_nbytes,
)
from agora.net.throttle import LinkThrottle

import torch
from google.protobuf.message import DecodeError
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.proto import runtime_pb2

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CHUNK_SIZE_BYTES",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "MAX_METADATA_BYTES",
    "WIRE_VERSION",
    "TransferStats",
    "Handler",
    "Admit",
    "IncomingGate",
    "IncomingLimits",
    "MessageDecoder",
    "encode_message",
    "encode_error",
    "decode_message",
    "handler_name",
    "add_handler",
    "remove_handler",
    "call",
    *errors.__all__,  # RpcError, RpcTimeout, WireError and the codes: callers use transport.TIMEOUT etc.
]

# One emulated link per process (= per peer), shared by every stream it sends: ``AGORA_LINK=80mbit,50ms``. Unset in
# normal runs. It caps only our tensor RPCs, not hivemind's DHT or averaging traffic; ``demo --link-mbps`` as root
# caps those in the kernel instead (namespaces + tc tbf) and sets only the latency here (e.g. ``AGORA_LINK=50ms``).
# Read at every send, so tests may swap it.
_LINK = LinkThrottle.from_env()
_OFFLOAD_THRESHOLD_BYTES = 2**20  # (de)serialize bigger messages in a thread so the event loop keeps serving

Handler = Callable[[dict, List[torch.Tensor], PeerID], Awaitable[Tuple[dict, List[torch.Tensor]]]]


async def _maybe_offload(function: Callable[[], Any], nbytes: int) -> Any:
    """Run CPU-heavy (de)serialization in a thread for big messages: the event loop also serves other peers."""
    if nbytes < _OFFLOAD_THRESHOLD_BYTES:
        return function()
    return await asyncio.get_running_loop().run_in_executor(None, function)


async def _pace(message: Message, first: bool) -> None:
    """Wait for this peer's emulated uplink (``agora demo --link-mbps``), if any; a stream's first message also
    pays the link's latency."""
    if _LINK is not None:
        await _LINK.send(message.ByteSize(), latency=first)


def handler_name(namespace: str, name: str) -> str:
    """The libp2p protocol id of a handler; the namespace (the run id) keeps concurrent runs apart."""
    for label, value in (("namespace", namespace), ("name", name)):
        if not isinstance(value, str) or not value or any(c.isspace() for c in value) or "::" in value:
            raise ValueError(f"{label} must be a non-empty string without whitespace or '::', got {value!r}")
    return f"{namespace}::agora.{name}"


# ------------------------------------------------------------------------------------------------ server

# A frame is hivemind's: a 1-byte marker, an 8-byte big-endian length, a protobuf. One frame carries the header
# (<= MAX_METADATA_BYTES of metadata) or one chunk (<= DEFAULT_CHUNK_SIZE_BYTES of tensor buffer); anything longer
# is refused from its length prefix, before a byte of it is read.
_MAX_FRAME_BYTES = max(MAX_METADATA_BYTES, DEFAULT_CHUNK_SIZE_BYTES) + 64 * 1024
# What one chunk frame may carry besides its tensor buffer (dtype, shape, chunk count, protobuf tags): the budget a
# request reserves is its payload plus this per announced frame.
_FRAME_OVERHEAD_BYTES = 1024
_DISCARD_CHUNK_BYTES = 64 * 1024
_MIN_READ_S = 0.05

# Checks a request's header (its meta, the payload bytes it announces, the caller) before any payload is read;
# raises RpcError to refuse it. See add_handler's ``admit``.
Admit = Callable[[dict, int, PeerID], Awaitable[None]]


class _Dropped(Exception):
    """The stream is dropped without a reply (the caller went away, or the reply could not be sent)."""


class _RequestStream:
    """Reads one request's frames from a server-side stream within the gate's limits.

    Every read has a deadline: after ``grace_s``, the stream must have delivered ``min_rate_bytes_per_s`` on
    average since it opened (time spent waiting for room in the budget does not count), else ``too_slow``.
    Every frame's bytes are reserved in the budget before they are read.
    """

    def __init__(self, reader: asyncio.StreamReader, slot: Optional[StreamSlot], limits: IncomingLimits):
        self.reader, self.slot, self.limits = reader, slot, limits
        self.started = time.monotonic()
        self.bytes_read = 0
        self.ended = False  # END_OF_STREAM was read

    def _deadline(self, more_bytes: int = 0) -> float:
        return self.started + self.limits.grace_s + (self.bytes_read + more_bytes) / self.limits.min_rate_bytes_per_s

    async def _read(self, nbytes: int, deadline: float) -> bytes:
        # At least a moment even past the deadline: bytes that arrived while this event loop was busy elsewhere are
        # read, not held against the sender.
        left = max(deadline - time.monotonic(), _MIN_READ_S)
        try:
            data = await asyncio.wait_for(self.reader.readexactly(nbytes), left)
        except asyncio.TimeoutError:
            raise RpcError(TOO_SLOW, f"the request arrived slower than {self.limits.min_rate_bytes_per_s} bytes/s "
                                     f"(after {self.limits.grace_s:g} s; {self.bytes_read} bytes read)") from None
        except (asyncio.IncompleteReadError, OSError) as e:
            raise _Dropped(f"the caller closed the stream after {self.bytes_read} bytes ({e!r})") from None
        self.bytes_read += nbytes
        return data

    async def frame_length(self) -> Tuple[bytes, int]:
        """The next frame's marker and length, refusing lengths no frame of ours has."""
        prefix = await self._read(1 + P2P.HEADER_LEN, self._deadline())
        marker, length = prefix[:1], int.from_bytes(prefix[1:], P2P.BYTEORDER)
        if marker not in (P2P.MESSAGE_MARKER, P2P.ERROR_MARKER):
            raise WireError(MALFORMED, f"unknown frame marker {marker!r}")
        if length > _MAX_FRAME_BYTES:
            raise WireError(PAYLOAD_TOO_LARGE, f"a frame of {length} bytes; the limit is {_MAX_FRAME_BYTES}")
        return marker, length

    async def frame(self, reserve: bool) -> Optional[runtime_pb2.ExpertRequest]:
        """The next request protobuf, or None at the end of the stream. ``reserve``: take the frame's bytes from
        the budget first (the header's); else they must fit what the stream reserved already."""
        marker, length = await self.frame_length()
        if reserve:
            self.started += await self.slot.reservation.grow(length)
        elif self.bytes_read + length > self.slot.reservation.nbytes + 1 + P2P.HEADER_LEN:
            raise WireError(MALFORMED, "the request's frames are larger than its header announced")
        data = await self._read(length, self._deadline(length))
        if marker == P2P.ERROR_MARKER:  # the caller's END_OF_STREAM (an empty RPCError)
            self.ended = True
            return None
        request = runtime_pb2.ExpertRequest()
        try:
            request.ParseFromString(data)
        except DecodeError as e:
            raise WireError(MALFORMED, f"a frame does not parse as a request protobuf: {e!r}") from None
        return request

    async def drain(self) -> None:
        """After a refusal: read and discard what the caller still sends, so that our error reply is not lost to
        a reset, but at most ``drain_bytes`` and ``drain_s``; the reply then goes out anyway (and may be lost)."""
        if self.ended:
            return
        budget, deadline = self.limits.drain_bytes, time.monotonic() + self.limits.drain_s

        async def discard() -> None:
            nonlocal budget
            while True:
                prefix = await self.reader.readexactly(1 + P2P.HEADER_LEN)
                length = int.from_bytes(prefix[1:], P2P.BYTEORDER)
                budget -= len(prefix) + length
                if budget < 0:
                    return
                while length > 0:
                    length -= len(await self.reader.readexactly(min(length, _DISCARD_CHUNK_BYTES)))
                if prefix[:1] == P2P.ERROR_MARKER:
                    self.ended = True
                    return

        try:
            await asyncio.wait_for(discard(), max(0.0, deadline - time.monotonic()))
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, OSError):
            pass

    async def linger(self) -> None:
        """After our reply: discard what still comes until the caller, who has the reply now, closes the stream, for
        at most ``drain_s``. Closing at once could reset the stream and lose the reply in flight (a caller then sees
        ``connection_lost`` after the request ran); discarding costs no memory."""

        async def discard() -> None:
            while await self.reader.read(_DISCARD_CHUNK_BYTES):
                pass

        try:
            await asyncio.wait_for(discard(), self.limits.drain_s)
        except (asyncio.TimeoutError, OSError):
            pass

    async def closed_by_caller(self) -> None:
        """Returns when the caller closes the stream (or sends anything after its END_OF_STREAM)."""
        try:
            await self.reader.read(1)
        except OSError:
            pass


@dataclass(frozen=True)
class _ServedHandler:
    """A handler registered by ``add_handler``; ``serve`` answers one incoming stream (one request, one reply)."""

    handle: str
    handler: Handler
    max_payload_bytes: int
    stats: Optional[TransferStats]
    gate: IncomingGate
    admit: Optional[Admit]

    async def serve(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer_id = stream_info.peer_id
        with closing(writer):
            stream = _RequestStream(reader, None, self.gate.limits)
            try:
                replies = await self._answer(peer_id, stream)
            except _Dropped as e:
                logger.info(f"Handler {self.handle}: stream of {peer_id} dropped without a reply: {e}")
                return
            for i, reply in enumerate(replies):
                await _pace(reply, first=(i == 0))
                try:
                    await P2P.send_protobuf(reply, writer)
                except (OSError, ConnectionError, RuntimeError) as e:  # the caller went away: it reports the error
                    logger.info(f"Handler {self.handle}: reply to {peer_id} not sent: {e!r}")
                    return
                if self.stats is not None:
                    self.stats.count_sent(reply)
            await stream.linger()

    async def _answer(self, peer_id: PeerID, stream: _RequestStream) -> List[runtime_pb2.ExpertResponse]:
        if self.stats is not None:
            self.stats.calls += 1
        try:
            stream.slot = self.gate.open_stream(str(peer_id))
        except RpcError as e:
            await stream.drain()  # no slot: nothing is buffered, only discarded
            return self._error(e, peer_id)
        with stream.slot:
            decoder = MessageDecoder(self.max_payload_bytes)
            try:
                await self._read_request(stream, decoder, peer_id)
            except RpcError as e:  # WireError included
                if e.code == TOO_SLOW:
                    self.gate.count("too_slow")
                    logger.info(f"Handler {self.handle}: cut the request of {peer_id}: {e.message}")
                else:
                    await stream.drain()
                return self._error(e, peer_id)
            except Exception as e:  # a bug in an admission hook: the caller still gets an answer
                logger.warning(f"Handler {self.handle}: admitting a request of {peer_id} failed:", exc_info=True)
                await stream.drain()
                return self._error(RpcError(INTERNAL, f"{type(e).__name__}: {e}"), peer_id)
            return await self._run_handler_while_connected(stream, decoder, peer_id)

    async def _read_request(self, stream: _RequestStream, decoder: MessageDecoder, peer_id: PeerID) -> None:
        """Header, admission, the payload's reservation, the payload, END_OF_STREAM: each before the next."""
        header = await stream.frame(reserve=True)
        if header is None:
            raise WireError(TRUNCATED, "the stream ended before its header")
        self._count(header)
        decoder.feed(header)
        announced = decoder.announced
        if "error" in announced:
            raise WireError(MALFORMED, "a request cannot be an error envelope")
        if self.admit is not None:
            await self.admit(announced["meta"], announced["bytes"], peer_id)
        # The payload's room, all at once: two streams must never each hold half of what both need.
        stream.started += await stream.slot.reservation.grow(
            announced["bytes"] + (announced["n"] + 1) * _FRAME_OVERHEAD_BYTES)
        while not decoder.complete:
            request = await stream.frame(reserve=False)
            if request is None:
                raise WireError(TRUNCATED, f"the stream ended after {decoder.progress}")
            self._count(request)
            decoder.feed(request)
        if await stream.frame(reserve=False) is not None:
            raise WireError(MALFORMED, f"more messages than the {announced['n']} announced by the header")

    def _count(self, request: runtime_pb2.ExpertRequest) -> None:
        if self.stats is not None:
            self.stats.count_received(request)

    def _error(self, failure: RpcError, peer_id: PeerID) -> List[runtime_pb2.ExpertResponse]:
        logger.debug(f"Handler {self.handle} replies to {peer_id} with error {failure}")
        if self.stats is not None:
            self.stats.errors += 1
        return encode_error(failure)

    async def _run_handler_while_connected(
        self, stream: _RequestStream, decoder: MessageDecoder, peer_id: PeerID
    ) -> List[runtime_pb2.ExpertResponse]:
        """The handler's reply; the handler is cancelled if the caller closes the stream first (e.g. its timeout)."""
        handling = asyncio.create_task(self._run_handler(decoder, stream.slot.reservation, peer_id))
        watching = asyncio.create_task(stream.closed_by_caller())
        try:
            await asyncio.wait({handling, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
            if not handling.done():
                handling.cancel()
        if not handling.done() or handling.cancelled():
            raise _Dropped("the caller closed the stream while the handler ran; the handler was cancelled")
        try:
            return handling.result()
        except RpcError as e:
            return self._error(e, peer_id)
        except Exception as e:
            logger.warning(f"Handler {self.handle} failed on a request from {peer_id}:", exc_info=e)
            return self._error(RpcError(INTERNAL, f"{type(e).__name__}: {e}"), peer_id)

    async def _run_handler(
        self, decoder: MessageDecoder, reservation: Reservation, peer_id: PeerID
    ) -> List[runtime_pb2.ExpertResponse]:
        meta, tensors = await _maybe_offload(decoder.finish, decoder.payload_bytes)
        reservation.release()  # the frames are tensors now: what the handler holds is its own business
        result = await self.handler(meta, tensors, peer_id)
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise TypeError(f"handler must return a (meta, tensors) tuple, got {type(result).__name__}")
        reply_meta, reply_tensors = result
        return await _maybe_offload(
            lambda: encode_message(
                reply_meta,
                reply_tensors,
                message_type=runtime_pb2.ExpertResponse,
                max_payload_bytes=self.max_payload_bytes,
            ),
            payload_nbytes(reply_tensors),
        )


async def add_handler(
    p2p: P2P,
    namespace: str,
    name: str,
    handler: Handler,
    *,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    stats: Optional[TransferStats] = None,
    balanced: bool = False,
    gate: Optional[IncomingGate] = None,
    admit: Optional[Admit] = None,
) -> str:
    """Serve ``handler(meta, tensors, peer_id) -> (meta, tensors)`` as a streamed RPC on ``p2p``.

    The request is read to its end before anything is sent back (see ``docs/TRANSPORT.md``), then:
    an ``RpcError`` raised by the handler becomes an error reply with its code; any other exception becomes
    code "internal" with the exception text, and is logged with its traceback. Either way the server keeps serving.
    If the caller disconnects (e.g. on timeout) while the handler runs, the handler is cancelled.

    :param namespace: the run id; only callers that use the same one reach this handler
    :param max_payload_bytes: limit for the request's tensors (checked from its header) and for the reply's
    :param stats: server-side byte counters (requests count as received, replies as sent)
    :param balanced: let p2pd balance streams between several processes serving the same handler
    :param gate: the server's limits on streams, buffered bytes and slow senders (``agora.net.admission``), shared
      by all of its handlers; default: one of its own for this handler, with a budget of two maximal requests
    :param admit: ``admit(meta, announced_payload_bytes, peer_id)``, awaited once the header arrived and before any
      payload is read: raise ``RpcError`` to refuse the request (who may call, how big its payload may be)
    :returns: the libp2p handler name
    """
    handle = handler_name(namespace, name)
    if gate is None:
        gate = IncomingGate(IncomingLimits(budget_bytes=2 * max_payload_bytes + 2 * _MAX_FRAME_BYTES))
    served = _ServedHandler(handle, handler, max_payload_bytes, stats, gate, admit)
    await p2p.add_binary_stream_handler(handle, served.serve, balanced=balanced)
    return handle


async def remove_handler(p2p: P2P, namespace: str, name: str) -> None:
    """Stop serving a handler registered with ``add_handler``."""
    await p2p.remove_binary_stream_handler(handler_name(namespace, name))


# ------------------------------------------------------------------------------------------------ client


@dataclass(frozen=True)
class _Exchange:
    """One ``call`` in flight: the handler it talks to, and the limit and counters that apply to it."""

    p2p: P2P
    peer_id: PeerID
    handle: str
    max_payload_bytes: int
    stats: Optional[TransferStats]

    @property
    def target(self) -> str:
        """The handler and peer, as error messages name them."""
        return f"{self.handle!r} of peer {self.peer_id}"


async def call(
    p2p: P2P,
    peer_id: Union[PeerID, str],
    namespace: str,
    name: str,
    meta: Mapping[str, Any],
    tensors: Sequence[torch.Tensor],
    timeout: float,
    *,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    stats: Optional[TransferStats] = None,
) -> Tuple[dict, List[torch.Tensor]]:
    """Send ``(meta, tensors)`` to handler ``name`` of ``peer_id`` and return its ``(meta, tensors)`` reply.

    :param peer_id: a ``PeerID`` or its base58 string
    :param namespace: the run id the handler was registered under (see ``add_handler``)
    :param timeout: overall limit in seconds for encoding, connecting, sending and receiving the full reply
    :param max_payload_bytes: limit for the request (checked before sending) and for the reply
    :param stats: incremented with the bytes/messages actually sent and received, also for failed calls
    :raises RpcTimeout: no complete reply within ``timeout`` (code "timeout")
    :raises RpcError: ``remote=True`` with the handler's code for error replies; "unreachable" / "no_handler"
      if no stream could be opened; "connection_lost" if the stream broke before the full reply arrived
    :raises WireError: the request is oversized or cannot be serialized, or the reply is malformed
    """
    if isinstance(peer_id, str):
        peer_id = PeerID.from_base58(peer_id)
    exchange = _Exchange(p2p, peer_id, handler_name(namespace, name), max_payload_bytes, stats)
    if stats is not None:
        stats.calls += 1
    try:
        return await asyncio.wait_for(_call(exchange, meta, tensors), timeout)
    except asyncio.TimeoutError:
        if stats is not None:
            stats.errors += 1
        raise RpcTimeout(f"no reply from handler {exchange.target} within {timeout:.3g} s") from None
    except RpcError:
        if stats is not None:
            stats.errors += 1
        raise


async def _call(
    exchange: _Exchange, meta: Mapping[str, Any], tensors: Sequence[torch.Tensor]
) -> Tuple[dict, List[torch.Tensor]]:
    requests = await _maybe_offload(
        lambda: encode_message(meta, tensors, uid=exchange.handle, max_payload_bytes=exchange.max_payload_bytes),
        payload_nbytes(tensors),
    )
    # We drive the stream ourselves instead of using P2P.iterate_protobuf_handler: that helper starts writing
    # in a task that is only cleaned up once its reply iterator is iterated, and a write error (e.g. a reset) at the
    # end of the stream would mask a reply we already received in full. The framing is hivemind's own.
    reader, writer = await _open_stream(exchange)
    sending = asyncio.create_task(_send_requests(requests, writer, exchange.stats))
    try:
        decoder = await _receive_reply(exchange, reader, sending)
    finally:
        if not sending.done():
            sending.cancel()
        elif not sending.cancelled():
            sending.exception()  # mark a send error as retrieved: it was reported already or is moot now
        writer.close()
    return await _maybe_offload(decoder.finish, decoder.payload_bytes)


async def _open_stream(exchange: _Exchange) -> Tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    try:
        _, reader, writer = await exchange.p2p.call_binary_stream_handler(exchange.peer_id, exchange.handle)
    except P2PDaemonError as e:
        code = NO_HANDLER if "protocol" in str(e) and "not supported" in str(e) else UNREACHABLE
        raise RpcError(code, f"cannot open a stream to {exchange.target}: {e}") from e
    except (OSError, asyncio.IncompleteReadError) as e:  # our own p2pd daemon is unreachable or went away
        raise RpcError(UNREACHABLE, f"cannot open a stream to {exchange.target}: {e!r}") from e
    return reader, writer


async def _send_requests(
    requests: List[runtime_pb2.ExpertRequest], writer: asyncio.StreamWriter, stats: Optional[TransferStats]
) -> None:
    for i, request in enumerate(requests):
        await _pace(request, first=(i == 0))
        await P2P.send_protobuf(request, writer)
        if stats is not None:
            stats.count_sent(request)
    await P2P.send_protobuf(P2P.END_OF_STREAM, writer)


async def _receive_reply(
    exchange: _Exchange, reader: asyncio.StreamReader, sending: asyncio.Task
) -> MessageDecoder:
    """Read the reply until ``MessageDecoder.complete``, while ``sending`` may still be writing the request."""
    decoder = MessageDecoder(exchange.max_payload_bytes)
    while not decoder.complete:
        try:
            reply, error = await P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader)
        except (asyncio.IncompleteReadError, OSError) as e:
            failure = sending.exception() if sending.done() and not sending.cancelled() else None
            raise RpcError(
                CONNECTION_LOST,
                f"stream to {exchange.target} closed after {decoder.progress} "
                f"({e!r}{f'; sending failed with {failure!r}' if failure else ''})",
            ) from e
        except (TypeError, DecodeError) as e:  # bad frame marker or unparsable protobuf
            raise WireError(MALFORMED, f"unparsable reply from {exchange.target}: {e!r}") from e
        if error is not None:  # hivemind-level handler failure, not produced by agora servers
            raise RpcError(INTERNAL, f"handler {exchange.target} failed: {error.message}", remote=True)
        if exchange.stats is not None:
            exchange.stats.count_received(reply)
        decoder.feed(reply)
    if sending.done() and not sending.cancelled() and sending.exception() is not None:
        # The full reply is here; a write error now (e.g. a reset after a non-draining server replied early)
        # must not hide it.
        logger.debug(f"Ignoring a send error after the full reply from {exchange.peer_id}: {sending.exception()!r}")
    return decoder
