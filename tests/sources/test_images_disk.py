"""gpuload's own image source with ``cache_dir=``: whole decoded images the image cache cannot
hold go to the disk tier in the first epoch and come back from it (not from their files) in
later epochs and later loaders; damage is named and refilled; changed files are never read
stale. Real photos (``make_sample_image_folder``), a host cache of 4 of its 14 images, blocks
of 4 images."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from child_processes import child_environment
from equivalence import assert_same
from full_disk import filling_up
from image_fixtures import CountingList, assert_close_epochs

import gpuload
import gpuload.cache.disk as disk_module
import gpuload.cache.disk.writing as disk_writing
import gpuload.cache.disk_tier as disk_tier
from gpuload import transforms as T
from gpuload.cache.disk import DiskCacheWarning
from gpuload.cache.probe import estimate_image_bytes
from gpuload.datasets import ImageList, make_sample_image_folder

ROOT = Path(__file__).resolve().parents[2]
OPS = [T.RandomResizedCrop(24), T.RandomHorizontalFlip(), T.ToDtype(torch.float32), T.Normalize([0.5] * 3, [0.25] * 3)]
N = 14


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> list[tuple[str, int]]:
    folder = make_sample_image_folder(tmp_path_factory.mktemp("images"), num_images=N, num_classes=3, seed=3)
    return list(folder.samples)


@pytest.fixture(autouse=True)
def small_blocks(samples, monkeypatch) -> None:
    """Blocks of about 4 images (the entry's rows per block follow the estimated image size)."""
    decoded, _ = estimate_image_bytes(ImageList(samples))
    monkeypatch.setattr(disk_tier, "BLOCK_BYTES", decoded // N * 4)


def image_bytes(samples) -> int:
    return ImageList(samples)[0][0].numel()


def loader(source, samples, transforms=OPS, **keywords):
    # Without transforms, one image at a time: the photos differ in size.
    return gpuload.DataLoader(source, batch_size=4 if transforms else None, shuffle=True,
                              generator=torch.Generator().manual_seed(11),
                              device="cpu", transforms=transforms, cache="device",
                              cache_size=int(image_bytes(samples) * 4.5), **keywords)


def epochs(source_loader, count: int) -> list[list]:
    return [list(source_loader) for _ in range(count)]


def disk_stats(source_loader) -> dict:
    return source_loader.stats.extra["cache"]["disk"]


def test_images_the_host_cache_lacks_come_from_disk_with_the_batches_of_a_run_without_it(samples, tmp_path) -> None:
    source = CountingList(samples)
    spilling = loader(source, samples, cache_dir=tmp_path / "c")
    ours = epochs(spilling, 3)
    assert source.reads == N  # each file read once: later epochs read the images the cache lacks from disk
    held = spilling.stats.extra["cache"]["entries"]
    assert 0 < held < N
    disk = disk_stats(spilling)
    assert disk["published_rows"] == N and disk["hits"] == 2 * (N - held) and disk["blocks_published"] == 4
    assert_close_epochs(ours, epochs(loader(ImageList(samples), samples), 3))


def test_without_transforms_batches_equal_a_run_without_cache_dir_exactly(samples, tmp_path) -> None:
    ours = epochs(loader(CountingList(samples), samples, transforms=None, cache_dir=tmp_path / "c"), 2)
    source = CountingList(samples)
    later = epochs(loader(source, samples, transforms=None, cache_dir=tmp_path / "c"), 1)
    assert source.reads == 0
    reference = epochs(loader(ImageList(samples), samples, transforms=None), 2)
    for a, b in zip([*ours, *later], [*reference, reference[0]], strict=True):
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)


def test_a_second_loader_reads_its_first_epoch_from_disk_not_the_files(samples, tmp_path) -> None:
    first = epochs(loader(CountingList(samples), samples, cache_dir=tmp_path / "c"), 1)
    source = CountingList(samples)
    second = loader(source, samples, cache_dir=tmp_path / "c")
    again = epochs(second, 2)
    assert source.reads == 0 and disk_stats(second)["rows_written"] == 0
    for x, y in zip(first[0], again[0], strict=True):  # both from whole decoded images: equal
        assert_same(x, y)


def test_a_new_process_reads_its_first_epoch_from_disk(samples, tmp_path) -> None:
    child = textwrap.dedent(
        """
        import json, sys, torch, gpuload
        import gpuload.cache.disk_tier as disk_tier
        from gpuload.datasets import ImageList

        samples, cache, block_bytes, cache_size = json.loads(sys.argv[1])
        disk_tier.BLOCK_BYTES = block_bytes
        opened = []
        class Counting(ImageList):
            def read_encoded(self, index):
                opened.append(index)
                return super().read_encoded(index)
        loader = gpuload.DataLoader(Counting([tuple(s) for s in samples]), batch_size=None, device="cpu",
                                    cache="device", cache_size=cache_size, cache_dir=cache)
        batches = [images.sum().item() for images, _ in loader]
        print(json.dumps({"opened": len(opened), "sums": batches, "disk": loader.stats.extra["cache"]["disk"]}))
        """
    )
    arguments = [samples, str(tmp_path / "c"), disk_tier.BLOCK_BYTES, int(image_bytes(samples) * 4.5)]
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", child, json.dumps(arguments)], capture_output=True, text=True,
                              env=child_environment(), timeout=600)
        assert done.returncode == 0, done.stderr
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    filled, reread = runs
    assert filled["opened"] == N and filled["disk"]["rows_written"] == N
    assert reread["opened"] == 0 and reread["disk"]["hits"] == N and reread["sums"] == filled["sums"]


