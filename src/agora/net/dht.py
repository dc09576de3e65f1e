"""Process-level plumbing every role shares: joining the DHT, the run's manifest check, and a clean shutdown.

Kept apart from the stage server and the trainer so both join a run the same way and fail the same way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

os.environ.setdefault("USE_LEGACY_BFLOAT16", "0")  # before hivemind is imported: keep bf16 at 2 bytes on the wire

from hivemind import DHT  # noqa: E402

from agora.config import Manifest  # noqa: E402
from agora.net.lifeline import GuardedDHT  # noqa: E402
from agora.net.netns import entered  # noqa: E402
from agora.net.records import DHT_TIMEOUT_S, announce, bind_owner_key, manifest_key, read_subkeys  # noqa: E402
from agora.trust.credentials import CredentialError, load_credentials, record_validators  # noqa: E402

logger = logging.getLogger("agora")
READY_TIMEOUT_S = 90.0  # how long a new DHT process may take to report ready (hivemind waits forever)

EXIT_MANIFEST_MISMATCH = 3
EXIT_UNREACHABLE = 4
EXIT_CREDENTIALS = 5
EXIT_NOT_REACHABLE = 6  # --reachability public: no peer could connect back to this peer's port


class JoinError(RuntimeError):
    """Joining the run failed; ``exit_code`` says how the process should exit."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Endpoint:
    """Where this peer listens and who it is.

    :param announce_host: the public address to announce (needs a fixed ``port``); real swarms listen on 0.0.0.0
    :param identity: the peer's key file (libp2p identity = record signing key); None: an ephemeral key
    :param certificate: the authority's certificate file for ``identity`` (allow-listed runs)
    :param netns: fork the DHT process inside this named network namespace (the emulated-WAN demo)
    :param reachability: how a serving peer is reached (``REACHABILITY``): None leaves hivemind's defaults (callers
      that only dial out); "auto" lets libp2p serve through circuit relays once its AutoNAT finds this peer
      unreachable; "relay" serves through relays from the start; "public" only directly
    """

    host: str = "127.0.0.1"
    port: int = 0
    announce_host: Optional[str] = None
    identity: Optional[str] = None
    certificate: Optional[str] = None
    netns: Optional[str] = None
    reachability: Optional[str] = None


REACHABILITY = ("auto", "public", "relay")
# hivemind's P2P.create arguments per mode. Every p2pd also *serves* as a relay for others by default (circuit relay
# v2 with the daemon's limits: 16 circuits per peer, 30 min and 4 GiB per direction per relayed connection), and
# hivemind's P2P.create does not expose those limits.
_RELAY_ARGS = {
    "auto": dict(use_relay=True, use_auto_relay=True),
    "relay": dict(use_relay=True, use_auto_relay=True, force_reachability="private"),
    "public": dict(use_relay=True, use_auto_relay=False, force_reachability="public"),
}


def relay_args(reachability: str) -> dict:
    """hivemind ``P2P.create`` arguments of a ``--reachability`` mode."""
    if reachability not in _RELAY_ARGS:
        raise JoinError(f"--reachability must be one of {', '.join(REACHABILITY)}, got {reachability!r}", 2)
    return dict(_RELAY_ARGS[reachability])


