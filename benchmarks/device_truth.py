"""The device check's proofs: each CUDA-path hazard of issue 34 made to bite, and the data checked.

Every sub-check drives gpuload's public API (``gpuload.DataLoader``, ``shrink_cache``,
``device_cache_bytes``) on the device in a way that makes one hazard happen if it is there, and
asserts on the samples served, never on "it ran":

==============  =======  ====================================================================
check           defects  what it does, and what fails it
==============  =======  ====================================================================
nvjpeg-stall    1        stalls the prefetcher's side stream (``torch.cuda._sleep``) before each
                         nvJPEG decode with a poisoning write queued behind the stall into
                         memory freed on that stream; decodes the same JPEGs twice (a loader
                         with the decoded-image cache over two epochs, one without): every image
                         within nvJPEG's tolerance of the CPU decode, and both decodes bit-equal
stream-guard    3        an epoch of an array loader and of a sample cache, then each store's
                         ``StreamGuard`` asked to order a probe stream after every stream it
                         noted: a handful of ``wait_stream`` calls, not one per batch
array-shrink    2        a tiered array loader whose cache is shrunk from the loop every few
                         batches while the prefetcher gathers ahead: every row equals its index's
                         expected row, every index once per epoch
column-oom      4, 5     a sample (column) cache filled under a tight
                         ``torch.cuda.set_per_process_memory_fraction`` until the allocator
                         refuses, then shrunk under it: every sample served afterwards is right,
                         and the shrink gives memory back without raising
epoch-shrink    6        five epochs with a "model" holding memory inside the cache reserve: the
                         cache gives memory back once, then stays (it does not drain each epoch)
==============  =======  ====================================================================

Each check runs in its own process (a device-side assert kills the CUDA context, a hang stops
at ``--timeout``) and writes ``OUT/<check>.json``: ``passed``, ``defects``, ``problems`` (what
failed, in words), ``details`` (the measured values) and ``seconds``. On a CPU
(``--device cpu``, the dry run ``tests/bench/test_device_truth.py`` runs) the same code runs at
small sizes: the CUDA-only mechanics (streams, the memory fraction, the epoch-start shrink) are
inert there, which each result says (``details["cuda_only"]``), and the data is checked all the
same.

Usage: python benchmarks/device_truth.py --out DIR [--device cuda|cpu] [--only CHECK ...]
       [--timeout SECONDS]; exit status 1 when a check did not pass.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset

MiB = 2**20
# nvJPEG against libjpeg-turbo on the same file: the IDCT and chroma upsampling differ, so pixels
# differ by a few levels on average and up to ~20 at sharp edges of 4:2:0 JPEGs; a poisoned or
# half-written image is off by tens to hundreds on average. The same bounds hold DALI's mixed
# decoder and the nvjpeg backend in tests/decode (GPU_MEAN_TOL, GPU_MAX_TOL there).
NVJPEG_MEAN_TOL, NVJPEG_MAX_TOL = 1.0, 24
POISON = 255  # what the write queued behind the stall puts into memory the decoder may be handed
HANDFUL = 4  # StreamGuard entries a loader may need: its side stream, the loop's, a spare


@dataclass
class Result:
    """One sub-check's outcome, as written to ``OUT/<check>.json``."""

    check: str
    defects: list[int]
    device: str
    passed: bool = False
    problems: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def fail(self, problem: str) -> None:
        self.problems.append(problem)


@dataclass(frozen=True)
class Sizes:
    """How big each check runs: a device run is sized to make the hazard bite in ~10 s a check,
    the CPU dry run to finish in a second or two."""

    images: int
    image_batch: int
    rows: int
    row_ints: int
    row_batch: int
    sample_ints: int
    samples: int
    sample_batch: int
    reserve_rows: int
    reserve_row_ints: int
    reserve_batch: int
    stall_ms: float


DEVICE_SIZES = Sizes(images=48, image_batch=8, rows=32768, row_ints=64, row_batch=64, sample_ints=65536,
                     samples=512, sample_batch=64, reserve_rows=16384, reserve_row_ints=4096,
                     reserve_batch=512, stall_ms=20.0)
