"""Peer-relative evidence: a sender judged against the other senders of its stream at the same time.

Everything here works on z (a message measured against the drifting reference), so a shift every sender shares
(the model training) cancels, while a sender that deviates from its peers keeps its offset. Three tests: the
common mode (a per-message flag the senders' latest messages share is no flag), a per-sender EMA of z against
the median of the active senders' EMAs, and a two-sided CUSUM on z minus that median (small persistent shifts).
Replicas claiming other weights at the same step are never compared (``comparable_versions``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from agora.sentinel.config import SentinelConfig, comparable_versions
from agora.sentinel.state import SenderRecord, StreamState


@dataclass
class PeerEvidence:
    """What the peer tests found for one message."""

    alone: bool  # its sender is alone on its claimed weights (kept out of the peer tests and the reference)
    reasons: list[str]  # EMA-test deviations and confirmed CUSUM alarms
    alarm: bool  # a confirmed CUSUM alarm is among them (worth ``cusum_strikes``)


class PeerTests:
    """The peer-relative tests of one receiver. ``banned``: its banned senders (never anyone's peer); ``names``:
    the feature names, for the reasons given."""

    def __init__(self, config: SentinelConfig, banned: set[str], names: tuple[str, ...]):
        self.cfg = config
        self.banned = banned
        self.names = names

    def _recent_peers(self, stream: StreamState, st: SenderRecord) -> Iterator[SenderRecord]:
        """The other standing senders whose latest scored message is at most ``common_recent`` messages old."""
        return (s for _, s in stream.standing(self.banned)
                if s is not st and stream.n - s.last_at <= self.cfg.common_recent)

    def common_mode(self, stream: StreamState, st: SenderRecord, z: np.ndarray,
                    version: Optional[tuple]) -> Optional[np.ndarray]:
        """The median of ``z`` and the recent peers' latest z (same weights only): what the senders sent at about
        the same time. None with fewer than ``peer_min_senders`` such senders."""
        recent = [s.last_z for s in self._recent_peers(stream, st)
                  if s.last_z is not None and comparable_versions(s.last_version, version)]
        return np.median(np.stack([z, *recent]), axis=0) if len(recent) + 1 >= self.cfg.peer_min_senders else None

    def alone_on_weights(self, stream: StreamState, st: SenderRecord, version: Optional[tuple]) -> bool:
        """Whether the sender claims weights that an active peer contradicts (same step, other fingerprint) and
        that no active peer shares."""
        lasts = [s.last_version for s in self._recent_peers(stream, st) if s.last_version is not None]
        return any(not comparable_versions(v, version) for v in lasts) and version not in lasts

    def evidence(self, stream: StreamState, st: SenderRecord, version: Optional[tuple], zc: np.ndarray,
                 z_scale: np.ndarray) -> PeerEvidence:
        """Update the sender's EMA and CUSUM with its message's clipped z ``zc`` (claimed ``version``) and test
        them against its peers; ``z_scale``: the features' measured honest z sd (the tests compare sums of z)."""
        cfg = self.cfg
        alone = self.alone_on_weights(stream, st, version)
        st.alone_run = st.alone_run + 1 if alone else 0
        alone = alone and st.alone_run <= cfg.alone_max
        dev, reasons = None, []
        if not alone:
            # (A sender alone on its weights is not fed to the peer tests: its offset is its weights', not its own
            # doing. Its per-message flags still count, for a third of a strike each.)
            st.ema = (1 - cfg.peer_beta) * zc + (cfg.peer_beta * st.ema if st.ema is not None else 0.0)
            st.ema_n += 1
            peer = self.peer_centre(stream, st)
            if peer is not None:
                dev = self._ema_deviation(st, peer, z_scale)
                reasons = [f"peer:{self.names[i]} d={dev[i]:+.1f}"
                           for i in np.flatnonzero(np.abs(dev) > cfg.peer_kappa)]
                self._cusum_step(st, zc, peer, z_scale)
        alarm = self._cusum_alarms(st, dev)
        return PeerEvidence(alone, [*reasons, *alarm], bool(alarm))

    def peer_centre(self, stream: StreamState, st: SenderRecord) -> Optional[np.ndarray]:
        """Median of the active senders' (bias-corrected) z EMAs; None when there are too few senders or
        messages to compare (with 2 senders one cannot say which is wrong)."""
        cfg = self.cfg
        if st.ema_n < cfg.peer_min_messages:
            return None
        peers = [self.unbiased_ema(s) for _, s in stream.standing(self.banned)
                 if s.ema is not None and s.ema_n >= cfg.peer_min_messages
                 and stream.n - s.last_seen <= cfg.peer_active_window]
        if len(peers) < cfg.peer_min_senders:
            return None
        return np.median(np.stack(peers), axis=0)

    def unbiased_ema(self, st: SenderRecord) -> np.ndarray:
        return st.ema / (1 - self.cfg.peer_beta ** min(st.ema_n, 10_000))

    def _ema_deviation(self, st: SenderRecord, peer: np.ndarray, z_scale: np.ndarray) -> np.ndarray:
        """The sender's EMA minus the peer centre, in sds of the difference of two honest senders' EMAs."""
        b, n = self.cfg.peer_beta, min(st.ema_n, 10_000)
        # sd of a bias-corrected EMA of n unit-variance z; x sqrt(2): the centre is some other sender's EMA.
        ema_sd = math.sqrt(2 * (1 - b) * (1 - b ** (2 * n)) / ((1 + b) * (1 - b**n) ** 2))
        return (self.unbiased_ema(st) - peer) / (ema_sd * z_scale)

    def _cusum_step(self, st: SenderRecord, zc: np.ndarray, peer: np.ndarray, z_scale: np.ndarray) -> None:
        """CUSUM on this message's z *relative to its peers*: small persistent offsets add up, a drift all senders
        share does not, one outlier cannot trip it on its own. Without enough peers there is no CUSUM (with two
        senders one cannot tell which of them is off), only the per-message test."""
        cfg = self.cfg
        u = np.clip((zc - peer) / z_scale, -cfg.kappa, cfg.kappa)
        if st.cusum_pos is None:
            st.cusum_pos, st.cusum_neg = np.zeros_like(zc), np.zeros_like(zc)
        st.cusum_pos = np.maximum(0.0, st.cusum_pos + u - cfg.cusum_k)
        st.cusum_neg = np.maximum(0.0, st.cusum_neg - u - cfg.cusum_k)

    def _cusum_alarms(self, st: SenderRecord, dev: Optional[np.ndarray]) -> list[str]:
        """CUSUM alarms, each reset; confirmed (returned) when the sender's EMA is ``cusum_peer_min`` sds off the
        peer median on the same side. A confirmed alarm resets the whole CUSUM."""
        cfg = self.cfg
        alarm = []
        if st.cusum_pos is None:
            return alarm
        for sign, acc in ((1, st.cusum_pos), (-1, st.cusum_neg)):
            for i in np.flatnonzero(acc > cfg.cusum_h):
                if dev is not None and sign * dev[i] >= cfg.cusum_peer_min:
                    alarm.append(f"cusum:{self.names[i]}{'+' if sign > 0 else '-'}")
                acc[i] = 0.0
        if alarm:
            st.cusum_pos[:] = 0.0
            st.cusum_neg[:] = 0.0
        return alarm

    def trusted(self, st: SenderRecord) -> bool:
        """In good standing: its CUSUM is below ``trust_cusum`` (its messages may enter the reference)."""
        return st.cusum_pos is None or max(st.cusum_pos.max(), st.cusum_neg.max()) <= self.cfg.trust_cusum
