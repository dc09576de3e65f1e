"""Live stage moves: a serving peer moves to the swarm's bottleneck stage when that lifts throughput enough.

Every ~``rebalance_every_s`` a serving peer reads the swarm and computes the plan (``net.routing.plan_rebalance``),
which names at most one mover; a DHT lock with expiry covers peers whose views differ. The move itself (leave,
rebuild, download state, serve; or go back) is ``StageNode.move_to``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any, Optional

from agora.model import active_depth
from agora.net.records import PeerState, announce, read_subkeys, read_swarm
from agora.net.routing import Move, plan_rebalance

logger = logging.getLogger("agora.node")

MOVE_LOCK_TTL_S = 90.0  # a mover that dies mid-move blocks other moves at most this long


def moves_key(run_id: str) -> str:
    """DHT key of the stage-move lock: one subkey per peer that claims (or released) the right to move."""
    return f"{run_id}_moving"


class Rebalancer:
    """Decides when this peer moves, and holds the swarm-wide move lock meanwhile.

    :param node: the ``StageNode`` (its state, stage, options, DHT and ``move_to``)
    """

    def __init__(self, node: Any):
        self.node = node
        self.lock_claimed = False
        self.waiting_for_depth = False
        self.clock = time.monotonic
        # The move the plan has named for us at every read since ``planned_since`` (None: none). A move is made only
        # once the plan held for ``rebalance_confirm_s``: a stage that looks weak because a replica is frozen for a
        # while (a laptop lid) or restarting must not pull a peer away from its own stage, and back.
        self.planned: Optional[tuple[int, int]] = None
        self.planned_since = 0.0

    async def run(self) -> None:
        node = self.node
        while True:
            period = node.opts.rebalance_every_s
            await asyncio.sleep(period * random.uniform(0.75, 1.25) if period > 0 else 1.0)
            if node.opts.rebalance_every_s <= 0 or node.state != PeerState.SERVING or node.stopping:
                continue  # (read again after the sleep: rebalancing can be switched off at run time)
            if time.monotonic() - node.serving_since < node.opts.rebalance_dwell_s:
                continue
            try:
                await self.maybe_move()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # a failed attempt leaves the node serving where it was
                logger.warning(f"rebalancing failed: {err!r}", exc_info=True)

    async def maybe_move(self) -> Optional[Move]:
        """Move to another stage if the swarm-wide plan names this peer as the mover; returns the move made."""
        node, m = self.node, self.node.manifest
        if active_depth(m, node.step) < m.model.n_layers:
            # Architecture warm-up: a stage's cost grows as its blocks join, so a move planned on today's costs is
            # undone when the next stage's blocks join (two state downloads for nothing). Routing follows the
            # measured throughput meanwhile; stages rebalance once the network is whole.
            if not self.waiting_for_depth:
                logger.info(f"rebalancing waits for the architecture warm-up to end (depth "
                            f"{active_depth(m, node.step)} of {m.model.n_layers} blocks at step {node.step})")
            self.waiting_for_depth = True
            return None
        self.waiting_for_depth = False
        swarm = await node.run_io(read_swarm, node.dht, m.run_id, m.n_stages, m.hash)
        plan = plan_rebalance(swarm, node.opts.min_move_gain)
        if plan is None or plan[0] != node.peer_id or plan[1].from_stage != node.stage_index:
            self.planned = None
            return None
        move = plan[1]
        now = self.clock()
        if self.planned != (move.from_stage, move.to_stage):
            self.planned, self.planned_since = (move.from_stage, move.to_stage), now
        if now - self.planned_since < node.opts.rebalance_confirm_s:
            logger.info(f"rebalancing: stage {move.to_stage} is the bottleneck (x{move.gain:.2f}); moving there if "
                        f"that still holds {node.opts.rebalance_confirm_s - (now - self.planned_since):.0f}s from now")
            return None
        self.planned = None
        if not await self.claim_lock(move):
            return None
        try:
            logger.info(f"rebalancing: moving from stage {move.from_stage} to {move.to_stage} "
                        f"(bottleneck x{move.gain:.2f})")
            moved = await node.move_to(move.to_stage)
        finally:
            await self.release_lock()
        return move if moved else None

    def _claims(self) -> list[str]:
        """Peers (other than us) holding the move lock of this run and manifest (io thread)."""
        node = self.node
        entries = read_subkeys(node.dht, moves_key(node.manifest.run_id))
        return sorted(
            sub for sub, v in entries.items()
            if sub != node.peer_id and isinstance(v, dict) and v.get("manifest_hash") == node.manifest.hash
            and not v.get("released")
        )

    async def claim_lock(self, move: Move) -> bool:
        node = self.node
        if await node.run_io(self._claims):
            return False
        value = {"manifest_hash": node.manifest.hash, "from": move.from_stage, "to": move.to_stage, "released": False}
        await node.run_io(announce, node.dht, moves_key(node.manifest.run_id), node.peer_id, value, MOVE_LOCK_TTL_S)
        self.lock_claimed = True
        await asyncio.sleep(1.0)  # a concurrent claim (a differing view of the swarm) lands meanwhile
        rivals = await node.run_io(self._claims)
        if any(r < node.peer_id for r in rivals):
            await self.release_lock()
            return False
        return True

    async def release_lock(self) -> None:
        node = self.node
        # A later expiration replaces the claim (hivemind keeps the value that expires last for a subkey).
        value = {"manifest_hash": node.manifest.hash, "released": True}
        try:
            await node.run_io(announce, node.dht, moves_key(node.manifest.run_id), node.peer_id, value,
                              MOVE_LOCK_TTL_S + 1.0)
        except Exception as err:  # the claim then just expires
            logger.warning(f"could not release the move lock: {err!r}")
        self.lock_claimed = False


