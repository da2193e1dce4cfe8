"""Test-suite wiring: `gpu`-marked tests skip without CUDA and say so; every test sees the same
host memory and disk space readings, whatever else runs on the machine."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import gpuload
import gpuload.cache.budget
import gpuload.cpu_threads
import gpuload.device
from gpuload.device import MemoryInfo

sys.path.insert(0, str(Path(__file__).parent))  # shared test helpers (equivalence.py, ...)

GiB = 2**30
# What every test sees as host RAM unless it pretends another reading: enough for the caches
# the tests fill (a few MiB) above the host reserve of max(4 GiB, 10%), on any machine.
PRETENDED_HOST_MEMORY = MemoryInfo(free=48 * GiB, total=64 * GiB)

# And what every test sees as the disk under any path: room for the disk tiers the tests fill
# above the default disk reserve (at most 8 GiB), whatever the machine's disk holds. CI's disk
# had under 8 GiB free once torch was installed: every ``disk_cache_size='auto'`` tier was off.
PRETENDED_DISK_SPACE = (200 * GiB, 256 * GiB)

_REAL_HOST_MEMORY = gpuload.device.host_memory
_REAL_DISK_SPACE = gpuload.cache.budget.disk_space


for _info in pkgutil.walk_packages(gpuload.__path__, "gpuload."):  # every module that could look a reading up
    if not _info.name.rsplit(".", 1)[-1].startswith("_"):  # the private DALI/CuPy ones excluded
        importlib.import_module(_info.name)


def _modules_reading(function: Callable[..., object]) -> list[object]:
    """gpuload's imported modules that look ``function`` up by name."""
    name = function.__name__
    return [
        module for module_name, module in list(sys.modules.items())
        if module_name.startswith("gpuload.") and getattr(module, name, None) is function
    ]


_HOST_MEMORY_READERS = _modules_reading(_REAL_HOST_MEMORY)
_DISK_SPACE_READERS = _modules_reading(_REAL_DISK_SPACE)


@pytest.fixture(autouse=True)
def pretend_host_memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Pin the host memory reading to ``PRETENDED_HOST_MEMORY`` for every test (CI must not
    depend on what else runs); a test of memory pressure calls the fixture's value,
    ``pretend_host_memory(free=..., total=...)``, to pretend another reading."""
    reading = [PRETENDED_HOST_MEMORY]

    def read() -> MemoryInfo:
        return reading[0]

    for module in _HOST_MEMORY_READERS:
        monkeypatch.setattr(module, "host_memory", read)

    def pretend(free: int, total: int = PRETENDED_HOST_MEMORY.total) -> None:
        reading[0] = MemoryInfo(free=int(free), total=int(total))

    yield pretend


@pytest.fixture(autouse=True)
def pretend_disk_space(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Pin every file system's ``(free, total)`` reading to ``PRETENDED_DISK_SPACE`` in this
    process, as ``pretend_host_memory`` does for memory; a test of a full disk calls
    ``pretend_disk_space(free=..., total=...)``. A child process reads the real disk: a job
    started by a test that fills a disk tier names its ``disk_cache_size``."""
    reading = [PRETENDED_DISK_SPACE]

    def read(path: object) -> tuple[int, int]:
        return reading[0]

    for module in _DISK_SPACE_READERS:
        monkeypatch.setattr(module, "disk_space", read)

    def pretend(free: int, total: int = PRETENDED_DISK_SPACE[1]) -> None:
        reading[0] = (int(free), int(total))

    yield pretend


@pytest.fixture(autouse=True)
def fresh_cpu_thread_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's batch ops choose their threads from the load it pretends (or the machine's),
    not from a choice an earlier test left kept (``gpuload.cpu_threads.take_cpu_threads``)."""
    monkeypatch.setattr(gpuload.cpu_threads, "_kept_choice", (float("-inf"), 0, 0))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
