"""A stage's state (parameters, optimizer moments) sent in pages: a real stage is far larger than one message.

The server snapshots the state once (``StateSnapshots``), so every page comes from the same step even while the
replica keeps training, and hands it out in pages of at most ``PAGE_BYTES`` tensor bytes; a tensor larger than a page
travels as row ranges. ``fetch_state`` is the client: it asks page after page and reassembles the tensors.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from agora.net import transport
from agora.net.framing import DEFAULT_MAX_PAYLOAD_BYTES
from agora.net.protocol import GET_STATE

PAGE_BYTES = DEFAULT_MAX_PAYLOAD_BYTES // 4  # well under the message cap, so a page never hits it
SNAPSHOT_TTL_S = 300.0  # a snapshot nobody asks pages of for this long is dropped
MAX_SNAPSHOTS = 2  # each holds a full copy of the stage's state


def split_pieces(names: list[str], tensors: list[torch.Tensor], page_bytes: int) -> list[tuple[str, Optional[tuple[int, int]], torch.Tensor]]:
    """(name, row range or None, tensor piece) in order; tensors over ``page_bytes`` are cut along dim 0."""
    pieces = []
    for name, t in zip(names, tensors):
        nbytes = t.numel() * t.element_size()
        if nbytes <= page_bytes or t.dim() == 0 or t.shape[0] < 2:
            pieces.append((name, None, t))
            continue
        row_bytes = max(1, nbytes // t.shape[0])
        rows = max(1, page_bytes // row_bytes)
        for start in range(0, t.shape[0], rows):
            stop = min(t.shape[0], start + rows)
            pieces.append((name, (start, stop), t[start:stop]))
    return pieces


@dataclass
class Snapshot:
    step: int
    fingerprint: object
    pieces: list
    expires: float = field(default=0.0)
    kind: object = None  # what it holds (e.g. "params_only"): downloads of another kind do not share it

    def page(self, offset: int, page_bytes: int) -> tuple[list[str], list, list[torch.Tensor], Optional[int]]:
        """Pieces from ``offset`` up to ``page_bytes`` (at least one): names, row ranges, tensors, next offset."""
        names, rows, out, size, i = [], [], [], 0, offset
        while i < len(self.pieces):
            name, rng, t = self.pieces[i]
            nbytes = t.numel() * t.element_size()
            if out and size + nbytes > page_bytes:
                break
            names.append(name)
            rows.append(list(rng) if rng else None)
            out.append(t.contiguous())
            size += nbytes
            i += 1
        return names, rows, out, (i if i < len(self.pieces) else None)


class StateSnapshots:
    """The snapshots a server is handing out, by token. Bounded: at most ``MAX_SNAPSHOTS`` distinct snapshots, each
    dropped once every download of it fetched its last page or ``SNAPSHOT_TTL_S`` passed without a request.
    Downloads of the same step and kind share one snapshot (``join``): a stage's state is copied once, however many
    replicas fetch it at a time."""

    def __init__(self, max_snapshots: int = MAX_SNAPSHOTS, ttl_s: float = SNAPSHOT_TTL_S):
        self.max_snapshots, self.ttl_s = max_snapshots, ttl_s
        self._by_token: dict[str, Snapshot] = {}
        self._owners: dict[str, str] = {}  # token -> the peer it was issued to

    def _expire(self) -> None:
        now = time.monotonic()
        for token in [t for t, s in self._by_token.items() if s.expires < now]:
            del self._by_token[token]
            self._owners.pop(token, None)

    def has_room(self) -> bool:
        self._expire()
        return len({id(s) for s in self._by_token.values()}) < self.max_snapshots

    def join(self, step: int, fingerprint: object, kind: object = None, owner: str = "") -> Optional[str]:
        """A new token, issued to ``owner``, on a live snapshot of ``step`` with this ``fingerprint`` and
        ``kind``, or None."""
        self._expire()
        for snap in self._by_token.values():
            if snap.step == step and snap.fingerprint == fingerprint and snap.kind == kind:
                token = secrets.token_hex(8)
                self._by_token[token] = snap
                self._owners[token] = owner
                snap.expires = time.monotonic() + self.ttl_s
                return token
        return None

    def add(self, step: int, fingerprint: object, names: list[str], tensors: list[torch.Tensor],
            page_bytes: int = PAGE_BYTES, kind: object = None, owner: str = "") -> str:
        """A snapshot of these tensors and a token for it, issued to ``owner`` (only it may fetch the pages)."""
        if not self.has_room():
            raise transport.RpcError("busy", f"{self.max_snapshots} state downloads are in progress; try again shortly")
        token = secrets.token_hex(8)
        self._by_token[token] = Snapshot(step, fingerprint, split_pieces(names, tensors, page_bytes),
                                         time.monotonic() + self.ttl_s, kind)
        self._owners[token] = owner
        return token

    def serve(self, token: object, offset: object, page_bytes: int = PAGE_BYTES,
              owner: str = "") -> tuple[dict, list[torch.Tensor]]:
        """The reply for one page request of ``owner``; errors are RpcErrors the caller can act on."""
        snap = self._by_token.get(token) if isinstance(token, str) else None
        if snap is None:
            raise transport.RpcError("unknown_snapshot", "no such state snapshot here (expired, or never made); "
                                                         "start the download again")
        if self._owners.get(token) != owner:  # a token passed on is not a grant: the download was admitted for one
            raise transport.RpcError("unauthorized", "this state snapshot was issued to another peer")
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < len(snap.pieces):
            raise transport.RpcError("bad_request", f"offset must be an integer in [0, {len(snap.pieces)})")
        names, rows, tensors, nxt = snap.page(offset, page_bytes)
        if nxt is None:
            del self._by_token[token]
            self._owners.pop(token, None)
        else:
            snap.expires = time.monotonic() + self.ttl_s
        return {"step": snap.step, "fingerprint": snap.fingerprint, "snapshot": token, "names": names, "rows": rows,
                "next": nxt, "pieces": len(snap.pieces)}, tensors


class StateAssembler:
    """The client's half: collects pages (in any order) and rebuilds the named tensors, in the server's order."""

    def __init__(self) -> None:
        self._parts: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def add(self, reply: dict, tensors: list[torch.Tensor]) -> None:
        names, rows = reply.get("names"), reply.get("rows")
        if not isinstance(names, list) or not isinstance(rows, list) or not (len(names) == len(rows) == len(tensors)):
            raise transport.RpcError("bad_reply", "a state page whose names, row ranges and tensors do not line up")
        for name, rng, t in zip(names, rows, tensors):
            self._parts.setdefault(name, []).append((rng[0] if rng else 0, t))

    def result(self) -> tuple[list[str], list[torch.Tensor]]:
        names, out = [], []
        for name, chunks in self._parts.items():
            chunks.sort(key=lambda c: c[0])
            names.append(name)
            out.append(chunks[0][1] if len(chunks) == 1 else torch.cat([c[1] for c in chunks]))
        return names, out


async def fetch_state(p2p, peer_id, run_id: str, meta: dict, timeout: float,
                      params_only: bool = False) -> tuple[dict, list[str], list[torch.Tensor]]:
    """A peer's whole state, page by page (``timeout`` per page): (first reply, names, tensors). Raises RpcError."""
    request = dict(meta, params_only=params_only, offset=0)
    first, tensors = await transport.call(p2p, peer_id, run_id, GET_STATE, request, [], timeout)
    pages, reply = StateAssembler(), first
    while True:
        pages.add(reply, tensors)
        nxt = reply.get("next")
        if nxt is None:
            break
        request = dict(meta, snapshot=first.get("snapshot"), offset=nxt, params_only=params_only)
        reply, tensors = await transport.call(p2p, peer_id, run_id, GET_STATE, request, [], timeout)
    names, out = pages.result()
    return first, names, out
