"""The disk tier's faults through the loader, each run in a subprocess (nothing in memory: what
a run reads, it reads from the folder): a real-photo JPEG folder read by torchvision's
ImageFolder at 32x32, gpuload's sample cache with a 3-sample host tier and ``cache_dir=``,
blocks of 4 samples; every run's batches are compared with torch's DataLoader's (uncached)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from child_processes import child_environment

import gpuload

ROOT = Path(__file__).resolve().parents[2]
N = 20

CHILD = textwrap.dedent(
    """
    import json, os, sys, time, warnings
    import torch, gpuload
    import gpuload.cache.disk_tier as disk_tier
    from gpuload.cache.disk import DiskCacheWarning
    from torchvision import datasets, transforms

    IMAGES, CACHE, MODE = sys.argv[1], sys.argv[2], sys.argv[3]
    ROW = 3 * 32 * 32 + 8  # a decoded image and its label
    disk_tier.BLOCK_BYTES = 4 * ROW

    class Folder(datasets.ImageFolder):
        delay = 0.0

        def __getitem__(self, index):
            time.sleep(self.delay)
            return super().__getitem__(index)

    def dataset(delay=0.0):
        folder = Folder(IMAGES, transform=transforms.Compose(
            [transforms.Resize(32), transforms.CenterCrop(32), transforms.PILToTensor()]))
        Folder.delay = delay  # the class's: an instance attribute is the dataset's state, part of its fingerprint
        return folder

    def batches(loader, epochs):
        got = []
        for epoch in range(epochs):
            if loader.sampler is not None and hasattr(loader.sampler, "set_epoch"):
                loader.sampler.set_epoch(epoch)
            got.append([(images.clone(), labels.clone()) for images, labels in loader])
        return got

    def order(data):
        # A rank's share (rank0, rank1: torch's DistributedSampler of 2), else shuffled.
        if MODE.startswith("rank"):
            sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=int(MODE[4]), seed=0)
            return {"sampler": sampler}
        return {"shuffle": True, "generator": torch.Generator().manual_seed(2)}

    def same(a, b):
        return len(a) == len(b) and all(
            len(x) == len(y) and all(torch.equal(i, j) and torch.equal(k, l) for (i, k), (j, l) in zip(x, y))
            for x, y in zip(a, b))

    def run(epochs=2, delay=0.0):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            data = dataset(delay)
            loader = gpuload.DataLoader(data, batch_size=5, cache="host", cache_size=3 * ROW, cache_dir=CACHE,
                                        **order(data))
            got = batches(loader, epochs)
            if MODE.startswith("rank"):  # both ranks keep the entry open until both are done, as a job's do
                done = os.path.join(os.path.dirname(CACHE), "done-")
                open(done + MODE, "w").close()
                deadline = time.monotonic() + 120
                while not os.path.exists(done + ("rank1" if MODE == "rank0" else "rank0")):
                    assert time.monotonic() < deadline, "the other rank never finished"
                    time.sleep(0.05)
        reference = torch.utils.data.DataLoader(dataset(), batch_size=5, **order(data))
        return {"equal": same(got, batches(reference, epochs)), "disk": loader.stats.extra["cache"].get("disk"),
                "warnings": [str(w.message) for w in caught if issubclass(w.category, DiskCacheWarning)]}

    if MODE == "enospc":
        import errno
        real, calls = os.posix_fallocate, []
        def fill_up(fd, offset, length):
            calls.append(1)
            if len(calls) > 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            real(fd, offset, length)
        os.posix_fallocate = fill_up
    print(json.dumps(run(epochs=3 if MODE.startswith("rank") else 2, delay=0.15 if MODE == "slow" else 0.0)))
    """
)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("photos")
    gpuload.datasets.make_sample_image_folder(root, num_images=N, num_classes=2, seed=0)
    return root


def _command(images: Path, cache: Path, mode: str = "fill") -> list[str]:
    return [sys.executable, "-c", CHILD, str(images), str(cache), mode]


def _run(images: Path, cache: Path, mode: str = "fill") -> dict:
    done = subprocess.run(_command(images, cache, mode), capture_output=True, text=True, env=child_environment(),
                          timeout=900)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run_together(images: Path, cache: Path, modes: list[str]) -> list[dict]:
    """One child per mode, all started at once; their results."""
    children = [subprocess.Popen(_command(images, cache, mode), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=child_environment()) for mode in modes]
    results = []
    for child in children:
        out, err = child.communicate(timeout=900)
        assert child.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def _entries(cache: Path) -> list[Path]:
    return [p for p in cache.iterdir() if p.is_dir()] if cache.exists() else []


def test_killed_during_the_fill_then_a_new_run_gives_the_uncached_batches(images: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    child = subprocess.Popen(_command(images, cache, "slow"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env=child_environment())
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and not list(cache.glob("*/block-*.part")):
            assert child.poll() is None, child.stderr.read().decode()
            time.sleep(0.02)
        time.sleep(0.3)  # a few rows into the fill
        assert child.poll() is None, "the fill ended before it could be killed"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stderr.close()
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
