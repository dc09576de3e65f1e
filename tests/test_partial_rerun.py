"""The suite's rerun of a test during which hivemind cut an all-reduce short (tests/conftest.py): only such a
failure runs again, the second run decides, and the rerun is listed. Run in a subprocess with this suite's
conftest (its exit watchdog must not start in this process)."""

from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]

PROBES = '''
from agora.server.averaging import allreduce

runs = {"flaky": 0, "broken": 0}


def _partial():
    with allreduce.PARTIAL_ALLREDUCES.get_lock():
        allreduce.PARTIAL_ALLREDUCES.value += 1


def test_flaky():
    runs["flaky"] += 1
    if runs["flaky"] == 1:
        _partial()
        assert False, "hivemind cut it short"


def test_broken_every_time():
    runs["broken"] += 1
    _partial()
    assert False, f"run {runs['broken']}"


def test_plain_failure():
    assert False, "no partial all-reduce"
'''


def test_only_failures_with_a_partial_allreduce_run_again(pytester):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_probes=PROBES)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=2)
    out = result.stdout.str()
    assert "tests run twice" in out and "test_probes.py::test_flaky: 1 partial" in out
    assert "AssertionError: run 2" in out  # the second run's failure is the one reported
    assert "test_plain_failure: " not in out.split("tests run twice")[1].split("short test summary")[0]
