"""Streamed tensor RPCs between swarm peers over hivemind's libp2p ``P2P``.

A call carries ``(meta, tensors)``: a msgpack-able dict plus a list of CPU tensors, and gets the same shape back.
We reuse hivemind's existing protobufs (``runtime_pb2.ExpertRequest`` / ``ExpertResponse``) instead of adding a
.proto file, and we never use unary RPCs for tensors: hivemind caps unary payloads at 2 MiB
(``MAX_UNARY_PAYLOAD_SIZE``), while one activation batch is easily tens of MiB. Every message therefore goes over a
bidirectional *stream* handler, chunked with hivemind's ``split_for_streaming``.

Wire format of one message (request or reply), a stream of protobufs::

    [0]   header:   metadata = msgpack({"v": 1, "meta": {...}, "n": N, "tensors": T, "bytes": B}), no tensors
    [1:N] chunks:   exactly one ``runtime_pb2.Tensor`` part each; the first part of every tensor carries its
                    dtype/shape/``chunks`` count, the following parts only carry buffer bytes

The header announces how many messages follow (``N``), how many tensors they hold (``T``) and the total tensor
payload (``B``), so a receiver knows where the stream ends, can reject an oversized message before buffering it,
and can tell a truncated stream from a complete one. An error reply is a lone header
``{"v": 1, "error": {"code": ..., "message": ...}, "n": 0}``, re-raised on the caller as ``RpcError(code)``.

Things this module deliberately takes care of, because each one bit us or hivemind's users before:

* **bf16 upcast.** hivemind's ``NoCompression`` serializes bfloat16 as float32 (twice the bytes) unless the env var
  ``USE_LEGACY_BFLOAT16=0`` is set *before* ``hivemind.compression.base`` is imported (it is read once, at import).
  We set it below, before importing hivemind, and if hivemind was already imported by someone else we flip the
  module flag it reads at call time. Receivers accept both encodings, so this stays compatible with legacy peers.
* **Reply lost to a TCP reset.** If a server replies (e.g. with an error) and closes the stream while the caller is
  still writing its request, the caller's next write hits a reset and the reply is lost. Servers here always read
  the request stream to its end (discarding it if it is already known to be bad) before sending anything.
* **No silent hangs.** Every ``call`` runs under one overall ``asyncio.wait_for`` and raises ``RpcTimeout`` naming
  the peer and the handler; a caller that gives up closes the stream, which cancels the handler on the server.

Byte accounting: ``TransferStats`` counts tensor payload bytes (what the boundary actually costs), protobuf wire
bytes (payload + metadata + protobuf overhead) and messages. Pass one to ``call``/``add_handler`` and it is
*incremented*, so one object per pipeline boundary accumulates over many calls.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import asdict, dataclass
from typing import (
    Any,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Type,
    TypeVar,
    Union,
)

# Must happen before hivemind.compression.base is imported, see the module docstring.
os.environ["USE_LEGACY_BFLOAT16"] = "0"

import msgpack  # noqa: E402
import torch  # noqa: E402
from google.protobuf.message import DecodeError  # noqa: E402
from hivemind.compression import base as _hivemind_compression_base  # noqa: E402
from hivemind.compression.serialization import deserialize_torch_tensor, serialize_torch_tensor  # noqa: E402
from hivemind.p2p import P2P, P2PContext, P2PDaemonError, PeerID  # noqa: E402
from hivemind.proto import runtime_pb2  # noqa: E402
from hivemind.utils.streaming import split_for_streaming  # noqa: E402

from agora.net.throttle import LinkThrottle  # noqa: E402

logger = logging.getLogger(__name__)

if _hivemind_compression_base.USE_LEGACY_BFLOAT16:
    # hivemind was imported before us with the legacy default; NoCompression.compress reads this module global on
    # every call, so flipping it restores native 2-byte bf16 for this process.
    logger.debug("hivemind was imported before agora.net.transport; disabling its legacy bf16->fp32 upcast")
    _hivemind_compression_base.USE_LEGACY_BFLOAT16 = False

__all__ = [
    "DEFAULT_CHUNK_SIZE_BYTES",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "MAX_METADATA_BYTES",
    "WIRE_VERSION",
    "RpcError",
    "RpcTimeout",
    "WireError",
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
]

WIRE_VERSION = 1

# One emulated link per process (= per peer), shared by every stream it sends: ``AGORA_LINK=80mbit,50ms``. Unset in
# normal runs. It caps only our tensor RPCs, not hivemind's DHT or averaging traffic; ``demo --link-mbps`` as root
# caps those in the kernel instead (namespaces + tc tbf) and sets only the latency here (e.g. ``AGORA_LINK=50ms``).
_LINK = LinkThrottle.from_env()
DEFAULT_CHUNK_SIZE_BYTES = 2**20  # 1 MiB: well below p2pd's 4 MiB message limit, large enough to amortize framing
DEFAULT_MAX_PAYLOAD_BYTES = 256 * 2**20  # total tensor bytes of one message; both sides enforce it
MAX_METADATA_BYTES = 2**20  # the header must stay a small control message, tensors belong in the payload
_MAX_ERROR_MESSAGE_CHARS = 4096
_OFFLOAD_THRESHOLD_BYTES = 2**20  # (de)serialize bigger messages in a thread so the event loop keeps serving

# Error codes. Callers branch on these, so they are part of the API; handlers may raise RpcError with their own codes.
INTERNAL = "internal"  # the remote handler raised something that is not an RpcError
TIMEOUT = "timeout"  # no complete reply within the caller's timeout
UNREACHABLE = "unreachable"  # could not open a stream to the peer (unknown, offline, wrong address)
# The peer is up but serves no such handler (e.g. another run/namespace). Best effort: right after a peer removes a
# handler, libp2p may still negotiate the protocol lazily from its cached peer info, and the refusal then arrives as
# "connection_lost". Callers should treat both as "route elsewhere".
NO_HANDLER = "no_handler"
CONNECTION_LOST = "connection_lost"  # the stream broke after it was opened
PAYLOAD_TOO_LARGE = "payload_too_large"
TRUNCATED = "truncated"  # fewer messages/chunks than the header announced
MALFORMED = "malformed"  # anything else that does not parse as our wire format
BAD_METADATA = "bad_metadata"  # metadata is not a msgpack-able dict
UNSUPPORTED_TENSOR = "unsupported_tensor"  # dtype/layout that cannot be serialized

_Msg = TypeVar("_Msg", runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse)
Message = Union[runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse]
Handler = Callable[[dict, List[torch.Tensor], PeerID], Awaitable[Tuple[dict, List[torch.Tensor]]]]


class RpcError(Exception):
    """A failed RPC with a machine-readable ``code`` (e.g. "shape_mismatch", "timeout", "unreachable").

    Raised by handlers to send a specific error back, and by ``call`` for both remote errors (``remote=True``:
    the peer answered with an error reply) and local ones (timeout, unreachable, broken stream).
    """

    def __init__(self, code: str, message: str = "", *, remote: bool = False):
        if not isinstance(code, str) or not code:
            raise TypeError(f"RpcError code must be a non-empty string, got {code!r}")
        super().__init__(f"[{code}] {message}" if message else f"[{code}]")
        self.code = code
        self.message = message
        self.remote = remote

    def __reduce__(self):  # keep code/message/remote when pickled across processes (e.g. via MPFuture)
        return _rebuild_error, (type(self), self.code, self.message, self.remote)


def _rebuild_error(cls: type, code: str, message: str, remote: bool) -> RpcError:
    error = RpcError.__new__(cls)
    RpcError.__init__(error, code, message, remote=remote)
    return error


class RpcTimeout(RpcError):
    """The call did not complete within its timeout (code "timeout"); the message names the peer and handler."""

    def __init__(self, message: str = "", *, remote: bool = False):
        super().__init__(TIMEOUT, message, remote=remote)

    def __reduce__(self):
        return _rebuild_error, (type(self), self.code, self.message, self.remote)


class WireError(RpcError, ValueError):
    """A message that cannot be encoded or decoded: oversized, truncated or malformed.

    It is a ``ValueError`` (bad data) and an ``RpcError`` (so ``except RpcError`` around ``call`` catches it too).
    """


@dataclass
class TransferStats:
    """Counters for one side of one or more RPCs; ``call``/``add_handler`` add to them, never reset them.

    ``payload_*`` counts tensor buffer bytes only (the cost of a pipeline boundary: for bf16 that is exactly
    2 bytes per element), ``wire_*`` counts serialized protobuf bytes (payload + metadata + protobuf overhead,
    excluding hivemind's 9-byte frame headers and libp2p/TLS overhead).
    """

    payload_bytes_sent: int = 0
    payload_bytes_received: int = 0
    wire_bytes_sent: int = 0
    wire_bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    calls: int = 0
    errors: int = 0

    def as_dict(self) -> dict:
        return asdict(self)

    def _count_sent(self, message: Message) -> None:
        self.messages_sent += 1
        self.wire_bytes_sent += message.ByteSize()
        self.payload_bytes_sent += _payload_size(message)

    def _count_received(self, message: Message) -> None:
        self.messages_received += 1
        self.wire_bytes_received += message.ByteSize()
        self.payload_bytes_received += _payload_size(message)


def _payload_size(message: Message) -> int:
    return sum(len(part.buffer) for part in message.tensors)


# ------------------------------------------------------------------------------------------------ encoding


def _pack_header(envelope: dict) -> bytes:
    try:
        packed = msgpack.packb(envelope, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(BAD_METADATA, f"metadata is not msgpack-serializable: {e}") from e
    if len(packed) > MAX_METADATA_BYTES:
        raise WireError(
            PAYLOAD_TOO_LARGE,
            f"metadata is {len(packed)} bytes, the limit is {MAX_METADATA_BYTES}; send bulk data as tensors",
        )
    return packed


def _serialize_tensor(index: int, tensor: torch.Tensor) -> runtime_pb2.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise WireError(UNSUPPORTED_TENSOR, f"tensors[{index}] is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.layout != torch.strided:
        raise WireError(UNSUPPORTED_TENSOR, f"tensors[{index}] has layout {tensor.layout}; only dense tensors")
    # Autograd state is not part of the wire format: receivers decide themselves what needs gradients.
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    try:
        serialized = serialize_torch_tensor(tensor, runtime_pb2.CompressionType.NONE)
    except (TypeError, RuntimeError, ValueError) as e:
        raise WireError(UNSUPPORTED_TENSOR, f"tensors[{index}] ({tensor.dtype}) cannot be serialized: {e}") from e
    expected = tensor.numel() * tensor.element_size()
    if len(serialized.buffer) != expected:  # e.g. the legacy bf16->fp32 upcast sneaking back in
        raise WireError(
            UNSUPPORTED_TENSOR,
            f"tensors[{index}] ({tensor.dtype}) serialized to {len(serialized.buffer)} bytes, expected {expected}",
        )
    return serialized


def encode_message(
    meta: Mapping[str, Any],
    tensors: Sequence[torch.Tensor],
    *,
    message_type: Type[_Msg] = runtime_pb2.ExpertRequest,
    uid: str = "",
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES,
) -> List[_Msg]:
    """Turn ``(meta, tensors)`` into the stream of protobufs described in the module docstring.

    :param message_type: ``runtime_pb2.ExpertRequest`` for requests, ``runtime_pb2.ExpertResponse`` for replies
    :param uid: stored in the header's ``uid`` field (requests only; informational, e.g. the handler name)
    :raises WireError: ``payload_too_large`` if the tensors exceed ``max_payload_bytes`` (checked before any copy),
      ``bad_metadata`` / ``unsupported_tensor`` for inputs that cannot be serialized
    """
    if not isinstance(meta, Mapping):
        raise WireError(BAD_METADATA, f"metadata must be a dict, got {type(meta).__name__}")
    if chunk_size_bytes <= 0:
        raise ValueError(f"chunk_size_bytes must be positive, got {chunk_size_bytes}")
    tensors = list(tensors)
    declared = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    if declared > max_payload_bytes:
        raise WireError(
            PAYLOAD_TOO_LARGE, f"tensor payload is {declared} bytes, the limit is {max_payload_bytes} bytes"
        )

    chunks: List[runtime_pb2.Tensor] = []
    for index, tensor in enumerate(tensors):
        chunks.extend(split_for_streaming(_serialize_tensor(index, tensor), chunk_size_bytes))
    payload_bytes = sum(len(chunk.buffer) for chunk in chunks)

    envelope = {
        "v": WIRE_VERSION,
        "meta": dict(meta),
        "n": len(chunks),
        "tensors": len(tensors),
        "bytes": payload_bytes,
    }
    header = message_type(metadata=_pack_header(envelope))
    if uid and message_type is runtime_pb2.ExpertRequest:
        header.uid = uid
    return [header] + [message_type(tensors=[chunk]) for chunk in chunks]


def encode_error(error: RpcError, *, message_type: Type[_Msg] = runtime_pb2.ExpertResponse) -> List[_Msg]:
    """An error reply: a lone header whose envelope holds ``{"error": {"code", "message"}}`` and ``n == 0``."""
    message = str(error.message)[:_MAX_ERROR_MESSAGE_CHARS]
    envelope = {"v": WIRE_VERSION, "error": {"code": error.code, "message": message}, "n": 0}
    return [message_type(metadata=msgpack.packb(envelope, use_bin_type=True))]


# ------------------------------------------------------------------------------------------------ decoding


class MessageDecoder:
    """Incrementally reassembles one message from its protobuf stream, validating it as it arrives.

    ``feed`` is cheap (it only collects buffers) and enforces the size limit *before* buffering more data;
    ``finish`` deserializes the tensors (CPU-heavy for big messages; safe to run in a thread).
    """

    def __init__(self, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES):
        self.max_payload_bytes = max_payload_bytes
        self.payload_bytes = 0
        self.wire_bytes = 0
        self._envelope: Optional[dict] = None
        self._expected_messages = 0
        self._received_messages = 0
        self._finished_tensors: List[Tuple[runtime_pb2.Tensor, List[bytes]]] = []
        self._open_tensor: Optional[Tuple[runtime_pb2.Tensor, List[bytes]]] = None
        self._open_chunks_left = 0

    @property
    def complete(self) -> bool:
        """True once the header and all messages it announced have arrived."""
        return self._envelope is not None and self._received_messages == self._expected_messages

    @property
    def progress(self) -> str:
        if self._envelope is None:
            return "no header"
        return f"{self._received_messages} of {self._expected_messages} messages after the header"

    def feed(self, message: Message) -> None:
        """Consume the next protobuf of the stream; raises ``WireError`` as soon as the stream is invalid."""
        self.wire_bytes += message.ByteSize()
        if self._envelope is None:
            self._read_header(message)
            return
        if self.complete:
            raise WireError(MALFORMED, f"more messages than the {self._expected_messages} announced by the header")
        self._received_messages += 1
        if message.metadata:
            raise WireError(MALFORMED, "only the first message of a stream may carry metadata")
        if len(message.tensors) != 1:
            raise WireError(MALFORMED, f"expected exactly one tensor part per message, got {len(message.tensors)}")
        part = message.tensors[0]
        self.payload_bytes += len(part.buffer)
        if self.payload_bytes > self.max_payload_bytes:
            raise WireError(
                PAYLOAD_TOO_LARGE, f"tensor payload exceeds the limit of {self.max_payload_bytes} bytes"
            )
        if self.payload_bytes > self._envelope["bytes"]:
            raise WireError(MALFORMED, f"tensor payload exceeds the {self._envelope['bytes']} bytes announced")

        if part.dtype:  # first part of a new tensor: it carries dtype, shape and the number of chunks
            if self._open_tensor is not None:
                raise WireError(TRUNCATED, f"tensor {len(self._finished_tensors)} ended before its last chunk")
            if len(self._finished_tensors) >= self._envelope["tensors"]:
                raise WireError(MALFORMED, f"more tensors than the {self._envelope['tensors']} announced")
            self._open_tensor = (part, [part.buffer])
            self._open_chunks_left = max(part.chunks, 1) - 1  # an empty tensor is one part with chunks == 0
        else:
            if self._open_tensor is None or self._open_chunks_left <= 0:
                raise WireError(MALFORMED, "a continuation chunk arrived without an unfinished tensor")
            if part.size or part.chunks or part.compression:
                raise WireError(MALFORMED, "a continuation chunk carries tensor header fields")
            self._open_tensor[1].append(part.buffer)
            self._open_chunks_left -= 1
        if self._open_chunks_left == 0:
            self._finished_tensors.append(self._open_tensor)
            self._open_tensor = None

    def _read_header(self, message: Message) -> None:
        if message.tensors:
            raise WireError(MALFORMED, "the header message must not carry tensors")
        try:
            envelope = msgpack.unpackb(message.metadata, raw=False, strict_map_key=False)
        except Exception as e:  # msgpack raises a zoo of exception types for garbage input
            raise WireError(MALFORMED, f"header metadata is not valid msgpack: {e}") from e
        if not isinstance(envelope, dict) or envelope.get("v") != WIRE_VERSION:
            version = envelope.get("v") if isinstance(envelope, dict) else None
            raise WireError(MALFORMED, f"header is not an agora wire v{WIRE_VERSION} envelope (version {version!r})")
        if "error" in envelope:
            error = envelope["error"]
            if not isinstance(error, dict) or not isinstance(error.get("code"), str) or not error["code"]:
                raise WireError(MALFORMED, f"malformed error envelope: {error!r}")
            envelope.update(n=0, tensors=0, bytes=0)
        for key in ("n", "tensors", "bytes"):
            value = envelope.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise WireError(MALFORMED, f"header field {key!r} must be a non-negative int, got {value!r}")
        if "error" not in envelope and not isinstance(envelope.get("meta"), dict):
            raise WireError(MALFORMED, "header has no metadata dict")
        if envelope["bytes"] > self.max_payload_bytes:
            raise WireError(
                PAYLOAD_TOO_LARGE,
                f"announced tensor payload of {envelope['bytes']} bytes exceeds the limit of "
                f"{self.max_payload_bytes} bytes",
            )
        if envelope["n"] < envelope["tensors"]:
            raise WireError(MALFORMED, f"{envelope['tensors']} tensors cannot fit in {envelope['n']} messages")
        self._envelope = envelope
        self._expected_messages = envelope["n"]

    def finish(self) -> Tuple[dict, List[torch.Tensor]]:
        """Return ``(meta, tensors)``; raise ``RpcError(code, remote=True)`` if the message is an error reply.

        :raises WireError: ``truncated`` if the stream ended early, ``malformed`` if a tensor does not deserialize
        """
        if self._envelope is None:
            raise WireError(TRUNCATED, "the stream ended before its header")
        if not self.complete or self._open_tensor is not None:
            raise WireError(TRUNCATED, f"the stream ended after {self.progress}")
        if "error" in self._envelope:
            error = self._envelope["error"]
            raise RpcError(error["code"], str(error.get("message", "")), remote=True)
        if len(self._finished_tensors) != self._envelope["tensors"] or self.payload_bytes != self._envelope["bytes"]:
            raise WireError(
                MALFORMED,
                f"got {len(self._finished_tensors)} tensors / {self.payload_bytes} bytes, the header announced "
                f"{self._envelope['tensors']} / {self._envelope['bytes']}",
            )
        tensors = []
        for index, (first_part, buffers) in enumerate(self._finished_tensors):
            serialized = runtime_pb2.Tensor()
            serialized.CopyFrom(first_part)
            serialized.buffer = b"".join(buffers)
            serialized.requires_grad = False
            try:
                tensors.append(deserialize_torch_tensor(serialized))
            except Exception as e:  # wrong buffer size, unknown dtype or compression, ...
                raise WireError(
                    MALFORMED,
                    f"tensor {index} (dtype={first_part.dtype!r}, shape={list(first_part.size)}) "
                    f"does not deserialize: {type(e).__name__}: {e}",
                ) from e
        self._finished_tensors = []  # release the buffers; finish() is single-use
        return self._envelope["meta"], tensors


def decode_message(
    messages: Iterable[Message], *, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
) -> Tuple[dict, List[torch.Tensor]]:
    """Inverse of ``encode_message``/``encode_error`` for an already-received stream of protobufs."""
    decoder = MessageDecoder(max_payload_bytes)
    for message in messages:
        decoder.feed(message)
    return decoder.finish()


async def _maybe_offload(function: Callable[[], Any], nbytes: int) -> Any:
    """Run CPU-heavy (de)serialization in a thread for big messages: the event loop also serves other peers."""
    if nbytes < _OFFLOAD_THRESHOLD_BYTES:
        return function()
    return await asyncio.get_running_loop().run_in_executor(None, function)


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


# ------------------------------------------------------------------------------------------------ server


def handler_name(namespace: str, name: str) -> str:
    """The libp2p protocol id of a handler; the namespace (the run id) keeps concurrent runs apart."""
    for label, value in (("namespace", namespace), ("name", name)):
        if not isinstance(value, str) or not value or any(c.isspace() for c in value) or "::" in value:
            raise ValueError(f"{label} must be a non-empty string without whitespace or '::', got {value!r}")
    return f"{namespace}::agora.{name}"


async def add_handler(
    p2p: P2P,
    namespace: str,
    name: str,
    handler: Handler,
    *,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES,
    stats: Optional[TransferStats] = None,
    balanced: bool = False,
) -> str:
    """Serve ``handler(meta, tensors, peer_id) -> (meta, tensors)`` as a streamed RPC on ``p2p``.

    The request is read to its end before anything is sent back (see the module docstring), then:
    an ``RpcError`` raised by the handler becomes an error reply with its code; any other exception becomes
    code "internal" with the exception text, and is logged with its traceback. Either way the server keeps serving.
    If the caller disconnects (e.g. on timeout) while the handler runs, the handler is cancelled.

    :param stats: server-side byte counters (requests count as received, replies as sent)
    :param balanced: let p2pd balance streams between several processes serving the same handler
    :returns: the libp2p handler name
    """
    handle = handler_name(namespace, name)

    async def _serve(
        requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        peer_id = context.remote_id
        decoder = MessageDecoder(max_payload_bytes)
        failure: Optional[RpcError] = None
        async for request in requests:  # always drain the whole request before replying
            if stats is not None:
                stats._count_received(request)
            if failure is None:
                try:
                    decoder.feed(request)
                except WireError as e:
                    failure = e  # keep reading and discarding so that our error reply is not lost to a reset
        if stats is not None:
            stats.calls += 1

        replies: List[runtime_pb2.ExpertResponse] = []
        if failure is None:
            try:
                meta, tensors = await _maybe_offload(decoder.finish, decoder.payload_bytes)
                result = await handler(meta, tensors, peer_id)
                if not (isinstance(result, (tuple, list)) and len(result) == 2):
                    raise TypeError(f"handler must return a (meta, tensors) tuple, got {type(result).__name__}")
                reply_meta, reply_tensors = result
                replies = await _maybe_offload(
                    lambda: encode_message(
                        reply_meta,
                        reply_tensors,
                        message_type=runtime_pb2.ExpertResponse,
                        max_payload_bytes=max_payload_bytes,
                        chunk_size_bytes=chunk_size_bytes,
                    ),
                    _nbytes(reply_tensors),
                )
            except RpcError as e:
                failure = e
            except Exception as e:
                logger.warning(f"Handler {handle} failed on a request from {peer_id}:", exc_info=True)
                failure = RpcError(INTERNAL, f"{type(e).__name__}: {e}")
        if failure is not None:
            logger.debug(f"Handler {handle} replies to {peer_id} with error {failure}")
            if stats is not None:
                stats.errors += 1
            replies = encode_error(failure)
        for i, reply in enumerate(replies):
            if _LINK is not None:  # emulated uplink of this peer (agora demo --link-mbps)
                await _LINK.send(reply.ByteSize(), latency=(i == 0))
            if stats is not None:
                stats._count_sent(reply)
            yield reply

    await p2p.add_protobuf_handler(
        handle, _serve, runtime_pb2.ExpertRequest, stream_input=True, stream_output=True, balanced=balanced
    )
    return handle


async def remove_handler(p2p: P2P, namespace: str, name: str) -> None:
    """Stop serving a handler registered with ``add_handler``."""
    await p2p.remove_protobuf_handler(handler_name(namespace, name), stream_input=True, stream_output=True)


# ------------------------------------------------------------------------------------------------ client


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
    chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES,
    stats: Optional[TransferStats] = None,
) -> Tuple[dict, List[torch.Tensor]]:
    """Send ``(meta, tensors)`` to handler ``name`` of ``peer_id`` and return its ``(meta, tensors)`` reply.

    :param peer_id: a ``PeerID`` or its base58 string
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
    handle = handler_name(namespace, name)
    if stats is not None:
        stats.calls += 1
    try:
        return await asyncio.wait_for(
            _call(p2p, peer_id, handle, meta, tensors, max_payload_bytes, chunk_size_bytes, stats), timeout
        )
    except asyncio.TimeoutError:
        if stats is not None:
            stats.errors += 1
        raise RpcTimeout(f"no reply from handler {handle!r} of peer {peer_id} within {timeout:.3g} s") from None
    except RpcError:
        if stats is not None:
            stats.errors += 1
        raise


async def _call(
    p2p: P2P,
    peer_id: PeerID,
    handle: str,
    meta: Mapping[str, Any],
    tensors: Sequence[torch.Tensor],
    max_payload_bytes: int,
    chunk_size_bytes: int,
    stats: Optional[TransferStats],
) -> Tuple[dict, List[torch.Tensor]]:
    requests = await _maybe_offload(
        lambda: encode_message(
            meta, tensors, uid=handle, max_payload_bytes=max_payload_bytes, chunk_size_bytes=chunk_size_bytes
        ),
        _nbytes(tensors),
    )
    # We drive the stream ourselves instead of using P2P.iterate_protobuf_handler: that helper starts writing
    # in a task that is only cleaned up once its reply iterator is iterated, and a write error (e.g. a reset) at the
    # end of the stream would mask a reply we already received in full. The framing is hivemind's own.
    try:
        _, reader, writer = await p2p.call_binary_stream_handler(peer_id, handle)
    except P2PDaemonError as e:
        code = NO_HANDLER if "protocol" in str(e) and "not supported" in str(e) else UNREACHABLE
        raise RpcError(code, f"cannot open a stream to {handle!r} of peer {peer_id}: {e}") from e
    except (OSError, asyncio.IncompleteReadError) as e:  # our own p2pd daemon is unreachable or went away
        raise RpcError(UNREACHABLE, f"cannot open a stream to {handle!r} of peer {peer_id}: {e!r}") from e

    async def _send_all() -> None:
        for i, request in enumerate(requests):
            if _LINK is not None:  # emulated uplink of this peer (agora demo --link-mbps)
                await _LINK.send(request.ByteSize(), latency=(i == 0))
            await P2P.send_protobuf(request, writer)
            if stats is not None:
                stats._count_sent(request)
        await P2P.send_protobuf(P2P.END_OF_STREAM, writer)

    decoder = MessageDecoder(max_payload_bytes)
    sending = asyncio.create_task(_send_all())
    try:
        while not decoder.complete:
            try:
                reply, error = await P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader)
            except (asyncio.IncompleteReadError, OSError) as e:
                failure = sending.exception() if sending.done() and not sending.cancelled() else None
                raise RpcError(
                    CONNECTION_LOST,
                    f"stream to {handle!r} of peer {peer_id} closed after {decoder.progress} "
                    f"({e!r}{f'; sending failed with {failure!r}' if failure else ''})",
                ) from e
            except (TypeError, DecodeError) as e:  # bad frame marker or unparsable protobuf
                raise WireError(MALFORMED, f"unparsable reply from {handle!r} of peer {peer_id}: {e!r}") from e
            if error is not None:  # hivemind-level handler failure, not produced by agora servers
                raise RpcError(INTERNAL, f"handler {handle!r} of peer {peer_id} failed: {error.message}", remote=True)
            if stats is not None:
                stats._count_received(reply)
            decoder.feed(reply)
        if sending.done() and not sending.cancelled() and sending.exception() is not None:
            # The full reply is here; a write error now (e.g. a reset after a non-draining server replied early)
            # must not hide it.
            logger.debug(f"Ignoring a send error after the full reply from {peer_id}: {sending.exception()!r}")
    finally:
        if not sending.done():
            sending.cancel()
        elif not sending.cancelled():
            sending.exception()  # mark a send error as retrieved: it was reported above or is moot now
        writer.close()
    return await _maybe_offload(decoder.finish, decoder.payload_bytes)
