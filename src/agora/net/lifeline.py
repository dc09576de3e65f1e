"""Helper processes that die with the process that started them.

hivemind forks a DHT process (which starts its own ``p2pd``) and one averager process per replica sync. When a
role's main process dies by SIGKILL (the OOM killer, a crash) nothing tells them: they would keep the dead peer's
identity in the network and its port bound, so the same node could not restart on the same ``--port``. Every such
helper therefore watches its parent: once it was re-parented (its parent process is gone), it kills its own
descendants (``p2pd``) and exits, within ``WATCH_PERIOD_S``.

Why a watch thread and not ``PR_SET_PDEATHSIG``: the kernel sends that signal when the *thread* that forked the
child exits, and helpers may be forked from short-lived threads (thread pools, ``asyncio.to_thread``).
"""

from __future__ import annotations

import os
import threading
import time

import psutil
from hivemind import DHT

WATCH_PERIOD_S = 0.25


class ParentWatch:
    """Remembers the current process (in the parent, before the fork) and, started in the child, ends the child
    and its descendants once that process is gone."""

    def __init__(self) -> None:
        self.parent_pid = os.getpid()

    def start(self) -> None:
        """Call first thing in the child process."""
        if os.getppid() != self.parent_pid:  # the parent died between fork and now
            _end_this_process_tree()
        threading.Thread(target=self._watch, name="parent-watch", daemon=True).start()

    def _watch(self) -> None:
        while os.getppid() == self.parent_pid:
            time.sleep(WATCH_PERIOD_S)
        _end_this_process_tree()


def _end_this_process_tree() -> None:
    me = psutil.Process()
    for child in me.children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            continue
    os._exit(0)


class GuardedDHT(DHT):
    """hivemind's DHT process, ended with its ``p2pd`` when the process that started it dies."""

    def __init__(self, *args, **kwargs):
        self._lifeline = ParentWatch()
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        self._lifeline.start()
        super().run()
