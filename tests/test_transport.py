"""Tests for agora.net.transport: the wire format offline, then real streams between p2pd daemons on loopback."""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, List, Tuple

import msgpack
import psutil
import pytest
import torch

from agora.net import transport
from agora.net.transport import (
    RpcError,
    RpcTimeout,
    TransferStats,
    WireError,
    add_handler,
    call,
    decode_message,
    encode_error,
    encode_message,
    handler_name,
    remove_handler,
)
from hivemind import DHT
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2, runtime_pb2
from hivemind.utils.asyncio import as_aiter
from hivemind.utils.crypto import RSAPrivateKey

NS = "test-run"
TEST_TIMEOUT_S = 20


def _p2pd_descendants() -> List[psutil.Process]:
    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.name() == "p2pd" and child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture(autouse=True)
def no_leaked_daemons():
    """Every test must shut down the p2pd daemons it started (directly or inside a DHT process)."""
    yield
    deadline = time.monotonic() + 5
    while _p2pd_descendants() and time.monotonic() < deadline:
        time.sleep(0.1)
    leaked = _p2pd_descendants()
    for proc in leaked:  # clean up so one failure does not cascade into the other tests
        proc.kill()
    assert not leaked, f"leaked p2pd daemons: {[p.pid for p in leaked]}"


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, TEST_TIMEOUT_S))


@asynccontextmanager
async def p2p_pair() -> AsyncIterator[Tuple[P2P, P2P]]:
    """A server and a client daemon on 127.0.0.1, the client bootstrapped from the server."""
    server = client = None
    try:
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        client = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await server.get_visible_maddrs())
        yield server, client
    finally:
        for p2p in (client, server):
            if p2p is not None:
                await p2p.shutdown()


async def echo(meta: dict, tensors: List[torch.Tensor], peer_id: PeerID):
    return {**meta, "echo": True, "from": peer_id.to_base58()}, tensors


def _random_peer_id() -> PeerID:
    key = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes())
    return PeerID.from_identity(key.SerializeToString())


def _sample_tensors() -> List[torch.Tensor]:
    torch.manual_seed(0)
    return [
        torch.randn(1024, 640),  # 2.5 MiB fp32: above the 2 MiB unary cap, spans 3 chunks
        torch.randint(-(2**31), 2**31 - 1, (7, 5), dtype=torch.int32),
        torch.randn(33, 17).to(torch.bfloat16),
    ]


def _assert_same(received: List[torch.Tensor], sent: List[torch.Tensor]) -> None:
    assert len(received) == len(sent)
    for got, want in zip(received, sent):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------------ offline


def test_encode_decode_roundtrip_and_bf16_is_two_bytes():
    tensors = _sample_tensors() + [torch.zeros(0, 3), torch.tensor(2.5), torch.arange(12.0).reshape(3, 4).t()]
    meta = {"step": 3, "nested": {"ids": [1, 2], "name": "x"}, "blob": b"\x00\xff"}
    messages = encode_message(meta, tensors, uid="h")

    header = msgpack_header(messages[0])
    assert header["n"] == len(messages) - 1 and header["tensors"] == len(tensors)
    assert messages[0].uid == "h" and not messages[0].tensors
    assert all(len(m.tensors) == 1 and not m.metadata for m in messages[1:])
    assert max(len(m.tensors[0].buffer) for m in messages[1:]) <= transport.DEFAULT_CHUNK_SIZE_BYTES

    bf16 = tensors[2]
    bf16_parts = [m.tensors[0] for m in messages[1:] if m.tensors[0].dtype == "bfloat16"]
    assert len(bf16_parts) == 1 and len(bf16_parts[0].buffer) == 2 * bf16.numel()  # not upcast to fp32

    got_meta, got = decode_message(messages)
    assert got_meta == meta
    _assert_same(got, tensors)
    assert not any(t.requires_grad for t in got)

    replies = encode_message({}, [], message_type=runtime_pb2.ExpertResponse)
    assert len(replies) == 1 and isinstance(replies[0], runtime_pb2.ExpertResponse)
    assert decode_message(replies) == ({}, [])


def msgpack_header(message) -> dict:
    return msgpack.unpackb(message.metadata, raw=False)


