"""Where a microbatch goes next: the boundary to a peer of the next stage, and its gradient back.

``Downstream.send`` is the one place a stage's output leaves it. The peer is picked and retried by the shared
router (``agora.client.router``); with SENTINEL a returned gradient is screened before it is accepted, and a
flagged one is retried on another replica (an exact reproduction there withdraws the flag).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

import torch

from agora.client.router import Reply, Router, RouterOptions
from agora.config import Manifest
from agora.net.records import StageRecord
from agora.net.transport import TransferStats
from agora.server.runtime import Counters
from agora.server.screening import Message, Screening
from agora.server.stage_records import StageRecords
from agora.wire import Boundary

logger = logging.getLogger("agora.node")


@dataclass
class DownstreamHooks:
    """What the next hop needs from its node (explicit, so it never holds the node).

    :param run_io: ``await run_io(fn, *args)`` on the node's I/O threads
    :param is_leaving: whether the node is leaving (a hop then stops waiting for an empty next stage)
    :param screening: the node's SENTINEL, or None
    :param counters: the node's counters (retries are counted there)
    :param stats: byte counters of the calls to the next stage
    :param acks: results each downstream peer delivered (the node publishes them)
    :param records: the node's shared reads of stage records (``StageRecords``)
    """

    run_io: Callable[..., Awaitable[Any]]
    records: StageRecords
    is_leaving: Callable[[], bool]
    screening: Optional[Screening]
    counters: Counters
    stats: TransferStats
    acks: dict[str, int] = field(default_factory=dict)


class Downstream:
    """The next stage as seen from one stage: its records (refreshed off the hot path) and a router to it.

    :param stage_index: the stage sending (its next stage is called)
    """

    def __init__(self, manifest: Manifest, stage_index: int, dht, p2p, options: RouterOptions,
                 hooks: DownstreamHooks):
        self.manifest, self.stage_index, self.dht = manifest, stage_index, dht
        self.next_stage = stage_index + 1
        self.hooks = hooks
        self.records: list[StageRecord] = []
        self.router = Router(p2p, manifest.run_id, self.next_stage, self, options, stats=hooks.stats, acks=hooks.acks)

    # ------------------------------------------------------------------ the router's view (PeerSource)
    def candidates(self) -> list[StageRecord]:
        banned = self.hooks.screening.banned_peers() if self.hooks.screening is not None else set()
        return [r for r in self.records if r.peer_id not in banned] if banned else self.records

    async def refresh(self) -> None:
        if self.next_stage >= self.manifest.n_stages:
            return
        try:
            self.records = await self.hooks.records.get(self.next_stage)
        except Exception as err:
            logger.warning(f"reading stage {self.next_stage} records failed: {err!r}")

    # ------------------------------------------------------------------ one hop
    async def send(self, meta: dict, boundary: Boundary, last: torch.Tensor, version: Optional[list] = None,
                   frame: Optional[int] = None) -> Reply:
        """Send the boundary to a peer of the next stage and return its reply (loss, path, the gradient of the
        boundary); retries other replicas on failures (bounded). ``version``: this stage's ``sent_version`` for the
        microbatch (the receiver's SENTINEL uses it). ``frame``: the UPM frame epoch the boundary is written in (the
        receiver converts it, and its gradient back; None without UPM)."""
        down_meta = dict(meta, stage=self.next_stage, version=version)
        down_meta.pop("frame", None)  # the frame our caller wrote our input in is not the frame of our output
        if frame is not None:
            down_meta["frame"] = frame
        down_meta.pop("hedge_of", None)  # a hedge between our stage's replicas; the next stage's call is our own
        tensors = [boundary.coords, boundary.tokens, last]
        screening = self.hooks.screening
        train = meta.get("train", True)

        async def accept(peer: StageRecord, reply: Reply) -> bool:
            grads = reply[1]
            if screening is None or not train or len(grads) != 1 or grads[0].shape != boundary.coords.shape:
                return True
            msg = Message(peer.peer_id, self.stage_index, "bwd", grads[0], boundary.tokens, paired=boundary.coords,
                          version=reply[0].get("version"))
            flagged = await screening.screen(msg)
            if flagged:
                logger.warning(f"gradient from stage {self.next_stage} peer {peer.peer_id[-8:]} flagged; trying "
                               f"another replica")
                if "bwd" in screening.audited():
                    screening.start_audit(msg, down_meta, tensors, flagged=True)
            else:
                screening.maybe_audit(msg, down_meta, tensors, flagged=False)
            return not flagged

        def count_failure() -> None:
            self.hooks.counters.retried += 1  # every failed or refused attempt (the node's record counts them so)

        _, reply = await self.router.call(down_meta, tensors, stopped=self.hooks.is_leaving, accept=accept,
                                          on_failure=count_failure)
        return reply
