"""The disk tier's faults through the loader, each run in a new process (nothing in memory: what
a run reads, it reads from the folder; forked from the suite's fork server, or a fresh
interpreter for the read-only folder's namespace): a real-photo JPEG folder read by torchvision's
ImageFolder at 32x32, gpuload's sample cache with a 3-sample host tier and ``cache_dir=``,
blocks of 4 samples; every run's batches are compared with torch's DataLoader's (uncached)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from child_processes import Child, child_environment, results_of

import gpuload

N = 20
HANG_S = 900  # a run takes seconds quiet, a minute at load 10: past this it hangs

#: A run of the loader (and its reference): see its docstring.
CHILD_SCRIPT = Path(__file__).resolve().parent / "disk_tier_child.py"
CHILD = CHILD_SCRIPT.read_text()


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("photos")
    gpuload.datasets.make_sample_image_folder(root, num_images=N, num_classes=2, seed=0)
    return root


def _command(images: Path, cache: Path, mode: str = "fill") -> list[str]:
    return [sys.executable, "-c", CHILD, str(images), str(cache), mode]


def _child(images: Path, cache: Path, mode: str) -> Child:
    """One run of :data:`CHILD_SCRIPT` on ``images`` and ``cache``, started now as a new process
    forked from the suite's fork server (torch and gpuload imported, nothing of an earlier run in
    memory), in :func:`child_environment`; its stdout and stderr kept in files beside ``cache``."""
    return Child([str(images), str(cache), mode], child_environment(), cache.parent / "children", mode,
                 script=CHILD_SCRIPT)


def _run(images: Path, cache: Path, mode: str = "fill") -> dict:
    return _child(images, cache, mode).result(HANG_S)


def _run_together(images: Path, cache: Path, modes: list[str]) -> list[dict]:
    """One child per mode, all started at once; their results."""
    return results_of([_child(images, cache, mode) for mode in modes], HANG_S)


def _entries(cache: Path) -> list[Path]:
    return [p for p in cache.iterdir() if p.is_dir()] if cache.exists() else []


def test_killed_during_the_fill_then_a_new_run_gives_the_uncached_batches(images: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    child = _child(images, cache, "slow")
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and not list(cache.glob("*/block-*.part")):
            assert child.process.exitcode is None, child.err.read_text()
            time.sleep(0.02)
        time.sleep(0.3)  # a few rows into the fill
        assert child.process.exitcode is None, "the fill ended before it could be killed"
    finally:
        child.kill()
    assert child.process.exitcode == -signal.SIGKILL
    (entry,) = _entries(cache)
    assert list(entry.glob("block-*.part"))  # killed mid-fill: unpublished parts left behind
    result = _run(images, cache)
    assert result["equal"] and result["warnings"] == []
    assert result["disk"]["published_rows"] == N and not list(entry.glob("block-*.part"))


def test_a_truncated_or_garbage_block_is_named_refilled_and_the_batches_stay_right(images: Path,
                                                                                  tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _run(images, cache)
    assert first["equal"] and first["disk"]["published_rows"] == N and first["warnings"] == []
    (entry,) = _entries(cache)
    truncated, garbage = entry / "block-000001.bin", entry / "block-000003.bin"
    truncated.write_bytes(truncated.read_bytes()[:100])
    garbage.write_bytes(os.urandom(garbage.stat().st_size))
    second = _run(images, cache)
    assert second["equal"] and second["disk"]["blocks_dropped"] == 2
    assert len(second["warnings"]) == 2
    assert any(str(truncated) in w for w in second["warnings"]) and any(str(garbage) in w for w in second["warnings"])
    assert second["disk"]["rows_written"] == 8  # the two blocks, filled again from the files
    third = _run(images, cache)
    assert third["equal"] and third["warnings"] == [] and third["disk"]["rows_written"] == 0


def test_a_dataset_file_changed_after_the_fill_changes_the_fingerprint(images: Path, tmp_path: Path) -> None:
    from PIL import Image

    copy = tmp_path / "photos"
    shutil.copytree(images, copy)
    cache = tmp_path / "cache"
    assert _run(copy, cache)["equal"]
    changed = sorted(copy.glob("*/*.jpg"))[3]
    with Image.open(changed) as image:
        image.rotate(90, expand=True).save(changed, quality=90)
    result = _run(copy, cache)  # the reference reads the changed file too: stale pixels would differ
    assert result["equal"] and len(_entries(cache)) == 2 and result["disk"]["rows_written"] == N


def test_two_processes_on_an_empty_folder_make_one_copy_and_both_are_right(images: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    results = _run_together(images, cache, ["fill", "fill"])
    assert all(r["equal"] and r["warnings"] == [] for r in results)
    (entry,) = _entries(cache)
    assert sum(r["disk"]["rows_written"] for r in results) == N  # each row written once, by one of them
    assert len(list(entry.glob("block-*.bin"))) == N // 4


def test_a_nodes_ranks_share_one_copy_each_writing_its_share(images: Path, tmp_path: Path) -> None:
    """Two ranks of a node (torch's DistributedSampler, 2 replicas) on one cache_dir: one entry,
    each row written once by whichever rank read it first, both ranks' batches right."""
    cache = tmp_path / "cache"
    results = _run_together(images, cache, ["rank0", "rank1"])
    assert all(r["equal"] and r["warnings"] == [] for r in results)
    (entry,) = _entries(cache)
    assert sum(r["disk"]["rows_written"] for r in results) == N
    assert len(list(entry.glob("block-*.bin"))) == N // 4


def test_a_full_disk_stops_the_tier_with_one_warning_and_the_epoch_completes(images: Path, tmp_path: Path) -> None:
    result = _run(images, tmp_path / "cache", "enospc")
    assert result["equal"] and len(result["warnings"]) == 1 and "the disk is full" in result["warnings"][0]
    # Two blocks' files were made before the disk "filled"; shuffled rows may not complete them.
    assert result["disk"]["full"] and result["disk"]["stopped"] and result["disk"]["published_rows"] in (0, 4, 8)


def test_a_read_only_folder_is_one_warning_and_no_disk_tier(images: Path, tmp_path: Path) -> None:
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs `unshare -rm` (a user and mount namespace) to mount a read-only tmpfs")
    cache = tmp_path / "cache"
    cache.mkdir()
    fill, again = (" ".join(f"'{part}'" for part in _command(images, cache)[3:]),) * 2
    script = (f'mount -t tmpfs tmpfs "$0" && "$1" -c "$2" {fill} && mount -o remount,ro "$0" && '
              f'exec "$1" -c "$2" {again}')
    done = subprocess.run([unshare, "-rm", "sh", "-c", script, str(cache), sys.executable, CHILD],
                          capture_output=True, text=True, env=child_environment(), timeout=900)
    assert done.returncode == 0, done.stderr
    filled, read_only = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert filled["equal"] and filled["disk"]["published_rows"] == N
    assert read_only["equal"] and read_only["disk"] is None and len(read_only["warnings"]) == 1
    assert "Read-only file system" in read_only["warnings"][0] and "without a disk tier" in read_only["warnings"][0]
