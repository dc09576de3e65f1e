"""SENTINEL: cheap statistical monitoring of the tensors that cross stage boundaries (METHODS s5).

Why: in a permissionless swarm any peer can serve a stage, and a stage cannot recompute its neighbours' work. What it
*can* do is notice that a neighbour's messages do not look like everybody else's: honest replicas of a stage run
the same weights on data from the same distribution, so their boundary messages are statistically alike. A
receiver therefore keeps, per (boundary, direction), a reference of what honest messages look like, and per sender a
record of how that sender deviates from it.

What is measured (``fingerprint``), on the message flattened to tokens x channels, all scale-free:

* ``log_rms``; ``norm_cv`` (spread of per-token norms); ``log_peak`` (max-abs / rms); ``zero_frac``;
* ``adj_cos``: mean cosine between consecutive positions' (centred) vectors. Attention makes neighbouring
  forward activations alike; independent noise does not (the strongest forward-noise feature; ~0 for gradients);
* the message's mean vector / rms, projected on a few fixed random directions (seeded by the run) and on the
  running reference mean direction (``mean_ref``): an *odd* statistic, the only kind a sign flip changes;
* per-channel skewness projected on its reference direction (``skew_ref``, odd as well);
* ``mean_dist`` / ``profile_dist``: per-channel whitened (diagonal Mahalanobis) distance of the mean vector / the
  per-channel rms profile to their references: a bias in *any* direction, or noise flattening the profile;
* ``pair_align`` (optional): mean over tokens of cos(message_t, paired_t). The gradient receiver knows the forward
  coordinates it sent for that microbatch; once a model has trained a little, honest gradients correlate with them
  and a flipped gradient anti-correlates. It is NaN (ignored) when no pair is given.

How it decides (``SentinelMonitor.observe``):

1. Hard checks: a non-finite message is flagged and (by default) bans its sender at once.
2. Replay: a SimHash of a fixed sub-sample of the (centred) message; a near-identical digest seen earlier with
   *different* token ids is a replay. Same tokens is a legitimate retry and is not flagged.
3. Warm-up: the first ``warmup`` messages of a (boundary, direction), pooled over senders, set the first reference.
   Each is compared with the rolling median of its neighbours in time (the model may train fast meanwhile); those
   that stand out do not seed the reference, but earn no strike (early training moves too fast to tell).
4. Reference that follows honest drift: honest statistics drift as the model trains, early by many per-message
   spreads per optimizer step (a frozen or EMA reference then flags every honest message and bans honest peers,
   as happened live). The reference is a window of the last ``window`` accepted messages: per feature, a
   Theil-Sen drift per step, a centre (median of the last ``centre`` accepted messages, moved along the drift to
   the message's step) and a spread (median absolute successive difference, which grows with the drift). With
   >= 3 senders, senders vote rather than messages (routing can give one peer most of a receiver's traffic): the
   centre is the median of the senders' own medians, the spread the within-sender noise plus the spread between
   senders' medians, and at the end of the warm-up a sender whose median is off that centre seeds nothing.
5. Per-message robust z-scores; ``|z| > kappa x`` the feature's measured honest z sd (1 to ``max_threshold_scale``)
   flags the message (it is dropped). A flag that the senders' latest messages share (median of their z, >= 3
   senders) is a common shift, not a flag. The *strike* waits for the other senders' next messages: if one shows
   the same shift (on the flag's strongest feature and on most of the others), the stream moved (the flag is
   dismissed and the reference re-anchored on the latest messages); if they do not, this sender stood out from its
   peers at the same time, and it is struck. This peer comparison works with 2 senders too.
6. Same weights only: every message carries its sender's parameter version, ``(step, fingerprint)``
   (``StageNode.sent_version``). Between averaging rounds a replica that missed one holds other weights at the same
   step until it repairs, and its messages differ for a reason that is nobody's fault; so a message of the same
   step but another fingerprint neither confirms a flag nor counts in the common-mode median, and a sender alone
   on its weights is kept out of the peer tests. A flag nobody with the same weights could settle expires as
   ``unconfirmed_weight`` (a third) of a strike: a sender that lies about its version still gets banned, later.
7. Recomputation, the strongest evidence: replicas with the same weights compute bit-identical messages. A
   receiver retries a dropped microbatch on another replica; if the retry returns the exact content that was
   flagged, the flag was the reference's fault: it is withdrawn, the message is used, the reference re-anchored.
   Where the sender's stage can recompute a message from what the receiver holds (a head from the tokens, a tail
   from the boundary), the node *audits* (``recomputed``): every flagged message and ``AUDIT_RATE`` of the
   accepted ones are recomputed by other replicas, and two that agree with each other and not with the message
   strike its sender. In those directions (``node_config``) statistics only pick suspects and never ban: that is
   what removed the honest bans of live runs, and what catches corruption no statistic sees (stale messages, faint
   noise). A middle stage's messages cannot be recomputed without its whole chain: statistics ban there.
8. Peer-relative evidence on z (drift cancels): a per-sender EMA of z against the median of the active senders'
   EMAs (>= 3 senders), and a two-sided CUSUM on the message's z minus that median (small persistent shifts),
   both scaled by the measured variance of honest z. A CUSUM alarm also needs the sender's EMA ``cusum_peer_min``
   sds off the median, same side.
9. Only un-flagged messages of senders in good standing (CUSUM below ``trust_cusum``) enter the window. Every
   confirmed flag is a strike (a CUSUM alarm ``cusum_strikes``); a sender with ``strikes_to_ban`` strikes within its
   last ``strike_window`` messages is banned if some other sender's message was accepted since the first of them
   (the reference was alive), and if, on statistics alone, the senders this receiver banned stay a minority of its
   active senders (honest replicas are the majority; a receiver about to ban most of them follows a broken
   reference). If nobody's message is accepted for ``reanchor_after`` messages the reference is re-anchored and the
   statistical strikes earned meanwhile are forgotten.

Measured (``agora bench sentinel``, offline, real ``tiny`` traffic, ``docs/bench/sentinel``), on a static pool and
on streams recorded while ``tiny`` trains 240 steps: with audits (the node's setting next to the first or last
stage) 32/32 attacks banned in each setting, median 2 messages, 0 honest bans, sender F1 1.0; on statistics alone
(middle stages) 29/32 (weak gradient noise and stale messages missed), 0 honest bans, F1 0.951. With SENTINEL the
model's validation loss under each attack equals the clean run's; without, attacks cost up to 5.7 %. Live 6-process
swarms: attackers banned by every honest receiver that judged enough of them, no honest bans
(``docs/bench/sentinel/live.md``).

Sign flips: for zero-mean, symmetric messages no even statistic (rms, norms, peaks, profile) can see ``x -> -x``;
only odd ones can (mean direction, skewness, pairing). Measured on the ``tiny`` preset with Zipf/bigram synthetic
text (``agora.bench.sentinel_eval``): the batch mean direction is consistent enough, even untrained, that a flip moves
``mean_ref`` by ~7 sigma for forward coordinates and ~4.6 sigma for gradients (banned within 3-12 messages); after 50
training steps ``skew_ref`` and the mean projections move by 14-100 sigma (banned in 3). The loss check
(``LossMonitor``) is the complement, not the substitute: at initialisation a forward flip does not change the loss at
all (z = -0.4), after 50 steps it raises the log-loss by z ~ 24, after 150 by z ~ 11. Gradient flips never show in
the loss of the same microbatch (they corrupt the *upstream* update); fingerprints must catch those.

Known blind spots (measured, see the evaluation): a *stale* message (the real output of another microbatch, never
sent before) is statistically honest and invisible to all of this; weak additive noise on gradients (0.25 x rms) is
below the per-message spread; a 0.2 x rms forward bias on an untrained model is not caught (caught in 3 messages
after 50 training steps). Near-duplicate data on different token ids (heavy padding, duplicated documents) would be
mistaken for replays.

How ``StageNode`` uses it (``agora node --sentinel``): ``_screen`` calls ``observe`` off the event loop for every
received training activation (upstream sender, direction ``fwd``) and every gradient returned by the peer it
called (direction ``bwd``, paired with the coordinates it sent); a flagged message is dropped (refused, or retried
on another replica), a banned sender is refused and skipped by routing and averaging, and bans are published under
``records.bans_key(run_id)``; trainers and averaging groups drop a peer once ``records.BAN_QUORUM`` publishers
banned it.

Cost: ~1 ms per [8, 64, 8] message and ~10-20 ms per [8, 1024, 51] one on one CPU thread (linear in size), so for
real message sizes call it off the event loop, e.g. ``await self.run_io(functools.partial(self.sentinel.observe,
...))`` (``run_io``/``run_compute`` pass positional arguments only). It takes an internal lock, so calls from several
threads are safe.

Where the node already refuses a message as non-finite (``_validate``; the finite check on the returned gradient),
call ``observe`` on it anyway before raising: that is what turns a NaN into a ban instead of an endless rejection.
Reject calls from banned upstream peers first thing in ``_handle_fwd_bwd``: ``if self.sentinel.banned(str(caller))``.
"""

