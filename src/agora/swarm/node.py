"""A stage server: one peer holding one pipeline stage, serving recursive forward-backward calls.

Threads and loops: the asyncio loop (this process's main thread) does all networking and DHT traffic; one
compute thread runs every forward, backward and optimizer step, so the stage's parameters are only ever touched
from one thread and an optimizer step can never interleave with half a backward.

The data path is stage to stage: the trainer calls a head peer with token ids; each stage computes its forward,
calls a peer of the next stage with the compressed boundary, receives the gradient of its output, runs its
backward and returns the gradient of its input. Activations never return through the trainer.

Optimizer steps vs microbatches in flight: a microbatch keeps its autograd graph while downstream stages work.
If this stage stepped in between (parameters changed in place), the graph is stale; we then recompute the
forward from the stashed input with the current parameters before the backward (PyTorch's version check would
otherwise refuse, rightly).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from hivemind import DHT
from hivemind.p2p import PeerID

from agora.config import Manifest
from agora.model import Stage
from agora.optim import build_optimizer, set_lr
from agora.swarm import transport
from agora.swarm.records import (
    ANNOUNCE_PERIOD_S,
    PeerState,
    StageRecord,
    acks_key,
    announce,
    read_stage,
    stage_key,
)
from agora.swarm.routing import BanList, pick_peer
from agora.swarm.transport import RpcError, TransferStats
from agora.wire import WIRE_DTYPES, Boundary, compress, decompress

logger = logging.getLogger("agora.node")

FWD_BWD = "fwd_bwd"
GET_STATE = "get_state"
INFO = "info"

# Failures of a downstream peer that justify retrying the microbatch on another replica. Validation errors
# (our request was bad) are not retried: another replica would refuse it the same way.
RETRYABLE = {
    transport.TIMEOUT,
    transport.UNREACHABLE,
    transport.NO_HANDLER,
    transport.CONNECTION_LOST,
    transport.INTERNAL,
    "leaving",
    "not_serving",
    "no_peers",
}


@dataclass
class NodeOptions:
    hop_timeout_s: float = 30.0  # one stage's compute + its downstream chain, scaled by the stages left
    max_retries: int = 3
    wait_for_peers_s: float = 60.0  # how long a hop waits for an empty next stage before giving up
    ban_s: float = 15.0
    averaging_timeout_s: float = 20.0
    stall_step_s: float = 10.0  # step with what we have if no new samples arrived for this long
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    drain_timeout_s: float = 20.0
    threads: Optional[int] = None


@dataclass
class Counters:
    """Microbatch accounting of this peer (exported in the DHT record and /metrics)."""

    forward: int = 0
    backward: int = 0
    eval: int = 0
    tokens: int = 0
    retried: int = 0
    failed: int = 0
    rejected: int = 0
    recomputed: int = 0
    busy_s: float = 0.0
    rejected_by_code: dict[str, int] = field(default_factory=dict)


@dataclass
class _Pending:
    """What a microbatch left on this stage between its forward and its backward."""

    inputs: Any  # token ids (head) or the decompressed-from coordinates (others)
    tokens: torch.Tensor
    leaf: Optional[torch.Tensor]
    out: torch.Tensor
    step: int


class StageNode:
    def __init__(self, manifest: Manifest, stage: int, dht: DHT, options: Optional[NodeOptions] = None):
        self.manifest = manifest
        self.stage_index = stage
        self.dht = dht
        self.opts = options or NodeOptions()
        self.peer_id = str(dht.peer_id)
        self.state = PeerState.JOINING
        self.stage = Stage(manifest, stage)
        self.is_head, self.is_tail = self.stage.spec.is_head, self.stage.spec.is_tail
        self.optimizer = build_optimizer(self.stage, manifest.optimizer)
        self.step = 0
        self.samples = 0  # samples whose gradients sit in .grad, waiting for the next step
        self.last_sample_time = time.monotonic()
        self.counters = Counters()
        self.stats_in = TransferStats()  # requests from upstream, replies to it
        self.stats_out = TransferStats()  # requests to downstream, replies from it
        self.throughput = 0.0  # tokens/s of compute, EMA
        self.inflight = 0
        self.loss_ema = float("nan")
        self.bans = BanList(self.opts.ban_s)
        self.next_records: list[StageRecord] = []
        self.sync = None  # set by start(): ReplicaSync
        self._compute = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"stage{stage}-compute")
        self._io = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix=f"stage{stage}-dht")
        self._queue = 0
        self._p2p = None
        self._tasks: list[asyncio.Task] = []
        self.events: list[dict] = []
        self._wire_dtype = WIRE_DTYPES[manifest.residual.wire_dtype]
        # Observers (e.g. Prometheus metrics) get (kind, seconds, tokens) for every forward/backward: no metrics
        # code in the hot path, and a node without metrics pays nothing.
        self.compute_observers: list = []
        # Receiver-side acknowledgements: how many results each downstream peer delivered to us. Published in the
        # DHT under our own id, so a peer's acknowledged work is vouched for by others, never by itself.
        self.acks: dict[str, int] = {}
        if self.opts.threads:
            torch.set_num_threads(self.opts.threads)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        from agora.swarm.averaging import ReplicaSync

        self._p2p = await self.dht.replicate_p2p()
        ns = self.manifest.run_id
        await transport.add_handler(self._p2p, ns, FWD_BWD, self._handle_fwd_bwd, stats=self.stats_in)
        await transport.add_handler(self._p2p, ns, GET_STATE, self._handle_get_state)
        await transport.add_handler(self._p2p, ns, INFO, self._handle_info)
        self.sync = ReplicaSync(self)
        self._tasks.append(asyncio.create_task(self._announce_loop(), name="announce"))
        if not self.is_tail:
            self._tasks.append(asyncio.create_task(self._refresh_next_loop(), name="refresh-next"))
        self.state = PeerState.SYNCING
        await self.announce()
        await self.sync.initial_sync()
        self.state = PeerState.SERVING
        await self.announce()
        self._tasks.append(asyncio.create_task(self.sync.run(), name="replica-sync"))
        logger.info(f"stage {self.stage_index} peer {self.peer_id[-8:]} serving at step {self.step}")

    async def stop(self) -> None:
        """Graceful leave: stop taking work, finish in-flight microbatches up to a deadline, announce, checkpoint."""
        self.state = PeerState.LEAVING
        await self.announce()
        deadline = time.monotonic() + self.opts.drain_timeout_s
        while self.inflight and time.monotonic() < deadline:
            logger.info(f"leaving: waiting for {self.inflight} microbatches in flight")
            await asyncio.sleep(0.5)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.sync is not None:
            self.sync.shutdown()
        if self.opts.checkpoint_dir:
            await self.run_compute(self.save_checkpoint)
        self._compute.shutdown(wait=True)
        self._io.shutdown(wait=False)

    async def run_compute(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    async def run_io(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    # ------------------------------------------------------------------ DHT announcements
    def record(self) -> StageRecord:
        c = self.counters
        return StageRecord(
            peer_id=self.peer_id,
            stage=self.stage_index,
            state=self.state.value,
            manifest_hash=self.manifest.hash,
            throughput=self.throughput,
            queue=self._queue,
            step=self.step,
            samples=self.samples,
            fingerprint=self.sync.fingerprint if self.sync else 0.0,
            averaging_step=self.sync.averaging_step if self.sync else -1,
            metrics={
                "forward": c.forward, "backward": c.backward, "tokens": c.tokens, "retried": c.retried,
                "failed": c.failed, "rejected": c.rejected, "loss": self.loss_ema,
                "bytes_out": self.stats_out.payload_bytes_sent, "bytes_in": self.stats_in.payload_bytes_received,
                "busy_s": c.busy_s,
            },
        )

    async def announce(self) -> None:
        rec = self.record().to_value()
        await self.run_io(announce, self.dht, stage_key(self.manifest.run_id, self.stage_index), self.peer_id, rec)
        if self.acks:
            acks = {"manifest_hash": self.manifest.hash, "acks": dict(self.acks)}
            await self.run_io(announce, self.dht, acks_key(self.manifest.run_id), self.peer_id, acks)

    async def _announce_loop(self) -> None:
        while True:
            try:
                await self.announce()
            except Exception as err:  # a DHT hiccup must not kill the node; the record just ages
                logger.warning(f"announce failed: {err!r}")
            await asyncio.sleep(ANNOUNCE_PERIOD_S)

    async def _refresh_next_loop(self) -> None:
        """Keep the next stage's records fresh off the hot path (one DHT read a second at most)."""
        while True:
            try:
                self.next_records = await self.run_io(
                    read_stage, self.dht, self.manifest.run_id, self.stage_index + 1, self.manifest.hash
                )
            except Exception as err:
                logger.warning(f"reading stage {self.stage_index + 1} records failed: {err!r}")
            await asyncio.sleep(1.0)

    # ------------------------------------------------------------------ validation
    def _reject(self, code: str, message: str) -> RpcError:
        self.counters.rejected += 1
        self.counters.rejected_by_code[code] = self.counters.rejected_by_code.get(code, 0) + 1
        return RpcError(code, message)

    def _validate(self, meta: dict, tensors: list[torch.Tensor]) -> None:
        m = self.manifest
        if meta.get("run_id") != m.run_id:
            raise self._reject("wrong_run", f"this peer serves run {m.run_id!r}, not {meta.get('run_id')!r}")
        if meta.get("manifest_hash") != m.hash:
            raise self._reject(
                "manifest_mismatch", f"manifest hash {meta.get('manifest_hash')} != this peer's {m.hash}"
            )
        if meta.get("stage") != self.stage_index:
            raise self._reject("wrong_stage", f"this peer serves stage {self.stage_index}, not {meta.get('stage')}")
        if self.state != PeerState.SERVING:
            raise RpcError("leaving" if self.state == PeerState.LEAVING else "not_serving", f"peer is {self.state.value}")
        expected = 2 if self.is_head else 3
        if len(tensors) != expected:
            raise self._reject("shape_mismatch", f"expected {expected} tensors, got {len(tensors)}")
        tokens, last = tensors[-2], tensors[-1]
        if tokens.dtype != torch.int32 or last.dtype != torch.int32:
            raise self._reject("dtype_mismatch", f"token ids must be int32, got {tokens.dtype} and {last.dtype}")
        if tokens.dim() != 2 or tokens.shape[1] > m.model.seq_len or tokens.shape[0] == 0:
            raise self._reject(
                "shape_mismatch", f"tokens must be [batch, <= {m.model.seq_len}], got {tuple(tokens.shape)}"
            )
        if tokens.shape[0] > 4 * m.batch.target_batch_size:
            raise self._reject("too_large", f"microbatch of {tokens.shape[0]} sequences is larger than allowed")
        if last.shape != (tokens.shape[0],):
            raise self._reject("shape_mismatch", f"last-token ids must be [{tokens.shape[0]}], got {tuple(last.shape)}")
        v = m.model.vocab_size
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= v or int(last.min()) < 0 or int(last.max()) >= v):
            raise self._reject("bad_token", f"token ids must be in [0, {v})")
        if not self.is_head:
            coords = tensors[0]
            width = m.residual.k if m.residual.mode == "subspace" else m.model.d_model
            want = (tokens.shape[0], tokens.shape[1], width)
            if tuple(coords.shape) != want:
                raise self._reject("shape_mismatch", f"boundary must be {want}, got {tuple(coords.shape)}")
            if coords.dtype != self._wire_dtype:
                raise self._reject("dtype_mismatch", f"boundary dtype must be {self._wire_dtype}, got {coords.dtype}")
            if not torch.isfinite(coords).all():
                raise self._reject("non_finite", "boundary contains NaN or Inf")

    # ------------------------------------------------------------------ compute (compute thread only)
    def _forward(self, tensors: list[torch.Tensor], train: bool) -> tuple[_Pending, Optional[float]]:
        t0 = time.perf_counter()
        tokens, last = tensors[-2].long(), tensors[-1].long()
        with torch.set_grad_enabled(train):
            leaf, out = self._forward_from(None if self.is_head else tensors[0], tokens)
            loss = None
            if self.is_tail:
                targets = torch.cat([tokens[:, 1:], last[:, None]], dim=1)
                loss_t = self.stage.loss(out, targets)
                loss = float(loss_t.detach())
                if train:
                    # Sum over sequences of per-sequence mean loss: gradients add up to samples x mean.
                    (loss_t * tokens.shape[0]).backward()
        self._account(t0, tokens.numel(), "forward")
        pending = _Pending(tensors[0] if not self.is_head else None, tokens, leaf, out, self.step)
        return pending, loss

    def _forward_from(self, coords: Optional[torch.Tensor], tokens: torch.Tensor):
        """(leaf, output): ``leaf`` is the received coordinates as a grad-tracking leaf (None on the head)."""
        if self.is_head:
            return None, self.stage(tokens)
        leaf = coords.detach().float().requires_grad_(torch.is_grad_enabled())
        boundary = Boundary(leaf, tokens, self.manifest.residual.mode)
        return leaf, self.stage(decompress(boundary, self.stage.basis, self.stage.frozen_embed))

    def _backward(self, pending: _Pending, grad_out: torch.Tensor) -> Optional[torch.Tensor]:
        t0 = time.perf_counter()
        if pending.step != self.step:
            # Parameters moved since this microbatch's forward: recompute on the current ones.
            self.counters.recomputed += 1
            with torch.enable_grad():
                pending.leaf, pending.out = self._forward_from(pending.inputs, pending.tokens)
        next_basis = self.stage.basis if self.manifest.residual.mode == "subspace" else None
        sent = pending.out @ next_basis if next_basis is not None else pending.out
        sent.backward(grad_out.to(sent.dtype))
        self._account(t0, pending.tokens.numel(), "backward")
        self.samples += pending.tokens.shape[0]
        self.last_sample_time = time.monotonic()
        if pending.leaf is None:
            return None
        return pending.leaf.grad.to(self._wire_dtype)

    def _finish_tail(self, pending: _Pending) -> Optional[torch.Tensor]:
        self.samples += pending.tokens.shape[0]
        self.last_sample_time = time.monotonic()
        return None if pending.leaf is None else pending.leaf.grad.to(self._wire_dtype)

    def _account(self, t0: float, n_tokens: int, kind: str) -> None:
        dt = time.perf_counter() - t0
        self.counters.busy_s += dt
        for observe in self.compute_observers:
            observe(kind, dt, n_tokens)
        if dt > 0:
            rate = n_tokens / dt
            self.throughput = rate if self.throughput == 0 else 0.8 * self.throughput + 0.2 * rate

    # ------------------------------------------------------------------ RPC handlers
    async def _handle_fwd_bwd(self, meta: dict, tensors: list[torch.Tensor], caller: PeerID):
        self._validate(meta, tensors)
        train = bool(meta.get("train", True))
        self.inflight += 1
        self._queue += 1
        try:
            pending, loss = await self.run_compute(self._forward, tensors, train)
            self._queue -= 1
            n_tokens = pending.tokens.numel()
            self.counters.forward += 1
            self.counters.tokens += n_tokens if train else 0
            if not train:
                self.counters.eval += 1
            if self.is_tail:
                if loss is not None and train:
                    self.loss_ema = loss if math.isnan(self.loss_ema) else 0.9 * self.loss_ema + 0.1 * loss
                grad_in = await self.run_compute(self._finish_tail, pending) if train else None
                if train:
                    self.counters.backward += 1
                return {"loss": loss, "path": [self.peer_id]}, ([grad_in] if grad_in is not None else [])
            boundary = compress(pending.out.detach(), pending.tokens, self.stage.basis, self.manifest.residual.wire_dtype)
            down_meta, down_tensors = await self._call_next(meta, boundary, tensors[-1])
            if not train:
                return {"loss": down_meta.get("loss"), "path": [self.peer_id, *down_meta.get("path", [])]}, []
            if len(down_tensors) != 1 or tuple(down_tensors[0].shape) != tuple(boundary.coords.shape):
                raise RpcError("bad_reply", f"stage {self.stage_index + 1} returned a malformed gradient")
            if not torch.isfinite(down_tensors[0]).all():
                raise RpcError("non_finite", f"stage {self.stage_index + 1} returned a non-finite gradient")
            self._queue += 1
            grad_in = await self.run_compute(self._backward, pending, down_tensors[0])
            self._queue -= 1
            self.counters.backward += 1
            reply = {"loss": down_meta.get("loss"), "path": [self.peer_id, *down_meta.get("path", [])]}
            return reply, ([grad_in] if grad_in is not None else [])
        except RpcError:
            self.counters.failed += 1
            raise
        finally:
            self.inflight -= 1
            self._queue = max(0, self._queue)

    async def _call_next(self, meta: dict, boundary: Boundary, last: torch.Tensor):
        """Send the boundary to a peer of the next stage; on failure retry other replicas (bounded)."""
        nxt = self.stage_index + 1
        down_meta = dict(meta, stage=nxt)
        tensors = [boundary.coords, boundary.tokens, last]
        timeout = self.opts.hop_timeout_s * (self.manifest.n_stages - nxt)
        tried: list[str] = []
        last_error: Optional[RpcError] = None
        for attempt in range(self.opts.max_retries + 1):
            peer = await self._wait_for_next_peer(tried)
            if peer is None:
                raise RpcError("no_peers", f"stage {nxt} has no reachable peers (tried {len(tried)})")
            try:
                reply = await transport.call(
                    self._p2p, peer.peer_id, self.manifest.run_id, FWD_BWD, down_meta, tensors, timeout,
                    stats=self.stats_out,
                )
                self.acks[peer.peer_id] = self.acks.get(peer.peer_id, 0) + 1
                return reply
            except RpcError as err:
                last_error = err
                if err.code not in RETRYABLE:
                    raise
                tried.append(peer.peer_id)
                self.bans.ban(peer.peer_id)
                self.counters.retried += 1
                logger.warning(f"stage {nxt} peer {peer.peer_id[-8:]} failed ({err.code}); retry {attempt + 1}")
        raise RpcError("retries_exhausted", f"stage {nxt}: {self.opts.max_retries} retries failed; last: {last_error}")

    async def _wait_for_next_peer(self, tried: list[str]) -> Optional[StageRecord]:
        deadline = time.monotonic() + self.opts.wait_for_peers_s
        warned = False
        while True:
            peer = pick_peer(self.next_records, 1, exclude=tried, bans=self.bans)
            if peer is not None or time.monotonic() > deadline:
                return peer
            if not warned:
                logger.warning(f"stage {self.stage_index + 1} has no usable peers; waiting")
                warned = True
            await asyncio.sleep(0.5)
            self.next_records = await self.run_io(
                read_stage, self.dht, self.manifest.run_id, self.stage_index + 1, self.manifest.hash
            )

    async def _handle_get_state(self, meta: dict, tensors: list[torch.Tensor], caller: PeerID):
        if meta.get("run_id") != self.manifest.run_id or meta.get("manifest_hash") != self.manifest.hash:
            raise RpcError("manifest_mismatch", "state requested for another run or manifest")
        if meta.get("stage") != self.stage_index:
            raise RpcError("wrong_stage", f"this peer serves stage {self.stage_index}")
        step, names, state = await self.run_compute(self.export_state)
        return {"step": step, "names": names, "fingerprint": self.sync.fingerprint}, state

    async def _handle_info(self, meta: dict, tensors: list[torch.Tensor], caller: PeerID):
        return {"record": self.record().to_value(), "events": self.events[-20:]}, []

    # ------------------------------------------------------------------ state (compute thread)
    def export_state(self) -> tuple[int, list[str], list[torch.Tensor]]:
        """Parameters and optimizer moments, as a flat named list (also the checkpoint format)."""
        names, tensors = [], []
        for name, p in self.stage.named_parameters():
            names.append(f"param/{name}")
            tensors.append(p.detach().clone())
            st = self.optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq", "step"):
                if key in st:
                    names.append(f"opt/{key}/{name}")
                    tensors.append(torch.as_tensor(st[key]).detach().clone().reshape(-1) if key == "step" else st[key].detach().clone())
        return self.step, names, tensors

    def import_state(self, step: int, names: list[str], tensors: list[torch.Tensor]) -> None:
        by_name = dict(zip(names, tensors))
        params = dict(self.stage.named_parameters())
        missing = [n for n in params if f"param/{n}" not in by_name]
        if missing:
            raise ValueError(f"state is missing parameters {missing[:3]}")
        with torch.no_grad():
            for name, p in params.items():
                src = by_name[f"param/{name}"]
                if src.shape != p.shape:
                    raise ValueError(f"{name}: state shape {tuple(src.shape)} != {tuple(p.shape)}")
                p.copy_(src)
                if f"opt/exp_avg/{name}" in by_name:
                    self.optimizer.state[p] = {
                        "exp_avg": by_name[f"opt/exp_avg/{name}"].clone(),
                        "exp_avg_sq": by_name[f"opt/exp_avg_sq/{name}"].clone(),
                        "step": by_name[f"opt/step/{name}"].reshape(()).clone().float(),
                    }
                else:
                    self.optimizer.state.pop(p, None)
                p.grad = None
        self.step = int(step)
        self.samples = 0
        set_lr(self.optimizer, self.manifest.optimizer, self.step)

    def save_checkpoint(self) -> Optional[Path]:
        from agora.swarm.checkpoint import save_stage_checkpoint

        step, names, tensors = self.export_state()
        return save_stage_checkpoint(self.opts.checkpoint_dir, self.manifest, self.stage_index, step, names, tensors)

    def apply_step(self, grads: Optional[list[torch.Tensor]]) -> None:
        """One optimizer step with ``grads`` (averaged, mean over samples); gradients accumulated meanwhile survive."""
        params = [p for p in self.stage.parameters()]
        kept = [p.grad for p in params]
        for p, g in zip(params, grads):
            p.grad = g.to(p.dtype)
        torch.nn.utils.clip_grad_norm_(params, self.manifest.optimizer.grad_clip)
        set_lr(self.optimizer, self.manifest.optimizer, self.step)
        self.optimizer.step()
        for p, g in zip(params, kept):
            p.grad = g
        self.step += 1
        if self.opts.checkpoint_dir and self.opts.checkpoint_every and self.step % self.opts.checkpoint_every == 0:
            self.save_checkpoint()

    def take_gradients(self) -> tuple[int, list[torch.Tensor]]:
        """Move the accumulated gradient sums out (as means over their samples) and restart accumulation."""
        n = self.samples
        grads = []
        for p in self.stage.parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            grads.append(g.double() / max(n, 1))
            p.grad = None
        self.samples = 0
        return n, grads

    def log_event(self, kind: str, **info) -> None:
        self.events.append({"t": time.time(), "kind": kind, "peer": self.peer_id, "stage": self.stage_index, **info})
        del self.events[:-200]

