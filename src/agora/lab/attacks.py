"""Deliberate misbehaviour, for tests and benchmarks of the defences (``agora node --attack KIND[:strength]``).

A spec is ``KIND[:strength][@fwd|@bwd|@both][,after=N]``, e.g. ``scale:4@bwd`` or ``bias:0.5@fwd,after=300``.
Kinds (``ATTACK_KINDS``): ``gaussian``, ``sign_flip``, ``scale``, ``zero``, ``bias``, ``replay``, ``stale``,
``nan``, and the kinds SENTINEL was not designed around (``HELD_OUT_KINDS``, evaluated apart): ``rotate``,
``evade``, ``sub_tolerance``. ``DEFAULT_STRENGTH`` holds the default strengths. ``@fwd`` corrupts the forward
boundaries a stage sends, ``@bwd`` the gradients it returns upstream, ``@both`` (the default) both. ``after=N``
sends the first N messages of each direction unchanged (a sleeper: it earns trust, then attacks).

``install_attack(node, spec)`` registers an output filter through the node's public hook
(``StageNode.add_output_filter``), so other nodes in the same process are unaffected; ``agora node --attack``
installs it right after building the node, before any work arrives. What each kind does and what its strength
means: docs/ATTACKS.md.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from agora.sentinel import SentinelConfig, fingerprint

logger = logging.getLogger("agora.attacks")

HELD_OUT_KINDS = ("rotate", "evade", "sub_tolerance")
ATTACK_KINDS = ("gaussian", "sign_flip", "scale", "zero", "bias", "replay", "stale", "nan", *HELD_OUT_KINDS)
DEFAULT_STRENGTH = {"gaussian": 0.5, "sign_flip": 1.0, "scale": 4.0, "zero": 1.0, "bias": 0.5, "replay": 1.0,
                    "stale": 1.0, "nan": 1.0, "rotate": 0.1, "evade": 0.8, "sub_tolerance": 0.9}
TARGETS = ("fwd", "bwd", "both")
# ``evade`` learns the spread of its own honest statistics from this many messages before it perturbs anything.
EVADE_MIN_HISTORY = 8


class AttackSpecError(ValueError):
    """An ``--attack`` string that cannot be used; the message says what would work."""


@dataclass(frozen=True)
class AttackSpec:
    kind: str
    strength: float
    target: str = "both"
    seed: int = 0
    after: int = 0  # messages per direction sent unchanged before the attack starts

    def __str__(self) -> str:
        return f"{self.kind}:{self.strength:g}@{self.target}" + (f",after={self.after}" if self.after else "")


def parse_attack(text: str) -> AttackSpec:
    """``KIND[:strength][@fwd|bwd|both][,after=N]`` -> AttackSpec, e.g. ``"scale:4"``, ``"gaussian:0.5@bwd"``,
    ``"nan"``, ``"bias:0.5,after=300"``."""
    raw, _, options = text.strip().partition(",")
    after = _parse_after(text, options)
    target = "both"
    if "@" in raw:
        raw, target = raw.rsplit("@", 1)
        if target not in TARGETS:
            raise AttackSpecError(f"attack {text!r}: target must be one of {TARGETS}, got {target!r}")
    kind, _, value = raw.partition(":")
    kind = kind.strip().lower().replace("-", "_")
    if kind not in ATTACK_KINDS:
        raise AttackSpecError(f"unknown attack kind {kind!r} in {text!r}; known kinds: {', '.join(ATTACK_KINDS)}")
    try:
        strength = float(value) if value.strip() else DEFAULT_STRENGTH[kind]
    except ValueError:
        raise AttackSpecError(f"attack {text!r}: strength {value!r} is not a number") from None
    if not math.isfinite(strength):
        raise AttackSpecError(f"attack {text!r}: strength must be finite")
    if kind in ("sign_flip", "zero", "nan") and not 0 < strength <= 1:
        raise AttackSpecError(f"attack {text!r}: {kind} strength is a fraction in (0, 1]")
    if kind in ("gaussian", "rotate") and strength < 0:
        raise AttackSpecError(f"attack {text!r}: {kind} strength must be >= 0")
    if kind in ("evade", "sub_tolerance") and strength <= 0:
        raise AttackSpecError(f"attack {text!r}: {kind} strength is a fraction of a threshold, > 0")
    if kind in ("replay", "stale") and (strength < 1 or strength != int(strength)):
        raise AttackSpecError(f"attack {text!r}: {kind} strength is how many messages back (an integer >= 1)")
    return AttackSpec(kind, strength, target, after=after)


def _parse_after(text: str, options: str) -> int:
    if not options.strip():
        return 0
    key, _, value = options.partition("=")
    if key.strip() != "after" or not value.strip().isdigit():
        raise AttackSpecError(f"attack {text!r}: the only option is ',after=N' (N messages sent unchanged first)")
    return int(value)


@dataclass
class AttackState:
    """What an attack remembers between messages: messages sent (replay), real messages computed and never sent
    (stale), fixed bias directions, and the statistics of its own honest messages (evade)."""

    sent: dict = field(default_factory=dict)  # shape -> deque of messages sent (replay)
    unsent: dict = field(default_factory=dict)  # shape -> deque of real messages never sent, oldest first (stale)
    bias_dirs: dict = field(default_factory=dict)  # width -> unit-rms direction
    honest_stats: dict = field(default_factory=dict)  # shape -> deque of statistics of its honest messages (evade)
    max_history: int = 16
    applied: int = 0

    def remember(self, tensor: Tensor) -> None:
        """Record a message sent without corruption (so a replay attack started later has history)."""
        key = tuple(tensor.shape)
        self.sent.setdefault(key, deque(maxlen=self.max_history)).append(tensor.detach().float().clone())

    def spare(self, tensor: Tensor) -> None:
        """Record a real message this peer computed and never sent (e.g. of data of its own): what a stale attack
        sends first. Without spares it starts with the current microbatch's sequences in another order."""
        self.unsent.setdefault(tuple(tensor.shape), deque()).append(tensor.detach().float().clone())


