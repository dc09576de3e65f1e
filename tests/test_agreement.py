"""Replicas agree when their fingerprints are equal, or when their records' parameter samples are within
``averaging.agreement_tolerance`` (``ReplicaSync.agrees_with``): what is agreement, what is not, what cannot be told
yet, and what an untrusted record cannot make a replica do."""

import math

import pytest
import torch

from agora.config import load_manifest
from agora.net.records import StageRecord
from agora.server.averaging.sync import ReplicaSync
from swarm_util import offline_sync_context
from agora.server.observers import Observers
from agora.server.runtime import Counters, StageRuntime

MAN = load_manifest("tiny")


def _sync(manifest=MAN) -> ReplicaSync:
    rt = StageRuntime(manifest, 1, Counters(), Observers())
    rt.apply_step([torch.full(p.shape, 0.01, dtype=torch.float64) for p in rt.stage.parameters()])
    sync = ReplicaSync(offline_sync_context(rt, peer_id="b", stall_step_s=1.0))
    sync._set_fingerprint()
    return sync


def _leader(sync: ReplicaSync, scale: float = 0.0, **fields) -> StageRecord:
    """A record of a replica at our step whose sample is ours moved by ``scale`` (relative), other fingerprint."""
    step, sample = sync.ctx.runtime.parameter_sample
    moved = [x + scale * math.sqrt(sum(v * v for v in sample) / len(sample)) for x in sample]
    values = dict(peer_id="a", stage=1, state="serving", manifest_hash=MAN.hash, step=step,
                  fingerprint=sync.fingerprint + 1.0, param_sample=moved, param_sample_step=step)
    return StageRecord(**{**values, **fields})


def test_rounding_agrees_and_the_follower_announces_the_leaders_version():
    sync = _sync()
    assert sync.agrees_with(_leader(sync, fingerprint=sync.fingerprint)) is True  # bit-identical
    assert sync.tolerated == 0
    rounding = _leader(sync, scale=1e-7)
    assert sync.agrees_with(rounding) is True
    assert sync.fingerprint == rounding.fingerprint and sync.tolerated == 1
    assert 0 < sync.agreement_distance < 1e-6 and sync.agreement_max_distance == sync.agreement_distance
    assert sync.agrees_with(rounding) is True and sync.tolerated == 1  # counted once per step


def test_a_real_divergence_does_not_agree_and_a_stale_sample_is_not_judged():
    sync = _sync()
    own = sync.fingerprint
    assert sync.agrees_with(_leader(sync, scale=1e-3)) is False
    assert sync.fingerprint == own and sync.agreement_distance > 1e-4
    step = sync.ctx.runtime.step
    assert sync.agrees_with(_leader(sync, scale=1e-7, param_sample_step=step - 1)) is None  # the record lags
    assert sync.agrees_with(_leader(sync, scale=1e-7, param_sample=[])) is False  # an older peer: exact only
    exact = _sync(MAN.with_overrides(**{"averaging.agreement_tolerance": 0.0}))
    assert exact.agrees_with(_leader(exact, scale=1e-9)) is False
    # Schemes whose replicas differ between rounds have no tolerance, whatever the default says.
    sparse = _sync(MAN.with_overrides(**{"averaging.scheme": "sparse"}))
    assert sparse.agrees_with(_leader(sparse, scale=1e-9)) is False


@pytest.mark.parametrize("fields", [
    {"fingerprint": "x"}, {"fingerprint": float("nan")}, {"fingerprint": True}, {"fingerprint": [1.0]},
    {"param_sample": 5}, {"param_sample": ["a"] * 128}, {"param_sample": [1e300] * 128}, {"param_sample": [1.0]},
    {"param_sample": [float("inf")] * 128}, {"param_sample": [None] * 128},
])
def test_an_untrusted_record_cannot_crash_or_steer_agreement(fields):
    sync = _sync()
    own = sync.fingerprint
    record = _leader(sync, scale=1e-8, **fields)
    assert sync.agrees_with(record) is False  # never an exception: the caller repairs by a download
    assert sync.fingerprint == own
