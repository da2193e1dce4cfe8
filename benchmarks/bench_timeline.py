"""What ``loader.timeline`` costs: a cached in-memory epoch with the timeline on and off, alternately.

One loader over the bench's CIFAR-shaped uint8 images and labels (50,000 of them, as ``gpuload
bench`` makes: 98 steps an epoch; batch 512, ``cache="auto"``),
warmed up (its first epoch places the arrays), its timeline switched between epochs
(``timeline.resize``: 1000 steps kept, stages timed on one step in ``--sample-every``, the default
64; or 0, off). One loader, not one of each: two loaders place two copies of the arrays, and which
copy gathers faster (where its memory landed) differs by about 2% from one process to the next,
ten times the timeline's cost. glibc's malloc thresholds are fixed first, as ``gpuload bench``
fixes them (:func:`gpuload.bench.run.steady_host_allocator`): left to adapt, they made some
epochs' 1.5 MB batches fresh mappings that page-fault, and the two orders of a pair disagreed by
more than the cost. torch's intra-op threads are set as ``gpuload bench`` sets them
(:func:`gpuload.cli.bench.default_threads`: one on a machine of two cores; with two there, on
2026-12-07, the step was about half the bench's and so was the timeline's cost in µs, its share
about the same). Then ``--pairs`` pairs of epochs, no training step (the worst
case: the loop does nothing but ask), timed by :func:`gpuload.bench.measure.time_pairs` (the
order within each pair alternating so that drift in the machine's load falls on both alike; the
switch untimed between epochs). It prints the median epoch per step of each, and the paired
difference per step (:func:`gpuload.bench.measure.paired_overhead`: the mean of its medians over
the pairs of each order), as a share of the median epoch without the timeline.

``--clock thread`` times each epoch with the loop thread's CPU time instead of the wall clock: on
a shared machine the wall clock also counts the time other processes held the CPU, noise tens of
times the timeline's cost, while the CPU path (in memory, on a CPU device) runs every batch in the
loop's thread. The wall clock (the default) is what a training loop sees.

Usage: python benchmarks/bench_timeline.py [--pairs 400] [--samples 50000] [--sample-every 64] [--device cpu]
       [--clock wall|thread] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch.utils.data import TensorDataset

import gpuload
from gpuload.bench.measure import order_differences, paired_overhead, time_pairs
from gpuload.bench.run import steady_host_allocator
from gpuload.bench.scenarios import BenchConfig, synthetic_cifar
from gpuload.cli.bench import default_threads
from gpuload.device import resolve_device
from gpuload.timeline import DEFAULT_SAMPLE_EVERY

CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
ON_STEPS = 1000  # steps the timeline keeps when on


def one_epoch(loader: gpuload.DataLoader) -> None:
    """One epoch of ``loader`` with nothing done per batch, its timeline then brought up to date
    (``step_count`` records the steps the loop logged: that pass is part of the cost, and would
    otherwise fall in the untimed switch)."""
    for _batch in loader:
        pass
    loader.timeline.step_count  # noqa: B018 (read for its effect)


def measure(pairs: int, samples: int, batch_size: int, device: torch.device,
            sample_every: int = DEFAULT_SAMPLE_EVERY, clock: str = "wall") -> dict[str, float | int | str]:
    """Alternating epochs with the timeline on and off (:func:`~gpuload.bench.measure.time_pairs`):
    per-step medians, the paired difference and its share
    (:func:`~gpuload.bench.measure.paired_overhead`)."""
    fixed_thresholds = steady_host_allocator()  # as gpuload bench does; see the module's docstring
    dataset: TensorDataset = synthetic_cifar(BenchConfig(num_samples=samples, batch_size=batch_size))
    loader = gpuload.DataLoader(dataset, batch_size=batch_size, shuffle=True, device=device, cache="auto",
                                timeline_steps=ON_STEPS, generator=torch.Generator().manual_seed(0))
    timeline = loader.timeline
    timeline.sample_every = sample_every

    def switch(on: bool) -> None:  # untimed, before each epoch: it takes effect from the next one
        timeline.resize(ON_STEPS if on else 0)

    for on in (True, False):
        switch(on)
        one_epoch(loader)  # the first places the arrays
    steps_per_epoch = len(loader)
    load_before = os.getloadavg()[0]
    on_s, off_s = time_pairs(lambda: one_epoch(loader), lambda: one_epoch(loader), pairs, device,
                             clock=CLOCKS[clock], prepare=switch)
    path = loader.stats.path
    loader.close()
    off_step = statistics.median(off_s) / steps_per_epoch
    overhead = paired_overhead(on_s, off_s)
    on_first, off_first = (difference / steps_per_epoch for difference in order_differences(on_s, off_s))
    return {
        "device": str(device), "path": path, "pairs": pairs, "steps_per_epoch": steps_per_epoch,
        "batch_size": batch_size, "sample_every": sample_every, "clock": clock, "off_us_per_step": 1e6 * off_step,
        "on_us_per_step": 1e6 * statistics.median(on_s) / steps_per_epoch,
        "paired_difference_us_per_step": 1e6 * overhead * off_step,
        "on_first_us_per_step": 1e6 * on_first, "off_first_us_per_step": 1e6 * off_first,
        "overhead_percent": 100 * overhead,
        "fixed_malloc_thresholds": fixed_thresholds, "torch_threads": torch.get_num_threads(),
        "load_before": load_before, "load_after": os.getloadavg()[0], "cpu_count": os.cpu_count() or 0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=400)
    parser.add_argument("--samples", type=int, default=BenchConfig().num_samples)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--sample-every", type=int, default=DEFAULT_SAMPLE_EVERY)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: the wall clock; thread: the loop thread's CPU time (see above)")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    threads = default_threads()  # as gpuload bench does (1 on a machine of 2 cores): for the process, as a CLI
    if threads is not None:
        torch.set_num_threads(threads)
    found = measure(args.pairs, args.samples, args.batch_size, resolve_device(args.device), args.sample_every,
                    args.clock)
    print(f"{found['pairs']} alternating pairs of {found['steps_per_epoch']}-step epochs on {found['device']} "
          f"(path {found['path']}, batch {found['batch_size']}, stages timed 1 step in {found['sample_every']}, "
          f"{found['clock']} clock), "
          f"load {found['load_before']:.1f} -> "
          f"{found['load_after']:.1f} on {found['cpu_count']} cores")
    print(f"timeline off: {found['off_us_per_step']:.1f} us/step; on: {found['on_us_per_step']:.1f} us/step; "
          f"paired difference {found['paired_difference_us_per_step']:.2f} us/step "
          f"(medians: timeline first {found['on_first_us_per_step']:.2f}, second {found['off_first_us_per_step']:.2f}) "
          f"= {found['overhead_percent']:.2f}% of the epoch")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(found, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