def test_killed_during_the_fill_then_a_new_loader_gives_the_uncached_batches(samples, tmp_path, monkeypatch) -> None:
    import signal
    import time

    child = textwrap.dedent(
        """
        import json, sys, time, torch, gpuload
        import gpuload.cache.disk_tier as disk_tier
        from gpuload.datasets import ImageList

        samples, cache, block_bytes, cache_size = json.loads(sys.argv[1])
        disk_tier.BLOCK_BYTES = block_bytes
        read = ImageList.read_encoded
        def slow(self, index):  # the class itself patched: the fingerprint names it
            time.sleep(0.3)
            return read(self, index)
        ImageList.read_encoded = slow
        loader = gpuload.DataLoader(ImageList([tuple(s) for s in samples]), batch_size=None, device="cpu",
                                    cache="device", cache_size=cache_size, cache_dir=cache)
        for _ in loader:
            pass
        """
    )
    cache = tmp_path / "c"
    arguments = [samples, str(cache), disk_tier.BLOCK_BYTES, int(image_bytes(samples) * 4.5)]
    process = subprocess.Popen([sys.executable, "-c", child, json.dumps(arguments)], stderr=subprocess.PIPE,
                               env=child_environment())
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        entries = [p for p in cache.iterdir() if p.is_dir()] if cache.exists() else []
        if entries and list(entries[0].glob("block-*.bin")) and list(entries[0].glob("block-*.part")):
            break  # a block published, the next one half written
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, process.stderr.read()
    read, reads = ImageList.read_encoded, []
    monkeypatch.setattr(ImageList, "read_encoded", lambda self, index: reads.append(index) or read(self, index))
    ours = epochs(loader(ImageList(samples), samples, transforms=None, cache_dir=cache), 2)
    assert 0 < len(reads) < N  # the published block was read from disk, the half-written one from the files
    assert not list(cache.glob("*/block-*.part")) and _all_blocks_published(cache)
    monkeypatch.setattr(ImageList, "read_encoded", read)
    for a, b in zip(ours, epochs(loader(ImageList(samples), samples, transforms=None), 2), strict=True):
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)


def _all_blocks_published(cache: Path) -> bool:
    """Every block of the entry is published (the new loader finished the fill)."""
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    return len(json.loads((entry / "manifest.json").read_bytes())["blocks"]) == 4


