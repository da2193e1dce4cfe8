"""reserved_bytes: what torch's CUDA caching allocator takes for one tensor, as the caches count it."""

from __future__ import annotations

import pytest
import torch

from gpuload.cache.allocator import reserved_bytes
from gpuload.cache.budget import BudgetLedger
from gpuload.cache.sample_store import SampleStore

MiB = 1 << 20
IMAGENET = 3 * 400 * 350  # an ImageNet image decoded at its own size, uint8: 420,000 bytes


@pytest.mark.parametrize("nbytes, reserved", [
    (0, 0),
    (8, 512),  # a scalar's block: 512 bytes, 4096 of them to a 2 MiB segment
    (512, 512),
    (IMAGENET, 2 * MiB // 4),  # 420,352 rounded; four to a segment, the tail (415,744) too small for a fifth
    (3 * 224 * 224, -(-2 * MiB // 13)),  # 150,528 bytes: thirteen to a segment
    (MiB, MiB),  # the largest small request: two to a segment
    (3 * 800 * 600, -(-20 * MiB // 14)),  # 1.44 MB: fourteen to a 20 MiB segment
    (10 * MiB, 10 * MiB),  # a segment of its own
    (10 * MiB + 1, 12 * MiB),  # rounded to 2 MiB
])
def test_reserved_bytes_are_the_block_and_its_share_of_the_segment(nbytes: int, reserved: int) -> None:
    assert reserved_bytes(nbytes) == reserved


def test_decoded_images_kept_one_tensor_each_on_a_device_count_what_the_allocator_takes() -> None:
    """Issue #34 (also-check): an image cache on a device counted each image by its size, 25%
    short of what the allocator reserves for ImageNet-sized images, so a budget of N bytes took
    1.25 N. META stands in for CUDA (the count is arithmetic); host memory counts sizes."""
    image = torch.zeros(3, 400, 350, dtype=torch.uint8)
    ledger = BudgetLedger()
    on_device = SampleStore(16 * (2 * MiB // 4 + 8), "meta", ledger=ledger, owner="images")
    kept = sum(on_device.keep(i, (image, i)) for i in range(20))
    assert kept == 16 and on_device.full  # four images to each 2 MiB segment
    assert on_device.stats.bytes == ledger.used("meta") == 16 * (2 * MiB // 4 + 8)
    on_host = SampleStore(1 << 30)
    on_host.keep(0, (image, 0))
    assert on_host.stats.bytes == IMAGENET + 8
    on_device.close()
    on_host.close()


@pytest.mark.gpu
def test_an_image_cache_on_cuda_counts_at_least_what_the_allocator_reserves_for_it(record_property) -> None:
    """The count against torch's own statistics: 400 images of ImageNet-like sizes (3 x 300..500
    x 300..400 uint8, one tensor each) kept on the device. The count must not fall short of
    the growth of reserved memory (2% slack for the segments other tests left partly used) nor
    exceed it by more than a third; both numbers are recorded for the device check's report."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    generator = torch.Generator().manual_seed(0)
    heights = torch.randint(300, 501, (400,), generator=generator).tolist()
    widths = torch.randint(300, 401, (400,), generator=generator).tolist()
    images = [torch.zeros(3, h, w, dtype=torch.uint8) for h, w in zip(heights, widths)]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_stats()["reserved_bytes.all.current"]
    cache = SampleStore(1 << 40, "cuda", ledger=BudgetLedger(), owner="images")
    assert all(cache.keep(i, image) for i, image in enumerate(images))
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_stats()["reserved_bytes.all.current"] - before
    counted, sizes = cache.stats.bytes, sum(image.numel() for image in images)
    record_property("image_cache_sizes_bytes", sizes)
    record_property("image_cache_counted_bytes", counted)
    record_property("image_cache_reserved_bytes", reserved)
    assert counted >= 0.98 * reserved, f"counted {counted} of {reserved} reserved (sizes {sizes})"
    assert counted <= 1.34 * reserved, f"counted {counted}, reserved only {reserved} (sizes {sizes})"
    cache.close()
