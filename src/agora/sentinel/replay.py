"""Replay detection: a message re-sent for another microbatch is a copy, and copies are cheap to recognise.

Each message gets a SimHash of a fixed, run-seeded sub-sample of its (centred) entries. A near-identical digest
seen recently *and* the same scalar fingerprint, on different token ids, is a replay; the same token ids is a
legitimate retry. The hash alone is not enough: live, honest gradients of different microbatches shared it.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

from agora.sentinel.config import SentinelConfig
from agora.sentinel.features import derived_seed, message_rows, same_fingerprint
from agora.sentinel.state import StreamState


class ReplayCheck:
    """SimHash digests of messages, and the per-stream memory of recent ones."""

    def __init__(self, config: SentinelConfig):
        self.cfg = config
        self._planes: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}  # (size, bits) -> (sampled entries, planes)

    def digest(self, tensor: Tensor) -> int:
        """The message's ``replay_bits``-bit SimHash."""
        r = message_rows(tensor)
        r = r - r.mean(0)
        flat = r.reshape(-1)
        n = flat.numel()
        key = (n, self.cfg.replay_bits)
        if key not in self._planes:
            gen = torch.Generator().manual_seed(derived_seed(self.cfg.seed, "sentinel-replay", n))
            idx = torch.randperm(n, generator=gen)[: self.cfg.replay_sample]
            planes = torch.randn(idx.numel(), self.cfg.replay_bits, generator=gen, dtype=torch.float64)
            if len(self._planes) > 64:
                self._planes.clear()
            self._planes[key] = (idx, planes)
        idx, planes = self._planes[key]
        bits = (flat[idx] @ planes) >= 0
        return int(sum(1 << i for i, b in enumerate(bits.tolist()) if b))

    def check(self, stream: StreamState, sender: str, digest: int, tok: Optional[bytes],
              base: np.ndarray) -> list[str]:
        """Reasons (empty or one) why the message is a replay of a recent one on other tokens; remembers it.

        ``digest``: its SimHash. ``tok``: its token digest (None: unknown). ``base``: its scalar fingerprint, which
        must match to 1e-3 too: an exact re-send matches both.
        """
        reasons = []
        for other, who, other_tok, other_base in stream.digests:
            if ((digest ^ other).bit_count() <= self.cfg.replay_max_distance and (tok is None or tok != other_tok)
                    and same_fingerprint(base, other_base)):
                reasons.append(f"replay (matches a message from {who[-8:]} on other tokens)")
                break
        stream.digests.append((digest, sender, tok, base))
        while len(stream.digests) > self.cfg.replay_memory:
            stream.digests.popleft()
        return reasons
