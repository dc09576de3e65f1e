"""How the replicas of a stage keep in agreement: the shared decision loop (``sync``) and one class per scheme.

``full``: float64 gradients all-reduced every step. ``powersgd``: rank-r PowerSGD with error feedback.
``sparse``: SPARTA, local steps and a background average of a seeded slice of the state every H steps.
``diloco``: DiLoCo, H local (inner) steps, then a blocking round that averages the replicas' outer Nesterov step.
``gossip``: factored gossip DiLoCo, pairwise exchanges instead of the exact average (Mix1 in the background, q
blocking Mix2 rounds).
``allreduce`` holds the hivemind pieces (a byte-counting codec, a two-phase averager).
"""

from __future__ import annotations

from agora.server.averaging.diloco import DiLoCoSync
from agora.server.averaging.full import FullSync
from agora.server.averaging.gossip import GossipSync
from agora.server.averaging.powersgd import PowerSGDSync
from agora.server.averaging.sparse import SparseSync
from agora.server.averaging.sync import ReplicaSync, SyncContext

SCHEMES: dict[str, type[ReplicaSync]] = {"full": FullSync, "powersgd": PowerSGDSync, "sparse": SparseSync,
                                         "diloco": DiLoCoSync, "gossip": GossipSync}


def make_sync(ctx: SyncContext) -> ReplicaSync:
    """The replica sync of the manifest's ``averaging.scheme`` (every replica of a run runs the same one)."""
    return SCHEMES[ctx.manifest.averaging.scheme](ctx)
