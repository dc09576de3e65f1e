"""UPM through the raw CLI: the replica that draws a boundary's rotations is SIGKILLed (its whole process group, no
leave announcement) while a rotation it drew is accepted but not yet applied anywhere. The survivors apply it at its
step (none late), the surviving replica of the drawing stage takes over the drawing once the dead peer's record
expires, and both stages stay in one frame while the trainer keeps training. (The drawer delivers a rotation right
after drawing it, so this does not exercise the relay by other holders; ``tests/test_upm_swarm.py`` covers a drawer
that leaves.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from agora.config import load_manifest
from swarm_util import kill_started

pytestmark = pytest.mark.slow

LEAD_STEPS = 10  # a drawn rotation waits this many optimizer steps: the window in which the drawer is killed
MARGIN_STEPS = 6  # killed at least this many steps before the rotation applies


def _agora(*args: str, log: Path) -> subprocess.Popen:
    # Its own session, like a process started from a shell: the kill takes its whole group (DHT, p2pd, averager).
    return subprocess.Popen([sys.executable, "-m", "agora.cli", *args], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _read(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet, or being replaced
        return None


def _wait(predicate, timeout: float, what: str, procs: dict[str, subprocess.Popen], logs: Path):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        for name, proc in procs.items():
            if proc.poll() is not None:
                tail = (logs / f"{name}.log").read_text()[-3000:]
                raise AssertionError(f"{what}: {name} exited ({proc.returncode}):\n{tail}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out ({timeout:.0f} s) waiting for {what}; summaries: "
                                 + json.dumps({n: _brief(_read(logs / f"{n}.json")) for n in procs}))
        time.sleep(0.25)


def _brief(s: Optional[dict]) -> Optional[dict]:
    if not s or s.get("role") != "node":
        return s and {k: s.get(k) for k in ("microbatches", "steps", "tokens") if k in s}
    return {"stage": s["stage"], "state": s["state"], "step": s["step"], "upm": s["upm"],
            "fingerprint": s["fingerprint"]}


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def test_the_drawer_sigkilled_mid_rotation_leaves_both_stages_in_one_frame(tmp_path):
    man = load_manifest("tiny").with_overrides(**{
        "optimizer.total_steps": 400,
        "security.upm": {"every_s": 2.0, "lead_steps": LEAD_STEPS}})
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(man.to_yaml())
    maddr = tmp_path / "boot.maddr"
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["boot"] = _agora("bootstrap", "--manifest", str(manifest), "--maddr-file", str(maddr),
                               log=tmp_path / "boot.log")
        _wait(lambda: maddr.exists() and maddr.read_text().strip(), 60, "the bootstrap peer", procs, tmp_path)
        peer = maddr.read_text().split()[0]
        for name, stage in (("s0a", 0), ("s0b", 0), ("s1a", 1), ("s1b", 1)):
            procs[name] = _agora("node", "--manifest", str(manifest), "--stage", str(stage), "--initial-peers", peer,
                                 "--rebalance-every", "0", "--averaging-timeout", "10", "--threads", "1",
                                 "--summary", str(tmp_path / f"{name}.json"), log=tmp_path / f"{name}.log")
        nodes = ["s0a", "s0b", "s1a", "s1b"]
        summary = {n: (lambda n=n: _read(tmp_path / f"{n}.json")) for n in nodes}
        _wait(lambda: all((summary[n]() or {}).get("state") == "serving" for n in nodes), 180, "four nodes serving",
              procs, tmp_path)
        procs["trainer"] = _agora("train", "--manifest", str(manifest), "--initial-peers", peer,
                                  "--max-tokens", str(10**8), "--summary", str(tmp_path / "trainer.json"),
                                  log=tmp_path / "trainer.log")

        # The drawer of boundary 0 with a rotation it drew accepted and due at least MARGIN_STEPS ahead, after at
        # least one rotation went through (so the kill is not at the start).
        def drawer_mid_rotation():
            for n in ("s0a", "s0b"):
                s = summary[n]()
                if s and s["upm"]["epoch_out"] >= 1:
                    due = [d for d in s["upm"]["due"]
                           if d[0] == 0 and d[3] == s["peer_id"] and d[2] - s["step"] >= MARGIN_STEPS]
                    if due:
                        return n, s, due[0]
            return None

        victim, at_kill, (_, epoch, apply_step, _) = _wait(drawer_mid_rotation, 240, "the drawer mid-rotation",
                                                          procs, tmp_path)
        _kill_group(procs[victim])
        t_kill = time.time()
        procs.pop(victim)
        survivor = "s0b" if victim == "s0a" else "s0a"
        survivors = [survivor, "s1a", "s1b"]
        # The first summaries written after the kill: nobody had applied the rotation yet (it was mid-rotation).
        first = _wait(lambda: (lambda s: s if all(v and v["time"] > t_kill for v in s.values()) else None)(
            {n: summary[n]() for n in survivors}), 30, "the survivors' summaries after the kill", procs, tmp_path)
        drawn_before = first[survivor]["upm"]["drawn"]
        steps_at_kill = {n: first[n]["step"] for n in survivors}
        assert first[survivor]["upm"]["epoch_out"] < epoch, first[survivor]["upm"]
        assert all(first[n]["upm"]["epoch_in"] < epoch for n in ("s1a", "s1b")), first

        # The dead drawer's rotation is applied by every survivor at its step, and the survivor of stage 0 draws the
        # next ones (after the dead peer's record expires) which reach stage 1 too.
        def moved_on():
            s = {n: summary[n]() for n in survivors}
            if not all(s.values()) or s[survivor]["upm"]["drawn"] <= drawn_before:
                return None
            out0 = s[survivor]["upm"]["epoch_out"]
            ins = {s[n]["upm"]["epoch_in"] for n in ("s1a", "s1b")}
            return s if ins == {out0} and out0 > epoch else None

        # (epochs go one by one, so a survivor past ``epoch`` applied the dead drawer's rotation first)
        after = _wait(moved_on, 180, f"stage 1 to follow the survivor's rotations past frame {epoch}", procs,
                      tmp_path)
        # Stage 1's replicas agree bit for bit (summaries are written every 2 s: compare at one step).
        def stage1_agrees():
            a, b = summary["s1a"](), summary["s1b"]()
            return (a and b and a["step"] == b["step"] and a["fingerprint"] != 0.0
                    and a["fingerprint"] == b["fingerprint"] and a["upm"]["epoch_in"] == b["upm"]["epoch_in"])

        _wait(stage1_agrees, 90, "stage 1's replicas to agree", procs, tmp_path)
    finally:
        kill_started(list(procs.values()))

    print(f"killed {victim} at step {at_kill['step']} with frame {epoch} of boundary 0 due after step {apply_step}; "
          f"after: " + json.dumps({n: _brief(v) for n, v in after.items()}))
    # Everyone took steps after the kill: only the trainer's microbatches make steps, so the pipeline kept training.
    for n in survivors:
        assert after[n]["step"] >= steps_at_kill[n] + 2, (n, steps_at_kill[n], after[n]["step"])
    # No survivor applied a rotation after its step had passed (which would need a state download to repair).
    assert all(after[n]["upm"]["late"] == 0 for n in survivors), {n: after[n]["upm"] for n in survivors}
    assert after[survivor]["upm"]["drawn"] > drawn_before
