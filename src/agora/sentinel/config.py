"""SENTINEL's settings and its answer: what a monitor is tuned by, and what it says about one message.

``SentinelConfig`` holds every threshold and memory length (defaults follow METHODS s5's prototype, tuned on
``tiny``); ``node_config`` derives a stage node's settings from it; ``Verdict`` is what the monitor returns per
message. ``version_key`` / ``comparable_versions`` turn a sender's claimed parameter version into something the
monitor can compare: replicas holding different weights at the same step are never evidence about each other.
See ``docs/SENTINEL.md`` for how the pieces fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal, Optional, Sequence

Direction = Literal["fwd", "bwd"]

# Share of accepted messages a node has other replicas recompute where it can (``NodeOptions.audit_rate``;
# flagged ones always): gradients from the last stage, activations from the first.
AUDIT_RATE = 0.1


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


def node_config(config: Optional[SentinelConfig] = None, audited: Sequence[str] = ("fwd", "bwd")) -> SentinelConfig:
    """A node's monitor settings: in the directions it audits (has messages recomputed by other replicas),
    statistics pick suspects and audits convict.

    ``config``: the settings to start from (default ``SentinelConfig()``). ``audited``: the directions (``fwd``,
    ``bwd``) whose messages the node can have recomputed; their statistical strikes no longer ban.
    """
    config = config or SentinelConfig()
    return replace(config, statistical_ban_directions=tuple(
        d for d in config.statistical_ban_directions if d not in audited))


@dataclass
class Verdict:
    """What the monitor concluded about one message. ``flagged``: drop it. ``banned``: its sender is banned (now or
    before). ``score``: the message's largest robust |z| (0 during warm-up). ``reasons``: why, for logs."""

    flagged: bool
    banned: bool
    score: float
    reasons: list[str] = field(default_factory=list)


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


def comparable_versions(a: Optional[tuple], b: Optional[tuple]) -> bool:
    """Whether messages of versions ``a`` and ``b`` may be compared: not when both are known, of the same step, and
    with different fingerprints (replicas that diverged at that step; their messages differ for a reason that is
    no fault of either). Different steps are compared: the reference's drift fit accounts for those."""
    if a is None or b is None or a[0] != b[0] or a[1] is None or b[1] is None:
        return True
    return a[1] == b[1]