def _block_files(cache: Path) -> list[Path]:
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    return sorted(entry.glob("block-*.bin"))


def test_a_corrupted_block_is_warned_naming_it_and_refilled(samples, tmp_path) -> None:
    cache = tmp_path / "c"
    first = epochs(loader(CountingList(samples), samples, transforms=None, cache_dir=cache), 1)
    damaged = _block_files(cache)[1]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 3] ^= 0xFF
    damaged.write_bytes(bytes(data))
    source = CountingList(samples)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        repaired = epochs(loader(source, samples, transforms=None, cache_dir=cache), 1)
    named = [str(w.message) for w in caught if issubclass(w.category, DiskCacheWarning)]
    assert len(named) == 1 and str(damaged) in named[0] and "checksum" in named[0]
    assert 0 < source.reads < N  # only the damaged block's images came from their files
    for x, y in zip(first[0], repaired[0], strict=True):
        assert_same(x, y)
    third = CountingList(samples)
    epochs(loader(third, samples, transforms=None, cache_dir=cache), 1)
    assert third.reads == 0  # the block was written again


def test_a_changed_image_file_changes_the_fingerprint_and_is_never_read_stale(samples, tmp_path) -> None:
    folder = tmp_path / "images"
    folder.mkdir()
    copied = []
    for k, (path, label) in enumerate(samples):
        target = folder / f"{k:02d}.jpg"
        target.write_bytes(Path(path).read_bytes())
        copied.append((str(target), label))
    cache = tmp_path / "c"
    epochs(loader(CountingList(copied), copied, transforms=None, cache_dir=cache), 1)
    before = disk_module.fingerprint_for(ImageList(copied), {"x": 1}).digest
    Path(copied[5][0]).write_bytes(Path(copied[6][0]).read_bytes())  # another photo, another size
    assert disk_module.fingerprint_for(ImageList(copied), {"x": 1}).digest != before
    source = CountingList(copied)
    changed = epochs(loader(source, copied, transforms=None, cache_dir=cache), 1)
    assert source.reads == N  # a new entry: nothing read from the old one
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 2
    for x, y in zip(changed[0], epochs(loader(ImageList(copied), copied, transforms=None), 1)[0], strict=True):
        assert_same(x, y)


def test_the_decoder_settings_are_part_of_the_entry(samples, tmp_path) -> None:
    cache = tmp_path / "c"
    epochs(loader(ImageList(samples), samples, transforms=None, cache_dir=cache), 1)
    epochs(loader(ImageList(samples), samples, cache_dir=cache), 1)  # transforms: images kept as HWC views
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 1 + (gpuload.decode.BatchDecoder("cpu").backend
                                                                     .startswith("dali"))