def make_dht(initial_peers: Sequence[str] = (), endpoint: Endpoint = Endpoint(), manifest: Optional[Manifest] = None,
             client_mode: bool = False, writes: bool = True) -> DHT:
    """Start this process's DHT node (hivemind runs it in a child process with its own libp2p daemon).

    ``endpoint.host`` defaults to loopback for local runs; real swarms pass ``--host 0.0.0.0 --announce-host
    PUBLIC_IP`` because hivemind otherwise announces an address nobody outside can dial.

    With a ``manifest`` the DHT enforces the run's record rules (``agora.trust.credentials``): every record it
    writes is signed by the peer's identity key, records it reads or stores are checked, and in an allow-listed run
    only certified keys can write. Every peer of a run, readers included, needs them: signed values carry their
    signature, which only the validators strip. ``writes=False`` marks a read-only client (no certificate needed).

    ``endpoint.netns``: fork the DHT process (and so its libp2p daemon) inside this named network namespace while the
    calling process stays where it is (see :func:`agora.net.netns.entered`). The emulated-WAN demo uses it for
    processes that must be reachable from the host (the dashboard's web page) or that read the swarm from outside
    (the demo itself), yet must reach peers that only exist inside namespaces. ``host`` must then be the
    namespace's address. The DHT object is built first, outside, so that hivemind's result-pipe thread (started
    once per process by the first MPFuture) is not born inside the namespace.
    """
    if endpoint.announce_host and not endpoint.port:
        raise JoinError("--announce-host needs a fixed --port: the announced address must name the port", 2)
    creds = None
    if manifest is not None:
        try:
            creds = load_credentials(manifest, endpoint.identity, endpoint.certificate, writes=writes)
        except CredentialError as err:
            raise JoinError(str(err), EXIT_CREDENTIALS) from None
    try:
        dht = _start_dht(initial_peers, endpoint, client_mode, manifest, creds)
    finally:
        if creds is not None:
            creds.discard_ephemeral()  # the daemon has read it; an ephemeral key never outlives the process
    if creds is not None:
        if str(dht.peer_id) != creds.peer_id:  # records would name a peer id the key cannot sign for
            dht.shutdown()
            raise JoinError(f"identity {creds.identity_path}: the DHT came up as {dht.peer_id}, not as the key's "
                            f"peer id {creds.peer_id}", EXIT_CREDENTIALS)
        bind_owner_key(dht, creds.key)
    return dht


def _start_dht(initial_peers: Sequence[str], endpoint: Endpoint, client_mode: bool, manifest: Optional[Manifest],
               creds) -> DHT:
    host, port, netns = endpoint.host, endpoint.port, endpoint.netns
    kwargs = dict(host_maddrs=[f"/ip4/{host}/tcp/{port}"], identity_path=endpoint.identity, client_mode=client_mode)
    if creds is not None:
        kwargs["identity_path"] = creds.identity_path
        kwargs["record_validators"] = record_validators(manifest, creds)
        if creds.ephemeral_dir:
            kwargs["check_if_identity_free"] = False  # a key made a moment ago is nobody else's; skip the probe
    if endpoint.reachability is not None:
        kwargs.update(relay_args(endpoint.reachability))
        if endpoint.reachability == "relay" and initial_peers:
            # The peers we joined through answered us, so they are reachable, and every p2pd serves as a relay: offer
            # them to libp2p's auto-relay as its first candidates. It still waits for several candidates or a boot
            # delay of minutes before it reserves a slot (go-libp2p's minCandidates, bootDelay), because p2pd uses
            # static relays alone only with -relayDiscovery=0, which hivemind's P2P.create cannot pass
            # (docs/TRANSPORT.md, "Reachability"). p2pd panics on a relay address without a peer id.
            kwargs["trusted_relays"] = [p for p in initial_peers if "/p2p/" in str(p)] or None
    if endpoint.announce_host:
        kwargs["announce_maddrs"] = [f"/ip4/{endpoint.announce_host}/tcp/{port}"]
    if netns is None:
        # hivemind's own start waits for readiness without a timeout; a DHT child that never reports ready (seen
        # once in CI: the bootstrap of a test waited 600 s) would hold the caller forever. Bounded: two tries.
        for attempt in (1, 2):
            dht = GuardedDHT(initial_peers=list(initial_peers), start=False, **kwargs)
            dht.start()
            try:
                dht.wait_until_ready(timeout=READY_TIMEOUT_S)
                return dht
            except TimeoutError as err:
                dht.shutdown()
                if attempt == 2:
                    raise _join_error(initial_peers, TimeoutError(
                        f"the DHT process did not report ready within {READY_TIMEOUT_S:g}s, twice")) from err
                logger.warning(f"the DHT process did not report ready within {READY_TIMEOUT_S:g}s; starting a new one")
            except Exception as err:  # hivemind raises plain exceptions from its daemon; make them actionable
                dht.shutdown()
                raise _join_error(initial_peers, err) from err
    dht = GuardedDHT(initial_peers=list(initial_peers), start=False, **kwargs)
    with entered(netns):  # a failure to enter is a setup error, not a join error: it propagates as is
        dht.start()  # fork only: the child inherits this thread's namespace
    try:
        dht.wait_until_ready(timeout=120)
    except Exception as err:
        dht.shutdown()
        raise _join_error(initial_peers, err) from err
    return dht


