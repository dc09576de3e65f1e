"""A pytest plugin that writes, per test, its wall time and the CPU seconds the whole machine spent meanwhile
(/proc/stat: every process, daemons and child processes included) to ``$CPU_PROBE_OUT`` (JSON lines).

    CPU_PROBE_OUT=/tmp/probe.jsonl PYTHONPATH=docs/bench/suite .venv/bin/python -m pytest -p cpu_probe tests

Run it on an otherwise idle machine: the CPU column counts everything that ran."""

from __future__ import annotations

import json
import os
import time

_started: dict[str, tuple[float, int]] = {}


def _busy_ticks() -> int:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # all but idle and iowait


def pytest_runtest_logstart(nodeid, location):
    _started[nodeid] = (time.monotonic(), _busy_ticks())


def pytest_runtest_logfinish(nodeid, location):
    t0, b0 = _started.pop(nodeid)
    row = [nodeid, round(time.monotonic() - t0, 2), round((_busy_ticks() - b0) / os.sysconf("SC_CLK_TCK"), 2)]
    with open(os.environ.get("CPU_PROBE_OUT", "cpu_probe.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
