"""Every stage steps once per target batch: a replica admits training microbatches only while its stage holds less
than the target batch (``ReplicaSync.admit_training``), and steps on a partial batch only once no trainer trains."""

import asyncio
import time

import pytest

from agora.config import load_manifest
from agora.net.records import PeerState, StageRecord
from agora.net.transport import RpcError
from agora.server.averaging.sync import ReplicaSync
from swarm_util import offline_sync_context
from agora.server.observers import Observers
from agora.server.runtime import Counters, StageRuntime


def _sync() -> ReplicaSync:
    manifest = load_manifest("tiny")
    rt = StageRuntime(manifest, 0, Counters(), Observers())

    async def unused(*args):
        raise AssertionError("this test reads and announces nothing")

    return ReplicaSync(offline_sync_context(rt, run_compute=unused, run_io=unused, announce=unused))


def _replica(step: int, samples: int, state: str = PeerState.SERVING.value) -> StageRecord:
    return StageRecord(peer_id="QmOther", stage=0, state=state, manifest_hash="h", step=step, samples=samples)


def test_a_stage_holds_training_microbatches_once_its_replicas_hold_the_target_batch():
    sync = _sync()
    rt, target = sync.ctx.runtime, sync.target
    assert target == 16

    async def scenario():
        await sync.admit_training(8, 1.0)  # in flight here
        rt.samples = 4  # accumulated here
        sync._note_replicas([_replica(rt.step, 4)])  # announced by the other replica at our step: 16 in all
        assert not sync.batch_open()
        with pytest.raises(RpcError) as err:
            await sync.admit_training(8, 0.2)
        assert err.value.code == "batch_full"
        waiting = asyncio.create_task(sync.admit_training(8, 5.0))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # held, not refused
        sync.release(8)  # the in-flight microbatch finished: accumulated now
        rt.samples = 12
        await asyncio.sleep(0.2)
        assert not waiting.done()
        rt.samples = 0  # the step took the batch; the other replica announced its reset
        sync._note_replicas([_replica(rt.step + 1, 0)])
        await asyncio.wait_for(waiting, 2.0)
        assert sync.admitted == 8

    asyncio.run(scenario())


def test_only_replicas_that_serve_at_our_step_or_one_ahead_count():
    sync = _sync()
    step = sync.ctx.runtime.step
    sync._note_replicas([_replica(step, 3), _replica(step + 1, 5), _replica(step + 2, 100),
                         _replica(step, 100, PeerState.SYNCING.value)])
    assert sync.others_samples == 8
    sync.release(10**6)  # a release never drives the count below zero
    assert sync.admitted == 0


def test_a_partial_batch_is_stepped_only_once_no_trainer_trains():
    from agora.net.records import trainers_training

    training = {"n": 1}
    rounds = []

    class Recording(ReplicaSync):
        async def round(self, n_others: int, stalled: bool = False) -> None:
            rounds.append(stalled)

    manifest = load_manifest("tiny")
    rt = StageRuntime(manifest, 0, Counters(), Observers())

    async def run_io(fn, *args):
        assert fn is trainers_training
        return training["n"]

    async def announce():
        pass

    sync = Recording(offline_sync_context(rt, stall_step_s=0.1, run_io=run_io, announce=announce))

    async def scenario():
        rt.samples = 4
        rt.last_sample_time -= 60  # nothing arrived for a minute: a slower stage, while a trainer trains
        await sync._step_when_ready(0, n_others=0)
        assert rounds == []
        training["n"] = 0
        sync._trainers_read_at = 0.0  # the next look reads the trainers again
        await sync._step_when_ready(0, n_others=0)
        assert rounds == [True]  # the run's last, partial batch
        rt.samples = 16
        await sync._step_when_ready(0, n_others=0)
        assert rounds == [True, False]  # a full batch steps at once

    asyncio.run(scenario())



def test_a_partial_batch_is_stepped_once_the_other_stages_took_the_step_and_no_sample_comes():
    """The rest of the batch left with a replica (``ReplicaSync._left_behind``): once every other stage published
    its gradient norm of our step and no sample came for a while (longer while microbatches are in flight here or at
    a replica), waiting is a deadlock."""
    from agora.net.dht import make_dht
    from agora.net.records import announce
    from agora.server.averaging.clip import gradnorm_key

    rounds = []

    class Recording(ReplicaSync):
        async def round(self, n_others: int, stalled: bool = False) -> None:
            rounds.append((n_others, stalled))

    manifest = load_manifest("tiny")
    rt = StageRuntime(manifest, 1, Counters(), Observers())
    dht = make_dht(manifest=manifest)
    try:
        async def run_io(fn, *args):
            return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

        async def nothing():
            pass

        sync = Recording(offline_sync_context(rt, dht=dht, peer_id=str(dht.peer_id), stall_step_s=1e9, run_io=run_io,
                                              announce=nothing))

        async def look(others_samples=4, others_admitted=0):
            sync._left_behind_read_at = 0.0  # every look may read the DHT
            await sync._step_when_ready(others_samples, n_others=1, others_admitted=others_admitted)

        async def scenario():
            rt.samples = 4
            rt.last_sample_time -= 60
            await look()
            assert rounds == []  # stage 0 has not published step 0's norm: it is still collecting (or slow)
            await run_io(announce, dht, gradnorm_key(manifest.run_id, rt.step), "QmHead",
                         {"stage": 0, "sq_norm": 1.0, "manifest_hash": manifest.hash}, 60.0)
            await sync.admit_training(4, 1.0)
            rt.last_sample_time = time.monotonic() - 3
            await look()
            assert rounds == []  # a microbatch in flight here for 3 s: its backward may still be on its way
            sync.release(4)
            await look(others_admitted=4)
            assert rounds == []  # ... or at the other replica
            rt.last_sample_time = time.monotonic()
            await look()
            assert rounds == []  # a sample just arrived: more may follow
            rt.last_sample_time -= 60
            await look()
            assert rounds == []  # one look could have read a replica's lagging record: confirm at the next
            await look(others_samples=8)
            assert rounds == []  # it was lagging: the replica holds 8 now, a new look is needed
            await look(others_samples=8)
            assert rounds == [(1, False)] and sync.realigned_steps == 1  # 12 of 16 samples, and nothing can come
            # Microbatches in flight for a minute while the other stages took the step: they hold them for their
            # next step (our batches are shifted against theirs), so waiting for them would be the same deadlock.
            sync._left_behind_seen = None  # (the recording stage does not step: its next step starts afresh)
            await sync.admit_training(4, 1.0)
            rt.last_sample_time -= 60
            await look(others_samples=8)
            assert len(rounds) == 1  # confirmed at the next look
            await look(others_samples=8)
            assert rounds == [(1, False)] * 2 and sync.realigned_steps == 2
            sync.release(4)

        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        dht.shutdown()
