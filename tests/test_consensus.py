"""Consensus distance from sampled parameters: every replica samples the same seeded positions, records carry the
values with the step they were taken after, and the distance compares replicas at one step only."""

import math

import torch

from agora.config import load_manifest
from agora.net.records import StageRecord, sampled_consensus_distance, sampled_relative_distance
from agora.server.observers import Observers
from agora.server.runtime import PARAMETER_SAMPLE, Counters, StageRuntime

MAN = load_manifest("tiny")


def _rec(peer, step, sample, state="serving"):
    return StageRecord(peer_id=peer, stage=0, state=state, manifest_hash="h", param_sample_step=step,
                       param_sample=sample)


def test_the_distance_is_the_relative_spread_at_the_most_common_step():
    same = [1.0, 2.0, 2.0]
    assert sampled_consensus_distance([_rec("a", 3, same), _rec("b", 3, list(same))]) == 0.0
    # two replicas at +-d around the mean m: mean ||s_i - m|| / ||m|| = ||d|| / ||m||
    m, d = [3.0, 4.0, 0.0], [0.0, 0.0, 1.0]
    a = [x + y for x, y in zip(m, d)]
    b = [x - y for x, y in zip(m, d)]
    assert math.isclose(sampled_consensus_distance([_rec("a", 3, a), _rec("b", 3, b)]), 1.0 / 5.0)
    # a replica one step behind, a leaving one, or one without a sample is not compared
    records = [_rec("a", 3, a), _rec("b", 3, b), _rec("c", 2, [100.0, 0.0, 0.0]),
               _rec("d", 3, [9.0, 9.0, 9.0], state="leaving"), _rec("e", 3, [])]
    assert math.isclose(sampled_consensus_distance(records), 0.2)
    assert sampled_consensus_distance([_rec("a", 3, a), _rec("c", 2, b)]) is None
    assert sampled_consensus_distance([]) is None


def test_the_relative_distance_of_two_samples_refuses_what_it_cannot_compare():
    """Replicas judge their agreement with it (``ReplicaSync.agrees_with``); the other sample comes from an
    untrusted record."""
    assert sampled_relative_distance([3.0, 4.0], [3.0, 4.0]) == 0.0
    assert math.isclose(sampled_relative_distance([3.0, 4.0], [3.0, 3.0]), 1.0 / 5.0)
    for ours, theirs in (([3.0, 4.0], [3.0]), ([], []), ([0.0, 0.0], [1.0, 1.0]), ([3.0, 4.0], ["x", 1.0]),
                         ([3.0, 4.0], [float("nan"), 1.0]), ([3.0, 4.0], [float("inf"), 1.0]), ([3.0, 4.0], [None, 1])):
        assert sampled_relative_distance(ours, theirs) is None, theirs


def test_replicas_sample_the_same_positions_and_the_sample_follows_the_weights():
    a, b = (StageRuntime(MAN, 1, Counters(), Observers()) for _ in range(2))
    assert a._sample_at == b._sample_at and len(a._sample_at) == PARAMETER_SAMPLE
    assert a.parameter_sample == b.parameter_sample and a.parameter_sample[0] == 0
    other_stage = StageRuntime(MAN, 0, Counters(), Observers())
    assert other_stage._sample_at != a._sample_at
    grads = [torch.full(p.shape, 0.1, dtype=torch.float64) for p in a.stage.parameters()]
    a.apply_step(grads)
    step, values = a.parameter_sample
    assert step == 1 and values != b.parameter_sample[1]
    flat = torch.cat([p.detach().reshape(-1) for p in a.stage.parameters()])
    sizes = [p.numel() for p in a.stage.parameters()]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    assert values == [float(flat[starts[i] + j]) for i, j in a._sample_at]
    b.import_state(*a.export_state())
    assert b.parameter_sample == a.parameter_sample
