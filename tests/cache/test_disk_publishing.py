"""Blocks published behind the loop (gpuload/cache/disk/publishing.py): a write returns once its
rows are in their parts; the fsync, checksum, rename and manifest of a complete block happen on
the publishing thread, at most PENDING_BLOCKS waiting; a reader waits for this process's own
queued blocks; close and interpreter exit publish what is queued; a failure is said in the
caller's thread and leaves the block unpublished; a crash mid-publication leaves nothing read."""

from __future__ import annotations

import errno
import json
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import gpuload
import gpuload.cache.disk.publishing as publishing
import gpuload.cache.disk.writing as writing
from gpuload.cache.disk import ColumnSpec, DiskCache, DiskCacheWarning, Fingerprint
from tests.cache.test_disk import (
    BLOCK_ROWS,
    CHILD,
    HANG_S,
    RECORD,
    SHAPE,
    _child,
    _data,
    _environment,
    _open,
    _start,
)
from tests.cache.test_disk_tier import Pictures, _same, _torch_epochs

PUBLISHER = "gpuload-disk-publish"
OPEN_BEHIND = f"""
def open_behind():
    return DiskCache.open(FOLDER, FP, COLUMNS, N, 1 << 30, block_bytes={BLOCK_ROWS * RECORD}, publish_behind=True)
"""


def _fresh_child(script: str, folder: Path, n: int) -> Any:
    """test_disk's ``_child`` in a fresh interpreter (``python -c``), which exits as Python does
    (non-daemon threads joined, then atexit's functions, then finalization); a forked child ends
    by calling atexit's functions itself (child_processes.start_script)."""
    command = [sys.executable, "-c", CHILD + textwrap.dedent(script), str(folder), str(n)]
    done = subprocess.run(command, capture_output=True, text=True, env=_environment(), timeout=HANG_S)
    assert done.returncode == 0, f"child failed ({done.returncode}):\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _behind(folder: Path, n: int) -> DiskCache:
    """test_disk's ``_open`` (the same entry), publishing behind."""
    cache = DiskCache.open(folder, Fingerprint.of("arrays", "test rows", {"seed": 0, "rows": n}),
                           [ColumnSpec("image", torch.uint8, SHAPE), ColumnSpec("label", torch.int64, ())], n,
                           1 << 30, block_bytes=BLOCK_ROWS * RECORD, publish_behind=True)
    assert cache is not None
    return cache


def _publishers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == PUBLISHER]


def _only_on_the_publisher(monkeypatch, name: str, held: threading.Event | None = None,
                           refuse: bool = True) -> list[str]:
    """Patch ``writing.os.<name>``: record the calling thread; refuse any other thread (when
    ``refuse``); wait for ``held`` (when given) on the publisher's."""
    calls: list[str] = []
    real = getattr(writing.os, name)

    def recorded(*args, **kwargs):
        thread = threading.current_thread().name
        calls.append(thread)
        if thread != PUBLISHER:
            if not refuse:
                return real(*args, **kwargs)
            raise AssertionError(f"os.{name} in the writing thread ({thread})")
        if held is not None:
            assert held.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(writing.os, name, recorded)
    return calls


def test_a_write_returns_before_its_block_is_fsynced_and_checksummed(tmp_path: Path, monkeypatch) -> None:
    images, labels = _data(16)
    release = threading.Event()
    with _behind(tmp_path, 16) as cache:
        fsyncs = _only_on_the_publisher(monkeypatch, "fsync", release)
        assert cache.write(torch.arange(16), [images, labels]) == 16  # returns while block 0 is held
        assert not (cache.root / "block-000000.bin").exists()
        release.set()
        assert bool(cache.present(torch.arange(16)).all())  # waits for its own queued blocks
        assert torch.equal(cache.read(torch.arange(16))[0], images)
        assert cache.stats().blocks_published == 2 and cache.complete
    assert fsyncs and set(fsyncs) == {PUBLISHER}
    assert not _publishers()


def test_at_most_pending_blocks_wait_then_the_writer_waits(tmp_path: Path, monkeypatch) -> None:
    n = 8 * BLOCK_ROWS
    images, labels = _data(n)
    release, queued = threading.Event(), []
    real_queue = publishing.BlockPublisher.queue

    def noted(self, block, size, inode):
        real_queue(self, block, size, inode)
        queued.append(self.pending)

    monkeypatch.setattr(publishing.BlockPublisher, "queue", noted)
    cache = _behind(tmp_path, n)
    _only_on_the_publisher(monkeypatch, "fsync", release)

    def fill() -> None:
        for block in range(8):
            rows = torch.arange(block * BLOCK_ROWS, (block + 1) * BLOCK_ROWS)
            cache.write(rows, [images[rows], labels[rows]])

    writer = threading.Thread(target=fill)
    writer.start()
    writer.join(1.0)
    assert writer.is_alive()  # held: the fifth block waits for room (it would never finish otherwise)
    assert max(queued) <= publishing.PENDING_BLOCKS
    release.set()
    writer.join(60)
    assert not writer.is_alive() and max(queued) <= publishing.PENDING_BLOCKS
    assert cache.complete and torch.equal(cache.read(torch.arange(n))[0], images)
    cache.close()
    assert not _publishers()


def test_close_publishes_what_is_queued_and_joins_the_thread(tmp_path: Path, monkeypatch) -> None:
    images, labels = _data(16)
    release = threading.Event()
    cache = _behind(tmp_path, 16)
    _only_on_the_publisher(monkeypatch, "fsync", release)
    cache.write(torch.arange(16), [images, labels])
    threading.Timer(0.05, release.set).start()  # close waits for it either way
    cache.close()
    assert not _publishers()
    monkeypatch.undo()
    with _open(tmp_path, 16) as again:
        assert bool(again.present(torch.arange(16)).all()) and again.stats().rows_written == 0