DRY_RUN_SIZES = Sizes(images=12, image_batch=4, rows=2048, row_ints=16, row_batch=32, sample_ints=256,
                      samples=256, sample_batch=32, reserve_rows=1024, reserve_row_ints=64,
                      reserve_batch=128, stall_ms=0.0)


def sizes_for(device: torch.device) -> Sizes:
    """The device sizes on CUDA, the dry run's elsewhere."""
    return DEVICE_SIZES if device.type == "cuda" else DRY_RUN_SIZES


# ---------------------------------------------------------------- shared pieces


def sleep_cycles(ms: float) -> int:
    """``torch.cuda._sleep`` cycles for ``ms`` milliseconds, measured now with CUDA events (clocks
    boost under load, so a calibration at idle would give stalls several times shorter)."""
    probe = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):  # the first launch pays the kernel's load
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
    return max(1, int(probe * ms / max(start.elapsed_time(end), 1e-3)))


def row_pattern(indices: torch.Tensor, width: int) -> torch.Tensor:
    """The row every check's arrays hold for each index: ``index * width + column`` (int32),
    so a row from another index, another tier's slot or unwritten memory cannot pass."""
    return (indices.to(torch.int64)[:, None] * width + torch.arange(width)[None, :]).to(torch.int32)


class PatternRows(Dataset):
    """A map-style dataset (not a TensorDataset: it goes through the sample cache) of
    ``(row_pattern(i), i)``."""

    def __init__(self, count: int, width: int) -> None:
        self.count, self.width = count, width

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return row_pattern(torch.tensor([index]), self.width)[0], index


def wrong_rows(rows: torch.Tensor, indices: torch.Tensor, width: int) -> int:
    """How many of a batch's rows differ from their indices' pattern (compared on the host)."""
    host, index = rows.cpu(), indices.cpu()
    if host.shape != (index.numel(), width):
        return index.numel()
    return int((host != row_pattern(index, width)).any(dim=1).sum())


def check_epoch(result: Result, name: str, batches: Iterator[Any], width: int, count: int,
                between: Callable[[int], None] | None = None) -> None:
    """Every row of an epoch right and every index seen once; ``between(k)`` runs after batch k."""
    wrong, seen = 0, torch.zeros(count, dtype=torch.int64)
    for k, (rows, indices) in enumerate(batches):
        wrong += wrong_rows(rows, indices, width)
        seen.index_add_(0, indices.cpu(), torch.ones(indices.numel(), dtype=torch.int64))
        del rows, indices
        if between is not None:
            between(k)
    result.details.setdefault("wrong_rows", {})[name] = wrong
    if wrong:
        result.fail(f"{name}: {wrong} row(s) differ from their index's row")
    if not bool((seen == 1).all()):
        result.fail(f"{name}: {int((seen != 1).sum())} index(es) not served exactly once")


def reachable(root: object, kind: type, limit: int = 100_000) -> list[Any]:
    """Objects of ``kind`` reachable from ``root`` through gpuload's objects and plain containers:
    the stores' guards, found without naming any private attribute."""
    found, seen, todo = [], {id(root)}, [root]
    while todo and len(seen) < limit:
        item = todo.pop()
        if isinstance(item, kind):
            found.append(item)
        for child in gc.get_referents(item):
            followed = type(child) in _CONTAINERS or type(child).__module__.startswith("gpuload")
            if followed and id(child) not in seen:
                seen.add(id(child))
                todo.append(child)
    return found


_CONTAINERS = (dict, list, tuple, set, frozenset)


@contextlib.contextmanager
def memory_fraction(device: torch.device, headroom: int) -> Iterator[dict[str, int]]:
    """On CUDA: torch's allocator may hold at most what it holds now plus ``headroom`` bytes
    (cached blocks given back first); the OOMs it raised meanwhile are counted. Inert on a CPU."""
    counts = {"ooms": 0}
    if device.type != "cuda":
        yield counts
        return
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info(device)[1]
    before = torch.cuda.memory_stats(device).get("num_ooms", 0)
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(device) + headroom) / total, device)
    try:
        yield counts
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        counts["ooms"] = torch.cuda.memory_stats(device).get("num_ooms", 0) - before


