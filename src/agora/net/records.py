"""What peers announce in the DHT, and how to read it back.

One DHT key per (run, stage) with one subkey per peer, so records expire independently: a crashed peer vanishes
when its record's short expiry passes, without anyone deleting it. Values are small dicts (a few hundred bytes).
Every record carries the manifest hash; readers drop records of another manifest, so two runs (or a stale
manifest) that share a DHT never mix.

Ownership: a DHT made for a run (``agora.net.dht.make_dht`` with a manifest) has the peer's signing key bound to
it (``bind_owner_key``). ``announce`` then writes under ``owner_subkey(peer_id, key)``, which hivemind's
``RSASignatureValidator`` only accepts with that key's signature, and ``agora.trust.identity`` checks that the
peer id is the key's own. Readers get plain peer ids back (``read_subkeys`` strips the owner marker).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
import weakref
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Callable, Optional, Sequence

import numpy as np
from hivemind import DHT
from hivemind.utils import get_dht_time

from agora.trust.identity import owner_subkey, subkey_peer_id

logger = logging.getLogger("agora.records")

RECORD_TTL_S = 8.0  # a record lives this long unless refreshed; ~3x the announce period
ANNOUNCE_PERIOD_S = 2.5


class PeerState(str, Enum):
    """Lifecycle of a stage peer. Only ``serving`` peers get routed work."""

    JOINING = "joining"  # process up, stage chosen, no weights yet
    SYNCING = "syncing"  # downloading parameters and optimizer state from a replica
    SERVING = "serving"  # accepting forward/backward work
    LEAVING = "leaving"  # draining in-flight work before exit; routers must stop sending


def stage_key(run_id: str, stage: int) -> str:
    return f"{run_id}_stage{stage}"


def trainers_key(run_id: str) -> str:
    return f"{run_id}_trainers"


def manifest_key(run_id: str) -> str:
    return f"{run_id}_manifest"


def acks_key(run_id: str) -> str:
    return f"{run_id}_acks"


def bans_key(run_id: str) -> str:
    return f"{run_id}_bans"


@dataclass
class StageRecord:
    """A stage peer's announcement. ``throughput`` is tokens/s of compute (EMA), ``queue`` jobs waiting."""

    peer_id: str
    stage: int
    state: str
    manifest_hash: str
    throughput: float = 0.0
    queue: int = 0
    step: int = 0
    samples: int = 0  # samples accumulated toward the next optimizer step
    admitted: int = 0  # samples of training microbatches taken toward that step and still in flight here
    fingerprint: float = 0.0  # checksum of the parameters after ``step`` (replicas must agree)
    averaging_step: int = -1  # the step this peer is averaging gradients for right now (-1: not averaging)
    # The step this peer took on its own gradients after its round with replicas failed (-1: its last step was
    # averaged, or it was alone): replicas at that step with other parameters keep theirs (``repair_source``).
    fallback_step: int = -1
    addrs: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    # The parameters' values at seeded positions, the same on every replica of the stage: consensus distance.
    param_sample: list[float] = field(default_factory=list)
    param_sample_step: int = -1  # the step the sample was taken after
    # How this peer computes its stage's messages ("fp32", "bf16"; "" from an older peer): auditors recompute a
    # message at its sender's precision (server/screening.py).
    precision: str = ""
    # "direct" (a peer connected back to its port), "relayed" (none could: it serves through libp2p relays),
    # "unknown" (nobody answered the dial-back yet), "" (an older peer); net/reachability.py
    reachability: str = ""
    updated: float = 0.0

    def to_value(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_value(cls, value: Any) -> Optional["StageRecord"]:
        if not isinstance(value, dict):
            return None
        try:
            return cls(**{k: value[k] for k in cls.__dataclass_fields__ if k in value})
        except TypeError:
            return None


@dataclass
class TrainerRecord:
    peer_id: str
    manifest_hash: str
    tokens: int = 0
    loss: float = float("nan")
    microbatches: dict[str, int] = field(default_factory=dict)
    training: bool = True  # False once its training loop ended (stages may then step a last partial batch)
    updated: float = 0.0

    def to_value(self) -> dict[str, Any]:
        return asdict(self)


DHT_TIMEOUT_S = 10.0  # every DHT call is bounded: a thread blocked forever on a dead DHT process blocks exit
STORE_WAIT_S = 1.0  # how long ``announce`` waits for its store (see there); stores take milliseconds when all is well


_OWNER_KEYS: "weakref.WeakKeyDictionary[DHT, Any]" = weakref.WeakKeyDictionary()


def bind_owner_key(dht: DHT, key: Any) -> None:
    """Sign every record ``dht`` writes with ``key`` (an ``RSAPrivateKey``, the key of the DHT's own peer id)."""
    _OWNER_KEYS[dht] = key


def announce(dht: DHT, key: str, subkey: str, value: dict, ttl: float = RECORD_TTL_S,
             wait_s: float = STORE_WAIT_S) -> bool:
    """Store ``value`` under ``key``/``subkey`` for ``ttl`` seconds. False when the store was refused (e.g. a record
    signed by another peer); True when it was stored, or is still running after ``wait_s``.

    Why not wait for every store: hivemind's store waits for each of the key's nearest DHT nodes, and one that is
    frozen (SIGSTOP, a suspended laptop) holds it for twice its ``wait_timeout`` (search, then store: 6 s) until it
    is blacklisted. A node's DHT calls run on two threads; stores waiting on a frozen peer took both and stalled the
    reads behind them (a stage's round, its records, the gradient norms) for 20 s and more. The store completes in
    hivemind's DHT process meanwhile.
    """
    value = dict(value, updated=time.time())
    owner = _OWNER_KEYS.get(dht)
    stored_subkey: Any = subkey if owner is None else owner_subkey(subkey, owner)
    future = dht.store(key, subkey=stored_subkey, value=value, expiration_time=get_dht_time() + ttl,
                       return_future=True)
    try:
        return bool(future.result(timeout=wait_s))
    except TimeoutError:
        if future.done():  # the store itself failed with a timeout: not stored
            return False
        logger.debug(f"the store of {key}/{subkey} is still running after {wait_s:g}s; not waiting for it")
        return True


def sampled_consensus_distance(records: Sequence["StageRecord"]) -> Optional[float]:
    """Consensus distance of a stage's replicas from their records' parameter samples: mean ``||s_i - mean||`` over
    ``||mean||`` among the serving replicas whose samples were taken after the most common step (replicas a step
    apart differ by that step, not by disagreement). None with fewer than two such replicas."""
    serving = [r for r in records if r.state == "serving" and _real_numbers(r.param_sample)
               and isinstance(r.param_sample_step, int) and r.param_sample_step >= 0]
    if not serving:
        return None
    steps = [r.param_sample_step for r in serving]
    step = max(set(steps), key=lambda s: (steps.count(s), s))
    samples = [r.param_sample for r in serving if r.param_sample_step == step]
    if len(samples) < 2 or len({len(x) for x in samples}) != 1:
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        stacked = np.asarray(samples, dtype=np.float64)
        mean = stacked.mean(axis=0)
        norm = float(np.linalg.norm(mean))
        spread = float(np.linalg.norm(stacked - mean, axis=1).mean())
    if not (math.isfinite(norm) and math.isfinite(spread)) or norm == 0.0:
        return None
    return spread / norm


def _real_numbers(values: object) -> bool:
    """Whether ``values`` (from an untrusted record) is a non-empty list of real numbers."""
    return (isinstance(values, (list, tuple)) and len(values) > 0
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in values))


