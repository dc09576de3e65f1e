"""A round whose group is complete starts its all-reduce at once (``GuardedAverager.set_target_group_size``) instead
of at the end of the matchmaking time, and a target above the peers that come changes nothing but the wait."""

from __future__ import annotations

import time

import hivemind
import pytest
import torch

from agora.server.averaging.allreduce import GuardedAverager
from agora.server.averaging.sync import ReplicaSync

MATCHMAKING_S = 6.0  # far above what a complete group needs to form on loopback


def _averagers(prefix: str, dhts) -> list[GuardedAverager]:
    return [GuardedAverager([torch.full((1000,), float(i))], dht, prefix=prefix, start=True, min_group_size=2,
                            min_matchmaking_time=MATCHMAKING_S, request_timeout=0.5, allreduce_timeout=15,
                            next_chunk_timeout=5.0)
            for i, dht in enumerate(dhts)]


def _timed_round(averagers) -> tuple[float, bool]:
    """Seconds from the first ``step`` until every averager finished, and whether all hold the true average."""
    t0 = time.monotonic()
    controls = [a.step(wait=False, timeout=30) for a in averagers]
    for c in controls:
        c.result(60)
    took = time.monotonic() - t0
    exact = []
    for a in averagers:
        with a.get_tensors() as (t,):
            exact.append(bool(torch.allclose(t, torch.full_like(t, 0.5))))
    return took, all(exact)


@pytest.fixture
def two_dhts():
    boot = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peers = [str(a) for a in boot.get_visible_maddrs()]
    dhts = [hivemind.DHT(initial_peers=peers, start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in range(2)]
    yield dhts
    for d in [*dhts, boot]:
        d.shutdown()


def test_a_complete_group_starts_before_the_matchmaking_time_ends_and_a_larger_target_waits_it_out(two_dhts):
    averagers = []
    try:
        averagers += _averagers("targeted", two_dhts)
        for a in averagers:
            a.set_target_group_size(2)
        fast, fast_exact = _timed_round(averagers)
        # the same peers, a target one above them (a replica in the records that does not join): the old wait
        averagers += _averagers("waiting", two_dhts)
        for a in averagers[2:]:
            a.set_target_group_size(3)
        slow, slow_exact = _timed_round(averagers[2:])
    finally:
        for a in averagers:
            a.shutdown()
    print(f"complete group {fast:.2f}s, group below its target {slow:.2f}s")
    assert fast_exact and slow_exact
    assert fast < MATCHMAKING_S - 2.0, f"a complete group took {fast:.2f}s, the whole matchmaking time"
    assert slow >= MATCHMAKING_S - 1.0, f"a group below its target started after {slow:.2f}s"


def test_a_target_below_two_is_refused():
    class Bare(GuardedAverager):
        def __init__(self):  # no process: only the argument check runs
            self._target_sent, self._parent_pid = None, None  # ``__del__`` reads the pid

    with pytest.raises(ValueError, match="below 2"):
        Bare().set_target_group_size(1)


def test_the_expected_group_counts_every_replica_in_the_records():
    class Counting(ReplicaSync):
        def __init__(self, replica_ids):  # only what expected_group_size reads
            self.replica_ids = set(replica_ids)

    assert Counting([]).expected_group_size() == 1
    assert Counting(["a", "b", "c"]).expected_group_size() == 4