def _rms(x: Tensor) -> Tensor:
    return x.float().pow(2).mean().sqrt()


def _token_mask(x: Tensor, fraction: float, rng: torch.Generator) -> Tensor:
    """Boolean mask over x's tokens (all dims but the last), broadcastable to x; exactly round(fraction * n)."""
    lead = x.shape[:-1] if x.dim() >= 2 else x.shape
    n = math.prod(lead) if len(lead) else 1
    count = max(1, int(round(fraction * n)))
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.randperm(n, generator=rng)[:count]] = True
    mask = mask.reshape(lead) if len(lead) else mask.reshape(())
    return mask.unsqueeze(-1) if x.dim() >= 2 else mask


def _bias_direction(x: Tensor, rng: torch.Generator, state: AttackState) -> Tensor:
    """A fixed random direction of unit rms per message width (kept in ``state``: a persistent shift)."""
    width = x.shape[-1] if x.dim() else 1
    if width not in state.bias_dirs:
        d = torch.randn(width, generator=rng)
        state.bias_dirs[width] = d / d.pow(2).mean().sqrt()
    return state.bias_dirs[width]


def _rotation(k: int, angle: float, rng: torch.Generator) -> Tensor:
    """A random rotation of R^k by at most ``angle`` radians: exp of a random skew-symmetric matrix scaled so
    that its largest rotation angle is ``angle``."""
    g = torch.randn(k, k, generator=rng, dtype=torch.float64)
    a = g - g.T
    return torch.linalg.matrix_exp(a * (angle / float(torch.linalg.matrix_norm(a, ord=2)))).float()


def _stale(x: Tensor, lag: int, state: AttackState) -> Tensor:
    """The real message of the microbatch ``lag`` messages back, from messages computed and never sent: a stale
    message is new content (no replay check matches it) that every statistic finds honest."""
    bank = state.unsent.setdefault(tuple(x.shape), deque())
    bank.append(x.clone())  # this microbatch's real message: computed, not sent now
    if len(bank) > lag:
        return bank.popleft().clone()
    # Nothing unsent yet: the microbatch's own sequences, each given its neighbour's real output. Every row is a
    # computed output and the message as a whole was never sent; with one sequence there is nothing to swap.
    if x.dim() >= 3 and x.shape[0] >= 2:
        return torch.roll(x, 1, dims=0)
    return x.clone()


def _statistics(x: Tensor) -> np.ndarray:
    """What ``evade`` keeps under the thresholds: SENTINEL's state-free statistics of the message."""
    s = fingerprint(x)
    return np.concatenate([s.base, s.mean, s.skew, s.profile])


def _evade(x: Tensor, margin: float, rng: torch.Generator, state: AttackState) -> Tensor:
    """A white-box attacker: the largest persistent shift (``bias``'s direction) whose statistics stay within
    ``margin`` x SENTINEL's per-message threshold of what its own honest messages look like (centre: the median
    of the latest 8, spread: successive differences, as the monitor measures them). Features already beyond the
    bound by honest chance are not made worse."""
    key = tuple(x.shape)
    history = state.honest_stats.get(key)
    if history is None:  # start from what it sent while behaving
        history = state.honest_stats[key] = deque((_statistics(m) for m in state.sent.get(key, ())), maxlen=32)
    fx = _statistics(x)
    past = np.array(history) if history else np.empty((0, fx.shape[0]))
    history.append(fx)
    if len(past) < EVADE_MIN_HISTORY:
        return x.clone()
    cfg = SentinelConfig()
    centre = np.median(past[-cfg.centre:], axis=0)
    sd = np.maximum(1.4826 * np.median(np.abs(np.diff(past, axis=0)), axis=0) / math.sqrt(2), cfg.sigma_floor)
    limit = np.maximum(margin * cfg.kappa, np.abs(fx - centre) / sd)
    shift = _rms(x) * _bias_direction(x, rng, state)

    def under(a: float) -> bool:
        return bool(np.all(np.abs(_statistics(x + a * shift) - centre) / sd <= limit))

    lo, hi = 0.0, 2.0
    if under(hi):
        return x + hi * shift
    for _ in range(10):  # bisection to ~0.1 % of the largest shift tried
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if under(mid) else (lo, mid)
    return x + lo * shift


