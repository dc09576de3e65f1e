"""Errors of tensor RPCs and their machine-readable codes.

Callers branch on the codes (``agora.net.protocol`` sorts them into retryable and bannable), so the code strings
are part of the API and of the wire format: an error reply carries its code to the caller. Kept apart from the
framing and the transport because both raise them and neither needs torch or hivemind for it. The table of codes
is in ``docs/TRANSPORT.md``; ``agora.net.transport`` re-exports everything here.
"""

from __future__ import annotations

__all__ = [
    "RpcError",
    "RpcTimeout",
    "WireError",
    "INTERNAL",
    "TIMEOUT",
    "UNREACHABLE",
    "NO_HANDLER",
    "CONNECTION_LOST",
    "PAYLOAD_TOO_LARGE",
    "TRUNCATED",
    "MALFORMED",
    "BAD_METADATA",
    "UNSUPPORTED_TENSOR",
    "BUSY",
    "TOO_SLOW",
    "NO_ANSWER",
]

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
BUSY = "busy"  # the server is at one of its limits now (streams, buffered bytes, ...); the message says when to retry
TOO_SLOW = "too_slow"  # the caller sent its request slower than the server's minimum rate (net/admission.py)
# Failures that mean the peer never answered (frozen, gone, or not serving us): a probe or claim that ends so got no
# reply, unlike a refusal such as BUSY, which the peer sent.
NO_ANSWER = frozenset({TIMEOUT, UNREACHABLE, CONNECTION_LOST, NO_HANDLER})


class RpcError(Exception):
    """A failed RPC with a machine-readable ``code`` (e.g. "shape_mismatch", "timeout", "unreachable").

    Raised by handlers to send a specific error back, and by ``call`` for both remote errors (``remote=True``:
    the peer answered with an error reply) and local ones (timeout, unreachable, broken stream).

    :param code: a non-empty string; one of this module's constants or a handler's own
    :param message: human-readable detail, sent along in error replies (cut to 4096 characters there)
    :param remote: True when the error came back from the peer in an error reply
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

    def __reduce__(self):  # its __init__ takes no code, so rebuild it through RpcError's
        return _rebuild_error, (type(self), self.code, self.message, self.remote)


class WireError(RpcError, ValueError):
    """A message that cannot be encoded or decoded: oversized, truncated or malformed.

    It is a ``ValueError`` (bad data) and an ``RpcError`` (so ``except RpcError`` around ``call`` catches it too).
    """
