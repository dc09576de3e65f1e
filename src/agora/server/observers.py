"""A node's observer hooks: observers subscribe to what happens instead of polling the node.

Kinds emitted today (arguments in order):

* ``"compute"``: kind ("forward" | "backward"), seconds, tokens -- every forward/backward on the compute thread;
* ``"round"``: ok, seconds, group size -- every averaging step of the replica sync;
* ``"sync"``: the new ``ReplicaSync`` -- the node joined a stage (start, or a stage move);
* ``"outer_round_start"``: step, the parameters the optimizer steps -- on the compute thread when a DiLoCo outer
  round begins (the end of the inner phase; clone what you keep: the round overwrites them);
* ``"outer_round"``: averaged (False: stepped alone), seconds, group size -- after every DiLoCo outer round;
* ``"blocks_joined"``: stage index, step, block names -- architecture warm-up activated these blocks after a step.

Observers run synchronously in the emitting thread and must be cheap (Prometheus histograms are). A node without
observers pays one dict lookup per event.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

logger = logging.getLogger("agora.events")


class Observers:
    def __init__(self) -> None:
        self._observers: dict[str, list[Callable[..., Any]]] = {}

    def subscribe(self, kind: str, fn: Callable[..., Any]) -> None:
        self._observers.setdefault(kind, []).append(fn)

    def unsubscribe(self, kind: str, fn: Callable[..., Any]) -> None:
        observers = self._observers.get(kind, [])
        if fn in observers:
            observers.remove(fn)

    def observers(self, kind: str) -> list[Callable[..., Any]]:
        return list(self._observers.get(kind, ()))

    def emit(self, kind: str, *args: Any) -> None:
        for fn in self._observers.get(kind, ()):
            try:
                fn(*args)
            except Exception as err:  # an observer's bug must not fail a microbatch or a round
                logger.warning(f"{kind} observer {fn!r} failed: {err!r}")
