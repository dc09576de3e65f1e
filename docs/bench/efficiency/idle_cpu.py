"""Idle CPU of stage node processes (plus their hivemind children) over a 20 s window with no traffic.

Run with the project venv: ``.venv/bin/python docs/bench/efficiency/idle_cpu.py [OUT_FILE]``; prints the shares
and, with OUT_FILE, also writes them there. Every process it starts is killed by its process group at the end, also
on errors.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time

from agora.roles import process_cpu_seconds as cpu_seconds

WINDOW_S = 20.0


def main() -> None:
    out = tempfile.mkdtemp()
    maddr = os.path.join(out, "boot")
    spawn = dict(start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started: list[subprocess.Popen] = []
    try:
        boot = subprocess.Popen([sys.executable, "-m", "agora.cli", "bootstrap", "--manifest", "tiny",
                                 "--maddr-file", maddr], **spawn)
        started.append(boot)
        deadline = time.monotonic() + 60
        while not (os.path.exists(maddr) and open(maddr).read().strip()):
            if time.monotonic() > deadline or boot.poll() is not None:
                raise RuntimeError("the bootstrap did not print its address within 60 s")
            time.sleep(0.2)
        peer = open(maddr).read().split()[0]
        nodes = [subprocess.Popen([sys.executable, "-m", "agora.cli", "node", "--manifest", "tiny", "--stage", str(s),
                                   "--initial-peers", peer], **spawn) for s in (0, 0, 1)]
        started += nodes
        time.sleep(25)  # joined, synced and serving
        c0, b0 = [cpu_seconds(n.pid) for n in nodes], cpu_seconds(boot.pid)
        time.sleep(WINDOW_S)
        c1, b1 = [cpu_seconds(n.pid) for n in nodes], cpu_seconds(boot.pid)
        line = (f"idle node CPU share (cores, {WINDOW_S:.0f} s window, tiny, 3 nodes): "
                f"{[round((b - a) / WINDOW_S, 3) for a, b in zip(c0, c1)]} bootstrap: {round((b1 - b0) / WINDOW_S, 3)}")
        print(line)
        if len(sys.argv) > 1:
            with open(sys.argv[1], "w") as f:
                f.write(f"{time.strftime('%Y-%m-%d')} {line}\n")
    finally:
        for p in started:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


if __name__ == "__main__":
    main()
