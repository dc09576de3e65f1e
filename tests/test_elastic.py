"""Elastic, fault-tolerant swarm: peers die, join, move and restart while training goes on.

Most tests run in-process swarms (real hivemind DHTs and libp2p daemons on 127.0.0.1, nodes on the test's asyncio
loop): much cheaper than one OS process per peer. A "crash" there is abrupt: the node's background tasks stop and
its DHT process shuts its libp2p daemon down, so every connection to the peer breaks and its records stop being
refreshed, which is what other peers see of a SIGKILLed process. The chaos test uses real processes and SIGKILL.
Timeouts are generous: the machine is shared and slow; what must hold is that nothing waits past its own bound.
"""

import asyncio
import contextlib
import logging
import time


from swarm_util import run_chaos_demo, wait_until
import torch

from agora.config import load_manifest
from agora.data import TokenDataset
from agora.model import Stage
from agora.server.checkpoint import load_stage_checkpoint
from agora.server.node import NodeOptions, StageNode
from agora.net.dht import make_dht, visible_maddrs
from agora.net.records import RECORD_TTL_S, PeerState, read_stage
from agora.roles import choose_stage
from agora.client.trainer import Trainer, TrainerOptions

MAN = load_manifest("tiny")
V, T = MAN.model.vocab_size, MAN.model.seq_len