def sampled_relative_distance(ours: Sequence[float], theirs: object) -> Optional[float]:
    """``||ours - theirs|| / ||ours||`` of two replicas' parameter samples (the same seeded positions); None when the
    samples cannot be compared (not a list of as many real numbers, empty, not finite, too large: ``theirs`` comes
    from another peer's record and is untrusted)."""
    if not ours or not _real_numbers(theirs) or len(ours) != len(theirs):
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        a = np.asarray(ours, dtype=np.float64)
        b = np.asarray(theirs, dtype=np.float64)
        norm, diff = float(np.linalg.norm(a)), float(np.linalg.norm(a - b))
    if not (math.isfinite(norm) and math.isfinite(diff)) or norm == 0.0:
        return None
    return diff / norm


def read_subkeys(dht: DHT, key: str, latest: bool = True) -> dict[str, Any]:
    """All live subkey values of ``key`` as {peer id: value}; empty when the key is unknown.

    Owner-signed subkeys (``peer_id[owner:ssh-rsa ...]``) are reported by their peer id: the validators already
    checked the signature and that the key is that peer's.
    """
    found = dht.get(key, latest=latest, return_future=True).result(timeout=DHT_TIMEOUT_S)
    if found is None or not isinstance(found.value, dict):
        return {}
    return {subkey_peer_id(sub): item.value for sub, item in found.value.items()}


def stage_medians(found: dict[str, Any], manifest_hash: str, n_stages: int, field: str,
                  minimum: Optional[float] = None) -> dict[int, float]:
    """{stage: median over its peers' values of ``field``} from ``read_subkeys`` values ``{"stage", field,
    "manifest_hash"}`` of this run; values of another manifest, stage numbers out of range, non-finite numbers and
    numbers below ``minimum`` are ignored. The median, so that one replica cannot set its stage's value alone."""
    by_stage: dict[int, list[float]] = {}
    for value in found.values():
        if not isinstance(value, dict) or value.get("manifest_hash") != manifest_hash:
            continue
        stage, x = value.get("stage"), value.get(field)
        if isinstance(stage, int) and 0 <= stage < n_stages and isinstance(x, (int, float)) and math.isfinite(x) \
                and (minimum is None or x >= minimum):
            by_stage.setdefault(stage, []).append(float(x))
    return {s: statistics.median(v) for s, v in by_stage.items()}


