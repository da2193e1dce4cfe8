"""Decoded images from the disk tier: ``gpuload bench --scenario disk``.

A folder of real-photo JPEGs (``make_sample_image_folder``), read as torchvision's
``ImageFolder`` with a deterministic ``Resize(256) + CenterCrop(224) + PILToTensor()``: a
decoded sample is 147 KiB of uint8. gpuload's sample cache keeps them with ``cache="host"``, the
host tier forced to a quarter of the decoded size (``cache_size``), and ``cache_dir=`` a fresh
folder: epoch 1 decodes (with the loader's workers) and writes the disk tier, epoch 2 reads
what the host tier lacks from it, memory-mapped. Measured beside torch's DataLoader with PIL on
the same folder, and a second process started afterwards, whose first epoch reads the disk
tier. Host memory growth is the anonymous resident memory held after the epochs (the page cache
and the memory maps' file pages aside; freed heap handed back first). Targets (issue 27): epoch
2 at least 5x epoch 1 and 3x torch's; the second process's first epoch as fast as epoch 2;
growth within the host tier's budget + 64 MiB.

A second part runs gpuload's own ``ImageFolder`` on the same folder (gpuload's decoder, whole
decoded images cached with ``cache="device"`` in host memory at a quarter of their decoded
size, ``RandomResizedCrop(224)`` after the cache): epoch 1 decodes and fills the disk tier,
epoch 2 and a new loader's first epoch (same process) read what the image cache lacks from it;
beside a loader without ``cache_dir``, whose epoch 2 decodes what its image cache lacks.

After its epoch 2, each of the two disk-tier loaders runs one more epoch, untimed, with its
timeline on: the chart (``bench.png``) is the stage panel of the main bench.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import torch

import gpuload
from gpuload.bench.measure import stage_row
from gpuload.bench.report import WIDTH, write_json, write_stages_chart
from gpuload.bench.run import steady_host_allocator
from gpuload.bench.tokens import anonymous_bytes
from gpuload.cache import estimate_image_bytes, format_bytes

__all__ = [
    "DISK_TARGET", "SECOND_JOB_TARGET", "TORCH_TARGET", "anon_resident_bytes", "decoded_folder", "load_line",
    "run_disk", "run_disk_bench", "run_own_images",
]

DISK_TARGET = 5.0  # epoch 1 / epoch 2, at least
TORCH_TARGET = 3.0  # torch epoch / epoch 2, at least
SECOND_JOB_TARGET = 0.9  # a second process's first-epoch rate / epoch 2's rate, at least (issue 40)
MEMORY_SLACK = 64 << 20
SIZE = 224


def anon_resident_bytes() -> int:
    """This process's anonymous resident memory (``RssAnon``: not file pages nor the page cache),
    after glibc hands its free heap back (``malloc_trim``: the bench's fixed malloc thresholds
    keep freed batches otherwise): the memory the process holds."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):
            pass
    return anonymous_bytes()


def decoded_folder(root: str | os.PathLike[str]) -> Any:
    """The folder as torchvision's ImageFolder decoded at 224x224 uint8 (deterministic)."""
    from torchvision import datasets, transforms

    return datasets.ImageFolder(os.fspath(root), transform=transforms.Compose(
        [transforms.Resize(256), transforms.CenterCrop(SIZE), transforms.PILToTensor()]))


def _loader(dataset: Any, batch_size: int, workers: int, cache_dir: str, cache_size: int) -> gpuload.DataLoader:
    return gpuload.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
                              generator=torch.Generator().manual_seed(0), cache="host", cache_size=cache_size,
                              cache_dir=cache_dir, device="cpu")


def _epoch_s(loader: Any) -> float:
    start = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - start


def second_process(root: str, batch_size: int, cache_dir: str, cache_size: int) -> None:
    """In a new process: one epoch of a fresh loader on the same folder and cache_dir; prints
    its time and the disk tier's counters as one JSON line."""
    steady_host_allocator()  # the allocator the first process measured with
    loader = _loader(decoded_folder(root), batch_size, 0, cache_dir, cache_size)
    seconds = _epoch_s(loader)
    disk = loader.stats.extra["cache"].get("disk", {})
    print(json.dumps({"epoch_s": seconds, "disk_hits": disk.get("hits", 0),
                      "rows_written": disk.get("rows_written", 0)}))


