"""What honest messages look like now, per stream: the reference every message is z-scored against.

Honest statistics drift as the model trains, early on by many per-message spreads per optimizer step, so the
reference is not an EMA (it would lag, flag every honest message and ban honest peers, as happened live). It is a
window of recently accepted messages: per feature a Theil-Sen drift per step, a centre (a median of the latest
messages, moved along the drift to the message's step) and a spread (median absolute successive difference, which
widens with the drift). With enough senders, senders vote rather than messages. The warm-up seeds the first
reference; re-anchoring moves it onto the latest messages when the whole stream shifted. See ``docs/SENTINEL.md``.
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import numpy as np

from agora.sentinel.config import SentinelConfig
from agora.sentinel.features import VECTORS, MessageStats, random_directions, reference_features
from agora.sentinel.state import SenderRecord, StreamState

MAD_TO_SD = 1.4826  # median absolute deviation -> standard deviation, for normal data


@contextmanager
def _nan_quiet() -> Iterator[None]:
    """Silence numpy about all-NaN columns: features without a value in some messages (``pair_align``)."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


@dataclass(frozen=True)
class _Votes:
    """How the messages of a reference vote: one vote per sender with ``peer_min_senders`` senders or more (routing
    can send most of a receiver's traffic to one peer: live, an attacking tail got half of a head's gradients,
    hence most of its reference), else one per message."""

    groups: list  # per sender, the indices of its messages, in arrival order
    by_sender: bool
    pooled: bool  # the warm-up: plain median / MAD (successive differences would straddle interleaved senders)

    @staticmethod
    def of(raws: list[MessageStats], min_senders: int, pooled: bool) -> "_Votes":
        who = [r.sender for r in raws]
        groups = [np.array([i for i, w in enumerate(who) if w == name]) for name in dict.fromkeys(who)]
        return _Votes(groups, len(groups) >= min_senders, pooled)

    def centre_spread(self, x: np.ndarray, n_centre: int) -> tuple[np.ndarray, np.ndarray]:
        """Centre and spread of the rows of ``x`` (messages in arrival order, detrended); the centre is a median
        of the latest ``n_centre`` messages (of each sender, when senders vote)."""
        if not self.by_sender:
            c = np.median(x[-n_centre:], axis=0)
            if self.pooled or x.shape[0] < 3:
                return c, MAD_TO_SD * np.median(np.abs(x - c), axis=0)
            return c, MAD_TO_SD * np.median(np.abs(np.diff(x, axis=0)), axis=0) / math.sqrt(2)
        # Each sender's own median counts once and the centre is the median of those. The spread is the honest
        # noise within a sender (successive differences of its own messages, pooled) plus the spread between
        # senders' medians (median distance to the centre: a lone odd sender does not widen it).
        meds = np.stack([np.median(x[g[-n_centre:]], axis=0) for g in self.groups])
        c = np.median(meds, axis=0)
        diffs = [np.diff(x[g], axis=0) for g in self.groups if len(g) > 1]
        within = (MAD_TO_SD * np.median(np.abs(np.concatenate(diffs)), axis=0) / math.sqrt(2)
                  if diffs else np.zeros(x.shape[1]))
        between = MAD_TO_SD * np.median(np.abs(meds - c), axis=0)
        return c, np.sqrt(within**2 + between**2)


class _TimePairs(NamedTuple):
    """Every pair (i < k) of a window's messages with their time difference, for Theil-Sen slopes."""

    i: np.ndarray
    k: np.ndarray
    dt: np.ndarray
    timed: np.ndarray  # dt != 0: pairs at the same time carry no slope

    @staticmethod
    def of(t: np.ndarray) -> "_TimePairs":
        i, k = np.triu_indices(len(t), 1)
        dt = t[k] - t[i]
        return _TimePairs(i, k, dt, dt != 0)

    def slope(self, col: np.ndarray, ok: np.ndarray) -> float:
        """Median of the pairwise slopes of ``col`` over its finite (``ok``) entries; 0 with fewer than 3 pairs:
        the model's drift per step, robust to a minority of odd messages."""
        sel = self.timed & ok[self.i] & ok[self.k]
        if sel.sum() < 3:
            return 0.0
        return float(np.median((col[self.k[sel]] - col[self.i[sel]]) / self.dt[sel]))


