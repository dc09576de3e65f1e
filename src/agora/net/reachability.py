"""Can other peers open a connection to this peer? A dial-back asked of peers that are already connected.

A node behind a NAT or a firewall can dial out (to the bootstrap, the DHT) but nobody can dial in, so every call
routed to it would fail. Before serving, a node asks a few connected peers to open a plain TCP connection back to
its listening port, at the address each of them sees its connection come from (docs/NETWORK.md, "Reachability").

Why the observed address and not one the caller names: a peer that dialed whatever address it was given would be a
port scanner for anyone. The server dials only the IP addresses its libp2p daemon holds connections from that very
peer id (authenticated by libp2p), one port per request, each peer at most once per ``DIALBACK_EVERY_S``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional, Sequence

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from agora.net import transport
from agora.net.errors import BAD_METADATA, RpcError

logger = logging.getLogger("agora.reachability")

DIALBACK = "dialback"  # RPC name: "open a TCP connection to my port at the address you see me at"
DIAL_TIMEOUT_S = 3.0  # one TCP connect back; a dropped SYN takes this long to count as "not reachable"
ASK_TIMEOUT_S = 10.0  # one whole request (the server may try two addresses)
DIALBACK_EVERY_S = 10.0  # per caller, on the server
MAX_ADDRESSES = 2  # observed addresses of one caller the server tries
ASK_PEERS = 3  # connected peers a node asks at start
GRACE_S = 1.0  # after a first "not reachable", how long the other peers asked may still answer

DIRECT, UNREACHABLE, UNKNOWN = "direct", "unreachable", "unknown"


@dataclass
class Reachability:
    """What the peers asked said. ``status``: ``direct`` (one of them connected to our port), ``unreachable`` (some
    answered and none could), ``unknown`` (nobody answered: no peer to ask, or peers of an older version)."""

    status: str
    port: Optional[int] = None
    answers: list[dict] = field(default_factory=list)  # {"peer", "reachable", "tried", "error"}
    unanswered: list[str] = field(default_factory=list)  # peers that did not answer, with why

    def label(self) -> str:
        """What a record, ``agora status`` and ``agora doctor`` call it: peers reach this peer directly, through
        relays (nobody could connect back), or it is not known."""
        return {DIRECT: "direct", UNREACHABLE: "relayed"}.get(self.status, "unknown")

    def explain(self) -> str:
        tried = sorted({t for a in self.answers for t in a.get("tried", [])})
        errors = sorted({a["error"] for a in self.answers if a.get("error")})
        if self.status == DIRECT:
            ok = [a["peer"][-8:] for a in self.answers if a.get("reachable")]
            return f"port {self.port} is reachable: peer(s) {', '.join(ok)} connected to {', '.join(tried)}"
        if self.status == UNREACHABLE:
            return (f"port {self.port} is not reachable from other peers: {len(self.answers)} peer(s) tried "
                    f"{', '.join(tried) or 'no address'} and failed ({'; '.join(errors) or 'no address to dial'}). "
                    f"Open TCP port {self.port} for inbound connections in this machine's firewall, and if it sits "
                    f"behind a router or a cloud NAT forward that port to it and pass --announce-host PUBLIC_IP "
                    f"--port {self.port}")
        why = "; ".join(self.unanswered) or "no connected peer to ask"
        return f"could not check whether port {self.port} is reachable: no peer answered the dial-back ({why})"


def _ip4(addr) -> Optional[str]:
    try:
        return Multiaddr(str(addr)).value_for_protocol("ip4")
    except Exception:  # noqa: BLE001 (no ip4 part: a relayed or ip6 connection)
        return None


def listening_port(maddrs: Sequence[str]) -> Optional[int]:
    """The TCP port of this peer's first announced multiaddr that has one."""
    for addr in maddrs:
        try:
            return int(Multiaddr(str(addr)).value_for_protocol("tcp"))
        except Exception:  # noqa: BLE001
            continue
    return None


