"""Who may download this stage's state (``get_state``): the front door to the model's weights.

A stage's parameters and optimizer moments go only to (1) a peer whose own signed record announces it as a replica
of *this* stage (joining, syncing, or serving and repairing), that holds no other stage now and held none within
``security.state_access.period_s``, at most ``downloads_per_period`` new downloads per identity and server; or
(2) an identity the manifest lists in ``security.state_access.readers`` (the run's operators). Everyone else gets
``unauthorized``. "Held" is witnessed, not self-declared: every node writes to the run's *state ledger* (one DHT key,
one owner-signed subkey per witness) the replicas it sees serving its stage and the downloads it granted, each with
a time; a peer that served stage A a minute ago cannot take stage B now. docs/TRUST.md says what this does not stop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Optional

from agora.config import Manifest
from agora.net.records import PeerState, announce, read_subkeys, read_swarm
from agora.net.transport import RpcError
from agora.trust.ratelimit import RateLimiter

logger = logging.getLogger("agora.node")

SETTLE_S = 1.0  # after writing a grant, wait this long and check again: two servers granting at once both see it
HOLDING_STATES = (PeerState.JOINING.value, PeerState.SYNCING.value, PeerState.SERVING.value)


def ledger_key(run_id: str) -> str:
    """DHT key of the run's state ledger: one subkey per witness, ``{"holders": {peer: [stage, unix time]}}``."""
    return f"{run_id}_state_ledger"


