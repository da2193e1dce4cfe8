"""Arrow, Parquet and Hugging Face datasets: ``gpuload bench --scenario arrow``.

A synthetic table (a 768-float embedding, an int64 label and a variable-length int32 token
column; 1M rows, a small one with ``--quick``) saved with ``datasets``' ``save_to_disk`` and as
Parquet, in a temporary folder removed after. Each loader serves the fixed-width columns
(``with_format("torch", columns=["embedding", "label"])``: torch's default collate cannot stack
token lists of different lengths) for whole epochs, shuffled where the loader shuffles:
gpuload's DataLoader over the ``datasets.Dataset`` loaded back memory-mapped and over
``Parquet(path, columns=...)``; torch's DataLoader over the same ``datasets.Dataset`` with 0
and 2 workers; and ``dataset.iter(batch_size=...)``, the fastest path ``datasets`` itself
offers (in order, no shuffle). Reported: samples/s of the first epoch (gpuload places the
columns then: the first epoch's time counts making the DataLoader, which reads the Parquet file and
makes the columns) and of the later ones (served from the cache), and the ratios against torch's
with 0 workers and ``dataset.iter``. Targets (issue 39): at least 20x torch with 0 workers and
2x ``dataset.iter`` once cached; the first epoch no slower than torch with 2 workers.
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader as TorchDataLoader

import gpuload
from gpuload.bench.measure import stage_row, synchronize
from gpuload.bench.report import WIDTH, busy_note, write_json, write_stages_chart
from gpuload.bench.tokens import shutdown_workers
from gpuload.cache import format_bytes
from gpuload.datasets.arrow import Parquet, import_optional

__all__ = ["ArrowConfig", "ArrowRow", "run_arrow", "run_arrow_bench", "write_synthetic_table"]

TORCH_TARGET = 20.0  # gpuload cached / torch's DataLoader with 0 workers, at least
ITER_TARGET = 2.0  # gpuload cached / dataset.iter, at least
SERVED = ["embedding", "label"]


@dataclass(frozen=True)
class ArrowConfig:
    """What one run measures (recorded in the JSON)."""

    rows: int = 1_000_000
    width: int = 768
    max_tokens: int = 64
    batch_size: int = 512
    epochs: int = 3
    torch_workers: tuple[int, ...] = (0, 2)
    seed: int = 0

    @classmethod
    def quick(cls) -> ArrowConfig:
        return cls(rows=20_000, epochs=2)


@dataclass
class ArrowRow:
    """One loader: seconds of each whole epoch (the first one places gpuload's cache)."""

    name: str
    seconds: list[float] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)
    stages: dict[str, Any] | None = None  # a gpuload loader's one more epoch, traced (stage_row)

    def first_per_s(self, config: ArrowConfig) -> float:
        return config.rows / self.seconds[0]

    def later_per_s(self, config: ArrowConfig) -> float:
        """Samples/s of the epochs after the first (the first's when there is one epoch)."""
        return config.rows / statistics.median(self.seconds[1:] or self.seconds)

    def as_dict(self, config: ArrowConfig) -> dict[str, Any]:
        return {**self.__dict__, "first_epoch_samples_per_s": self.first_per_s(config),
                "later_epochs_samples_per_s": self.later_per_s(config)}


def write_synthetic_table(folder: Path, config: ArrowConfig) -> tuple[Path, Path]:
    """The table written as one Parquet file in slices of 64k rows (the host holds one slice at
    a time), then read back by ``datasets`` (its Arrow cache in ``folder``) and saved with
    ``save_to_disk`` (a folder)."""
    pa = import_optional("pyarrow")
    pq = import_optional("pyarrow.parquet")
    datasets = import_optional("datasets")
    datasets.disable_progress_bars()
    rng = np.random.default_rng(config.seed)
    parquet = folder / "table.parquet"
    writer = None
    for start in range(0, config.rows, 1 << 16):
        count = min(1 << 16, config.rows - start)
        embedding = rng.standard_normal(count * config.width, dtype=np.float32)
        lengths = rng.integers(1, config.max_tokens + 1, count)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        part = pa.table({
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(embedding), config.width),
            "label": pa.array(rng.integers(0, 1000, count)),
            "tokens": pa.ListArray.from_arrays(pa.array(offsets),
                                               pa.array(rng.integers(0, 50257, int(offsets[-1]), dtype=np.int32))),
        })
        if writer is None:
            writer = pq.ParquetWriter(parquet, part.schema)
        writer.write_table(part)
    assert writer is not None
    writer.close()
    saved = folder / "saved"
    datasets.Dataset.from_parquet(str(parquet), cache_dir=str(folder / "cache")).save_to_disk(str(saved))
    return saved, parquet


