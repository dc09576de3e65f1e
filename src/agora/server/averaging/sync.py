"""Per-stage data parallelism: replicas of a stage average gradients and step together.

Why not ``hivemind.Optimizer``: its progress tracker extrapolates when the swarm will reach the target batch, so
replicas sometimes step on partial batches at different moments and drift apart. Here the decision is made from
facts: each replica announces (step, samples accumulated) in its DHT record; when the replicas at our step
together hold the target batch, every one of them joins an all-reduce (hivemind's ``DecentralizedAverager``,
butterfly all-reduce, weights = samples) and applies the same averaged gradient.

Averaging happens in float64. hivemind applies the result as ``local += (average - local)``; in float32 that
leaves replicas a rounding error apart, in float64 the error vanishes when cast back to float32, so replicas stay
bit-identical.

Repair instead of hope: a replica that finds another one ahead of it, or one at the same step with different
parameters (a failed round, a missed step), downloads the full state from it. Joining peers do the same.

Failures inside a round are bounded: matchmaking gives up after ``averaging_timeout_s``, a running all-reduce after
hivemind's ``allreduce_timeout``, and while we look for a group we watch the DHT: once no replica at our step is
left (its record expired: it died), we cancel and step on our own gradients rather than wait out the timeout.
Survivors of a broken round may hold slightly different parameters (parts of the all-reduce missing); the
fingerprint comparison then makes every replica adopt the state of the one with the smallest peer id, keeping its
own accumulated gradients (they are as good an estimate on the adopted parameters), so replicas never drift.

The manifest's ``averaging.scheme`` picks what a round moves (all replicas of a run agree: it is in the hash):

* ``full`` (default): the above, the whole float64 gradient (8 bytes per parameter per step).
* ``powersgd``: the same decision and repairs, but a round is rank-``r`` PowerSGD with error feedback, both of its
  all-reduces in one hivemind group (``agora.server.averaging.allreduce.PowerSGDAverager``): ``8 r (n + m)`` bytes per
  ``n x m`` matrix instead of ``8 n m``. Every replica applies the same update, so they stay bit-identical and the
  fingerprint repair works unchanged. A failed round costs no repair either: every replica whose round failed takes
  a zero-gradient step and keeps ``G + E`` in its error buffer for the next round. A state download resets the
  error buffer (it belongs to the trajectory left behind); a replica alone steps on ``G + E``.
* ``sparse`` (SPARTA, METHODS §3): replicas step together (same decision as above) but each on its own gradients;
  every ``H`` steps a background round averages a seeded ``rho`` slice of parameters and Adam moments and applies
  it with the delta rule, ``k`` steps later. Replicas legitimately differ, so the leader adoption is off, and a
  replica's state is downloaded only when it fell more than ``H`` steps behind.

Every scheme's all-reduce goes through ``CountingCompression``: ``bytes_sent`` and ``round_bytes`` are measured
payload bytes, not estimates.
"""

from __future__ import annotations

import asyncio
from collections import deque
import logging
import random
import time
from typing import TYPE_CHECKING, Optional

import torch
from hivemind.averaging import DecentralizedAverager

from agora.compression.powersgd import PowerSGD
from agora.compression.sparse import SparseAverager, SparseSnapshot
from agora.net import transport
from agora.server.averaging.allreduce import CountingCompression, PowerSGDAverager
from agora.net.records import PeerState, StageRecord, read_bans, read_stage, read_swarm
from agora.net.transport import RpcError

if TYPE_CHECKING:
    from agora.server.node import StageNode

logger = logging.getLogger("agora.averaging")

POLL_S = 0.3
ZERO_SAMPLE_WEIGHT = 1e-6  # hivemind requires positive weights; this keeps an empty replica's influence < fp32 eps


def parameter_fingerprint(module: torch.nn.Module) -> float:
    """An exact checksum of the parameters: equal floats iff (almost surely) equal parameters."""
    with torch.no_grad():
        total = 0.0
        for i, p in enumerate(module.parameters()):
            total += float(p.double().sum()) * (1 + i * 1e-3) + float(p.double().abs().sum()) * 1e-7
        return total


