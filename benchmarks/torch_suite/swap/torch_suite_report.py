"""pytest plugin of the torch-suite harness: one JSON line per test, written as each test ends.

Loaded with ``-p torch_suite_report``; writes to ``$GPULOAD_TORCH_SUITE_REPORT``. Written line
by line (not at the end, as junit XML is) so that a run stopped by the harness's time limit
still reports every test that finished.
"""

from __future__ import annotations

import json
import os

import pytest
import torch.utils.data


def _first_line(report: pytest.TestReport) -> str:
    """The line that says why: the assertion or exception message, or the skip reason."""
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # skipped: (file, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr)
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _outcome(report: pytest.TestReport) -> str:
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.when != "call" and report.failed:
        return "error"
    return report.outcome


def pytest_sessionstart(session: pytest.Session) -> None:
    with open(os.environ["GPULOAD_TORCH_SUITE_REPORT"], "w") as out:
        loader = torch.utils.data.DataLoader
        out.write(json.dumps({"loader": f"{loader.__module__}.{loader.__qualname__}"}) + "\n")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # One line per test: its call phase, or the setup/teardown phase that failed or skipped it.
    if report.when != "call" and report.passed:
        return
    line = {"test": report.nodeid, "outcome": _outcome(report), "why": _first_line(report),
            "seconds": round(report.duration, 2)}
    with open(os.environ["GPULOAD_TORCH_SUITE_REPORT"], "a") as out:
        out.write(json.dumps(line) + "\n")
