"""``agora demo``: a whole swarm on this machine, as separate OS processes.

It starts a bootstrap peer, ``stages x replicas`` stage nodes and the trainers, trains until the stop rule holds
(every stage at ``steps`` optimizer steps, or ``tokens`` tokens, or ``train_seconds`` of training), shows live
progress, stops everything cleanly, and writes ``summary.json``, ``loss.png`` and ``report.html``. Optionally it
kills stage peers at random (chaos), emulates slow internet links, or runs invitation-only.

This module orchestrates one run (:class:`DemoRun`); the processes live in :mod:`agora.lab.processes`, the setup
(manifest, authority, link plan) in :mod:`agora.lab.demo_setup`, the measurements in :mod:`agora.lab.demo_summary`.
``docs/DEMO.md`` explains chaos, the two link-emulation backends and the summary's fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import psutil
from rich.console import Console
from rich.live import Live
from rich.table import Table

from agora.config import Manifest
from agora.lab import netem
from agora.lab.cpu_meter import SwarmMeter
from agora.lab.demo_setup import (LINK_BACKENDS, LinkPlan, LocalAuthority, averaging_section, demo_manifest,
                                  even_split, plan_links)
from agora.lab.demo_summary import (RunRecord, measure_replica_divergence, settling_point, summarize,
                                   timeline_point)
from agora.lab.processes import Child, Swarm, read_json
from agora.lab.train_local import tokens_per_step

logger = logging.getLogger("agora.demo")

ORPHAN_GRACE_S = 5.0  # a killed peer's helpers must exit on their own within this
CHAOS_FAULTS = ("kill", "kill-main", "stop", "kill-bootstrap", "mixed")
MIXED_FAULTS = ("kill-bootstrap", "kill", "stop", "kill-main")  # ``mixed`` takes these in turn

__all__ = [  # the setup and process classes stay importable from here, where callers have always found them
    "ChaosOptions", "Child", "DemoOptions", "DemoRun", "LINK_BACKENDS", "LinkOptions", "LinkPlan", "LocalAuthority",
    "NodeExtras", "StopRule", "Swarm", "SwarmShape", "averaging_section", "demo_manifest", "even_split",
    "measure_replica_divergence", "plan_links", "progress_table", "read_json", "run_demo", "summarize",
]

console = Console(stderr=True)

STATUS_GIVE_UP_S = 120.0  # the demo fails when it could not read the swarm's status from the DHT for this long
LAYOUT_TIMEOUT_S = 180.0  # every stage must serve with all its replicas this soon after the nodes start
TRAINER_LEAVE_S = 120.0  # exact_tokens: how long the trainers may take to validate and leave after training
SETTLE_TIMEOUT_S = 90.0  # exact_tokens: how long the stages may take to apply their last samples


@dataclass(frozen=True)
class SwarmShape:
    """What runs: the model (``preset``: a preset name or manifest YAML), its split into ``stages`` with
    ``replicas`` nodes each, and the trainers."""

    preset: str = "small"
    stages: int = 3
    replicas: int = 2
    trainers: int = 1
    in_flight: int = 2  # microbatches each trainer keeps in flight
    val_batches: int = 4  # validation microbatches each trainer runs through the swarm at the end
    eval_every_steps: int = 0  # also validate on them every this many optimizer steps (0: only at the end)
    threads: int = 1  # torch threads per process
    residual: Optional[str] = None  # "dense" or "subspace": override the preset's boundary compression
    averaging: Optional[str] = None  # replica averaging spec, e.g. "powersgd,rank=8" (see averaging_section)
    seed: Optional[int] = None  # the run's seed (None: the preset's)
    overlap_rounds: Optional[bool] = None  # batch.overlap_rounds (None: the preset's)
    upm_every_s: Optional[float] = None  # UPM: rotate every boundary's frame this often (security.upm; None: off)
    overrides: Optional[dict] = None  # any other manifest settings, dotted keys (e.g. {"optimizer.name": "nadam"})


@dataclass(frozen=True)
class StopRule:
    """Training ends at the first of: every stage at ``steps`` steps, ``tokens`` tokens, ``train_seconds`` of
    training. ``timeout`` seconds after the demo started, it gives up (a failure).

    ``exact_tokens`` (with ``tokens``): the trainers themselves stop at exactly ``tokens`` between them, and
    training ends once the stages have applied every sample (the last partial batch is stepped after the nodes'
    stall time); only then do the trainers validate. The CPU window (``cpu_window`` in the summary) ends there.
    ``steps`` then only labels the progress: the token count alone ends training. ``exact_tokens`` without
    ``tokens``: exactly ``steps`` target batches (``agora demo --compare-local``: the centralized run then trains
    the very same tokens)."""

    steps: int = 30
    tokens: Optional[int] = None
    train_seconds: Optional[float] = None
    timeout: float = 1800.0
    exact_tokens: bool = False

    def reached(self, snap: dict, trained_s: float) -> bool:
        """Whether the swarm status ``snap``, ``trained_s`` seconds after every trainer announced itself, ends training."""
        if self.exact_tokens and self.tokens is not None:
            return snap["tokens"] >= self.tokens
        return (_every_stage_at(snap, self.steps) or (self.tokens is not None and snap["tokens"] >= self.tokens)
                or (self.train_seconds is not None and trained_s >= self.train_seconds))


@dataclass(frozen=True)
class ChaosOptions:
    """Every ``every_s`` seconds (None: never) SIGKILL a random serving stage peer and start a replacement with
    ``--stage auto``; the last serving peer of a stage only with ``kill_last``. ``seed`` picks the victims.
    ``fault``: "kill" SIGKILLs the victim's whole process group; "kill-main" only its main process (as the OOM
    killer does), and the summary counts its helper processes still alive 5 s later (``chaos_orphans``); "stop"
    freezes the victim's whole process group with SIGSTOP for ``stop_s`` seconds, then SIGCONT (a laptop lid, a
    swapping machine: no replacement is started); "kill-bootstrap" SIGKILLs the bootstrap peer's process group (once;
    later joiners enter through live peers); "mixed" takes kill-bootstrap, kill, stop and kill-main in turn."""

    every_s: Optional[float] = None
    kill_last: bool = False
    seed: int = 0
    fault: str = "kill"
    stop_s: float = 40.0


@dataclass(frozen=True)
class LinkOptions:
    """Emulated internet link of every peer: uplink ``mbps`` (None: uncapped), one-way ``latency_ms``, and the
    ``backend`` (auto, netns or transport; see :func:`plan_links`). ``refuse_inbound``: stages whose first replica
    sits behind a firewall that drops inbound connections, as behind a home router (netns backend only)."""

    mbps: Optional[float] = None
    latency_ms: float = 0.0
    backend: str = "auto"
    refuse_inbound: tuple[int, ...] = ()


@dataclass(frozen=True)
class NodeExtras:
    """``agora node`` options every stage node gets: checkpoints, a checkpoint to resume from, raw ``args``;
    ``mixed_args``: more options for every second replica of each stage (a mixed swarm, ``agora demo --mixed``)."""

    checkpoint_dir: Optional[Path] = None
    checkpoint_every: int = 0
    resume: Optional[Path] = None
    args: Optional[list[str]] = None
    mixed_args: Optional[list[str]] = None

    def replica_argv(self, replica: int) -> list[str]:
        """The options of replica ``replica`` of a stage beyond ``argv``: ``mixed_args`` for the odd ones."""
        return list(self.mixed_args or []) if replica % 2 == 1 else []

    def argv(self) -> list[str]:
        """The arguments appended to every ``agora node`` command line."""
        extra = list(self.args or [])
        if self.checkpoint_dir is not None:
            extra += ["--checkpoint-dir", str(self.checkpoint_dir), "--checkpoint-every", str(self.checkpoint_every)]
        if self.resume is not None:
            extra += ["--resume", str(self.resume)]
        return extra


@dataclass(frozen=True)
class DemoOptions:
    """Everything a demo run is told. ``measure_divergence``: at the end, stop the trainers, let the replicas
    settle and compare their parameters. ``allow_list``: an invitation-only run
    (:class:`LocalAuthority`). ``live``: the progress table; ``dashboard_port``: also serve the dashboard there;
    ``on_tick``: called with every swarm status the demo reads."""

    out: Path = Path("runs/demo")
    shape: SwarmShape = field(default_factory=SwarmShape)
    stop: StopRule = field(default_factory=StopRule)
    chaos: ChaosOptions = field(default_factory=ChaosOptions)
    link: LinkOptions = field(default_factory=LinkOptions)
    nodes: NodeExtras = field(default_factory=NodeExtras)
    allow_list: bool = False
    measure_divergence: bool = False
    live: bool = True
    dashboard_port: Optional[int] = None
    on_tick: Optional[Callable[[dict], None]] = None
    sample_prompt: str = "The state of the Union is"
    sample_tokens: int = 24  # after training: export the model to OUT/model and continue sample_prompt (0: skip)

    @classmethod
    def from_flat(cls, **settings: Any) -> "DemoOptions":
        """From ``run_demo``'s flat keyword names: ``preset=``, ``steps=``, ``chaos=``, ``link_mbps=`` ..."""
        groups: dict[str, dict[str, Any]] = {}
        top: dict[str, Any] = {}
        for name, value in settings.items():
            if name in _FLAT_NAMES:
                group, attribute = _FLAT_NAMES[name]
                groups.setdefault(group, {})[attribute] = value
            elif name in _TOP_LEVEL:
                top[name] = value
            else:
                raise TypeError(f"run_demo() got an unexpected keyword argument {name!r}")
        return cls(**top, **{group: _GROUP_TYPES[group](**values) for group, values in groups.items()})