class ReplicaSync:
    def __init__(self, node: "StageNode"):
        self.node = node
        m = node.manifest
        self.target = m.batch.target_batch_size
        self.prefix = f"{m.run_id}_s{node.stage_index}_{m.hash}_grads"  # no dots: hivemind splits keys on '.'
        self.scheme = m.averaging.scheme
        self.compression = CountingCompression()  # measures the all-reduce bytes this replica sends
        settings = dict(
            start=True,
            prefix=self.prefix,
            min_group_size=2,
            min_matchmaking_time=1.0,
            request_timeout=0.5,  # below min_matchmaking_time, else matchmaking can deadlock
            allreduce_timeout=node.opts.averaging_timeout_s,
            next_chunk_timeout=5.0,
            allow_state_sharing=False,
            shutdown_timeout=2,
            compression=self.compression,
        )
        params = list(node.stage.parameters())
        self.psgd: Optional[PowerSGD] = None
        self.sparse: Optional[SparseAverager] = None
        if self.scheme == "powersgd":
            a = m.averaging
            self.psgd = PowerSGD([p.shape for p in params], a.rank, run_id=m.run_id, stage=node.stage_index,
                                 warm_start=a.warm_start)
            f64 = torch.float64
            phase1 = [torch.zeros(s, dtype=f64) for s in [*self.psgd.p_shapes(), *self.psgd.passthrough_shapes()]]
            qs = [torch.zeros(s, dtype=f64) for s in self.psgd.q_shapes()]
            matrices = [torch.zeros(ps[0], qs_[0], dtype=f64)
                        for ps, qs_ in zip(self.psgd.p_shapes(), self.psgd.q_shapes())]
            self.averager = PowerSGDAverager(phase1, qs, matrices, node.dht, **settings)
        elif self.scheme == "sparse":
            a = m.averaging
            self.sparse = SparseAverager(list(node.stage.named_parameters()), node.optimizer,
                                         seed=(m.run_id, node.stage_index), rho=a.rho, every=a.every)
            payload = [torch.zeros(self.sparse.payload_numel(), dtype=torch.float64)]
            self.averager = DecentralizedAverager(payload, node.dht, **settings)
        else:
            gradients = [torch.zeros_like(p, dtype=torch.float64) for p in params]
            self.averager = DecentralizedAverager(gradients, node.dht, **settings)
        self._compressed_step: Optional[int] = None  # step whose PowerSGD payload is built and not yet resolved
        self._sparse_task: Optional[asyncio.Task] = None  # the background SPARTA round in flight (at most one)
        self._samples_since_round = 0  # the weight of this replica in the next SPARTA round
        self._epoch = 0  # bumped by every state download: a SPARTA round snapshotted before one is dropped
        self.round_bytes: deque[int] = deque(maxlen=100)  # all-reduce payload bytes we sent, per successful round
        self.fingerprint = parameter_fingerprint(node.stage)
        self.fingerprint_step = node.step  # the step ``fingerprint`` was computed at (records carry it only then)
        self.lock = asyncio.Lock()  # held for a whole tick: a stage move waits for it, so never stops a round midway
        self.aborted_rounds = 0
        self.control = None  # hivemind's StepControl of the round in progress (its stage shows where it is)
        self.closed = False
        self.rounds_ok = 0
        self.rounds_failed = 0
        self.local_steps = 0
        self.resyncs = 0
        self._announced_samples, self._announced_at = 0, 0.0
        self.averaging_step = -1
        self._banned: set[str] = set()
        self._banned_at = 0.0
        self.round_observers: list = []  # called with (ok: bool, seconds: float, group_size: int)

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.averager.shutdown()
        except Exception as err:  # already gone: nothing left to release
            logger.debug(f"averager shutdown: {err!r}")

    # ------------------------------------------------------------------ helpers
    async def replicas(self) -> list[StageRecord]:
        n = self.node
        recs = await n.run_io(read_stage, n.dht, n.manifest.run_id, n.stage_index, n.manifest.hash)
        return [r for r in recs if r.peer_id != n.peer_id]

    async def download_from(self, peer: StageRecord, timeout: float = 60.0, keep_grads: bool = False) -> bool:
        """Copy parameters + optimizer state + step from ``peer``; bounded by ``timeout``.

        ``keep_grads``: keep the gradients accumulated toward the next step (a same-step repair); a download that
        changes the step drops them, since they belong to a step the replicas already took.
        """
        n = self.node
        meta = {"run_id": n.manifest.run_id, "manifest_hash": n.manifest.hash, "stage": n.stage_index}
        t0 = time.monotonic()
        try:
            reply, tensors = await transport.call(n._p2p, peer.peer_id, n.manifest.run_id, "get_state", meta, [], timeout)
        except RpcError as err:
            logger.warning(f"state download from {peer.peer_id[-8:]} failed: {err}")
            return False

        def load() -> None:
            n.import_state(reply["step"], reply["names"], tensors, keep_grads=keep_grads)
            self._epoch += 1
            if self.psgd is not None:
                self.psgd.reset()  # the error buffer belongs to the trajectory we just left
            self._set_fingerprint()

        try:
            await n.run_compute(load)
        except ValueError as err:  # a malformed state must not replace ours
            logger.warning(f"state from {peer.peer_id[-8:]} refused: {err}")
            return False
        self.resyncs += 1
        n.log_event("synced", source=peer.peer_id, step=n.step, seconds=time.monotonic() - t0)
        logger.info(f"stage {n.stage_index}: loaded step {n.step} from {peer.peer_id[-8:]} in {time.monotonic() - t0:.1f}s")
        return True

    def _set_fingerprint(self) -> None:
        """Compute thread only, right after the parameters changed, so record and parameters agree."""
        self.fingerprint = parameter_fingerprint(self.node.stage)
        self.fingerprint_step = self.node.step

    @property
    def fingerprint_valid(self) -> bool:
        return self.fingerprint_step == self.node.step

    async def initial_sync(self, timeout: float = 120.0, attempts: int = 5) -> bool:
        """Take the state of the freshest serving replica before serving; bounded by ``timeout`` and ``attempts``.

        True when in sync with the freshest replica (or when there is none: the first replica starts from the seed
        or its checkpoint). Replicas may step while we download, so we check again after each download. False when
        replicas exist but none delivered its state: the caller decides (a joining node still serves and resyncs
        later, a moving node goes back to its old stage).
        """
        n = self.node
        t0 = time.monotonic()
        deadline = t0 + timeout
        failures = 0
        while failures < attempts and time.monotonic() < deadline:
            serving = [r for r in await self.replicas() if r.state == PeerState.SERVING.value]
            if not serving:
                return True
            best = max(r.step for r in serving)
            freshest = [r for r in serving if r.step == best]
            known = [r.fingerprint for r in freshest if r.fingerprint]
            same_state = not known or self.fingerprint in known
            if best < n.step or (best == n.step and same_state):
                return True
            left = max(1.0, min(60.0, deadline - time.monotonic()))
            if await self.download_from(random.choice(freshest), timeout=left):
                continue
            failures += 1
            await asyncio.sleep(0.5)
        logger.warning(f"stage {n.stage_index}: could not get the state of a replica ({failures} failed downloads "
                       f"in {time.monotonic() - t0:.0f}s); at step {n.step}")
        return False

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        n = self.node
        try:
            while True:
                await asyncio.sleep(POLL_S)
                try:
                    async with self.lock:
                        await (self._tick_sparse() if self.sparse is not None else self._tick())
                except asyncio.CancelledError:
                    raise
                except Exception as err:  # keep the node alive; the next tick retries with fresh records
                    logger.warning(f"stage {n.stage_index} sync tick failed: {err!r}", exc_info=True)
        finally:
            if self._sparse_task is not None:  # a background round must not outlive its sync loop (stage move)
                self._sparse_task.cancel()

    async def _tick_sparse(self) -> None:
        """SPARTA: replicas step together, each on its own gradients; rounds run in the background.

        When to step is decided as for ``full``, from facts: once the replicas at our step together hold the target
        batch (or we stalled), we step, and a replica that sees another one a step ahead follows at once, on what
        it has accumulated (a zero gradient if nothing). Why keep the replicas' steps aligned although nothing is
        averaged per step: a SPARTA round pairs the replicas that reach the same multiple of ``H``; replicas left
        to step on their own share drift apart in steps (routing feeds one more than the other) and then never
        meet in a round. What is off compared to ``full``: no adoption of the leader's state on a fingerprint
        mismatch (replicas legitimately differ), and a state download only for a replica more than ``H`` steps
        behind (its state too stale for the rounds to pull it back).
        """
        n = self.node
        if n.state != PeerState.SERVING:
            return
        banned = await self.banned_replicas()  # also keeps the ban list fresh for the background rounds
        others = [r for r in await self.replicas() if r.state == PeerState.SERVING.value and r.peer_id not in banned]
        far = [r for r in others if r.step > n.step + self.sparse.every]
        if far:
            best = max(r.step for r in far)
            logger.info(f"stage {n.stage_index}: replica at step {best} is more than {self.sparse.every} steps ahead "
                        f"of our {n.step}; resyncing")
            await self.download_from(random.choice([r for r in far if r.step == best]))
            return
        if any(r.step > n.step for r in others):
            await self.round(0)  # the stage took this step: follow on our own gradients
            return
        if n.samples == 0:
            return
        await self._step_when_ready(sum(r.samples for r in others if r.step == n.step), n_others=0)

    async def _sparse_round(self, snap: SparseSnapshot, weight: int, epoch: int) -> None:
        """One background SPARTA round: all-reduce ``snap``'s payload, then apply the delta rule on the compute
        thread, ``k`` steps after the snapshot. Bounded by hivemind's timeouts and a hard deadline; a failed or
        mismatched round is dropped (its partition class comes back ``N`` rounds later)."""
        n = self.node
        timeout = n.opts.averaging_timeout_s
        sent_before = self.bytes_sent
        t0 = time.monotonic()
        result: Optional[dict] = None
        try:
            with self.averager.get_tensors() as bufs:
                bufs[0].copy_(snap.payload)
            control = await n.run_io(
                lambda: self.averager.step(
                    weight=max(float(weight), ZERO_SAMPLE_WEIGHT), gather={"round": snap.round_index},
                    timeout=timeout, allow_retries=True, wait=False,
                )
            )
            result = await self._await_round(control, None, timeout)
        except Exception as err:  # a failed round, not a failed node
            logger.warning(f"stage {n.stage_index}: SPARTA round {snap.round_index} raised {err!r}")
        rounds = {g.get("round") for g in result.values() if isinstance(g, dict)} if result is not None else set()
        if (result is None or len(result) < 2 or rounds != {snap.round_index} or await self._untrusted(result)):
            # No group, a group that mixed replicas of different rounds (different partition classes), a banned
            # or an uncertified member: applying it would corrupt our slice; drop it.
            self.rounds_failed += 1
            logger.warning(f"stage {n.stage_index}: SPARTA round {snap.round_index} dropped "
                           f"({'no group' if result is None else f'rounds {sorted(map(str, rounds))}'})")
            return
        with self.averager.get_tensors() as bufs:
            averaged = bufs[0].clone()

        def apply() -> Optional[int]:
            if epoch != self._epoch or n.step < snap.step:
                return None  # our state was replaced by a download meanwhile: the snapshot is of another trajectory
            k = self.sparse.apply(snap, averaged, n.step)
            n.version += 1  # parameters changed in place: unstashed microbatches recompute their forward
            self._set_fingerprint()
            return k

        k = await n.run_compute(apply)
        if k is None:
            self.rounds_failed += 1
            return
        self.rounds_ok += 1
        self.round_bytes.append(self.bytes_sent - sent_before)
        n.log_event("sparse_round", step=n.step, round=snap.round_index, group=len(result), delay_steps=k,
                    seconds=time.monotonic() - t0)
        logger.info(f"stage {n.stage_index}: SPARTA round {snap.round_index} (part {snap.part}) with {len(result)} "
                    f"replicas applied {k} steps later, {time.monotonic() - t0:.2f}s")

    async def _tick(self) -> None:
        n = self.node
        if n.state != PeerState.SERVING:
            return
        others = [r for r in await self.replicas() if r.state in (PeerState.SERVING.value, PeerState.SYNCING.value)]
        ahead = [r for r in others if r.step > n.step and r.state == PeerState.SERVING.value]
        if ahead:
            best = max(r.step for r in ahead)
            logger.info(f"stage {n.stage_index}: replica at step {best} is ahead of our {n.step}; resyncing")
            await self.download_from(random.choice([r for r in ahead if r.step == best]))
            return
        banned = await self.banned_replicas()
        same = [r for r in others if r.step == n.step and r.state == PeerState.SERVING.value
                and r.peer_id not in banned]
        averaging = any(r.averaging_step == n.step for r in same)
        if not averaging and self.fingerprint_valid:
            # Same step, different parameters (a broken round, a local fallback step): everyone adopts the state of
            # the replica with the smallest peer id. No round is running for this step, so none is cut short.
            known = [r for r in same if r.fingerprint]
            leader = min(known, key=lambda r: r.peer_id, default=None)
            if leader is not None and leader.peer_id < n.peer_id and leader.fingerprint != self.fingerprint:
                logger.warning(f"stage {n.stage_index}: parameters differ from replica {leader.peer_id[-8:]} at "
                               f"step {n.step}; adopting its state")
                await self.download_from(leader, keep_grads=True)
                return
        if averaging:
            # A replica started the round for our step: join it, even with nothing accumulated, so that every
            # replica applies the same update (a zero-sample member carries a negligible weight).
            await self.round(len(same))
            return
        if n.samples == 0:
            return
        await self._step_when_ready(sum(r.samples for r in same), n_others=len(same))

    async def _step_when_ready(self, others_samples: int, n_others: int) -> None:
        """Announce our sample count while it changes; step once the replicas at our step together hold the
        target batch (``others_samples`` + ours), or when no sample arrived for ``stall_step_s``."""
        n = self.node
        if n.samples != self._announced_samples and time.monotonic() - self._announced_at > 0.5:
            # Replicas decide from each other's sample counts: keep ours fresh while we accumulate.
            self._announced_samples, self._announced_at = n.samples, time.monotonic()
            await n.announce()
        total = n.samples + others_samples
        stalled = time.monotonic() - n.last_sample_time > n.opts.stall_step_s
        if total >= self.target or stalled:
            await self.round(n_others, stalled=stalled and total < self.target)

    async def _untrusted(self, result: dict) -> bool:
        """Whether a finished round's group holds a member whose contribution must not reach our parameters.

        hivemind's matchmaking cannot exclude anyone, so this is checked after the all-reduce: a replica banned by
        SENTINEL, or, in an allow-listed run (its matchmaking keys carry no certificate), a member without a
        certified record of this stage. If the replicas cannot be read, every other member counts as unknown.
        """
        n = self.node
        members = {str(p) for p in result} - {n.peer_id}
        if members & self._banned:
            logger.warning(f"stage {n.stage_index}: a banned replica joined the round; discarding it")
            return True
        if n.members is None or not members:
            return False
        try:
            outsiders = members - {r.peer_id for r in await self.replicas()}
        except Exception as err:
            logger.warning(f"stage {n.stage_index}: reading the replicas failed: {err!r}")
            outsiders = members
        if outsiders:
            logger.warning(f"stage {n.stage_index}: uncertified peers {sorted(outsiders)} joined the round; "
                           f"discarding it")
        return bool(outsiders)

    async def banned_replicas(self) -> set[str]:
        """Replicas banned by SENTINEL (ours, or published by ``BAN_QUORUM`` other peers), refreshed at most every 2 s."""
        n = self.node
        if time.monotonic() - self._banned_at > 2.0:
            self._banned_at = time.monotonic()
            try:
                m = n.manifest

                def serving() -> set[str]:  # runs on the I/O thread, inside read_bans, only if bans were published
                    swarm = read_swarm(n.dht, m.run_id, m.n_stages, m.hash)
                    return {r.peer_id for stage in swarm for r in stage if r.state == PeerState.SERVING.value}

                published = await n.run_io(read_bans, n.dht, m.run_id, m.hash, serving)
            except Exception as err:  # keep the previous view; bans only ever grow
                logger.debug(f"reading bans failed: {err!r}")
                published = set()
            self._banned = self._banned | published | n.banned_peers()
        return self._banned

    async def _partners_left(self, step: int) -> bool:
        """Whether any other replica that could still be in our round for ``step`` is alive in the DHT."""
        recs = await self.replicas()
        return any(r.state == PeerState.SERVING.value and (r.step == step or r.averaging_step == step) for r in recs)

    @property
    def bytes_sent(self) -> int:
        """All-reduce payload bytes this replica sent to the other members of its rounds, so far."""
        return self.compression.bytes_sent

    def _load_buffers(self, grads: list[torch.Tensor], step: int) -> None:
        """Compute thread: put this round's payload into the averager's buffers.

        ``full``: the gradients. ``powersgd``: ``P = (G + E) Q`` and the passthrough gradients for phase 1, and
        ``M = G + E`` for the averager to compute phase 2's ``Q`` from.
        """
        if self.psgd is None:
            with self.averager.get_tensors() as bufs:
                for b, g in zip(bufs, grads):
                    b.copy_(g)
            return
        ps = self.psgd.compress_p(grads, step)
        self._compressed_step = step
        payload = [*ps, *self.psgd.passthrough_tensors(grads)]
        with self.averager.get_tensors() as bufs:
            for b, t in zip(bufs, payload):
                b.copy_(t)
            for b, mat in zip(self.averager.matrices, self.psgd.matrices()):
                b.copy_(mat)

    def _averaged(self) -> list[torch.Tensor]:
        """Compute thread, after a successful round: the averaged update, one tensor per parameter."""
        with self.averager.get_tensors() as bufs:
            if self.psgd is None:
                return [b.clone() for b in bufs]
            k, n1 = len(self.psgd.compressed), self.averager.n_phase1
            p_hat, passthrough, q_avg = [b.clone() for b in bufs[:k]], [b.clone() for b in bufs[k:n1]], \
                [b.clone() for b in bufs[n1:]]
        self._compressed_step = None
        return self.psgd.assemble(self.psgd.decompress(p_hat, q_avg), passthrough)

    def _not_averaged(self, grads: list[torch.Tensor], alone: bool) -> list[torch.Tensor]:
        """Compute thread: what to apply when no round result exists.

        ``full``: our own gradients (as a lone replica would). ``powersgd`` alone: ``G + E`` (the error buffer is
        flushed: there is no group to compress for). ``powersgd`` after a failed round: a zero update, the whole
        ``G + E`` staying in the error buffer for the next round. Why not our own gradient here: it would be
        applied now *and* again through the error buffer; and replicas whose round failed together take the same
        zero-gradient step, so they stay identical and need no state download.
        """
        if self.psgd is None:
            return grads
        compressed, self._compressed_step = self._compressed_step, None
        if alone:
            return self.psgd.flush(grads)
        if compressed is None:  # the round failed before its payload was built: build M = G + E to keep it
            self.psgd.compress_p(grads, self.node.step)
        self.psgd.abort()
        return [torch.zeros_like(g) for g in grads]

    async def _average(self, samples: int, grads: list[torch.Tensor]) -> Optional[dict]:
        """One averaging round with the replicas at our step; None if it failed or was given up."""
        n = self.node
        step = n.step
        timeout = n.opts.averaging_timeout_s
        await n.run_compute(self._load_buffers, grads, step)
        control = await n.run_io(
            lambda: self.averager.step(
                weight=max(float(samples), ZERO_SAMPLE_WEIGHT), gather={"step": step, "samples": samples},
                timeout=timeout, allow_retries=True, wait=False,
            )
        )
        self.control = control
        try:
            return await self._await_round(control, step, timeout)
        finally:
            self.control = None

    async def _await_round(self, control, step: Optional[int], timeout: float) -> Optional[dict]:
        """Wait for hivemind's round; gathered metadata by peer, or None. With ``step``, give up early once no
        replica that could join the round for ``step`` is left (SPARTA rounds, ``step=None``, only time out)."""
        n = self.node
        # Hard bound: matchmaking (timeout) + one all-reduce (allreduce_timeout) + slack. hivemind enforces both;
        # this only guards against a wedged averager process.
        hard_deadline = time.monotonic() + 2 * timeout + 10.0
        next_check = time.monotonic() + 2.0
        while not control.done():
            await asyncio.sleep(0.1)
            now = time.monotonic()
            if now > hard_deadline:
                logger.warning(f"stage {n.stage_index}: averaging did not finish within {2 * timeout + 10:.0f}s")
                control.cancel()
                return None
            if step is not None and now > next_check and not control.began_allreduce:
                next_check = now + 1.0
                if not await self._partners_left(step):
                    # Everyone we could average with is gone (records expired: crashed, or moved on without us):
                    # waiting for the matchmaking timeout would only stall this stage.
                    control.cancel()
                    self.aborted_rounds += 1
                    logger.warning(f"stage {n.stage_index}: no replica left for the round of step {step}; "
                                   f"stepping locally")
                    return None
        try:
            return control.result(timeout=0)
        except BaseException as err:  # hivemind raises when no group formed; a failed round, not a crash
            logger.warning(f"stage {n.stage_index}: averaging failed: {err!r}")
            return None

    async def round(self, n_others: int, stalled: bool = False) -> None:
        n = self.node
        t0 = time.monotonic()
        samples, grads = await n.run_compute(n.take_gradients)
        self._samples_since_round += samples
        averaged: Optional[list[torch.Tensor]] = None
        group = 1
        if n_others > 0:
            self.averaging_step = n.step
            sent_before = self.bytes_sent
            try:
                await n.announce()  # tells replicas to join now, instead of when their own counts catch up
                result = await self._average(samples, grads)
            except Exception as err:  # e.g. the DHT failed the announce: a failed round, handled below
                logger.warning(f"stage {n.stage_index}: averaging round raised {err!r}")
                result = None
            finally:
                self.averaging_step = -1
            if result is not None and await self._untrusted(result):
                result = None
            if result is not None:
                group = len(result)
                steps = {g.get("step") for g in result.values() if isinstance(g, dict)}
                if len(steps) > 1:
                    logger.warning(f"stage {n.stage_index}: averaged with replicas at steps {sorted(steps)}")
                averaged = await n.run_compute(self._averaged)
                self.rounds_ok += 1
                self.round_bytes.append(self.bytes_sent - sent_before)
            else:
                self.rounds_failed += 1
                logger.warning(f"stage {n.stage_index}: all-reduce with {n_others} replicas failed; stepping locally")
        local = averaged is None
        if local:
            averaged = await n.run_compute(self._not_averaged, grads, n_others == 0)

        start_sparse = self.sparse is not None and (self._sparse_task is None or self._sparse_task.done())

        def step() -> tuple[Optional[SparseSnapshot], int]:
            n.apply_step([g.float() for g in averaged])
            self._set_fingerprint()
            if start_sparse and self.sparse.due(n.step):
                return self.sparse.snapshot(n.step), self._epoch  # right after the step: the round's starting state
            return None, self._epoch

        snap, epoch = await n.run_compute(step)
        if local:  # counted once the step is applied: a scrape never sees more local steps than steps
            self.local_steps += 1
        if snap is not None:
            weight, self._samples_since_round = self._samples_since_round, 0
            self._sparse_task = asyncio.create_task(self._sparse_round(snap, weight, epoch),
                                                    name=f"sparta-round-{snap.round_index}")
        dt = time.monotonic() - t0
        for observe in self.round_observers:
            observe(n_others == 0 or group > 1, dt, group)
        n.log_event("step", step=n.step, samples=samples, group=group, seconds=dt, stalled=stalled)
        logger.info(f"stage {n.stage_index}: step {n.step} ({samples} local samples, group of {group}, {dt:.2f}s)")
        await n.announce()
