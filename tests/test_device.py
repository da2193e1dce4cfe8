"""gpuload.device: what "free" device memory means, with simulated driver and allocator readings."""

from __future__ import annotations

import pytest
import torch

from gpuload import device as device_module
from gpuload.device import DeviceError, MemoryInfo, device_memory

GiB = 1 << 30
CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def pretend_card(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A pretended 80 GiB card: set driver_free, reserved and allocated in the returned dict."""
    reading = {"driver_free": 50 * GiB, "total": 80 * GiB, "reserved": 20 * GiB, "allocated": 8 * GiB}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (reading["driver_free"], reading["total"]))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: reading["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: reading["allocated"])
    return reading


def test_free_is_what_the_driver_says_and_torchs_pool_is_reported_apart(pretend_card: dict) -> None:
    memory = device_memory(CUDA0)
    assert memory == MemoryInfo(free=50 * GiB, total=80 * GiB, torch_cached=12 * GiB)


def test_activations_freed_between_steps_do_not_count_as_free(pretend_card: dict) -> None:
    # Epoch start: the last step's 12 GiB of activations sit in torch's pool, unallocated.
    at_epoch_start = device_memory(CUDA0)
    # In the middle of the next step they are allocated again; the driver's view is unchanged.
    pretend_card["allocated"] = 20 * GiB
    mid_step = device_memory(CUDA0)
    assert at_epoch_start.free == mid_step.free == 50 * GiB
    assert mid_step.torch_cached == 0


def test_empty_cache_hands_the_pool_back_and_then_it_is_free(pretend_card: dict) -> None:
    pretend_card.update(driver_free=62 * GiB, reserved=8 * GiB)  # what torch.cuda.empty_cache() does
    assert device_memory(CUDA0) == MemoryInfo(free=62 * GiB, total=80 * GiB, torch_cached=0)


def test_the_cpu_has_no_device_memory() -> None:
    with pytest.raises(DeviceError, match="ask host_memory"):
        device_memory(torch.device("cpu"))


def test_host_memory_reads_proc_meminfo() -> None:
    memory = device_module.host_memory()
    assert 0 < memory.free <= memory.total and memory.torch_cached == 0
