"""Published blocks checked ahead of their first read (gpuload/cache/disk/checking.py): a job
opening a filled entry takes the blocks' checksums on a background thread, hands each to the
reading thread, and a damaged block is still named, dropped and its rows read from the source."""

from __future__ import annotations

import multiprocessing
import threading
import warnings
import zlib
from pathlib import Path

import pytest
import torch

import gpuload
import gpuload.cache.disk.checking as checking
from gpuload.cache.disk import DiskCache, DiskCacheWarning
from tests.cache.test_disk import _data, _open
from tests.cache.test_disk_tier import Pictures, _same, _torch_epochs


def _filled(folder: Path, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = _data(n)
    with _open(folder, n) as cache:
        cache.write(torch.arange(n), [images, labels])
    return images, labels


def _checked(cache: DiskCache) -> DiskCache:
    """``cache`` once the background has checked what it queued at open."""
    cache._checks.wait()
    return cache


def _checkers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gpuload-disk-check"]


def test_a_later_open_checks_published_blocks_off_the_reading_thread(tmp_path: Path, monkeypatch) -> None:
    images, labels = _filled(tmp_path)
    threads: list[str] = []
    real = zlib.crc32

    def recorded(data, value=0):
        threads.append(threading.current_thread().name)
        return real(data, value)

    monkeypatch.setattr(zlib, "crc32", recorded)
    with _open(tmp_path, 16) as cache:
        _checked(cache)
        assert threads == ["gpuload-disk-check"] * 2  # both blocks, before any read
        assert bool(cache.present(torch.arange(16)).all())
        got = cache.read(torch.arange(16))
        assert torch.equal(got[0], images) and torch.equal(got[1], labels)
    assert threads == ["gpuload-disk-check"] * 2  # the reader took no checksum itself
    assert not _checkers()


def test_a_block_damaged_before_the_open_fails_its_background_check_and_is_named_and_refilled(tmp_path: Path) -> None:
    images, labels = _filled(tmp_path)
    (block,) = tmp_path.glob("*/block-000001.bin")
    raw = bytearray(block.read_bytes())
    raw[5] ^= 1
    block.write_bytes(bytes(raw))
    with _open(tmp_path, 16) as cache:
        _checked(cache)
        with pytest.warns(DiskCacheWarning, match="block-000001.bin fails its checksum"):
            assert cache.present(torch.arange(16)).tolist() == [True] * 8 + [False] * 8
        assert cache.write(torch.arange(8, 16), [images[8:], labels[8:]]) == 8
        assert torch.equal(cache.read(torch.arange(16))[0], images)
        assert cache.stats().blocks_dropped == 1


def _held_in_the_background(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Patch the checksum so the background thread stops inside its first block until ``hold``
    is set (``holding``: it is there)."""
    hold, holding = threading.Event(), threading.Event()
    real = checking.crc32

    def held(data, value=0):
        if threading.current_thread().name == "gpuload-disk-check":
            holding.set()
            hold.wait(60)
        return real(data, value)

    monkeypatch.setattr(checking, "crc32", held)
    return hold, holding


def test_the_reader_takes_a_block_the_background_has_not_reached(tmp_path: Path, monkeypatch) -> None:
    """The reader checks a block itself (taking it out of the queue) rather than wait behind others."""
    images, _ = _filled(tmp_path)
    hold, holding = _held_in_the_background(monkeypatch)
    with _open(tmp_path, 16) as cache:
        assert holding.wait(60)  # the background is inside block 0
        assert bool(cache.present(torch.arange(8, 16)).all())  # block 1: taken here, not queued behind block 0
        hold.set()
        assert torch.equal(cache.read(torch.arange(16))[0], images)
    assert not _checkers()


def _read_in_a_forked_child(cache: DiskCache, out) -> None:
    out.put(bool(cache.present(torch.arange(16)).all()))


def test_a_forked_child_checks_blocks_itself_the_parents_thread_is_not_in_it(tmp_path: Path, monkeypatch) -> None:
    """The parent's background is inside block 0 at the fork: the child, which has no such
    thread, must not wait for it."""
    _filled(tmp_path)
    hold, holding = _held_in_the_background(monkeypatch)
    with _open(tmp_path, 16) as cache:
        assert holding.wait(60)
        context = multiprocessing.get_context("fork")
        out = context.Queue()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
            child = context.Process(target=_read_in_a_forked_child, args=(cache, out))
            child.start()
        child.join(60)
        hold.set()
        assert child.exitcode == 0 and out.get(timeout=5) is True


def test_close_stops_and_joins_the_background_check(tmp_path: Path, monkeypatch) -> None:
    _filled(tmp_path)
    holding = threading.Event()
    real = checking.crc32

    def noted(data, value=0):
        holding.set()
        return real(data, value)

    monkeypatch.setattr(checking, "crc32", noted)
    cache = _open(tmp_path, 16)
    holding.wait(60)
    cache.close()
    assert not _checkers()


def test_a_block_damaged_between_two_jobs_is_named_and_its_batches_still_equal_torch(tmp_path: Path) -> None:
    """A later job finds the damage mid-epoch: the block is named once, its samples come from
    the dataset and every batch is torch's."""
    expected = _torch_epochs(Pictures(), 2)

    def loader(dataset: Pictures) -> gpuload.DataLoader:
        return gpuload.DataLoader(dataset, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(5),
                                  cache="host", cache_size=30 * (3 * 36 + 16), cache_dir=tmp_path / "c")

    first = loader(Pictures())
    list(first)
    first.close()
    blocks = sorted((tmp_path / "c").glob("*/block-*.bin"))
    assert blocks
    raw = bytearray(blocks[-1].read_bytes())
    raw[len(raw) // 2] ^= 0x10
    blocks[-1].write_bytes(bytes(raw))
    again = Pictures()
    later = loader(again)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [list(later) for _ in range(2)]
    named = [str(w.message) for w in caught if issubclass(w.category, DiskCacheWarning)]
    assert _same(got, expected)
    assert len(named) == 1 and blocks[-1].name in named[0] and "checksum" in named[0]
    assert again.reads > 1  # the damaged block's samples came from the dataset
    later.close()
    assert not _checkers()

