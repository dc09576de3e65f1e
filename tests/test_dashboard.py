"""Browser test of the live dashboard against a real local swarm (separate OS processes on 127.0.0.1).

Headless Chromium renders the page (its JavaScript fetches /api/swarm); the DOM must show every stage column and
every live peer with its step, exactly as the API reports them. A screenshot is kept in test-artifacts/.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import psutil
import pytest

from agora.config import load_manifest
from agora.lab.demo import Child, LocalAuthority, Swarm
from agora.net.dht import make_dht, visible_maddrs
from swarm_util import leftover_children

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
BROWSER_SESSIONS: list[int] = []  # chromium runs, each in its own session: checked for leftovers too
# $AGORA_CHROMIUM picks another browser binary (or, pointing nowhere, forces the skip).
_CANDIDATES = [os.environ["AGORA_CHROMIUM"]] if os.environ.get("AGORA_CHROMIUM") else [
    shutil.which("chromium"), shutil.which("chromium-browser"), "/usr/bin/chromium"]
CHROMIUM = next((p for p in _CANDIDATES if p and os.path.exists(p)), None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="headless chromium not found (`make install` as root installs it with apt; "
                             "or set AGORA_CHROMIUM=/path/to/chromium)"
)


class _Elements(HTMLParser):
    """Every start tag of a document as (tag, attributes)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.found.append((tag, {k: v or "" for k, v in attrs}))


def _elements(html: str) -> list[tuple[str, dict[str, str]]]:
    parser = _Elements()
    parser.feed(html)
    return parser.found


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def _wait_for_url(child: Child, timeout: float) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        match = re.search(r"dashboard at (http://127\.0\.0\.1:\d+/)", child.log.read_text(errors="replace"))
        if match:
            return match.group(1)
        assert child.alive, f"dashboard exited early:\n{child.log.read_text()[-3000:]}"
        time.sleep(0.2)
    raise TimeoutError(f"dashboard did not start within {timeout:.0f}s:\n{child.log.read_text()[-3000:]}")


def _wait_for_swarm(url: str, n_stages: int, swarm: Swarm, timeout: float) -> dict:
    """Until every stage has a serving peer and a trainer has delivered tokens (so the charts have data)."""
    deadline = time.time() + timeout
    data: dict = {}
    while time.time() < deadline:
        dead = [c for c in swarm.children if not c.alive]
        assert not dead, f"{dead[0].name} exited early:\n{dead[0].log.read_text()[-3000:]}"
        data = _get_json(url + "api/swarm")
        stages = data.get("stages", [])
        if (len(stages) == n_stages and all(any(p["state"] == "serving" for p in st["peers"]) for st in stages)
                and data.get("tokens", 0) > 0 and len(data.get("history", [])) >= 4):
            return data
        time.sleep(0.5)
    raise TimeoutError(f"swarm not ready within {timeout:.0f}s; last /api/swarm: {json.dumps(data)[:2000]}")


def _chromium(url: str, *args: str, timeout: float = 60) -> str:
    with tempfile.TemporaryDirectory() as profile:
        cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--virtual-time-budget=6000", *args, url]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        BROWSER_SESSIONS.append(proc.pid)
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:  # hung browser: kill its whole session (renderer/zygote helpers too) by PID
                os.killpg(proc.pid, 9)
                proc.wait()
        assert proc.returncode == 0, f"chromium failed ({proc.returncode}): {err.decode(errors='replace')[-2000:]}"
        return out.decode(errors="replace")


def _session_leftovers(pids: list[int]) -> list[psutil.Process]:
    """Live processes in the sessions of the children we started (each child leads its own session)."""
    left = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) in pids and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return left