def is_oom(error: BaseException | None) -> bool:
    """Whether ``error``, or an error it was raised from (the loader names the batch), is an OOM."""
    while error is not None:
        if isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


# ---------------------------------------------------------------- 1: nvJPEG and a stalled side stream


def fixed_size_jpegs(folder: Path, count: int, size: tuple[int, int] = (256, 192)) -> Path:
    """``count`` JPEGs of one size (so batches stack without transforms), crops of the real
    photographs gpuload's bench uses, in two classes."""
    from PIL import Image

    from gpuload.datasets.images import make_sample_image_folder

    source = make_sample_image_folder(folder / "source", num_images=count, num_classes=2, seed=7)
    for k in range(len(source)):
        path = Path(source.path(k))
        out = folder / "fixed" / path.parent.name / path.name
        out.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        Image.open(path).convert("RGB").resize(size).save(buffer, format="JPEG", quality=90, subsampling=2)
        out.write_bytes(buffer.getvalue())
    return folder / "fixed"


@contextlib.contextmanager
def nvjpeg_stalled(device: torch.device, stall_ms: float) -> Iterator[dict[str, int]]:
    """gpuload's image path decodes with the ``nvjpeg`` backend (on a CPU: the same backend with
    torchvision's CPU decode, the dry run), and before each decode the calling stream (the
    prefetcher's side stream) gets a stall and, queued behind it, a write of ``POISON`` into
    blocks of the decoded images' sizes, freed at once: the caching allocator hands those blocks
    to the decoder's outputs. A decode ordered after the calling stream's work overwrites the
    poison; one that is not (defect 1) is overwritten by it."""
    from gpuload.decode import batch
    from gpuload.decode._nvjpeg import NvjpegDecoder

    calls = {"decodes": 0, "stalls": 0}
    real = NvjpegDecoder.decode
    cycles = sleep_cycles(stall_ms) if device.type == "cuda" and stall_ms else 0

    def stalled(self: NvjpegDecoder, encoded: Any, headers: Any, rois: Any = None) -> list[torch.Tensor]:
        calls["decodes"] += 1
        if cycles and self.device.type == "cuda":
            freed = [torch.empty((3, *h.upright), dtype=torch.uint8, device=self.device) for h in headers]
            torch.cuda._sleep(cycles)
            for block in freed:
                block.fill_(POISON)
            del freed
            calls["stalls"] += 1
        return real(self, encoded, headers, rois)

    saved = (batch._dali_installed, batch._without_dali, NvjpegDecoder.decode)
    batch._dali_installed = lambda: False  # type: ignore[assignment]
    batch._without_dali = lambda device: "nvjpeg"  # type: ignore[assignment]
    NvjpegDecoder.decode = stalled  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        batch._dali_installed, batch._without_dali, NvjpegDecoder.decode = saved  # type: ignore[assignment]


