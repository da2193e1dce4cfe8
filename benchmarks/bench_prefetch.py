"""Prefetcher benchmark: how long a training loop waits for data, gpuload vs torch's DataLoader.

A synthetic step of ``--step-ms`` (a sleep on the CPU, ``torch.cuda._sleep`` on a GPU) consumes
uint8 image batches whose production costs ``--produce-ms`` each (one gather from a host
tensor plus a sleep standing in for I/O). For each way of feeding the loop it reports the share
of wall time the loop spent inside ``next()`` (and the copy call), and the overhead over the
step alone. On a GPU it also measures the prefetcher's host-to-device GB/s against this
machine's own pinned-copy bandwidth, measured in the same run (target: >= 85%).

Usage: python benchmarks/bench_prefetch.py [--quick] [--device cuda] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.data as tud

from gpuload.bench.steps import make_step
from gpuload.device import resolve_device
from gpuload.prefetch import Fill, Prefetcher, TensorSpec
from gpuload.transfer import move_to_device


class BatchedImages(tud.Dataset):
    """Indexed by a whole batch of indices: one gather, then the simulated source latency.

    ``length`` samples are served from a smaller pool (index modulo the pool), so one epoch
    covers the whole measurement and no feed pays an epoch-boundary restart.
    """

    def __init__(
        self, images: torch.Tensor, labels: torch.Tensor, produce_s: float, length: int
    ) -> None:
        self.images, self.labels, self.produce_s, self.length = images, labels, produce_s, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices) % len(self.images)
        batch = self.images.index_select(0, index), self.labels.index_select(0, index)
        if self.produce_s:
            time.sleep(self.produce_s)
        return batch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_loop(
    batches: Iterator[Any], step: Callable[[Any], None], device: torch.device, n: int, move: bool
) -> tuple[float, float]:
    """(wall seconds, seconds inside next() and the copy call) for ``n`` steps after 2 warm-up."""
    for _ in range(2):
        batch = next(batches)
        step(move_to_device(batch, device, non_blocking=True) if move else batch)
    sync(device)
    waited = 0.0
    started = time.perf_counter()
    for _ in range(n):
        before = time.perf_counter()
        batch = next(batches)
        if move:
            batch = move_to_device(batch, device, non_blocking=True)
        waited += time.perf_counter() - before
        step(batch)
    sync(device)
    return time.perf_counter() - started, waited


def endless(loader: tud.DataLoader) -> Iterator[Any]:
    while True:
        yield from loader


def h2d_bandwidth(device: torch.device, nbytes: int, repeats: int, pinned: bool = True) -> float:
    """This machine's host-to-device GB/s from pinned (or pageable) memory: back-to-back copies
    timed with events."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target.copy_(host, non_blocking=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        target.copy_(host, non_blocking=True)
    end.record()
    end.synchronize()
    return nbytes * repeats / (start.elapsed_time(end) / 1000) / 1e9


