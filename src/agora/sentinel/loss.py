"""Loss-based attribution, for attacks the message statistics cannot see (e.g. sign flips of symmetric messages).

The tail (or the trainer, from a reply's ``loss`` and ``path``) z-scores each microbatch's log-loss against a
robust reference *before* applying its gradient. A flagged loss blames every peer on the path, but a peer is
banned only when it stands out from the other peers serving the same stage, so a peer that merely shares paths
with an attacker is not. It complements the fingerprints: gradient sign flips never show in the loss of the same
microbatch (they corrupt the *upstream* update). See ``docs/SENTINEL.md`` for the measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class LossCheckConfig:
    """Settings of ``LossMonitor``."""

    warmup: int = 32  # finite losses pooled (median / MAD) before any flag
    beta: float = 0.98  # EMA decay of the reference log-loss mean and variance (un-flagged losses only)
    kappa: float = 6.0  # one-sided: only losses well above the reference are suspicious
    margin: int = 6  # ban when a peer's loss strikes exceed the median of its stage peers by this much ...
    rate_margin: float = 0.3  # ... and its flagged fraction of paths exceeds theirs by this much
    sigma_floor: float = 1e-3


@dataclass
class LossVerdict:
    """``flagged``: skip the microbatch's gradients. ``z``: its log-loss z (0 during warm-up). ``blamed``: the
    path's peers, when flagged. ``banned``: the peers newly banned by this verdict."""

    flagged: bool
    z: float
    blamed: list[str]
    banned: list[str]


class LossMonitor:
    """Per-microbatch log-loss z-scores and per-(stage, peer) blame.

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
        """Judge one microbatch's ``loss``, computed along ``path`` (the peer serving each stage, in order)."""
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
        for stage, peer in enumerate(path):
            self.strikes[(stage, peer)] = self.strikes.get((stage, peer), 0) + 1
        return LossVerdict(True, float(z), list(path), self._blame(path))

    def _blame(self, path: Sequence[str]) -> list[str]:
        """Ban (and return) the path's peers whose strikes and flagged fraction stand out from their stage peers'.
        Path mates of an attacker share its flags in proportion to their traffic; the attacker's own flagged
        *fraction* stands out. Both margins must hold."""
        cfg = self.cfg
        newly = []
        for stage, peer in enumerate(path):
            peers = [p for (s, p) in self.path_stats if s == stage]
            if len(peers) < 2 or peer in self.banned:
                continue
            strikes = [self.strikes.get((stage, p), 0) for p in peers]
            rates = [self.strikes.get((stage, p), 0) / self.path_stats[(stage, p)][0] for p in peers]
            mine = self.strikes[(stage, peer)]
            rate = mine / self.path_stats[(stage, peer)][0]
            if mine - float(np.median(strikes)) >= cfg.margin and rate - float(np.median(rates)) >= cfg.rate_margin:
                self.banned.add(peer)
                newly.append(peer)
        return newly

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
