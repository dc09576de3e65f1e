"""``SentinelMonitor``: a receiver's judge of the tensors that cross stage boundaries (METHODS s5).

In a permissionless swarm any peer can serve a stage, and a stage cannot recompute its neighbours' work. What it
can do is notice that a neighbour's messages do not look like everybody else's: honest replicas of a stage run
the same weights on data from the same distribution. ``observe`` judges one received message: hard checks
(non-finite), retries and replays of a microbatch, then statistics against the stream's drifting reference and
against the other senders; ``recomputed`` takes an audit (other replicas recomputed a message). Evidence becomes
strikes and bans in the ``StrikeBook``. The pieces live in their own modules: ``features`` (what is measured),
``reference`` (what honest looks like now), ``peers`` (comparisons between senders), ``strikes`` (strikes and
bans), ``replay`` (copies). ``docs/SENTINEL.md`` explains the design and gives the measured numbers.

Its cost grows linearly with the message size, so a node calls it off its event loop; an internal lock makes calls
from several threads safe.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from agora.sentinel.config import Direction, SentinelConfig, Verdict, version_key
from agora.sentinel.features import (MessageStats, feature_names, fingerprint, relative_difference,
                                     same_fingerprint, token_digest)
from agora.sentinel.peers import PeerTests
from agora.sentinel.reference import Reference
from agora.sentinel.replay import ReplayCheck
from agora.sentinel.state import JudgedContent, PendingFlag, SenderRecord, StreamState, new_stream, strike_weight
from agora.sentinel.strikes import Strike, StrikeBook


@dataclass
class _Scores:
    """One message's z against the reference, and the features it flags."""

    z: np.ndarray
    score: float  # max |z|
    flagged: list  # indices of the features beyond their threshold and off the senders' common mode
    reasons: list[str]  # one per flagged feature


