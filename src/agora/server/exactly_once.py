"""A training microbatch is run once per stage peer, however many times its caller retries it.

A caller that loses the stream (a reset, its own timeout) retries the microbatch, on the same peer when the stage
has one replica. Had this peer already run it, the gradient would be accumulated twice: the stage's batch would
hold a duplicate while the trainer's next microbatch slid into the next step, and the stages' steps would no longer
see the same samples. The trainer labels each training microbatch (``meta["mb"]``, random) and every stage passes
the label on. Here a labelled microbatch runs in a task of its own (a caller that goes away does not cancel it
halfway through forward, downstream and backward), and a retry with the same caller and label waits for that run
or gets its reply from a small cache.

A hedge sends the microbatch to a second replica while the first may still run it. Before either applies it (sends
it downstream, or accumulates it at the tail) it passes its point of no return (``pass_point``); the hedge target
first claims the key from the first replica (``claim``): granted unless that one already passed, in which case the
target drops it; once granted, the first replica drops it at its point. A claim that gets no answer (the first
replica is frozen: it drops what it held when it wakes) lets the target go on. See docs/AVERAGING.md.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any, Awaitable, Callable, Hashable, Optional

from agora.client.router import Reply

MAX_LABEL_CHARS = 64


def microbatch_key(caller: str, meta: dict) -> Optional[tuple[str, str]]:
    """The retry key of a request: its caller and label, or None for an unlabelled request (run as it comes)."""
    label = meta.get("mb")
    if not isinstance(label, str) or not 0 < len(label) <= MAX_LABEL_CHARS:
        return None
    return caller, label


class ExactlyOnce:
    """Runs of labelled microbatches in progress, and the replies of recent ones (at most ``max_bytes`` of reply
    tensors and ``max_entries`` replies, each kept ``keep_s`` seconds: a retry comes within a hop's timeout)."""

    def __init__(self, max_bytes: int = 64 << 20, max_entries: int = 1024, keep_s: float = 300.0):
        self.max_bytes, self.max_entries, self.keep_s = max_bytes, max_entries, keep_s
        self.running: dict[Hashable, asyncio.Task] = {}
        self.waiters: dict[Hashable, int] = {}  # callers awaiting each run now
        self.done: OrderedDict[Hashable, tuple[float, int, Reply]] = OrderedDict()
        self.bytes = 0
        self.duplicates = 0  # retries answered without running the microbatch again
        # Keys whose run here passed its point of no return, and keys a hedge target claimed (see the docstring);
        # both kept ``keep_s`` seconds, at most ``max_entries`` each.
        self.passed: OrderedDict[Hashable, float] = OrderedDict()
        self.yielded: OrderedDict[Hashable, float] = OrderedDict()

    async def run(self, key: Optional[Hashable], compute: Callable[[], Awaitable[Reply]]) -> Reply:
        """``compute()``'s reply; for a ``key`` seen before, the reply of its first run (awaited if it still runs)."""
        if key is None:
            return await compute()
        self._expire()
        hit = self.done.get(key)
        if hit is not None:
            self.duplicates += 1
            return hit[2]
        task = self.running.get(key)
        if task is None:
            task = asyncio.create_task(compute())
            self.running[key] = task
            task.add_done_callback(lambda t: self._finished(key, t))
        else:
            self.duplicates += 1
        # The caller may go away (its stream closes and this coroutine is cancelled): the run goes on, and a retry
        # finds it. A run nobody awaits any more drops its work at its commit point (see ``wanted``).
        self.waiters[key] = self.waiters.get(key, 0) + 1
        try:
            return await asyncio.shield(task)
        finally:
            self.waiters[key] -= 1
            if not self.waiters[key]:
                del self.waiters[key]

    def wanted(self, key: Optional[Hashable]) -> bool:
        """Whether a caller still awaits the run of ``key`` (always, for an unlabelled request). A caller that
        went away either hedged the microbatch to another replica, which applies it, or will retry it here, which
        runs it again: either way this run must not commit it."""
        return key is None or self.waiters.get(key, 0) > 0

    def claim(self, key: Hashable) -> bool:
        """A hedge target asks for ``key``: True (it may apply it; our run will not) unless our run passed its point
        of no return. The key is remembered even if its run has not arrived here yet."""
        self._expire()
        if key in self.passed:
            return False
        self._remember(self.yielded, key)
        return True

    def pass_point(self, key: Optional[Hashable]) -> bool:
        """Our run of ``key`` is about to apply it: False if a hedge target claimed it first (drop it; the claim is
        used up, so a later retry of the microbatch here runs), else True, and later claims are refused. Nothing
        may be awaited between this and the application."""
        if key is None:
            return True
        if self.yielded.pop(key, None) is not None:
            return False
        self._remember(self.passed, key)
        return True

    def _remember(self, keys: "OrderedDict[Hashable, float]", key: Hashable) -> None:
        keys[key] = time.monotonic()
        keys.move_to_end(key)
        while len(keys) > self.max_entries:
            keys.popitem(last=False)

    def _finished(self, key: Hashable, task: asyncio.Task) -> None:
        self.running.pop(key, None)
        if task.cancelled() or task.exception() is not None:  # retrieved here: a retry runs it again
            return
        reply = task.result()
        size = sum(_nbytes(t) for t in reply[1])
        if size > self.max_bytes:
            return
        self.done[key] = (time.monotonic(), size, reply)
        self.bytes += size
        while self.done and (self.bytes > self.max_bytes or len(self.done) > self.max_entries):
            self._pop_oldest()

    def _expire(self) -> None:
        now = time.monotonic()
        while self.done and now - next(iter(self.done.values()))[0] > self.keep_s:
            self._pop_oldest()
        for keys in (self.passed, self.yielded):
            while keys and now - next(iter(keys.values())) > self.keep_s:
                keys.popitem(last=False)

    def _pop_oldest(self) -> None:
        _, (_, size, _) = self.done.popitem(last=False)
        self.bytes -= size


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size()) if hasattr(t, "numel") else 0
