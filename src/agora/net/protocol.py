"""What peers say to each other: RPC names and how a caller treats each error code.

Shared by both ends (``agora.client`` calls, ``agora.server`` answers), so neither imports the other. The message
formats themselves are in ``docs/ARCHITECTURE.md`` ("Messages between nodes"); the framing is ``agora.net.framing``
(``docs/TRANSPORT.md``).
"""

from __future__ import annotations

from agora.net import transport

FWD_BWD = "fwd_bwd"  # one microbatch's forward through the rest of the pipeline and its backward on the way back
GET_STATE = "get_state"  # parameters and optimizer moments of a stage (a joining or repairing replica)
INFO = "info"  # a peer's record and recent events (dashboard, status)
TIED_GRAD = "tied_grad"  # a step's gradient of a tied embedding, between the head's and the tail's replicas
INFER = "infer"  # one chunk of a generation session through this stage, with the session's KV cache kept here
FRAME = "frame"  # a UPM rotation of one boundary's frame, to the replicas of the two stages beside it (server/upm.py)
CLAIM = "claim"  # a hedge target asks the replica first called whether it may apply the microbatch (exactly_once.py)

OVER_SHARE = "over_share"

# Failures of a peer that justify retrying the microbatch on another replica. Validation errors (our request was
# bad) are not retried: another replica would refuse it the same way.
RETRYABLE = frozenset({
    transport.TIMEOUT,
    transport.UNREACHABLE,
    transport.NO_HANDLER,
    transport.CONNECTION_LOST,
    transport.INTERNAL,
    "leaving",
    "not_serving",
    "no_peers",
    "banned",  # the peer was banned by SENTINEL somewhere: route around it
    "sentinel",  # a message on this path was flagged as corrupted
    "rate_limited",
    "frame_unknown",  # the peer cannot convert our UPM frame yet (a rotation on its way): another replica, or later
    "batch_full",  # the stage holds its whole target batch and has not stepped yet: later, or another path
    OVER_SHARE,  # this replica holds its share of the batch: another replica of the stage (a redirect, not a failure)
    transport.BUSY,  # the peer is at one of its limits on incoming requests (streams, buffered bytes)
    transport.TOO_SLOW,  # our request reached the peer slower than it accepts: another path may be faster
})
# Of those, the ones that say the peer itself is broken or unreachable: it is banned for a while. A peer that is
# leaving or not yet serving is healthy; routing just skips it for this microbatch.
BANNABLE = frozenset({
    transport.TIMEOUT, transport.UNREACHABLE, transport.NO_HANDLER, transport.CONNECTION_LOST, transport.INTERNAL,
})
# Codes with which a head reports a failure downstream of it, or that a moment fixes (``unauthorized``: the caller's
# certified record has not reached the callee's DHT view yet): a trainer retries them (bounded) but bans nobody.
DOWNSTREAM = frozenset({"retries_exhausted", "no_peers", "unauthorized"})

# Generation sessions (``INFER``). A session lives on one peer per stage, so these codes tell the client what to do
# with that pin: the request itself was bad (another replica would refuse it the same way: raise), or the pinned peer
# cannot go on with this session (pick another replica of the stage and replay the session's prefix there).
SESSION_LOST = frozenset({
    *BANNABLE,
    "leaving",
    "not_serving",
    "banned",
    "busy",  # over its inference memory cap: another replica may have room
    "unknown_session",  # the peer forgot the session (idle expiry, restart, stage move)
    "position_mismatch",  # the peer's cache and the client disagree (e.g. a chunk applied before a timeout)
})


def held_seconds(reply_meta: dict) -> float:
    """The seconds a ``fwd_bwd`` reply says its request waited, along the rest of the pipeline, for stages' batches
    to open (``held_s``; 0 when absent or not a sane number). Callers take it out of the call's latency: hedging
    waits for a multiple of a peer's typical latency, and calls held for a round had stretched that bound to 30 s,
    so a frozen peer stalled its callers for a whole timeout."""
    value = reply_meta.get("held_s") if isinstance(reply_meta, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1e6:
        return 0.0
    return float(value)