def test_a_full_disk_stops_the_tier_with_one_warning_and_the_epochs_complete(samples, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(disk_writing, "pwrite_all", filling_up(disk_writing.pwrite_all, calls_allowed=5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spilling = loader(CountingList(samples), samples, transforms=None, cache_dir=tmp_path / "c")
        ours = epochs(spilling, 2)
    named = [str(w.message) for w in caught if issubclass(w.category, DiskCacheWarning)]
    assert len(named) == 1 and "the disk is full" in named[0]
    assert disk_stats(spilling)["stopped"]
    for a, b in zip(ours, epochs(loader(ImageList(samples), samples, transforms=None), 2), strict=True):
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)


def test_a_disk_budget_bounds_the_entry_and_the_rest_comes_from_the_files(samples, tmp_path) -> None:
    budget = image_bytes(samples) * 8
    source = CountingList(samples)
    spilling = loader(source, samples, transforms=None, cache_dir=tmp_path / "c", disk_cache_size=budget)
    ours = epochs(spilling, 2)
    disk = disk_stats(spilling)
    assert disk["full"] and 0 < disk["published_bytes"] <= budget
    (entry,) = [p for p in (tmp_path / "c").iterdir() if p.is_dir()]
    assert sum(f.stat().st_size for f in entry.glob("block-*")) <= budget
    for a, b in zip(ours, epochs(loader(ImageList(samples), samples, transforms=None), 2), strict=True):
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)


def test_a_read_only_folder_is_one_warning_and_no_disk_tier(samples, tmp_path, monkeypatch) -> None:
    cache = tmp_path / "c"
    real = Path.mkdir

    def read_only(path, *args, **keywords):  # what a read-only mount answers (root ignores chmod)
        if str(path).startswith(str(cache)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, *args, **keywords)

    monkeypatch.setattr(Path, "mkdir", read_only)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = loader(ImageList(samples), samples, transforms=None, cache_dir=cache)
        ours = epochs(plain, 1)
    named = [str(w.message) for w in caught if issubclass(w.category, DiskCacheWarning)]
    assert len(named) == 1 and "Read-only file system" in named[0] and "without a disk tier" in named[0]
    assert "disk" not in plain.stats.extra["cache"]
    for x, y in zip(ours[0], epochs(loader(ImageList(samples), samples, transforms=None), 1)[0], strict=True):
        assert_same(x, y)


@pytest.mark.gpu
def test_on_cuda_images_from_disk_reach_the_device_and_a_new_loader_decodes_none(samples, tmp_path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: torch.cuda.is_available() is False here")

    def cuda_loader(source):
        return gpuload.DataLoader(source, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(11),
                                  device="cuda", transforms=OPS, cache="device",
                                  cache_size=int(image_bytes(samples) * 4.5), cache_dir=tmp_path / "c")

    first = epochs(cuda_loader(CountingList(samples)), 2)
    source = CountingList(samples)
    again = cuda_loader(source)
    later = epochs(again, 1)
    assert source.reads == 0 and disk_stats(again)["hits"] == N
    for (images, labels), (ref_images, ref_labels) in zip(later[0], first[0], strict=True):
        assert images.is_cuda and torch.equal(labels, ref_labels)
        torch.testing.assert_close(images, ref_images, atol=0.1, rtol=0)


def test_beside_an_encoded_bytes_cache_the_disk_tier_keeps_decoded_images(samples, tmp_path) -> None:
    def host_loader(source):
        return gpuload.DataLoader(source, batch_size=None, shuffle=True, generator=torch.Generator().manual_seed(11),
                                  device="cpu", cache="host", cache_dir=tmp_path / "c")

    first = epochs(host_loader(CountingList(samples)), 1)
    source = CountingList(samples)
    again = host_loader(source)
    later = epochs(again, 1)
    assert source.reads == 0 and again.stats.extra["cache"]["mode"] == "encoded"
    assert disk_stats(again)["hits"] == N
    for x, y in zip(first[0], later[0], strict=True):
        assert_same(x, y)


def test_a_shares_block_dropped_between_its_check_and_its_read_is_decoded_again(samples, tmp_path, monkeypatch) -> None:
    """A rank's share is read whole from the disk tier where published (``ImageReader.read_whole``);
    a block another process drops between the presence check and the read: all decoded again."""
    epochs(loader(CountingList(samples), samples, transforms=None, cache_dir=tmp_path / "c"), 1)  # published
    source = CountingList(samples)
    reading = loader(source, samples, transforms=None, cache_dir=tmp_path / "c")
    images = reading._source
    images.begin_epoch()  # decides: the image cache and the disk tier
    disk = images.disk
    present = disk.present

    def present_then_dropped(positions):
        found = present(positions)
        with pytest.warns(DiskCacheWarning, match="another process found it damaged"):
            disk.disk._drop(0, "another process found it damaged")
        return found

    monkeypatch.setattr(disk, "present", present_then_dropped)
    share = images.reader.read_whole([0, 1, 2, 3])
    assert share.positions == [0, 1, 2, 3] and not share.bad and source.reads == 4
    for position, image in zip(share.positions, share.images, strict=True):
        assert_same(image, ImageList(samples)[position][0])