def check_nvjpeg_stall(device: torch.device, work: Path) -> Result:
    import gpuload
    from gpuload.datasets import ImageFolder
    from gpuload.decode import cpu

    result = Result("nvjpeg-stall", [1], str(device))
    size = sizes_for(device)
    folder = ImageFolder(fixed_size_jpegs(work, size.images))
    reference = [cpu.cpu_decoder("torchvision")(folder.read_encoded(k)[0], None) for k in range(len(folder))]
    decodes: dict[str, list[torch.Tensor]] = {}
    with nvjpeg_stalled(device, size.stall_ms) as calls:
        cached = gpuload.DataLoader(folder, batch_size=size.image_batch, device=device, cache="auto", cache_reserve=0)
        uncached = gpuload.DataLoader(folder, batch_size=size.image_batch, device=device, cache="off")
        for name, loader in (("cached epoch 1", cached), ("cached epoch 2", cached), ("uncached", uncached)):
            images = [image for batch, _ in loader for image in batch.cpu()]
            decodes[name] = images
        result.details.update(
            decode_backend=cached.stats.extra.get("decode_backend"),
            image_cache=cached.stats.extra.get("image_cache_decision"),
            decode_calls=calls["decodes"], stalled_decodes=calls["stalls"],
            stall_ms=size.stall_ms if calls["stalls"] else 0,
        )
        cached.close()
        uncached.close()
    if result.details["decode_backend"] != "nvjpeg":
        result.fail(f"decoded by {result.details['decode_backend']!r}, not the nvjpeg backend")
    if device.type == "cuda" and not calls["stalls"]:
        result.fail("no decode ran behind a stall")
    worst_mean, worst_max = 0.0, 0
    for name, images in decodes.items():
        if len(images) != len(reference):
            result.fail(f"{name}: {len(images)} images for {len(reference)} files")
            continue
        off = 0
        for image, expected in zip(images, reference):
            diff = (image.to(torch.int16) - expected.to(torch.int16)).abs()
            mean, most = float(diff.float().mean()), int(diff.max())
            worst_mean, worst_max = max(worst_mean, mean), max(worst_max, most)
            off += mean > NVJPEG_MEAN_TOL or most > NVJPEG_MAX_TOL
        if off:
            result.fail(f"{name}: {off} image(s) off the CPU decode by more than mean {NVJPEG_MEAN_TOL} / "
                        f"max {NVJPEG_MAX_TOL}")
    result.details.update(worst_mean_abs_diff=round(worst_mean, 3), worst_max_abs_diff=worst_max,
                          tolerance={"mean": NVJPEG_MEAN_TOL, "max": NVJPEG_MAX_TOL})
    checksums = {name: [int(image.to(torch.int64).sum()) for image in images] for name, images in decodes.items()}
    differing = sum(a != b for a, b in zip(checksums["cached epoch 1"], checksums["uncached"]))
    result.details["checksums_differing_between_the_two_decodes"] = differing
    if differing:
        result.fail(f"the two decodes of the same files differ in {differing} image(s)")
    if checksums["cached epoch 2"] != checksums["cached epoch 1"]:
        result.fail("the decoded-image cache served other pixels than it was filled with")
    return result


# ---------------------------------------------------------------- 3: StreamGuard entries


def guard_entries(guard: Any, device: torch.device) -> int:
    """How many streams ``guard`` (a ``gpuload.cache.store.StreamGuard``) orders a replacement
    after: the ``wait_stream`` calls its ``before_replacing`` makes on a fresh probe stream."""
    if device.type != "cuda":
        return 0
    probe = torch.cuda.Stream(device)
    waited: list[Any] = []
    original = torch.cuda.Stream.wait_stream

    def counting(self: Any, other: Any) -> Any:
        waited.append(other)
        return original(self, other)

    torch.cuda.Stream.wait_stream = counting  # type: ignore[method-assign, assignment]
    try:
        with torch.cuda.stream(probe):
            guard.before_replacing()
    finally:
        torch.cuda.Stream.wait_stream = original  # type: ignore[method-assign]
    probe.synchronize()
    return len(waited)


def guard_problems(entries: dict[str, list[int]], batches: dict[str, int]) -> list[str]:
    """A guard holding more than ``HANDFUL`` streams after an epoch keeps one per use (defect 3)."""
    return [f"{name}: a StreamGuard orders after {max(counts)} streams after {batches[name]} batches "
            f"(a handful, at most {HANDFUL}, expected)"
            for name, counts in entries.items() if counts and max(counts) > HANDFUL]


