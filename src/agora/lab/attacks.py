"""Deliberate misbehaviour, for tests and benchmarks of the defences (``agora node --attack KIND[:strength]``).

A spec is ``KIND[:strength][@fwd|@bwd|@both]``, e.g. ``scale:4@bwd``. Kinds (``ATTACK_KINDS``): ``gaussian``,
``sign_flip``, ``scale``, ``zero``, ``bias``, ``replay``, ``stale``, ``nan``; ``DEFAULT_STRENGTH`` holds the
default strengths. ``@fwd`` corrupts the forward boundaries a stage sends, ``@bwd`` the gradients it returns
upstream, ``@both`` (the default) both.

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

import torch
from torch import Tensor

logger = logging.getLogger("agora.attacks")

ATTACK_KINDS = ("gaussian", "sign_flip", "scale", "zero", "bias", "replay", "stale", "nan")
DEFAULT_STRENGTH = {"gaussian": 0.5, "sign_flip": 1.0, "scale": 4.0, "zero": 1.0, "bias": 0.5, "replay": 1.0,
                    "stale": 1.0, "nan": 1.0}
TARGETS = ("fwd", "bwd", "both")


class AttackSpecError(ValueError):
    """An ``--attack`` string that cannot be used; the message says what would work."""


@dataclass(frozen=True)
class AttackSpec:
    kind: str
    strength: float
    target: str = "both"
    seed: int = 0

    def __str__(self) -> str:
        return f"{self.kind}:{self.strength:g}@{self.target}"


def parse_attack(text: str) -> AttackSpec:
    """``KIND[:strength][@fwd|bwd|both]`` -> AttackSpec, e.g. ``"scale:4"``, ``"gaussian:0.5@bwd"``, ``"nan"``."""
    raw = text.strip()
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
    if kind == "gaussian" and strength < 0:
        raise AttackSpecError(f"attack {text!r}: gaussian strength (noise std / rms) must be >= 0")
    if kind in ("replay", "stale") and (strength < 1 or strength != int(strength)):
        raise AttackSpecError(f"attack {text!r}: {kind} strength is how many messages back (an integer >= 1)")
    return AttackSpec(kind, strength, target)


@dataclass
class AttackState:
    """What an attack remembers between messages: past messages (replay, stale) and fixed bias directions."""

    sent: dict = field(default_factory=dict)  # shape -> deque of messages sent (replay)
    clean: dict = field(default_factory=dict)  # shape -> deque of real messages computed (stale)
    bias_dirs: dict = field(default_factory=dict)  # width -> unit-rms direction
    max_history: int = 16
    applied: int = 0

    def remember(self, tensor: Tensor) -> None:
        """Record a message sent without corruption (so a replay attack started later has history)."""
        key = tuple(tensor.shape)
        for store in (self.sent, self.clean):
            store.setdefault(key, deque(maxlen=self.max_history)).append(tensor.detach().float().clone())


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
        width = x.shape[-1] if x.dim() else 1
        if width not in state.bias_dirs:
            d = torch.randn(width, generator=rng)
            state.bias_dirs[width] = d / d.pow(2).mean().sqrt()
        out = x + strength * _rms(x) * state.bias_dirs[width]
    elif kind in ("replay", "stale"):
        key = tuple(x.shape)
        sent = state.sent.setdefault(key, deque(maxlen=state.max_history))
        clean = state.clean.setdefault(key, deque(maxlen=state.max_history))
        past = sent if kind == "replay" else clean
        lag = int(strength)
        out = past[-lag].clone() if len(past) >= lag else x.clone()
        clean.append(x.clone())
        sent.append(out.clone())
    else:  # nan
        out = x.clone().reshape(-1)
        n = out.numel()
        count = max(1, int(round(strength * n)))
        out[torch.randperm(n, generator=rng)[:count]] = float("nan")
        out = out.reshape(x.shape)
    return out.to(dtype)


def attack_filter(spec: "str | AttackSpec"):
    """The output filter ``(direction, tensor) -> tensor`` that corrupts what ``spec`` targets (seeded per
    direction, so a run is reproducible)."""
    spec = parse_attack(spec) if isinstance(spec, str) else spec
    generators = {"fwd": torch.Generator().manual_seed(spec.seed * 2 + 1),
                  "bwd": torch.Generator().manual_seed(spec.seed * 2 + 2)}
    states = {"fwd": AttackState(), "bwd": AttackState()}
    targets = ("fwd", "bwd") if spec.target == "both" else (spec.target,)

    def corrupt(direction: str, tensor: Tensor) -> Tensor:
        if direction not in targets:
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