def apply_attack(kind: str, strength: float, tensor: Tensor, rng: torch.Generator, state: AttackState) -> Tensor:
    """The corrupted version of ``tensor`` (a new tensor of the same shape and dtype; the input is not modified)."""
    if kind not in ATTACK_KINDS:
        raise AttackSpecError(f"unknown attack kind {kind!r}; known kinds: {', '.join(ATTACK_KINDS)}")
    dtype = tensor.dtype
    x = tensor.detach().float()
    state.applied += 1
    if kind == "gaussian":
        out = x + strength * _rms(x) * torch.randn(x.shape, generator=rng)
    elif kind == "sign_flip":
        out = torch.where(_token_mask(x, strength, rng), -x, x) if strength < 1 else -x
    elif kind == "scale":
        out = x * strength
    elif kind == "zero":
        zeros = torch.zeros_like(x)
        out = torch.where(_token_mask(x, strength, rng), zeros, x) if strength < 1 else zeros
    elif kind == "bias":
        out = x + strength * _rms(x) * _bias_direction(x, rng, state)
    elif kind == "replay":
        sent = state.sent.setdefault(tuple(x.shape), deque(maxlen=state.max_history))
        lag = int(strength)
        out = sent[-lag].clone() if len(sent) >= lag else x.clone()
        sent.append(out.clone())
    elif kind == "stale":
        out = _stale(x, int(strength), state)
    elif kind == "rotate":
        k = x.shape[-1] if x.dim() else 1
        out = x @ _rotation(k, strength, rng) if k >= 2 and strength > 0 else x.clone()
    elif kind == "evade":
        out = _evade(x, strength, rng, state)
    elif kind == "sub_tolerance":
        # A persistent shift of relative size ``strength`` x the audit tolerance: an audit must call it rounding.
        u = _bias_direction(x, rng, state).expand_as(x)
        out = x + strength * SentinelConfig().audit_tolerance * x.norm() / u.norm() * u
    else:  # nan
        out = x.clone().reshape(-1)
        n = out.numel()
        count = max(1, int(round(strength * n)))
        out[torch.randperm(n, generator=rng)[:count]] = float("nan")
        out = out.reshape(x.shape)
    return out.to(dtype)


def attack_filter(spec: "str | AttackSpec"):
    """The output filter ``(direction, tensor) -> tensor`` that corrupts what ``spec`` targets (seeded per
    direction, so a run is reproducible), after ``spec.after`` unchanged messages per direction."""
    spec = parse_attack(spec) if isinstance(spec, str) else spec
    generators = {"fwd": torch.Generator().manual_seed(spec.seed * 2 + 1),
                  "bwd": torch.Generator().manual_seed(spec.seed * 2 + 2)}
    states = {"fwd": AttackState(), "bwd": AttackState()}
    seen = {"fwd": 0, "bwd": 0}
    targets = ("fwd", "bwd") if spec.target == "both" else (spec.target,)

    def corrupt(direction: str, tensor: Tensor) -> Tensor:
        if direction not in targets:
            return tensor
        seen[direction] += 1
        if seen[direction] <= spec.after:
            states[direction].remember(tensor)  # replay, stale and evade draw on what it sent while behaving
            return tensor
        return apply_attack(spec.kind, spec.strength, tensor, generators[direction], states[direction])

    return corrupt


def install_attack(node: Any, spec: "str | AttackSpec") -> AttackSpec:
    """Make ``node`` corrupt what it sends, through its ``add_output_filter`` hook. Returns the spec."""
    spec = parse_attack(spec) if isinstance(spec, str) else spec
    node.add_output_filter(attack_filter(spec))
    node.attack = spec
    node.log_event("attack_installed", attack=str(spec))
    if (spec.target == "fwd" and node.is_tail) or (spec.target == "bwd" and node.is_head):
        logger.warning(f"attack {spec} has no effect on this stage (the head returns no gradient, the tail "
                       f"sends no forward boundary)")
    logger.warning(f"ATTACK INSTALLED: this node will corrupt its outgoing messages ({spec})")
    return spec
