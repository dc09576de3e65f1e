"""The transport's limits on hostile callers (agora.net.admission), against real p2pd daemons on loopback: bounded
drains, admission before buffering, a byte budget with back-pressure, stream caps, a minimum sending rate."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Tuple

import pytest
import torch

from agora.lab.hostile import attack
from agora.net.admission import IncomingGate, IncomingLimits
from agora.net.transport import RpcError, add_handler, call
from hivemind.p2p import P2P

NS = "limits-run"


async def echo(meta, tensors, peer_id):
    return meta, tensors


@asynccontextmanager
async def daemons(clients: int = 1) -> AsyncIterator[Tuple[P2P, list]]:
    """A server and ``clients`` client daemons (each its own peer identity) on 127.0.0.1."""
    started = []
    try:
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        started.append(server)
        maddrs = await server.get_visible_maddrs()
        others = []
        for _ in range(clients):
            others.append(await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs))
            started.append(others[-1])
        yield server, others
    finally:
        for p2p in started:
            await p2p.shutdown()


def run(coro, timeout: float = 60) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout))


def test_invalid_header_then_drip_is_answered_and_closed_within_5s():
    async def scenario():
        async with daemons() as (server, (client,)):
            gate = IncomingGate()
            await add_handler(server, NS, "echo", echo, gate=gate)
            *drips, frame = await asyncio.gather(*(attack(client, server.peer_id, NS, "echo", kind, {}, timeout=15)
                                                   for kind in ["drip"] * 4 + ["huge_frame"]))
            for outcome in drips:
                assert outcome.code == "malformed", outcome
                assert outcome.closed_after_s is not None and outcome.closed_after_s < 5.0, outcome
            assert frame.code == "payload_too_large" and frame.closed_after_s < 5.0, frame
            assert gate.peak_buffered_bytes < 2**20  # a 1 TiB length prefix reserved nothing
            assert gate.open_streams == 0
            _, (x,) = await call(client, server.peer_id, NS, "echo", {}, [torch.ones(3)], 10)  # still serving
            assert torch.equal(x, torch.ones(3))

    run(scenario())


def test_admission_refuses_at_the_header_before_any_payload_is_buffered():
    async def scenario():
        seen = []

        async def admit(meta, announced, peer_id):
            seen.append((meta, announced))
            if announced > 2**20:
                raise RpcError("too_large", f"{announced} bytes is more than this handler takes")

        async with daemons() as (server, (client,)):
            gate = IncomingGate(IncomingLimits(budget_bytes=8 * 2**20))
            await add_handler(server, NS, "echo", echo, gate=gate, admit=admit)
            outcomes = await asyncio.gather(*(attack(client, server.peer_id, NS, "echo", "huge", {"x": 1},
                                                     timeout=20) for _ in range(16)))
            assert [o.code for o in outcomes] == ["too_large"] * 16, outcomes
            assert all(o.closed_after_s < 5.0 for o in outcomes), outcomes
            # Only headers were ever held: 16 streams announcing 200 MiB each reserved nothing for their payload.
            assert gate.peak_buffered_bytes < 64 * 1024, gate.snapshot()
            assert all(announced == 200 * 2**20 for _, announced in seen) and len(seen) == 16
            _, (x,) = await call(client, server.peer_id, NS, "echo", {"x": 2}, [torch.ones(4)], 10)
            assert torch.equal(x, torch.ones(4)) and seen[-1] == ({"x": 2}, 16)

    run(scenario())


def test_slow_senders_are_cut_and_silent_streams_time_out():
    async def scenario():
        async with daemons() as (server, (client,)):
            gate = IncomingGate(IncomingLimits(grace_s=1.0, min_rate_bytes_per_s=8 * 1024, drain_s=0.5))
            await add_handler(server, NS, "echo", echo, gate=gate)
            slow, silent = await asyncio.gather(attack(client, server.peer_id, NS, "echo", "slow", {}, timeout=15),
                                                attack(client, server.peer_id, NS, "echo", "silent", {}, timeout=15))
            # 16 KiB at 8 KiB/s is due after 1 + 2 s; 100 bytes/s is far behind. A silent stream sends no header.
            for outcome in (slow, silent):
                assert outcome.code == "too_slow" and outcome.closed_after_s < 5.0, outcome
            assert gate.refused["too_slow"] == 2 and gate.open_streams == 0 and gate.buffered_bytes == 0
            # An honest request far above the minimum rate is served.
            payload = torch.randn(2**20)
            _, (x,) = await call(client, server.peer_id, NS, "echo", {}, [payload], 20)
            assert torch.equal(x, payload)

    run(scenario())


def test_budget_applies_back_pressure_then_busy_and_never_overflows():
    async def scenario():
        async with daemons() as (server, (client,)):
            # A budget of 3 MiB: one 2 MiB request fits, a second must wait for it.
            gate = IncomingGate(IncomingLimits(budget_bytes=3 * 2**20, budget_wait_s=1.0))
            await add_handler(server, NS, "echo", echo, gate=gate)
            payload = torch.randn(2**19)  # 2 MiB
            results = await asyncio.gather(*(call(client, server.peer_id, NS, "echo", {}, [payload], 30)
                                             for _ in range(6)), return_exceptions=True)
            served = [r for r in results if not isinstance(r, Exception)]
            busy = [r for r in results if isinstance(r, RpcError) and r.code == "busy"]
            assert len(served) + len(busy) == 6 and served, results  # loopback is fast: most are just delayed
            assert gate.peak_buffered_bytes <= 3 * 2**20, gate.snapshot()
            assert gate.buffered_bytes == 0 and gate.open_streams == 0
            # A request larger than the whole budget is refused at once, not after a wait.
            t0 = time.monotonic()
            with pytest.raises(RpcError) as info:
                await call(client, server.peer_id, NS, "echo", {}, [torch.randn(2**20)], 30)  # 4 MiB
            assert info.value.code == "payload_too_large" and time.monotonic() - t0 < 3.0

    run(scenario())


def test_stream_caps_per_peer_and_in_total():
    async def scenario():
        entered = asyncio.Event()
        release = asyncio.Event()

        async def hold(meta, tensors, peer_id):
            entered.set()
            await release.wait()
            return meta, tensors

        async with daemons(clients=3) as (server, clients):
            gate = IncomingGate(IncomingLimits(streams_per_peer=2, streams_total=4))
            await add_handler(server, NS, "hold", hold, gate=gate)
            first = clients[0]
            held = [asyncio.create_task(call(first, server.peer_id, NS, "hold", {}, [], 30)) for _ in range(2)]
            await asyncio.wait_for(entered.wait(), 10)
            while gate.open_streams < 2:
                await asyncio.sleep(0.05)
            with pytest.raises(RpcError) as info:  # a third stream of the same identity
                await call(first, server.peer_id, NS, "hold", {}, [], 10)
            assert info.value.code == "busy" and "limit is 2" in info.value.message
            held += [asyncio.create_task(call(clients[1], server.peer_id, NS, "hold", {}, [], 30)) for _ in range(2)]
            while gate.open_streams < 4:
                await asyncio.sleep(0.05)
            with pytest.raises(RpcError) as info:  # another identity, but the server holds its total
                await call(clients[2], server.peer_id, NS, "hold", {}, [], 10)
            assert info.value.code == "busy"
            assert gate.refused == {"busy_streams_per_peer": 1, "busy_streams_total": 1}
            release.set()
            assert all(meta == {} for meta, _ in await asyncio.gather(*held))
            assert gate.open_streams == 0

    run(scenario())


def test_limits_are_derived_from_the_largest_request_and_refuse_what_the_host_cannot_afford():
    from agora.config import load_manifest
    from agora.server.handler import largest_request_bytes

    tiny = largest_request_bytes(load_manifest("tiny"))  # 32 sequences x (64 x (16 bf16 coords + int32 id) + 4)
    assert tiny == 32 * (64 * 36 + 4)
    assert IncomingLimits.for_requests(tiny).budget_bytes == 4 * 2**20  # the floor: a few headers and requests
    assert largest_request_bytes(load_manifest("agora-8b")) < 2**21  # 4 x 1 sequence of 4096 x (40 bf16 + id)
    big = 10 * 2**20
    assert IncomingLimits.for_requests(big).budget_bytes == 2 * big
    assert IncomingLimits.for_requests(big, budget_bytes=3 * 2**20).budget_bytes == 3 * 2**20
    with pytest.raises(ValueError, match="--incoming-budget-mib"):
        IncomingLimits.for_requests(big, available_bytes=4 * big)  # 2x the request > a quarter of free memory
    for bad in ({"budget_bytes": 0}, {"streams_per_peer": -1}, {"grace_s": 0.0}, {"min_rate_bytes_per_s": 1.5}):
        with pytest.raises(ValueError):
            IncomingLimits(**bad)
