"""hivemind pieces behind the averaging schemes of ``agora.server.averaging.sync``: a byte counter, a two-phase averager.

``CountingCompression`` is hivemind's wire compression of a round's parts (none for most schemes; float16 or uint8
for DiLoCo and gossip with ``averaging.codec``) that also counts the payload bytes this peer serializes, i.e. what it
puts on the wire per round; the counter is in shared memory because the all-reduce runs in the
averager's background process and the ``ReplicaSync`` reads it in the node's.

``PowerSGDAverager`` runs both all-reduces of a PowerSGD round (P, then Q) in *one* matchmade group, because the
update is only the same on every replica if all of them averaged P and Q over the same members. The node's process
keeps the error buffers; the averager's process orthogonalizes the averaged P and computes Q between the phases.
The averaged P and Q are rounded to float32, so every replica computes from identical inputs.

Details (what is and is not counted, the division of work, bit-identity): docs/COMPRESSION.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import multiprocessing as mp
from typing import Any, Optional, Sequence

import numpy as np
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.compression import (CompressionBase, CompressionInfo, Float16Compression, NoCompression,
                                  Uniform8BitQuantization, deserialize_torch_tensor)
from hivemind.compression import serialization as hivemind_serialization
from hivemind.compression.quantization import average_buckets
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import enter_asynchronously

from agora.compression.powersgd import orthogonalize
from agora.net.lifeline import ParentWatch

HIVEMIND_ALLREDUCE_LOGGER = "hivemind.averaging.allreduce"
PHASE_P = b".P"
PHASE_Q = b".Q"


CODECS = ("none", "float16", "uint8")  # ``averaging.codec``: how DiLoCo and gossip payloads travel
# uint8 sends a smaller part uncompressed: its 1 KiB codebook would outweigh the values, and float16 would round a
# payload the sender already rounded to 256 levels (``roundtrip``) once more, out of reach of its error feedback.
MIN_QUANTIZED_VALUES = 2048


class Uniform8BitCodec(Uniform8BitQuantization):
    """hivemind's ``UNIFORM_8BIT`` wire format (256 bins over 6 standard deviations around the mean; each bin
    decodes to the mean of the values it holds), mended for what this install runs it with.

    Why not hivemind's own: under numpy 2 its ``extract`` fails on every message (``int()`` of a one-element
    array), its ``quantize`` uses ``torch.quantize_per_tensor`` (deprecated), and a part with zero spread gets a
    zero scale. ``register_uint8_codec`` puts this class in hivemind's table of wire formats, which both ends of
    every part (the sender and the reducer answering in the part's own format) look up.

    A part holding at most 256 distinct values is sent exactly (its values are the codebook): a payload the sender
    already quantized with error feedback (``CountingCompression.roundtrip``) loses nothing more on the wire."""

    def quantize(self, tensor: torch.Tensor, allow_inplace: bool = False) -> tuple[np.ndarray, np.ndarray]:
        values = tensor.detach().to(torch.float32).flatten()
        if values.numel() and torch.unique(values[:4 * self.n_bins]).numel() <= self.n_bins:
            distinct, where = torch.unique(values, return_inverse=True)
            if distinct.numel() <= self.n_bins:  # already on at most 256 levels (a quantized payload): exact
                return where.to(torch.uint8).numpy(), distinct.numpy().astype(self.codebook_dtype)
        centered = values - values.mean()
        spread = float(centered.norm()) / math.sqrt(max(1, values.numel() - 1))
        scale = self.RANGE_IN_SIGMAS * spread / self.n_bins if spread > 0 else 1.0
        offset = self.n_bins // 2
        bins = torch.clamp(torch.round(centered / scale) + offset, 0, self.n_bins - 1).to(torch.uint8)
        lookup = average_buckets(values, bins, self.n_bins)
        return bins.numpy().astype(self.indices_dtype), lookup.numpy().astype(self.codebook_dtype)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buffer = serialized_tensor.buffer
        size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(buffer, offset=8, count=size, dtype=self.codebook_dtype)
        bins = np.frombuffer(buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        out = torch.as_tensor(codebook.copy())[torch.as_tensor(bins.astype(np.int64))]
        return out.reshape(tuple(serialized_tensor.size)).to(getattr(torch, serialized_tensor.dtype))


def register_uint8_codec() -> None:
    """Make hivemind encode and decode ``UNIFORM_8BIT`` parts with ``Uniform8BitCodec`` (idempotent; in this
    process and, by fork, in the averagers it starts later)."""
    table = hivemind_serialization._BASE_COMPRESSION_TYPES  # no public hook: the table is module-level
    if not isinstance(table.get("UNIFORM_8BIT"), Uniform8BitCodec):
        table["UNIFORM_8BIT"] = Uniform8BitCodec()


class CountingCompression(CompressionBase):
    """hivemind's wire compression for a round's payload (``codec``: ``none``, ``float16``: ``Float16Compression``,
    ``uint8``: ``Uniform8BitCodec``), adding the size of every serialized part to a counter shared across
    processes.

    Every serialized part names its own compression type and the reducer answers in the same one, so ``uint8``
    sends parts of fewer than ``MIN_QUANTIZED_VALUES`` values uncompressed, and ``set_exact(True)`` sends the next
    rounds' parts uncompressed (gossip's exact exchanges, through the same averager as its compressed ones). Both
    the counter and the switch are in shared memory: the averager's process reads them."""

    def __init__(self, codec: str = "none") -> None:
        super().__init__()
        if codec not in CODECS:
            raise ValueError(f"unknown averaging codec {codec!r}; choose from {list(CODECS)}")
        self.codec = codec
        if codec == "uint8":
            register_uint8_codec()
        self._base: CompressionBase = {"none": NoCompression(), "float16": Float16Compression(),
                                       "uint8": Uniform8BitCodec()}[codec]
        self._small = NoCompression() if codec == "uint8" else self._base
        self.compression_type = self._base.compression_type
        self._sent = mp.Value("q", 0)
        self._exact = mp.Value("b", 0)

    def set_exact(self, exact: bool) -> None:
        """Send the following rounds' parts uncompressed (``True``) or in the codec's format (``False``)."""
        self._exact.value = 1 if exact else 0

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        base = self._base
        if self._exact.value:
            base = NoCompression()
        elif self._small is not base and tensor.numel() < MIN_QUANTIZED_VALUES:
            base = self._small
        message = base.compress(tensor, info, allow_inplace)
        with self._sent.get_lock():
            self._sent.value += len(message.buffer)
        return message

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return deserialize_torch_tensor(serialized_tensor)  # by the part's own compression type

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self._base.estimate_compression_ratio(info)

    def roundtrip(self, tensor: torch.Tensor) -> torch.Tensor:
        """What a receiver decodes of ``tensor`` sent whole (not counted as sent): the codec's rounding, so a
        sender can keep what it loses as error feedback."""
        info = CompressionInfo.from_tensor(tensor)
        base = self._small if tensor.numel() < MIN_QUANTIZED_VALUES else self._base
        return deserialize_torch_tensor(base.compress(tensor, info)).to(tensor.dtype)

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this peer serialized for other peers so far, all rounds together."""
        return int(self._sent.value)


def canonical_(tensor: torch.Tensor) -> torch.Tensor:
    """Round to float32 in place (the buffer keeps its dtype): equal up to last-bit noise -> equal (see module doc)."""
    return tensor.copy_(tensor.float())


class PartFailureFilter(logging.Filter):
    """Passes hivemind's account of a failed all-reduce part ("Caught TimeoutError() when communicating to <peer>")
    at WARNING, without its traceback.

    Why: hivemind logs it at DEBUG, and the round then only shows up as "received 98.0% results" and a failed round
    here (``GuardedAverager``); without the reason nobody can tell a stalled reducer from a broken stream or a peer
    that left. ``drop_debug``: the logger was lowered to DEBUG only for these lines, so every other DEBUG line of
    the module is dropped (the user did not ask for them)."""

    def __init__(self, drop_debug: bool):
        super().__init__()
        self.drop_debug = drop_debug

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG:
            return True
        message = record.getMessage()
        if not message.startswith("Caught "):
            return not self.drop_debug
        record.msg, record.args = f"all-reduce part failed: {message}", None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info = record.exc_text = None
        return True


def report_part_failures() -> None:
    """Make this process log why all-reduce parts fail (``PartFailureFilter``); calling it again changes nothing."""
    log = logging.getLogger(HIVEMIND_ALLREDUCE_LOGGER)
    if any(isinstance(f, PartFailureFilter) for f in log.filters):
        return
    drop_debug = log.getEffectiveLevel() > logging.DEBUG
    log.addFilter(PartFailureFilter(drop_debug))
    if drop_debug:
        log.setLevel(logging.DEBUG)


# Every partial all-reduce of the averagers this process started (shared with their processes, which it forks): the
# node's own accounting is per averager (``GuardedAverager.partial_rounds``); this is for whoever watches a whole
# process, such as the test suite's rerun of a test during which hivemind cut an all-reduce short (tests/conftest.py).
PARTIAL_ALLREDUCES = mp.Value("q", 0)


def partial_allreduces() -> int:
    """All-reduces that averagers started by this process finished with part of the average missing, so far."""
    return int(PARTIAL_ALLREDUCES.value)


class GuardedAverager(DecentralizedAverager):
    """hivemind's averager process, ended when the node process that started it dies (``net.lifeline``), counting
    the all-reduces it finished with part of the average missing (``partial_rounds``, ``incomplete_allreduce``).

    Why count them: when a reducer of some parts does not answer in time, hivemind finishes the all-reduce with our
    own values in those parts ("received 81.8% results") and reports success. This replica then holds a partly local
    gradient while the others hold the average; ``ReplicaSync`` treats such a round as failed, and the replicas'
    repair adopts the state of one that averaged (``full.repair_source``). Why a part failed is logged at WARNING
    (``report_part_failures``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._lifeline = ParentWatch()
        self._partial = mp.Value("q", 0)  # shared: the all-reduce runs in the averager's process
        self._partial_in_process = PARTIAL_ALLREDUCES  # an attribute, so a spawned (not forked) process shares it too
        self._target_sent: Optional[int] = kwargs.get("target_group_size")
        super().__init__(*args, **kwargs)

    def set_target_group_size(self, size: Optional[int]) -> None:
        """The group size at which this averager, when it leads, starts the all-reduce at once instead of at the
        end of ``min_matchmaking_time`` (None: always at the end). Takes effect for the next ``step``: messages
        to the averager's process are handled in order.

        Why: without it every round waited out the whole matchmaking time although every replica had joined.
        A complete group now starts long before anyone's expiry, so a follower no longer gives up on a leader that
        is late at its expiry; a follower that times out on the leader's first answer (``request_timeout``) can
        still be counted in a group that starts without it (docs/AVERAGING.md). A size below the peers that join
        leaves the surplus out of the group, so callers pass an upper bound (``ReplicaSync.expected_group_size``)."""
        if size is not None and size < 2:
            raise ValueError(f"a target group size below 2 means no group ever forms: {size}")
        if size == self._target_sent:
            return
        self._target_sent = size
        self._outer_pipe.send(("_set_target_group_size", [], dict(size=size)))

    async def _set_target_group_size(self, size: Optional[int]) -> None:
        self._matchmaking.target_group_size = size  # in the averager's process, read at every join request

    def run(self) -> None:
        self._lifeline.start()
        report_part_failures()
        super().run()

    @property
    def partial_rounds(self) -> int:
        """All-reduces this averager finished with parts of the average replaced by its own values, so far."""
        return int(self._partial.value)

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      group_id: Any = None, **kwargs: Any) -> None:
        await super()._run_allreduce_inplace_(tensors, group_info, group_id=group_id, **kwargs)
        running = self._running_groups.get(group_info.group_id if group_id is None else group_id)
        runner = running.result() if running is not None and running.done() and not running.cancelled() else None
        if runner is not None and incomplete_allreduce(runner):
            with self._partial.get_lock():
                self._partial.value += 1
            with self._partial_in_process.get_lock():
                self._partial_in_process.value += 1


