"""Busy neighbours: CPU-burning processes the bench starts beside the loaders it times, so a
ratio against torch's DataLoader under contention is measured, not guessed.

Each neighbour is a Python process spinning on one core (a pure-Python loop: no memory
traffic of note, the kind of load other jobs' interpreters put on a shared machine). They
start before the timed epochs and are stopped (terminated, then killed) when the run ends,
also after an error or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

__all__ = ["busy_neighbours"]

_SPIN = "while True:\n    pass\n"
_STOP_WAIT_S = 5.0  # how long a terminated neighbour may take to end before it is killed


@contextlib.contextmanager
def busy_neighbours(count: int) -> Iterator[list[subprocess.Popen]]:
    """``count`` processes each spinning on a core while the block runs (none for 0)."""
    processes: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            processes.append(subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.DEVNULL,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield processes
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=_STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
