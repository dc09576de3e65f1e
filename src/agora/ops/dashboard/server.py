"""The dashboard server: polls the DHT, keeps a short history in memory, serves one page and one JSON API.

Why a server at all (instead of the page talking to the swarm): browsers cannot speak libp2p, and one poller per
dashboard keeps DHT load independent of how many people watch. DHT calls block (hivemind answers through futures
bounded by ``DHT_TIMEOUT_S``), so they run in a one-thread executor and the aiohttp loop stays responsive while a
slow DHT read is in progress. Everything the page shows comes from ``swarm_status`` plus what only a watcher over
time can know: tokens/s (a rate), loss over time, and events (joins, leaves, state changes, bans) found by
diffing successive snapshots.

Peer ids, states and ban reasons are written into the DHT by untrusted peers; the page only ever inserts them as
text (never as HTML), and the Content-Security-Policy forbids any network access except this server's API.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import importlib.resources
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from aiohttp import web

logger = logging.getLogger("agora.ops.dashboard")

RATE_WINDOW_S = 10.0  # tokens/s is averaged over this window: trainers announce their totals every ~2.5 s
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
       "img-src data:; base-uri 'none'; form-action 'none'")


def finite_or_none(value: Any) -> Any:
    """JSON-safe copy: NaN/Inf become null (``JSON.parse`` rejects Python's ``NaN``)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def _short(peer_id: str) -> str:
    return str(peer_id)[-8:]


def _peers(snap: dict) -> dict[str, dict]:
    return {p["peer_id"]: dict(p, stage=st["stage"]) for st in snap.get("stages", []) for p in st.get("peers", [])}


def _serving(stage: dict) -> int:
    return sum(p.get("state") == "serving" for p in stage.get("peers", []))


def _ban_id(ban: dict) -> str:
    return json.dumps({k: v for k, v in ban.items() if k not in ("updated", "time", "t")}, sort_keys=True, default=str)


def diff_events(prev: Optional[dict], snap: dict, now: float) -> list[dict]:
    """Events that explain how ``snap`` differs from ``prev`` (``prev=None``: the dashboard's first look)."""
    events: list[dict] = []

    def add(kind: str, text: str, level: str = "info", **extra: Any) -> None:
        events.append({"t": now, "kind": kind, "level": level, "text": text, **extra})

    old, new = _peers(prev) if prev else {}, _peers(snap)
    for pid, p in new.items():
        if pid not in old:
            verb = "joined" if prev else "found"
            add("join", f"{_short(pid)} {verb} stage {p['stage']} ({p['state']})", peer=pid, stage=p["stage"])
        else:
            o = old[pid]
            if o["stage"] != p["stage"]:
                add("move", f"{_short(pid)} moved from stage {o['stage']} to {p['stage']}", peer=pid, stage=p["stage"])
            if o["state"] != p["state"]:
                level = "warn" if p["state"] == "leaving" else "info"
                add("state", f"{_short(pid)} {o['state']} → {p['state']}", level, peer=pid, stage=p["stage"],
                    state=p["state"])
    for pid, o in old.items():
        if pid not in new:
            if o["state"] == "leaving":
                add("leave", f"{_short(pid)} left stage {o['stage']}", peer=pid, stage=o["stage"])
            else:
                add("leave", f"{_short(pid)} vanished from stage {o['stage']} (record expired: crash or network)",
                    "bad", peer=pid, stage=o["stage"])
    if prev:
        for st_old, st_new in zip(prev.get("stages", []), snap.get("stages", [])):
            if _serving(st_old) and not _serving(st_new):
                add("stage", f"stage {st_new['stage']} has no serving peer: the pipeline is stalled", "bad",
                    stage=st_new["stage"])
            elif not _serving(st_old) and _serving(st_new):
                add("stage", f"stage {st_new['stage']} has a serving peer", stage=st_new["stage"])
    old_t = {t.get("peer_id"): t for t in (prev or {}).get("trainers", [])}
    new_t = {t.get("peer_id"): t for t in snap.get("trainers", [])}
    for pid in new_t.keys() - old_t.keys():
        add("trainer", f"trainer {_short(pid)} {'joined' if prev else 'found'}", peer=pid)
    for pid in old_t.keys() - new_t.keys():
        add("trainer", f"trainer {_short(pid)} left", peer=pid)
    old_bans = {_ban_id(b) for b in (prev or {}).get("bans", [])}
    for ban in snap.get("bans", []):
        if _ban_id(ban) not in old_bans:
            target = ban.get("peer") or ban.get("peer_id") or ban.get("banned") or "?"
            reason = ban.get("reason") or ban.get("code") or ""
            add("ban", f"{_short(ban.get('publisher', '?'))} banned {_short(str(target))}"
                       + (f": {reason}" if reason else ""), "bad", peer=str(target))
    return events


def swarm_loss(snap: dict) -> Optional[float]:
    """The trainers' latest loss (mean over trainers), else the tail stage's loss EMA."""
    losses = [float(t["loss"]) for t in snap.get("trainers", [])
              if isinstance(t.get("loss"), (int, float)) and math.isfinite(t["loss"])]
    if not losses and snap.get("stages"):
        losses = [float(p["metrics"]["loss"]) for p in snap["stages"][-1].get("peers", [])
                  if isinstance((p.get("metrics") or {}).get("loss"), (int, float))
                  and math.isfinite(p["metrics"]["loss"])]
    return sum(losses) / len(losses) if losses else None


class DashboardState:
    """Latest snapshot, a bounded history and a bounded event log; fed by ``update``, read by ``payload``."""

    def __init__(self, layout: Sequence[int] = (), history: int = 1200, events: int = 300):
        self.layout = list(layout)
        self.snapshot: Optional[dict] = None
        self.history: collections.deque = collections.deque(maxlen=history)
        self.events: collections.deque = collections.deque(maxlen=events)
        self.polls = 0
        self.errors = 0
        self.last_error: Optional[str] = None
        self.updated = 0.0
        self.started = time.time()
        self._trainer_tokens: dict[str, int] = {}
        self._tokens = 0  # monotonic: survives trainers leaving (their records vanish with their totals)

    def update(self, snap: dict, now: Optional[float] = None) -> None:
        now = time.time() if now is None else now
        for event in diff_events(self.snapshot, snap, now):
            self.events.append(event)
        for t in snap.get("trainers", []):
            pid, tokens = str(t.get("peer_id")), int(t.get("tokens") or 0)
            self._tokens += max(0, tokens - self._trainer_tokens.get(pid, 0))
            self._trainer_tokens[pid] = max(tokens, self._trainer_tokens.get(pid, 0))
        rate = 0.0
        older = [h for h in self.history if now - h["t"] >= RATE_WINDOW_S]
        base = older[-1] if older else (self.history[0] if self.history else None)
        if base is not None and now > base["t"]:
            rate = (self._tokens - base["tokens"]) / (now - base["t"])
        self.history.append({
            "t": now, "tokens": self._tokens, "tokens_per_s": rate, "loss": swarm_loss(snap),
            "serving": sum(_serving(st) for st in snap.get("stages", [])),
        })
        self.snapshot = snap
        self.polls += 1
        self.updated = now
        self.last_error = None

    def failed(self, err: BaseException, now: Optional[float] = None) -> None:
        now = time.time() if now is None else now
        self.errors += 1
        if self.last_error is None:  # one event per streak of failures, not one per poll
            self.events.append({"t": now, "kind": "dashboard", "level": "warn", "text": f"DHT read failed: {err!r}"})
        self.last_error = repr(err)

    def payload(self) -> dict:
        snap = self.snapshot or {"stages": [], "trainers": [], "bans": [], "microbatches": {}, "tokens": 0}
        last = self.history[-1] if self.history else {}
        return finite_or_none({
            **snap,
            "ready": self.snapshot is not None,
            "layout": self.layout,
            "tokens_per_s": last.get("tokens_per_s", 0.0),
            "loss": last.get("loss"),
            "tokens_seen": self._tokens,
            "history": list(self.history),
            "events": list(self.events)[-100:][::-1],  # newest first
            "dashboard": {"polls": self.polls, "errors": self.errors, "last_error": self.last_error,
                          "updated": self.updated, "started": self.started, "now": time.time()},
        })


def write_json(path: str, data: dict) -> None:
    """Write ``data`` atomically (readers such as the demo's summariser never see half a file)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(finite_or_none(data), indent=1, default=str))
    os.replace(tmp, target)


def index_html() -> str:
    return importlib.resources.files("agora.ops.dashboard").joinpath("index.html").read_text(encoding="utf-8")


def make_app(state: DashboardState) -> web.Application:
    page = index_html()

    async def index(request: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store", "Content-Security-Policy": CSP})

    async def api(request: web.Request) -> web.Response:
        body = json.dumps(state.payload(), allow_nan=False)
        return web.Response(text=body, content_type="application/json", headers={"Cache-Control": "no-store"})

    app = web.Application()
    app.router.add_get("/", index)
    app.router.add_get("/api/swarm", api)
    return app


async def poll_forever(state: DashboardState, fetch: Callable[[], dict], interval: float,
                       executor: concurrent.futures.Executor) -> None:
    """Call the blocking ``fetch`` in ``executor`` every ``interval`` seconds and feed the results to ``state``."""
    loop = asyncio.get_running_loop()
    while True:
        t0 = time.monotonic()
        try:
            state.update(await loop.run_in_executor(executor, fetch))
        except asyncio.CancelledError:
            raise
        except Exception as err:  # a DHT hiccup: keep the last snapshot, say so, retry next tick
            logger.warning(f"swarm status failed: {err!r}")
            state.failed(err)
        await asyncio.sleep(max(0.1, interval - (time.monotonic() - t0)))


def run_dashboard(manifest, initial_peers: Sequence[str], host: str = "127.0.0.1", port: int = 8080,
                  interval: float = 1.5, summary: Optional[str] = None, dht_host: str = "127.0.0.1",
                  dht_netns: Optional[str] = None) -> int:
    """Join the DHT as a client, serve the dashboard until SIGTERM/SIGINT, then leave cleanly (exit code 0).

    ``dht_host``/``dht_netns``: where the DHT client lives (see ``make_dht``). The web page is served from this
    process's own namespace, so a swarm emulated in network namespaces stays watchable from the host.
    """
    from agora.net.dht import Endpoint, install_stop_signals, make_dht
    from agora.ops.status import swarm_status

    dht = make_dht(initial_peers, Endpoint(host=dht_host, netns=dht_netns), manifest=manifest, client_mode=True,
                   writes=False)
    state = DashboardState(layout=manifest.stages)
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dashboard-dht")

    async def main() -> None:
        stop = asyncio.Event()
        install_stop_signals(asyncio.get_running_loop(), stop)
        runner = web.AppRunner(make_app(state), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        bound = runner.addresses[0][1] if runner.addresses else port  # --port 0: the OS picked a free one
        print(f"dashboard at http://{host}:{bound}/", flush=True)
        poller = asyncio.create_task(poll_forever(state, lambda: swarm_status(dht, manifest), interval, executor))
        try:
            await stop.wait()
        finally:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
            await runner.cleanup()

    try:
        asyncio.run(main())
    finally:
        executor.shutdown(wait=False)  # a DHT read in flight ends by its own timeout; do not wait for it
        dht.shutdown()
        if summary:
            write_json(summary, {"role": "dashboard", "polls": state.polls, "errors": state.errors,
                             "events": list(state.events), "history": list(state.history)[-300:],
                             "last_snapshot": finite_or_none(state.snapshot), "time": time.time()})
    return 0
