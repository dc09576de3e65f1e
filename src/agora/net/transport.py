"""Streamed tensor RPCs between swarm peers over hivemind's libp2p ``P2P``: ``add_handler`` serves, ``call`` asks.

A call sends ``(meta, tensors)`` (a msgpack-able dict plus CPU tensors) to a named handler of a peer and gets the
same shape back. Tensors always travel over a bidirectional stream, never a unary RPC: hivemind caps unary payloads
at 2 MiB, while one activation batch is easily tens of MiB. ``agora.net.framing`` turns one message into protobufs
and back; this module opens and drives the streams and turns every failure into an ``RpcError`` whose code callers
branch on (``agora.net.errors``). It re-exports both modules' names, so callers need only this one.

What it guarantees, each because it bit us or hivemind's users before (details in ``docs/TRANSPORT.md``):
servers read a request to its end before replying, so no reply is lost to a connection reset; every call runs
under one overall timeout and raises ``RpcTimeout`` naming the peer and handler, which also cancels the remote
handler; a send error after the full reply arrived does not hide the reply; big messages are (de)serialized in a
thread so the event loop keeps serving. ``AGORA_LINK`` emulates a slow uplink for the messages sent here.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, List, Mapping, Optional, Sequence, Tuple, Union

# framing must be imported before any hivemind module: it turns off hivemind's bf16->fp32 upcast, which hivemind
# reads once, at import. So the agora imports come first here.
from agora.net import errors
from agora.net.errors import (  # noqa: F401  (re-exported, see __all__)
    BAD_METADATA,
    CONNECTION_LOST,
    INTERNAL,
    MALFORMED,
    NO_HANDLER,
    PAYLOAD_TOO_LARGE,
    TIMEOUT,
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
from hivemind.p2p import P2P, P2PContext, P2PDaemonError, PeerID
from hivemind.proto import runtime_pb2

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CHUNK_SIZE_BYTES",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "MAX_METADATA_BYTES",
    "WIRE_VERSION",
    "TransferStats",
    "Handler",
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


@dataclass(frozen=True)
class _ServedHandler:
    """A handler registered by ``add_handler``; ``serve`` answers one incoming stream (one request, one reply)."""

    handle: str
    handler: Handler
    max_payload_bytes: int
    stats: Optional[TransferStats]

    async def serve(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        decoder = MessageDecoder(self.max_payload_bytes)
        failure = await self._drain(requests, decoder)
        if self.stats is not None:
            self.stats.calls += 1
        replies = await self._reply(decoder, failure, context.remote_id)
        for i, reply in enumerate(replies):
            await _pace(reply, first=(i == 0))
            if self.stats is not None:
                self.stats.count_sent(reply)
            yield reply

    async def _drain(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], decoder: MessageDecoder
    ) -> Optional[WireError]:
        """Feed the whole request to ``decoder``; the first ``WireError`` it raises is returned, not raised."""
        failure: Optional[WireError] = None
        async for request in requests:  # always drain the whole request before replying
            if self.stats is not None:
                self.stats.count_received(request)
            if failure is None:
                try:
                    decoder.feed(request)
                except WireError as e:
                    failure = e  # keep reading and discarding so that our error reply is not lost to a reset
        return failure

    async def _reply(
        self, decoder: MessageDecoder, failure: Optional[RpcError], peer_id: PeerID
    ) -> List[runtime_pb2.ExpertResponse]:
        """The handler's reply to a fully read request, or an error reply (``failure``, or what went wrong)."""
        if failure is None:
            try:
                return await self._run_handler(decoder, peer_id)
            except RpcError as e:
                failure = e
            except Exception as e:
                logger.warning(f"Handler {self.handle} failed on a request from {peer_id}:", exc_info=True)
                failure = RpcError(INTERNAL, f"{type(e).__name__}: {e}")
        logger.debug(f"Handler {self.handle} replies to {peer_id} with error {failure}")
        if self.stats is not None:
            self.stats.errors += 1
        return encode_error(failure)

    async def _run_handler(self, decoder: MessageDecoder, peer_id: PeerID) -> List[runtime_pb2.ExpertResponse]:
        meta, tensors = await _maybe_offload(decoder.finish, decoder.payload_bytes)
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
    :returns: the libp2p handler name
    """
    handle = handler_name(namespace, name)
    served = _ServedHandler(handle, handler, max_payload_bytes, stats)
    await p2p.add_protobuf_handler(
        handle, served.serve, runtime_pb2.ExpertRequest, stream_input=True, stream_output=True, balanced=balanced
    )
    return handle


async def remove_handler(p2p: P2P, namespace: str, name: str) -> None:
    """Stop serving a handler registered with ``add_handler``."""
    await p2p.remove_protobuf_handler(handler_name(namespace, name), stream_input=True, stream_output=True)


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