def check_stream_guard(device: torch.device, work: Path) -> Result:
    import gpuload
    from gpuload.cache.store import StreamGuard

    result = Result("stream-guard", [3], str(device))
    size = sizes_for(device)
    arrays = TensorDataset(row_pattern(torch.arange(size.rows), size.row_ints), torch.arange(size.rows))
    loaders = {
        "arrays (device tier)": gpuload.DataLoader(arrays, batch_size=size.row_batch, shuffle=True, device=device,
                                                   cache_reserve=0),
        "samples (column cache)": gpuload.DataLoader(PatternRows(size.samples, size.sample_ints), shuffle=True,
                                                     batch_size=size.sample_batch // 4, device=device,
                                                     cache_reserve=0),
    }
    entries: dict[str, list[int]] = {}
    batches: dict[str, int] = {}
    for name, loader in loaders.items():
        dataset: Any = loader.dataset
        check_epoch(result, name, iter(loader), dataset[0][0].numel(), len(dataset))
        batches[name] = len(loader)
        guards = reachable(loader, StreamGuard)
        entries[name] = [guard_entries(guard, device) for guard in guards]
        loader.close()
    result.details.update(guards=entries, batches=batches)
    if device.type == "cuda" and not all(any(counts) for counts in entries.values()):
        result.fail(f"no StreamGuard with a noted stream found behind a loader: {entries}")
    for problem in guard_problems(entries, batches):
        result.fail(problem)
    if device.type != "cuda":
        result.details["cuda_only"] = "StreamGuard is inert off CUDA: 0 entries; the rows are checked"
    return result


# ---------------------------------------------------------------- 2: shrinking while the prefetcher gathers