from __future__ import annotations

import hashlib
import math
import threading
import warnings
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Literal, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

Direction = Literal["fwd", "bwd"]

BASE_FEATURES = ("log_rms", "norm_cv", "log_peak", "zero_frac", "adj_cos")
TAIL_FEATURES = ("mean_ref", "skew_ref", "mean_dist", "profile_dist", "pair_align")
VECTORS = ("mean", "skew", "profile")  # per-channel statistics with a reference mean / variance per channel


@dataclass(frozen=True)
class SentinelConfig:
    """Thresholds and memory of ``SentinelMonitor``. Defaults follow METHODS s5's prototype, tuned on ``tiny``."""

    seed: int = 0  # run seed: the random projections and replay sub-sample (all honest receivers may share it)
    warmup: int = 48  # pooled messages per (boundary, direction) before any statistical flag
    window: int = 32  # recently accepted messages kept; their successive differences give the spread
    centre: int = 8  # the reference centre is the median of this many most recent accepted messages
    common_recent: int = 12  # a sender's last z counts for the common-mode check if this many stream messages old
    reanchor_after: int = 12  # stream messages in a row without one accepted: the reference is re-anchored
    kappa: float = 6.0  # per-message robust z threshold
    max_threshold_scale: float = 2.0  # ... times the feature's measured honest z sd, capped at this
    cusum_k: float = 1.0  # CUSUM slack, in sigmas
    cusum_h: float = 15.0  # CUSUM alarm level
    cusum_strikes: int = 2  # a confirmed alarm is accumulated evidence: two strikes (live, an honest head sent a run
    # of four odd microbatches, one document's worth, and a CUSUM alarm worth a ban nearly banned it)
    cusum_peer_min: float = 3.0  # ... confirmed = the sender's EMA is this many sds off the peer median, same side
    trust_cusum: float = 8.0  # a sender whose CUSUM exceeds this does not enter the reference window
    peer_beta: float = 0.95  # per-sender EMA decay of z for the peer-relative test
    peer_kappa: float = 6.0  # threshold, in sds of the difference of two honest senders' EMAs
    peer_min_senders: int = 3
    peer_min_messages: int = 8  # a sender's EMA is compared only after this many of its messages
    peer_active_window: int = 200  # senders silent for this many stream messages leave the peer median
    strikes_to_ban: int = 3
    # A flag that no message of the same version from another sender could settle (the sender was alone on its
    # version: an honest replica that has not repaired a missed round yet, or a sender lying about its version)
    # weighs this much of a strike.
    unconfirmed_weight: float = 1 / 3
    alone_max: int = 20  # ... for this many messages in a row; longer, and its version is treated as made up
    strike_window: int = 50  # in messages of that sender
    n_projections: int = 4
    sigma_floor: float = 1e-3  # features are scale-free; a constant honest feature still gets a finite sigma
    nonfinite_bans: bool = True  # NaN/Inf bans at once (it is never an honest statistical fluctuation)
    # Directions whose statistical strikes may ban. A receiver that audits a direction (has every flagged message
    # recomputed, ``recomputed``) leaves it out: there statistics only pick suspects and recomputation convicts,
    # which removes the honest bans that drifting gradient statistics caused live.
    statistical_ban_directions: tuple = ("fwd", "bwd")
    audit_tolerance: float = 1e-3  # relative L2 difference between a message and its recomputation that is rounding
    # A failed audit weighs this much of a strike: two ban. Not one: a replica repairing its state at the same step
    # can send a message of its old weights under its new fingerprint, once.
    audit_weight: float = 1.5
    replay_bits: int = 64
    replay_max_distance: int = 2  # Hamming distance (of replay_bits) that counts as the same message
    replay_memory: int = 1024  # recent digests kept per (boundary, direction)
    replay_sample: int = 2048  # entries of the message hashed


# Share of accepted messages a node has other replicas recompute where it can (``NodeOptions.audit_rate``;
# flagged ones always): gradients from the last stage, activations from the first.
AUDIT_RATE = 0.1


def node_config(config: Optional[SentinelConfig] = None, audited: Sequence[str] = ("fwd", "bwd")) -> SentinelConfig:
    """A node's monitor settings: in the directions it audits (has messages recomputed by other replicas),
    statistics pick suspects and audits convict."""
    config = config or SentinelConfig()
    return replace(config, statistical_ban_directions=tuple(
        d for d in config.statistical_ban_directions if d not in audited))


@dataclass
class Verdict:
    """What ``observe`` concluded about one message. ``score`` is its largest robust |z| (0 during warm-up)."""

    flagged: bool
    banned: bool
    score: float
    reasons: list[str] = field(default_factory=list)


@dataclass
class _Raw:
    """Per-message statistics that do not depend on the monitor's state."""

    base: np.ndarray  # BASE_FEATURES
    mean: np.ndarray  # [k] mean vector / rms
    skew: np.ndarray  # [k] per-channel skewness
    profile: np.ndarray  # [k] per-channel rms / rms
    pair_align: float
    t: float = 0.0  # when it was received: the receiver's optimizer step, else the stream's message index
    sender: str = ""
    version: Optional[tuple] = None  # the sender's claimed parameter version (step, fingerprint), if it sent one
    tok: Optional[bytes] = None  # digest of the microbatch's token ids, if given


@dataclass
class _Sender:
    n: int = 0
    last_seen: int = 0
    banned: bool = False
    # (sender message index, stream index, statistical?, weight, token digest of the message struck)
    strikes: deque = field(default_factory=deque)
    flags: int = 0
    cusum_pos: Optional[np.ndarray] = None
    cusum_neg: Optional[np.ndarray] = None
    ema: Optional[np.ndarray] = None  # EMA of the sender's clipped z (peer-relative test)
    last_z: Optional[np.ndarray] = None  # z of its latest message (common-mode check)
    last_at: int = 0  # stream index of that message
    last_version: Optional[tuple] = None  # version of that message
    alone_run: int = 0  # its latest messages in a row on weights no active peer shares
    ema_n: int = 0
    struck: deque = field(default_factory=lambda: deque(maxlen=8))  # reasons of its latest strikes (the evidence)


@dataclass
class _Stream:
    direction: str = "fwd"
    warm: list = field(default_factory=list)  # [(sender, _Raw)] until ready
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
    window: deque = field(default_factory=deque)  # recently accepted _Raw messages (maxlen set by the monitor)
    recent: deque = field(default_factory=deque)  # every recent scored _Raw, accepted or not (re-anchoring)
    accepted_at: dict = field(default_factory=dict)  # sender -> stream index of its latest accepted message
    last_accept: int = 0  # stream index of the latest accepted message (any sender)
    pending: list = field(default_factory=list)  # _Pending strikes awaiting the peers' next messages
    z2: Optional[np.ndarray] = None  # running mean of clipped z^2 over all senders: the z's real variance
    senders: dict = field(default_factory=dict)
    digests: deque = field(default_factory=deque)  # (simhash, sender, token_digest, base features)
    judged: dict = field(default_factory=dict)  # (token_digest, simhash) -> _Judged: retries and reproductions
    by_tok: dict = field(default_factory=dict)  # token_digest -> [(sender, simhash, base, version, flagged)]


