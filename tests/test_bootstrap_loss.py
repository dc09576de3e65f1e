"""The bootstrap peer is only a way in: after its whole process tree is SIGKILLed, the swarm keeps training and a
new node joins through a serving node's announced address (raw CLI, 127.0.0.1)."""

from __future__ import annotations

import json
import signal
import time

import psutil
import pytest

from test_crash_only import _agora, _cleanup, _serving, _wait_for

pytestmark = pytest.mark.slow


def _summary(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def test_the_swarm_outlives_its_bootstrap_peer_and_accepts_joiners_through_any_node(tmp_path):
    maddr = tmp_path / "boot.maddr"
    boot = _agora("bootstrap", "--manifest", "tiny", "--maddr-file", str(maddr), log=tmp_path / "boot.log")
    procs = [boot]
    try:
        _wait_for(lambda: maddr.exists() and maddr.read_text().strip(), 60, "the bootstrap peer", boot,
                  tmp_path / "boot.log")
        peer = maddr.read_text().split()[0]
        summaries = {s: tmp_path / f"node{s}.json" for s in (0, 1)}
        for s, summary in summaries.items():
            procs.append(_agora("node", "--manifest", "tiny", "--stage", str(s), "--initial-peers", peer,
                                "--rebalance-every", "0", "--summary", str(summary), log=tmp_path / f"node{s}.log"))
        for (s, summary), proc in zip(summaries.items(), procs[1:]):
            _wait_for(lambda: _serving(summary), 120, f"stage {s} to serve", proc, tmp_path / f"node{s}.log")
        trainer = _agora("train", "--manifest", "tiny", "--initial-peers", peer, "--val-batches", "0",
                         log=tmp_path / "trainer.log")
        procs.append(trainer)
        tail_work = lambda: _summary(summaries[1]).get("counters", {}).get("backward", 0)  # noqa: E731
        _wait_for(lambda: tail_work() >= 2, 120, "training to start", trainer, tmp_path / "trainer.log")

        tree = [psutil.Process(boot.pid), *psutil.Process(boot.pid).children(recursive=True)]
        for p in tree:
            p.send_signal(signal.SIGKILL)
        psutil.wait_procs(tree, timeout=10)
        after_kill = tail_work()

        # Training goes on without the bootstrap peer ...
        _wait_for(lambda: tail_work() >= after_kill + 4, 90, "training after the bootstrap died", trainer,
                  tmp_path / "trainer.log")
        # ... and a newcomer joins through the head's announced address.
        entry = _summary(summaries[0])["maddrs"][0]
        joiner_summary = tmp_path / "joiner.json"
        joiner = _agora("node", "--manifest", "tiny", "--stage", "1", "--initial-peers", entry,
                        "--rebalance-every", "0", "--summary", str(joiner_summary), log=tmp_path / "joiner.log")
        procs.append(joiner)
        _wait_for(lambda: _serving(joiner_summary), 120, "the joiner to serve", joiner, tmp_path / "joiner.log")
        # The head routes to it: it gets work of its own.
        _wait_for(lambda: _summary(joiner_summary).get("counters", {}).get("forward", 0) >= 1, 90,
                  "the joiner to get work", joiner, tmp_path / "joiner.log")
        assert trainer.poll() is None, (tmp_path / "trainer.log").read_text()[-2000:]
    finally:
        _cleanup(*reversed(procs))