def incomplete_allreduce(runner: Any) -> bool:
    """Whether a finished hivemind ``AllReduceRunner`` left anything out of its average: parts whose reducer did not
    answer (our own values stand in for them) or, in the parts we reduced, inputs of a sender that did not send in
    time (those parts are the others' average, and that sender keeps its own values for them)."""
    container = getattr(runner, "tensor_part_container", None)
    if container is not None and container.failed_size:
        return True
    reducer = getattr(runner, "tensor_part_reducer", None)
    if reducer is None or not reducer.num_parts or not reducer.num_senders:
        return False
    return sum(reducer.num_parts_received) != reducer.num_parts * reducer.num_senders


class PowerSGDAverager(GuardedAverager):
    """A ``DecentralizedAverager`` whose one round is a full PowerSGD round over one group.

    :param phase1: float64 buffers all-reduced first: one ``P`` (n x r) per compressed tensor, then the
      passthrough tensors (averaged in full)
    :param qs: float64 buffers of the second phase, one ``Q`` (m x r) per compressed tensor
    :param matrices: float64 ``M`` (n x m) per compressed tensor, written by the caller before each round and only
      read here (shared memory, not averaged)
    Every other keyword goes to ``DecentralizedAverager``; ``start=True`` must come last (the buffers have to be in
    shared memory before the background process starts).
    """

    def __init__(self, phase1: Sequence[torch.Tensor], qs: Sequence[torch.Tensor], matrices: Sequence[torch.Tensor],
                 dht: Any, **kwargs: Any):
        if len(qs) != len(matrices):
            raise ValueError(f"{len(qs)} Q buffers for {len(matrices)} matrices")
        self.n_phase1 = len(phase1)
        self.n_compressed = len(qs)
        self.matrices = tuple(m.share_memory_() for m in matrices)
        super().__init__([*phase1, *qs], dht, **kwargs)

    @contextlib.contextmanager
    def _register_allreduce_group(self, group_info: GroupInfo):
        """Register both phases' group ids for the whole round, so a fast peer's phase-2 parts are never refused."""
        ids = [group_info.group_id + PHASE_P, group_info.group_id + PHASE_Q]
        try:
            for group_id in ids:
                self._running_groups[group_id] = asyncio.Future()
            self._pending_groups_registered.set()
            yield
        finally:
            for group_id in ids:
                self._running_groups.pop(group_id, None)
            self._pending_groups_registered.set()

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Any:
        """Phase 1 (P + passthrough), orthogonalize, ``Q = M^T P^``, phase 2 (Q); in place, in one group.

        On failure the phase-1 buffers are restored before re-raising: hivemind may retry the round with another
        group, and that retry must start from this replica's own P, not from a half-averaged or orthogonalized one.
        """
        kwargs.pop("tensor_infos", None)  # hivemind's infos cover both phases' tensors; each phase derives its own
        try:
            bandwidths, mode_ids, user_gathered_bytes = zip(*map(self.serializer.loads, group_info.gathered))
            modes = tuple(map(AveragingMode, mode_ids))
            download = [bw if mode != AveragingMode.CLIENT else 0.0 for bw, mode in zip(bandwidths, modes)]
            fractions = await asyncio.get_event_loop().run_in_executor(
                None, load_balance_peers, self.total_size, download, min_vector_size
            )
            gathered = dict(zip(group_info.peer_ids, map(self.serializer.loads, user_gathered_bytes)))
        except BaseException as err:
            raise MatchmakingException(f"could not read the group's metadata: {err!r}") from err

        async with enter_asynchronously(self.get_tensors()) as tensors:
            phase1, qs = list(tensors[: self.n_phase1]), list(tensors[self.n_phase1:])
            saved = [t.clone() for t in phase1]
            try:
                await self._run_allreduce_inplace_(phase1, group_info, group_info.group_id + PHASE_P,
                                                   peer_fractions=fractions, **kwargs)
                for p, q, m in zip(phase1[: self.n_compressed], qs, self.matrices):
                    p.copy_(orthogonalize(canonical_(p)))
                    torch.matmul(m.T, p, out=q)
                await self._run_allreduce_inplace_(qs, group_info, group_info.group_id + PHASE_Q,
                                                   peer_fractions=fractions, **kwargs)
                for q in qs:
                    canonical_(q)
                return gathered
            except BaseException as err:
                for t, s in zip(phase1, saved):
                    t.copy_(s)
                if isinstance(err, asyncio.CancelledError):
                    raise
                raise MatchmakingException(f"PowerSGD all-reduce failed: {err!r}") from err
