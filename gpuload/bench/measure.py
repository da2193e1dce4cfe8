"""Measuring a loader: epoch times, time spent waiting for data vs stepping, memory peaks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from gpuload.timeline import DEFAULT_STEPS, Timeline, timeline_of

__all__ = ["EpochTimes", "time_epochs", "time_step", "trace_epoch", "stage_row", "synchronize", "count_samples",
           "HostPeak", "order_differences", "paired_overhead", "time_pairs"]


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so a timer reads finished work, not launched work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_samples(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, dict):
        return count_samples(next(iter(batch.values())))
    return count_samples(batch[0])


@dataclass
class EpochTimes:
    """Per-epoch wall time, time the loop waited inside ``next()`` and batch count; epoch 0 is the
    warm-up, kept apart."""

    wall_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)
    batches: int = 0
    samples_per_epoch: int = 0

    @property
    def first_s(self) -> float:
        return self.wall_s[0]

    @property
    def steady_s(self) -> list[float]:
        return self.wall_s[1:] or self.wall_s[:1]

    @property
    def median_s(self) -> float:
        return statistics.median(self.steady_s)

    @property
    def spread_s(self) -> float:
        """Half the range of the steady epochs: the +- shown beside the median."""
        steady = self.steady_s
        return (max(steady) - min(steady)) / 2

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_epoch / self.median_s if self.median_s > 0 else float("inf")

    @property
    def wait_per_step_s(self) -> float:
        """The loop's exposed wait per step: the median steady epoch's time inside ``next()``, per
        batch (measured around the loop, the same way for every loader)."""
        steady = self.wait_s[1:] or self.wait_s[:1]
        return statistics.median(steady) / self.batches if steady and self.batches else 0.0

    def wait_share(self, step_s: float) -> float:
        """Share of a steady epoch not spent in training steps: the loop waiting for data.

        ``step_s`` is the step's own duration, measured on a batch already on the device, so
        asynchronous GPU work is attributed correctly without synchronising every batch.
        """
        busy = self.batches * step_s
        return min(1.0, max(0.0, 1.0 - busy / self.median_s)) if self.median_s > 0 else 0.0


_END = object()


def time_epochs(
    make_epoch: Callable[[], Iterable[Any]],
    device: torch.device,
    epochs: int,
    step: Callable[[Any], None] | None = None,
    on_epoch: Callable[[int], None] = lambda _: None,
) -> EpochTimes:
    """Run one warm-up epoch plus ``epochs`` timed ones, each timed with the device synchronised."""
    times = EpochTimes()
    for epoch in range(epochs + 1):
        synchronize(device)
        started = time.perf_counter()
        samples = batches = 0
        waited = 0.0
        batches_of = iter(make_epoch())
        while True:
            asked = time.perf_counter()
            batch = next(batches_of, _END)
            if batch is _END:
                break
            waited += time.perf_counter() - asked
            samples += count_samples(batch)
            batches += 1
            if step is not None:
                step(batch)
        synchronize(device)
        times.wall_s.append(time.perf_counter() - started)
        times.wait_s.append(waited)
        times.samples_per_epoch, times.batches = samples, batches
        on_epoch(epoch)
    return times


def trace_epoch(
    make_epoch: Callable[[], Iterable[Any]], timeline: Timeline, device: torch.device,
    step: Callable[[Any], None] | None = None,
) -> dict[str, float]:
    """Each stage's mean ms per step over one more epoch, untimed, with the loader's timeline on.

    The timed epochs ran with the timeline as the loader has it (off by default), so its cost
    stays out of their times; this steady epoch, with the same step, says where the loader's time
    goes, from every step's stages (not one in ``sample_every``). The timeline keeps this epoch's
    totals and is then as it was (on or off, its sampling).
    """
    capacity, every = timeline.capacity, timeline.sample_every
    timeline.resize(max(capacity, DEFAULT_STEPS))
    timeline.sample_every = 1
    timeline.reset_totals()
    try:
        for batch in make_epoch():
            if step is not None:
                step(batch)
        synchronize(device)
    finally:
        timeline.resize(capacity)
        timeline.sample_every = every
    return {name: 1e3 * seconds for name, seconds in timeline.stage_seconds().items()}


def stage_row(name: str, loader: Iterable[Any], device: torch.device, steps: int | None = None) -> dict[str, Any]:
    """The stage panel's row (:func:`gpuload.bench.report.stages_panel`) of a gpuload ``loader``: one
    more epoch (its first ``steps`` steps, if given), untimed, traced (:func:`trace_epoch`), and the
    wait per step inside ``next()`` over it."""
    timeline = timeline_of(loader)
    if timeline is None:
        raise ValueError(f"{name}: {type(loader).__name__} is not a gpuload loader: it has no timeline to trace")
    waits: list[float] = []

    def epoch() -> Iterator[Any]:
        batches = iter(loader)
        while steps is None or len(waits) < steps:
            started = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            waits.append(time.perf_counter() - started)
            yield batch

    stage_ms = trace_epoch(epoch, timeline, device)
    wait_ms = 1e3 * statistics.fmean(waits) if waits else None
    return {"name": name, "kind": "gpuload", "wait_ms_per_step": wait_ms, "stage_ms_per_step": stage_ms}


def time_step(step: Callable[[Any], None], batch: Any, device: torch.device, repeats: int = 5) -> float:
    """Median seconds of one training step on a batch that is already where it will be used."""
    step(batch)
    durations = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        step(batch)
        synchronize(device)
        durations.append(time.perf_counter() - started)
    return statistics.median(durations)


def time_pairs(first: Callable[[], Any], second: Callable[[], Any], pairs: int, device: torch.device,
               clock: Callable[[], float] = time.perf_counter,
               prepare: Callable[[bool], None] | None = None) -> tuple[list[float], list[float]]:
    """Seconds of one call of ``first`` and of ``second`` in each of ``pairs`` pairs, ``first``
    leading in the even pairs and ``second`` in the odd ones, so that drift in the machine's load
    falls on both alike (device work finished before each timer reads). ``clock``: what a second
    is read from (``time.thread_time``: this thread's CPU time); ``prepare(is_first)`` runs
    untimed before each call (switching a setting between the two)."""
    timed: dict[bool, list[float]] = {True: [], False: []}  # by whether it is ``first``'s time
    for pair in range(pairs):
        for is_first in (True, False) if pair % 2 == 0 else (False, True):
            if prepare is not None:
                prepare(is_first)
            synchronize(device)
            started = clock()
            (first if is_first else second)()
            synchronize(device)
            timed[is_first].append(clock() - started)
    return timed[True], timed[False]


def order_differences(new: list[float], base: list[float]) -> tuple[float, float]:
    """The median paired difference ``new - base`` of the pairs ``new`` led (the even ones, as
    :func:`time_pairs` runs them) and of those ``base`` led."""
    if len(new) != len(base) or len(new) < 2:
        raise ValueError(f"paired times need as many of each, at least 2 pairs; got {len(new)} and "
                         f"{len(base)}")
    differences = [a - b for a, b in zip(new, base)]
    return statistics.median(differences[0::2]), statistics.median(differences[1::2])


def paired_overhead(new: list[float], base: list[float]) -> float:
    """What ``new`` costs over ``base``, as a share of ``base``'s median, from pairs timed by
    :func:`time_pairs` (``new`` leading in the even pairs): the median paired difference of each
    order (:func:`order_differences`), averaged. The call run second in a pair can be faster or
    slower for the order alone (caches, the allocator); averaging the orders cancels that, where
    one median over both could land anywhere between their two humps."""
    return statistics.fmean(order_differences(new, base)) / statistics.median(base)


class HostPeak:
    """Peak resident host memory of this process between ``reset()`` and ``read()`` (Linux)."""

    def reset(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
                refs.write("5")  # resets VmHWM to the current RSS
        except OSError:
            pass

    def read(self) -> int | None:
        try:
            with open("/proc/self/status", encoding="ascii") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None