class SentinelMonitor:
    """Per-(boundary, direction) reference statistics and per-sender evidence, for one receiver.

    ``config``: thresholds and memory (default ``SentinelConfig()``); a node may replace ``cfg`` later (its
    stage, hence what it can audit, changed): every part follows.
    """

    def __init__(self, config: Optional[SentinelConfig] = None):
        config = config or SentinelConfig()
        self._streams: dict[tuple[int, str], StreamState] = {}
        self._reference = Reference(config)
        self._replays = ReplayCheck(config)
        self._book = StrikeBook(config)
        self.feature_names: tuple[str, ...] = feature_names(config.n_projections)
        self._peers = PeerTests(config, self._book.banned, self.feature_names)
        self._lock = threading.Lock()
        self.cfg = config

    @property
    def cfg(self) -> SentinelConfig:
        return self._cfg

    @cfg.setter
    def cfg(self, config: SentinelConfig) -> None:
        self._cfg = config
        for part in (self._reference, self._replays, self._book, self._peers):
            part.cfg = config

    # ------------------------------------------------------------------ public API
    def observe(self, sender: str, boundary: int, direction: Direction, tensor: Tensor, step: Optional[int] = None,
                tokens: Optional[Tensor] = None, paired: Optional[Tensor] = None, version: object = None) -> Verdict:
        """Judge one message from ``sender`` crossing ``boundary`` (between stage b and b+1) in ``direction``.

        ``tokens``: the microbatch's token ids (tells a replay from a retry). ``paired``: for ``bwd``, the forward
        coordinates this receiver sent for the same microbatch (enables ``pair_align``). ``step``: the receiver's
        optimizer step (the time axis of the drift fit). ``version``: the sender's claimed parameter version,
        ``(step, fingerprint)`` (``StageNode.sent_version``): two messages of the same step but different
        fingerprints come from replicas holding different weights (one missed an averaging round and has not
        repaired yet), so neither is evidence about the other (``comparable_versions``). Unverified: a sender that
        lies about it only changes whom its flags are compared with, and flags nobody could compare still ban
        (``unconfirmed_weight``, ``alone_max``).
        """
        if direction not in ("fwd", "bwd"):
            raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
        sender, version = str(sender), version_key(version)
        with self._lock:
            if sender in self._book.banned:
                return Verdict(True, True, 0.0, ["banned"])  # never scored again: it cannot move any statistic
            stream = self._stream(int(boundary), direction)
            stream.n += 1
            st = stream.senders.setdefault(sender, SenderRecord())
            st.n += 1
            st.last_seen = stream.n
            if not bool(torch.isfinite(tensor).all()):
                return self._book.strike(stream, sender, Strike(["non_finite"], math.inf,
                                                                hard=self.cfg.nonfinite_bans))
            digest = self._replays.digest(tensor)
            raw = fingerprint(tensor, paired)
            raw.t = float(step) if step is not None else float(stream.n)
            raw.sender, raw.version = sender, version
            raw.tok = None if tokens is None else token_digest(tokens)
            return self._judge_content(stream, st, raw, digest)

    def recomputed(self, sender: str, boundary: int, direction: Direction, original: Tensor, version: object,
                   recomputations: Sequence[tuple[str, Tensor, object]], suspected: bool = False) -> Verdict:
        """An audit: other replicas of ``sender``'s stage recomputed a message it sent (same input), as
        ``(auditor, tensor, its version)``; the receiver compares. ``original``: the message as ``sender`` sent
        it, claiming ``version``. ``suspected``: statistics flagged it.

        Replicas with the same weights compute the same message (bit-identical live; ``audit_tolerance`` allows
        for rounding). Only recomputations claiming ``sender``'s version (both fingerprints known) count. The
        sender is struck (not a statistical strike: nothing is estimated) when two of them agree with each other
        and not with its message: that bans a sender whose corruption looks honest to every statistic, e.g. the
        real message of another microbatch (``stale``) or noise below the per-message spread. One disagreeing
        recomputation is no proof (the auditor may be the liar): the caller asks a second replica. When none at
        the sender's weights answers (live, replicas often step seconds apart) and the message was ``suspected``,
        one disagreeing recomputation is a strike of weight 1: two independent signs, and a lying auditor would
        need three flagged honest messages audited by it alone to ban anyone. An auditor that disagrees with the
        message while two others confirm it is struck itself.
        """
        with self._lock:
            sender = str(sender)
            if sender in self._book.banned:
                return Verdict(True, True, 0.0, ["banned"])
            stream = self._stream(int(boundary), direction)
            st = stream.senders.setdefault(sender, SenderRecord())
            witnesses = self._audit_witnesses(sender, st, original, version_key(version), recomputations)
            if not witnesses:
                return Verdict(False, False, 0.0, ["audit inconclusive (no recomputation with the same weights)"])
            return self._audit(stream, sender, original, witnesses, suspected)

    def same_message(self, x: Tensor, y: Tensor) -> bool:
        """Whether two messages are one computation's result, up to ``audit_tolerance``."""
        return relative_difference(x, y) <= self.cfg.audit_tolerance

    def banned(self, sender: str) -> bool:
        return str(sender) in self._book.banned

    def banned_peers(self) -> set[str]:
        return set(self._book.banned)

    def unban(self, sender: str) -> None:
        """Lift a ban and clear the sender's evidence (e.g. after an operator's review)."""
        with self._lock:
            self._book.unban(sender)
            for stream in self._streams.values():
                stream.senders.pop(sender, None)

    def strikes(self, sender: str) -> float:
        """The sender's current strike weight, summed over streams."""
        with self._lock:
            return sum(strike_weight(s.senders[sender]) for s in self._streams.values() if sender in s.senders)

    def summary(self) -> dict:
        """Counts for metrics / the dashboard: per stream, messages seen and per-sender flags / ban state."""
        out = {}
        with self._lock:  # observe() runs on worker threads; a stream may be added meanwhile
            streams = list(self._streams.items())
        for (b, d), s in streams:
            out[f"{b}/{d}"] = {
                "messages": s.n,
                "ready": s.ready,
                "senders": {p: {"n": st.n, "flags": st.flags, "banned": st.banned,
                                "strikes": round(strike_weight(st), 2),
                                "struck": list(st.struck)}
                            for p, st in list(s.senders.items())},
            }
        return out

    # ------------------------------------------------------------------ audits
    def _audit_witnesses(self, sender: str, st: SenderRecord, original: Tensor, claimed: Optional[tuple],
                         recomputations: Sequence[tuple[str, Tensor, object]]) -> list[tuple[str, Tensor]]:
        """The recomputations that may judge ``sender``'s message (claimed version ``claimed``): of its shape, by
        auditors in good standing, at the sender's weights."""
        shaped = [(str(who), t, version_key(v)) for who, t, v in recomputations
                  if tuple(t.shape) == tuple(original.shape) and str(who) not in self._book.banned | {sender}]
        if claimed is not None and claimed[1] is not None and st.alone_run <= self.cfg.alone_max:
            return [(who, t) for who, t, v in shaped if v == claimed]
        # No fingerprint claimed, or one nobody else has held for ``alone_max`` messages (made up): the sender is
        # held to what replicas at its step compute (two that agree hold the same weights).
        return [(who, t) for who, t, v in shaped if v is not None and (claimed is None or v[0] == claimed[0])]

    def _audit(self, stream: StreamState, sender: str, original: Tensor, witnesses: list[tuple[str, Tensor]],
               suspected: bool) -> Verdict:
        cfg = self.cfg
        agree = [who for who, t in witnesses if self.same_message(original, t)]
        differ = [(who, t) for who, t in witnesses if who not in agree]
        if agree:
            if len(agree) >= 2:  # two auditors confirm the message: one that contradicts them lied
                for who, _ in differ:
                    self._book.strike(stream, who, Strike(
                        [f"audit of {sender[-8:]}'s message contradicted by {agree[0][-8:]} and {agree[1][-8:]}"],
                        counted=True, weight=cfg.audit_weight))
            return Verdict(False, False, 0.0, [])
        if len(differ) >= 2 and self.same_message(differ[0][1], differ[1][1]):
            diff = relative_difference(original, differ[0][1])
            return self._book.strike(stream, sender, Strike(
                [f"recomputed by {differ[0][0][-8:]} and {differ[1][0][-8:]}: differs (relative difference "
                 f"{diff:.3g})"], diff, counted=True, weight=cfg.audit_weight))
        if len(differ) == 1 and suspected:
            diff = relative_difference(original, differ[0][1])
            return self._book.strike(stream, sender, Strike(
                [f"flagged, and recomputed by {differ[0][0][-8:]} differently (relative difference {diff:.3g})"],
                diff, counted=True))
        return Verdict(False, False, 0.0, ["audit needs a second recomputation"])

    # ------------------------------------------------------------------ one message
    def _stream(self, boundary: int, direction: str) -> StreamState:
        stream = self._streams.get((boundary, direction))
        if stream is None:
            stream = self._streams[(boundary, direction)] = new_stream(direction, self.cfg.window, self.cfg.centre)
        return stream

    def _judge_content(self, stream: StreamState, st: SenderRecord, raw: MessageStats, digest: int) -> Verdict:
        """A finite message (``digest``: its SimHash): a retry gets its content's verdict again, a reproduction
        withdraws a flag; anything else is judged and, with token ids, remembered for its microbatch."""
        if raw.tok is not None:
            again = self._judged_before(stream, st, raw, digest)
            if again is not None:
                return again
        verdict = self._judge(stream, st, raw, self._replays.check(stream, raw.sender, digest, raw.tok, raw.base))
        if raw.tok is not None:
            self._remember_microbatch(stream, raw, digest, verdict)
        return verdict

    def _judged_before(self, stream: StreamState, st: SenderRecord, raw: MessageStats,
                       digest: int) -> Optional[Verdict]:
        """The verdict for content already judged for this microbatch; None for new content."""
        sender, version = raw.sender, raw.version
        seen = stream.judged.get((raw.tok, digest))
        if seen is None or not same_fingerprint(raw.base, seen.base):
            return None  # (the same sign pattern, not the same message, e.g. rescaled: judged afresh)
        if (seen.flagged and sender not in seen.senders and version is not None and version[1] is not None
                and version == seen.version and strike_weight(st) == 0 and self._peers.trusted(st)):
            return self._reproduced(stream, seen, raw)
        # A retry: the same microbatch's identical message, re-sent after a drop or a failure elsewhere (nodes
        # retry other replicas, trainers re-submit). It gets the verdict its content already got, and no second
        # strike: live, a flagged message is retried several times, and counting each retry turned one odd honest
        # message into a ban.
        seen.senders.add(sender)
        return Verdict(seen.flagged, st.banned or sender in self._book.banned, 0.0,
                       [f"retry of a flagged message: {'; '.join(seen.reasons[:2])}"] if seen.flagged else [])

    def _remember_microbatch(self, stream: StreamState, raw: MessageStats, digest: int, verdict: Verdict) -> None:
        """Record the verdict ``raw``'s content got for its microbatch (retries, reproductions, cross-checks)."""
        if not verdict.flagged:
            self._cross_check(stream, raw, digest)
        stream.judged[(raw.tok, digest)] = JudgedContent(verdict.flagged, list(verdict.reasons), {raw.sender},
                                                         raw.base, raw.version)
        entries = stream.by_tok.setdefault(raw.tok, [])
        entries.append((raw.sender, digest, raw.base, raw.version, verdict.flagged))
        del entries[:-8]  # a microbatch is sent to a few replicas at most
        for memory in (stream.judged, stream.by_tok):
            while len(memory) > self.cfg.replay_memory:
                memory.pop(next(iter(memory)))

    def _reproduced(self, stream: StreamState, seen: JudgedContent, raw: MessageStats) -> Verdict:
        """Another replica sent the exact content of a flagged message for the same microbatch (the receiver
        retried it there). Replicas holding the same weights compute bit-identical results, so the content is the
        honest computation and the flag was the reference's fault (the model moved faster than it followed): the
        flag is withdrawn for every sender of that content (pending flags dropped, strikes for it removed), the
        message is accepted and the reference re-anchored on it. Only from a sender in good standing (no strikes,
        CUSUM low) claiming the same, known weights; replay strikes stay. Two colluding identities of one attacker
        could still fake a reproduction (a known limit: in open runs identities are free)."""
        tok, sender = raw.tok, raw.sender
        seen.flagged, seen.reasons = False, []
        seen.senders.add(sender)
        self._book.withdraw(stream, tok, seen.senders)
        stream.by_tok[tok] = [(w, d, b, v, False if w in seen.senders else f)
                              for w, d, b, v, f in stream.by_tok.get(tok, [])]
        stream.recent.append(raw)
        if stream.ready and raw.mean.shape == stream.vec_mu["mean"].shape:
            stream.window.append(raw)
            stream.accepted_at[sender] = stream.n
            self._reanchor(stream)
        return Verdict(False, sender in self._book.banned, 0.0, ["reproduced a flagged message of another replica"])

    def _cross_check(self, stream: StreamState, raw: MessageStats, digest: int) -> None:
        """An accepted message for a microbatch another sender's flagged message was about, from a replica that
        claims the same weights (same step and fingerprint): the other's content was not what those weights
        compute on that input. Its pending flag becomes a strike now."""
        if raw.version is None or raw.version[1] is None:
            return
        for who, other_digest, base, version, flagged in stream.by_tok.get(raw.tok, []):
            if who == raw.sender or not flagged or version != raw.version or (
                    other_digest == digest and same_fingerprint(base, raw.base)):
                continue
            for p in [p for p in stream.pending if p.tok == raw.tok and p.sender == who]:
                stream.pending.remove(p)
                if who in stream.senders and who not in self._book.banned:
                    # Statistical all the same (minority cap, live reference): the witness is one sender, and on
                    # the forward side a sender picks the microbatches it is retried on.
                    self._book.strike(stream, who, Strike(
                        [*p.reasons, f"differs from {raw.sender[-8:]}'s result on the same input and weights"],
                        statistical=True, counted=True, tok=p.tok))

    def _judge(self, stream: StreamState, st: SenderRecord, raw: MessageStats, replay: list[str]) -> Verdict:
        """Judge new content (``replay``: why it is a replay, if it is): pooled into the warm-up, or scored."""
        sender = raw.sender
        if not stream.ready:
            stream.warm.append((sender, raw))
            if replay:
                return self._book.strike(stream, sender, Strike(replay))
            if len(stream.warm) >= self.cfg.warmup:
                self._reference.finish_warmup(stream)
                return Verdict(False, sender in self._book.banned, 0.0, [])
            return Verdict(False, st.banned or sender in self._book.banned, 0.0, [])
        if raw.mean.shape != stream.vec_mu["mean"].shape:
            return self._book.strike(stream, sender, Strike([*replay, f"width {raw.mean.shape[0]} differs"],
                                                            math.inf))
        return self._score(stream, st, raw, replay)

    def _reanchor(self, stream: StreamState, stalled: bool = False) -> None:
        """The model moved faster than the reference: a shift every sender shares (e.g. a loss spike or the end
        of the learning-rate warm-up), not an attack by everybody. Move the reference to the latest messages.
        ``stalled``: nobody's message was accepted for ``reanchor_after`` messages, so the statistical strikes
        earned since the last accepted one were earned against a stale reference and are forgotten."""
        self._reference.reanchor(stream)
        if stalled:
            self._book.forget_stalled(stream)
        stream.last_accept = stream.n

    def _score(self, stream: StreamState, st: SenderRecord, raw: MessageStats, replay: list[str]) -> Verdict:
        """Score one message against the stream's reference and its peers; strike, hold or accept it."""
        cfg = self.cfg
        if stream.n - stream.last_accept > cfg.reanchor_after and len(stream.recent) >= 3:
            self._reanchor(stream, stalled=True)
        z = self._reference.z(stream, raw)
        if self._book.settle(stream, raw, z):
            # Another sender's flag turned out to be shared by this message: the model moved, the reference is
            # stale. Re-anchor it on the latest messages and judge this one against the new reference.
            self._reanchor(stream)
            z = self._reference.z(stream, raw)
        scores, z_scale = self._flags(stream, st, raw, z)
        stream.recent.append(raw)
        # Peer-relative evidence works on z, not on raw features: z is measured against the drifting reference,
        # so a shift every sender shares cancels in the comparison with the peers. The tests are scaled by the z's
        # measured variance, like the per-message threshold.
        zc = np.clip(z, -cfg.kappa, cfg.kappa)
        peers = self._peers.evidence(stream, st, raw.version, zc, z_scale)
        if replay or peers.reasons:
            # Replays and peer-relative evidence (EMA test, CUSUM) are already judged against the peers: strike now.
            return self._book.strike(stream, raw.sender, Strike(
                [*replay, *scores.reasons, *peers.reasons], scores.score,
                weight=cfg.cusum_strikes if peers.alarm else 1, statistical=not replay, tok=raw.tok))
        if scores.flagged:
            return self._hold_flag(stream, st, raw, scores)
        if self._peers.trusted(st) and not peers.alone:
            # Accepted from a sender in good standing, holding its peers' weights: only now may the message enter
            # the reference window (a sender accumulating evidence could otherwise drag the reference towards
            # itself and hide, and one on other weights would widen the honest spread).
            self._reference.accept(stream, raw, zc)
        return Verdict(False, st.banned or raw.sender in self._book.banned, scores.score, [])

    def _flags(self, stream: StreamState, st: SenderRecord, raw: MessageStats,
               z: np.ndarray) -> tuple[_Scores, np.ndarray]:
        """The features ``z`` flags, and each feature's measured honest z sd (at least 1); records ``z`` as the
        sender's latest for the other senders' common-mode checks."""
        cfg = self.cfg
        # Common mode: with enough recent senders, a feature counts as deviant only if this message also stands
        # out from what the senders sent at about the same time (the median of their latest z, this one
        # included). A shift they all share is the model training faster than the reference follows.
        common = self._peers.common_mode(stream, st, z, raw.version)
        st.last_z, st.last_at, st.last_version = z, stream.n, raw.version
        # The threshold of each feature is kappa times the measured sd of its honest z, between 1 and
        # ``max_threshold_scale``: a heavy-tailed feature (live: the channel-profile and mean-vector distances, the
        # skewness direction while the model trains) would otherwise drop honest messages at many times the nominal
        # rate. The cap: early in training every feature's z is wide (drift), and an uncapped threshold let a 4x
        # scaled message (z ~ 25) through for 20 steps.
        z_scale = np.sqrt(np.maximum(stream.z2, 1.0)) if stream.z2 is not None else np.ones_like(z)
        threshold = cfg.kappa * np.minimum(z_scale, cfg.max_threshold_scale)
        flagged = [i for i in np.flatnonzero(np.abs(z) > threshold)
                   if common is None or abs(z[i] - common[i]) > threshold[i]]
        reasons = [f"{self.feature_names[i]} z={z[i]:+.1f}" for i in flagged]
        return _Scores(z, float(np.max(np.abs(z))), flagged, reasons), z_scale

    def _hold_flag(self, stream: StreamState, st: SenderRecord, raw: MessageStats, scores: _Scores) -> Verdict:
        """A per-message flag: the message is dropped now, but whether it is this sender's fault or a shift of the
        whole stream (the first sender to show a common drift has no peer evidence yet) is decided by the other
        senders' next messages (``StrikeBook.settle``)."""
        cfg = self.cfg
        st.flags += 1
        others = {p for p, s in stream.standing(self._book.banned)
                  if s is not st and stream.n - s.last_at <= cfg.peer_active_window}
        if not others:  # nobody to compare with: the flag stands on its own
            return self._book.strike(stream, raw.sender, Strike(scores.reasons, scores.score, statistical=True,
                                                                counted=True, tok=raw.tok))
        idx = np.array(scores.flagged)
        z = scores.z
        stream.pending.append(PendingFlag(raw.sender, stream.n, idx, np.sign(z[idx]), np.abs(z[idx]), scores.reasons,
                                          min(len(others), cfg.peer_min_senders - 1), raw.version, raw.tok))
        return Verdict(True, st.banned or raw.sender in self._book.banned, scores.score, scores.reasons)