def _epoch_seconds(batches: Callable[[], Iterable[Any]], device: torch.device, move: bool) -> float:
    """Seconds for one whole epoch, each batch on ``device`` (``move``: copied there, as a loop does)."""
    synchronize(device)
    started = time.perf_counter()
    for batch in batches():
        if move and device.type == "cuda":
            batch = {name: value.to(device, non_blocking=True) for name, value in batch.items()}
        del batch
    synchronize(device)
    return time.perf_counter() - started


def run_arrow(config: ArrowConfig, device: torch.device, folder: Path,
              say: Callable[[str], None] = lambda line: None) -> list[ArrowRow]:
    """Write the table into ``folder`` and time every loader for ``config.epochs`` epochs."""
    datasets = import_optional("datasets")
    saved, parquet = write_synthetic_table(folder, config)
    dataset = datasets.load_from_disk(str(saved)).with_format("torch", columns=SERVED)
    rows: list[ArrowRow] = []

    def generator() -> torch.Generator:
        return torch.Generator().manual_seed(config.seed)

    def timed(name: str, batches: Callable[[], Iterable[Any]], move: bool, close: Callable[[], None],
              epochs: int = config.epochs) -> ArrowRow:
        row = ArrowRow(name)
        gc.collect()
        try:
            for _ in range(epochs):
                row.seconds.append(_epoch_seconds(batches, device, move))
        finally:
            close()
        rows.append(row)
        return row

    for name, read in (("gpuload DataLoader (datasets.Dataset)", lambda: dataset),
                       ("gpuload DataLoader (Parquet)", lambda: Parquet(parquet, columns=SERVED))):
        began = time.perf_counter()  # reading the Parquet file and making the columns count in the first epoch
        loader = gpuload.DataLoader(read(), batch_size=config.batch_size, shuffle=True, generator=generator(),
                                    device=device)
        made_s = time.perf_counter() - began
        row = timed(name, _always(loader), False, _nothing)
        row.seconds[0] += made_s
        row.notes.update(path=loader.stats.path, cache_plan=loader.stats.extra.get("cache_plan"), made_s=made_s)
        row.stages = stage_row(name, loader, device)
        loader.close()
        say(f"  {name}: {row.first_per_s(config):,.0f} samples/s in the first epoch")
    for workers in config.torch_workers:
        theirs = TorchDataLoader(dataset, batch_size=config.batch_size, shuffle=True, num_workers=workers,
                                 pin_memory=device.type == "cuda", persistent_workers=workers > 0,
                                 generator=generator())
        # torch's epochs cost the same each time: one is timed (an epoch of 1M rows with 0 workers
        # takes minutes on 2 cores)
        row = timed(f"torch DataLoader (num_workers={workers})", _always(theirs), True, shutdown_workers(theirs),
                    epochs=1)
        say(f"  {row.name}: {row.first_per_s(config):,.0f} samples/s")
    row = timed("datasets' dataset.iter(batch_size)", lambda: dataset.iter(batch_size=config.batch_size), True,
                _nothing, epochs=1)
    say(f"  {row.name}: {row.first_per_s(config):,.0f} samples/s")
    return rows


def _always(loader: Iterable[Any]) -> Callable[[], Iterable[Any]]:
    """An epoch factory giving ``loader`` (a DataLoader is its own epochs)."""
    return lambda: loader


def _nothing() -> None:
    """Closes nothing (the loader is closed by its caller, or holds nothing)."""


def ratios(rows: list[ArrowRow], config: ArrowConfig) -> dict[str, float]:
    """gpuload's (over the datasets.Dataset) samples/s against torch's and dataset.iter's."""
    by_name = {row.name: row for row in rows}
    ours = by_name["gpuload DataLoader (datasets.Dataset)"]
    iterated = by_name["datasets' dataset.iter(batch_size)"].first_per_s(config)
    found = {"cached_vs_dataset_iter": ours.later_per_s(config) / iterated}
    torch0 = by_name.get("torch DataLoader (num_workers=0)")
    if torch0 is not None:
        found["cached_vs_torch_0_workers"] = ours.later_per_s(config) / torch0.first_per_s(config)
    torch2 = by_name.get("torch DataLoader (num_workers=2)")
    if torch2 is not None:
        found["first_epoch_vs_torch_2_workers"] = ours.first_per_s(config) / torch2.first_per_s(config)
    return found


