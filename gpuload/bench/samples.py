"""Many small samples through the sample cache: ``gpuload bench --scenario samples``.

A generic map-style dataset (any ``__getitem__``, here ``(torch.full((8,), i), i)``) is what
gpuload cannot gather from directly: torch fetches and collates, and ``cache="host"`` keeps the
samples by column. Measured side by side with torch's DataLoader in one process, interleaved
round by round (the machine may be busy): torch's epoch, gpuload's first (filling) epoch, its
cached epochs, and the process's resident memory growth while the cache is held; then one more
cached epoch, untimed, with the loader's timeline on: where its time goes (the chart's stage
panel, as the main bench draws it). Targets
(issue 17): filling at most 1.3x torch's epoch, a cached epoch at least 5x faster than torch's,
memory growth at most 2x the data's bytes + 64 MiB.
"""

from __future__ import annotations

import gc
import os
import statistics
import textwrap
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

import gpuload
from gpuload.bench.measure import stage_row, synchronize
from gpuload.bench.report import WIDTH, display_name, save_figure, stages_panel, write_json
from gpuload.transfer import move_to_device

__all__ = ["SampleRun", "SmallSamples", "draw_samples_chart", "format_samples", "run_samples", "run_samples_bench",
           "samples_headline", "targets_met"]

FILL_TARGET = 1.3  # filling epoch / torch epoch, at most
CACHED_TARGET = 5.0  # torch epoch / cached epoch, at least
MEMORY_SLACK = 64 << 20  # bytes allowed beyond 2x the data


class SmallSamples(Dataset):
    """``(torch.full((8,), i), i)``: 72 bytes per sample once collated (int64 x 8, int64)."""

    sample_bytes = 8 * 8 + 8

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.full((8,), index), index


def resident_bytes() -> int:
    """This process's resident memory now (Linux ``/proc/self/statm``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass
class SampleRun:
    """One dataset size and worker count, every round's times (seconds) and memory growth."""

    num_samples: int
    num_workers: int
    batch_size: int
    torch_s: list[float]
    fill_s: list[float]
    cached_s: list[float]
    rss_growth_bytes: list[int]
    layout: str
    torch_cpu_s: list[float] = field(default_factory=list)
    fill_cpu_s: list[float] = field(default_factory=list)
    stages: dict[str, Any] | None = None  # the last round's traced cached epoch (stage_row)

    @property
    def label(self) -> str:
        return f"{self.num_samples:,} samples, num_workers={self.num_workers}"

    @property
    def data_bytes(self) -> int:
        return self.num_samples * SmallSamples.sample_bytes

    @property
    def fill_ratio(self) -> float:
        return statistics.median(self.fill_s) / statistics.median(self.torch_s)

    @property
    def fill_cpu_ratio(self) -> float | None:
        """Filling / torch in CPU seconds (this process and its finished workers): what a busy
        machine's other processes cannot inflate."""
        torch_cpu = statistics.median(self.torch_cpu_s) if self.torch_cpu_s else 0.0
        if not self.fill_cpu_s or torch_cpu <= 0:  # os.times() counts in clock ticks (10 ms)
            return None
        return statistics.median(self.fill_cpu_s) / torch_cpu

    @property
    def cached_speedup(self) -> float:
        return statistics.median(self.torch_s) / statistics.median(self.cached_s)

    @property
    def memory_limit(self) -> int:
        return 2 * self.data_bytes + MEMORY_SLACK

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "data_bytes": self.data_bytes, "fill_ratio": self.fill_ratio,
                "fill_cpu_ratio": self.fill_cpu_ratio,
                "cached_speedup": self.cached_speedup, "memory_limit_bytes": self.memory_limit,
                "targets_met": targets_met(self)}


def targets_met(run: SampleRun) -> dict[str, bool]:
    return {
        "fill": run.fill_ratio <= FILL_TARGET,
        "cached": run.cached_speedup >= CACHED_TARGET,
        "memory": max(run.rss_growth_bytes) <= run.memory_limit,
    }


