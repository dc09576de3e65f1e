"""An all-reduce that hivemind finishes with part of the average missing is counted (``GuardedAverager``), and the
replicas then repair toward the state of one that averaged (``full.repair_source``)."""

from __future__ import annotations

import asyncio
import logging

import hivemind
import torch

from agora.config import load_manifest
from agora.net.records import StageRecord
from agora.server.averaging.allreduce import HIVEMIND_ALLREDUCE_LOGGER, GuardedAverager, PartFailureFilter, \
    report_part_failures
from agora.server.averaging.full import repair_source
from agora.server.averaging.sync import ReplicaSync, SyncContext
from swarm_util import offline_sync_context
from agora.server.observers import Observers
from agora.server.runtime import Counters, StageRuntime

SIZE = 200_000


def _pair(prefix: str, dhts, hasty: bool) -> list[GuardedAverager]:
    """Two averagers of one group; with ``hasty`` the first gives its reducer and senders 1 microsecond, so it
    stops waiting for the other's parts before they can arrive (what a slow link does to a real round)."""
    out = []
    for i, dht in enumerate(dhts):
        timeouts = {"reducer_timeout": 1e-6, "sender_timeout": 5e-7} if hasty and i == 0 else {}
        out.append(GuardedAverager([torch.full((SIZE,), float(i))], dht, prefix=prefix, start=True,
                                   min_group_size=2, target_group_size=2, min_matchmaking_time=1.0,
                                   request_timeout=0.5, allreduce_timeout=15, next_chunk_timeout=5.0, **timeouts))
    return out


def _round(averagers) -> list[tuple[bool, int]]:
    """One step of every averager: (its buffer holds the true average everywhere, its partial-round count)."""
    controls = [a.step(wait=False, timeout=15) for a in averagers]
    for c in controls:
        c.result(30)
    out = []
    for a in averagers:
        with a.get_tensors() as (t,):
            out.append((bool((t == 0.5).all()), a.partial_rounds))
    return out


def test_an_allreduce_with_parts_missing_is_counted_and_a_complete_one_is_not(tmp_path):
    # the averagers' processes are forked from this one and inherit this handler: their log lines land in the file
    record = logging.FileHandler(tmp_path / "allreduce.log")
    logging.getLogger(HIVEMIND_ALLREDUCE_LOGGER).addHandler(record)
    boot = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peers = [str(a) for a in boot.get_visible_maddrs()]
    dhts = [hivemind.DHT(initial_peers=peers, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in range(2)]
    averagers = []
    try:
        averagers += _pair("complete", dhts, hasty=False)
        complete = _round(averagers[:2])
        averagers += _pair("partial", dhts, hasty=True)
        partial = _round(averagers[2:])
    finally:
        for a in averagers:
            a.shutdown()
        for d in [*dhts, boot]:
            d.shutdown()
        logging.getLogger(HIVEMIND_ALLREDUCE_LOGGER).removeHandler(record)
        record.close()
    assert complete == [(True, 0), (True, 0)], complete
    # hivemind reports success either way; every averager left without the true average knows it
    assert any(not exact for exact, _ in partial), partial
    assert all(exact or count == 1 for exact, count in partial), partial
    # ...and its averager process said why, at WARNING (hivemind itself logs the reason at DEBUG only)
    lines = (tmp_path / "allreduce.log").read_text()
    assert "all-reduce part failed: Caught" in lines, lines[-2000:]
    assert "Traceback" not in lines


def test_part_failures_are_promoted_and_other_debug_lines_stay_quiet():
    log = logging.getLogger(HIVEMIND_ALLREDUCE_LOGGER)
    level, filters = log.level, list(log.filters)
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record)

    handler = Keep()
    log.addHandler(handler)
    try:
        log.setLevel(logging.INFO)
        report_part_failures()
        report_part_failures()  # idempotent
        assert sum(isinstance(f, PartFailureFilter) for f in log.filters) == 1
        try:
            raise TimeoutError
        except TimeoutError:
            log.debug("Caught TimeoutError() when communicating to QmPeer", exc_info=True)
        log.debug("Task <x> failed with y")
        log.warning("something else")
    finally:
        log.removeHandler(handler)
        log.filters[:] = filters
        log.setLevel(level)
    assert [(r.levelno, r.getMessage()) for r in seen] == [
        (logging.WARNING, "all-reduce part failed: Caught TimeoutError() when communicating to QmPeer"),
        (logging.WARNING, "something else")]
    assert seen[0].exc_info is None
    # a user who asked for DEBUG keeps every DEBUG line
    keep = PartFailureFilter(drop_debug=False)
    assert keep.filter(logging.LogRecord(HIVEMIND_ALLREDUCE_LOGGER, logging.DEBUG, "f", 1, "Task x", None, None))