def test_wire_errors():
    messages = encode_message({"a": 1}, [torch.randn(600_000)], chunk_size_bytes=2**20)  # 2.4 MB -> 3 chunks
    assert len(messages) == 4

    with pytest.raises(WireError) as info:
        decode_message(messages[:-1])
    assert info.value.code == "truncated" and isinstance(info.value, ValueError)
    with pytest.raises(WireError, match="malformed"):
        decode_message(messages + messages[-1:])
    with pytest.raises(WireError, match="malformed"):
        decode_message([runtime_pb2.ExpertRequest(metadata=b"\xc1garbage")] + messages[1:])
    with pytest.raises(WireError) as info:
        decode_message([])
    assert info.value.code == "truncated"
    with pytest.raises(WireError) as info:  # the receiver's own limit, checked from the header already
        decode_message(messages, max_payload_bytes=2**20)
    assert info.value.code == "payload_too_large"

    with pytest.raises(WireError) as info:
        encode_message({}, [torch.zeros(2**20)], max_payload_bytes=2**20)  # 4 MiB of fp32 > 1 MiB
    assert info.value.code == "payload_too_large" and isinstance(info.value, RpcError)
    with pytest.raises(WireError) as info:
        encode_message({"x": object()}, [])
    assert info.value.code == "bad_metadata"

    with pytest.raises(RpcError) as info:
        decode_message(encode_error(RpcError("shape_mismatch", "expected [2, 3]")))
    assert info.value.code == "shape_mismatch" and info.value.remote and "expected [2, 3]" in str(info.value)

    for error in (RpcError("c", "m", remote=True), RpcTimeout("t"), WireError("truncated", "w")):
        clone = pickle.loads(pickle.dumps(error))
        assert type(clone) is type(error) and (clone.code, clone.message, clone.remote) == (
            error.code,
            error.message,
            error.remote,
        )


# ------------------------------------------------------------------------------------------------ over p2p


def test_roundtrip_over_p2p_with_byte_accounting():
    async def scenario():
        async with p2p_pair() as (server, client):
            server_stats = TransferStats()
            await add_handler(server, NS, "echo", echo, stats=server_stats)
            tensors = _sample_tensors()
            stats = TransferStats()
            meta, got = await call(client, server.peer_id, NS, "echo", {"step": 7}, tensors, timeout=10, stats=stats)
            assert meta == {"step": 7, "echo": True, "from": client.peer_id.to_base58()}
            _assert_same(got, tensors)

            payload = sum(t.numel() * t.element_size() for t in tensors)
            assert stats.payload_bytes_sent == stats.payload_bytes_received == payload
            assert server_stats.payload_bytes_received == server_stats.payload_bytes_sent == payload
            assert stats.wire_bytes_sent > payload and stats.calls == 1 and stats.errors == 0

            bf16 = torch.randn(257, 31).to(torch.bfloat16)
            per_call = TransferStats()
            _, (got_bf16,) = await call(client, server.peer_id.to_base58(), NS, "echo", {}, [bf16], 10, stats=per_call)
            assert got_bf16.dtype == torch.bfloat16 and torch.equal(got_bf16, bf16)
            assert per_call.payload_bytes_sent == per_call.payload_bytes_received == 2 * bf16.numel()

    run(scenario())


def test_handler_errors_become_rpc_errors_and_server_keeps_serving(caplog):
    async def strict(meta, tensors, peer_id):
        if meta.get("mode") == "shape":
            raise RpcError("shape_mismatch", f"expected [4, 8], got {list(tensors[0].shape)}")
        if meta.get("mode") == "bug":
            raise KeyError("oops")
        return {"ok": True}, [tensors[0] * 2]

    async def scenario():
        async with p2p_pair() as (server, client):
            await add_handler(server, NS, "strict", strict)
            x = torch.randn(4, 9)
            with pytest.raises(RpcError) as info:
                await call(client, server.peer_id, NS, "strict", {"mode": "shape"}, [x], timeout=10)
            assert info.value.code == "shape_mismatch" and info.value.remote
            assert "got [4, 9]" in info.value.message

            with pytest.raises(RpcError) as info:
                await call(client, server.peer_id, NS, "strict", {"mode": "bug"}, [x], timeout=10)
            assert info.value.code == "internal" and "KeyError" in info.value.message and "oops" in info.value.message

            meta, (y,) = await call(client, server.peer_id, NS, "strict", {}, [x], timeout=10)
            assert meta == {"ok": True} and torch.equal(y, x * 2)

    with caplog.at_level(logging.WARNING, logger=transport.__name__):
        run(scenario())
    assert "KeyError: 'oops'" in caplog.text  # unexpected handler failures are logged with their traceback


def test_oversized_payloads_are_rejected():
    async def scenario():
        async with p2p_pair() as (server, client):
            await add_handler(server, NS, "small", echo, max_payload_bytes=2**20)
            big = torch.randn(2**21)  # 8 MiB

            # locally, before a single byte is sent
            stats = TransferStats()
            with pytest.raises(WireError) as info:
                await call(client, server.peer_id, NS, "small", {}, [big], 10, max_payload_bytes=2**20, stats=stats)
            assert info.value.code == "payload_too_large" and stats.messages_sent == 0

            # remotely: the server drains the whole 8 MiB stream, then replies with the error (no reset)
            with pytest.raises(RpcError) as info:
                await call(client, server.peer_id, NS, "small", {}, [big], 10)
            assert info.value.code == "payload_too_large" and info.value.remote

            # the drain matters most for hivemind's stock stream client: it loses a reply sent before the request
            # stream was read to its end to a connection reset
            for _ in range(2):
                requests = as_aiter(*encode_message({}, [big]))
                responses = await client.iterate_protobuf_handler(
                    server.peer_id, handler_name(NS, "small"), requests, runtime_pb2.ExpertResponse
                )
                with pytest.raises(RpcError) as info:
                    decode_message([response async for response in responses])
                assert info.value.code == "payload_too_large"

            _, (small,) = await call(client, server.peer_id, NS, "small", {}, [big[:1000]], 10)
            assert torch.equal(small, big[:1000])

    run(scenario())


