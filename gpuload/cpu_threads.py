"""Intra-op threads for gpuload's own batch-sized CPU ops, chosen from the CPUs free now.

A batch of transforms on the CPU is a handful of large ops, each split over torch's intra-op
(OpenMP) threads, which wait for each other at the end of every op by spinning. When other
processes keep the cores busy, a spinning thread holds a core that the thread it waits for
needs: on 2 cores at load 9, two threads made a CIFAR batch's transforms 5x slower than one
(and spent 6x the CPU time), where torch's per-sample loop, whose ops are too small to be
split, lost nothing. So gpuload runs its own batch ops with no more threads than the CPUs
left free by other processes (the 1-minute load average less the cores this process itself
kept busy lately; never below 1, never above torch's setting), and puts torch's setting back
after each call: the user's own ops keep the thread count the user chose. (OpenMP's thread
count is the calling thread's; a thread the user starts during the call may take the lower
count as its first one.) The choice is kept for a second (the load average moves every 5 s),
so that a batch does not read the load again (:func:`take_cpu_threads`).

Work that comes one image at a time (a random crop's resize: one small op per image, too small
for torch to split) is spread over threads of gpuload's own instead (:func:`spread_over_cpus`),
one per usable CPU not already taken by the intra-op threads in force, whatever the load.
Independent images need no barrier: the threads take small runs of images from one queue, so a
thread that loses its core to a neighbour does fewer of them, and none spins while it waits.
With torch's setting at 1 (the bench's on 2 cores) a batch's resizes otherwise kept one core
idle while the other did them all; and counting the load as lost cores (as the intra-op threads
must) left the per-image work one thread at load 2, against torch's DataLoader whose two worker
processes each take their share of the cores at any load.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from gpuload.device import usable_cpu_count

__all__ = ["chosen_cpu_threads", "free_cpu_threads", "give_back_cpu_threads", "image_pool", "own_cpu_threads",
           "spread_over_cpus", "take_cpu_threads"]

_Item = TypeVar("_Item")


def free_cpu_threads(current: int, usable: int, load: float, own: float) -> int:
    """Threads for a batch op: ``current`` (torch's setting) capped by the CPUs this process may
    use (``usable``) less the ones other processes keep busy: the 1-minute ``load`` average
    less this process's ``own`` share of it (the cores its threads kept busy lately, spinning
    ones included, so its own threads never count as contention)."""
    others = max(0.0, load - own)
    return max(1, min(current, usable, usable - int(others + 0.5)))


class _OwnUse:
    """Cores this process kept busy over its last complete window of at least ``WINDOW`` s
    (CPU time over wall time; 1.0, the loop's thread, before one has passed)."""

    WINDOW = 10.0

    def __init__(self) -> None:
        self.cores = 1.0
        self.since = (time.monotonic(), time.process_time())

    def now(self) -> float:
        wall, cpu = time.monotonic(), time.process_time()
        elapsed = wall - self.since[0]
        if elapsed >= self.WINDOW:
            self.cores = (cpu - self.since[1]) / elapsed
            self.since = (wall, cpu)
        return self.cores


_own_use = _OwnUse()


def chosen_cpu_threads() -> int:
    """:func:`free_cpu_threads` for this process now."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return free_cpu_threads(torch.get_num_threads(), usable_cpu_count(), load, _own_use.now())


# The last choice, kept a second: the load average it follows moves every 5 s, and a batch
# should not pay for reading it again. (until, torch's setting it was made for, threads)
_KEEP_CHOICE_S = 1.0
_clock = time.monotonic
_kept_choice: tuple[float, int, int] = (float("-inf"), 0, 0)


def take_cpu_threads(device: torch.device) -> int | None:
    """Set :func:`free_cpu_threads` threads for gpuload's own batch ops on a CPU ``device``;
    returns torch's setting to give back with :func:`give_back_cpu_threads` (None: nothing was
    changed). The hot paths' form of :func:`own_cpu_threads` (a try/finally, no generator)."""
    global _kept_choice
    if device.type != "cpu":
        return None
    current = torch.get_num_threads()
    until, made_for, wanted = _kept_choice
    now = _clock()
    if now >= until or made_for != current:
        wanted = chosen_cpu_threads()
        _kept_choice = (now + _KEEP_CHOICE_S, current, wanted)
    if wanted == current:
        return None
    torch.set_num_threads(wanted)
    return current


def give_back_cpu_threads(taken: int | None) -> None:
    """Put back torch's setting that :func:`take_cpu_threads` returned."""
    if taken is not None:
        torch.set_num_threads(taken)


@contextlib.contextmanager
def own_cpu_threads(device: torch.device) -> Iterator[None]:
    """Run the block's CPU ops with :func:`free_cpu_threads` threads (on a CPU ``device``;
    elsewhere, and when that is torch's setting already, nothing changes)."""
    taken = take_cpu_threads(device)
    try:
        yield
    finally:
        give_back_cpu_threads(taken)


def _threads_for_images() -> int:
    """Threads for per-image work: the usable CPUs shared with the intra-op threads in force, so
    that an image's op split over N intra-op threads takes N of them (not fewer at load: see the
    module docstring)."""
    return max(1, min(_MAX_IMAGE_THREADS, usable_cpu_count() // max(1, torch.get_num_threads())))


# Runs per thread that per-image work is cut into: threads that get less of a core take fewer.
_RUNS_PER_THREAD = 4


_MAX_IMAGE_THREADS = 8
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def image_pool() -> ThreadPoolExecutor:
    """The process's one pool for per-image CPU work (decoding, resizes): a thread per usable
    CPU, at most 8."""
    # One pool per process: a pool inherited through fork has no threads behind it.
    pid = os.getpid()
    with _pools_lock:
        pool = _pools.get(pid)
        if pool is None:
            workers = min(_MAX_IMAGE_THREADS, usable_cpu_count())
            pool = _pools[pid] = ThreadPoolExecutor(workers, thread_name_prefix="gpuload-images")
        return pool


def spread_over_cpus(work: Callable[[Sequence[_Item]], None], items: Sequence[_Item],
                          device: torch.device) -> None:
    """``work`` on consecutive runs of ``items``, taken from one queue by as many threads as
    the usable CPUs allow (see the module docstring), the calling thread one of them; on a CPU
    ``device`` only (elsewhere, or with one thread, ``work(items)`` here). Returns once every
    run is done; the first error raised in any run is raised here, after the others finished."""
    threads = min(len(items), _threads_for_images()) if device.type == "cpu" else 1
    if threads <= 1:
        work(items)
        return
    size = -(-len(items) // (threads * _RUNS_PER_THREAD))
    starts = iter(range(0, len(items), size))
    lock = threading.Lock()

    def take_runs() -> None:
        while True:
            with lock:
                start = next(starts, None)
            if start is None:
                return
            work(items[start : start + size])

    others = [image_pool().submit(take_runs) for _ in range(threads - 1)]
    try:
        take_runs()
    finally:
        errors = [future.exception() for future in others]  # waits for each
    for error in errors:
        if error is not None:
            raise error