class Reference:
    """Builds and applies each stream's reference statistics (``StreamState.mu``, ``sd``, ``slope``, ...)."""

    def __init__(self, config: SentinelConfig):
        self.cfg = config
        self._projections: dict[int, np.ndarray] = {}  # channel count -> the run's random directions

    def features(self, stream: StreamState, raw: MessageStats) -> np.ndarray:
        """``raw``'s full feature vector against the stream's per-channel references."""
        k = raw.mean.shape[0]
        if k not in self._projections:
            self._projections[k] = random_directions(self.cfg.seed, self.cfg.n_projections, k)
        return reference_features(raw, self._projections[k], stream.vec_mu, stream.vec_var, self.cfg.sigma_floor)

    def z(self, stream: StreamState, raw: MessageStats) -> np.ndarray:
        """Robust per-feature z of ``raw``; 0 for the features it lacks or the reference does not score."""
        phi = self.features(stream, raw)
        known = np.isfinite(phi) & stream.active
        # The window's centre, moved along the fitted drift to this message's time (not beyond the window's own
        # time span: a receiver idle for long should not extrapolate a trend into the void).
        centre = stream.mu + stream.slope * float(np.clip(raw.t - stream.t_ref, -stream.t_span, stream.t_span))
        return np.where(known, (np.nan_to_num(phi) - centre) / stream.sd, 0.0)

    def set(self, stream: StreamState, raws: list[MessageStats], pooled: bool = False) -> None:
        """The reference centre, drift and per-feature spread, from ``raws`` in arrival order.

        The centre is the median of the last ``centre`` messages (a lag of a few messages, robust to a minority of
        sub-threshold attacker messages) and the spread the median absolute *successive difference* of the window
        / sqrt(2): for iid messages that is the honest spread, and under drift it grows by the drift per message,
        so the threshold widens exactly as much as the drift between a message and its reference. ``pooled`` (the
        warm-up, which may interleave an attacker's messages with honest ones): plain median / MAD of all of them.
        """
        votes = _Votes.of(raws, self.cfg.peer_min_senders, pooled)
        n_centre = len(raws) if pooled else self.cfg.centre
        # The per-channel references (mean direction, skew direction, rms profile) use the whole window: a
        # direction estimated from a few messages is too noisy for the odd statistics that expose sign flips,
        # and the features built on it are detrended below anyway.
        for name in VECTORS:
            stream.vec_mu[name], sp = votes.centre_spread(np.stack([getattr(r, name) for r in raws]), len(raws))
            stream.vec_var[name] = sp**2
        feats = np.stack([self.features(stream, r) for r in raws])
        t = np.array([r.t for r in raws])
        t_ref = float(np.median(t[-n_centre:]))
        mu, sd = np.zeros(feats.shape[1]), np.full(feats.shape[1], self.cfg.sigma_floor)
        slope = np.zeros(feats.shape[1])
        active = np.zeros(feats.shape[1], dtype=bool)
        pairs = _TimePairs.of(t)
        for j in range(feats.shape[1]):
            ok = np.isfinite(feats[:, j])
            # A feature absent from most of the reference messages (pair_align without pairs) is not scored: it
            # would have no honest reference to be compared with.
            if ok.sum() < max(3, len(raws) // 2):
                continue
            active[j] = True
            col = feats[:, j]
            if not pooled:
                slope[j] = pairs.slope(col, ok)
            detr = np.where(ok, col - slope[j] * (t - t_ref), np.nan)
            mu[j], sd[j] = self._centre_spread(detr, ok, votes, n_centre)
        stream.slope, stream.t_ref, stream.t_span = slope, t_ref, float(t.max() - t.min())
        stream.mu, stream.sd, stream.active = mu, sd, active

    def _centre_spread(self, detr: np.ndarray, ok: np.ndarray, votes: _Votes, n_centre: int) -> tuple[float, float]:
        """One feature's centre and floored spread from its detrended values (NaN where ``ok`` is False)."""
        if ok.all():
            c, sp = votes.centre_spread(detr[:, None], n_centre)
        else:
            with _nan_quiet():
                c = np.array([np.nanmedian(detr[-n_centre:])])
                sp = np.array([MAD_TO_SD * np.nanmedian(np.abs(detr - c[0]))])
        return float(c[0]), max(float(np.nan_to_num(sp[0])), self.cfg.sigma_floor)

    def finish_warmup(self, stream: StreamState) -> None:
        """Turn the pooled warm-up messages into the first reference and seed its window.

        Warm-up messages that stand out from their neighbours do not seed the window (an attacker present from the
        start does not become the reference), but they earn no strikes: early in training the model changes so fast
        between steps (measured: the mean direction of the forward coordinates turns by tens of honest spreads per
        step in the first ~20 steps of ``tiny``) that a pooled look back cannot tell an attacker from an early
        message. Judgement starts with the next message, against the window, with peers.
        """
        warm, stream.warm = stream.warm, []
        raws = [r for _, r in warm]
        self.set(stream, raws, pooled=True)
        feats, resid = self._warmup_residuals(stream, raws)
        stream.ready = True
        keep = self._warmup_seeds(stream, raws, feats, resid)
        for who, _ in warm:
            stream.senders.setdefault(who, SenderRecord())
            stream.accepted_at[who] = stream.n
        stream.last_accept = stream.n
        stream.window.extend(keep if len(keep) >= 3 else raws)
        stream.recent.extend(raws[-self.cfg.centre:])
        self.set(stream, list(stream.window))

    def _warmup_residuals(self, stream: StreamState, raws: list[MessageStats]) -> tuple[np.ndarray, np.ndarray]:
        """The warm-up's features and their residuals from the rolling median of the messages around each, and the
        stream's spread set to the MAD of those residuals.

        The warm-up spans many optimizer steps of a model that may be training fast, so one pooled centre would
        make its first messages look like outliers; the messages around one (same time, mostly other senders) are
        robust to an attacker's minority share, and the residuals have the drift removed.
        """
        feats = np.stack([self.features(stream, r) for r in raws])
        half = self.cfg.centre // 2
        with _nan_quiet():
            local = np.stack([np.nanmedian(feats[max(0, t - half): t + half + 1], axis=0)
                              for t in range(len(raws))])
        resid = feats - local
        for j in np.flatnonzero(stream.active):
            col = resid[np.isfinite(resid[:, j]), j]
            stream.sd[j] = max(MAD_TO_SD * float(np.median(np.abs(col - np.median(col)))), self.cfg.sigma_floor)
        return feats, resid

    def _warmup_seeds(self, stream: StreamState, raws: list[MessageStats], feats: np.ndarray,
                      resid: np.ndarray) -> list[MessageStats]:
        """The warm-up messages that may seed the window: those within ``kappa`` of their neighbours; with enough
        senders, every message of the senders whose median message is on the senders' common centre."""
        cfg = self.cfg
        z = np.where(np.isfinite(resid) & stream.active, np.nan_to_num(resid) / stream.sd, 0.0)
        keep = [raw for raw, zi in zip(raws, z) if np.max(np.abs(zi)) <= cfg.kappa]
        names = list(dict.fromkeys(r.sender for r in raws))
        if len(names) < cfg.peer_min_senders:
            return keep
        # With enough senders the rolling median is message-weighted (a sender that got most of the traffic sets
        # it); instead, a sender whose median message is off the senders' common centre (one vote per sender)
        # seeds nothing, and the others' messages all do.
        self.set(stream, raws, pooled=True)
        with _nan_quiet():
            off = {n for n in names
                   if np.any(np.abs(np.nan_to_num(np.nanmedian(feats[[r.sender == n for r in raws]], axis=0)
                                                  - stream.mu))[stream.active]
                             > cfg.kappa * stream.sd[stream.active])}
        return [r for r in raws if r.sender not in off]

    def reanchor(self, stream: StreamState) -> None:
        """Move the reference to the latest messages, whatever their verdict, added to the window (the centre is a
        median and the drift a median of slopes, so a minority of odd messages barely moves them)."""
        stream.window.extend(r for r in stream.recent if all(r is not w for w in stream.window))
        self.set(stream, list(stream.window))

    def accept(self, stream: StreamState, raw: MessageStats, zc: np.ndarray) -> None:
        """``raw`` (clipped z ``zc``) enters the window; the honest z variance and the reference follow."""
        stream.window.append(raw)
        stream.accepted_at[raw.sender] = stream.last_accept = stream.n
        stream.z2 = 0.98 * (np.ones_like(zc) if stream.z2 is None else stream.z2) + 0.02 * zc**2
        self.set(stream, list(stream.window))