def prefetcher_bandwidth(device: torch.device, nbytes: int, repeats: int, gather: bool) -> float:
    """GB/s through a Prefetcher whose consumer does nothing; ``gather`` also fills each slot."""
    cache = torch.randint(0, 255, (64, nbytes // 64), dtype=torch.uint8) if gather else None
    perm = torch.randperm(64)

    def fill(slot: torch.Tensor) -> None:
        if cache is not None:
            torch.index_select(cache, 0, perm, out=slot)

    def source() -> Iterator[Fill]:
        for _ in range(repeats + 2):
            yield Fill(TensorSpec((64, nbytes // 64), torch.uint8), fill)

    batches = iter(Prefetcher(source(), device, depth=3))
    for _ in range(2):
        next(batches)
    sync(device)
    started = time.perf_counter()
    for _ in batches:
        pass
    sync(device)
    return nbytes * repeats / (time.perf_counter() - started) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: auto)")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--image", type=int, nargs=3, default=None, metavar=("C", "H", "W"))
    parser.add_argument("--step-ms", type=float, default=4.0, help="synthetic step time")
    parser.add_argument("--produce-ms", type=float, default=2.0, help="per-batch source latency")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="for the torch workers row")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)

    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    batch_size = args.batch_size or (64 if args.quick else 256)
    shape = tuple(args.image or ((3, 64, 64) if args.quick else (3, 224, 224)))
    steps = args.steps or (40 if args.quick else 200)
    samples = batch_size * 8
    images = torch.randint(0, 255, (samples, *shape), dtype=torch.uint8)
    labels = torch.randint(0, 1000, (samples,))
    dataset = BatchedImages(images, labels, args.produce_ms / 1000, batch_size * (steps + 4))
    plan = tud.BatchSampler(tud.RandomSampler(dataset), batch_size, drop_last=True)
    step = make_step("sleep", device, args.step_ms)
    batch_mb = (images[0].numel() + 8) * batch_size / 1e6

    def torch_loader(workers: int, pin: bool) -> tud.DataLoader:
        return tud.DataLoader(
            dataset, batch_size=None, sampler=plan, num_workers=workers, pin_memory=pin,
            persistent_workers=workers > 0,
        )

    def gather_fills() -> Iterator[Fill]:
        while True:
            for indices in plan:
                index = torch.as_tensor(indices) % samples

                def fill(slot: tuple[torch.Tensor, torch.Tensor], index=index) -> None:
                    torch.index_select(images, 0, index, out=slot[0])
                    torch.index_select(labels, 0, index, out=slot[1])
                    if dataset.produce_s:
                        time.sleep(dataset.produce_s)

                layout = (TensorSpec((len(index), *shape), torch.uint8),
                          TensorSpec((len(index),), torch.int64))
                yield Fill(layout, fill)

    rows: list[dict[str, Any]] = []
    ideal_s = run_loop(iter(lambda: None, 1), step, device, steps, move=False)[0]

    def record(name: str, wall: float, waited: float) -> None:
        rows.append({
            "feed": name, "wall_s": wall, "wait_share": waited / wall,
            "overhead": max(0.0, 1 - ideal_s / wall), "batches_per_s": steps / wall,
        })

    record("step alone (no data)", ideal_s, 0.0)
    for workers in (0, args.workers):
        loader = torch_loader(workers, pin=cuda)
        label = f"torch DataLoader(num_workers={workers}, pin_memory={cuda}) + .to(non_blocking)"
        record(label, *run_loop(endless(loader), step, device, steps, move=True))
        del loader
    with Prefetcher(None, device, depth=args.depth) as prefetcher:
        batches = prefetcher.epoch(endless(torch_loader(0, pin=False)))
        record(f"gpuload Prefetcher(depth={args.depth}) over DataLoader(num_workers=0)",
               *run_loop(batches, step, device, steps, move=False))
        batches = prefetcher.epoch(gather_fills())
        record(f"gpuload Prefetcher(depth={args.depth}), Fill: gather into the slot",
               *run_loop(batches, step, device, steps, move=False))

    print(f"device {device}; batch {batch_size} x {shape} uint8 = {batch_mb:.2f} MB; "
          f"step {args.step_ms} ms; source {args.produce_ms} ms/batch; {steps} steps")
    width = max(len(r["feed"]) for r in rows)
    print(f"{'feed':<{width}}  {'wall s':>7}  {'wait %':>7}  {'overhead %':>10}  {'batch/s':>8}")
    for r in rows:
        print(f"{r['feed']:<{width}}  {r['wall_s']:7.3f}  {100 * r['wait_share']:7.1f}  "
              f"{100 * r['overhead']:10.1f}  {r['batches_per_s']:8.1f}")

    result: dict[str, Any] = {"device": str(device), "batch_mb": batch_mb, "rows": rows}
    if cuda:
        nbytes = (16 if args.quick else 64) << 20
        repeats = 20 if args.quick else 50
        peak = h2d_bandwidth(device, nbytes, repeats)
        pageable = h2d_bandwidth(device, nbytes, repeats, pinned=False)
        through = prefetcher_bandwidth(device, nbytes, repeats, gather=False)
        gathered = prefetcher_bandwidth(device, nbytes, repeats, gather=True)
        result["h2d"] = {"pinned_peak_gbps": peak, "pageable_gbps": pageable, "prefetcher_gbps": through,
                         "prefetcher_with_gather_gbps": gathered, "batch_bytes": nbytes}
        print(f"\nhost-to-device, {nbytes >> 20} MiB batches:")
        print(f"  pinned copy peak (this machine)      {peak:7.2f} GB/s")
        print(f"  pageable copy (this machine)         {pageable:7.2f} GB/s")
        print(f"  prefetcher, slot copy only           {through:7.2f} GB/s "
              f"({100 * through / peak:.0f}% of peak; target >= 85%)")
        print(f"  prefetcher, host gather + copy       {gathered:7.2f} GB/s "
              f"({100 * gathered / peak:.0f}%; bounded by host memcpy)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(result, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
