"""What a monitor remembers: one ``StreamState`` per (boundary, direction), one ``SenderRecord`` per sender in it.

Plain records, no logic beyond reading them: the reference statistics (``reference``), the strike book
(``strikes``), the peer tests (``peers``) and the monitor itself all read and update these, so they live apart
from any one of them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np


@dataclass
class SenderRecord:
    """One sender's evidence in one stream."""

    n: int = 0  # its messages in this stream
    last_seen: int = 0  # stream index of its latest message
    banned: bool = False
    # (sender message index, stream index, statistical?, weight, token digest of the message struck)
    strikes: deque = field(default_factory=deque)
    flags: int = 0
    cusum_pos: Optional[np.ndarray] = None
    cusum_neg: Optional[np.ndarray] = None
    ema: Optional[np.ndarray] = None  # EMA of the sender's clipped z (peer-relative test)
    last_z: Optional[np.ndarray] = None  # z of its latest scored message (common-mode check)
    last_at: int = 0  # stream index of that message
    last_version: Optional[tuple] = None  # version of that message
    alone_run: int = 0  # its latest messages in a row on weights no active peer shares
    ema_n: int = 0
    struck: deque = field(default_factory=lambda: deque(maxlen=8))  # reasons of its latest strikes (the evidence)


@dataclass
class PendingFlag:
    """A per-message flag whose strike waits for the other senders' next messages (``StrikeBook.settle``)."""

    sender: str
    at: int  # stream index of the flagged message
    feats: np.ndarray  # indices of the flagged features
    sign: np.ndarray  # their signs
    size: np.ndarray  # their |z|
    reasons: list
    need: int  # other senders that must send un-shifted messages to confirm it
    version: Optional[tuple] = None  # the flagged message's claimed version: only same-version messages settle it
    tok: Optional[bytes] = None  # its microbatch (a reproduction of the message by another replica dismisses it)
    others: set = field(default_factory=set)


@dataclass
class JudgedContent:
    """The verdict a message's content got, and who sent that exact content for that microbatch."""

    flagged: bool
    reasons: list
    senders: set
    base: np.ndarray  # its scalar fingerprint: a retry matches it as well as the SimHash
    version: Optional[tuple] = None  # the version its first sender claimed


@dataclass
class StreamState:
    """The reference and the senders' evidence for one (boundary, direction)."""

    direction: str = "fwd"
    warm: list = field(default_factory=list)  # [(sender, MessageStats)] until ready
    ready: bool = False
    n: int = 0
    mu: Optional[np.ndarray] = None  # per-feature reference centre at time t_ref
    slope: Optional[np.ndarray] = None  # per-feature drift per unit of time (step), robustly fitted on the window
    t_ref: float = 0.0
    t_span: float = 0.0  # time the window covers: the centre is extrapolated at most this far
    sd: Optional[np.ndarray] = None  # per-feature robust spread (1.4826 x MAD, floored)
    active: Optional[np.ndarray] = None  # features present in the reference; the others are never scored
    vec_mu: dict = field(default_factory=dict)  # VECTORS name -> per-channel reference median
    vec_var: dict = field(default_factory=dict)  # VECTORS name -> per-channel reference spread, squared
    window: deque = field(default_factory=deque)  # recently accepted MessageStats (maxlen set by the monitor)
    recent: deque = field(default_factory=deque)  # every recent scored MessageStats, accepted or not (re-anchoring)
    accepted_at: dict = field(default_factory=dict)  # sender -> stream index of its latest accepted message
    last_accept: int = 0  # stream index of the latest accepted message (any sender)
    pending: list = field(default_factory=list)  # PendingFlag strikes awaiting the peers' next messages
    z2: Optional[np.ndarray] = None  # running mean of clipped z^2 over all senders: the z's real variance
    senders: dict = field(default_factory=dict)  # sender -> SenderRecord
    digests: deque = field(default_factory=deque)  # (simhash, sender, token_digest, base features)
    judged: dict = field(default_factory=dict)  # (token_digest, simhash) -> JudgedContent: retries, reproductions
    by_tok: dict = field(default_factory=dict)  # token_digest -> [(sender, simhash, base, version, flagged)]

    def standing(self, banned: set) -> Iterator[tuple[str, SenderRecord]]:
        """The senders not banned (neither in this stream nor in ``banned``, the receiver's bans), in arrival
        order."""
        return ((p, s) for p, s in self.senders.items() if not s.banned and p not in banned)


def strike_weight(st: SenderRecord) -> float:
    """The sender's current strike weight in one stream."""
    return sum(x[3] for x in list(st.strikes))


def new_stream(direction: str, window: int, centre: int) -> StreamState:
    """An empty stream keeping ``window`` accepted messages and the ``centre`` latest scored ones."""
    return StreamState(direction, window=deque(maxlen=window), recent=deque(maxlen=centre))