_GROUP_TYPES = {"shape": SwarmShape, "stop": StopRule, "chaos": ChaosOptions, "link": LinkOptions,
                "nodes": NodeExtras}
_TOP_LEVEL = {f.name for f in dataclasses.fields(DemoOptions)} - set(_GROUP_TYPES)
_FLAT_NAMES = {  # run_demo's flat keyword -> (group, attribute)
    **{name: ("shape", name) for name in ("preset", "stages", "replicas", "trainers", "in_flight", "val_batches",
                                          "threads", "residual", "averaging")},
    **{name: ("stop", name) for name in ("steps", "tokens", "train_seconds", "timeout", "exact_tokens")},
    **{name: ("nodes", name) for name in ("checkpoint_dir", "checkpoint_every", "resume")},
    "node_args": ("nodes", "args"),
    "chaos": ("chaos", "every_s"), "chaos_last": ("chaos", "kill_last"), "seed": ("chaos", "seed"),
    "chaos_fault": ("chaos", "fault"),
    "link_mbps": ("link", "mbps"), "link_latency_ms": ("link", "latency_ms"), "link_backend": ("link", "backend"),
}


def run_demo(options: Optional[DemoOptions] = None, /, **settings: Any) -> dict:
    """Run a local swarm as ``options`` say (or ``settings``, the flat keywords of :meth:`DemoOptions.from_flat`)
    and return its summary, also written to ``OUT/summary.json`` with ``OUT/report.html``. The summary's
    ``finished`` is False when the stop rule did not hold within the timeout."""
    if options is None:
        options = DemoOptions.from_flat(**settings)
    elif settings:
        raise TypeError("run_demo() takes DemoOptions or keyword settings, not both")
    return DemoRun(options).run()


