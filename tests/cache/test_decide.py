"""Cache decisions: where a dataset's samples or images are kept (or not), and why."""

from __future__ import annotations

import pytest
import torch

from gpuload.cache import CacheSettings, decide_images, decide_samples, estimate_image_bytes, format_bytes
from gpuload.datasets.images import make_sample_image_folder
from gpuload.device import MemoryInfo

GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_sample_image_folder(tmp_path_factory.mktemp("photos"), num_images=12, num_classes=3)


def settings(**keywords) -> CacheSettings:
    return CacheSettings.resolve(environ={}, cwd="/", **keywords)


def decide(dataset, device="cuda", *, collate=True, workers=0, in_order=True, probe=None, free=40 * GiB, **kw):
    return decide_samples(
        dataset, settings(**kw), torch.device(device), default_collate=collate, num_workers=workers,
        in_order=in_order, owner=("test", id(dataset)), device_memory_info=MemoryInfo(free=free, total=80 * GiB),
        host_memory_info=MemoryInfo(free=100 * GiB, total=128 * GiB),
        probe=probe or (lambda _: (True, "two reads were equal")),
    )


def test_decision_matrix() -> None:
    data = list(range(37))  # the decision needs only len(); the probe's answer is given

    def same(_: object) -> tuple[bool, str]:
        return True, "equal"

    def differs(_: object) -> tuple[bool, str]:
        return False, "two reads differ"

    assert decide(data, cache="off").tier == "none"
    assert decide(data, cache_size=0).tier == "none"
    assert decide([]).tier == "none"
    assert decide(data, workers=2, in_order=False, cache="device").tier == "none"
    cpu_auto = decide(data, device="cpu")
    assert cpu_auto.tier == "none" and "cache='host'" in cpu_auto.reason
    assert decide(data, device="cpu", cache="host").tier == "host"
    assert decide(data, device="cpu", cache="host", cache_size="1KiB").budget == 1024
    auto = decide(data, probe=same)
    assert auto.tier == "device" and auto.budget == 40 * GiB - 8 * GiB  # free minus the 10% reserve
    declined = decide(data, probe=differs)
    assert declined.tier == "none" and declined.warn and "differ" in declined.reason
    assert decide(data, cache="device", probe=same).tier == "device"
    frozen = decide(data, cache="device", probe=differs)  # asked for: cached, with a warning
    assert frozen.tier == "device" and frozen.warn and "first epoch's samples are kept" in frozen.reason
    assert decide(data, collate=False, probe=same).tier == "host"
    assert decide(data, cache="host", probe=same).tier == "host"
    assert decide(data, device="cpu", cache="host", probe=differs).warn

    def unreadable(_):
        raise KeyError(0)

    assert decide(data, probe=unreadable).tier == "none"  # auto: cannot tell, so no cache
    assert decide(data, cache="host", probe=unreadable).tier == "host" and not decide(
        data, cache="host", probe=unreadable).warn
    assert decide(data, probe=same, free=8 * GiB).tier == "host"  # nothing above the reserve



class _Unsized(torch.utils.data.Dataset):
    """A map-style dataset without ``__len__`` (torch reads it through a sampler)."""

    def __getitem__(self, index: int) -> int:
        return index


def test_a_dataset_without_len_gets_no_cache_saying_why() -> None:
    decision = decide(_Unsized(), cache="host")
    assert decision.tier == "none" and decision.reason == "_Unsized has no len(): samples cannot be counted"


def choose(source, device="cuda", free=40 * GiB, host_free=100 * GiB, **keywords):
    return decide_images(
        source, settings(**keywords), torch.device(device), owner=("test", id(source)),
        device_memory_info=MemoryInfo(free=free, total=80 * GiB),
        host_memory_info=MemoryInfo(free=host_free, total=128 * GiB),
    )


def test_image_cache_keeps_what_the_budget_allows(folder) -> None:
    decoded, encoded = estimate_image_bytes(folder)
    whole = choose(folder)
    assert (whole.tier, whole.holds) == ("device", "decoded")
    # Decoded images do not fit the device budget but the bytes fit in host memory.
    small = choose(folder, cache_size=decoded // 2)
    assert (small.tier, small.holds) == ("host", "encoded") and "would not fit" in small.reason
    # Neither fits: as many decoded images as the budget holds.
    assert choose(folder, cache_size=decoded // 2, host_free=12 * GiB).holds == "decoded"
    assert choose(folder, cache="device", cache_size=decoded // 2).holds == "decoded"  # forced
    assert choose(folder, cache="host").holds == "encoded"
    assert not choose(folder, cache="off").caches
    assert choose(folder, cache_size=0).tier == "none"
    cpu = choose(folder, device="cpu")
    assert not cpu.caches and "cache='device'" in cpu.reason
    assert choose(folder, device="cpu", cache="device").holds == "decoded"
    assert choose(folder, device="cpu", cache="host", cache_size="1MiB").budget == MiB


def test_decoded_images_are_weighed_against_a_device_budget_as_the_allocator_takes_them(folder) -> None:
    """Issue #34 (also-check): one tensor per decoded image takes its rounded block and a share
    of its segment; a budget that holds the images' sizes but not that does not hold them all."""
    by_size, encoded = estimate_image_bytes(folder)
    on_device, same_encoded = estimate_image_bytes(folder, on_device=True)
    assert on_device > by_size and same_encoded == encoded
    decision = choose(folder, cache_size=by_size)
    assert (decision.tier, decision.holds) == ("host", "encoded") and "would not fit" in decision.reason
    assert choose(folder, cache_size=on_device).holds == "decoded"
    assert choose(folder, device="cpu", cache="device", cache_size=by_size).reason.endswith(
        f"decoded ~{format_bytes(by_size)}, encoded ~{format_bytes(encoded)})")