def read_ledger(dht, manifest: Manifest) -> dict[str, list[tuple[int, float]]]:
    """(io thread) Every witnessed holding of the run: {peer id: [(stage, unix time), ...]}. Malformed entries are
    skipped (a witness writes only its own subkey, so one liar cannot erase what the others saw)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for value in read_subkeys(dht, ledger_key(manifest.run_id)).values():
        if not isinstance(value, dict) or value.get("manifest_hash") != manifest.hash:
            continue
        holders = value.get("holders")
        if not isinstance(holders, dict):
            continue
        for peer, entry in holders.items():
            if (isinstance(peer, str) and isinstance(entry, (list, tuple)) and len(entry) == 2
                    and isinstance(entry[0], int) and isinstance(entry[1], (int, float))):
                out.setdefault(peer, []).append((int(entry[0]), float(entry[1])))
    return out


class StateAccess:
    """One node's state-download policy and its witness subkey of the state ledger.

    :param manifest: the run (its ``security.state_access`` section)
    :param peer_id: this node's peer id (its ledger subkey)
    :param dht: the node's DHT (owner-signed writes)
    :param run_io: runs a blocking DHT call off the event loop
    :param clock: unix time (tests pass a fake); ledger times are compared across machines, so it is wall time
    """

    def __init__(self, manifest: Manifest, peer_id: str, dht: Any, run_io: Callable[..., Awaitable[Any]],
                 clock: Callable[[], float] = time.time):
        self.manifest, self.peer_id, self.dht, self.run_io, self.clock = manifest, peer_id, dht, run_io, clock
        self.config = manifest.security.state_access
        self.readers = frozenset(self.config.readers)
        self.period_s = self.config.period_s
        self.limiter = RateLimiter(rate=self.config.downloads_per_period / self.period_s,
                                   burst=self.config.downloads_per_period)
        self._witnessed: dict[str, tuple[int, float]] = {}  # peer -> (stage, last seen holding it), ours to publish
        self.granted = 0
        self.granted_readers = 0

    # ------------------------------------------------------------------ the ledger
    def note(self, peer: str, stage: int) -> None:
        """Remember that ``peer`` holds ``stage`` now (a replica seen serving, or a download granted)."""
        self._witnessed[peer] = (stage, self.clock())

    async def publish(self) -> None:
        """Write our witness subkey (entries of the last period only); it expires a period after the last write."""
        now = self.clock()
        self._witnessed = {p: e for p, e in self._witnessed.items() if now - e[1] < self.period_s}
        value = {"manifest_hash": self.manifest.hash,
                 "holders": {p: [stage, at] for p, (stage, at) in self._witnessed.items()}}
        await self.run_io(announce, self.dht, ledger_key(self.manifest.run_id), self.peer_id, value,
                          self.period_s + 5.0)

    async def witness(self, stage: int, serving: list[str]) -> None:
        """The replicas serving ``stage`` right now (ourselves included): noted and published."""
        for peer in serving:
            self.note(peer, stage)
        await self.publish()

    # ------------------------------------------------------------------ the decision
    async def admit_download(self, caller: str, stage: int) -> str:
        """Allow a new download of ``stage`` by ``caller`` or raise ``RpcError("unauthorized" | "rate_limited")``.
        Returns how it was allowed: ``"reader"`` or ``"replica"``."""
        if caller in self.readers:
            self.granted_readers += 1
            logger.info(f"stage {stage}: state download by {caller[-8:]}, a reader named in the manifest")
            return "reader"
        if not self.limiter.allow(caller):
            raise RpcError("rate_limited", f"more than {self.config.downloads_per_period} state downloads from "
                                           f"{caller} in {self.period_s:.0f}s")
        await self._check_replica(caller, stage, retry_records=True)
        self.note(caller, stage)
        await self.publish()
        # A concurrent grant of another stage (another server, the same instant) lands meanwhile: both then refuse.
        await asyncio.sleep(SETTLE_S)
        await self._check_replica(caller, stage, retry_records=False)
        self.granted += 1
        return "replica"

    async def _check_replica(self, caller: str, stage: int, retry_records: bool) -> None:
        m = self.manifest
        swarm = await self.run_io(read_swarm, self.dht, m.run_id, m.n_stages, m.hash)
        mine = [r for r in swarm[stage] if r.peer_id == caller]
        if retry_records and not any(r.state in HOLDING_STATES for r in mine):
            await asyncio.sleep(SETTLE_S)  # a joiner announces right before it asks: its record may be in flight
            swarm = await self.run_io(read_swarm, self.dht, m.run_id, m.n_stages, m.hash)
            mine = [r for r in swarm[stage] if r.peer_id == caller]
        if not any(r.state in HOLDING_STATES for r in mine):
            raise RpcError("unauthorized", f"peer {caller} does not announce itself as a replica of stage {stage} "
                                           f"(joining, syncing or serving): stage state goes only to its replicas")
        elsewhere = sorted({s for s, recs in enumerate(swarm) if s != stage
                            for r in recs if r.peer_id == caller and r.state in HOLDING_STATES})
        if elsewhere:
            raise RpcError("unauthorized", f"peer {caller} also announces stage {elsewhere[0]}: one identity holds "
                                           f"one stage")
        held = self._held_elsewhere(await self.run_io(read_ledger, self.dht, m), caller, stage)
        if held is not None:
            other, at = held
            wait = self.period_s - (self.clock() - at)
            raise RpcError("unauthorized", f"peer {caller} held stage {other} {self.clock() - at:.0f}s ago: one "
                                           f"identity gets one stage per {self.period_s:.0f}s "
                                           f"(security.state_access.period_s); retry in {max(wait, 0.0):.0f}s")

    def _held_elsewhere(self, ledger: dict[str, list[tuple[int, float]]], caller: str,
                        stage: int) -> Optional[tuple[int, float]]:
        """The latest holding of another stage by ``caller`` within the period, or None."""
        now = self.clock()
        entries = [*ledger.get(caller, []), *([self._witnessed[caller]] if caller in self._witnessed else [])]
        recent = [(s, at) for s, at in entries if s != stage and now - at < self.period_s]
        return max(recent, key=lambda e: e[1]) if recent else None

    async def own_wait(self, stage: int) -> float:
        """Seconds until this node's own identity may get ``stage``'s state: a restarted peer that served another
        stage within the period (the ledger remembers it) waits instead of being refused."""
        ledger = await self.run_io(read_ledger, self.dht, self.manifest)
        held = self._held_elsewhere(ledger, self.peer_id, stage)
        return self.wait_after_leaving(held[1]) if held is not None else 0.0

    def wait_after_leaving(self, left_at: float) -> float:
        """Seconds a peer that stopped holding a stage at unix time ``left_at`` waits before another stage's
        servers grant it state: a period after the last witness saw it, plus a witness's write interval."""
        return max(0.0, left_at + self.period_s + SETTLE_S + 1.0 - self.clock())

    def summary(self) -> dict[str, Any]:
        return {"state_downloads_granted": self.granted, "state_downloads_readers": self.granted_readers}
