"""Strikes and bans: how evidence against a sender accumulates, waits for its peers, and becomes a ban.

Every piece of evidence is a ``Strike`` with a weight (a failed audit 1.5, a CUSUM alarm 2, a flag nobody could
compare a third). ``strikes_to_ban`` of them within a sender's last ``strike_window`` messages ban it, with two
guards for statistical strikes: the reference must have been alive (another sender's message accepted since the
first of them), and a receiver bans on statistics at most a minority of its active senders (honest replicas are
the majority; a receiver about to ban most of them follows a broken reference). A per-message flag becomes a
strike only once the other senders' next messages show they did not share its shift (``settle``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from agora.sentinel.config import SentinelConfig, Verdict, comparable_versions
from agora.sentinel.features import MessageStats
from agora.sentinel.state import PendingFlag, SenderRecord, StreamState, strike_weight


@dataclass(frozen=True)
class Strike:
    """One piece of evidence against a sender, as ``StrikeBook.strike`` records it."""

    reasons: list[str]
    score: float = 0.0  # the message's score, returned in the verdict
    weight: float = 1.0  # the share of a strike this evidence is worth
    statistical: bool = False  # estimated from statistics (not content: a replay, an audit, a non-finite value)
    counted: bool = False  # the message's flag was already counted in the sender's ``flags``
    hard: bool = False  # bans at once (a non-finite message)
    tok: Optional[bytes] = None  # token digest of the message struck (a reproduction withdraws its strikes)


# What ``settle`` does with one pending flag.
_KEEP, _DROP, _SHARED = "keep", "drop", "shared"


class StrikeBook:
    """The receiver's bans, and the strike bookkeeping of every stream's senders."""

    def __init__(self, config: SentinelConfig):
        self.cfg = config
        self.banned: set[str] = set()
        self.stat_banned: set[str] = set()  # banned on statistical strikes (the minority cap counts these)

    def strike(self, stream: StreamState, sender: str, evidence: Strike) -> Verdict:
        """Record a strike; ban on ``strikes_to_ban`` within ``strike_window`` of the sender's messages."""
        cfg = self.cfg
        st = stream.senders.setdefault(sender, SenderRecord())
        if not evidence.counted:
            st.flags += 1
        st.strikes.append((st.n, stream.n, evidence.statistical, float(evidence.weight), evidence.tok))
        st.struck.append("; ".join(evidence.reasons[:3]))
        while st.strikes and st.strikes[0][0] <= st.n - cfg.strike_window:
            st.strikes.popleft()
        if evidence.hard or self._may_ban(stream, sender, st, evidence.statistical):
            st.banned = True
            self.banned.add(sender)
            if evidence.statistical and not evidence.hard:
                self.stat_banned.add(sender)
        return Verdict(True, st.banned or sender in self.banned, evidence.score, evidence.reasons)

    def _may_ban(self, stream: StreamState, sender: str, st: SenderRecord, statistical: bool) -> bool:
        """Whether the sender's strikes now ban it. A statistical strike bans only if some *other* sender's message
        was accepted since the oldest counted strike: then the reference was alive and tracking honest traffic
        while this sender kept failing it. Without that, the strikes may all come from a reference the model has
        outrun (every sender failing it); they wait, and a re-anchoring forgets them."""
        cfg = self.cfg
        alive = not statistical or max(
            (at for who, at in stream.accepted_at.items() if who != sender), default=-1) >= st.strikes[0][1]
        # A small tolerance: three thirds of a strike are a strike.
        return (strike_weight(st) >= cfg.strikes_to_ban - 1e-9 and alive
                and (not statistical or (stream.direction in cfg.statistical_ban_directions
                                         and self._minority_after_ban(stream, sender))))

    def _minority_after_ban(self, stream: StreamState, sender: str) -> bool:
        """Whether banning ``sender`` keeps the senders this receiver banned on statistics alone a minority of the
        stream's active senders. Honest replicas are the majority (the premise of any comparison with peers); a
        monitor about to ban most of its senders is following a broken reference (live, early in training, one
        receiver banned every peer of the next stage), and the evidence waits for a stronger kind: a
        recomputation by another replica, a replay, a non-finite value."""
        cfg = self.cfg
        active = [p for p, s in stream.senders.items() if stream.n - s.last_seen <= cfg.peer_active_window]
        banned = sum(p in self.stat_banned for p in active if p != sender)
        return banned + 1 <= (len(active) - 1) // 2

    def settle(self, stream: StreamState, raw: MessageStats, z: np.ndarray) -> bool:
        """Decide the pending flags of other senders with this message's z (``raw``: the message, from
        ``raw.sender``). Returns whether a flag turned out to be a shift of the whole stream (the caller
        re-anchors the reference).

        A flag this message shares (beyond kappa/2 with the same sign on the flag's strongest feature and on most
        of the others) was a shift of the whole stream: dismissed, whatever the two messages' versions. A flag that
        ``need`` other senders' messages did not share, or that waited ``common_recent`` messages, becomes a
        strike: its sender stood out from its peers at the same time. Not sharing counts only for messages of a
        comparable version; a flag that none could settle before it expired weighs ``unconfirmed_weight`` of a
        strike (a full one for a sender alone on its weights beyond ``alone_max``). Flags on the same microbatch are
        left to the monitor's cross-check and reproduction of that microbatch.
        """
        shared, keep = False, []
        for p in stream.pending:
            outcome = self._settle_one(stream, p, raw, z)
            shared = shared or outcome == _SHARED
            if outcome == _KEEP:
                keep.append(p)
        stream.pending = keep
        if shared:
            stream.pending = [p for p in stream.pending if p.sender != raw.sender]
        return shared

    def _settle_one(self, stream: StreamState, p: PendingFlag, raw: MessageStats, z: np.ndarray) -> str:
        cfg = self.cfg
        if p.sender == raw.sender:
            return _KEEP
        if p.sender in self.banned:
            return _DROP
        if raw.tok is not None and p.tok == raw.tok:
            return _KEEP  # the same microbatch: the monitor compares the contents
        same = (np.abs(z[p.feats]) > cfg.kappa / 2) & (np.sign(z[p.feats]) == p.sign)
        if same[int(np.argmax(p.size))] and same.sum() >= math.ceil(len(p.feats) / 2):
            # A shift this message shares on its strongest feature and on most of the others is common to the
            # stream, whatever the weights of the two: the model moved. (Live, honest flags come in sets of
            # features that move together with training, e.g. the distance of the mean vector and of the
            # channel profile, with one or two others beyond the threshold by chance.)
            return _SHARED
        if not comparable_versions(p.version, raw.version):
            # Other weights than the flagged message's: not sharing its shift is no evidence against it.
            if stream.n - p.at <= cfg.common_recent:
                return _KEEP
            st = stream.senders.get(p.sender)
            if st is not None:
                weight = 1.0 if p.others or st.alone_run > cfg.alone_max else cfg.unconfirmed_weight
                self.strike(stream, p.sender, Strike([*p.reasons, *([] if p.others else ["unconfirmed"])],
                                                     weight=weight, statistical=True, counted=True, tok=p.tok))
            return _DROP
        p.others.add(raw.sender)
        if len(p.others) < p.need and stream.n - p.at <= cfg.common_recent:
            return _KEEP
        if p.sender in stream.senders:
            self.strike(stream, p.sender, Strike(p.reasons, statistical=True, counted=True, tok=p.tok))
        return _DROP

    def forget_stalled(self, stream: StreamState) -> None:
        """Nobody's message was accepted for ``reanchor_after`` messages: the statistical strikes earned since the
        last accepted one were earned against a stale reference, and are forgotten with the pending flags."""
        for st in stream.senders.values():
            _drop_statistical(st, lambda at, tok: at > stream.last_accept)
        stream.pending.clear()

    def withdraw(self, stream: StreamState, tok: bytes, senders: set) -> None:
        """Another replica reproduced a flagged message of microbatch ``tok``: the flag was the reference's fault.
        Its pending flags and the statistical strikes of ``senders`` (who sent that content) for it go; replay
        strikes stay (judged on content, not on statistics)."""
        stream.pending = [p for p in stream.pending if p.tok != tok]
        for who in senders:
            st = stream.senders.get(who)
            if st is not None:
                _drop_statistical(st, lambda at, struck_tok: struck_tok == tok)

    def unban(self, sender: str) -> None:
        self.banned.discard(sender)
        self.stat_banned.discard(sender)


def _drop_statistical(st: SenderRecord, which: Callable[[int, Optional[bytes]], bool]) -> None:
    """Remove the sender's statistical strikes for which ``which(stream index, token digest)`` holds."""
    st.strikes = deque(x for x in st.strikes if not (x[2] and which(x[1], x[4])))
