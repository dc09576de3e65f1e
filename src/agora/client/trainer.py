"""A trainer: streams its data shard into the pipeline and reports the loss.

It sends token ids to a head-stage peer and gets the loss back; activations then travel stage to stage without
it. Several microbatches stay in flight so stages never wait on the trainer. Accounting is per microbatch:
submitted, completed, retried, abandoned; tokens count once, when the microbatch completes.

Which head, and what a failure means, is the router's business (``client/router.py``): a head that reports trouble
further down the pipeline ("retries_exhausted", "no_peers") is only skipped for this microbatch, since the head did
nothing wrong. An empty stage makes the trainer wait (with a status line) instead of burning its bounded retries.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
from hivemind import DHT

from agora.config import Manifest
from agora.data import TokenDataset
from agora.client.router import Router, RouterOptions
from agora.net.protocol import DOWNSTREAM, RETRYABLE
from agora.net.reachability import register_hello
from agora.net.records import (
    ANNOUNCE_PERIOD_S, StageRecord, acks_key, announce, read_swarm, read_swarm_bans, stages_settled, trainers_key,
)
from agora.net.transport import RpcError, TransferStats

logger = logging.getLogger("agora.trainer")


@dataclass
class TrainerOptions:
    in_flight: int = 2
    max_retries: int = 3
    call_timeout_s: float = 120.0
    ban_s: float = 15.0
    status_every_s: float = 5.0
    fallback_wait_s: float = 10.0  # a dead head's record lingers up to RECORD_TTL_S: wait that out (client/router.py)
    hedge_factor: float = 4.0  # a microbatch slower than this x the head's typical latency is hedged (router.py)
    hedge_min_s: float = 3.0
    retry_backoff_s: float = 0.5  # pause before retrying a peer this microbatch already tried


@dataclass
class MicrobatchCounts:
    submitted: int = 0
    completed: int = 0
    retried: int = 0
    abandoned: int = 0


@dataclass
class TrainerStats:
    tokens: int = 0
    counts: MicrobatchCounts = field(default_factory=MicrobatchCounts)
    loss_curve: list[dict] = field(default_factory=list)  # {tokens, loss, wall_s}
    # Validation during training (``validate_every``): {step, wall_s, tokens, val_loss, batches, eval_s, step_after}
    val_curve: list[dict] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)


class Trainer:
    def __init__(
        self,
        manifest: Manifest,
        dht: DHT,
        shard: Optional[TokenDataset],
        options: Optional[TrainerOptions] = None,
        data_seed: Optional[int] = None,
    ):
        self.manifest = manifest
        self.dht = dht
        self.shard = shard
        self.opts = options or TrainerOptions()
        self.peer_id = str(dht.peer_id)
        self.training = False  # in the training loop of ``run`` (announced: stages hold partial batches meanwhile)
        self.stats = TrainerStats()
        self.transfer = TransferStats()
        self.swarm: list[list[StageRecord]] = [[] for _ in range(manifest.n_stages)]
        self.router: Optional[Router] = None  # set by start(): it needs the P2P
        self.banned: set[str] = set()  # peers banned by SENTINEL of BAN_QUORUM publishers (in the DHT)
        seed = manifest.seed if data_seed is None else data_seed
        self._batches = shard.batches(manifest.batch.microbatch_size, seed=seed) if shard is not None else None
        self._io = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="trainer-dht")
        self._p2p = None
        self.started_monotonic = time.monotonic()  # the zero of the loss and validation curves' ``wall_s``
        self.started_at = time.time()  # wall-clock anchor of the loss curve's ``wall_s`` (merged across processes)
        self._empty_since: dict[int, float] = {}
        self.val_batches_done = 0  # validation microbatches of the last evaluate() that got a loss back

    async def run_io(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    @property
    def acks(self) -> dict[str, int]:
        """Head-stage results received, per head peer (receiver-side accounting)."""
        return self.router.acks if self.router is not None else {}

    # The router's view of the head stage (``PeerSource``).
    def candidates(self) -> list[StageRecord]:
        return self.swarm[0]

    async def start(self) -> None:
        self._p2p = await self.dht.replicate_p2p()
        # A head nobody can dial opens a connection to us by calling this (net/reachability.py, ReverseDialer).
        await register_hello(self._p2p, self.manifest.run_id)
        options = RouterOptions(max_retries=self.opts.max_retries, timeout_s=self.opts.call_timeout_s,
                                wait_for_peers_s=self.opts.call_timeout_s, backoff_s=self.opts.retry_backoff_s,
                                backoff_per_attempt=True, ban_s=self.opts.ban_s, fallback_wait_s=self.opts.fallback_wait_s,
                                hedge_factor=self.opts.hedge_factor, hedge_min_s=self.opts.hedge_min_s,
                                retryable=RETRYABLE | DOWNSTREAM, warn_when_empty=False)
        self.router = Router(self._p2p, self.manifest.run_id, 0, self, options, stats=self.transfer,
                             errors=self.stats.errors)
        await self.announce()  # stages of an allow-listed run serve only callers with a (certified) record
        await self.refresh()

    def close(self) -> None:
        self._io.shutdown(wait=False)

    async def refresh(self) -> None:
        m = self.manifest
        swarm = await self.run_io(read_swarm, self.dht, m.run_id, m.n_stages, m.hash)
        try:
            # Heads that the next stage banned for corrupted activations are not sent our data any more.
            self.banned |= await self.run_io(read_swarm_bans, self.dht, m.run_id, m.n_stages, m.hash, swarm)
        except Exception as err:
            logger.debug(f"reading bans failed: {err!r}")
        self.swarm = [[r for r in stage if r.peer_id not in self.banned] for stage in swarm]

    def empty_stages(self) -> list[int]:
        return [s for s, recs in enumerate(self.swarm) if not any(r.state == "serving" for r in recs)]

    async def _background(self, stop: asyncio.Event) -> None:
        last_announce = 0.0
        while not stop.is_set():
            try:
                await self.refresh()
                if time.monotonic() - last_announce > ANNOUNCE_PERIOD_S:
                    await self.announce()
                    last_announce = time.monotonic()
            except Exception as err:
                logger.warning(f"trainer DHT refresh failed: {err!r}")
            await asyncio.sleep(1.0)

    async def announce(self) -> None:
        loss = self.stats.loss_curve[-1]["loss"] if self.stats.loss_curve else float("nan")
        value = {"peer_id": self.peer_id, "manifest_hash": self.manifest.hash, "tokens": self.stats.tokens,
                 "loss": loss, "microbatches": asdict(self.stats.counts), "training": self.training}
        await self.run_io(announce, self.dht, trainers_key(self.manifest.run_id), self.peer_id, value)
        if self.acks:
            acks = {"manifest_hash": self.manifest.hash, "acks": dict(self.acks)}
            await self.run_io(announce, self.dht, acks_key(self.manifest.run_id), self.peer_id, acks)

    # ------------------------------------------------------------------ one microbatch
    async def _wait_for_full_pipeline(self, stop: Optional[asyncio.Event] = None, timeout_s: float = math.inf,
                                      what: str = "") -> bool:
        """Whether every stage has a serving peer before ``stop`` is set or ``timeout_s`` passes, saying every
        ``status_every_s`` what is awaited (``what``: whose wait it is, e.g. "validation")."""
        deadline, warned_at = time.monotonic() + timeout_s, -math.inf
        prefix = f"{what}: " if what else ""
        while stop is None or not stop.is_set():
            empty = self.empty_stages()
            if not empty:
                return True
            if time.monotonic() > deadline:
                logger.warning(f"{what or 'waiting'} skipped: stage {empty[0]} has had no serving peer for "
                               f"{timeout_s:.0f}s")
                return False
            if time.monotonic() - warned_at > self.opts.status_every_s:
                more = f" up to {deadline - time.monotonic():.0f}s more" if math.isfinite(deadline) else ""
                logger.warning(f"{prefix}stage {empty[0]} has no peers; waiting{more}")
                warned_at = time.monotonic()
            await asyncio.sleep(0.5)
            await self.refresh()
        return False

    async def send(
        self, batch: torch.Tensor, train: bool = True, stop: Optional[asyncio.Event] = None
    ) -> Optional[float]:
        """One microbatch through the pipeline; returns its loss, or None if abandoned after bounded retries."""
        tokens = batch[:, :-1].to(torch.int32).contiguous()
        last = batch[:, -1].to(torch.int32).contiguous()
        meta = {"run_id": self.manifest.run_id, "manifest_hash": self.manifest.hash, "stage": 0, "train": train}
        if train:  # its label: a stage that gets a retry of it does not accumulate it twice (server/exactly_once.py)
            meta["mb"] = secrets.token_hex(8)

        def count_retry() -> None:
            if train:
                self.stats.counts.retried += 1  # counts retries made, not the final failure (that is abandoned)

        try:
            _, (reply, _) = await self.router.call(meta, [tokens, last], job_tokens=tokens.numel(),
                                                   stopped=lambda: stop is not None and stop.is_set(),
                                                   on_retry=count_retry)
        except RpcError as err:
            if err.code not in ("retries_exhausted", "no_peers"):
                logger.error(f"microbatch refused by the pipeline: {err}")
            return None
        loss = reply.get("loss")
        return float(loss) if loss is not None else None

    async def _one(self, stop: Optional[asyncio.Event] = None) -> None:
        batch = next(self._batches)
        self.stats.counts.submitted += 1
        submitted_s = time.monotonic() - self.started_monotonic
        loss = await self.send(batch, stop=stop)
        if loss is None or not math.isfinite(loss):
            self.stats.counts.abandoned += 1
            return
        self.stats.counts.completed += 1
        self.stats.tokens += batch.shape[0] * (batch.shape[1] - 1)
        self.stats.loss_curve.append({"tokens": self.stats.tokens, "loss": loss,
                                      "wall_s": time.monotonic() - self.started_monotonic, "submitted_s": submitted_s})

    # ------------------------------------------------------------------ the loop
    async def run(self, stop: asyncio.Event, max_tokens: Optional[int] = None) -> TrainerStats:
        """Train until ``stop`` or ``max_tokens``. With ``max_tokens``, a microbatch is only submitted while the
        completed ones plus those in flight stay below it, so in-flight work never carries the count past it:
        a budget that is a whole number of microbatches ends exactly on it (else within one microbatch)."""
        self.training = True
        background = asyncio.create_task(self._background(stop))
        workers: set[asyncio.Task] = set()
        per_microbatch = self.manifest.batch.microbatch_size * self.manifest.model.seq_len

        def room() -> bool:
            return max_tokens is None or self.stats.tokens + len(workers) * per_microbatch < max_tokens

        try:
            while not stop.is_set() and (max_tokens is None or self.stats.tokens < max_tokens):
                if not await self._wait_for_full_pipeline(stop):
                    break
                while len(workers) < self.opts.in_flight and room():
                    workers.add(asyncio.create_task(self._one(stop)))
                done, workers = await asyncio.wait(workers, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                workers = set(workers)
                for task in done:
                    if task.exception() is not None:
                        logger.error(f"microbatch task crashed: {task.exception()!r}")
                        self.stats.counts.abandoned += 1
        finally:
            if workers:
                await asyncio.wait(workers, timeout=self.opts.call_timeout_s)
            background.cancel()
            await asyncio.gather(background, return_exceptions=True)
            self.training = False  # the stages may now step a last partial batch (see ReplicaSync)
            await self.announce()
        return self.stats

    async def wait_settled(self, since: float, timeout: float) -> bool:
        """Wait (up to ``timeout`` seconds) until every stage has applied what it was sent before ``since`` (a
        ``time.time()``): see :func:`agora.net.records.stages_settled`. A validation pass after this sees every
        trained token in the weights; False when the stages did not settle in time."""
        deadline = time.monotonic() + timeout
        in_a_row = 0
        while in_a_row < 2:
            await self.refresh()
            in_a_row = in_a_row + 1 if stages_settled(self.swarm, since) else 0
            if in_a_row < 2:
                if time.monotonic() > deadline:
                    return False
                await asyncio.sleep(0.5)
        return True

    def pipeline_step(self) -> int:
        """The optimizer step every stage has applied, as last read from the DHT: per stage the lowest step of its
        serving replicas, and the lowest of those (-1 while a stage has none serving)."""
        steps = [min((r.step for r in stage if r.state == "serving"), default=-1) for stage in self.swarm]
        return min(steps, default=-1)

    async def validate_every(self, batches: list[torch.Tensor], every_steps: int, stop: asyncio.Event) -> None:
        """Until ``stop`` (or cancelled): each time every stage has applied another ``every_steps`` optimizer steps,
        run ``batches`` through the swarm (forward only, alongside training) and add the loss to ``stats.val_curve``
        with the step and the time since this trainer started. The step comes from the DHT records (refreshed
        every second by the training loop), so an evaluation can start a little after its step and, on a slow
        link, end after the next one: ``step_after`` says which step the stages had reached when it ended."""
        if every_steps < 1:
            raise ValueError(f"every_steps must be at least 1, got {every_steps}")
        done = 0
        while not stop.is_set():
            step = self.pipeline_step()
            if step >= done + every_steps:
                done = step - step % every_steps
                loss = await self.validate_point(batches)
                logger.info(f"validation after step {step}: loss {loss:.4f} ({self.val_batches_done} batches)")
                continue
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                pass

    async def validate_point(self, batches: list[torch.Tensor], final: bool = False) -> float:
        """``evaluate``, also added to ``stats.val_curve`` with the step every stage had applied when it started
        and when it ended, and the time since this trainer started; ``final``: the pass on the model the run
        ended with."""
        step, t = self.pipeline_step(), time.monotonic()
        loss = await self.evaluate(batches)
        self.stats.val_curve.append({"step": step, "wall_s": t - self.started_monotonic, "tokens": self.stats.tokens,
                                     "val_loss": loss, "batches": self.val_batches_done,
                                     "eval_s": time.monotonic() - t, "step_after": self.pipeline_step(),
                                     "final": final})
        return loss

    async def evaluate(self, batches: list[torch.Tensor]) -> float:
        """Validation loss through the swarm (forward only, no gradients, no optimizer effect); NaN, with a warning,
        when some stage has had no serving peer for ``call_timeout_s``. Why the up-front check: each batch would
        otherwise wait that long for a peer on its own, silently (8 batches: 16 minutes at the default)."""
        await self.refresh()
        if not await self._wait_for_full_pipeline(timeout_s=self.opts.call_timeout_s, what="validation"):
            self.val_batches_done = 0
            return float("nan")
        losses = [await self.send(b, train=False) for b in batches]
        losses = [x for x in losses if x is not None]
        self.val_batches_done = len(losses)
        return float(sum(losses) / len(losses)) if losses else float("nan")
