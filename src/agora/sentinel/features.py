"""What SENTINEL measures on one message: scale-free statistics that need no state (pure functions).

``fingerprint`` reduces a message (flattened to tokens x channels) to a ``MessageStats``: five scalar features
(``BASE_FEATURES``) and three per-channel vectors (``VECTORS``). ``reference_features`` adds the features that
are measured against a stream's reference (``TAIL_FEATURES``) and the projections of the mean vector on a few
fixed random directions (``random_directions``). Why these features and what each one catches: ``docs/SENTINEL.md``.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import Tensor

BASE_FEATURES = ("log_rms", "norm_cv", "log_peak", "zero_frac", "adj_cos")
TAIL_FEATURES = ("mean_ref", "skew_ref", "mean_dist", "profile_dist", "pair_align")
VECTORS = ("mean", "skew", "profile")  # per-channel statistics with a reference mean / variance per channel


def feature_names(n_projections: int) -> tuple[str, ...]:
    """The names of ``reference_features``' entries, in order."""
    return BASE_FEATURES + tuple(f"mean_proj{i}" for i in range(n_projections)) + TAIL_FEATURES


@dataclass
class MessageStats:
    """Per-message statistics that do not depend on the monitor's state, and where the message came from."""

    base: np.ndarray  # BASE_FEATURES
    mean: np.ndarray  # [k] mean vector / rms
    skew: np.ndarray  # [k] per-channel skewness
    profile: np.ndarray  # [k] per-channel rms / rms
    pair_align: float
    t: float = 0.0  # when it was received: the receiver's optimizer step, else the stream's message index
    sender: str = ""
    version: Optional[tuple] = None  # the sender's claimed parameter version (step, fingerprint), if it sent one
    tok: Optional[bytes] = None  # digest of the microbatch's token ids, if given


def derived_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` (e.g. the run seed, a purpose, a size): the same on every receiver."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


def token_digest(tokens: Tensor) -> bytes:
    """A digest of a microbatch's token ids: tells a retry of one microbatch from a replay on another."""
    return hashlib.blake2b(tokens.detach().cpu().to(torch.int64).numpy().tobytes(), digest_size=16).digest()


def same_fingerprint(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two scalar fingerprints are one message's (identical content, up to rounding)."""
    return bool(np.allclose(a, b, rtol=1e-3, atol=1e-3))


def relative_difference(x: Tensor, y: Tensor) -> float:
    """||x - y|| / ||y|| in float64; inf when either holds a non-finite value."""
    x, y = x.detach().double(), y.detach().double()
    if not (bool(torch.isfinite(x).all()) and bool(torch.isfinite(y).all())):
        return math.inf
    return float((x - y).norm() / (y.norm() + 1e-30))


def message_rows(x: Tensor) -> Tensor:
    """The message as float64 rows of channels: [tokens, k] (a scalar or a vector becomes one column)."""
    x = x.detach().to(torch.float64)
    if x.dim() == 0:
        return x.reshape(1, 1)
    return x.reshape(-1, x.shape[-1]) if x.dim() >= 2 else x.reshape(-1, 1)


def fingerprint(x: Tensor, paired: Optional[Tensor] = None) -> MessageStats:
    """State-free statistics of one (finite) message: what ``observe`` z-scores, minus the reference projections.

    ``x``: the message, [..., T, k]. ``paired``: for a gradient, the forward coordinates the receiver sent for the
    same microbatch (same shape); gives ``pair_align``, else NaN.
    """
    r = message_rows(x)
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
        p = message_rows(paired)
        align = float(torch.nn.functional.cosine_similarity(r, p, dim=1, eps=1e-30).mean())
    return MessageStats(base, (mean / (rms + eps)).numpy(), skew.numpy(), profile.numpy(), align)


def random_directions(seed: int, count: int, k: int) -> np.ndarray:
    """``count`` random unit directions in R^k, [count, k], drawn from the run ``seed``: every receiver of a run
    projects on the same ones."""
    gen = torch.Generator().manual_seed(derived_seed(seed, "sentinel-proj", k))
    p = torch.randn(count, k, generator=gen, dtype=torch.float64)
    return (p / p.norm(dim=1, keepdim=True)).numpy()


def reference_features(raw: MessageStats, projections: np.ndarray, vec_mu: dict, vec_var: dict,
                       sigma_floor: float) -> np.ndarray:
    """The full feature vector of ``raw`` (names: ``feature_names``) against a stream's per-channel references.

    ``vec_mu`` / ``vec_var``: per ``VECTORS`` name, the reference's per-channel centre and squared spread.
    """
    floor = sigma_floor**2

    def unit(v: np.ndarray) -> np.ndarray:
        return v / (np.linalg.norm(v) + 1e-30)

    def dist(name: str, v: np.ndarray) -> float:
        return float(np.sqrt(np.mean((v - vec_mu[name]) ** 2 / (vec_var[name] + floor))))

    tail = [
        float(raw.mean @ unit(vec_mu["mean"])),
        float(raw.skew @ unit(vec_mu["skew"])),
        dist("mean", raw.mean),
        dist("profile", raw.profile),
        raw.pair_align,
    ]
    return np.concatenate([raw.base, projections @ raw.mean, np.array(tail)])
