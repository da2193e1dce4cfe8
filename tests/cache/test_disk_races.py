"""The disk tier's race windows and error branches (gpuload/cache/disk/), each arranged
deterministically: a file damaged or removed between two calls, another user of the entry
(a second open in this process: its flocks exclude this one's as another process's do), an
OSError raised by a patched function. No sleeps."""

from __future__ import annotations

import errno
import fcntl
import gc
import json
import multiprocessing
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import gpuload.cache.disk.cache as opening
import gpuload.cache.disk.writing as writing
from gpuload.cache.disk import ColumnSpec, DiskCache, DiskCacheWarning, Fingerprint
from gpuload.cache.disk_tier import DiskImages, DiskRows
from gpuload.cache.settings import CacheSettings
from tests.cache.test_disk import (
    RAGGED_ROW,
    _data,
    _images,
    _open,
    _open_ragged,
    forge_block,
    no_room_for_the_manifest,
)


def _truncate(path: Path, size: int = 10) -> None:
    with open(path, "r+b") as file:
        file.truncate(size)


def _warnings(caught: list) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, DiskCacheWarning)]


def test_a_block_damaged_after_its_check_is_dropped_while_reading_and_filled_again(tmp_path: Path) -> None:
    images, labels = _data(16)
    cache = _open(tmp_path, 16)
    cache.write(torch.arange(16), [images, labels])  # published and checked by this process
    _truncate(cache.root / "block-000000.bin")  # damaged after the check, before the read
    assert cache.present(torch.arange(16)).all()  # checked blocks are not checked again
    with pytest.warns(DiskCacheWarning, match="block-000000.bin is 10 bytes"):
        with pytest.raises(LookupError, match="block 0 of the disk cache .* was dropped while reading"):
            cache.read(torch.arange(16))
    assert cache.present(torch.arange(16)).tolist() == [False] * 8 + [True] * 8
    assert cache.write(torch.arange(8), [images[:8], labels[:8]]) == 8
    assert torch.equal(cache.read(torch.arange(16))[0], images)
    cache.close()


def test_a_ragged_block_damaged_after_its_check_is_dropped_while_reading(tmp_path: Path) -> None:
    images = _images(8)
    cache = _open_ragged(tmp_path, 8)
    cache.write_items(torch.arange(8), images)
    _truncate(cache.root / "block-000001.bin")
    with pytest.warns(DiskCacheWarning, match="block-000001.bin is 10 bytes"):
        with pytest.raises(LookupError, match="block 1 of the disk cache .* was dropped while reading"):
            cache.read_items(torch.arange(8))
    assert cache.present(torch.arange(8)).tolist() == [True] * 4 + [False] * 4
    cache.write_items(torch.arange(8), images)
    assert all(torch.equal(a, b) for a, b in zip(cache.read_items(torch.arange(8)), images))
    cache.close()


