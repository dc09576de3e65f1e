"""A frozen DHT peer must not hold a node's announcements: hivemind's store waits for every nearest node, and a
frozen one holds it for 2 x its wait_timeout (6 s) until blacklisted; ``records.announce`` returns after
``STORE_WAIT_S`` and the value still reaches the live peers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import hivemind

from agora.net.records import STORE_WAIT_S, announce, read_subkeys

CHILD = """
import sys, time, hivemind
dht = hivemind.DHT(initial_peers=[sys.argv[1]], start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
print("up", flush=True)
time.sleep(600)
"""


def test_an_announcement_does_not_wait_for_a_frozen_dht_peer():
    boot = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    addr = str(boot.get_visible_maddrs()[0])
    child = subprocess.Popen([sys.executable, "-c", CHILD, addr], start_new_session=True, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    me = reader = None
    try:
        assert child.stdout.readline().strip() == "up"
        me = hivemind.DHT(initial_peers=[addr], start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        reader = hivemind.DHT(initial_peers=[addr], start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        assert announce(me, "k", "warm-up", {"i": 0})
        os.killpg(child.pid, signal.SIGSTOP)  # the child's DHT process and its p2pd are in its session
        took = []
        for i in range(1, 4):
            t0 = time.monotonic()
            assert announce(me, "k", f"v{i}", {"i": i})
            took.append(time.monotonic() - t0)
        assert max(took) < STORE_WAIT_S + 0.5, took  # before: 6 s for a store that met the frozen peer
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:
            found = read_subkeys(reader, "k")
            if all(f"v{i}" in found for i in range(1, 4)):
                break
            time.sleep(0.5)
        assert all(f"v{i}" in found for i in range(1, 4)), found
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        for dht in (me, reader, boot):
            if dht is not None:
                dht.shutdown()
