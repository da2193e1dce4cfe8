"""Test-suite wiring: `gpu`-marked tests skip without CUDA and say so; every test sees the same
host memory reading, whatever else runs on the machine."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import gpuload
import gpuload.device
from gpuload.device import MemoryInfo

sys.path.insert(0, str(Path(__file__).parent))  # shared test helpers (equivalence.py, ...)

GiB = 2**30
# What every test sees as host RAM unless it pretends another reading: enough for the caches
# the tests fill (a few MiB) above the host reserve of max(4 GiB, 10%), on any machine.
PRETENDED_HOST_MEMORY = MemoryInfo(free=48 * GiB, total=64 * GiB)

_REAL_HOST_MEMORY = gpuload.device.host_memory


def _modules_reading_host_memory() -> list[object]:
    """gpuload's modules that look ``host_memory`` up by name (the private DALI/CuPy ones excluded)."""
    for info in pkgutil.walk_packages(gpuload.__path__, "gpuload."):
        if not info.name.rsplit(".", 1)[-1].startswith("_"):
            importlib.import_module(info.name)
    return [
        module for name, module in list(sys.modules.items())
        if name.startswith("gpuload.") and getattr(module, "host_memory", None) is _REAL_HOST_MEMORY
    ]


_READERS = _modules_reading_host_memory()


@pytest.fixture(autouse=True)
def pretend_host_memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Pin the host memory reading to ``PRETENDED_HOST_MEMORY`` for every test (CI must not
    depend on what else runs); a test of memory pressure calls the fixture's value,
    ``pretend_host_memory(free=..., total=...)``, to pretend another reading."""
    reading = [PRETENDED_HOST_MEMORY]

    def read() -> MemoryInfo:
        return reading[0]

    for module in _READERS:
        monkeypatch.setattr(module, "host_memory", read)

    def pretend(free: int, total: int = PRETENDED_HOST_MEMORY.total) -> None:
        reading[0] = MemoryInfo(free=int(free), total=int(total))

    yield pretend


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