def test_a_failed_publication_is_said_in_the_callers_thread_and_leaves_the_block_unpublished(
        tmp_path: Path, monkeypatch) -> None:
    images, labels = _data(16)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(args[0]))

    with _behind(tmp_path, 16) as cache:
        monkeypatch.setattr(writing.os, "rename", no_space)
        assert cache.write(torch.arange(8), [images[:8], labels[:8]]) == 8  # the failure comes later
        with pytest.warns(DiskCacheWarning, match=r"block-000000.part failed \(the disk is full\)"):
            assert not bool(cache.present(torch.arange(8)).any())
        assert cache.stats().full and not cache.accepting
    monkeypatch.undo()
    with _open(tmp_path, 16) as again:  # the next job: nothing of block 0 published, filled again
        assert not bool(again.present(torch.arange(16)).any())
        assert again.write(torch.arange(16), [images, labels]) == 16
        assert torch.equal(again.read(torch.arange(16))[0], images)


def test_an_unexpected_error_while_publishing_is_raised_in_the_callers_thread(tmp_path: Path, monkeypatch) -> None:
    images, labels = _data(8)

    def broken(*args, **kwargs):
        raise ValueError("a bug")

    with _behind(tmp_path, 8) as cache:
        monkeypatch.setattr(writing, "stripe_sums", broken)
        cache.write(torch.arange(8), [images, labels])
        with pytest.raises(RuntimeError, match="publishing a block of .* failed: ValueError") as raised:
            cache.present(torch.arange(8))
        assert isinstance(raised.value.__cause__, ValueError)
        monkeypatch.undo()
        assert not bool(cache.present(torch.arange(8)).any())


def test_blocks_queued_at_interpreter_exit_are_published(tmp_path: Path) -> None:
    n = 32
    _fresh_child(
        OPEN_BEHIND + textwrap.dedent("""
        from gpuload.cache.disk import writing
        real = writing.os.fsync
        def slow(fd):
            time.sleep(0.01)  # still queued when the script ends
            return real(fd)
        writing.os.fsync = slow
        cache = open_behind()
        cache.write(torch.arange(N), [images, labels])
        print(json.dumps(0))  # no close: the interpreter exits with blocks queued
        """),
        tmp_path, n,
    )
    assert _child("cache = open_cache(); print(json.dumps(bool(cache.present(torch.arange(N)).all())))",
                  tmp_path, n) is True


def test_killed_while_publishing_the_block_is_not_read_and_is_filled_again(tmp_path: Path) -> None:
    n = 32
    crashed = _start(
        OPEN_BEHIND + textwrap.dedent("""
        import signal, threading
        from gpuload.cache.disk import writing
        real = writing.os.rename
        def crash_on_third(*args):
            if str(args[0]).endswith("block-000002.part"):
                os.kill(os.getpid(), signal.SIGKILL)  # fsync'ed and checksummed, not renamed
            return real(*args)
        writing.os.rename = crash_on_third
        cache = open_behind()
        cache.write(torch.arange(N), [images, labels])
        cache.close()
        """),
        tmp_path, n,
    )
    assert crashed.wait(HANG_S) == -signal.SIGKILL, crashed.err.read_text()
    result = _child(
        """
        cache = open_cache()
        present = cache.present(torch.arange(N)).numpy()
        print(json.dumps({"missing": np.flatnonzero(~present).tolist(), "same": epoch(cache, list(range(N))),
                          "complete": cache.complete}))
        """,
        tmp_path, n,
    )
    assert result == {"missing": list(range(16, 32)), "same": True, "complete": True}  # 2 and the one queued after it


def test_a_loop_broken_early_leaves_no_thread_and_the_next_job_reads_torchs_batches(tmp_path: Path) -> None:
    expected = _torch_epochs(Pictures(), 1)

    def loader() -> gpuload.DataLoader:
        return gpuload.DataLoader(Pictures(), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(5),
                                  cache="host", cache_size=30 * (3 * 36 + 16), cache_dir=tmp_path / "c")

    first = loader()
    for k, _ in enumerate(first):
        if k == 4:
            break
    first.close()
    assert not _publishers()
    later = loader()
    assert _same([list(later)], expected)
    later.close()
    assert not _publishers()


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_filling_the_disk_tier_never_waits_for_a_publication(tmp_path: Path, monkeypatch, workers) -> None:
    """Publication held until after the epoch: the epoch ends anyway (with workers, the loader
    asks the tier whether it still takes samples after every batch), then the block is published."""
    expected = _torch_epochs(Pictures(), 1)
    release = threading.Event()
    timer = threading.Timer(120, release.set)  # a loop that waited would end here and fail below
    timer.start()
    _only_on_the_publisher(monkeypatch, "fsync", release, refuse=False)  # the open's entry.json: in the loop
    loader = gpuload.DataLoader(Pictures(), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(5),
                                num_workers=workers, cache="host", cache_size=30 * (3 * 36 + 16),
                                cache_dir=tmp_path / "c")
    try:
        got = [list(loader)]
        assert not release.is_set()  # the epoch did not wait for the held fsync
        release.set()
        assert _same(got, expected)
        assert loader.stats.extra["cache"]["disk"]["published_rows"] == 120
    finally:
        release.set()
        timer.cancel()
        loader.close()
    assert not _publishers()