class DemoRun:
    """One demo run: its processes, the demo's own DHT client, and what it observed (``record``)."""

    def __init__(self, options: DemoOptions):
        self.options = options
        self.out = Path(options.out)
        self.manifest, self.manifest_path, self.authority, self.operator_key = _write_manifest(options, self.out)
        if options.stop.exact_tokens and options.stop.tokens is None:
            tokens = options.stop.steps * tokens_per_step(self.manifest)
            options = self.options = dataclasses.replace(options, stop=dataclasses.replace(options.stop, tokens=tokens))
        link = options.link
        self.plan = plan_links(link.mbps, link.latency_ms, link.backend)
        if link.refuse_inbound:
            _check_refuse_inbound(link.refuse_inbound, self.plan.backend, self.manifest.n_stages)
        console.print(self.plan.describe())
        self.rng = random.Random(options.chaos.seed)
        self.killed_helpers: list[tuple[list, float]] = []  # (helpers of a kill-main victim, when they must be gone)
        self.frozen: list[tuple[Child, float]] = []  # ("stop" victims, when they get SIGCONT)
        self.record = RunRecord(t0=time.time())
        self.topology: Optional[netem.NetnsTopology] = None
        self.observer: Optional[netem.NetnsPeer] = None  # the namespace of the demo's own DHT client (netns)
        self.swarm: Optional[Swarm] = None
        self.dashboard: Optional[Child] = None
        self.dht = None
        self.cpu: Optional[SwarmMeter] = None  # the training window's CPU, every process of the swarm
        self.settled: Optional[bool] = None  # exact_tokens: the stages applied every sample before the end

    def run(self) -> dict:
        """Start, train, stop (also on errors, Ctrl-C and SIGTERM), then write and return the summary."""
        with _sigterm_raises():
            try:
                self.start()
                self.record.finished = self.train()
                self.after_training()
            finally:
                self.stop()
        self.record.wall_s = time.time() - self.record.t0
        return self.write_summary()

    def start(self) -> None:
        """Namespaces (netns links), the bootstrap peer, the demo's DHT client, every stage node and the dashboard;
        then, once every stage serves with all its replicas, the trainers."""
        shape = self.options.shape
        if self.plan.backend == "netns":
            self.topology = _enter_topology(self.plan)
        env = {"AGORA_LINK": self.plan.agora_link} if self.plan.agora_link else {}
        self.swarm = Swarm(self.manifest_path, self.out, threads=shape.threads,
                           extra_node_args=self.options.nodes.argv(), env=env, topology=self.topology,
                           authority=self.authority)
        maddr = self.swarm.start_bootstrap()
        self.dht = self._connect(maddr)
        for stage in range(self.manifest.n_stages):
            for replica in range(shape.replicas):
                self.swarm.start_node(stage, refuse_inbound=replica == 0 and stage in self.options.link.refuse_inbound,
                                      extra_args=self.options.nodes.replica_argv(replica))
        if self.options.dashboard_port is not None:
            self.dashboard = self.swarm.start_dashboard(self.options.dashboard_port)
            self.record.events.append(f"dashboard at http://127.0.0.1:{self.options.dashboard_port}/")
        _wait_for_layout(self.dht, self.manifest, shape.replicas, self.swarm, timeout=LAYOUT_TIMEOUT_S)
        self.record.train_started_s = time.time() - self.record.t0
        stop = self.options.stop
        budgets = _token_shares(stop.tokens, shape.trainers) if stop.exact_tokens and stop.tokens else None
        for i in range(shape.trainers):
            self.swarm.start_trainer(i, shape.trainers, shape.in_flight, shape.val_batches,
                                     max_tokens=budgets[i] if budgets else None,
                                     settle_s=SETTLE_TIMEOUT_S if budgets else 0.0,
                                     eval_every_steps=shape.eval_every_steps)
        # The CPU window opens when every trainer has announced itself, right before its training loop: a
        # trainer's start-up (imports, data) is no more training than a node's, or the baseline's model build.
        _wait_for_trainers(self.dht, self.manifest, shape.trainers, self.swarm, timeout=LAYOUT_TIMEOUT_S)
        self.cpu = SwarmMeter(self.swarm, self.dht)
        self.cpu.start()

    def _connect(self, maddr: str):
        """The demo's read-only DHT client. Under netns links it is a (capped) peer like any other: only its DHT
        process is forked into a namespace of its own, the demo itself stays on the host."""
        from agora.net.dht import Endpoint, make_dht

        identity = str(self.operator_key)  # a state reader of the run (``_write_manifest``)
        if self.topology is None:
            return make_dht([maddr], Endpoint(identity=identity), client_mode=True, manifest=self.manifest,
                            writes=False)
        self.observer = self.topology.add_peer()
        return make_dht([maddr], Endpoint(host=self.observer.address, netns=self.observer.netns, identity=identity),
                        client_mode=True, manifest=self.manifest, writes=False)

    def train(self) -> bool:
        """Read the swarm's status about every second until the stop rule holds (True) or the timeout passes
        (False): record it, show it, and let chaos kill on schedule. Fails when a trainer exits early."""
        opts = self.options
        # Faults and ``StopRule.train_seconds`` count from here, once every trainer has announced itself: a trainer's
        # slow start-up neither eats the training window nor pushes faults out of it.
        training_since = time.time()
        view_context = (Live(console=console, refresh_per_second=2, transient=False) if opts.live
                        else contextlib.nullcontext())
        try:
            with view_context as view:
                return self._train_loop(view, training_since)
        finally:
            if opts.live and not console.is_terminal:
                console.line()  # rich leaves a non-terminal Live's last line open: end it before the next print

    def _train_loop(self, view: Optional[Live], training_since: float) -> bool:
        opts, record = self.options, self.record
        every = opts.chaos.every_s
        next_kill = training_since + every if every else None
        deadline = record.t0 + opts.stop.timeout
        last_read = time.time()
        while time.time() < deadline:
            snap = self._read_status(last_read)
            if snap is None:
                time.sleep(1.0)
                continue
            last_read = time.time()
            self._observe(snap, view)
            self.cpu.tick()
            finished_at = self._trainers_finished()
            if opts.stop.reached(snap, time.time() - training_since) or finished_at is not None:
                if opts.stop.exact_tokens and opts.stop.tokens:
                    self.cpu.mark()
                    self.settled = self._wait_settled(snap, deadline, finished_at or 0.0)
                self.cpu.end()  # before anything stops
                if self.settled:
                    self._show_settled(view)
                return True
            dead = [c for c in self.swarm.trainers() if not c.alive and self._trained_share(c) is None]
            if dead:
                raise RuntimeError(f"trainer {dead[0].name} exited early; see {dead[0].log}")
            self.thaw()
            # On a fixed schedule (every ``every`` s from the start of training), so slow status reads or a
            # slow fault do not push later faults out of a run of fixed length; never two in a row. A fault
            # with no peer to hit (every stage down to its last serving replica, a thawed peer still re-syncing)
            # is tried again at the next read instead of being skipped.
            if next_kill and time.time() >= next_kill and self.chaos_kill(snap):
                next_kill = max(next_kill + every, time.time() + every / 2)
            time.sleep(1.0)
        return False

    def _trained_share(self, child) -> Optional[float]:
        """When a trainer that exited on its own had trained all of its ``max_tokens`` (exact-token runs), from its
        summary; None if it did not, or is still running."""
        if child.alive or child.proc.returncode != 0:
            return None
        summary = child.current() or {}
        quota, tokens = summary.get("max_tokens"), summary.get("tokens")
        if not isinstance(quota, int) or not isinstance(tokens, int) or tokens < quota:
            return None
        return float(summary.get("started_at") or 0.0) + float(summary.get("wall_s") or 0.0)

    def _trainers_finished(self) -> Optional[float]:
        """In an exact-token run, when the last trainer finished if every one exited after training its share (its
        last count may never have reached the DHT the status is read from: a store is not waited for at exit)."""
        if not (self.options.stop.exact_tokens and self.options.stop.tokens):
            return None
        ends = [self._trained_share(c) for c in self.swarm.trainers()]
        return max(ends) if ends and all(e is not None for e in ends) else None

    def _wait_settled(self, snap: dict, deadline: float, finished_at: float = 0.0) -> bool:
        """Until the stages have applied every sample the trainers sent (two reads in a row, see
        :func:`agora.net.records.stages_settled`); False after ``SETTLE_TIMEOUT_S`` or the demo's ``deadline``.
        ``finished_at``: when the trainers finished, if the status read last did not show it."""
        from agora.net.records import read_swarm, stages_settled

        since = max([float(t.get("updated", 0.0)) for t in snap["trainers"]] + [finished_at])
        give_up = min(deadline, time.time() + SETTLE_TIMEOUT_S)
        in_a_row = 0
        while time.time() < give_up:
            try:
                swarm = read_swarm(self.dht, self.manifest.run_id, self.manifest.n_stages, self.manifest.hash)
            except TimeoutError:
                swarm = None
            if swarm is not None and self.record.timeline:
                t = time.time() - self.record.t0
                self.record.timeline.append(settling_point(swarm, self.record.timeline[-1], t))
            in_a_row = in_a_row + 1 if swarm is not None and stages_settled(swarm, since) else 0
            if in_a_row >= 2:
                return True
            self.cpu.tick()
            time.sleep(0.5)
        self.record.events.append(f"the stages had not applied every sample after {SETTLE_TIMEOUT_S:.0f}s")
        return False

    def _show_settled(self, view: Optional[Live]) -> None:
        """The panel's last frame: the steps every stage applied while the demo waited for them to settle."""
        if view is None:
            return
        from agora.ops.status import swarm_status

        try:
            snap = swarm_status(self.dht, self.manifest)
        except TimeoutError:
            return  # the frame before settling stays; the summary has the final steps
        view.update(progress_table(snap, self.options.stop.steps, time.time() - self.record.t0, self.record.events))

    def _read_status(self, last_read: float) -> Optional[dict]:
        """The swarm's status, or None after a read that timed out. Under a kernel cap the demo's DHT reads share
        saturated links with the tensors: one slow read is a hiccup to ride out (as the dashboard does), minutes
        of them (since ``last_read`` succeeded) a failure."""
        from agora.ops.status import swarm_status

        try:
            return swarm_status(self.dht, self.manifest)
        except TimeoutError:
            if time.time() - last_read > STATUS_GIVE_UP_S:
                raise
            self.record.events.append(f"{time.time() - self.record.t0:.0f}s: swarm status read timed out; retrying")
            return None

    def _observe(self, snap: dict, view: Optional[Live]) -> None:
        record = self.record
        record.timeline.append(timeline_point(snap, time.time() - record.t0))
        if view is not None:
            view.update(progress_table(snap, self.options.stop.steps, time.time() - record.t0, record.events))
        if self.options.on_tick:
            self.options.on_tick(snap)

    def chaos_kill(self, snap: dict) -> bool:
        """One chaos fault (``ChaosOptions.fault``): a random serving stage peer (which stage it serves is read
        from the DHT, since peers choose and move) is SIGKILLed and replaced by a node with ``--stage auto``, or
        frozen for a while, or the bootstrap peer dies. False (nothing done) when no peer may be hit now."""
        chaos = self.options.chaos
        fault = chaos.fault
        if fault == "mixed":
            fault = MIXED_FAULTS[len(self.record.kills) % len(MIXED_FAULTS)]
        t = time.time() - self.record.t0
        if fault == "kill-bootstrap":
            boot = self.swarm.bootstrap()
            if boot is not None and boot.alive:
                boot.kill_group()
                self.record.events.append(f"{t:.0f}s: chaos killed the bootstrap peer {boot.name}")
                self.record.kills.append({"t": t, "fault": fault, "killed": boot.name, "peer_id": None,
                                          "stage": None, "replacement": None})
                return True
            fault = "kill"  # it is gone already: kill a stage peer instead
        frozen = frozenset(k["peer_id"] for k in self.record.kills
                           if k["fault"] == "stop" and k["killed"] in {v.name for v, _ in self.frozen})
        candidates = _chaos_candidates(self.swarm, snap, chaos.kill_last, frozen)
        if not candidates:
            return False
        victim, peer_id, stage = self.rng.choice(candidates)
        if fault == "stop":
            victim.signal_group(signal.SIGSTOP)
            self.frozen.append((victim, time.monotonic() + chaos.stop_s))
            self.record.events.append(f"{t:.0f}s: chaos froze {victim.name} (stage {stage}) for {chaos.stop_s:g}s")
            self.record.kills.append({"t": t, "fault": fault, "killed": victim.name, "peer_id": peer_id,
                                      "stage": stage, "replacement": None, "frozen_s": chaos.stop_s})
            return True
        if fault == "kill-main":
            self.killed_helpers.append((victim.kill_main(), time.monotonic() + ORPHAN_GRACE_S))
        else:
            victim.kill_group()
        live = [a for st in snap["stages"] for p in st["peers"] if p["peer_id"] != peer_id
                for a in (p.get("addrs") or [])[:1]]
        replacement = self.swarm.start_node(None, more_peers=live[:4])
        self.record.events.append(f"{t:.0f}s: chaos killed {victim.name} (stage {stage}, {fault}); started "
                                  f"{replacement.name} with --stage auto")
        self.record.kills.append({"t": t, "fault": fault, "killed": victim.name, "peer_id": peer_id, "stage": stage,
                                  "replacement": replacement.name})
        return True

    def thaw(self, everyone: bool = False) -> None:
        """SIGCONT frozen peers whose time is up (``everyone``: all of them, before the demo stops)."""
        still = []
        for victim, until in self.frozen:
            if everyone or time.monotonic() >= until:
                victim.signal_group(signal.SIGCONT)
                self.record.events.append(f"{time.time() - self.record.t0:.0f}s: chaos thawed {victim.name}")
            else:
                still.append((victim, until))
        self.frozen = still

    def after_training(self) -> None:
        """Note a timeout; else, if asked, stop the trainers, then compare the replicas' parameters and export and
        sample the trained model."""
        # Chaos ends with training: a peer frozen near the end would hold the trainers' last calls (and its own
        # leave) until the stop; thawed now, the trainers settle and leave as after any freeze.
        self.thaw(everyone=True)
        if not self.record.finished:
            self.record.events.append(f"timeout after {self.options.stop.timeout:.0f}s")
            return
        stop = self.options.stop
        if stop.exact_tokens and stop.tokens:
            # These trainers stop at their budget, validate and leave by themselves: a SIGTERM in the middle of
            # that would only race their summary.
            left = self.swarm.wait_exit(self.swarm.trainers(), TRAINER_LEAVE_S)
            if left:
                self.record.events.append(f"{left[0].name} had not left {TRAINER_LEAVE_S:.0f}s after training")
        if self.options.measure_divergence or self.options.sample_tokens > 0:
            # The trainers stop first (they settle and validate on the way out): what is compared or exported is
            # the model the run ended with, and its download does not compete with training for the peers.
            self.swarm.stop(self.swarm.trainers(), 90)
        if self.options.measure_divergence:
            self.record.divergence = measure_replica_divergence(self.dht, self.manifest)
        if self.options.sample_tokens > 0:
            # Every stage applies what it was sent first, so the exported stages are of one step.
            snap = self._read_status(time.time())
            if snap is not None:
                self._wait_settled(snap, time.time() + SETTLE_TIMEOUT_S)
            self.record.sample = self.sample_model()

    def sample_model(self) -> dict:
        """Download one replica of every stage, write the model to ``OUT/model`` (``agora eval`` and ``agora
        generate`` load it) and let it continue ``sample_prompt`` greedily. A failure is reported, not raised: the
        training run itself succeeded."""
        from agora.inference import generate
        from agora.ops.model_io import export_model, merge_stages, run_tokenizer
        from agora.roles import fetch_stages

        prompt = self.options.sample_prompt
        try:
            stages, steps = fetch_stages(self.dht, self.manifest, timeout=60.0)
            model = merge_stages(self.manifest, stages)
            tokenizer = run_tokenizer(self.manifest)
            export_model(model, self.out / "model", tokenizer, note=f"demo run {self.manifest.run_id}, steps {steps}")
            ids = tokenizer.encode(prompt).ids
            room = self.manifest.model.seq_len - len(ids)
            new = generate(model, ids, max(0, min(self.options.sample_tokens, room)), eos_id=None)
        except Exception as err:  # noqa: BLE001 - any failure here is reported in the summary, not fatal
            logger.warning(f"could not sample the trained model: {err!r}")
            return {"error": repr(err)}
        text = tokenizer.decode(new)
        self.record.events.append(f"sample: {prompt!r} -> {text!r}")
        return {"prompt": prompt, "continuation": text, "steps": steps, "model_dir": str(self.out / "model")}

    def stop(self) -> None:
        """Stop the DHT client and every process; remove the namespaces even if that fails (or is interrupted by
        a second Ctrl-C), with anything still running inside them: no namespace outlives the demo."""
        try:
            self.thaw(everyone=True)  # a frozen process cannot leave
            if self.dht is not None:
                self.dht.shutdown()
            if self.swarm is not None:
                self.swarm.shutdown()
                if self.dashboard is not None:
                    self.swarm.stop([self.dashboard], 10)
        finally:
            if self.topology is not None:
                self.topology.teardown()

    def count_orphans(self) -> int:
        """Helpers of ``kill-main`` victims still alive ``ORPHAN_GRACE_S`` after their main process died (they are
        then killed, by PID, so the demo leaves nothing behind)."""
        orphans = 0
        for helpers, deadline in self.killed_helpers:
            _, alive = psutil.wait_procs(helpers, timeout=max(0.0, deadline - time.monotonic()))
            orphans += len(alive)
            for proc in alive:
                try:
                    proc.kill()
                except psutil.Error:
                    pass
        self.killed_helpers.clear()
        return orphans

    def write_summary(self) -> dict:
        """``summary.json`` and ``report.html`` in the output folder; returns the summary."""
        from agora.lab.report import write_swarm_report

        record = self.record
        summary = summarize(self.swarm.children, self.manifest, record, self.options.stop.steps,
                            self.options.shape.replicas)
        summary["finished"] = record.finished
        summary["train_started_s"] = record.train_started_s
        summary["replica_divergence"] = record.divergence
        if record.sample is not None:
            summary["sample"] = record.sample
            summary["sample_text"] = f"{record.sample.get('prompt', '')} | {record.sample.get('continuation', '')}"
        summary["cpu_window"] = self.cpu.result() if self.cpu is not None else None
        summary["settled"] = self.settled
        summary["chaos_fault"] = self.options.chaos.fault
        summary["chaos_orphans"] = self.count_orphans()
        summary["link"] = self.plan.as_dict() | self._link_placement()
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
        write_swarm_report(summary, self.out)
        return summary

    def _link_placement(self) -> dict:
        """Under netns links: each process's namespace and address, and the tbf settings."""
        if self.topology is None:
            return {}
        observer = self.observer
        return {
            "observer": {"netns": observer.netns, "address": observer.address} if observer else None,
            "peers": {c.name: {"netns": c.slot.netns, "address": c.slot.address}
                      for c in self.swarm.children if c.slot},
            "tbf": {"burst_bytes": self.topology.burst_bytes, "queue_ms": self.topology.queue_ms},
        }