@dataclass
class _Pending:
    """A per-message flag whose strike waits for the other senders' next messages (see ``_settle``)."""

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
class _Judged:
    """The verdict a message's content got, and who sent that exact content for that microbatch."""

    flagged: bool
    reasons: list
    senders: set
    base: np.ndarray  # its scalar fingerprint: a retry matches it as well as the SimHash
    version: Optional[tuple] = None  # the version its first sender claimed


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


def version_key(version: object) -> Optional[tuple]:
    """``(step, fingerprint)`` as a hashable key; None for anything else (a sender may send garbage here)."""
    if not isinstance(version, (list, tuple)) or len(version) != 2:
        return None
    step, fp = version
    if isinstance(step, bool) or not isinstance(step, int):
        return None
    if fp is not None and (isinstance(fp, bool) or not isinstance(fp, (int, float)) or not math.isfinite(fp)):
        return None
    return (step, None if fp is None else float(fp))


def _comparable(a: Optional[tuple], b: Optional[tuple]) -> bool:
    """Whether messages of versions ``a`` and ``b`` may be compared: not when both are known, of the same step, and
    with different fingerprints (replicas that diverged at that step; their messages differ for a reason that is
    no fault of either). Different steps are compared: the reference's drift fit accounts for those."""
    if a is None or b is None or a[0] != b[0] or a[1] is None or b[1] is None:
        return True
    return a[1] == b[1]