def format_arrow(rows: list[ArrowRow], config: ArrowConfig) -> str:
    """A table of every loader, within 100 columns."""
    header = f"{'loader':<40} {'1st epoch/s':>12} {'later/s':>12} {'x torch0':>9}"
    lines = [header, "-" * len(header)]
    base_row = next((row for row in rows if row.name == "torch DataLoader (num_workers=0)"), rows[0])
    base = base_row.first_per_s(config)
    for row in rows:
        later = f"{row.later_per_s(config):>12,.0f}" if len(row.seconds) > 1 else f"{'':>12}"
        lines.append(f"{row.name:<40} {row.first_per_s(config):>12,.0f} {later} "
                     f"{row.later_per_s(config) / base:>9.1f}")
    lines += textwrap.wrap("later/s: the epochs after the first (gpuload serves them from its cache); torch's "
                           "loaders and dataset.iter run one epoch (theirs cost the same each time)", WIDTH)
    return "\n".join(lines)


def arrow_headline(found: dict[str, float], load_average: tuple[float, ...] | None) -> str:
    parts = []
    if "cached_vs_torch_0_workers" in found:
        parts.append(f"{found['cached_vs_torch_0_workers']:.1f}x torch's DataLoader (num_workers=0; target "
                     f"{TORCH_TARGET:.0f}x)")
    parts.append(f"{found['cached_vs_dataset_iter']:.1f}x dataset.iter (target {ITER_TARGET:.0f}x) once cached")
    if "first_epoch_vs_torch_2_workers" in found:
        parts.append(f"first epoch {found['first_epoch_vs_torch_2_workers']:.1f}x torch with 2 workers "
                     "(target 1x)")
    load = f", load average {load_average[0]:.2f}" if load_average else ""
    return "gpuload over a datasets.Dataset: " + ", ".join(parts) + load


def run_arrow_bench(quick: bool, batch_size: int | None, device: torch.device, out: Path,
                    environment: dict[str, Any], quiet: bool = False,
                    torch_workers: tuple[int, ...] | None = None, rows: int | None = None,
                    epochs: int | None = None) -> int:
    """``gpuload bench --scenario arrow``: run, print the table and the ratios, write
    ``bench.json`` and ``bench.png`` (the stage panel of gpuload's loaders, from one more epoch
    each, untimed, with the timeline on); 0. The table lives in a temporary folder, removed at the end."""
    config = ArrowConfig.quick() if quick else ArrowConfig()
    changes = {"batch_size": batch_size, "rows": rows, "epochs": epochs,
               "torch_workers": tuple(torch_workers) if torch_workers is not None else None}
    config = ArrowConfig(**{**config.__dict__, **{key: value for key, value in changes.items() if value is not None}})
    say = (lambda *lines: None) if quiet else (lambda *lines: print(*lines, sep="\n", flush=True))
    say(*textwrap.wrap(
        f"gpuload bench: arrow, a synthetic {config.rows:,}-row table ({config.width}-float embedding "
        f"{format_bytes(config.rows * config.width * 4)}, int64 label, up to {config.max_tokens} int32 tokens), "
        f"batch {config.batch_size}, on {device}", WIDTH, subsequent_indent="    "))
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    with tempfile.TemporaryDirectory(prefix="gpuload-arrow-") as folder:
        results = run_arrow(config, device, Path(folder), say)
    load_after = os.getloadavg() if hasattr(os, "getloadavg") else None
    found = ratios(results, config)
    say("", format_arrow(results, config), "")
    write_json(out / "bench.json", {
        "scenario": "arrow", "config": config.__dict__, "environment": environment,
        "load_average_before": load_before, "load_average_after": load_after,
        "targets": {"cached_vs_torch_0_workers": TORCH_TARGET, "cached_vs_dataset_iter": ITER_TARGET,
                    "first_epoch_vs_torch_2_workers": 1.0},
        "ratios": found, "results": [row.as_dict(config) for row in results],
        "stages": (traced := [row.stages for row in results if row.stages]),
    })
    write_stages_chart(out / "bench.png", traced, f"gpuload bench: arrow, batch {config.batch_size}, {device}")
    busy = busy_note(max(load_before[0], load_after[0]) if load_before and load_after else None, os.cpu_count())
    if busy:
        say(busy)
    print(*textwrap.wrap(arrow_headline(found, load_after), WIDTH, subsequent_indent="    "), sep="\n")
    print(f"results: {out / 'bench.json'}; chart: {out / 'bench.png'}")
    return 0