def test_dashboard_renders_live_swarm(tmp_path: Path) -> None:
    # An invitation-only run (signed manifest, a certified key per process, as `agora demo --allow-list` makes it):
    # the page can only show peers whose certified records the dashboard's validators accepted, and the trainer's
    # work only flows if every stage authorises its certified callers.
    authority = LocalAuthority(tmp_path / "keys")
    man = authority.secure(load_manifest("tiny"))
    manifest_path = tmp_path / "manifest.yaml"
    manifest_path.write_text(man.to_yaml())
    authority.sign(manifest_path)
    # Nodes measure their curvature every step: the cards show lr x lambda against the threshold.
    swarm = Swarm(manifest_path, tmp_path / "swarm", authority=authority, extra_node_args=["--curvature-every", "1"])
    dash: Child | None = None
    # The bootstrap DHT lives in this process (one interpreter fewer to start on a busy machine); nodes, trainer and
    # dashboard are real processes, each in its own session, started together.
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    boot = make_dht()
    try:
        swarm.maddr = maddr = visible_maddrs(boot)[0]
        dash = swarm._spawn("dashboard", ["--manifest", str(manifest_path), "--initial-peers", maddr,
                                          "--port", "0", "--interval", "1"])
        for s in range(man.n_stages):
            swarm.start_node(s)
        swarm.start_trainer(0, 1, in_flight=2, val_batches=0)
        url = _wait_for_url(dash, timeout=45)
        data = _wait_for_swarm(url, man.n_stages, swarm, timeout=50)

        page = urllib.request.urlopen(url, timeout=5)
        assert "connect-src 'self'" in page.headers["Content-Security-Policy"]  # no CDN, no third party
        assert "<script src" not in page.read().decode()

        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "dashboard.png"
        shot.unlink(missing_ok=True)
        dom = _chromium(url, "--dump-dom", f"--screenshot={shot}", "--window-size=1280,900", "--hide-scrollbars")
        assert shot.exists() and shot.stat().st_size > 10_000
        elements = _elements(dom)
        stage_cols = {a["data-stage"]: a for tag, a in elements if tag == "section" and "data-stage" in a}
        cards = {a["data-peer"]: a for tag, a in elements if "data-peer" in a}
        assert sorted(stage_cols) == [str(s) for s in range(man.n_stages)], dom[-3000:]
        assert 'data-ready="true"' in dom
        for stage in data["stages"]:
            for peer in stage["peers"]:
                card = cards.get(peer["peer_id"])
                assert card is not None, f"peer {peer['peer_id']} missing from the page"
                assert card["data-stage"] == str(stage["stage"])
                assert re.fullmatch(r"\d+", card["data-step"]), card
                assert card["data-state"] in ("joining", "syncing", "serving", "leaving")
        assert all("data-consensus" in a for a in stage_cols.values()), stage_cols
        assert sum("data-utilisation" in a for _, a in elements) == sum(len(st["peers"]) for st in data["stages"])
        curvature = [a for _, a in elements if "data-curvature" in a]
        assert len(curvature) == sum(len(st["peers"]) for st in data["stages"]), dom[-3000:]
        assert sum(a.get("data-bottleneck") == "true" for a in stage_cols.values()) <= 1
        assert any("data-trainer" in a for _, a in elements)
        assert any(tag == "path" for tag, _ in elements)  # the charts drew their lines
    finally:
        if dash is not None:
            swarm.stop([dash], 15)
        swarm.stop([c for c in swarm.children if c is not dash], 30)  # all at once: SIGTERM, wait, kill the rest
        boot.shutdown()
        pids = [c.proc.pid for c in swarm.children] + BROWSER_SESSIONS
        deadline = time.time() + 10
        while _session_leftovers(pids) and time.time() < deadline:
            time.sleep(0.2)
    assert not _session_leftovers(pids), "processes left behind"
    assert not leftover_children(before), "processes of the in-process bootstrap DHT left behind"
    assert dash.proc.returncode == 0, dash.log.read_text()[-3000:]  # SIGTERM: clean exit
    summary = json.loads(dash.summary.read_text())
    assert summary["role"] == "dashboard" and summary["polls"] > 0


def _peer(stage: int, n: int, reachability: str) -> dict:
    pid = f"Qm{'x' * 36}{stage}{n:07d}"
    return {"peer_id": pid, "short_id": pid[-8:], "state": "serving", "throughput": 100.0, "step": 3, "samples": 0,
            "queue": 0, "metrics": {"forward": 5, "tokens": 640, "bytes_out": 1000}, "addrs": [],
            "reachability": reachability, "claimed": 5, "acknowledged": 5}


def test_dashboard_flags_relayed_peers_and_a_boundary_relayed_on_both_sides(tmp_path: Path) -> None:
    """Peers nobody can dial carry a "relayed" mark; a boundary with such a peer on both sides (the two cannot
    connect to each other) is flagged; a boundary with one on one side only is not. Rendered by the real page from a
    status snapshot built by hand (ops/status.py computes the flag), served by the dashboard's own app."""
    import asyncio
    import socket
    import threading

    from aiohttp import web

    from agora.ops.dashboard.server import DashboardState, make_app
    from agora.ops.status import relayed_boundaries

    stages = [{"stage": s, "capacity_tokens_per_s": 100.0, "consensus_distance": None,
               "peers": [_peer(s, 0, "relayed" if s in (0, 1) else "direct"), _peer(s, 1, "direct")]}
              for s in range(3)]
    snap = {"run_id": "flags", "manifest_hash": "h", "time": time.time(), "stages": stages, "bottleneck_stage": 0,
            "trainers": [], "tokens": 0, "microbatches": {}, "bans": [], "relayed_boundaries": relayed_boundaries(stages)}
    assert [f["boundary"] for f in snap["relayed_boundaries"]] == [0]  # 0->1 relayed on both sides, 1->2 not
    state = DashboardState(layout=[1, 1, 1])
    state.update(snap)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(make_app(state))
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        dom = _chromium(f"http://127.0.0.1:{port}/", "--dump-dom")
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.run_until_complete(runner.cleanup())
        loop.close()
    assert dom.count('data-relayed="1"') == 2, dom[-3000:]
    flagged = re.findall(r'data-boundary="(\d-\d)"[^>]*>(?:(?!data-boundary=).)*?data-relayed-boundary="1"', dom, re.S)
    assert flagged == ["0-1"], flagged
    assert dom.count('data-relayed-boundary="1"') == 1