class _Samples(torch.utils.data.Dataset):
    """Fixed-shape samples, deterministic."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), i, dtype=torch.int64)


def test_the_disk_tiers_read_a_block_dropped_meanwhile_as_absent(tmp_path: Path) -> None:
    from gpuload.cache.columns import prepare
    from gpuload.datasets import make_sample_image_folder

    settings = CacheSettings.resolve(cache_dir=tmp_path / "c", environ={}, cwd=tmp_path)
    dataset = _Samples()
    rows = DiskRows.open(dataset, settings)
    assert rows is not None
    keys = torch.arange(16)
    samples = prepare([dataset[i] for i in range(16)])
    assert rows.write(keys, samples) == 16
    assert rows.stats()["published_rows"] == 16  # published (behind the write) and checked
    (block,) = rows.disk.root.glob("block-*.bin")
    _truncate(block)
    with pytest.warns(DiskCacheWarning, match=f"{block.name} is 10 bytes"):
        assert rows.read(keys) is None  # the caller reads these samples from the dataset
    assert rows.write(keys, samples) == 16
    assert torch.equal(rows.read(keys).batch(), torch.stack([dataset[i] for i in range(16)]))
    rows.close()

    folder = make_sample_image_folder(tmp_path / "images", num_images=3, num_classes=1, seed=0)
    disk_images = DiskImages.open(folder, settings, {"backend": "test"})
    assert disk_images is not None
    pictures = [torch.zeros(3, 5 + k, 4, dtype=torch.uint8) for k in range(3)]
    assert disk_images.write([0, 1, 2], pictures) == 3 and disk_images.present([0, 1, 2]) == [True] * 3
    (block,) = disk_images.disk.root.glob("block-*.bin")
    _truncate(block)
    with pytest.warns(DiskCacheWarning, match=f"{block.name} is 10 bytes"):
        assert disk_images.read([0, 1, 2]) is None  # the caller decodes them again
    disk_images.disk.close()


def test_a_block_another_user_dropped_is_forgotten_at_the_next_look_at_the_manifest(tmp_path: Path) -> None:
    images, labels = _data(16)
    one = _open(tmp_path, 16)
    one.write(torch.arange(16), [images, labels])  # both blocks published and checked by `one`
    two = _open(tmp_path, 16)
    _truncate(one.root / "block-000000.bin")
    with pytest.warns(DiskCacheWarning, match="block-000000.bin is 10 bytes"):
        assert two.present(torch.arange(16)).tolist() == [False] * 8 + [True] * 8  # `two` drops it
    assert not one.complete  # `one` reads the new manifest ...
    assert one.present(torch.arange(16)).tolist() == [False] * 8 + [True] * 8  # ... and checks block 0 no more
    one.close()
    two.close()


def _lock_in_child(cache: DiskCache) -> None:
    """In a forked child while the parent holds the entry lock: the child's lock is its own
    (a flock on the inherited descriptor would be the parent's, granted at once)."""
    assert cache.present(torch.arange(8)).all()
    try:
        fcntl.flock(cache._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(0)
    sys.exit(3)


def _use_in_child(cache: DiskCache, images: torch.Tensor, labels: torch.Tensor) -> None:
    """In a forked child: read the published block, write and publish the other."""
    got = cache.read(torch.arange(8))
    written = cache.write(torch.arange(8, 16), [images[8:], labels[8:]])
    sys.exit(0 if torch.equal(got[0], images[:8]) and written == 8 and cache.complete else 1)


def _forked(target: Callable[..., None], *args: object) -> int | None:
    child = multiprocessing.get_context("fork").Process(target=target, args=args)
    child.start()
    child.join(timeout=120)
    return child.exitcode


def test_a_forked_process_uses_the_cache_it_inherited_through_its_own_files(tmp_path: Path) -> None:
    images, labels = _data(16)
    cache = _open(tmp_path, 16)
    cache.write(torch.arange(8), [images[:8], labels[:8]])
    with cache._entry_lock():
        assert _forked(_lock_in_child, cache) == 0
    assert _forked(_use_in_child, cache, images, labels) == 0
    assert cache.complete and torch.equal(cache.read(torch.arange(16))[1], labels)  # the child's block, published
    cache.close()


def test_a_ragged_block_too_short_for_its_row_table_is_named_and_refilled(tmp_path: Path) -> None:
    images = _images(4)
    cache = _open_ragged(tmp_path, 4)
    cache.write_items(torch.arange(4), images)
    cache.close()
    block, manifest_path = cache.root / "block-000000.bin", cache.root / "manifest.json"
    _truncate(block, 8)
    manifest = json.loads(manifest_path.read_bytes())
    manifest["blocks"] = [forge_block(block, block.read_bytes())]  # size and checksums agree with the file
    manifest_path.write_text(json.dumps(manifest))
    again = _open_ragged(tmp_path, 4)
    with pytest.warns(DiskCacheWarning, match="block-000000.bin is 8 bytes, too short for its table of 4 rows"):
        assert not again.present(torch.arange(4)).any()
    again.write_items(torch.arange(4), images)
    assert all(torch.equal(a, b) for a, b in zip(again.read_items(torch.arange(4)), images))
    again.close()


def test_a_drop_whose_manifest_cannot_be_written_stops_the_tier_once_and_reads_the_block_no_more(
    tmp_path: Path, monkeypatch,
) -> None:
    images, labels = _data(16)
    cache = _open(tmp_path, 16)
    cache.write(torch.arange(16), [images, labels])
    no_room_for_the_manifest(monkeypatch)
    _truncate(cache.root / "block-000000.bin")
    _truncate(cache.root / "block-000001.bin")
    with pytest.warns(DiskCacheWarning) as caught, pytest.raises(LookupError, match="block 0"):
        cache.read(torch.arange(16))
    assert len(_warnings(caught)) == 2
    assert "block-000000.bin is 10 bytes" in _warnings(caught)[0]
    assert "manifest.json failed (the disk is full); the disk tier stops growing" in _warnings(caught)[1]
    with pytest.warns(DiskCacheWarning) as caught, pytest.raises(LookupError, match="block 1"):
        cache.read(torch.arange(8, 16))  # a second failed drop: named, the tier is stopped already
    assert len(_warnings(caught)) == 1 and "block-000001.bin is 10 bytes" in _warnings(caught)[0]
    assert not cache.present(torch.arange(16)).any() and not cache.accepting
    cache.close()


def test_a_part_another_user_published_and_that_was_then_dropped_is_started_again(tmp_path: Path) -> None:
    images, labels = _data(8)
    one, two = _open(tmp_path, 8), _open(tmp_path, 8)
    assert one.write(torch.arange(4), [images[:4], labels[:4]]) == 4  # `one` holds the part open
    assert two.write(torch.arange(4, 8), [images[4:], labels[4:]]) == 4  # `two` completes and publishes it
    _truncate(two.root / "block-000000.bin")
    three = _open(tmp_path, 8)
    with pytest.warns(DiskCacheWarning, match="block-000000.bin is 10 bytes"):
        assert not three.present(torch.arange(8)).any()  # dropped: its rows are to be written again
    three.close()
    before = len(os.listdir("/proc/self/fd"))
    assert one.write(torch.arange(8), [images, labels]) == 8  # a new part, not the one `one` had open
    assert len(os.listdir("/proc/self/fd")) == before - 1  # the old part's descriptor is closed
    assert torch.equal(two.read(torch.arange(8))[0], images) and torch.equal(one.read(torch.arange(8))[1], labels)
    one.close()
    two.close()


def test_a_ragged_row_larger_than_the_room_left_marks_the_entry_full(tmp_path: Path) -> None:
    cache = _open_ragged(tmp_path, 8, budget=4 * RAGGED_ROW)  # room for one block of typical rows
    large = torch.zeros(3, 50, 50, dtype=torch.uint8)  # 7500 bytes: more than the block's 4800
    small = _images(2)
    assert cache.write_items(torch.tensor([0, 1, 2]), [small[0], large, small[1]]) == 1
    assert cache.stats().full and not cache.present(torch.arange(8)).any()
    cache.close()


def test_a_row_index_cut_short_stops_the_tier_naming_it(tmp_path: Path) -> None:
    images = _images(4)
    cache = _open_ragged(tmp_path, 4)
    cache.write_items(torch.tensor([1, 2, 3]), images[1:])
    _truncate(cache.root / "rows.index", 0)  # another program cut it: row 0's entry alone will be there
    with pytest.warns(DiskCacheWarning, match=r"writing .*rows.index failed \(rows.index is shorter than its rows\)"):
        cache.write_items(torch.tensor([0]), images[:1])
    assert not cache.present(torch.arange(4)).any() and not cache.accepting
    cache.close()


def test_an_entry_description_that_cannot_be_written_leaves_the_entry_usable(tmp_path: Path, monkeypatch) -> None:
    write = opening.atomic_write

    def no_room_for_the_description(path: Path, data: bytes) -> None:
        if path.name == "entry.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        write(path, data)

    monkeypatch.setattr(opening, "atomic_write", no_room_for_the_description)
    images, labels = _data(8)
    cache = _open(tmp_path, 8)  # no warning: the description is only for `gpuload cache ls`
    assert not (cache.root / "entry.json").exists()
    assert cache.write(torch.arange(8), [images, labels]) == 8 and torch.equal(cache.read(torch.arange(8))[0], images)
    cache.close()


def test_a_cache_whose_construction_failed_is_collected_silently(tmp_path: Path, monkeypatch) -> None:
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(IndexError):
        DiskCache(tmp_path, Fingerprint.of("arrays", "none", {}), (), 0, 0, 1, False)  # no column
    gc.collect()
    assert unraisable == []


def test_blocks_of_fixed_rows_always_have_bytes(tmp_path: Path) -> None:
    """A published block is never empty, so its checksum is always taken over its bytes: a
    record holds at least one byte (its alignment), even for columns of no bytes."""
    cache = DiskCache.open(tmp_path, Fingerprint.of("arrays", "empty rows", {}),
                           [ColumnSpec("nothing", torch.float64, (0,))], 4, 1 << 20, block_bytes=2 * 8)
    assert cache is not None and cache.record_bytes == 8 and cache.block_rows == 2
    assert cache.write(torch.arange(4), [torch.zeros(4, 0, dtype=torch.float64)]) == 4
    assert [size for size, _ in cache._manifest.blocks.values()] == [16, 16]
    assert cache.read(torch.arange(4))[0].shape == (4, 0)
    cache.close()



class _Killed(BaseException):
    """A process killed at a chosen point: nothing after it runs (not an OSError, which the
    cache handles), and closing the cache afterwards only releases its locks, as death does."""


def _killed_after(monkeypatch, name: str, when: Callable[[], bool] = lambda: True) -> None:
    """Make the writer's ``<name>`` die (raise _Killed) right after doing its work, when ``when()``."""
    real = getattr(writing, name)

    def dying(*args: object, **kwargs: object) -> object:
        result = real(*args, **kwargs)
        if when():
            raise _Killed(name)
        return result

    monkeypatch.setattr(writing, name, dying)


def test_two_crashes_around_a_block_never_publish_rows_nobody_wrote(tmp_path: Path, monkeypatch) -> None:
    """Job 1 dies after renaming block 0 to .bin, before the manifest lists it (its rows'
    flags stay set); job 2 dies after creating block 0's new .part. Another user keeps the
    entry open throughout, so no open discards what they left. Job 3 must write block 0's rows
    (the part's flags are clear) and publish them, not the part's zeros."""
    images, labels = _data(16)
    holder = _open(tmp_path, 16)  # e.g. another rank: no later open is the entry's only user
    job1 = _open(tmp_path, 16)
    with monkeypatch.context() as patch:
        _killed_after(patch, "fsync_folder", lambda: (job1.root / "block-000000.bin").exists())
        with pytest.raises(_Killed):
            job1.write(torch.arange(8), [images[:8], labels[:8]])
    job1.close()
    assert (holder.root / "block-000000.bin").exists() and not holder.complete  # renamed, not listed
    job2 = _open(tmp_path, 16)
    with monkeypatch.context() as patch:
        _killed_after(patch, "preallocate")  # block 0's new part is created (and sized)
        with pytest.raises(_Killed):
            job2.write(torch.arange(8), [images[:8], labels[:8]])
    job2.close()
    job3 = _open(tmp_path, 16)
    job3.write(torch.arange(16), [images, labels])
    assert job3.complete
    got_images, got_labels = job3.read(torch.arange(16))
    assert torch.equal(got_images, images) and torch.equal(got_labels, labels)
    for cache in (job3, holder):
        cache.close()


def _present_in_child(cache: DiskCache, warned: str = "") -> None:
    """No row present in a forked child, and one DiskCacheWarning saying ``warned`` if given."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        none = not cache.present(torch.arange(16)).any()
    said = _warnings(caught)
    sys.exit(0 if none and (len(said) == 1 and warned in said[0] if warned else not said) else 1)


def test_a_forked_process_with_a_closed_or_removed_entry_finds_no_rows(tmp_path: Path) -> None:
    images, labels = _data(16)
    closed = _open(tmp_path / "a", 16)
    closed.write(torch.arange(16), [images, labels])
    closed.close()
    assert _forked(_present_in_child, closed) == 0
    removed = _open(tmp_path / "b", 16)
    removed.write(torch.arange(16), [images, labels])
    shutil.rmtree(removed.root)  # its files gone: the child cannot open them, and says so
    assert _forked(_present_in_child, removed, "No such file or directory") == 0
    removed.close()


def _present_and_own_file_open(cache: DiskCache, fd: int) -> None:
    """The child asks the closed cache, then its own file (on a number the cache once had) is still open."""
    cache.present(torch.arange(16))
    try:
        os.fstat(fd)
    except OSError:
        sys.exit(1)
    sys.exit(0)


def test_a_forked_child_of_a_closed_cache_never_closes_a_file_that_took_its_numbers(tmp_path: Path) -> None:
    images, labels = _data(16)
    cache = _open(tmp_path, 16)
    cache.write(torch.arange(16), [images, labels])
    cache.close()
    reused = [os.open(tmp_path / f"other-{k}", os.O_CREAT | os.O_RDWR) for k in range(8)]  # the freed numbers
    try:
        assert all(_forked(_present_and_own_file_open, cache, fd) == 0 for fd in reused)
    finally:
        for fd in reused:
            os.close(fd)