def _rec(peer: str, fallback_step: int = -1) -> StageRecord:
    return StageRecord(peer_id=peer, stage=1, state="serving", manifest_hash="h", step=5, fallback_step=fallback_step)


def test_the_repair_adopts_the_smallest_replica_that_averaged():
    # Nobody fell back: the smallest peer id, ourselves included (None: ours is the state everyone adopts).
    assert repair_source([_rec("b"), _rec("c")], "a", False, 5) is None
    assert repair_source([_rec("a"), _rec("c")], "b", False, 5).peer_id == "a"
    # "a" stepped on its own gradients at step 5: the others keep the smallest among those that averaged...
    assert repair_source([_rec("a", 5), _rec("c")], "b", False, 5) is None
    assert repair_source([_rec("a", 5), _rec("b")], "c", False, 5).peer_id == "b"
    # ...and "a" adopts it, though its id is the smallest.
    assert repair_source([_rec("b"), _rec("c")], "a", True, 5).peer_id == "b"
    # A fallback at an older step says nothing about this one.
    assert repair_source([_rec("a", 4), _rec("c")], "b", False, 5).peer_id == "a"
    # Everyone fell back: the smallest id among all.
    assert repair_source([_rec("b", 5), _rec("c", 5)], "a", True, 5) is None
    assert repair_source([_rec("a", 5), _rec("c", 5)], "b", True, 5).peer_id == "a"
    assert repair_source([], "a", True, 5) is None


class _Averager:
    """What ``ReplicaSync`` reads of a hivemind averager to tell a partial round: its partial-round count."""

    def __init__(self, partial_rounds: int):
        self.partial_rounds = partial_rounds


class _TwoAveragerScheme(ReplicaSync):
    """A scheme whose rounds run in one of two averagers, chosen when the round's payload is loaded (PowerSGD's
    dense steps run in a second averager): the second one already finished a partial round, the first none."""

    def __init__(self, ctx: SyncContext, partial: bool):
        super().__init__(ctx)
        self.main, self.second = _Averager(0), _Averager(1)
        self._second_round = False
        self.partial = partial

    def round_averager(self):
        return self.second if self._second_round else self.main

    def averagers(self) -> list:
        return [self.main, self.second]

    async def _average(self, samples, grads):
        self._second_round = True  # as ``_load_buffers`` does at a dense step
        if self.partial:
            self.second.partial_rounds += 1  # hivemind finished this all-reduce with parts missing
        return {peer: {"step": self.ctx.runtime.step, "samples": samples} for peer in ("QmSelf", "QmOther")}

    def _averaged(self):
        self._second_round = False
        return [torch.ones(3)]


def _scheme(partial: bool) -> _TwoAveragerScheme:
    manifest = load_manifest("tiny")

    async def nothing(*args, **kwargs):
        return None

    async def compute(fn, *args):
        return fn(*args)

    runtime = StageRuntime(manifest, 0, Counters(), Observers())
    return _TwoAveragerScheme(offline_sync_context(runtime, run_compute=compute, run_io=compute, announce=nothing),
                              partial)


def test_a_round_in_another_averager_than_the_last_is_judged_by_its_own_count():
    """A complete round in the second averager is a success although that averager's count exceeds the first's
    (the count read before the round once came from the last round's averager: every PowerSGD dense round after a
    first partial one was taken for a failed round, and that replica stepped alone); a partial one is a failure."""
    complete = _scheme(partial=False)
    averaged, group = asyncio.run(complete._group_average(4, [torch.zeros(3)], 1))
    assert group == 2 and averaged is not None and torch.equal(averaged[0], torch.ones(3))
    assert (complete.rounds_ok, complete.rounds_failed, complete.partial_rounds) == (1, 0, 0)
    partial = _scheme(partial=True)
    averaged, group = asyncio.run(partial._group_average(4, [torch.zeros(3)], 1))
    assert (averaged, group) == (None, 1)
    assert (partial.rounds_ok, partial.rounds_failed, partial.partial_rounds) == (0, 1, 1)
