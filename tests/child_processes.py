"""Test child processes: the environment a child takes (gpuload importable from this checkout,
the disk tier's budget named), ``python SCRIPT ARGV`` run as a process forked from the suite's
fork server, which imported torch and gpuload once (seconds of CPU a fresh interpreter spends on
them), and :class:`Child`, such a run whose output a test reads. conftest's pretended disk space
does not reach a child, which reads the real disk, and ``disk_cache_size='auto'`` on a disk with
under 8 GiB free is no tier at all (CI's disk once torch is installed)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHILD_DISK_CACHE_SIZE = "4GiB"  # far above what a test fills (a few MiB)

sys.path.insert(0, str(Path(__file__).resolve().parent / "distributed"))
import ranks_job  # noqa: E402


def child_environment() -> dict[str, str]:
    """``os.environ`` with this checkout on ``PYTHONPATH`` and ``GPULOAD_DISK_CACHE_SIZE`` set."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "GPULOAD_DISK_CACHE_SIZE": CHILD_DISK_CACHE_SIZE}


def start_script(script: Path | str, argv: list[str], environ: dict[str, str], out: Path, err: Path,
                 cwd: Path | None = None) -> BaseProcess:
    """``python SCRIPT ARGV`` started as a new process forked from the suite's fork server (nothing
    of this process's state, nor of an earlier child's), with the environment ``environ`` (and the
    working folder ``cwd``, if given); its stdout and stderr go to the files ``out`` and ``err``,
    its exit status is the process's ``exitcode`` (``-9`` once ``kill()``-ed)."""
    process = ranks_job.fork_server().Process(
        target=_run_script, args=(str(script), argv, environ, str(out), str(err), None if cwd is None else str(cwd)))
    process.start()
    return process


class Child:
    """One ``python SCRIPT ARGV`` started now by :func:`start_script`; its stdout and stderr kept in
    the folder ``logs`` as ``<index>-<name>.out`` and ``.err`` (``index``: the runs before it there).
    ``code``, instead of ``script``: the script's text (what ``python -c CODE`` would run), kept
    there as ``<index>-<name>.py``."""

    def __init__(self, argv: list[str], environ: dict[str, str], logs: Path, name: str, *,
                 script: Path | None = None, code: str | None = None, cwd: Path | None = None) -> None:
        if (script is None) == (code is None):
            raise TypeError("Child takes a script or its code, one of the two")
        logs.mkdir(parents=True, exist_ok=True)
        stem = f"{len(list(logs.glob('*.out')))}-{name}"
        self.out, self.err = logs / f"{stem}.out", logs / f"{stem}.err"
        self.out.touch()  # counted by the next child's index, though this one has not opened it yet
        if code is not None:
            script = logs / f"{stem}.py"
            script.write_text(code)
        assert script is not None
        self.process = start_script(script, argv, environ, self.out, self.err, cwd)

    def wait(self, hang_s: float) -> int:
        """Its exit status, once it ended; a run not over in ``hang_s`` is killed and fails the test."""
        self.process.join(hang_s)
        if self.process.exitcode is None:
            self.kill()
            pytest.fail(f"the child did not end in {hang_s} s: {self.err.read_text()[-2000:]}")
        return self.process.exitcode

    def result(self, hang_s: float) -> Any:
        """The JSON of its last stdout line, once it ended with status 0 (see :meth:`wait`)."""
        status = self.wait(hang_s)
        assert status == 0, f"child failed ({status}):\n{self.err.read_text()}"
        return json.loads(self.out.read_text().strip().splitlines()[-1])

    def kill(self) -> None:
        """Killed (SIGKILL) and waited for, unless it ended already."""
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()


def results_of(children: Sequence[Child], hang_s: float) -> list[Any]:
    """Each child's :meth:`Child.result`, in order; a child still running when another failed (or
    hung) is killed, not left behind."""
    try:
        return [child.result(hang_s) for child in children]
    finally:
        for child in children:
            child.kill()


def _run_script(script: str, argv: list[str], environ: dict[str, str], out: str, err: str, cwd: str | None) -> None:
    """``python SCRIPT ARGV`` in this (forked) process, as :func:`start_script` says."""
    import atexit
    import runpy
    import tempfile
    import traceback

    os.environ.clear()
    os.environ.update(environ)
    if cwd is not None:
        os.chdir(cwd)
    tempfile.tempdir = None  # found again, from TMPDIR
    for fd, path in ((1, out), (2, err)):
        with open(path, "w") as file:
            os.dup2(file.fileno(), fd)
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).parent))  # as ``python SCRIPT`` puts it first
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else (exit.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what the interpreter runs at its exit, which a forked process skips
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
