"""In-process swarm fixtures: real hivemind DHTs and libp2p daemons on 127.0.0.1, nodes on one asyncio loop."""

from __future__ import annotations

import contextlib

from hivemind import DHT

from agora.swarm.node import NodeOptions, StageNode
from agora.swarm.peer import make_dht, visible_maddrs


@contextlib.asynccontextmanager
async def local_swarm(manifest, layout, options: NodeOptions | None = None):
    """Start a bootstrap DHT and one StageNode per entry of ``layout`` (a list of stage indices)."""
    boot = make_dht()
    peers = visible_maddrs(boot)
    dhts: list[DHT] = [boot]
    nodes: list[StageNode] = []
    try:
        for stage in layout:
            dht = make_dht(peers)
            dhts.append(dht)
            node = StageNode(manifest, stage, dht, options or NodeOptions(stall_step_s=1e9))
            await node.start()
            nodes.append(node)
        yield boot, peers, nodes
    finally:
        for node in nodes:
            with contextlib.suppress(Exception):
                await node.stop()
        for dht in dhts:
            dht.shutdown()
