"""Image folders through the image cache: same batches as decoding every epoch, fewer reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from equivalence import assert_same
from image_fixtures import CountingList, assert_close_epochs

import gpuload
from gpuload import transforms as T
from gpuload.datasets import ImageList, make_sample_image_folder

OPS = [T.RandomResizedCrop(24), T.RandomHorizontalFlip(), T.ToDtype(torch.float32), T.Normalize([0.5] * 3, [0.25] * 3)]


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> list[tuple[str, int]]:
    folder = make_sample_image_folder(tmp_path_factory.mktemp("images"), num_images=14, num_classes=3, seed=3)
    return list(folder.samples)


def loader(source, cache: str, **keywords):
    return gpuload.DataLoader(source, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(11),
                              device="cpu", transforms=OPS, cache=cache, **keywords)


def epochs(source_loader, count: int = 3) -> list[list]:
    return [list(source_loader) for _ in range(count)]


@pytest.mark.parametrize("mode", ["device", "host"])
def test_cached_epochs_give_the_batches_of_uncached_ones(samples, mode: str) -> None:
    source = CountingList(samples)
    cached = loader(source, mode)
    ours = epochs(cached)
    reference = epochs(loader(ImageList(samples), "off"))
    if mode == "host":
        for a, b in zip(ours, reference):  # encoded bytes, decoded as before: identical
            for x, y in zip(a, b):
                assert_same(x, y)
    else:
        assert_close_epochs(ours, reference)
    assert source.reads == len(samples)  # each file read once, in the first epoch
    cache = cached.stats.extra["cache"]
    assert cache["complete"] and cache["mode"] == ("decoded" if mode == "device" else "encoded")
    assert cached.stats.path == f"image-cache ({cache['mode']})"


def test_a_decoded_cache_holds_whole_images_not_crops(samples) -> None:
    cached = loader(CountingList(samples), "device")
    list(cached)
    whole = sum(ImageList(samples)[index][0].numel() for index in range(len(samples)))
    assert cached.stats.extra["cache"]["bytes"] == whole  # not 14 crops of 24 x 24


def test_a_partial_cache_reads_only_what_it_lacks(samples) -> None:
    source = CountingList(samples)
    image_bytes = source[0][0].numel()
    source.reads = 0
    partial = loader(source, "device", cache_size=int(image_bytes * 4.5))
    ours = epochs(partial, 2)
    held = partial.stats.extra["cache"]["entries"]
    assert 0 < held < len(samples)
    assert source.reads == len(samples) + (len(samples) - held)
    assert_close_epochs(ours, epochs(loader(ImageList(samples), "off"), 2))


@pytest.mark.parametrize("mode, keeps", [("device", "decoded"), ("host", "encoded")])
def test_warm_fills_the_cache_before_the_first_epoch(samples, mode: str, keeps: str) -> None:
    source = CountingList(samples)
    warmed = loader(source, mode)
    stats = warmed.warm(progress=False)
    assert stats.extra["cache"]["complete"] and stats.extra["cache"]["mode"] == keeps
    assert source.reads == len(samples)
    ours = epochs(warmed, 2)
    assert source.reads == len(samples)
    assert_close_epochs(ours, epochs(loader(ImageList(samples), "off"), 2))


def test_auto_on_a_cpu_device_decodes_every_epoch(samples) -> None:
    source = CountingList(samples)
    plain = loader(source, "auto")
    epochs(plain, 2)
    assert source.reads == 2 * len(samples)
    assert plain.stats.extra["image_cache_decision"].startswith("none")
    assert plain.stats.path == "image-decode"


def test_a_bad_file_is_never_cached_and_skipped_every_epoch(samples, tmp_path: Path) -> None:
    broken = list(samples)
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(Path(broken[2][0]).read_bytes()[:300])
    broken[2] = (str(bad), broken[2][1])
    skipping = gpuload.DataLoader(ImageList(broken), batch_size=4, device="cpu", transforms=OPS,
                                  cache="device", on_error="skip")
    for _ in range(2):
        assert sum(len(labels) for _, labels in skipping) == len(broken) - 1
    assert skipping.stats.extra["skipped"] == 2
    cache = skipping.stats.extra["cache"]
    assert cache["entries"] == len(broken) - 1 and not cache["complete"]  # the bad file is not in it


def test_unbatched_images_from_the_cache_are_the_loops_own(samples) -> None:
    plain = gpuload.DataLoader(ImageList(samples), batch_size=None, device="cpu", cache="device")
    for image, _ in plain:
        image.zero_()
    for index, (image, _) in enumerate(plain):
        assert torch.equal(image, ImageList(samples)[index][0])


def test_close_gives_the_cache_back(samples) -> None:
    cached = loader(ImageList(samples), "device")
    list(cached)
    cached.close()
    released = cached.stats.extra["cache"]
    assert released["released"] and released["entries"] == 0 and released["bytes"] == 0
    assert len(list(cached)) == 4  # iterating again chooses a cache again


@pytest.mark.gpu
def test_decoded_images_stay_on_the_gpu(samples) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    ops = [T.RandomResizedCrop(24), T.ToDtype(torch.float16)]
    cached = gpuload.DataLoader(ImageList(samples), batch_size=4, device="cuda", transforms=ops)
    list(cached)
    assert cached.stats.extra["cache"]["mode"] == "decoded"
    assert cached.stats.extra["cache"]["complete"]
    images, _ = next(iter(cached))
    assert images.is_cuda and images.dtype == torch.float16
    cached.close()


def test_an_explicit_split_scope_on_one_rank_simply_caches_and_on_encoded_bytes_warns(samples, tmp_path: Path) -> None:
    """One rank holds the whole copy: node/world is the per-rank cache, silently. The encoded
    cache (cache='host') is never split over ranks: asking for it warns."""
    import warnings

    import torch.distributed as dist
    from torch.utils.data.distributed import DistributedSampler

    def on_one_rank(cache: str, scope: str) -> gpuload.DataLoader:
        data = ImageList(samples)
        return gpuload.DataLoader(data, batch_size=4, sampler=DistributedSampler(data, seed=11), device="cpu",
                                  transforms=OPS, cache=cache, cache_scope=scope)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            one = on_one_rank("device", "node")
            batches = epochs(one, 2)
        assert one.stats.path == "image-cache (decoded)" and one.stats.extra["cache"]["complete"]
        with pytest.warns(UserWarning, match="cache_scope='world'.*cache='host' keeps no device tier to split"):
            assert len(list(on_one_rank("host", "world"))) == 4
        reference = epochs(on_one_rank("off", "rank"), 2)
    finally:
        dist.destroy_process_group()
    assert_close_epochs(batches, reference)