def read_stage(dht: DHT, run_id: str, stage: int, manifest_hash: str) -> list[StageRecord]:
    """Live records of ``stage`` that belong to this manifest."""
    out = []
    for value in read_subkeys(dht, stage_key(run_id, stage)).values():
        rec = StageRecord.from_value(value)
        if rec is not None and rec.manifest_hash == manifest_hash and rec.stage == stage:
            out.append(rec)
    return out


def read_swarm(dht: DHT, run_id: str, n_stages: int, manifest_hash: str) -> list[list[StageRecord]]:
    return [read_stage(dht, run_id, s, manifest_hash) for s in range(n_stages)]


def trainers_training(dht: DHT, run_id: str, manifest_hash: str) -> int:
    """Live trainers of this manifest still in their training loop. A record without the flag counts as
    training; a trainer that died stops counting when its record expires (``RECORD_TTL_S``)."""
    return sum(1 for v in read_subkeys(dht, trainers_key(run_id)).values()
               if isinstance(v, dict) and v.get("manifest_hash") == manifest_hash and v.get("training", True) is not False)


def stages_settled(swarm: list[list[StageRecord]], since: float) -> bool:
    """Whether every stage has applied all it was sent before ``since`` (a ``time.time()``, e.g. when a trainer
    stopped): each stage has serving peers, and every one of them announced after ``since`` with no sample
    accumulated and no averaging round running. One read can still catch a replica between taking its gradients
    and applying its step (it announces again right after), so callers wait for two reads in a row."""
    for stage in swarm:
        serving = [r for r in stage if r.state == PeerState.SERVING.value]
        if not serving or any(r.updated < since or r.samples or r.averaging_step != -1 for r in serving):
            return False
    return True


# Distinct publishers whose SENTINEL banned a peer before the rest of the swarm (trainers, averaging groups) drops
# it. One publisher is not enough: one receiver's mistaken ban would exclude a peer everywhere, and a lone malicious
# peer could publish bans of every honest peer. Readers count only publishers that serve a stage of the run (and,
# in allow-listed runs, only certified ones write records at all); in an open run one person with two serving
# peers still meets the quorum. The publisher's own bans always apply to itself.
BAN_QUORUM = 2


def read_bans(dht: DHT, run_id: str, manifest_hash: str, publishers: Optional[Callable[[], set]] = None,
              quorum: int = BAN_QUORUM) -> set[str]:
    """Peers that at least ``quorum`` other peers of the run have banned for corrupted messages. ``publishers``:
    returns the peers whose bans count (e.g. those serving a stage); called only when someone published a ban, so
    a run without bans pays one DHT read. Used to keep banned peers out of routing and averaging groups."""
    published = read_subkeys(dht, bans_key(run_id))
    if not published:
        return set()
    return quorate_bans(published, manifest_hash, publishers() if publishers is not None else None, quorum)


def read_swarm_bans(dht: DHT, run_id: str, n_stages: int, manifest_hash: str,
                    swarm: Optional[list[list[StageRecord]]] = None) -> set[str]:
    """``read_bans`` with the serving peers of the run (all stages) as the publishers whose bans count; ``swarm``:
    the stage records if the caller already read them (else read only when someone published a ban)."""

    def serving() -> set[str]:
        stages = swarm if swarm is not None else read_swarm(dht, run_id, n_stages, manifest_hash)
        return {r.peer_id for stage in stages for r in stage if r.state == PeerState.SERVING.value}

    return read_bans(dht, run_id, manifest_hash, serving)


def quorate_bans(published: dict, manifest_hash: str, publishers: Optional[set] = None,
                 quorum: int = BAN_QUORUM) -> set[str]:
    """``published``: publisher peer id -> its bans record. The peers banned by >= ``quorum`` distinct publishers
    (only those in ``publishers`` when given; a publisher's ban of itself does not count)."""
    votes: dict[str, set[str]] = {}
    for publisher, value in published.items():
        if publishers is not None and publisher not in publishers:
            continue
        if isinstance(value, dict) and value.get("manifest_hash") == manifest_hash:
            for p in value.get("banned", []):
                if str(p) != publisher:
                    votes.setdefault(str(p), set()).add(publisher)
    return {p for p, by in votes.items() if len(by) >= quorum}
