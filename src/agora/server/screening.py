"""SENTINEL on a node: screen what this stage receives, and have other replicas audit the senders.

``agora.sentinel`` judges messages (statistics, no networking); this module feeds it from the RPC path, logs its
verdicts, and runs audits: where the sender's stage can recompute a message from what we hold (a head from the
tokens, a tail from the boundary), other replicas of that stage recompute it in the background and only a
recomputation that disagrees convicts. See ``docs/SENTINEL.md``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

import torch

from agora.config import Manifest
from agora.devices import PRECISIONS
from agora.net import transport
from agora.net.protocol import FWD_BWD
from agora.net.records import PeerState, StageRecord, read_stage
from agora.net.transport import RpcError, TransferStats
from agora.sentinel import SentinelConfig, SentinelMonitor, node_config, version_key

logger = logging.getLogger("agora.node")

MAX_AUDITS = 3  # audits in flight at once (each costs one or two recomputations by other replicas)
AUDITORS_ASKED = 2  # replicas asked per audit: the first that confirms ends it, a second is asked if it differs


def rank_auditors(records: list[StageRecord], sender: str, banned: set[str], claimed: Optional[tuple],
                  rng: Optional[random.Random] = None) -> list[StageRecord]:
    """The replicas that may recompute ``sender``'s message, best first: serving, not banned, not the sender; in
    random order, those whose record shows the sender's claimed step first (records lag by seconds, so the
    others stay candidates). ``claimed``: the message's ``version_key``. The offline evaluation
    (``agora.bench.sentinel_audits``) ranks its simulated replicas with this too."""
    others = [r for r in records if r.peer_id != sender and r.peer_id not in banned
              and r.state == PeerState.SERVING.value]
    (rng or random).shuffle(others)
    others.sort(key=lambda r: claimed is None or r.step != claimed[0])
    return others


@dataclass
class Message:
    """One received message to judge.

    :param sender: the peer that sent it
    :param boundary: the stage boundary it crossed (``s`` for the boundary between stages ``s`` and ``s + 1``)
    :param direction: "fwd" (activations) or "bwd" (a gradient)
    :param paired: for a gradient, the boundary it is the gradient of
    :param version: the sender's claimed ``[step, fingerprint]`` (unverified; only picks whom to compare it with)
    """

    sender: str
    boundary: int
    direction: str
    tensor: torch.Tensor
    tokens: torch.Tensor
    paired: Optional[torch.Tensor] = None
    version: Any = None


class Screening:
    """The node's SENTINEL: a monitor that outlives stage moves (bans stay), audits for the current stage.

    :param stats: byte counters of the audit calls (the node's downstream counters)
    :param audit_rate: the share of accepted messages audited where the direction can be recomputed
    :param hop_timeout_s: the timeout of one audit call
    :param log_path: a JSONL file receiving one line per verdict, or None
    """

    def __init__(self, manifest: Manifest, dht, stats: TransferStats, audit_rate: float, hop_timeout_s: float,
                 log_path: Optional[str], hooks: "ScreeningHooks"):
        self.manifest, self.dht, self.stats = manifest, dht, stats
        self.audit_rate, self.hop_timeout_s, self.log_path = audit_rate, hop_timeout_s, log_path
        self.hooks = hooks
        self.p2p = None
        self.stage_index = 0
        self.next_records: Callable[[], list[StageRecord]] = lambda: []
        self.monitor = SentinelMonitor(self._config())
        self._audits: set[asyncio.Task] = set()
        self._head_records: list[StageRecord] = []  # stage 0's records, for audits of activations (stage 1 only)
        self._head_records_at = 0.0

    def serve_stage(self, stage_index: int, next_records: Callable[[], list[StageRecord]]) -> None:
        """Screen for ``stage_index`` now: which directions can be audited depends on the stage."""
        self.stage_index, self.next_records = stage_index, next_records
        self.monitor.cfg = self._config()

    def _config(self) -> SentinelConfig:
        return node_config(SentinelConfig(seed=self.manifest.seed), self.audited())

    def audited(self) -> tuple[str, ...]:
        """Directions whose messages this node can have recomputed: gradients from the last stage (a tail needs
        only the boundary), activations from the first (a head needs only the tokens). A middle stage's messages
        would need its whole upstream or downstream chain: those stay judged by statistics."""
        if self.audit_rate <= 0:
            return ()
        n = self.manifest.n_stages
        return (*(("fwd",) if self.stage_index == 1 else ()), *(("bwd",) if self.stage_index + 1 == n - 1 else ()))

    def banned_peers(self) -> set[str]:
        return self.monitor.banned_peers()

    def tasks(self) -> list[asyncio.Task]:
        return [t for t in self._audits if not t.done()]

    # ------------------------------------------------------------------ screening
    async def screen(self, msg: Message) -> bool:
        """Score one received message with SENTINEL (off the event loop); True if it must be dropped."""
        step = self.hooks.step()
        verdict = await self.hooks.run_io(functools.partial(
            self.monitor.observe, msg.sender, msg.boundary, msg.direction, msg.tensor, step=step, tokens=msg.tokens,
            paired=msg.paired, version=msg.version))
        if self.log_path:
            await self.hooks.run_io(self._log_verdict, msg, msg.direction, step, verdict)
        if verdict.flagged and not verdict.banned:  # why a message was dropped: the operator's first question
            logger.info(f"SENTINEL flagged {msg.direction} from {msg.sender[-8:]} at step {step} (its version "
                        f"{msg.version}): {verdict.reasons[:3]}")
        if verdict.banned:
            self.hooks.log_event("ban", peer_banned=msg.sender, boundary=msg.boundary, direction=msg.direction,
                                 reasons=verdict.reasons[:3])
            logger.warning(f"SENTINEL banned {msg.sender[-8:]} ({msg.direction} at boundary {msg.boundary}): "
                           f"{verdict.reasons[:3]}")
        return verdict.flagged or verdict.banned

    def _log_verdict(self, msg: Message, label: str, step: int, verdict) -> None:
        line = {"t": round(time.time(), 3), "sender": msg.sender, "boundary": msg.boundary, "direction": label,
                "step": step, "version": msg.version, "flagged": verdict.flagged, "banned": verdict.banned,
                "score": round(verdict.score, 2) if math.isfinite(verdict.score) else None,
                "reasons": verdict.reasons[:4]}
        with open(self.log_path, "a") as f:
            f.write(json.dumps(line, default=repr) + "\n")  # ``version`` is whatever the peer sent

    # ------------------------------------------------------------------ audits
    def maybe_audit(self, msg: Message, meta: dict, tensors: list, flagged: bool) -> None:
        """Audit ``msg`` when its direction can be recomputed: always when flagged, else at ``audit_rate``."""
        if msg.direction in self.audited() and (flagged or random.random() < self.audit_rate):
            self.start_audit(msg, meta, tensors, flagged)

    def start_audit(self, msg: Message, meta: dict, tensors: list, flagged: bool = False) -> None:
        """Have other replicas of the sender's stage recompute its message in the background: a random accepted
        one when no audit runs (evidence, not a deadline: skipping one when busy costs nothing), a flagged one
        (statistics only name suspects in audited directions; this convicts or clears) when fewer than
        ``MAX_AUDITS`` run."""
        self._audits = {t for t in self._audits if not t.done()}
        if len(self._audits) >= (MAX_AUDITS if flagged else 1):
            return
        task = asyncio.create_task(self._run_audit(msg, meta, tensors, flagged), name="audit")
        task.add_done_callback(_log_task_error)
        self._audits.add(task)

    async def _auditors(self, msg: Message) -> tuple[list[StageRecord], int, Optional[StageRecord]]:
        """(replicas of the sender's stage that may recompute ``msg``, best first; the boundary it crossed; the
        sender's own record, None when it has none we can read)."""
        if msg.direction == "bwd":
            records, boundary = self.next_records(), self.stage_index
        else:
            fresh = time.monotonic() - self._head_records_at <= 2.0
            if not fresh or not any(r.peer_id == msg.sender for r in self._head_records):  # a head that just joined
                self._head_records = await self.hooks.run_io(read_stage, self.dht, self.manifest.run_id, 0,
                                                             self.manifest.hash)
                self._head_records_at = time.monotonic()
            records, boundary = self._head_records, self.stage_index - 1
        sender = next((r for r in records if r.peer_id == msg.sender), None)
        return rank_auditors(records, msg.sender, self.banned_peers(), version_key(msg.version)), boundary, sender

    async def _run_audit(self, msg: Message, meta: dict, tensors: list, flagged: bool = False) -> None:
        """Ask a replica of the sender's stage at the sender's step for the same message (``audit``: computed, not
        trained on); if it differs, ask a second one, then let SENTINEL judge (``recomputed``)."""
        others, boundary, sender = await self._auditors(msg)
        if sender is None:
            # Its precision is unknown: recomputed at another one, an honest message could be convicted.
            logger.debug(f"no record of {msg.sender[-8:]}: its message is not audited")
            return
        if msg.direction == "fwd":
            meta, tensors = dict(meta, stage=0), tensors[-2:]  # the head needs the tokens only
        # Recomputed at the sender's precision: bf16 and fp32 messages of one weight version differ by 0.6-0.8%
        # (tiny, small), far beyond the audit tolerance, so two fp32 auditors would convict an honest bf16 sender.
        # A sender that announces another precision than it computes in only gets its messages compared with
        # recomputations further from them. (A record without one is an older peer's: the auditor's own.)
        meta = {k: v for k, v in meta.items() if k != "precision"}
        if sender.precision in PRECISIONS:
            meta["precision"] = sender.precision
        results: list = []
        for rec in others[:AUDITORS_ASKED]:
            try:
                reply, out = await transport.call(self.p2p, rec.peer_id, self.manifest.run_id, FWD_BWD,
                                                  dict(meta, audit=True), tensors, self.hop_timeout_s,
                                                  stats=self.stats)
            except RpcError as err:
                logger.debug(f"audit on {rec.peer_id[-8:]} failed: {err}")
                continue
            if len(out) != 1 or tuple(out[0].shape) != tuple(msg.tensor.shape):
                continue
            results.append((rec.peer_id, out[0], reply.get("version")))
            if self.monitor.same_message(msg.tensor, out[0]):
                break  # confirmed: no second opinion needed
        if results:
            await self._judge_audit(msg, boundary, results, flagged)

    async def _judge_audit(self, msg: Message, boundary: int, results: list, flagged: bool) -> None:
        verdict = await self.hooks.run_io(functools.partial(
            self.monitor.recomputed, msg.sender, boundary, msg.direction, msg.tensor, msg.version, results, flagged))
        if self.log_path:
            audited = Message(msg.sender, boundary, msg.direction, msg.tensor, msg.tokens, version=msg.version)
            await self.hooks.run_io(self._log_verdict, audited, f"audit {msg.direction}", self.hooks.step(), verdict)
        if verdict.flagged:
            self.hooks.log_event("audit_failed", peer=msg.sender, direction=msg.direction, reasons=verdict.reasons[:2])
            logger.warning(f"SENTINEL audit: {msg.sender[-8:]}'s {msg.direction} message is not what its weights "
                           f"compute: {verdict.reasons[:1]}{' (banned)' if verdict.banned else ''}")


@dataclass
class ScreeningHooks:
    """The node's callbacks screening needs (explicit, so screening never holds the node).

    :param run_io: ``await run_io(fn, *args)`` on the node's I/O threads (SENTINEL's work stays off the event loop)
    :param log_event: the node's event log
    :param step: the stage's current step (read for the verdict log)
    """

    run_io: Callable[..., Awaitable[Any]]
    log_event: Callable[..., None]
    step: Callable[[], int]


def _log_task_error(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning(f"{task.get_name()} failed: {task.exception()!r}")