def _write_manifest(options: DemoOptions, out: Path) -> tuple[Manifest, Path, Optional[LocalAuthority], Path]:
    """The run's manifest, written to ``OUT/manifest.yaml`` (secured and signed for an allow-listed run), and the
    demo's own identity ``OUT/keys/operator.key``: the manifest names it a state reader
    (``security.state_access.readers``), so the demo may download every stage to compare replicas and export the
    model, as the operator of a real run would with ``agora export --identity``."""
    from agora.trust.identity import ensure_identity, peer_id_of

    out.mkdir(parents=True, exist_ok=True)
    shape = options.shape
    manifest = demo_manifest(shape.preset, shape.stages, shape.residual, shape.averaging, shape.seed,
                             shape.overlap_rounds, shape.upm_every_s, shape.overrides)
    authority = LocalAuthority(out / "keys") if options.allow_list else None
    if authority is not None:
        manifest = authority.secure(manifest)
    operator = out / "keys" / "operator.key"
    operator.parent.mkdir(parents=True, exist_ok=True)
    readers = [*manifest.security.state_access.readers, peer_id_of(ensure_identity(operator))]
    manifest = manifest.with_overrides(**{"security.state_access.readers": sorted(set(readers))})
    manifest_path = out / "manifest.yaml"
    manifest_path.write_text(manifest.to_yaml())
    tokenizer = manifest.data.tokenizer
    if tokenizer != "bpe" and not Path(tokenizer).is_absolute():
        # A relative tokenizer path is read beside the manifest (an `agora import` folder): copy it beside ours,
        # the path itself being part of the manifest's hash.
        source, target = manifest.data.resolve(tokenizer), out / tokenizer
        if source.is_file() and source.resolve() != target.resolve():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
    if authority is not None:
        authority.sign(manifest_path)
        console.print(f"allow-listed run: manifest signed by {out / 'keys' / 'authority.key'}; every peer gets a "
                      f"certified key in {out / 'keys'}")
    return manifest, manifest_path, authority, operator


