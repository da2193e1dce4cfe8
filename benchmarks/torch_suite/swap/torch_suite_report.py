"""pytest plugin of the torch-suite harness: one JSON line per test, written as each test ends.

Loaded with ``-p torch_suite_report``; writes to ``$GPULOAD_TORCH_SUITE_REPORT``. Written line
by line (not at the end, as junit XML is) so that a run stopped by the harness's time limit
still reports every test that finished. Its first line names the class the suite's tests get.

For the ``import`` swap it also rebinds the suite module's ``DataLoader`` in this process once
collected: pytest's assertion rewriter imports test modules ahead of ``sitecustomize``'s import
hook (which still serves spawned workers, where pytest is absent).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch.utils.data
from sitecustomize import SUITE_MODULE


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


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def pytest_sessionstart(session: pytest.Session) -> None:
    open(os.environ["GPULOAD_TORCH_SUITE_REPORT"], "w").close()


def pytest_collection_finish(session: pytest.Session) -> None:
    suite = sys.modules.get(SUITE_MODULE)
    if suite is not None and os.environ.get("GPULOAD_TORCH_SUITE_SWAP") == "import":
        import gpuload

        suite.DataLoader = gpuload.DataLoader
    classes = {"loader": _name(torch.utils.data.DataLoader)}
    if suite is not None:
        classes["suite_loader"] = _name(suite.DataLoader)
    with open(os.environ["GPULOAD_TORCH_SUITE_REPORT"], "a") as out:
        out.write(json.dumps(classes) + "\n")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # One line per test: its call phase, or the setup/teardown phase that failed or skipped it.
    if report.when != "call" and report.passed:
        return
    line = {"test": report.nodeid, "outcome": _outcome(report), "why": _first_line(report),
            "seconds": round(report.duration, 2)}
    with open(os.environ["GPULOAD_TORCH_SUITE_REPORT"], "a") as out:
        out.write(json.dumps(line) + "\n")
