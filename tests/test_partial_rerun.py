"""The suite's rerun of a test during which hivemind cut an all-reduce short (tests/conftest.py): only such a
failure runs again, the second run decides, and the rerun is listed. Run in a subprocess with this suite's
conftest (its exit watchdog must not start in this process)."""

from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]

PROBES = '''
import pytest

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


def test_failed_by_pytest_fail_runs_again_too():
    runs["fail"] = runs.get("fail", 0) + 1
    if runs["fail"] == 1:
        _partial()
        pytest.fail("hivemind cut it short")


def test_caplog_is_judged_on_the_second_run(caplog):
    import logging
    runs["log"] = runs.get("log", 0) + 1
    if runs["log"] == 1:
        logging.getLogger("probe").warning("first run only")
        _partial()
        assert False, "hivemind cut it short"
    assert not any("first run only" in r.getMessage() for r in caplog.records)


def test_capsys_is_not_rerun(capsys):
    _partial()
    assert False, "reads captured output"
'''


def test_only_failures_with_a_partial_allreduce_run_again(pytester):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_probes=PROBES)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=3)
    out = result.stdout.str()
    assert "tests run twice" in out and "test_probes.py::test_flaky: 1 partial" in out
    assert "AssertionError: run 2" in out  # the second run's failure is the one reported
    listed = out.split("tests run twice")[1].split("short test summary")[0]
    assert "test_plain_failure: " not in listed and "test_capsys_is_not_rerun: " not in listed
    assert "test_failed_by_pytest_fail_runs_again_too: " in listed