def _same_base(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two scalar fingerprints are one message's (identical content, up to rounding)."""
    return bool(np.allclose(a, b, rtol=1e-3, atol=1e-3))


def _weight(st: "_Sender") -> float:
    """The sender's current strike weight in one stream."""
    return sum(x[3] for x in list(st.strikes))


def _relative_difference(x: Tensor, y: Tensor) -> float:
    x, y = x.detach().double(), y.detach().double()
    if not (bool(torch.isfinite(x).all()) and bool(torch.isfinite(y).all())):
        return math.inf
    return float((x - y).norm() / (y.norm() + 1e-30))


def _rows(x: Tensor) -> Tensor:
    x = x.detach().to(torch.float64)
    if x.dim() == 0:
        return x.reshape(1, 1)
    return x.reshape(-1, x.shape[-1]) if x.dim() >= 2 else x.reshape(-1, 1)


def fingerprint(x: Tensor, paired: Optional[Tensor] = None) -> _Raw:
    """State-free statistics of one (finite) message: what ``observe`` z-scores, minus the reference projections."""
    r = _rows(x)
    eps = 1e-30
    rms = float(r.pow(2).mean().sqrt())
    norms = r.norm(dim=1)
    norm_mean = float(norms.mean())
    mean = r.mean(0)
    centred = r - mean
    seqs = centred.reshape(-1, x.shape[-2], centred.shape[-1]) if x.dim() >= 3 else centred.unsqueeze(0)
    adj = 0.0
    if seqs.shape[1] > 1:
        adj = float(torch.nn.functional.cosine_similarity(seqs[:, 1:], seqs[:, :-1], dim=-1, eps=1e-30).mean())
    base = np.array(
        [
            math.log(rms + eps),
            float(norms.std(unbiased=False)) / (norm_mean + eps) if r.shape[0] > 1 else 0.0,
            math.log(float(r.abs().max()) / (rms + eps) + eps) if rms > 0 else 0.0,
            float((r == 0).double().mean()),
            adj,
        ]
    )
    m2 = centred.pow(2).mean(0)
    skew = centred.pow(3).mean(0) / (m2.pow(1.5) + eps)
    profile = r.pow(2).mean(0).sqrt() / (rms + eps)
    align = float("nan")
    if paired is not None and tuple(paired.shape) == tuple(x.shape):
        p = _rows(paired)
        align = float(torch.nn.functional.cosine_similarity(r, p, dim=1, eps=1e-30).mean())
    return _Raw(base, (mean / (rms + eps)).numpy(), skew.numpy(), profile.numpy(), align)


class SentinelMonitor:
    """Per-(boundary, direction) reference statistics and per-sender evidence; see the module docstring."""

    def __init__(self, config: Optional[SentinelConfig] = None):
        self.cfg = config or SentinelConfig()
        self._streams: dict[tuple[int, str], _Stream] = {}
        self._proj: dict[int, np.ndarray] = {}
        self._hash: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        self._banned: set[str] = set()
        self._stat_banned: set[str] = set()  # banned on statistical strikes (the minority cap counts these)
        self._lock = threading.Lock()
        n = self.cfg.n_projections
        self.feature_names: tuple[str, ...] = (
            BASE_FEATURES + tuple(f"mean_proj{i}" for i in range(n)) + TAIL_FEATURES
        )

    # ------------------------------------------------------------------ public API
    def observe(
        self,
        sender: str,
        boundary: int,
        direction: Direction,
        tensor: Tensor,
        step: Optional[int] = None,
        tokens: Optional[Tensor] = None,
        paired: Optional[Tensor] = None,
        version: object = None,
    ) -> Verdict:
        """Judge one message from ``sender`` crossing ``boundary`` (between stage b and b+1) in ``direction``.

        ``tokens``: the microbatch's token ids (tells a replay from a retry). ``paired``: for ``bwd``, the forward
        coordinates this receiver sent for the same microbatch (enables ``pair_align``). ``step``: the receiver's
        optimizer step (the time axis of the drift fit). ``version``: the sender's claimed parameter version,
        ``(step, fingerprint)`` (``StageNode.sent_version``): two messages of the same step but different
        fingerprints come from replicas holding different weights (one missed an averaging round and has not
        repaired yet), so neither is evidence about the other (see ``_comparable``). Unverified: a sender that lies
        about it only changes whom its flags are compared with, and flags nobody could compare still ban
        (``unconfirmed_weight``, ``alone_max``).
        """
        if direction not in ("fwd", "bwd"):
            raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
        with self._lock:
            return self._observe(str(sender), int(boundary), direction, tensor, tokens, paired, step,
                                 version_key(version))

    def recomputed(self, sender: str, boundary: int, direction: Direction, original: Tensor, version: object,
                   recomputations: Sequence[tuple[str, Tensor, object]], suspected: bool = False) -> Verdict:
        """An audit: other replicas of ``sender``'s stage recomputed a message it sent (same input), as
        ``(auditor, tensor, its version)``; the receiver compares.

        Replicas with the same weights compute the same message (bit-identical live; ``audit_tolerance`` allows
        for rounding). Only recomputations claiming ``sender``'s version (both fingerprints known) count. The
        sender is struck (not a statistical strike: nothing is estimated) when two of them agree with each other
        and not with its message: that bans a sender whose corruption looks honest to every statistic, e.g. the
        real message of another microbatch (``stale``) or noise below the per-message spread. One disagreeing
        recomputation is no proof (the auditor may be the liar): the caller asks a second replica. When none at
        the sender's weights answers (live, replicas often step seconds apart) and the message was ``suspected``
        (flagged by statistics), one disagreeing recomputation is a strike of weight 1: two independent signs, and
        a lying auditor would need three flagged honest messages audited by it alone to ban anyone. An auditor
        that disagrees with the message while two others confirm it is struck itself.
        """
        cfg, a = self.cfg, version_key(version)
        with self._lock:
            sender = str(sender)
            if sender in self._banned:
                return Verdict(True, True, 0.0, ["banned"])
            stream = self._stream(int(boundary), direction)
            st = stream.senders.setdefault(sender, _Sender())
            shaped = [(str(who), t, version_key(v)) for who, t, v in recomputations
                      if tuple(t.shape) == tuple(original.shape) and str(who) not in self._banned | {sender}]
            if a is not None and a[1] is not None and st.alone_run <= cfg.alone_max:
                valid = [(who, t) for who, t, v in shaped if v == a]
            else:
                # No fingerprint claimed, or one nobody else has held for ``alone_max`` messages (made up): the
                # sender is held to what replicas at its step compute (two that agree hold the same weights).
                valid = [(who, t) for who, t, v in shaped if v is not None and (a is None or v[0] == a[0])]
            if not valid:
                return Verdict(False, False, 0.0, ["audit inconclusive (no recomputation with the same weights)"])
            agree = [who for who, t in valid if self.same_message(original, t)]
            differ = [(who, t) for who, t in valid if who not in agree]
            if agree:
                if len(agree) >= 2:  # two auditors confirm the message: one that contradicts them lied
                    for who, _ in differ:
                        self._strike(stream, who, stream.senders.setdefault(who, _Sender()),
                                     [f"audit of {sender[-8:]}'s message contradicted by {agree[0][-8:]} and "
                                      f"{agree[1][-8:]}"], 0.0, counted=True, weight=cfg.audit_weight)
                return Verdict(False, False, 0.0, [])
            if len(differ) >= 2 and self.same_message(differ[0][1], differ[1][1]):
                diff = _relative_difference(original, differ[0][1])
                return self._strike(stream, sender, st, [f"recomputed by {differ[0][0][-8:]} and {differ[1][0][-8:]}: "
                                                         f"differs (relative difference {diff:.3g})"], diff,
                                    counted=True, weight=cfg.audit_weight)
            if len(differ) == 1 and suspected:
                diff = _relative_difference(original, differ[0][1])
                return self._strike(stream, sender, st, [f"flagged, and recomputed by {differ[0][0][-8:]} differently "
                                                         f"(relative difference {diff:.3g})"], diff, counted=True)
            return Verdict(False, False, 0.0, ["audit needs a second recomputation"])

    def same_message(self, x: Tensor, y: Tensor) -> bool:
        """Whether two messages are one computation's result, up to ``audit_tolerance``."""
        return _relative_difference(x, y) <= self.cfg.audit_tolerance

    def banned(self, sender: str) -> bool:
        return str(sender) in self._banned

    def banned_peers(self) -> set[str]:
        return set(self._banned)

    def unban(self, sender: str) -> None:
        """Lift a ban and clear the sender's evidence (e.g. after an operator's review)."""
        with self._lock:
            self._banned.discard(sender)
            self._stat_banned.discard(sender)
            for stream in self._streams.values():
                stream.senders.pop(sender, None)

    def strikes(self, sender: str) -> float:
        """The sender's current strike weight, summed over streams."""
        with self._lock:
            return sum(_weight(s.senders[sender]) for s in self._streams.values() if sender in s.senders)

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
                                "strikes": round(_weight(st), 2),
                                "struck": list(st.struck)}
                            for p, st in list(s.senders.items())},
            }
        return out

    # ------------------------------------------------------------------ internals
    def _stream(self, boundary: int, direction: str) -> _Stream:
        stream = self._streams.get((boundary, direction))
        if stream is None:
            stream = self._streams[(boundary, direction)] = _Stream(
                direction, window=deque(maxlen=self.cfg.window), recent=deque(maxlen=self.cfg.centre))
        return stream

    def _observe(self, sender, boundary, direction, tensor, tokens, paired, step=None, version=None) -> Verdict:
        if sender in self._banned:
            return Verdict(True, True, 0.0, ["banned"])  # never scored again: it cannot move any statistic
        stream = self._stream(boundary, direction)
        stream.n += 1
        st = stream.senders.setdefault(sender, _Sender())
        st.n += 1
        st.last_seen = stream.n
        if not bool(torch.isfinite(tensor).all()):
            return self._strike(stream, sender, st, ["non_finite"], math.inf, hard=self.cfg.nonfinite_bans)

        digest = self._simhash(tensor)
        raw = fingerprint(tensor, paired)
        tok = None
        if tokens is not None:
            tok = hashlib.blake2b(tokens.detach().cpu().to(torch.int64).numpy().tobytes(), digest_size=16).digest()
        raw.t = float(step) if step is not None else float(stream.n)
        raw.sender, raw.version, raw.tok = sender, version, tok
        if tok is not None:
            seen = stream.judged.get((tok, digest))
            if seen is not None and not _same_base(raw.base, seen.base):
                seen = None  # the same sign pattern, not the same message (e.g. rescaled): judged afresh
            if (seen is not None and seen.flagged and sender not in seen.senders and version is not None
                    and version[1] is not None and version == seen.version and _weight(st) == 0
                    and self._trusted(st)):
                return self._reproduced(stream, sender, seen, raw)
            if seen is not None:
                # A retry: the same microbatch's identical message, re-sent after a drop or a failure elsewhere
                # (nodes retry other replicas, trainers re-submit). It gets the verdict its content already got, and
                # no second strike: live, a flagged message is retried several times, and counting each retry
                # turned one odd honest message into a ban.
                seen.senders.add(sender)
                return Verdict(seen.flagged, st.banned or sender in self._banned, 0.0,
                               [f"retry of a flagged message: {'; '.join(seen.reasons[:2])}"] if seen.flagged else [])
        verdict = self._judge(stream, sender, st, raw, self._replay_check(stream, sender, digest, tok, raw.base))
        if tok is not None:
            if not verdict.flagged:
                self._cross_check(stream, sender, raw, digest)
            stream.judged[(tok, digest)] = _Judged(verdict.flagged, list(verdict.reasons), {sender}, raw.base, version)
            entries = stream.by_tok.setdefault(tok, [])
            entries.append((sender, digest, raw.base, version, verdict.flagged))
            del entries[:-8]  # a microbatch is sent to a few replicas at most
            while len(stream.judged) > self.cfg.replay_memory:
                stream.judged.pop(next(iter(stream.judged)))
            while len(stream.by_tok) > self.cfg.replay_memory:
                stream.by_tok.pop(next(iter(stream.by_tok)))
        return verdict

    def _reproduced(self, stream: _Stream, sender: str, seen: _Judged, raw: _Raw) -> Verdict:
        """Another replica sent the exact content of a flagged message for the same microbatch (the receiver
        retried it there). Replicas holding the same weights compute bit-identical results, so the content is the
        honest computation and the flag was the reference's fault (the model moved faster than it followed): the
        flag is withdrawn for every sender of that content (pending flags dropped, strikes for it removed), the
        message is accepted and the reference re-anchored on it. Only from a sender in good standing (no strikes,
        CUSUM low) claiming the same, known weights; replay strikes stay. Two colluding identities of one attacker
        could still fake a reproduction (a known limit: in open runs identities are free)."""
        tok = raw.tok
        seen.flagged, seen.reasons = False, []
        seen.senders.add(sender)
        stream.pending = [p for p in stream.pending if p.tok != tok]
        for who in seen.senders:
            other = stream.senders.get(who)
            if other is not None:  # (a replay strike stays: it was judged on content, not on statistics)
                other.strikes = deque(x for x in other.strikes if not (x[2] and x[4] == tok))
        stream.by_tok[tok] = [(w, d, b, v, False if w in seen.senders else f)
                              for w, d, b, v, f in stream.by_tok.get(tok, [])]
        stream.recent.append(raw)
        if stream.ready and raw.mean.shape == stream.vec_mu["mean"].shape:
            stream.window.append(raw)
            stream.accepted_at[sender] = stream.n
            self._reanchor(stream)
        return Verdict(False, sender in self._banned, 0.0, ["reproduced a flagged message of another replica"])

    def _cross_check(self, stream: _Stream, sender: str, raw: _Raw, digest: int) -> None:
        """An accepted message for a microbatch another sender's flagged message was about, from a replica that
        claims the same weights (same step and fingerprint): the other's content was not what those weights
        compute on that input. Its pending flag becomes a strike now."""
        if raw.version is None or raw.version[1] is None:
            return
        for who, other_digest, base, version, flagged in stream.by_tok.get(raw.tok, []):
            if who == sender or not flagged or version != raw.version or (
                    other_digest == digest and _same_base(base, raw.base)):
                continue
            for p in [p for p in stream.pending if p.tok == raw.tok and p.sender == who]:
                stream.pending.remove(p)
                other = stream.senders.get(who)
                if other is not None and who not in self._banned:
                    # Statistical all the same (minority cap, live reference): the witness is one sender, and on
                    # the forward side a sender picks the microbatches it is retried on.
                    self._strike(stream, who, other, [*p.reasons, f"differs from {sender[-8:]}'s result on the same "
                                                                   f"input and weights"], 0.0, statistical=True,
                                 counted=True, tok=p.tok)

    def _judge(self, stream: _Stream, sender: str, st: _Sender, raw: _Raw, reasons: list[str]) -> Verdict:
        if not stream.ready:
            stream.warm.append((sender, raw))
            if reasons:
                return self._strike(stream, sender, st, reasons, 0.0)
            if len(stream.warm) >= self.cfg.warmup:
                return self._finish_warmup(stream, sender)
            return Verdict(False, st.banned or sender in self._banned, 0.0, [])
        if raw.mean.shape != stream.vec_mu["mean"].shape:
            return self._strike(stream, sender, st, [*reasons, f"width {raw.mean.shape[0]} differs"], math.inf)
        return self._score(stream, sender, st, raw, reasons)

    def _features(self, stream: _Stream, raw: _Raw) -> np.ndarray:
        proj = self._projections(raw.mean.shape[0])
        mu, var = stream.vec_mu, stream.vec_var
        floor = self.cfg.sigma_floor**2

        def unit(v: np.ndarray) -> np.ndarray:
            return v / (np.linalg.norm(v) + 1e-30)

        def dist(name: str, v: np.ndarray) -> float:
            return float(np.sqrt(np.mean((v - mu[name]) ** 2 / (var[name] + floor))))

        tail = [
            float(raw.mean @ unit(mu["mean"])),
            float(raw.skew @ unit(mu["skew"])),
            dist("mean", raw.mean),
            dist("profile", raw.profile),
            raw.pair_align,
        ]
        return np.concatenate([raw.base, proj @ raw.mean, np.array(tail)])

    def _projections(self, k: int) -> np.ndarray:
        if k not in self._proj:
            gen = torch.Generator().manual_seed(_seed(self.cfg.seed, "sentinel-proj", k))
            p = torch.randn(self.cfg.n_projections, k, generator=gen, dtype=torch.float64)
            self._proj[k] = (p / p.norm(dim=1, keepdim=True)).numpy()
        return self._proj[k]

    def _set_reference(self, stream: _Stream, raws: list[_Raw], pooled: bool = False) -> None:
        """The reference centre and per-feature spread, from ``raws`` in arrival order.

        Why not an EMA of accepted messages: honest statistics drift as the model trains, early on by many honest
        spreads per optimizer step (measured on ``tiny``: the forward rms moves by ~0.16 in log per step for the
        first steps, against a spread of 0.01-0.05 between replicas at one step). An EMA lags such drift by
        ~1/(1-beta) messages; once the lag exceeds the threshold every honest message is flagged, none is
        accepted, the reference never catches up, and honest senders are banned (what happened in live runs).

        Instead the centre is the median of the last ``centre`` accepted messages (a lag of a few messages, robust
        to a minority of sub-threshold attacker messages) and the spread is the median absolute *successive
        difference* of the last ``window`` accepted messages / sqrt(2): for iid messages that is the honest
        spread, and under drift it grows by the drift per message, so the threshold widens exactly as much as the
        drift between a message and its reference. Both are per feature: each is calibrated by its own measured
        spread. ``pooled`` (the warm-up, which may hold an attacker's messages interleaved with honest ones, where
        successive differences would mostly straddle the two): plain median / MAD of all of them instead.
        """
        who = [r.sender for r in raws]
        groups = [np.array([i for i, w in enumerate(who) if w == name]) for name in dict.fromkeys(who)]
        balanced = len(groups) >= self.cfg.peer_min_senders
        n_centre = len(raws) if pooled else self.cfg.centre

        def centre_spread(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            """Centre and spread of the rows of ``x`` (messages in arrival order, detrended)."""
            if not balanced:
                c = np.median(x[-n_centre:], axis=0)
                if pooled or x.shape[0] < 3:
                    return c, 1.4826 * np.median(np.abs(x - c), axis=0)
                return c, 1.4826 * np.median(np.abs(np.diff(x, axis=0)), axis=0) / math.sqrt(2)
            # Senders vote, not messages: routing can send most of a receiver's traffic to one peer (live, an
            # attacking tail got half of a head's gradients, hence most of its reference), so each sender's own
            # median counts once and the centre is the median of those. The spread is the honest noise within a
            # sender (successive differences of its own messages, pooled) plus the spread between senders'
            # medians (median distance to the centre: a lone odd sender does not widen it).
            meds = np.stack([np.median(x[g[-n_centre:]], axis=0) for g in groups])
            c = np.median(meds, axis=0)
            diffs = [np.diff(x[g], axis=0) for g in groups if len(g) > 1]
            within = (1.4826 * np.median(np.abs(np.concatenate(diffs)), axis=0) / math.sqrt(2)
                      if diffs else np.zeros(x.shape[1]))
            between = 1.4826 * np.median(np.abs(meds - c), axis=0)
            return c, np.sqrt(within**2 + between**2)

        # The per-channel references (mean direction, skew direction, rms profile) use the whole window: a
        # direction estimated from a few messages is too noisy for the odd statistics that expose sign flips,
        # and the features built on it are detrended below anyway.
        for name in VECTORS:
            vecs = np.stack([getattr(r, name) for r in raws])
            n_c, n_centre = n_centre, len(raws)
            stream.vec_mu[name], sp = centre_spread(vecs)
            n_centre = n_c
            stream.vec_var[name] = sp**2
        feats = np.stack([self._features(stream, r) for r in raws])
        t = np.array([r.t for r in raws])
        t_ref = float(np.median(t[-n_centre:]))
        # Theil-Sen slope (median of pairwise slopes) per feature over the window: the model's drift per step,
        # robust to a minority of odd messages. Pairs at the same time carry no slope.
        i, k = np.triu_indices(len(raws), 1)
        dt = t[k] - t[i]
        pairs = dt != 0
        mu, sd = np.zeros(feats.shape[1]), np.full(feats.shape[1], self.cfg.sigma_floor)
        slope = np.zeros(feats.shape[1])
        active = np.zeros(feats.shape[1], dtype=bool)
        for j in range(feats.shape[1]):
            ok = np.isfinite(feats[:, j])
            # A feature absent from most of the reference messages (pair_align without pairs) is not scored: it
            # would have no honest reference to be compared with.
            if ok.sum() < max(3, len(raws) // 2):
                continue
            active[j] = True
            col = feats[:, j]
            if not pooled:
                sel = pairs & ok[i] & ok[k]
                if sel.sum() >= 3:
                    slope[j] = float(np.median((col[k[sel]] - col[i[sel]]) / dt[sel]))
            detr = np.where(ok, col - slope[j] * (t - t_ref), np.nan)
            if ok.all():
                c, sp = centre_spread(detr[:, None])
            else:
                with np.errstate(all="ignore"), warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    c = np.array([np.nanmedian(detr[-n_centre:])])
                    sp = np.array([1.4826 * np.nanmedian(np.abs(detr - c[0]))])
            mu[j] = float(c[0])
            sd[j] = max(float(np.nan_to_num(sp[0])), self.cfg.sigma_floor)
        stream.slope, stream.t_ref, stream.t_span = slope, t_ref, float(t.max() - t.min())
        stream.mu, stream.sd, stream.active = mu, sd, active

    def _finish_warmup(self, stream: _Stream, sender: str) -> Verdict:
        warm, stream.warm = stream.warm, []
        raws = [r for _, r in warm]
        self._set_reference(stream, raws, pooled=True)
        # The warm-up spans many optimizer steps of a model that may be training fast, so one pooled centre would
        # make its first messages look like outliers. Each warm-up message is instead compared with the rolling
        # median of the messages around it (same time, mostly other senders: robust to an attacker's minority
        # share), and the spread is the MAD of those residuals, drift removed.
        feats = np.stack([self._features(stream, r) for r in raws])
        half = self.cfg.centre // 2
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: features without a value
            local = np.stack([np.nanmedian(feats[max(0, t - half): t + half + 1], axis=0)
                              for t in range(len(raws))])
        resid = feats - local
        for j in np.flatnonzero(stream.active):
            col = resid[np.isfinite(resid[:, j]), j]
            stream.sd[j] = max(1.4826 * float(np.median(np.abs(col - np.median(col)))), self.cfg.sigma_floor)
        stream.ready = True
        # Warm-up messages that stand out from their neighbours do not seed the window (an attacker present from
        # the start does not become the reference), but they earn no strikes: early in training the model changes
        # so fast between steps (measured: the mean direction of the forward coordinates turns by tens of honest
        # spreads per step in the first ~20 steps of ``tiny``) that a pooled look back cannot tell an attacker
        # from an early message. Judgement starts with the next message, against the window, with peers.
        z = np.where(np.isfinite(resid) & stream.active, np.nan_to_num(resid) / stream.sd, 0.0)
        keep = [raw for raw, zi in zip(raws, z) if np.max(np.abs(zi)) <= self.cfg.kappa]
        names = list(dict.fromkeys(r.sender for r in raws))
        if len(names) >= self.cfg.peer_min_senders:
            # With enough senders the rolling median above is message-weighted (a sender that got most of the
            # traffic sets it); instead, a sender whose median message is off the senders' common centre (set by
            # _set_reference, one vote per sender) does not seed the window, and the others' messages all do.
            self._set_reference(stream, raws, pooled=True)
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                off = {n for n in names
                       if np.any(np.abs(np.nan_to_num(np.nanmedian(feats[[r.sender == n for r in raws]], axis=0)
                                                      - stream.mu))[stream.active]
                                 > self.cfg.kappa * stream.sd[stream.active])}
            keep = [r for r in raws if r.sender not in off]
        for who, _ in warm:
            stream.senders.setdefault(who, _Sender())
            stream.accepted_at[who] = stream.n
        stream.last_accept = stream.n
        stream.window.extend(keep if len(keep) >= 3 else raws)
        stream.recent.extend(raws[-self.cfg.centre:])
        self._set_reference(stream, list(stream.window))
        return Verdict(False, sender in self._banned, 0.0, [])

    def _trusted(self, st: _Sender) -> bool:
        return st.cusum_pos is None or max(st.cusum_pos.max(), st.cusum_neg.max()) <= self.cfg.trust_cusum

    def _reanchor(self, stream: _Stream, stalled: bool = False) -> None:
        """The model moved faster than the reference: a shift every sender shares (e.g. a loss spike or the end
        of the learning-rate warm-up), not an attack by everybody. Move the reference to the latest messages,
        whatever their verdict, added to the window (the centre is a median and the drift a median of slopes, so a
        minority of odd messages barely moves them). ``stalled``: nobody's
        message was accepted for ``reanchor_after`` messages, so the statistical strikes earned since the last
        accepted one were earned against a stale reference and are forgotten."""
        stream.window.extend(r for r in stream.recent if all(r is not w for w in stream.window))
        self._set_reference(stream, list(stream.window))
        if stalled:
            for st in stream.senders.values():
                st.strikes = deque(x for x in st.strikes if not (x[2] and x[1] > stream.last_accept))
            stream.pending.clear()
        stream.last_accept = stream.n

    def _score(self, stream: _Stream, sender: str, st: _Sender, raw: _Raw, reasons: list[str]) -> Verdict:
        """Score one message against the stream's reference, strike or accept it, and update the stream."""
        cfg = self.cfg
        if stream.n - stream.last_accept > cfg.reanchor_after and len(stream.recent) >= 3:
            self._reanchor(stream, stalled=True)
        phi = self._features(stream, raw)
        known = np.isfinite(phi) & stream.active
        z = self._z(stream, raw, phi, known)
        if self._settle(stream, sender, z, raw.version, raw.tok):
            # Another sender's flag turned out to be shared by this message: the model moved, the reference is
            # stale. It was re-anchored on the latest messages; judge this one against the new reference.
            phi = self._features(stream, raw)
            known = np.isfinite(phi) & stream.active
            z = self._z(stream, raw, phi, known)
        score = float(np.max(np.abs(z)))
        names = self.feature_names
        replay = list(reasons)
        # Common mode: with enough recent senders, a feature counts as deviant only if this message also stands
        # out from what the senders sent at about the same time (the median of their latest z, this one
        # included). A shift they all share is the model training faster than the reference follows.
        recent = [s.last_z for p, s in stream.senders.items()
                  if s is not st and s.last_z is not None and not s.banned and p not in self._banned
                  and stream.n - s.last_at <= cfg.common_recent and _comparable(s.last_version, raw.version)]
        common = np.median(np.stack([z, *recent]), axis=0) if len(recent) + 1 >= cfg.peer_min_senders else None
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
        flag_reasons = [f"{names[i]} z={z[i]:+.1f}" for i in flagged]
        reasons = []
        stream.recent.append(raw)

        # Peer-relative evidence works on z, not on raw features: z is measured against the drifting reference, so
        # a shift every sender shares (the model training) cancels in the comparison with the peers, while a
        # sender that deviates from its peers at the same time keeps its offset.
        zc = np.clip(z, -cfg.kappa, cfg.kappa)
        # The spreads are robust estimates; heavy-tailed features (peaks, distances) have z with a variance above
        # 1. The peer test and the CUSUM compare sums of z, so they are scaled by the z's measured variance (never
        # below 1: a feature calmer than its estimate keeps the nominal scale), like the per-message threshold.
        # Measured on accepted messages of senders in good standing only, so an attacker cannot widen it.
        dev, peer = None, None
        alone = self._alone(stream, st, raw.version)
        st.alone_run = st.alone_run + 1 if alone else 0
        alone = alone and st.alone_run <= cfg.alone_max
        if not alone:
            # (A sender alone on its weights is not fed to the peer tests: its offset is its weights', not its own
            # doing. Its per-message flags still count, for a third of a strike each.)
            st.ema = (1 - cfg.peer_beta) * zc + (cfg.peer_beta * st.ema if st.ema is not None else 0.0)
            st.ema_n += 1
            peer = self._peer_centre(stream, st)
        if peer is not None:
            b, n = cfg.peer_beta, min(st.ema_n, 10_000)
            # sd of a bias-corrected EMA of n unit-variance z; x sqrt(2): the centre is some other sender's EMA.
            ema_sd = math.sqrt(2 * (1 - b) * (1 - b ** (2 * n)) / ((1 + b) * (1 - b**n) ** 2))
            dev = (self._unbiased(st) - peer) / (ema_sd * z_scale)
            reasons.extend(f"peer:{names[i]} d={dev[i]:+.1f}" for i in np.flatnonzero(np.abs(dev) > cfg.peer_kappa))

            # CUSUM on this message's z *relative to its peers*: small persistent offsets add up, a drift all
            # senders share does not, one outlier cannot trip it on its own. Without enough peers there is no
            # CUSUM (with two senders one cannot tell which of them is off), only the per-message test.
            u = np.clip((zc - peer) / z_scale, -cfg.kappa, cfg.kappa)
            if st.cusum_pos is None:
                st.cusum_pos, st.cusum_neg = np.zeros_like(z), np.zeros_like(z)
            st.cusum_pos = np.maximum(0.0, st.cusum_pos + u - cfg.cusum_k)
            st.cusum_neg = np.maximum(0.0, st.cusum_neg - u - cfg.cusum_k)
        alarm = []
        if st.cusum_pos is not None:
            for sign, acc in ((1, st.cusum_pos), (-1, st.cusum_neg)):
                for i in np.flatnonzero(acc > cfg.cusum_h):
                    if dev is not None and sign * dev[i] >= cfg.cusum_peer_min:
                        alarm.append(f"cusum:{names[i]}{'+' if sign > 0 else '-'}")
                    acc[i] = 0.0
        if alarm:
            reasons.extend(alarm)
            st.cusum_pos[:] = 0.0
            st.cusum_neg[:] = 0.0

        if replay or reasons:
            # Replays and peer-relative evidence (EMA test, CUSUM) are already judged against the peers: strike now.
            return self._strike(stream, sender, st, [*replay, *flag_reasons, *reasons], score,
                                weight=cfg.cusum_strikes if alarm else 1, statistical=not replay, tok=raw.tok)
        if flagged:
            # A per-message flag: the message is dropped now, but whether it is this sender's fault or a shift of
            # the whole stream (the first sender to show a common drift has no peer evidence yet) is decided by
            # the other senders' next messages.
            st.flags += 1
            others = {p for p, s in stream.senders.items()
                      if s is not st and not s.banned and p not in self._banned
                      and stream.n - s.last_at <= cfg.peer_active_window}
            if not others:  # nobody to compare with: the flag stands on its own
                return self._strike(stream, sender, st, flag_reasons, score, statistical=True, counted=True,
                                    tok=raw.tok)
            idx = np.array(flagged)
            stream.pending.append(_Pending(sender, stream.n, idx, np.sign(z[idx]), np.abs(z[idx]), flag_reasons,
                                           min(len(others), cfg.peer_min_senders - 1), raw.version, raw.tok))
            return Verdict(True, st.banned or sender in self._banned, score, flag_reasons)
        if self._trusted(st) and not alone:
            # Accepted from a sender in good standing, holding its peers' weights: only now may the message enter
            # the reference window (a sender accumulating evidence could otherwise drag the reference towards
            # itself and hide, and one on other weights would widen the honest spread).
            stream.window.append(raw)
            stream.accepted_at[sender] = stream.last_accept = stream.n
            stream.z2 = 0.98 * (np.ones_like(zc) if stream.z2 is None else stream.z2) + 0.02 * zc**2
            self._set_reference(stream, list(stream.window))
        return Verdict(False, st.banned or sender in self._banned, score, [])

    def _z(self, stream: _Stream, raw: _Raw, phi: np.ndarray, known: np.ndarray) -> np.ndarray:
        # The window's centre, moved along the fitted drift to this message's time (not beyond the window's own
        # time span: a receiver idle for long should not extrapolate a trend into the void).
        centre = stream.mu + stream.slope * float(np.clip(raw.t - stream.t_ref, -stream.t_span, stream.t_span))
        return np.where(known, (np.nan_to_num(phi) - centre) / stream.sd, 0.0)

    def _settle(self, stream: _Stream, sender: str, z: np.ndarray, version: Optional[tuple] = None,
                tok: Optional[bytes] = None) -> bool:
        """Decide the pending flags of other senders with this message's z. A flag this message shares (beyond
        kappa/2 with the same sign on the flag's strongest feature and on most of the others) was a shift of the
        whole stream: dismissed, and the reference is re-anchored (returns True), whatever the two messages'
        versions. A flag that ``need`` other senders' messages did not share, or that waited ``common_recent``
        messages, becomes a strike: its sender stood out from its peers at the same time. Not sharing counts only
        for messages of a ``_comparable`` version; a flag that none could settle before it expired weighs
        ``unconfirmed_weight`` of a strike (a full one for a sender alone on its weights beyond ``alone_max``).
        Flags on the same microbatch are left to ``_cross_check`` / ``_reproduced``."""
        cfg = self.cfg
        shared, keep = False, []
        for p in stream.pending:
            if p.sender == sender or p.sender in self._banned:
                if p.sender == sender:
                    keep.append(p)
                continue
            if tok is not None and p.tok == tok:
                keep.append(p)  # the same microbatch: ``_cross_check`` / ``_reproduced`` compare the contents
                continue
            same = (np.abs(z[p.feats]) > cfg.kappa / 2) & (np.sign(z[p.feats]) == p.sign)
            if same[int(np.argmax(p.size))] and same.sum() >= math.ceil(len(p.feats) / 2):
                # A shift this message shares on its strongest feature and on most of the others is common to the
                # stream, whatever the weights of the two: the model moved. (Live, honest flags come in sets of
                # features that move together with training, e.g. the distance of the mean vector and of the
                # channel profile, with one or two others beyond the threshold by chance.)
                shared = True
                continue
            if not _comparable(p.version, version):
                # Other weights than the flagged message's: not sharing its shift is no evidence against it.
                if stream.n - p.at <= cfg.common_recent:
                    keep.append(p)
                    continue
                st = stream.senders.get(p.sender)
                if st is not None:
                    w = 1.0 if p.others or st.alone_run > cfg.alone_max else cfg.unconfirmed_weight
                    self._strike(stream, p.sender, st, [*p.reasons, *([] if p.others else ["unconfirmed"])], 0.0,
                                 statistical=True, counted=True, weight=w, tok=p.tok)
                continue
            p.others.add(sender)
            if len(p.others) < p.need and stream.n - p.at <= cfg.common_recent:
                keep.append(p)
                continue
            st = stream.senders.get(p.sender)
            if st is not None:
                self._strike(stream, p.sender, st, p.reasons, 0.0, statistical=True, counted=True, tok=p.tok)
        stream.pending = keep
        if shared:
            stream.pending = [p for p in stream.pending if p.sender != sender]
            self._reanchor(stream)
        return shared

    def _minority_after_ban(self, stream: _Stream, sender: str) -> bool:
        """Whether banning ``sender`` keeps the senders this receiver banned on statistics alone a minority of the
        stream's active senders. Honest replicas are the majority (the premise of any comparison with peers); a
        monitor about to ban most of its senders is following a broken reference (live, early in training, one
        receiver banned every peer of the next stage), and the evidence waits for a stronger kind: a
        recomputation by another replica, a replay, a non-finite value."""
        cfg = self.cfg
        active = [p for p, s in stream.senders.items() if stream.n - s.last_seen <= cfg.peer_active_window]
        banned = sum(p in self._stat_banned for p in active if p != sender)
        return banned + 1 <= (len(active) - 1) // 2

    def _alone(self, stream: _Stream, st: _Sender, version: Optional[tuple]) -> bool:
        """Whether the sender claims weights that an active peer contradicts (same step, other fingerprint) and
        that no active peer shares."""
        cfg = self.cfg
        lasts = [s.last_version for p, s in stream.senders.items()
                 if s is not st and not s.banned and p not in self._banned and s.last_version is not None
                 and stream.n - s.last_at <= cfg.common_recent]
        return any(not _comparable(v, version) for v in lasts) and version not in lasts

    def _peer_centre(self, stream: _Stream, st: _Sender) -> Optional[np.ndarray]:
        """Median of the active senders' (bias-corrected) z EMAs; None when there are too few senders or
        messages to compare (with 2 senders one cannot say which is wrong)."""
        cfg = self.cfg
        if st.ema_n < cfg.peer_min_messages:
            return None
        peers = [
            self._unbiased(s) for p, s in stream.senders.items()
            if s.ema is not None and not s.banned and p not in self._banned and s.ema_n >= cfg.peer_min_messages
            and stream.n - s.last_seen <= cfg.peer_active_window
        ]
        if len(peers) < cfg.peer_min_senders:
            return None
        return np.median(np.stack(peers), axis=0)

    def _unbiased(self, st: _Sender) -> np.ndarray:
        return st.ema / (1 - self.cfg.peer_beta ** min(st.ema_n, 10_000))

    def _strike(self, stream: _Stream, sender: str, st: _Sender, reasons: list[str], score: float,
                hard: bool = False, weight: float = 1, statistical: bool = False, counted: bool = False,
                tok: Optional[bytes] = None) -> Verdict:
        """Record a strike; ban on ``strikes_to_ban`` within ``strike_window`` of the sender's messages.

        A statistical strike bans only if some *other* sender's message was accepted since the oldest counted
        strike: then the reference was alive and tracking honest traffic while this sender kept failing it.
        Without that, the strikes may all come from a reference the model has outrun (every sender failing it);
        they wait, and a re-anchoring forgets them. Nor does it ban beyond a minority of the active senders
        (``_minority_after_ban``). ``weight``: the share of a strike this evidence is worth.
        """
        cfg = self.cfg
        if not counted:
            st.flags += 1
        st.strikes.append((st.n, stream.n, statistical, float(weight), tok))
        st.struck.append("; ".join(reasons[:3]))
        while st.strikes and st.strikes[0][0] <= st.n - cfg.strike_window:
            st.strikes.popleft()
        alive = not statistical or max(
            (at for who, at in stream.accepted_at.items() if who != sender), default=-1) >= st.strikes[0][1]
        # A small tolerance: three thirds of a strike are a strike.
        if hard or (_weight(st) >= cfg.strikes_to_ban - 1e-9 and alive
                    and (not statistical or (stream.direction in cfg.statistical_ban_directions
                                             and self._minority_after_ban(stream, sender)))):
            st.banned = True
            self._banned.add(sender)
            if statistical and not hard:
                self._stat_banned.add(sender)
        return Verdict(True, st.banned or sender in self._banned, score, reasons)

    # ------------------------------------------------------------------ replay detection
    def _simhash(self, tensor: Tensor) -> int:
        r = _rows(tensor)
        r = r - r.mean(0)
        flat = r.reshape(-1)
        n = flat.numel()
        key = (n, self.cfg.replay_bits)
        if key not in self._hash:
            gen = torch.Generator().manual_seed(_seed(self.cfg.seed, "sentinel-replay", n))
            idx = torch.randperm(n, generator=gen)[: self.cfg.replay_sample]
            planes = torch.randn(idx.numel(), self.cfg.replay_bits, generator=gen, dtype=torch.float64)
            if len(self._hash) > 64:
                self._hash.clear()
            self._hash[key] = (idx, planes)
        idx, planes = self._hash[key]
        bits = (flat[idx] @ planes) >= 0
        return int(sum(1 << i for i, b in enumerate(bits.tolist()) if b))

    def _replay_check(self, stream: _Stream, sender: str, digest: int, tok: Optional[bytes],
                      base: np.ndarray) -> list[str]:
        """A replay is a copy: a near-identical SimHash *and* the same scalar fingerprint (rms, norm spread, peak,
        zero fraction, neighbour cosine) to 1e-3. The hash alone matched honest gradients of different
        microbatches in live runs (gradients share a strong token-independent structure); an exact re-send
        matches both."""
        reasons = []
        for other, who, other_tok, other_base in stream.digests:
            if ((digest ^ other).bit_count() <= self.cfg.replay_max_distance and (tok is None or tok != other_tok)
                    and _same_base(base, other_base)):
                reasons.append(f"replay (matches a message from {who[-8:]} on other tokens)")
                break
        stream.digests.append((digest, sender, tok, base))
        while len(stream.digests) > self.cfg.replay_memory:
            stream.digests.popleft()
        return reasons


# ---------------------------------------------------------------------- loss attribution


@dataclass(frozen=True)
class LossCheckConfig:
    warmup: int = 32
    beta: float = 0.98
    kappa: float = 6.0  # one-sided: only losses well above the reference are suspicious
    margin: int = 6  # ban when a peer's loss strikes exceed the median of its stage peers by this much ...
    rate_margin: float = 0.3  # ... and its flagged fraction of paths exceeds theirs by this much
    sigma_floor: float = 1e-3


@dataclass
class LossVerdict:
    flagged: bool
    z: float
    blamed: list[str]
    banned: list[str]


class LossMonitor:
    """Loss-based attribution, for attacks the fingerprints cannot see (e.g. sign flips of symmetric messages).

    The tail (or the trainer, from the reply's ``loss`` and ``path``) z-scores each microbatch's log-loss against
    a robust reference *before* applying its gradient. A flagged loss blames every peer on the path; peers are
    compared with the other peers serving the same stage (path position), so a peer that merely shares paths with
    an attacker is not banned: its strikes track its stage peers'. ``path_excess`` compares the mean log-loss of
    paths through a peer with paths through the other peers of its stage.

    Integration: on the tail, in ``_forward`` after computing ``loss`` (path = the ``path`` the trainer will see,
    i.e. ``meta`` would have to carry the upstream path; today only the trainer sees the whole path), or in the
    trainer after each reply: ``v = monitor.observe(reply["loss"], reply["path"])``; skip the microbatch's
    gradients when ``v.flagged`` (the trainer can only drop future work), ban ``v.banned``.
    """

    def __init__(self, config: Optional[LossCheckConfig] = None):
        self.cfg = config or LossCheckConfig()
        self._warm: list[float] = []
        self.mu = 0.0
        self.var = 0.0
        self.ready = False
        self.strikes: dict[tuple[int, str], int] = {}
        self.path_stats: dict[tuple[int, str], list[float]] = {}  # (stage, peer) -> [n, sum log-loss]
        self.banned: set[str] = set()

    def observe(self, loss: float, path: Sequence[str]) -> LossVerdict:
        cfg = self.cfg
        x = math.log(max(float(loss), 1e-12)) if math.isfinite(loss) else math.inf
        for stage, peer in enumerate(path):
            n_sum = self.path_stats.setdefault((stage, peer), [0, 0.0])
            n_sum[0] += 1
            n_sum[1] += x if math.isfinite(x) else 0.0
        if not self.ready:
            if math.isfinite(x):
                self._warm.append(x)
            if len(self._warm) >= cfg.warmup:
                self.mu = float(np.median(self._warm))
                self.var = (1.4826 * float(np.median(np.abs(np.array(self._warm) - self.mu)))) ** 2
                self.ready = True
            return LossVerdict(False, 0.0, [], [])
        z = (x - self.mu) / max(math.sqrt(self.var), cfg.sigma_floor)
        if z <= cfg.kappa:
            a = 1 - cfg.beta
            d = x - self.mu
            self.mu += a * d
            self.var = (1 - a) * (self.var + a * d * d)
            return LossVerdict(False, float(z), [], [])
        newly = []
        for stage, peer in enumerate(path):
            self.strikes[(stage, peer)] = self.strikes.get((stage, peer), 0) + 1
        for stage, peer in enumerate(path):
            peers = [p for (s, p) in self.path_stats if s == stage]
            if len(peers) < 2 or peer in self.banned:
                continue
            strikes = [self.strikes.get((stage, p), 0) for p in peers]
            rates = [self.strikes.get((stage, p), 0) / self.path_stats[(stage, p)][0] for p in peers]
            mine = self.strikes[(stage, peer)]
            rate = mine / self.path_stats[(stage, peer)][0]
            # Path mates of an attacker share its flags in proportion to their traffic; the attacker's own
            # flagged *fraction* stands out. Both margins must hold.
            if mine - float(np.median(strikes)) >= cfg.margin and rate - float(np.median(rates)) >= cfg.rate_margin:
                self.banned.add(peer)
                newly.append(peer)
        return LossVerdict(True, float(z), list(path), newly)

    def path_excess(self, stage: int, peer: str) -> float:
        """Mean log-loss of paths through ``peer`` minus that of paths through its stage peers, in sigmas."""
        mine = self.path_stats.get((stage, peer))
        rest = [v for (s, p), v in self.path_stats.items() if s == stage and p != peer]
        if not mine or not rest or mine[0] == 0:
            return 0.0
        n_rest = sum(v[0] for v in rest)
        if n_rest == 0:
            return 0.0
        diff = mine[1] / mine[0] - sum(v[1] for v in rest) / n_rest
        return diff / max(math.sqrt(self.var), self.cfg.sigma_floor)