async def _can_connect(host: str, port: int, timeout: float) -> Optional[str]:
    """None when a TCP connection to host:port opens within ``timeout``, else why not."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except asyncio.TimeoutError:
        return f"{host}:{port}: no answer within {timeout:g}s (inbound connections dropped)"
    except OSError as err:
        return f"{host}:{port}: {err.strerror or err}"
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    except (asyncio.TimeoutError, OSError):
        pass
    return None


class DialbackServer:
    """Answers ``DIALBACK`` requests on a peer's libp2p daemon (every node and the bootstrap serve it)."""

    def __init__(self, p2p: P2P, dial_timeout_s: float = DIAL_TIMEOUT_S, every_s: float = DIALBACK_EVERY_S):
        self.p2p, self.dial_timeout_s, self.every_s = p2p, dial_timeout_s, every_s
        self.last: dict[str, float] = {}

    async def register(self, namespace: str) -> None:
        await transport.add_handler(self.p2p, namespace, DIALBACK, self.handle, max_payload_bytes=1024)

    async def observed_ips(self, peer_id: PeerID) -> list[str]:
        infos = await asyncio.wait_for(self.p2p.list_peers(), 5.0)
        ips = []
        for info in infos:
            if info.peer_id == peer_id:
                ips += [ip for ip in map(_ip4, info.addrs) if ip and ip not in ips]
        return ips[:MAX_ADDRESSES]

    async def handle(self, meta: dict, tensors: list, peer_id: PeerID):
        port = meta.get("port")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise RpcError(BAD_METADATA, f"port must be an integer in 1..65535, got {port!r}")
        if tensors:
            raise RpcError(BAD_METADATA, "a dial-back request carries no tensors")
        now, caller = time.monotonic(), str(peer_id)
        if now - self.last.get(caller, -1e9) < self.every_s:
            raise RpcError("rate_limited", f"one dial-back per {self.every_s:g}s per peer")
        self.last = {p: t for p, t in self.last.items() if now - t < self.every_s}  # forget the old ones
        self.last[caller] = now
        ips = await self.observed_ips(peer_id)
        tried, errors = [], []
        for ip in ips:
            tried.append(f"{ip}:{port}")
            error = await _can_connect(ip, port, self.dial_timeout_s)
            if error is None:
                return {"reachable": True, "tried": tried}, []
            errors.append(error)
        return {"reachable": False, "tried": tried,
                "error": "; ".join(errors) or "no IPv4 connection from you to dial back (relayed?)"}, []


async def check_reachability(p2p: P2P, namespace: str, port: Optional[int], exclude: Sequence[str] = (),
                             ask: int = ASK_PEERS, timeout: float = ASK_TIMEOUT_S) -> Reachability:
    """Ask up to ``ask`` connected peers (not ``exclude``) to dial ``port`` back; see :class:`Reachability`."""
    if port is None:
        return Reachability(UNKNOWN, None, unanswered=["this peer announces no TCP port"])
    infos = await asyncio.wait_for(p2p.list_peers(), 5.0)
    mine = str(p2p.peer_id)
    peers = sorted({str(i.peer_id) for i in infos} - {mine, *map(str, exclude)})
    random.shuffle(peers)
    result = Reachability(UNKNOWN, port)

    async def one(peer: str) -> None:
        try:
            meta, _ = await transport.call(p2p, peer, namespace, DIALBACK, {"port": port}, [], timeout)
        except RpcError as err:
            result.unanswered.append(f"{peer[-8:]}: {err.code}")
            return
        result.answers.append({"peer": peer, "reachable": bool(meta.get("reachable")),
                               "tried": [str(t) for t in meta.get("tried", [])][:MAX_ADDRESSES],
                               "error": str(meta.get("error", ""))[:500]})

    # Ask in waves until someone answered: a libp2p peer that is no agora peer (or an older one) has no handler. A
    # frozen peer's connection looks alive and its answer never comes: once one peer said we are reachable, or
    # ``GRACE_S`` after a first answer, the rest are not waited for.
    for start in range(0, min(len(peers), 4 * ask), ask):
        tasks = [asyncio.create_task(one(p)) for p in peers[start:start + ask]]
        try:
            for done in asyncio.as_completed(tasks):
                await done
                if any(a["reachable"] for a in result.answers):
                    break
                if result.answers:
                    pending = [t for t in tasks if not t.done()]
                    if pending:
                        await asyncio.wait(pending, timeout=GRACE_S)
                    break
        finally:
            for t in tasks:
                t.cancel()
        if result.answers:
            break
    if any(a["reachable"] for a in result.answers):
        result.status = DIRECT
    elif result.answers:
        result.status = UNREACHABLE
    return result


def probe(dht, namespace: str, port: Optional[int], timeout: float = 4 * ASK_TIMEOUT_S) -> Reachability:
    """:func:`check_reachability` from synchronous code, through ``dht``'s libp2p daemon (before a node serves,
    and ``agora doctor``)."""

    async def ask() -> Reachability:
        return await check_reachability(await dht.replicate_p2p(), namespace, port)

    return asyncio.run(asyncio.wait_for(ask(), timeout))


CONNECTIONS_EVERY_S = 5.0  # how often a node looks at which of its connections cross a relay


def is_relayed(addr) -> bool:
    """Whether a connection's remote multiaddr goes through a libp2p circuit relay."""
    return "/p2p-circuit" in str(addr)