def in_a_second_process(root: str, batch_size: int, cache_dir: str, cache_size: int) -> dict[str, Any]:
    """What :func:`second_process` prints, run in a new Python process; a RuntimeError with the
    child's last line of error when it fails."""
    command = [sys.executable, "-c", "import sys; from gpuload.bench.disk import second_process; "
               f"second_process({root!r}, {batch_size}, {cache_dir!r}, {cache_size})"]
    child = subprocess.run(command, capture_output=True, text=True, check=False, timeout=3600)
    if child.returncode:
        last = " ".join(child.stderr.strip().splitlines()[-1:])
        raise RuntimeError(f"the second process failed (exit {child.returncode}): {last}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def run_disk(root: str, batch_size: int, workers: int, cache_dir: str) -> dict[str, Any]:
    """The measurements of one run (see the module docstring); ``cache_dir`` should be empty."""
    dataset = decoded_folder(root)
    decoded = len(dataset) * 3 * SIZE * SIZE
    cache_size = decoded // 4
    torch_loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
                                               persistent_workers=workers > 0)
    _epoch_s(torch_loader)  # workers started, files in the page cache: as warm as gpuload's epoch 2
    torch_s = _epoch_s(torch_loader)
    del torch_loader
    before = anon_resident_bytes()
    loader = _loader(dataset, batch_size, workers, cache_dir, cache_size)
    epoch1_s = _epoch_s(loader)
    epoch2_s = _epoch_s(loader)
    growth = anon_resident_bytes() - before
    stats = loader.stats.extra["cache"]
    stages = stage_row("gpuload DataLoader (host + disk tier)", loader, torch.device("cpu"))
    loader.close()
    second = in_a_second_process(root, batch_size, cache_dir, cache_size)
    return {
        "images": len(dataset), "batch_size": batch_size, "num_workers": workers,
        "decoded_bytes": decoded, "host_tier_budget": cache_size, "host_tier_bytes": stats["bytes"],
        "disk_bytes": stats["disk"]["published_bytes"], "disk_hits_epoch2": stats["disk"]["hits"],
        "torch_s": torch_s, "epoch1_s": epoch1_s, "epoch2_s": epoch2_s, "second_process_s": second["epoch_s"],
        "second_process_disk_hits": second["disk_hits"], "second_process_rows_written": second["rows_written"],
        "anon_rss_growth_bytes": growth, "memory_limit_bytes": cache_size + MEMORY_SLACK, "stages": stages,
    }