def _cpu_s() -> float:
    """CPU seconds of this process and of its children that have finished (torch's workers)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def _timed(batches: Iterable[Any], device: torch.device, move: bool, cpu: list[float] | None = None) -> float:
    """Seconds for one epoch, batches on ``device`` (``move``: copied there as a tuned loop
    does); the CPU seconds it took are appended to ``cpu``."""
    synchronize(device)
    cpu_started = _cpu_s()
    started = time.perf_counter()
    for batch in batches:
        if move and device.type == "cuda":
            batch = move_to_device(batch, device, non_blocking=True)
        del batch
    synchronize(device)
    if cpu is not None:
        cpu.append(_cpu_s() - cpu_started)
    return time.perf_counter() - started


def run_samples(num_samples: int, num_workers: int, batch_size: int, device: torch.device, rounds: int,
                cached_epochs: int = 3, seed: int = 0) -> SampleRun:
    """Interleave, ``rounds`` times: one torch epoch, then a fresh gpuload loader's filling epoch
    and ``cached_epochs`` cached ones, its resident memory growth read while it holds the cache;
    after the last round, one more cached epoch traced (``stages``)."""
    dataset = SmallSamples(num_samples)
    run = SampleRun(num_samples, num_workers, batch_size, [], [], [], [], "")
    for round_ in range(rounds):
        theirs = TorchDataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=num_workers,
                                 pin_memory=device.type == "cuda",
                                 generator=torch.Generator().manual_seed(seed + round_))
        run.torch_s.append(_timed(theirs, device, move=True, cpu=run.torch_cpu_s))
        del theirs
        gc.collect()
        before = resident_bytes()
        ours = gpuload.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=num_workers,
                                  generator=torch.Generator().manual_seed(seed + round_), device=device,
                                  cache="host")
        run.fill_s.append(_timed(ours, device, move=False, cpu=run.fill_cpu_s))
        cached = [_timed(ours, device, move=False) for _ in range(cached_epochs)]
        run.cached_s.append(statistics.median(cached))
        gc.collect()
        run.rss_growth_bytes.append(resident_bytes() - before)
        run.layout = ours.stats.extra.get("sample_cache_decision", "")
        if not ours.stats.extra.get("cache", {}).get("complete"):
            raise RuntimeError(f"gpuload's sample cache did not fill: {ours.stats.extra}")
        if round_ == rounds - 1:
            run.stages = stage_row(run.label, ours, device)
        ours.close()
        del ours
    return run


def format_samples(runs: list[SampleRun]) -> str:
    """A table of every run against the targets, in at most 100 columns."""
    mib = 2**20
    header = (
        f"{'samples':>9} {'workers':>7} {'torch s':>8} {'fill s':>8} {'fill/torch':>10} {'(cpu)':>6} "
        f"{'cached s':>9} {'x faster':>8} {'RSS +MiB':>9}  targets"
    )
    lines = [header, "-" * len(header)]
    for run in runs:
        missed = [name for name, ok in targets_met(run).items() if not ok]
        lines.append(
            f"{run.num_samples:>9,} {run.num_workers:>7} {statistics.median(run.torch_s):>8.3f} "
            f"{statistics.median(run.fill_s):>8.3f} {run.fill_ratio:>10.2f} {_ratio(run.fill_cpu_ratio):>6} "
            f"{statistics.median(run.cached_s):>9.3f} {run.cached_speedup:>8.1f} "
            f"{max(run.rss_growth_bytes) / mib:>9.1f}  {'MISSED' if missed else 'all met'}"
        )
        if missed:  # on a line of its own: the names would push the row past 100 columns
            lines.append(f"{'':>9} missed: {', '.join(missed)}")
    notes = (
        f"targets: filling <= {FILL_TARGET}x torch's epoch, cached >= {CACHED_TARGET:.0f}x faster than torch's, "
        "RSS growth <= 2x the data + 64 MiB (medians over rounds; RSS: the largest round). (cpu): the "
        "filling ratio in CPU seconds of this process and its workers, which other processes on a busy "
        "machine do not inflate."
    )
    lines += textwrap.wrap(notes, WIDTH)
    if runs:
        lines += textwrap.wrap(f"stored: {runs[-1].layout}", WIDTH, subsequent_indent="    ")
    return "\n".join(lines)


def samples_headline(runs: list[dict[str, Any]]) -> str:
    """The result in words, for the largest run without workers (else the first)."""
    if not runs:
        return ""
    run = next((r for r in runs if r["num_workers"] == 0), runs[0])
    mib = 2**20
    return (
        f"gpuload: cached epochs {run['cached_speedup']:.1f}x faster than torch's DataLoader, the filling "
        f"epoch {run['fill_ratio']:.2f}x torch's, +{max(run['rss_growth_bytes']) / mib:.0f} MiB resident for "
        f"{run['data_bytes'] / mib:.0f} MiB of data ({run['num_samples']:,} samples, num_workers="
        f"{run['num_workers']}) on this machine"
    )


def draw_samples_chart(runs: list[dict[str, Any]], title: str) -> Any:
    """Seconds per epoch, log scale, for each run: torch's epoch, gpuload's filling epoch and a
    cached one (each bar's gid is ``"<kind>:<run label>"``); beside them, for runs that traced a
    cached epoch, the stage panel (:func:`gpuload.bench.report.stages_panel`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = (("torch", "torch_s", "#8c8c8c", "torch DataLoader"),
             ("fill", "fill_s", "#9db8de", "gpuload, filling epoch"),
             ("cached", "cached_s", "#3b6fb6", "gpuload, cached epoch"))
    traced = [run["stages"] for run in runs if run.get("stages")]  # a document from before has none
    figure, axes = plt.subplots(1, 2 if traced else 1, figsize=(17 if traced else 9, 1.8 + 1.1 * len(runs)),
                                squeeze=False, gridspec_kw={"width_ratios": [9, 8] if traced else [1]})
    axis = axes[0][0]
    labels, positions = [], []
    for row, run in enumerate(runs):
        label = f"{run['num_samples']:,} samples, num_workers={run['num_workers']}"
        labels.append(label)
        positions.append(row)
        for k, (kind, key, color, name) in enumerate(kinds):
            seconds = statistics.median(run[key])
            spread = (min(run[key]), max(run[key]))
            bar = axis.barh(row + (k - 1) * 0.27, seconds, height=0.25, color=color, label=name if row == 0 else None,
                            xerr=[[seconds - spread[0]], [spread[1] - seconds]], capsize=2)[0]
            bar.set_gid(f"{kind}:{label}")
            axis.annotate(f"{seconds:.3g} s", (seconds, row + (k - 1) * 0.27), xytext=(4, 0),
                          textcoords="offset points", va="center", fontsize=8)
    axis.set_xscale("log")
    longest = max((max(run[key]) for run in runs for _, key, _, _ in kinds), default=1.0)
    axis.set_xlim(right=longest * 4)  # room for the labels beside the longest bar
    axis.set_yticks(positions, labels)
    axis.invert_yaxis()
    axis.set_xlabel("seconds per epoch (log scale; whiskers: the rounds' range)")
    axis.set_title(title, fontsize=10)
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=8, frameon=False)
    if traced:
        stages_panel(axes[0][1], traced)
        axes[0][1].set_yticks(range(len(traced)), [display_name(row["name"]) for row in traced])
        axes[0][1].invert_yaxis()
    figure.tight_layout()
    return figure


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def scenario_runs(quick: bool, samples: int | None) -> list[tuple[int, int]]:
    """(samples, num_workers) pairs: the issue's 400k in the loop and 1M with two workers."""
    if samples:
        return [(samples, 0), (samples, 2)]
    return [(100_000, 0), (200_000, 2)] if quick else [(400_000, 0), (1_000_000, 2)]


def run_samples_bench(quick: bool, samples: int | None, batch_size: int | None, device: torch.device,
                      out: Path, environment: dict[str, Any], quiet: bool = False) -> int:
    """``gpuload bench --scenario samples``: run, print the table and the headline, write
    ``bench.json`` and ``bench.png``; 0. ``quiet``: only the headline and where the files are."""
    batch_size = batch_size or 256
    rounds = 1 if quick else 3
    say = (lambda *lines: None) if quiet else (lambda *lines: print(*lines, sep="\n", flush=True))
    say(*textwrap.wrap(f"gpuload bench: samples (torch.full((8,), i), i), batch {batch_size}, shuffled, "
                       f"cache='host', {rounds} round(s) of torch epoch / gpuload filling + 3 cached epochs, "
                       f"on {device}", WIDTH, subsequent_indent="    "))
    runs = []
    for num_samples, workers in scenario_runs(quick, samples):
        runs.append(run_samples(num_samples, workers, batch_size, device, rounds))
        say(f"  done: {num_samples:,} samples, num_workers={workers}")
    say("", format_samples(runs), "")
    documents = [run.as_dict() for run in runs]
    write_json(out / "bench.json", {"scenario": "samples", "environment": environment, "runs": documents})
    title = f"gpuload bench: samples, batch {batch_size}, {device}"
    save_figure(out / "bench.png", draw_samples_chart(documents, title))
    print(*textwrap.wrap(samples_headline(documents), WIDTH, subsequent_indent="    "), sep="\n")
    print(f"results: {out / 'bench.json'}; chart: {out / 'bench.png'}")
    return 0
