"""In-process swarm fixtures: real hivemind DHTs and libp2p daemons on 127.0.0.1, nodes on one asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time

from hivemind import DHT

from agora.server.node import NodeOptions, StageNode
from agora.net.dht import make_dht, visible_maddrs


@contextlib.asynccontextmanager
async def local_swarm(manifest, layout, options: NodeOptions | list[NodeOptions] | None = None):
    """Start a bootstrap DHT and one StageNode per entry of ``layout`` (a list of stage indices); ``options``: every
    node's, or one per node."""
    boot = make_dht(manifest=manifest)  # tests read records through it: it needs the run's validators
    peers = visible_maddrs(boot)
    dhts: list[DHT] = [boot]
    nodes: list[StageNode] = []
    try:
        per_node = options if isinstance(options, list) else [options] * len(layout)
        for stage, opts in zip(layout, per_node):
            dht = make_dht(peers, manifest=manifest)  # the run's record rules, as `agora node` has them
            dhts.append(dht)
            node = StageNode(manifest, stage, dht, opts or NodeOptions(stall_step_s=1e9))
            await node.start()
            nodes.append(node)
        yield boot, peers, nodes
    finally:
        for node in nodes:
            with contextlib.suppress(Exception):
                await node.stop()
        for dht in dhts:
            dht.shutdown()


def leftover_children(before: set[int], timeout: float = 10.0) -> list:
    """Descendants of this process not in ``before`` still alive after ``timeout`` (waiting for them to exit).

    torch_shm_manager is ignored: torch starts it once per process for shared-memory tensors and it exits with
    this process, not with any test.
    """

    import psutil

    deadline = time.monotonic() + timeout
    while True:
        left = []
        for p in psutil.Process().children(recursive=True):
            try:
                if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE and p.name() != "torch_shm_manager":
                    left.append(p)
            except psutil.Error:
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def processes_mentioning(text: str) -> list[int]:
    """PIDs of processes whose command line contains ``text`` (e.g. a test's unique output folder)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(text in part for part in (p.info["cmdline"] or [])):
                found.append(p.info["pid"])
        except psutil.Error:
            continue
    return found


def kill_pids(pids: list[int]) -> None:
    """SIGKILL what a failed test left behind, by PID (never by name), so the next test starts clean."""
    import psutil

    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            proc.kill()
            procs.append(proc)
        except psutil.Error:
            continue
    psutil.wait_procs(procs, timeout=10)


def kill_started(procs) -> None:
    """SIGKILL every ``subprocess.Popen`` a test started and whatever each spawned, by PID: the process's own group
    too (each was started with ``start_new_session=True``, and its DHT process and p2pd stay in that group even when
    the main process died first), then reap it."""
    import os
    import signal

    import psutil

    for proc in procs:
        if proc is None:
            continue
        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.Error:
            tree = []
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for p in tree:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(tree, timeout=10)
        proc.wait(timeout=10)


async def wait_until(predicate, timeout: float, what: str, poll: float = 0.1) -> None:
    """Poll ``predicate`` (plain or async) on the test's loop until it holds; fail naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout

    async def holds() -> bool:
        result = predicate()
        return bool(await result) if inspect.isawaitable(result) else bool(result)

    while not await holds():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(poll)


def random_batches(vocab_size: int, seq_len: int, n: int, b: int = 4, seed: int = 0) -> list:
    """``n`` seeded batches of ``b`` random token rows of ``seq_len + 1`` tokens (inputs plus the next token)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (b, seq_len + 1), generator=g) for _ in range(n)]


def feed_fake_gradients(node, seed: int, samples: int = 8) -> None:
    """Compute thread: what backwards of ``samples`` sequences leave behind (a seeded fake gradient)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rt = node.runtime
    for p in rt.stage.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 0.1
    rt.samples += samples
    rt.last_sample_time = time.monotonic()


async def train_in_waves(manifest, boot, nodes, waves: int, after_wave=None, settled=None,
                         timeout: float = 40.0) -> list[float]:
    """A trainer sends the same 4 microbatches of 4 (one ``tiny`` target batch) ``waves`` times, waiting after each
    wave until every stage stepped (``after_wave(wave)`` then runs); returns the loss on 2 of them before and after
    (``settled()``, if given, must hold before the last evaluation)."""
    from agora.client.trainer import Trainer

    trainer = Trainer(manifest, boot, shard=None)
    await trainer.start()
    try:
        stages = {}
        for n in nodes:
            stages[n.stage_index] = stages.get(n.stage_index, 0) + 1
        await wait_until(lambda: all(len(trainer.swarm[s]) == k for s, k in stages.items()), 30, "all peers")
        data = random_batches(manifest.model.vocab_size, manifest.model.seq_len, 4, 4, 0)
        losses = [await trainer.evaluate(data[:2])]
        for wave in range(waves):
            sent = await asyncio.gather(*(trainer.send(x) for x in data))
            assert all(x is not None for x in sent), sent
            await wait_until(lambda: all(n.runtime.samples == 0 and not n.sync.stepping for n in nodes), timeout,
                             f"wave {wave} stepped")
            if after_wave is not None:
                after_wave(wave)
        if settled is not None:
            await wait_until(settled, 30, "the swarm to settle")
        losses.append(await trainer.evaluate(data[:2]))
        return losses
    finally:
        trainer.close()


def run_chaos_demo(out, chaos, train_seconds: float, timeout: float = 420) -> dict:
    """A ``tiny`` 2 x 2 demo (real processes) under ``chaos`` for ``train_seconds``, replicas compared at the end;
    asserts that no process of the run is left (those found are killed by PID first) and returns the summary."""
    from agora.lab.demo import DemoOptions, DemoRun, StopRule, SwarmShape

    options = DemoOptions(out=out, shape=SwarmShape(preset="tiny", stages=2, replicas=2, val_batches=2),
                          stop=StopRule(steps=10**6, train_seconds=train_seconds, timeout=timeout), live=False,
                          chaos=chaos, measure_divergence=True)
    try:
        summary = DemoRun(options).run()
    finally:
        time.sleep(1)
        leftovers = processes_mentioning(str(out))
        kill_pids(leftovers)
    assert leftovers == [], leftovers
    return summary


def offline_sync_context(runtime, **fields):
    """A ``SyncContext`` for exercising a ``ReplicaSync`` without a swarm: no DHT, no p2p, nothing announced or
    run off-thread unless ``fields`` says so (any field can be overridden)."""
    from agora.server.averaging.sync import SyncContext
    from agora.server.observers import Observers

    defaults = dict(manifest=runtime.manifest, runtime=runtime, dht=None, p2p=None, peer_id="QmSelf",
                    averaging_timeout_s=1.0, stall_step_s=10.0, run_compute=None, run_io=None, announce=None,
                    log_event=lambda *a, **k: None, is_serving=lambda: True, local_bans=set, members=None,
                    observers=Observers())
    return SyncContext(**{**defaults, **fields})
