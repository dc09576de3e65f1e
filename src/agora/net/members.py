"""Who may call a stage in an allow-listed run: the peers holding a certified record of it in the DHT.

The DHT's validators (``agora.trust.credentials.record_validators``) already dropped every record without a valid
signature and certificate, so holding a live record of this run is membership.
"""

from __future__ import annotations

import time

from agora.config import Manifest
from agora.net.records import read_subkeys, stage_key, trainers_key

MEMBER_TTL_S = 30.0  # a caller seen in the run's records stays authorised this long after its record was last seen
REFRESH_MIN_S = 1.0  # an unknown caller triggers at most one DHT read per second


class RunMembers:
    """Which peer ids hold a (validated, hence in an allow-listed run certified) record of the run.

    Reads go through the DHT, whose validators dropped every record without a valid signature and certificate. A
    lookup of an unknown caller refreshes at most every ``REFRESH_MIN_S``, so a flood of calls from an outsider
    costs one DHT read per second, not one per call.
    """

    def __init__(self, manifest: Manifest, refresh_min_s: float = REFRESH_MIN_S, ttl_s: float = MEMBER_TTL_S):
        self.manifest = manifest
        self.refresh_min_s = refresh_min_s
        self.ttl_s = ttl_s
        self._seen: dict[str, float] = {}
        self._refreshed_at = 0.0

    def refresh(self, dht) -> None:
        """(io thread) Re-read the run's stage and trainer records."""
        now = time.monotonic()
        self._refreshed_at = now
        keys = [stage_key(self.manifest.run_id, s) for s in range(self.manifest.n_stages)]
        keys.append(trainers_key(self.manifest.run_id))
        for key in keys:
            for peer, value in read_subkeys(dht, key).items():
                if isinstance(value, dict) and value.get("manifest_hash") == self.manifest.hash:
                    self._seen[peer] = now

    def known(self, peer_id: str) -> bool:
        seen = self._seen.get(peer_id)
        return seen is not None and time.monotonic() - seen < self.ttl_s

    def should_refresh(self) -> bool:
        return time.monotonic() - self._refreshed_at >= self.refresh_min_s