def _join_error(initial_peers: Sequence[str], err: Exception) -> JoinError:
    peers = ", ".join(initial_peers) or "(none)"
    return JoinError(
        f"could not join the swarm through {peers}: {err}. Check that the address is a full multiaddr "
        f"ending in /p2p/<peer id> (as printed by `agora bootstrap`), that the peer is running, and that its "
        f"port is reachable from this machine (firewall / NAT).",
        EXIT_UNREACHABLE,
    )


def visible_maddrs(dht: DHT, timeout: float = DHT_TIMEOUT_S) -> list[str]:
    """The DHT's reachable multiaddrs, within ``timeout``.

    hivemind's ``get_visible_maddrs`` waits for its DHT process without a timeout: asked of a DHT that is shutting
    down or dead it never returns, and a pool thread stuck in it keeps the whole process from exiting. The call runs
    in a daemon thread, abandoned (with a ``TimeoutError``) after ``timeout``."""
    box: dict = {}

    def ask() -> None:
        try:
            box["maddrs"] = [str(a) for a in dht.get_visible_maddrs()]
        except BaseException as err:  # handed to the caller
            box["error"] = err

    asker = threading.Thread(target=ask, name="visible-maddrs", daemon=True)
    asker.start()
    asker.join(timeout)
    if asker.is_alive():
        raise TimeoutError(f"the DHT did not report its addresses within {timeout:.0f}s (is its process alive?)")
    if "error" in box:
        raise box["error"]
    return box["maddrs"]


def check_run_manifest(dht: DHT, manifest: Manifest, publish: bool = False) -> None:
    """Refuse to take part in a run whose announced manifest differs from ours.

    The first peer (the bootstrap) publishes the manifest hash under the run id; every later peer compares. A
    mismatch is a configuration error that must stop the process: silently training a different model would
    corrupt the run.
    """
    announced = {sub: v for sub, v in read_subkeys(dht, manifest_key(manifest.run_id)).items() if isinstance(v, dict)}
    others = sorted({v.get("hash") for v in announced.values() if v.get("hash") and v.get("hash") != manifest.hash})
    if others:
        raise JoinError(
            f"manifest mismatch for run {manifest.run_id!r}: the swarm uses manifest hash {others[0]}, yours is "
            f"{manifest.hash}. Fetch the run's manifest from its organiser (`agora manifest FILE` prints the hash).",
            EXIT_MANIFEST_MISMATCH,
        )
    if publish:
        publish_manifest(dht, manifest)


def publish_manifest(dht: DHT, manifest: Manifest, ttl: float = 60.0) -> None:
    announce(dht, manifest_key(manifest.run_id), str(dht.peer_id), {"hash": manifest.hash}, ttl=ttl)


def install_stop_signals(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """SIGTERM/SIGINT start a graceful leave. hivemind leaves SIGINT ignored in some paths; we take it back."""

    def _stop(signame: str) -> None:
        if not stop.is_set():
            logger.info(f"received {signame}: leaving gracefully")
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, _stop, sig.name)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests run nodes in threads)
            pass


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("agora").setLevel(getattr(logging, level.upper(), logging.INFO))

