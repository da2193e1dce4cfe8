"""gpuload.device: what "free" device memory means, with simulated driver and allocator readings."""

from __future__ import annotations

import pytest
import torch

from gpuload import device as device_module
from gpuload import memory as memory_module
from gpuload.device import (
    DeviceError,
    MemoryInfo,
    device_memory,
    host_memory,
    new_side_stream,
    resolve_device,
    usable_cpu_count,
)

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


# --- device=None under a launcher (LOCAL_RANK) --------------------------------------------------


@pytest.fixture
def pretend_gpus(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A pretended machine with 4 CUDA devices; set ``current`` in the returned dict to pretend
    ``torch.cuda.set_device``. LOCAL_RANK starts unset."""
    state = {"count": 4, "current": 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state["count"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return state


def test_without_a_launcher_none_is_the_current_device(pretend_gpus: dict) -> None:
    assert device_module.resolve_device(None) == torch.device("cuda", 0)
    pretend_gpus["current"] = 2
    assert device_module.resolve_device(None) == torch.device("cuda", 2)


@pytest.mark.parametrize("device", [None, "cuda", torch.device("cuda")])
def test_under_torchrun_none_is_the_local_rank(pretend_gpus: dict, monkeypatch: pytest.MonkeyPatch, device) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device_module.resolve_device(device) == torch.device("cuda", 3)
    assert device_module.resolve_device("cuda:1") == torch.device("cuda", 1)  # an index is the user's


def test_a_device_the_job_set_wins_over_local_rank(pretend_gpus: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    pretend_gpus["current"] = 1  # torch.cuda.set_device(1)
    assert device_module.resolve_device(None) == torch.device("cuda", 1)


def test_one_visible_gpu_per_rank_is_cuda0_whatever_the_local_rank(pretend_gpus: dict,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    pretend_gpus["count"] = 1  # the launcher set CUDA_VISIBLE_DEVICES to this rank's GPU
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert device_module.resolve_device(None) == torch.device("cuda", 0)


@pytest.mark.parametrize("value", ["7", "-1", "first"])
def test_a_local_rank_that_is_no_device_here_is_one_clear_error(pretend_gpus: dict, monkeypatch: pytest.MonkeyPatch,
                                                                 value: str) -> None:
    monkeypatch.setenv("LOCAL_RANK", value)
    with pytest.raises(DeviceError, match=rf"LOCAL_RANK='{value}' is not a CUDA device of this machine \(4 devices"):
        device_module.resolve_device(None)


def test_off_cuda_local_rank_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device_module.resolve_device(None) == torch.device("cpu")


def test_free_to_torch_counts_the_allocators_unused_blocks(pretend_card: dict) -> None:
    assert device_memory(CUDA0).free_to_torch == 62 * GiB


def test_a_cuda_index_past_the_last_device_names_what_exists(pretend_gpus: dict) -> None:
    with pytest.raises(DeviceError, match=r"^device='cuda:4' does not exist: this machine has 4 CUDA device\(s\), "
                       r"cuda:0 to cuda:3$"):
        resolve_device("cuda:4")
    assert resolve_device(3) == torch.device("cuda", 3)


def test_without_proc_meminfo_host_memory_asks_sysconf(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_meminfo(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise FileNotFoundError(path)  # macOS, or a sandbox without /proc

    pages = {"SC_PAGE_SIZE": 4096, "SC_AVPHYS_PAGES": 1000, "SC_PHYS_PAGES": 4000}
    monkeypatch.setattr(memory_module, "open", no_meminfo, raising=False)  # host_memory lives there, torch-free
    monkeypatch.setattr(memory_module.os, "sysconf", lambda name: pages[name])
    assert host_memory() == MemoryInfo(free=4096 * 1000, total=4096 * 4000)


def test_without_an_affinity_api_the_cpu_count_is_os_cpu_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(device_module.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(device_module.os, "cpu_count", lambda: 6)
    assert usable_cpu_count() == 6
    monkeypatch.setattr(device_module.os, "cpu_count", lambda: None)  # unknown: at least one
    assert usable_cpu_count() == 1


def test_the_cpu_gets_no_side_stream() -> None:
    assert new_side_stream(torch.device("cpu")) is None
