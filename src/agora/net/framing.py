"""The wire format of one tensor RPC message: ``(meta, tensors)`` <-> a list of hivemind protobufs.

Pure data conversion, no networking, so it can be tested and reasoned about without p2p daemons.
``encode_message`` / ``encode_error`` build the protobufs a sender writes to a stream; ``MessageDecoder`` checks and
reassembles them as they arrive; ``decode_message`` does that for a whole list. The first protobuf is a header that
announces how many messages, tensors and payload bytes follow, so a receiver knows where a message ends, refuses an
oversized one before buffering it and tells a truncated stream from a complete one. ``TransferStats`` counts the
bytes of these protobufs. The format and the pitfalls it avoids are described in ``docs/TRANSPORT.md``.

Importing this module switches off hivemind's legacy bf16->fp32 upcast (twice the bytes on the wire). hivemind
reads the switch once, when ``hivemind.compression.base`` is first imported, so import this module before any
hivemind module; if hivemind came first, the module flag it reads at call time is flipped instead.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple, Type, TypeVar, Union

# Must happen before hivemind.compression.base is imported, see the module docstring.
os.environ["USE_LEGACY_BFLOAT16"] = "0"

import msgpack  # noqa: E402
import torch  # noqa: E402
from hivemind.compression import base as _hivemind_compression_base  # noqa: E402
from hivemind.compression.serialization import deserialize_torch_tensor, serialize_torch_tensor  # noqa: E402
from hivemind.proto import runtime_pb2  # noqa: E402
from hivemind.utils.streaming import split_for_streaming  # noqa: E402

from agora.net.errors import (  # noqa: E402
    BAD_METADATA,
    MALFORMED,
    PAYLOAD_TOO_LARGE,
    TRUNCATED,
    UNSUPPORTED_TENSOR,
    RpcError,
    WireError,
)

logger = logging.getLogger(__name__)

if _hivemind_compression_base.USE_LEGACY_BFLOAT16:
    # hivemind was imported before us with the legacy default; NoCompression.compress reads this module global on
    # every call, so flipping it restores native 2-byte bf16 for this process.
    logger.debug("hivemind was imported before agora.net.framing; disabling its legacy bf16->fp32 upcast")
    _hivemind_compression_base.USE_LEGACY_BFLOAT16 = False

__all__ = [
    "DEFAULT_CHUNK_SIZE_BYTES",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "MAX_METADATA_BYTES",
    "WIRE_VERSION",
    "Message",
    "TransferStats",
    "MessageDecoder",
    "encode_message",
    "encode_error",
    "decode_message",
    "payload_nbytes",
]

WIRE_VERSION = 1
DEFAULT_CHUNK_SIZE_BYTES = 2**20  # 1 MiB: well below p2pd's 4 MiB message limit, large enough to amortize framing
DEFAULT_MAX_PAYLOAD_BYTES = 256 * 2**20  # total tensor bytes of one message; both sides enforce it
MAX_METADATA_BYTES = 2**20  # the header must stay a small control message, tensors belong in the payload
_MAX_ERROR_MESSAGE_CHARS = 4096

_Msg = TypeVar("_Msg", runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse)
Message = Union[runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse]
_TensorParts = Tuple[runtime_pb2.Tensor, List[bytes]]  # a tensor's first part and the buffers of all its parts


def _counter(meaning: str) -> Any:
    """A ``TransferStats`` field: starts at 0; ``meaning`` is kept as its metadata["help"]."""
    return field(default=0, metadata={"help": meaning})


@dataclass
class TransferStats:
    """Counters for one side of one or more RPCs; ``call``/``add_handler`` add to them, never reset them.

    Payload bytes are what a pipeline boundary costs (for bf16 exactly 2 bytes per element); wire bytes add the
    metadata and protobuf overhead, but not hivemind's 9-byte frame headers nor libp2p/TLS overhead.
    """

    payload_bytes_sent: int = _counter("tensor buffer bytes sent")
    payload_bytes_received: int = _counter("tensor buffer bytes received")
    wire_bytes_sent: int = _counter("serialized protobuf bytes sent: payload + metadata + protobuf overhead")
    wire_bytes_received: int = _counter("serialized protobuf bytes received")
    messages_sent: int = _counter("protobufs sent: a message's header and each of its chunks count one")
    messages_received: int = _counter("protobufs received")
    calls: int = _counter("whole RPCs made (on a server: requests served)")
    errors: int = _counter("RPCs that ended in an error (on a server: error replies sent)")

    def as_dict(self) -> dict:
        return asdict(self)

    def count_sent(self, message: Message) -> None:
        """Add one protobuf this side wrote to a stream."""
        self.messages_sent += 1
        self.wire_bytes_sent += message.ByteSize()
        self.payload_bytes_sent += _message_payload_bytes(message)

    def count_received(self, message: Message) -> None:
        """Add one protobuf this side read from a stream."""
        self.messages_received += 1
        self.wire_bytes_received += message.ByteSize()
        self.payload_bytes_received += _message_payload_bytes(message)


def _message_payload_bytes(message: Message) -> int:
    return sum(len(part.buffer) for part in message.tensors)


def payload_nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """The tensor payload ``tensors`` will take on the wire (anything that is not a tensor counts as 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


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
    """Turn ``(meta, tensors)`` into the stream of protobufs described in ``docs/TRANSPORT.md``.

    :param meta: a msgpack-able dict
    :param tensors: dense tensors on any device (sent from CPU, without autograd state)
    :param message_type: ``runtime_pb2.ExpertRequest`` for requests, ``runtime_pb2.ExpertResponse`` for replies
    :param uid: stored in the header's ``uid`` field (requests only; informational, e.g. the handler name)
    :param chunk_size_bytes: the largest tensor buffer one protobuf carries
    :raises WireError: ``payload_too_large`` if the tensors exceed ``max_payload_bytes`` (checked before any copy),
      ``bad_metadata`` / ``unsupported_tensor`` for inputs that cannot be serialized
    """
    if not isinstance(meta, Mapping):
        raise WireError(BAD_METADATA, f"metadata must be a dict, got {type(meta).__name__}")
    if chunk_size_bytes <= 0:
        raise ValueError(f"chunk_size_bytes must be positive, got {chunk_size_bytes}")
    tensors = list(tensors)
    declared = payload_nbytes(tensors)
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


def _read_envelope(message: Message, max_payload_bytes: int) -> dict:
    """The checked envelope of a header message; an error envelope reads as announcing nothing to follow."""
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
    if envelope["bytes"] > max_payload_bytes:
        raise WireError(
            PAYLOAD_TOO_LARGE,
            f"announced tensor payload of {envelope['bytes']} bytes exceeds the limit of {max_payload_bytes} bytes",
        )
    if envelope["n"] < envelope["tensors"]:
        raise WireError(MALFORMED, f"{envelope['tensors']} tensors cannot fit in {envelope['n']} messages")
    return envelope


def _deserialize_tensor(index: int, parts: _TensorParts) -> torch.Tensor:
    first_part, buffers = parts
    serialized = runtime_pb2.Tensor()
    serialized.CopyFrom(first_part)
    serialized.buffer = b"".join(buffers)
    serialized.requires_grad = False
    try:
        return deserialize_torch_tensor(serialized)
    except Exception as e:  # wrong buffer size, unknown dtype or compression, ...
        raise WireError(
            MALFORMED,
            f"tensor {index} (dtype={first_part.dtype!r}, shape={list(first_part.size)}) "
            f"does not deserialize: {type(e).__name__}: {e}",
        ) from e


class MessageDecoder:
    """Incrementally reassembles one message from its protobuf stream, validating it as it arrives.

    ``feed`` is cheap (it only collects buffers) and enforces the size limit *before* buffering more data;
    ``finish`` deserializes the tensors (CPU-heavy for big messages; safe to run in a thread).

    :param max_payload_bytes: the receiver's own limit on the message's tensor payload
    """

    def __init__(self, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES):
        self.max_payload_bytes = max_payload_bytes
        self.payload_bytes = 0
        self.wire_bytes = 0
        self._envelope: Optional[dict] = None
        self._expected_messages = 0
        self._received_messages = 0
        self._finished_tensors: List[_TensorParts] = []
        self._open_tensor: Optional[_TensorParts] = None
        self._open_chunks_left = 0

    @property
    def complete(self) -> bool:
        """True once the header and all messages it announced have arrived."""
        return self._envelope is not None and self._received_messages == self._expected_messages

    @property
    def announced(self) -> Optional[dict]:
        """The header's envelope once it has arrived (``meta``, and ``n``/``tensors``/``bytes`` still to come)."""
        return self._envelope

    @property
    def progress(self) -> str:
        """How far the stream got, for error messages."""
        if self._envelope is None:
            return "no header"
        return f"{self._received_messages} of {self._expected_messages} messages after the header"

    def feed(self, message: Message) -> None:
        """Consume the next protobuf of the stream; raises ``WireError`` as soon as the stream is invalid."""
        self.wire_bytes += message.ByteSize()
        if self._envelope is None:
            self._envelope = _read_envelope(message, self.max_payload_bytes)
            self._expected_messages = self._envelope["n"]
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
        self._add_part(part)

    def _add_part(self, part: runtime_pb2.Tensor) -> None:
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
        tensors = [_deserialize_tensor(index, parts) for index, parts in enumerate(self._finished_tensors)]
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