def test_timeout_names_peer_and_handler_and_cancels_remote_handler():
    async def scenario():
        handler_cancelled = asyncio.Event()  # created inside the loop that uses it

        async def slow(meta, tensors, peer_id):
            if meta.get("sleep"):
                try:
                    await asyncio.sleep(meta["sleep"])
                except asyncio.CancelledError:
                    handler_cancelled.set()
                    raise
            return meta, tensors

        async with p2p_pair() as (server, client):
            await add_handler(server, NS, "slow", slow)
            start = time.monotonic()
            with pytest.raises(RpcTimeout) as info:
                await call(client, server.peer_id, NS, "slow", {"sleep": 30}, [torch.ones(3)], timeout=1.0)
            assert time.monotonic() - start < 1.0 + 2
            assert info.value.code == "timeout" and isinstance(info.value, RpcError)
            assert str(server.peer_id) in str(info.value) and "slow" in str(info.value)

            await asyncio.wait_for(handler_cancelled.wait(), 5)  # the caller hung up, the server stopped working
            meta, _ = await call(client, server.peer_id, NS, "slow", {"sleep": 0}, [torch.ones(3)], timeout=10)
            assert meta == {"sleep": 0}

    run(scenario())


def test_unreachable_peer_and_unknown_handler():
    async def scenario():
        async with p2p_pair() as (server, client):
            await add_handler(server, NS, "echo", echo)

            start = time.monotonic()
            with pytest.raises(RpcError) as info:
                await call(client, _random_peer_id(), NS, "echo", {}, [torch.ones(2)], timeout=3)
            assert time.monotonic() - start < 3 + 2
            assert info.value.code == "unreachable" and not info.value.remote

            with pytest.raises(RpcError) as info:
                await call(client, server.peer_id, "other-run", "echo", {}, [torch.ones(2)], timeout=3)
            assert info.value.code == "no_handler"

            await remove_handler(server, NS, "echo")
            with pytest.raises(RpcError) as info:
                await call(client, server.peer_id, NS, "echo", {}, [torch.ones(2)], timeout=3)
            # until identify tells the client's daemon that the protocol is gone, libp2p opens the stream lazily
            # and the remote's refusal surfaces as a reset of an already "open" stream
            assert info.value.code in ("no_handler", "connection_lost")

            await server.shutdown()  # a peer we were connected to goes away
            start = time.monotonic()
            with pytest.raises(RpcError) as info:
                await call(client, server.peer_id, NS, "echo", {}, [torch.ones(2)], timeout=3)
            assert time.monotonic() - start < 3 + 2
            assert info.value.code in ("unreachable", "connection_lost", "timeout")

    run(scenario())


def test_concurrent_calls_do_not_mix_up_replies():
    async def delayed_echo(meta, tensors, peer_id):
        await asyncio.sleep(0.05 * (4 - meta["i"]))  # finish in reverse order
        return meta, tensors

    async def scenario():
        async with p2p_pair() as (server, client):
            await add_handler(server, NS, "echo", delayed_echo)
            inputs = [torch.full((300_000,), float(i)) for i in range(4)]
            replies = await asyncio.gather(
                *[call(client, server.peer_id, NS, "echo", {"i": i}, [x], timeout=10) for i, x in enumerate(inputs)]
            )
            for i, (meta, (y,)) in enumerate(replies):
                assert meta == {"i": i} and torch.equal(y, inputs[i])

    run(scenario())


def test_call_through_dht_replicated_p2p():
    """The intended deployment: each peer runs a DHT and talks through ``dht.replicate_p2p()``."""
    dht_server = dht_client = None
    try:
        dht_server = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        dht_client = DHT(
            start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=dht_server.get_visible_maddrs()
        )

        async def scenario():
            server_p2p = await dht_server.replicate_p2p()
            client_p2p = await dht_client.replicate_p2p()
            await add_handler(server_p2p, NS, "echo", echo)
            x = torch.randn(600, 1000).to(torch.bfloat16)  # 1.2 MB in bf16 (2.4 MB if upcast)
            stats = TransferStats()
            meta, (y,) = await call(client_p2p, dht_server.peer_id, NS, "echo", {"k": 1}, [x], 10, stats=stats)
            assert meta["from"] == dht_client.peer_id.to_base58() and torch.equal(y, x)
            assert stats.payload_bytes_sent == 2 * x.numel()
            await client_p2p.shutdown()  # replicas only close their client; the DHT owns the daemon
            await server_p2p.shutdown()

        run(scenario())
    finally:
        for dht in (dht_client, dht_server):
            if dht is not None:
                dht.shutdown()
