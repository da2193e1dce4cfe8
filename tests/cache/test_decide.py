"""The image cache: which mode the budget chooses, and keeping decoded images or encoded bytes."""

from __future__ import annotations

import pytest
import torch

from gpuload.cache import CacheSettings
from gpuload.datasets.images import make_sample_image_folder
from gpuload.device import MemoryInfo
from gpuload.image_cache import ImageCache, ImageCacheDecision, choose_image_cache, estimate_image_bytes

GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_sample_image_folder(tmp_path_factory.mktemp("photos"), num_images=12, num_classes=3)


def choose(source, device="cuda", free=40 * GiB, host_free=100 * GiB, **keywords):
    settings = CacheSettings.resolve(environ={}, cwd="/", **keywords)
    return choose_image_cache(
        source, settings, torch.device(device), owner=("test", id(source)),
        device_memory_info=MemoryInfo(free=free, total=80 * GiB),
        host_memory_info=MemoryInfo(free=host_free, total=128 * GiB),
    )


def test_estimates_come_from_real_headers_and_sizes(folder) -> None:
    decoded, encoded = estimate_image_bytes(folder)
    exact_decoded = exact_encoded = 0
    for index in range(len(folder)):
        data, _ = folder.read_encoded(index)
        exact_encoded += len(data)
        image = folder[index][0]
        exact_decoded += image.numel()
    assert decoded == exact_decoded and encoded == exact_encoded  # 12 files: all probed
    assert 4 < decoded / encoded < 60  # JPEG at quality ~90 against 3 bytes a pixel


def test_mode_follows_the_budget(folder) -> None:
    decoded, encoded = estimate_image_bytes(folder)
    assert choose(folder).mode == "decoded"
    # Decoded images do not fit the device budget but the bytes fit in host memory.
    small = choose(folder, cache_size=decoded // 2)
    assert small.mode == "encoded" and "would not fit" in small.reason
    # Neither fits: as many decoded images as the budget holds.
    assert choose(folder, cache_size=decoded // 2, host_free=12 * GiB).mode == "decoded"
    assert choose(folder, cache="device", cache_size=decoded // 2).mode == "decoded"  # forced
    assert choose(folder, cache="host").mode == "encoded"
    assert choose(folder, cache="off").mode == "none"
    assert choose(folder, cache_size=0).mode == "none"
    cpu = choose(folder, device="cpu")
    assert cpu.mode == "none" and "cache='device'" in cpu.reason
    assert choose(folder, device="cpu", cache="device").mode == "decoded"
    assert choose(folder, device="cpu", cache="host", cache_size="1MiB").budget == MiB


def test_keeps_decoded_images_until_the_budget_then_settles(folder) -> None:
    image = folder[0][0]
    cache = ImageCache(ImageCacheDecision("decoded", 2 * image.numel(), "test"), torch.device("cpu"), 3, "t")
    assert cache.keep(0, image) and cache.keep(1, image)
    assert not cache.keep(2, image)  # over the budget
    assert torch.equal(cache.get(0), image) and cache.get(2) is None
    assert not cache.complete and not cache.decodes
    stats = cache.stats()
    assert stats["mode"] == "decoded" and stats["entries"] == 2 and stats["hits"] == 1
    cache.close()
    assert cache.get(0) is None


def test_keeps_encoded_bytes_and_completes(folder) -> None:
    blobs = [folder.read_encoded(i)[0] for i in range(2)]
    cache = ImageCache(ImageCacheDecision("encoded", GiB, "test"), torch.device("cpu"), 2, "t")
    assert cache.decodes
    for index, data in enumerate(blobs):
        assert cache.keep(index, data)
    assert cache.complete and cache.get(1) == blobs[1]
    assert cache.stats()["budget"] == sum(map(len, blobs))  # settled to what it holds


def test_a_mode_is_required() -> None:
    with pytest.raises(ValueError, match="decoded"):
        ImageCache(ImageCacheDecision("none", 0, ""), torch.device("cpu"), 1, "t")
