"""CPU time per image of the CPU image path's transforms, and of each piece of it (issue #40).

The bench's list (``RandomResizedCrop(224)`` + flip + float16 + ``Normalize``) runs on the crop
windows of real photos, stored as DALI's CPU decoder gives them (H, W, 3 memory viewed as
C, H, W). Reported, as process CPU time per image with one torch thread (median of
``--rounds``; load averages before and after, since a busy machine inflates CPU time too):

- ``transforms``: ``transform_batch`` on batches of 128, as the loader runs it (its per-image
  threads included);
- each piece of one image's work, one torch call at a time: the window's uint8 -> float32
  copy, the reference's bilinear resize (float32, no antialias) into a channels-last canvas,
  the value ops in place, the cast into a float16 output, the mirror;
- torch's uint8 bilinear resize on the same windows (antialias off, and on: torchvision v2's
  uint8 path), the lever issue #40 names, with how far its pixels are from the reference's
  (which keeps the resized pixels as float32: ``transforms/reference.py``).

Usage: python benchmarks/bench_image_cpu.py [--data FOLDER] [--images 256] [--rounds 5]
Without ``--data`` the images are generated (``make_sample_image_folder``) in a temporary folder.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

import gpuload
from gpuload import transforms as T
from gpuload.bench.images import MEAN, STD
from gpuload.transforms.windows import decode_windows

BATCH = 128
SIZE = (224, 224)


@contextlib.contextmanager
def _folder(data: str | None, images: int) -> Iterator[gpuload.datasets.ImageFolder]:
    if data is not None:
        yield gpuload.datasets.ImageFolder(Path(data))
        return
    with tempfile.TemporaryDirectory(prefix="gpuload-bench-image-cpu-") as root:
        yield gpuload.datasets.make_sample_image_folder(root, num_images=images, num_classes=min(10, images), seed=0)


def crop_windows(folder: gpuload.datasets.ImageFolder, images: int, ops: list[T.Op]) -> list[dict]:
    """Batches of the first ``images`` photos' epoch-0 crop windows, in DALI's HWC layout."""
    whole = [np.asarray(Image.open(path).convert("RGB")) for path, _ in folder.samples[:images]]
    batches = []
    for start in range(0, len(whole), BATCH):
        indices = torch.arange(start, min(start + BATCH, len(whole)))
        sizes = [whole[k].shape[:2] for k in indices.tolist()]
        windows = decode_windows(ops, 0, 0, indices, sizes)
        parts = [torch.from_numpy(np.ascontiguousarray(whole[k][y : y + h, x : x + w])).permute(2, 0, 1)
                 for k, (y, x, h, w) in zip(indices.tolist(), windows)]
        batches.append({"indices": indices, "sizes": sizes, "windows": windows, "parts": parts})
    return batches


def cpu_ms_per_image(work: Callable[[], int], rounds: int) -> float:
    """Median over ``rounds`` of the process CPU time of ``work()`` per image it reports."""
    work()  # warm: allocator, kernels' first calls
    times = []
    for _ in range(rounds):
        start = time.process_time()
        count = work()
        times.append((time.process_time() - start) / count * 1e3)
    return statistics.median(times)


def measure(batches: list[dict], ops: list[T.Op], rounds: int) -> dict[str, float]:
    """CPU ms per image of the transforms and of each piece (see the module docstring)."""
    windows = [part.unsqueeze(0) for batch in batches for part in batch["parts"]]
    floats = [window.to(torch.float32) for window in windows]
    canvas = torch.empty((1, 3, *SIZE), dtype=torch.float32, memory_format=torch.channels_last)
    output = torch.empty((len(windows), 3, *SIZE), dtype=torch.float16, memory_format=torch.channels_last)
    mean, std = (torch.tensor(v).view(1, 3, 1, 1).expand(1, 3, *SIZE).contiguous(memory_format=torch.channels_last)
                 for v in (MEAN, STD))

    def each(step: Callable[[int], object]) -> Callable[[], int]:
        def work() -> int:
            for k in range(len(windows)):
                step(k)
            return len(windows)
        return work

    def transforms() -> int:
        for batch in batches:
            T.transform_batch(ops, batch["parts"], 0, 0, batch["indices"], windows=batch["windows"],
                              image_sizes=batch["sizes"])
        return len(windows)

    def values(k: int) -> None:
        canvas.div_(255.0).sub_(mean).div_(std)

    pieces: dict[str, Callable[[], int]] = {
        "transforms (transform_batch, batch 128)": transforms,
        "window uint8 -> float32": each(lambda k: windows[k].to(torch.float32)),
        "bilinear float32 (the reference's)": each(
            lambda k: torch._C._nn.upsample_bilinear2d(floats[k], list(SIZE), False, None, None, out=canvas)),  # type: ignore[call-arg]
        "value ops in place (/255, -mean, /std)": each(values),
        "cast into the float16 output": each(lambda k: output[k : k + 1].copy_(canvas)),
        "mirror (canvas.copy_(canvas.flip(-1)))": each(lambda k: canvas.copy_(canvas.flip(-1))),
        "bilinear uint8, antialias off": each(
            lambda k: F.interpolate(windows[k], size=SIZE, mode="bilinear", antialias=False)),
        "bilinear uint8, antialias on (torchvision v2)": each(
            lambda k: F.interpolate(windows[k], size=SIZE, mode="bilinear", antialias=True)),
    }
    return {name: cpu_ms_per_image(work, rounds) for name, work in pieces.items()}


def uint8_difference(batches: list[dict]) -> dict[str, float]:
    """How far torch's uint8 bilinear (antialias off) is from the reference's float32 resize:
    the share of values that are not the reference's rounded, and the largest difference."""
    differing = total = 0
    largest = 0.0
    for batch in batches:
        for part in batch["parts"]:
            window = part.unsqueeze(0)
            reference = F.interpolate(window.to(torch.float32), size=SIZE, mode="bilinear", antialias=False)
            resized = F.interpolate(window, size=SIZE, mode="bilinear", antialias=False).to(torch.float32)
            differing += int((resized != reference.round()).sum())
            total += resized.numel()
            largest = max(largest, float((resized - reference).abs().max()))
    return {"share not the reference rounded": differing / max(1, total), "largest |uint8 - reference|": largest}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="an image folder root/<class>/<images> (default: generated photos)")
    parser.add_argument("--images", type=int, default=256, help="how many of its images (default 256)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds, median reported (default 5)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the bench's setting on 2 cores; the per-image threads are gpuload's own
    ops: list[T.Op] = [T.RandomResizedCrop(SIZE[0]), T.RandomHorizontalFlip(), T.ToDtype(torch.float16),
                       T.Normalize(MEAN, STD)]
    with _folder(args.data, args.images) as folder:
        batches = crop_windows(folder, args.images, ops)
    before = os.getloadavg()
    cpu = measure(batches, ops, args.rounds)
    after = os.getloadavg()
    difference = uint8_difference(batches)
    count = sum(len(batch["parts"]) for batch in batches)
    print(f"{count} crop windows, CPU ms per image (median of {args.rounds}), "
          f"load {before[0]:.1f} before, {after[0]:.1f} after")
    for name, ms in cpu.items():
        print(f"  {ms:7.3f}  {name}")
    print("torch's uint8 bilinear (antialias off) against the reference's float32 resize, 0-255 units:")
    for name, value in difference.items():
        print(f"  {value:7.4f}  {name}")
    return {"cpu_ms_per_image": cpu, "uint8_difference": difference,
            "load": {"before": before[0], "after": after[0]}}


if __name__ == "__main__":
    main()