def check_array_shrink(device: torch.device, work: Path) -> Result:
    import gpuload

    result = Result("array-shrink", [2], str(device))
    size = sizes_for(device)
    data = row_pattern(torch.arange(size.rows), size.row_ints)
    row_bytes = data[0].numel() * data.element_size() + 8  # the index column too
    loader = gpuload.DataLoader(TensorDataset(data, torch.arange(size.rows)), batch_size=size.row_batch,
                                shuffle=True, device=device, cache_size=int(0.6 * size.rows) * row_bytes,
                                cache_reserve=0, generator=torch.Generator().manual_seed(3))
    every = 4  # batches between shrinks: the tier empties over two epochs
    step = max(1, int(0.6 * size.rows) * every // (2 * len(loader))) * row_bytes
    held: list[int] = []

    def shrink(batch: int) -> None:
        if batch % every == 0:
            now = loader.device_cache_bytes
            held.append(now)
            loader.shrink_cache(max(0, now - step))

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the prefetch thread and the loop interleave as finely as they can
    try:
        for epoch in range(2):
            check_epoch(result, f"epoch {epoch + 1}", iter(loader), size.row_ints, size.rows, shrink)
    finally:
        sys.setswitchinterval(switch)
    result.details.update(shrinks=len(held), device_bytes_first=held[0] if held else 0,
                          device_bytes_last=loader.device_cache_bytes, path=loader.stats.path)
    if device.type == "cuda" and not (held and held[0] > loader.device_cache_bytes):
        result.fail(f"the device tier did not shrink while batches were gathered (held {held[:1]} -> "
                    f"{loader.device_cache_bytes} bytes)")
    if device.type != "cuda":
        result.details["cuda_only"] = "on a CPU the arrays are served in place: no tier to swap"
    loader.close()
    return result


# ---------------------------------------------------------------- 4, 5: the column cache out of memory


def check_column_oom(device: torch.device, work: Path) -> Result:
    import gpuload

    result = Result("column-oom", [4, 5], str(device))
    size = sizes_for(device)
    width, count = size.sample_ints, size.samples
    batch_bytes = size.sample_batch * width * 4
    loader = gpuload.DataLoader(PatternRows(count, width), batch_size=size.sample_batch, device=device,
                                cache="device", cache_size=4 * count * width * 4, cache_reserve=0, prefetch_depth=0)
    # Epoch 1: the first batch allocates the columns; then the allocator may grow by half a batch,
    # so the next fill's copy to the device is refused (the cache stops filling).
    epoch = iter(loader)
    first_rows, first_indices = next(epoch)
    wrong = wrong_rows(first_rows, first_indices, width)
    del first_rows, first_indices
    refused_in_loop = 0
    with memory_fraction(device, batch_bytes // 2) as fill:
        try:
            for rows, indices in epoch:
                wrong += wrong_rows(rows, indices, width)
                del rows, indices
        except RuntimeError as error:  # the batch itself may not fit either: the loop's own OOM
            if not is_oom(error):
                raise
            refused_in_loop += 1
    cache = loader.stats.extra.get("cache", {})
    result.details.update(fill_ooms=fill["ooms"], oom_raised_in_the_loop=refused_in_loop, wrong_rows_filling=wrong,
                          cache_after_fill={k: cache.get(k) for k in ("tier", "entries", "bytes", "full")})
    if wrong:
        result.fail(f"filling epoch: {wrong} row(s) differ from their index's row")
    if device.type == "cuda" and not fill["ooms"]:
        result.fail("the memory fraction did not make the allocator refuse while the cache filled")
    for number in (2, 3):
        check_epoch(result, f"epoch {number} after the refused fill", iter(loader), width, count)
    # Defect 5: a shrink under the same pressure (the kept rows' copy does not fit beside the old).
    held = loader.device_cache_bytes
    limit = held // 2
    with memory_fraction(device, batch_bytes // 8) as squeeze:
        try:
            freed = loader.shrink_cache(limit)
        except RuntimeError as error:
            if not is_oom(error):
                raise
            freed = -1
            result.fail(f"shrink_cache({limit}) under memory pressure raised: {str(error).splitlines()[0][:200]}")
    result.details.update(held_before_shrink=held, shrink_limit=limit, freed=freed, shrink_ooms=squeeze["ooms"],
                          held_after_shrink=loader.device_cache_bytes)
    if loader.device_cache_bytes > limit and device.type == "cuda":
        result.fail(f"after shrink_cache({limit}) the cache holds {loader.device_cache_bytes} device bytes")
    check_epoch(result, "epoch after the shrink", iter(loader), width, count)
    if device.type != "cuda":
        result.details["cuda_only"] = "no memory fraction on a CPU: nothing is refused; the samples are checked"
    loader.close()
    return result


# ---------------------------------------------------------------- 6: the epoch-start shrink


def drain_problems(held: list[int], full: int) -> list[str]:
    """``held``: the cache's device bytes after epochs 1..n, a model inside the reserve from epoch
    2 on. The cache must hold everything first, give memory back once, then keep what it holds
    (within 10%: a few rows may go as other memory moves); draining each epoch is defect 6."""
    problems = []
    if len(held) < 3:
        return [f"only {len(held)} epoch(s) measured"]
    if held[0] < full:
        problems.append(f"epoch 1 held {held[0]} of {full} bytes: the cache did not take the dataset")
    if held[1] >= held[0]:
        problems.append("the model's memory inside the reserve did not make the cache give any back")
    later = held[2:]
    if held[1] <= 0 or min(later) < 0.9 * held[1]:
        problems.append(f"the cache drains epoch by epoch: held {held} bytes")
    return problems


def check_epoch_shrink(device: torch.device, work: Path) -> Result:
    import gpuload

    result = Result("epoch-shrink", [6], str(device))
    size = sizes_for(device)
    width, count = size.reserve_row_ints, size.reserve_rows
    data = row_pattern(torch.arange(count), width)
    full = data.numel() * data.element_size() + count * 8
    margin = max(full, 64 * MiB)
    reserve = 0
    if device.type == "cuda":
        torch.zeros(1, device=device)  # the context exists before free memory is read
        torch.cuda.empty_cache()
        reserve = torch.cuda.mem_get_info(device)[0] - full - margin  # room for the cache and a margin
    loader = gpuload.DataLoader(TensorDataset(data, torch.arange(count)), batch_size=size.reserve_batch,
                                shuffle=True, device=device, cache_size=2 * full, cache_reserve=reserve)
    held: list[int] = []
    model = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(5):
            check_epoch(result, f"epoch {epoch + 1}", iter(loader), width, count)
            held.append(loader.device_cache_bytes)
            if epoch == 0 and device.type == "cuda":
                # The model takes the margin and half the cache's bytes: inside the reserve.
                torch.cuda.empty_cache()
                model = torch.empty(margin + full // 2, dtype=torch.uint8, device=device)
    shrink_warnings = [str(w.message) for w in caught if "fell below the reserve" in str(w.message)]
    result.details.update(held_per_epoch=held, dataset_bytes=full, reserve=reserve,
                          model_bytes=model.numel() if model is not None else 0,
                          reserve_warnings=len(shrink_warnings))
    del model
    if device.type == "cuda":
        for problem in drain_problems(held, full):
            result.fail(problem)
    else:
        result.details["cuda_only"] = "the epoch-start shrink runs on CUDA only; the rows are checked"
    loader.close()
    return result


CHECKS: dict[str, Callable[[torch.device, Path], Result]] = {
    "nvjpeg-stall": check_nvjpeg_stall,
    "stream-guard": check_stream_guard,
    "array-shrink": check_array_shrink,
    "column-oom": check_column_oom,
    "epoch-shrink": check_epoch_shrink,
}
DEFECTS = {"nvjpeg-stall": [1], "stream-guard": [3], "array-shrink": [2], "column-oom": [4, 5], "epoch-shrink": [6]}


def run_one(name: str, device: torch.device, out: Path) -> Result:
    """Run check ``name`` here and write its JSON; an exception is a failure with its traceback."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"gpuload-{name}-") as work:
        try:
            result = CHECKS[name](device, Path(work))
            result.passed = not result.problems
        except Exception as error:  # noqa: BLE001 - recorded, the next check still runs
            result = Result(name, DEFECTS[name], str(device))
            result.fail(f"{type(error).__name__}: {str(error)[:500]}")
            result.details["traceback"] = traceback.format_exc()[-3000:]
    result.seconds = round(time.perf_counter() - started, 2)
    write(result, out)
    return result


def write(result: Result, out: Path) -> None:
    """``out/<check>.json``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{result.check}.json").write_text(json.dumps(asdict(result), indent=2, default=str) + "\n")


def run_isolated(name: str, device: str, out: Path, timeout: float) -> Result:
    """Run check ``name`` in a process of its own (a device-side assert kills the CUDA context; a
    hang is stopped); when it writes no JSON, a failed one says why."""
    (out / f"{name}.json").unlink(missing_ok=True)
    started = time.perf_counter()
    command = [sys.executable, __file__, "--out", str(out), "--device", device, "--only", name, "--here"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
        rc, tail = done.returncode, (done.stdout + done.stderr)[-2000:]
    except subprocess.TimeoutExpired as expired:
        rc, tail = None, f"timed out after {timeout:.0f}s\n" + str(expired.stderr or "")[-2000:]
    written = out / f"{name}.json"
    if written.exists():
        return Result(**json.loads(written.read_text()))
    result = Result(name, DEFECTS[name], device, seconds=round(time.perf_counter() - started, 2))
    result.fail(f"the check's process ended without a result (exit status {rc})")
    result.details["output_tail"] = tail
    write(result, out)
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the checks named (all by default), print one line each; 1 when one did not pass."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for <check>.json")
    parser.add_argument("--device", default="cuda", help="cuda (the device check) or cpu (the dry run)")
    parser.add_argument("--only", nargs="+", choices=sorted(CHECKS), help="these checks only")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds each check may take")
    parser.add_argument("--here", action="store_true", help="run in this process (no process per check)")
    args = parser.parse_args(argv)
    names = args.only or list(CHECKS)
    if not args.here:  # what the step's own time limit stops before it runs still shows, as not run
        for name in names:
            write(Result(name, DEFECTS[name], args.device, problems=["not run: the step ended before it"]), args.out)
    results = []
    for name in names:
        if args.here:
            results.append(run_one(name, torch.device(args.device), args.out))
        else:
            results.append(run_isolated(name, args.device, args.out, args.timeout))
        last = results[-1]
        print(f"{last.check:<13} {'passed' if last.passed else 'FAILED'} in {last.seconds:.1f}s"
              + "".join(f"\n  - {problem}" for problem in last.problems), flush=True)
    return 0 if all(result.passed for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
