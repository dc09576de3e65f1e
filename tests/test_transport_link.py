"""Link emulation inside the transport: B bytes under an X Mbit/s cap take at least B*8/X seconds."""

import asyncio
import time

import torch

from agora.lab.netem import LinkThrottle
from agora.net import transport
from agora.net.dht import make_dht, visible_maddrs


def test_capped_link_delays_a_transfer_by_its_size(monkeypatch):
    mbps, latency_ms = 16.0, 50.0
    payload = torch.zeros(256 * 1024, dtype=torch.float32)  # 1 MiB
    server = make_dht()
    client = make_dht(visible_maddrs(server))

    async def main():
        p2p_s, p2p_c = await server.replicate_p2p(), await client.replicate_p2p()

        async def echo(meta, tensors, peer):
            return {}, []

        await transport.add_handler(p2p_s, "linktest", "sink", echo)
        await transport.call(p2p_c, server.peer_id, "linktest", "sink", {}, [payload[:10]], timeout=30)  # warm-up
        monkeypatch.setattr(transport, "_LINK", LinkThrottle(mbps, latency_ms))
        t0 = time.monotonic()
        await transport.call(p2p_c, server.peer_id, "linktest", "sink", {}, [payload], timeout=60)
        return time.monotonic() - t0

    try:
        elapsed = asyncio.run(main())
    finally:
        client.shutdown()
        server.shutdown()
    floor = payload.numel() * 4 * 8 / (mbps * 1e6) + latency_ms / 1e3
    assert elapsed >= floor, (elapsed, floor)
    assert elapsed < floor + 10  # and it is the cap, not something stuck