def _token_shares(tokens: int, trainers: int) -> list[int]:
    """``tokens`` split between ``trainers`` as evenly as possible (the first ones take the remainder)."""
    return [tokens // trainers + (1 if i < tokens % trainers else 0) for i in range(trainers)]


def _check_refuse_inbound(stages: tuple[int, ...], backend: str, n_stages: int) -> None:
    """ValueError/RuntimeError when peers behind a firewall cannot be emulated as asked."""
    bad = [s for s in stages if not 0 <= s < n_stages]
    if bad:
        raise ValueError(f"refuse_inbound: stages {bad} not in 0..{n_stages - 1}")
    if backend != "netns":
        raise RuntimeError(f"refuse_inbound needs the netns link backend (a firewall rule in a peer's namespace), "
                           f"not {backend!r}: give a link rate and run as root")
    ok, why = netem.firewall_available()
    if not ok:
        raise RuntimeError(f"refuse_inbound: cannot build a namespace that refuses inbound connections: {why}")


def _enter_topology(plan: LinkPlan) -> netem.NetnsTopology:
    """A fresh namespace topology capped at the plan's rate, after removing what a SIGKILLed earlier run left."""
    stale = netem.cleanup_stale()
    if stale:
        console.print(f"removed namespaces left by a killed earlier run: {', '.join(stale)}")
    return netem.NetnsTopology(0, mbps=plan.mbps).__enter__()


def progress_table(snap: dict, steps: int, elapsed: float, events: list[str]) -> Table:
    """The live table: per stage serving peers, step range (of ``steps``) and tokens/s; the last ``events``."""
    t = Table(title=f"agora demo: {snap['run_id']}  ({elapsed:.0f}s)")
    t.add_column("stage")
    t.add_column("peers")
    t.add_column("steps (min..max)")
    t.add_column("tokens/s")
    for st in snap["stages"]:
        serving = [p for p in st["peers"] if p["state"] == "serving"]
        stp = [p["step"] for p in serving] or [0]
        t.add_row(str(st["stage"]), f"{len(serving)}/{len(st['peers'])}", f"{min(stp)}..{max(stp)} / {steps}",
                  f"{sum(p['throughput'] for p in serving):.0f}")
    losses = [tr.get("loss") for tr in snap["trainers"] if tr.get("loss") == tr.get("loss")]
    mb = snap["microbatches"]
    t.caption = (f"loss {losses[0]:.3f}" if losses else "loss -") + (
        f" | tokens {snap['tokens']} | microbatches {mb.get('completed', 0)}/{mb.get('submitted', 0)} "
        f"retried {mb.get('retried', 0)} abandoned {mb.get('abandoned', 0)}"
    ) + ("\n" + "\n".join(events[-3:]) if events else "")
    return t


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Within the body, the first SIGTERM raises ``SystemExit`` (later ones are ignored), so the demo's cleanup --
    stopping its peers and deleting its network namespaces -- runs when it is terminated, not only on Ctrl-C.
    Only the main thread can own signal handlers; elsewhere (tests driving the demo from a thread) a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _every_stage_at(snap: dict, steps: int) -> bool:
    """Every stage has serving peers, all at ``steps`` optimizer steps or more."""
    for st in snap["stages"]:
        serving = [p for p in st["peers"] if p["state"] == "serving"]
        if not serving or min(p["step"] for p in serving) < steps:
            return False
    return True


def _wait_for_layout(dht, manifest: Manifest, replicas: int, swarm: Swarm, timeout: float) -> None:
    """Until every stage has ``replicas`` serving peers; fails when a node exits or ``timeout`` passes."""
    from agora.ops.status import swarm_status

    deadline = time.time() + timeout
    counts: list[int] = []
    while time.time() < deadline:
        try:
            snap = swarm_status(dht, manifest)
        except TimeoutError:  # a slow read on a capped link; the overall deadline still bounds the wait
            continue
        counts = [sum(p["state"] == "serving" for p in st["peers"]) for st in snap["stages"]]
        if all(c >= replicas for c in counts):
            return
        dead = [c for c in swarm.nodes(alive=False) if not c.alive]
        if dead:
            raise RuntimeError(f"node {dead[0].name} exited during start-up; see {dead[0].log}")
        time.sleep(0.5)
    raise TimeoutError(f"stage peers did not all start serving within {timeout:.0f}s (serving per stage: {counts})")


def _wait_for_trainers(dht, manifest: Manifest, trainers: int, swarm: Swarm, timeout: float) -> None:
    """Until ``trainers`` trainers of this run have announced themselves in the DHT (each does so right before
    its training loop); fails when a trainer exits or ``timeout`` passes. Polled often: the CPU window opens here."""
    from agora.net.records import read_subkeys, trainers_key

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            found = read_subkeys(dht, trainers_key(manifest.run_id))
        except TimeoutError:
            found = {}
        if sum(isinstance(v, dict) and v.get("manifest_hash") == manifest.hash for v in found.values()) >= trainers:
            return
        dead = [c for c in swarm.trainers() if not c.alive]
        if dead:
            raise RuntimeError(f"trainer {dead[0].name} exited during start-up; see {dead[0].log}")
        time.sleep(0.1)
    raise TimeoutError(f"the trainers did not announce themselves within {timeout:.0f}s")


def _chaos_candidates(swarm: Swarm, snap: dict, allow_last: bool,
                      frozen: frozenset = frozenset()) -> list[tuple[Child, str, int]]:
    """Running nodes chaos may kill, with the peer id and stage the DHT says they serve: not the last serving
    peer of its stage unless ``allow_last``; ``frozen`` peer ids (SIGSTOPped, their records not expired yet) count
    as gone."""
    serving = {p["peer_id"]: st["stage"] for st in snap["stages"] for p in st["peers"]
               if p["state"] == "serving" and p["peer_id"] not in frozen}
    per_stage: dict[int, int] = {}
    for stage in serving.values():
        per_stage[stage] = per_stage.get(stage, 0) + 1
    candidates = []
    for c in swarm.nodes():
        info = c.current() or {}
        stage = serving.get(info.get("peer_id", ""))
        if stage is not None and (allow_last or per_stage[stage] > 1):
            candidates.append((c, info["peer_id"], stage))
    return candidates


def compare_with_centralized(summary: dict, out: Path, val_batches: int) -> dict:
    """Train the demo's manifest centrally (``agora train-local``, one process) for as many optimizer steps as the
    swarm's slowest stage took, i.e. on the same tokens (a stage applies one target batch per step), and compare
    the validation loss on the same held-out batches. Added to ``OUT/summary.json`` as ``centralized``."""
    from agora.config import load_manifest
    from agora.lab.train_local import train_local

    steps = min(int(v) for v in summary["steps_per_stage"].values())
    if steps < 1:
        raise ValueError("the swarm took no optimizer step: nothing to compare with")
    manifest = load_manifest(Path(out) / "manifest.yaml")
    local = train_local(manifest, steps, val_batches=val_batches)
    b = manifest.batch
    swarm_tokens = summary["microbatches"]["completed"] * b.microbatch_size * manifest.model.seq_len
    result = {"steps": steps, "tokens": local["tokens"], "val_loss": local["val_loss"], "wall_s": local["wall_s"],
              # What the trainers had computed through the swarm; it differs from ``tokens`` when a stage's last
              # step was partial or a microbatch was lost with a killed replica.
              "swarm_tokens": swarm_tokens,
              "swarm_val_loss": summary["val_loss"],
              "ratio": summary["val_loss"] / local["val_loss"] if summary.get("val_loss") else None}
    path = Path(out) / "summary.json"
    full = json.loads(path.read_text())
    full["centralized"] = result
    path.write_text(json.dumps(full, indent=2))
    return result
