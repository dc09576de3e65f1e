"""Entering a network namespace for a moment, so that a process forked meanwhile lives there.

The emulated-WAN demo (``agora.lab.netem``) runs each peer in a namespace; ``agora.net.dht.make_dht`` (``Endpoint.netns``)
forks hivemind's DHT daemon inside one while the caller stays home. Linux only; needs root.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Iterator, Optional

NETNS_RUN_DIR = "/var/run/netns"  # where ``ip netns add`` bind-mounts named namespaces (iproute2's default)
CLONE_NEWNET = 0x40000000

_libc: Optional[ctypes.CDLL] = None


def _setns(fd: int) -> None:
    """setns(2) for the calling thread (Python 3.11 has no ``os.setns``)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def entered(netns: str) -> Iterator[None]:
    """Run the body with the *calling thread* in network namespace ``netns``, then move it back.

    Why per thread and only for a moment: setns(2) changes the namespace of one thread, and a process forked by
    that thread is born in it. A caller that needs one helper process inside a namespace (hivemind's DHT, which
    forks its own process and libp2p daemon) forks it in here and keeps every other thread, sockets it opens
    later included, in its own namespace. Threads started inside the body would stay in ``netns`` for life, so the
    body should only fork.
    """
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(os.path.join(NETNS_RUN_DIR, netns), os.O_RDONLY)
        try:
            _setns(target)
            try:
                yield
            finally:
                _setns(home)
        finally:
            os.close(target)
    finally:
        os.close(home)