def _learnable(n_rows=64, seed=0):
    """Sequences with an easy rule (next = previous + stride mod 97): the loss falls within a few steps."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 97, (n_rows, 1), generator=g)
    stride = torch.randint(1, 5, (n_rows, 1), generator=g)
    return (start + stride * torch.arange(T + 1)) % 97


def _batches(n, b=8, seed=0):
    rows = _learnable(n * b, seed)
    return [rows[i * b:(i + 1) * b] for i in range(n)]


_wait = wait_until


def _max_diff(a: StageNode, b: StageNode) -> float:
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.stage.parameters(), b.stage.parameters()))


class Cluster:
    """An in-process swarm that grows one node at a time (own options per node) and can crash nodes."""

    def __init__(self, manifest=MAN):
        self.manifest = manifest
        self.boot = make_dht(manifest=manifest)
        self.peers = visible_maddrs(self.boot)
        self.dhts = [self.boot]
        self.nodes: list[StageNode] = []
        self.crashed: list[StageNode] = []

    async def add(self, stage: int, opts: NodeOptions, resume=None) -> StageNode:
        dht = make_dht(self.peers, manifest=self.manifest)
        self.dhts.append(dht)
        node = StageNode(self.manifest, stage, dht, opts)
        if resume is not None:
            node.runtime.import_state(*load_stage_checkpoint(resume, self.manifest, stage))
        self.nodes.append(node)
        await node.start()
        return node

    def crash(self, node: StageNode) -> None:
        """Abrupt death: no leaving announcement, no drain; connections break, records stop being refreshed."""
        for task in [*node._tasks, node._sync_task]:
            if task is not None:
                task.cancel()
        node.dht.shutdown()  # its libp2p daemon goes with it: every stream to this peer breaks
        for sync in node.syncs:
            sync.shutdown()
        self.nodes.remove(node)
        self.crashed.append(node)

    async def close(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                await node.stop()
        for node in self.crashed:
            node._compute.shutdown(wait=False)
            node._io.shutdown(wait=False)
        for dht in self.dhts:
            with contextlib.suppress(Exception):
                dht.shutdown()


@contextlib.asynccontextmanager
async def cluster(manifest=MAN):
    c = Cluster(manifest)
    try:
        yield c
    finally:
        await c.close()


FAST = dict(stall_step_s=2.0, averaging_timeout_s=10.0, hop_timeout_s=10.0, wait_for_peers_s=4.0, drain_timeout_s=5.0)


def test_killed_replica_is_routed_around_and_an_empty_stage_waits_for_a_newcomer(caplog):
    """Kill one of two tail replicas mid-run: training continues through the survivor, no call hangs, the dead
    peer's record expires. Kill the survivor too: trainers wait with a clear status line and resume when a new
    peer joins the empty stage."""
    caplog.set_level(logging.WARNING, logger="agora.trainer")
    opts = NodeOptions(**FAST)

    async def main():
        async with cluster() as c:
            head = await c.add(0, opts)
            a, b = await c.add(1, opts), await c.add(1, opts)
            trainer = Trainer(MAN, c.boot, TokenDataset(_learnable(256)),
                              TrainerOptions(in_flight=3, call_timeout_s=40.0, ban_s=30.0))
            durations = []
            send = trainer.send

            async def timed_send(*args, **kw):
                t0 = time.monotonic()
                try:
                    return await send(*args, **kw)
                finally:
                    durations.append(time.monotonic() - t0)

            trainer.send = timed_send
            await trainer.start()
            await _wait(lambda: all(len(s) >= n for s, n in zip(trainer.swarm, (1, 2))), 30, "all peers announced")
            stop = asyncio.Event()
            run = asyncio.create_task(trainer.run(stop))
            counts = trainer.stats.counts
            await _wait(lambda: counts.completed >= 6 and a.counters.forward and b.counters.forward, 90,
                        "both tail replicas to serve")
            # Crash a tail replica while it holds a microbatch.
            await _wait(lambda: a.inflight > 0 or b.inflight > 0, 30, "a microbatch at the tail")
            victim, survivor = (a, b) if a.inflight > 0 else (b, a)
            c.crash(victim)
            t_crash, done_at_crash = time.monotonic(), counts.completed
            survivor_fwd = survivor.counters.forward
            await _wait(lambda: counts.completed >= done_at_crash + 10, 90, "training to go on after the crash")
            assert survivor.counters.forward >= survivor_fwd + 10 - 3  # (3 were in flight, maybe past the tail)
            assert head.counters.retried + counts.retried >= 1  # the broken call was seen and retried
            assert counts.abandoned == 0, counts
            assert max(durations) < 30.0, max(durations)  # nothing waited out a timeout
            await _wait(lambda: victim.peer_id not in [r.peer_id for r in read_stage(
                c.boot, MAN.run_id, 1, MAN.hash)], RECORD_TTL_S + 15, "the dead peer's record to expire")
            ttl_seen = time.monotonic() - t_crash

            # The last tail peer dies: trainers wait with a status line, then resume through a newcomer.
            def trainer_waits():
                return any(r.name == "agora.trainer" and "stage 1 has no peers; waiting" in r.getMessage()
                           for r in caplog.records)

            assert not trainer_waits()
            c.crash(survivor)
            await _wait(trainer_waits, RECORD_TTL_S + 30, "the trainer's status line")
            stalled_at = counts.completed
            newcomer = await c.add(1, opts)
            joined_at = time.time()
            await _wait(lambda: counts.completed >= stalled_at + 5, 90, "training to resume")
            assert newcomer.counters.forward >= 5
            # The newcomer started stage 1 over from step 0, steps behind the head for good. The head's steps since
            # do not wait out the clip wait for a gradient norm of its step that stage 1 will never publish (they
            # did, one step per 10 s, until the clip learned to tell a stage that far behind).
            since = [e["seconds"] for e in head.events if e["kind"] == "step" and e["t"] >= joined_at]
            assert since and max(since) < opts.averaging_timeout_s, since
            stop.set()
            await asyncio.wait_for(run, 60)
            trainer.close()
            return ttl_seen, counts

    ttl_seen, counts = asyncio.run(main())
    assert ttl_seen < RECORD_TTL_S + 15
    assert counts.submitted == counts.completed + counts.abandoned  # every microbatch accounted once


def test_replica_killed_during_allreduce_does_not_block_the_others(monkeypatch):
    """Three head replicas average; one of them gets stuck inside the all-reduce (its averager process hangs after
    the group formed) and is then killed. The other two still take the step within the round's bounds and end
    with identical parameters (a broken all-reduce leaves parts un-averaged; the replicas then adopt one state)."""
    from hivemind.averaging.allreduce import AllReduceRunner
    from hivemind.averaging.control import AveragingStage

    opts = NodeOptions(stall_step_s=1e9, averaging_timeout_s=12.0, hop_timeout_s=10.0)

    async def stuck(self):  # the victim's all-reduce: joined the group, never delivers
        await asyncio.sleep(3600)
        yield

    async def main():
        async with cluster() as c:
            survivors = [await c.add(0, opts) for _ in range(2)]
            # The averager runs in a forked process: patch, start the victim (its child inherits it), unpatch.
            monkeypatch.setattr(AllReduceRunner, "run", stuck)
            victim = await c.add(0, opts)
            monkeypatch.undo()
            await c.add(1, opts)
            trainer = Trainer(MAN, c.boot, shard=None)
            await trainer.start()
            await _wait(lambda: len(trainer.swarm[0]) == 3 and trainer.swarm[1], 30, "all peers announced")
            assert all(x is not None for x in await asyncio.gather(*(trainer.send(x) for x in _batches(2))))

            def victim_in_allreduce():
                ctl = victim.sync.control
                return ctl is not None and ctl.stage == AveragingStage.RUNNING_ALLREDUCE

            await _wait(victim_in_allreduce, 40, "the victim to be inside the all-reduce")
            await asyncio.sleep(0.5)
            c.crash(victim)
            t_crash = time.monotonic()
            assert len(survivors) == 2, survivors  # all() below must not hold vacuously
            await _wait(lambda: all(n.step >= 1 for n in survivors), opts.averaging_timeout_s * 2 + 15,
                        "the survivors to step")
            stepped_after = time.monotonic() - t_crash
            await _wait(lambda: survivors[0].step == survivors[1].step and _max_diff(*survivors) < 1e-6, 40,
                        "survivors to agree")
            trainer.close()
            return stepped_after, [n.step for n in survivors], victim.step

    stepped_after, steps, victim_step = asyncio.run(main())
    assert stepped_after < 12.0 * 2 + 15
    assert victim_step == 0 and min(steps) >= 1


def test_joining_peer_takes_the_weakest_stage_and_its_replicas_state_before_serving():
    """A ``--stage auto`` joiner downloads a live replica's weights and optimizer moments before it serves.

    Which stage is weakest depends on measured throughput (two head replicas against one tail usually, but not
    always, leaves the tail weakest: the first, warm-up microbatches dominate each node's estimate on a loaded
    machine). The choice policy is pinned by ``test_routing``; here the joiner is compared with a replica of
    whichever stage it chose (replicas of a stage are identical after each averaged step).
    """
    opts = NodeOptions(stall_step_s=1e9, averaging_timeout_s=15.0)

    async def main():
        async with cluster() as c:
            heads = [await c.add(0, opts), await c.add(0, opts)]
            tail = await c.add(1, opts)
            trainer = Trainer(MAN, c.boot, shard=None)
            await trainer.start()
            await _wait(lambda: len(trainer.swarm[0]) == 2 and trainer.swarm[1], 30, "all peers announced")
            for r in range(2):
                assert all(x is not None for x in await asyncio.gather(*(trainer.send(x) for x in _batches(2, seed=r))))
                await _wait(lambda: all(n.step == r + 1 for n in c.nodes), 60, f"step {r + 1}")
            trainer.close()
            stage = choose_stage(c.boot, MAN)  # what `--stage auto` picks
            ref = tail if stage == 1 else heads[0]
            fresh = Stage(MAN, stage)
            joiner = await c.add(stage, opts)
            assert joiner.state == PeerState.SERVING
            moved = max((p - q).abs().max().item() for p, q in zip(fresh.parameters(), ref.stage.parameters()))
            opt_diff = max((joiner.runtime.optimizer.state[p]["exp_avg"] - ref.runtime.optimizer.state[q]["exp_avg"]).abs().max().item()
                           for p, q in zip(joiner.stage.parameters(), ref.stage.parameters()))
            return stage, joiner.step, ref.step, _max_diff(joiner, ref), moved, opt_diff, joiner.sync.resyncs

    _, joiner_step, ref_step, diff, moved, opt_diff, resyncs = asyncio.run(main())
    assert moved > 1e-4  # training moved the replica away from the seed, so equality below means a real download
    assert joiner_step == ref_step == 2 and resyncs >= 1
    assert diff < 1e-6 and opt_diff < 1e-6


def test_peer_moves_to_the_bottleneck_stage_and_back_if_it_cannot_sync(monkeypatch):
    """Three head peers, one tail: exactly one head peer (the smallest id) moves to the tail, takes the tail's
    state, serves it, and nobody moves after it. The mover waits out ``security.state_access.period_s`` before the
    tail's replicas serve it their state (one identity holds one stage per period). A move whose state download
    fails goes back to the old stage."""
    period = 4.0
    man = MAN.with_overrides(**{"security.state_access.period_s": period})
    plain = NodeOptions(stall_step_s=1e9, averaging_timeout_s=10.0)
    rebalancing = NodeOptions(stall_step_s=1e9, averaging_timeout_s=10.0, rebalance_every_s=1.0,
                              rebalance_dwell_s=3.0, rebalance_confirm_s=2.0, drain_timeout_s=5.0)

    async def main():
        async with cluster(man) as c:
            tail = await c.add(1, plain)
            # Give the tail a state of its own (as if trained), so that a mover's copy is verifiable.
            step, names, tensors = tail.runtime.export_state()
            g = torch.Generator().manual_seed(3)
            tensors = [t + 0.01 * torch.randn(t.shape, generator=g) if n.startswith("param/") else t
                       for n, t in zip(names, tensors)]

            def set_state():
                tail.runtime.import_state(5, names, tensors)
                tail.sync._set_fingerprint()

            await tail.run_compute(set_state)
            await tail.announce()
            heads = [await c.add(0, rebalancing) for _ in range(3)]
            await _wait(lambda: any(n.moves for n in heads), 90, "a head peer to move")
            await asyncio.sleep(8.0)  # several rebalancing periods: nobody else may move
            movers = [n for n in heads if n.moves]
            assert len(movers) == 1, [n.moves for n in heads]
            mover = movers[0]
            assert mover.peer_id == min(n.peer_id for n in heads)
            assert mover.stage_index == 1 and mover.state == PeerState.SERVING and mover.step == 5
            assert _max_diff(mover, tail) < 1e-6
            assert [e["to_stage"] for e in mover.events if e["kind"] == "moved"] == [1]
            assert [e["seconds"] for e in mover.events if e["kind"] == "moved"][0] >= period
            assert tail.state_access.granted == 1  # the mover's download went through the front door
            rebalancing.rebalance_every_s = 0  # measured throughputs from here on could justify other moves
            # The pipeline works through the new layout.
            trainer = Trainer(man, c.boot, shard=None)
            await trainer.start()
            await _wait(lambda: len([r for r in trainer.swarm[1] if r.state == "serving"]) == 2, 30, "tail records")
            assert all(x is not None for x in await asyncio.gather(*(trainer.send(x) for x in _batches(4))))
            trainer.close()

            # A move whose download fails: back to the old stage, old parameters, serving again.
            other = next(n for n in heads if n is not mover)
            before = []  # its parameters at the moment it switches stage (a round may still end before that)
            switch = other._switch_runtime
            old_runtime = other.runtime

            def spy(runtime):
                if runtime is not old_runtime:  # switching away (not back)
                    before.extend(p.detach().clone() for p in other.stage.parameters())
                return switch(runtime)

            other._switch_runtime = spy

            async def refuse(self, peer, timeout=60.0, keep_grads=False):
                return False

            monkeypatch.setattr("agora.server.averaging.sync.ReplicaSync.download_from", refuse)
            moved = await other.move_to(1)
            monkeypatch.undo()
            back = max((p - q).abs().max().item() for p, q in zip(before, other.stage.parameters()))
            return moved, other.stage_index, other.state, back, [e["kind"] for e in other.events]

    moved, stage, state, back, kinds = asyncio.run(main())
    assert not moved and stage == 0 and state == PeerState.SERVING and back == 0.0
    assert "move_failed" in kinds


def test_restart_from_checkpoints_continues_training(tmp_path):
    """Stop the whole swarm, start it again from its checkpoints: the first step taken is saved + 1 and the loss
    continues where it was instead of starting over."""
    ckpt = tmp_path / "ckpt"
    opts = NodeOptions(stall_step_s=1e9, checkpoint_dir=str(ckpt), checkpoint_every=1)
    val = _batches(1, seed=99)[0]

    async def train_steps(c, trainer, steps, seed):
        losses = []
        for i in range(steps):
            target = c.nodes[0].step + 1
            losses += await asyncio.gather(*(trainer.send(x) for x in _batches(2, seed=seed + i)))
            await _wait(lambda: c.nodes and all(n.step >= target for n in c.nodes), 60, f"step {target}")
        assert len(losses) == 2 * steps and all(x is not None for x in losses)
        return losses

    async def first_run():
        async with cluster() as c:
            for s in (0, 1):
                await c.add(s, opts)
            trainer = Trainer(MAN, c.boot, shard=None)
            await trainer.start()
            await _wait(lambda: all(trainer.swarm), 30, "peers announced")
            fresh = await trainer.send(val, train=False)
            losses = await train_steps(c, trainer, 6, seed=10)
            before = await trainer.send(val, train=False)
            trainer.close()
            return fresh, losses, before, [n.step for n in c.nodes]

    async def second_run():
        async with cluster() as c:
            for s in (0, 1):
                await c.add(s, opts, resume=ckpt)
            resumed = [n.step for n in c.nodes]
            trainer = Trainer(MAN, c.boot, shard=None)
            await trainer.start()
            await _wait(lambda: all(trainer.swarm), 30, "peers announced")
            after = await trainer.send(val, train=False)
            losses = await train_steps(c, trainer, 1, seed=20)
            # A node's step counter moves a moment before it logs the step event: wait for the events too.
            await _wait(lambda: all(any(e["kind"] == "step" for e in n.events) for n in c.nodes), 10, "step events")
            first_steps = [next(e["step"] for e in n.events if e["kind"] == "step") for n in c.nodes]
            trainer.close()
            return resumed, after, losses, first_steps

    fresh, losses, before, saved = asyncio.run(first_run())
    assert saved == [6, 6]
    assert [load_stage_checkpoint(ckpt, MAN, s)[0] for s in (0, 1)] == [6, 6]
    resumed, after, later, first_steps = asyncio.run(second_run())
    assert resumed == saved and first_steps == [7, 7]
    assert abs(after - before) < 1e-5  # the very same parameters
    assert fresh - before > 0.3  # and they had learned something: a restart from scratch would show
    assert sum(later) / len(later) < sum(losses[:2]) / 2 - 0.3  # training loss continues, not back to the start



def test_chaos_demo_keeps_training_replicas_identical_and_leaves_no_process_behind(tmp_path):
    """Real processes, a fault every 8 s in turn (``--chaos-fault mixed``): the bootstrap peer's process tree is
    SIGKILLed, a stage peer's process group is SIGKILLed and replaced by a node that can only join through live
    peers, a stage peer is frozen (SIGSTOP) for 6 s, a stage peer's main process alone is SIGKILLed (as the OOM
    killer does). Training goes on, replicas end bit-identical, the killed peers' helpers exit on their own,
    survivors leave gracefully and quickly, and no process of the run is left. (Steps per stage are not asserted
    here: samples a killed or re-synced replica held are lost to its stage only; measured 16/16 and 11/15.)"""
    from agora.lab.demo import ChaosOptions

    out = tmp_path / "chaos"
    summary = run_chaos_demo(out, ChaosOptions(every_s=8.0, fault="mixed", stop_s=6.0), 44)
    assert summary["finished"]
    kills = summary["chaos_kills"]
    assert [k["fault"] for k in kills[:4]] == ["kill-bootstrap", "kill", "stop", "kill-main"], kills
    assert all(k["stage"] in (0, 1) for k in kills[1:])
    assert summary["chaos_fault"] == "mixed" and summary["chaos_orphans"] == 0, summary["chaos_orphans"]
    # The replacement of the first killed stage peer started after the bootstrap peer was dead: it joined through
    # the live peers' addresses and served.
    replacement_log = (out / "logs" / f"{kills[1]['replacement']}.log").read_text()
    assert "serving at step" in replacement_log, replacement_log[-2000:]
    mb = summary["microbatches"]
    assert mb["completed"] >= 20 and mb["submitted"] == mb["completed"] + mb["abandoned"]
    assert mb["abandoned"] <= mb["completed"] // 5, mb
    # Completions keep coming: no gap longer than the slowest failure path (a kill, a retry, a timeout). Within the
    # training window: microbatches in flight when it ends complete whenever the stop lets them.
    done = [c[1] for c in summary["completions"] if c[1] <= summary["train_started_s"] + 44]
    assert max(b - a for a, b in zip(done, done[1:])) < 30.0
    assert any(t > kills[0]["t"] + 10 for t in done)  # well after the bootstrap peer died
    killed = {k["killed"] for k in kills}
    for node in summary["nodes"]:
        if node["name"] not in killed:
            exit_ = summary["exits"][node["name"]]
            assert exit_["graceful"] and exit_["seconds"] < 30.0, (node["name"], exit_)
    div = summary["replica_divergence"]
    assert div["settled"], div
    # Stages that ended with two or more serving replicas (usually all: replacements have joined by then).
    compared = [v for v in div["stages"].values() if v["replicas"] >= 2]
    assert all(v["max_abs_diff"] < 1e-6 for v in compared), div