def run_own_images(root: str, batch_size: int, cache_dir: str) -> dict[str, Any]:
    """gpuload's own ImageFolder with its disk tier (see the module docstring); ``cache_dir``
    should be empty."""
    from gpuload import transforms as T

    images = gpuload.datasets.ImageFolder(root)
    decoded, _ = estimate_image_bytes(images)

    def loader(folder: str | None = cache_dir) -> gpuload.DataLoader:
        return gpuload.DataLoader(images, batch_size=batch_size, shuffle=True, device="cpu",
                                  generator=torch.Generator().manual_seed(0), transforms=[T.RandomResizedCrop(SIZE)],
                                  cache="device", cache_size=decoded // 4, cache_dir=folder)

    without = loader(None)
    _epoch_s(without)
    without_s = _epoch_s(without)
    without.close()
    first = loader()
    epoch1_s, epoch2_s = _epoch_s(first), _epoch_s(first)
    disk = first.stats.extra["cache"]["disk"]
    stages = stage_row("gpuload ImageFolder (image cache + disk tier)", first, torch.device("cpu"))
    first.close()
    second = loader()
    second_s = _epoch_s(second)
    second_disk = second.stats.extra["cache"]["disk"]
    second.close()
    return {"own_decoded_bytes": decoded, "own_without_disk_epoch2_s": without_s, "own_epoch1_s": epoch1_s,
            "own_epoch2_s": epoch2_s, "own_new_loader_s": second_s, "own_disk_bytes": disk["published_bytes"],
            "own_disk_rows": disk["published_rows"], "own_new_loader_disk_hits": second_disk["hits"],
            "own_new_loader_rows_written": second_disk["rows_written"], "own_stages": stages}


def format_disk(run: dict[str, Any]) -> str:
    """The run as a small table and the targets."""
    n = run["images"]

    def row(name: str, seconds: float) -> str:
        return f"  {name:<44} {seconds:7.2f} s  {n / seconds:8.0f} img/s"

    lines = [
        row(f"torch DataLoader (PIL, {run['num_workers']} workers)", run["torch_s"]),
        row("gpuload epoch 1 (decode, fill the disk tier)", run["epoch1_s"]),
        row("gpuload epoch 2 (host tier + disk tier)", run["epoch2_s"]),
        row("second process, its first epoch (disk tier)", run["second_process_s"]),
        f"  epoch 1 / epoch 2: {run['epoch1_s'] / run['epoch2_s']:.1f}x (target {DISK_TARGET:.0f}x); "
        f"torch / epoch 2: {run['torch_s'] / run['epoch2_s']:.1f}x (target {TORCH_TARGET:.0f}x); "
        f"second process's rate / epoch 2's: {run['epoch2_s'] / run['second_process_s']:.2f}x "
        f"(target {SECOND_JOB_TARGET}x)",
        f"  decoded {format_bytes(run['decoded_bytes'])}; host tier {format_bytes(run['host_tier_bytes'])} "
        f"(budget {format_bytes(run['host_tier_budget'])}); disk tier {format_bytes(run['disk_bytes'])}; "
        f"host memory growth {format_bytes(run['anon_rss_growth_bytes'])} "
        f"(limit {format_bytes(run['memory_limit_bytes'])})",
    ]
    if "own_epoch1_s" in run:
        lines += [
            f"  gpuload's own ImageFolder (whole images ~{format_bytes(run['own_decoded_bytes'])} decoded, "
            f"image cache at 1/4, RandomResizedCrop({SIZE}) after):",
            row("  epoch 1 (decode, fill the disk tier)", run["own_epoch1_s"]),
            row("  epoch 2 (image cache + disk tier)", run["own_epoch2_s"]),
            row("  epoch 2 without cache_dir (decoding)", run["own_without_disk_epoch2_s"]),
            row("  a new loader, its first epoch (disk tier)", run["own_new_loader_s"]),
            f"  epoch 1 / epoch 2: {run['own_epoch1_s'] / run['own_epoch2_s']:.1f}x; without cache_dir / with: "
            f"{run['own_without_disk_epoch2_s'] / run['own_epoch2_s']:.1f}x; disk tier "
            f"{format_bytes(run['own_disk_bytes'])}",
        ]
    return "\n".join(lines)


def load_line(load: list[float | None], cores: int | None) -> str:
    """The load averages before and after the run, one decimal each ("?" where unknown)."""
    loads = " / ".join("?" if value is None else f"{value:.1f}" for value in load)
    return f"  load average before / after: {loads} on {cores or '?'} cores"


def run_disk_bench(quick: bool, samples: int | None, batch_size: int | None, out: Path,
                   environment: dict[str, Any], quiet: bool = False, workers: int = 2) -> int:
    """``gpuload bench --scenario disk``: generate the JPEGs, run, print, write ``bench.json`` and
    ``bench.png`` (the stage panel); 0."""
    num_images = samples or (96 if quick else 1024)
    batch_size = batch_size or 32
    say = (lambda *lines: None) if quiet else (lambda *lines: print(*lines, sep="\n", flush=True))
    say(*textwrap.wrap(f"gpuload bench: disk, {num_images} real-photo JPEGs -> Resize(256) + CenterCrop({SIZE}) "
                       f"uint8, batch {batch_size}, shuffled, cache='host' at 1/4 of the decoded size, cache_dir= "
                       f"a new folder; torch and gpuload with {workers} workers", WIDTH, subsequent_indent="    "))
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    with tempfile.TemporaryDirectory(prefix="gpuload-bench-disk-") as scratch:
        root, cache_dir = Path(scratch) / "images", Path(scratch) / "cache"
        gpuload.datasets.make_sample_image_folder(root, num_images=num_images, num_classes=10, seed=0)
        run = run_disk(str(root), batch_size, workers, str(cache_dir))
        run.update(run_own_images(str(root), batch_size, str(Path(scratch) / "own-cache")))
    load = [load_before, os.getloadavg()[0] if hasattr(os, "getloadavg") else None]
    say("", format_disk(run), load_line(load, os.cpu_count()), "")
    stages = [run.pop("stages"), run.pop("own_stages")]
    write_json(out / "bench.json", {"scenario": "disk", "environment": environment, "run": run, "load": load,
                                    "stages": stages})
    write_stages_chart(out / "bench.png", stages, f"gpuload bench: disk, batch {batch_size}, cpu")
    print(f"disk tier: epoch 2 {run['epoch1_s'] / run['epoch2_s']:.1f}x faster than epoch 1 and "
          f"{run['torch_s'] / run['epoch2_s']:.1f}x torch's DataLoader; a second process's first epoch "
          f"{run['epoch1_s'] / run['second_process_s']:.1f}x faster than epoch 1")
    print(f"results: {out / 'bench.json'}; chart: {out / 'bench.png'}")
    return 0