@dataclass
class ConnectionPaths:
    """Which of this peer's libp2p connections crossed a circuit relay, sampled over its life.

    Why sample: a peer nobody can dial may still be served over connections it opened itself (libp2p reuses them in
    both directions), so "relayed" in a record says what peers could *not* do, not which path the bytes took. The
    daemon's connection list names the path: a relayed connection's remote address contains ``/p2p-circuit``.
    """

    samples: int = 0
    failed: int = 0  # samples our own daemon did not answer in time
    direct_peers: set = field(default_factory=set)  # peers seen on a direct connection at least once
    relayed_peers: set = field(default_factory=set)  # peers seen on a relayed connection at least once
    relayed_max: int = 0  # the most relayed connections open at one sample

    async def sample(self, p2p: P2P, timeout: float = 5.0) -> None:
        try:
            infos = await asyncio.wait_for(p2p.list_peers(), timeout)
        except Exception as err:  # noqa: BLE001 (a busy daemon: the next sample counts)
            self.failed += 1
            logger.debug(f"could not list connections: {err!r}")
            return
        self.samples += 1
        relayed = 0
        for info in infos:
            if any(is_relayed(a) for a in info.addrs):
                relayed += 1
                self.relayed_peers.add(str(info.peer_id))
            if any(not is_relayed(a) for a in info.addrs):
                self.direct_peers.add(str(info.peer_id))
        self.relayed_max = max(self.relayed_max, relayed)

    async def run(self, p2p: P2P, every_s: float = CONNECTIONS_EVERY_S) -> None:
        while True:
            await self.sample(p2p)
            await asyncio.sleep(every_s)

    def summary(self) -> dict:
        return {"samples": self.samples, "failed": self.failed, "direct_peers": len(self.direct_peers),
                "relayed_peers": len(self.relayed_peers), "relayed_max": self.relayed_max,
                "relayed_peer_ids": sorted(self.relayed_peers)[:20]}


HELLO = "hello"  # RPC answering nothing: calling it opens a connection the callee can then use to call us back
REVERSE_EVERY_S = 2.5  # how often a node nobody can dial checks that it is connected to every peer that calls it
REVERSE_MAX_PER_ROUND = 16  # connections opened per round at most (a large swarm is covered over several rounds)


async def register_hello(p2p: P2P, namespace: str) -> None:
    """Serve ``HELLO`` (every node and trainer): the target of :class:`ReverseDialer`'s calls."""

    async def hello(meta: dict, tensors: list, peer_id: PeerID):
        if tensors:
            raise RpcError(BAD_METADATA, "a hello carries no tensors")
        return {}, []

    await transport.add_handler(p2p, namespace, HELLO, hello, max_payload_bytes=256)


@dataclass
class ReverseDialer:
    """Keeps a connection open from a node nobody can dial to every peer that must call it.

    libp2p calls a peer over any connection already open between the two, whichever side opened it. A node behind a
    NAT or a firewall can dial out, so once it has opened a connection to each of its callers (the previous stage's
    replicas, the trainers for the head, its own stage's replicas for averaging) they reach it without a relay.
    Why not leave it to relays: hivemind's daemon reserves a relay slot only after minutes (docs/TRANSPORT.md,
    "Reachability"), and a relayed byte crosses two links. ``callers`` returns the peer ids to stay connected to.
    """

    p2p: P2P
    namespace: str
    callers: Callable[[], Awaitable[list[str]]]
    every_s: float = REVERSE_EVERY_S
    timeout_s: float = 5.0
    opened: int = 0  # connections this node opened to callers it was not connected to
    failed: int = 0  # of those attempts, the ones that failed (the caller gone, or unreachable itself)
    rounds: int = 0

    async def round(self) -> None:
        self.rounds += 1
        wanted = set(await self.callers()) - {str(self.p2p.peer_id)}
        if not wanted:
            return
        infos = await asyncio.wait_for(self.p2p.list_peers(), 5.0)
        missing = sorted(wanted - {str(i.peer_id) for i in infos})[:REVERSE_MAX_PER_ROUND]

        async def one(peer: str) -> None:
            try:
                await transport.call(self.p2p, peer, self.namespace, HELLO, {}, [], self.timeout_s)
                self.opened += 1
            except Exception as err:  # noqa: BLE001 (gone, frozen or unreachable itself: counted, tried next round)
                self.failed += 1
                logger.debug(f"could not open a connection to caller {peer[-8:]}: {err!r}")

        await asyncio.gather(*(one(p) for p in missing))

    async def run(self) -> None:
        while True:
            try:
                await self.round()
            except Exception as err:  # noqa: BLE001 (a DHT or daemon hiccup: the next round tries again)
                logger.debug(f"reverse-dial round failed: {err!r}")
            await asyncio.sleep(self.every_s)

    def summary(self) -> dict:
        return {"rounds": self.rounds, "opened": self.opened, "failed": self.failed}
