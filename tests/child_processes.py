"""Test child processes: the environment a child takes (gpuload importable from this checkout,
the disk tier's budget named), and ``python SCRIPT ARGV`` run as a process forked from the
suite's fork server, which imported torch and gpuload once (seconds of CPU a fresh interpreter
spends on them). conftest's pretended disk space does not reach a child, which reads the real
disk, and ``disk_cache_size='auto'`` on a disk with under 8 GiB free is no tier at all (CI's
disk once torch is installed)."""

from __future__ import annotations

import os
import sys
from multiprocessing.process import BaseProcess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD_DISK_CACHE_SIZE = "4GiB"  # far above what a test fills (a few MiB)

sys.path.insert(0, str(Path(__file__).resolve().parent / "distributed"))
import ranks_job  # noqa: E402


def child_environment() -> dict[str, str]:
    """``os.environ`` with this checkout on ``PYTHONPATH`` and ``GPULOAD_DISK_CACHE_SIZE`` set."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "GPULOAD_DISK_CACHE_SIZE": CHILD_DISK_CACHE_SIZE}


def start_script(script: Path | str, argv: list[str], environ: dict[str, str], out: Path, err: Path) -> BaseProcess:
    """``python SCRIPT ARGV`` started as a new process forked from the suite's fork server (nothing
    of this process's state, nor of an earlier child's), with the environment ``environ``; its
    stdout and stderr go to the files ``out`` and ``err``, its exit status is the process's
    ``exitcode`` (``-9`` once ``kill()``-ed)."""
    process = ranks_job.fork_server().Process(target=_run_script, args=(str(script), argv, environ, str(out), str(err)))
    process.start()
    return process


def _run_script(script: str, argv: list[str], environ: dict[str, str], out: str, err: str) -> None:
    """``python SCRIPT ARGV`` in this (forked) process, as :func:`start_script` says."""
    import atexit
    import runpy
    import tempfile
    import traceback

    os.environ.clear()
    os.environ.update(environ)
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
