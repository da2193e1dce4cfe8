"""LLM token windows: ``gpuload bench --scenario tokens``.

A synthetic uint16 token shard (the llm.c / nanoGPT-speedrun format, written to a temporary
folder and removed after) cut into windows of ``seq_len + 1``, served side by side in one
process, interleaved round by round (the machine may be busy): gpuload's DataLoader over a
:class:`~gpuload.TokenWindows`, torch's DataLoader over the same ``TokenWindows`` with 0 and 2
workers, and nanoGPT's ``get_batch`` loop (a memmap, ``torch.randint`` offsets, a Python loop
of slices, ``astype(int64)``, ``torch.stack``). Each loader runs the same number of steps per
round (a whole epoch of 100M tokens would take torch minutes on 2 cores); reported: samples/s,
tokens/s, the process's resident memory growth (and its anonymous part, without a memmap's
pages), and host-to-device bytes per step (measured on a GPU; on a CPU modelled for a pretended
card). After the last round, gpuload's loader runs as many steps more, untimed, with its
timeline on: the chart (``bench.png``) is the stage panel of the main bench. Targets (issue 26): gpuload at least 10x
torch's DataLoader with 0 workers and 5x ``get_batch``.
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader as TorchDataLoader

import gpuload
from gpuload.bench.measure import stage_row, synchronize
from gpuload.bench.modelled import DEFAULT_PRETENDED_CARD, pretended_card
from gpuload.bench.report import WIDTH, busy_note, write_json, write_stages_chart
from gpuload.bench.samples import resident_bytes
from gpuload.cache import CacheSettings, format_bytes
from gpuload.datasets.tokens import HEADER_BYTES, TokenWindows
from gpuload.device import MemoryInfo, host_memory
from gpuload.sources.tokens import row_tokens

__all__ = ["TokenConfig", "TokenRow", "get_batch_loop", "run_tokens", "run_tokens_bench", "shutdown_workers",
           "write_synthetic_shard"]

TORCH_TARGET = 10.0  # gpuload / torch's DataLoader with 0 workers, at least
GET_BATCH_TARGET = 5.0  # gpuload / nanoGPT's get_batch loop, at least


@dataclass(frozen=True)
class TokenConfig:
    """What one run measures (recorded in the JSON)."""

    num_tokens: int = 100_000_000
    seq_len: int = 1024
    batch_size: int = 32
    steps: int = 200
    rounds: int = 3
    torch_workers: tuple[int, ...] = (0, 2)
    seed: int = 0

    @classmethod
    def quick(cls) -> TokenConfig:
        return cls(num_tokens=2_000_000, steps=20, rounds=1)


@dataclass
class TokenRow:
    """One loader's rounds: seconds for ``steps`` batches, resident growth, H2D bytes per step."""

    name: str
    seconds: list[float] = field(default_factory=list)
    rss_growth_bytes: list[int] = field(default_factory=list)
    anon_growth_bytes: list[int] = field(default_factory=list)
    h2d_bytes_per_step: float = 0.0
    h2d_modelled: bool = False
    notes: dict[str, Any] = field(default_factory=dict)
    stages: dict[str, Any] | None = None  # gpuload's: its traced steps after the last round (stage_row)

    def samples_per_s(self, config: TokenConfig) -> float:
        return config.steps * config.batch_size / statistics.median(self.seconds)

    def as_dict(self, config: TokenConfig) -> dict[str, Any]:
        rate = self.samples_per_s(config)
        return {**self.__dict__, "samples_per_s": rate, "tokens_per_s": rate * config.seq_len}


def anonymous_bytes() -> int:
    """This process's resident anonymous memory (``RssAnon``): what it allocated, without the
    pages of mapped files, which the OS page cache holds and shares (0 where unknown)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    return 0


def write_synthetic_shard(path: Path, num_tokens: int, seed: int = 0, vocab: int = 50257) -> Path:
    """A uint16 shard of ``num_tokens`` random ids below ``vocab`` (GPT-2's), written in chunks."""
    rng = np.random.default_rng(seed)
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240520, 1, num_tokens)
    with open(path, "wb") as file:
        file.write(header.tobytes())
        for start in range(0, num_tokens, 1 << 24):
            count = min(1 << 24, num_tokens - start)
            file.write(rng.integers(0, vocab, size=count, dtype=np.uint16).tobytes())
    return path


def get_batch_loop(
    path: Path, config: TokenConfig, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """nanoGPT's ``get_batch``, as train.py writes it: a new memmap each step (it leaks
    otherwise), random offsets, one slice per row, ``astype(int64)``, stacked, then copied
    (pinned, non-blocking on a GPU)."""
    generator = torch.Generator().manual_seed(config.seed)
    block, batch = config.seq_len, config.batch_size
    while True:
        data = np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES)
        ix = torch.randint(len(data) - block, (batch,), generator=generator)
        x = torch.stack([torch.from_numpy(data[i : i + block].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block].astype(np.int64)) for i in ix])
        if device.type == "cuda":
            x = x.pin_memory().to(device, non_blocking=True)
            y = y.pin_memory().to(device, non_blocking=True)
        yield x, y


def _steps(batches: Iterator[Any], steps: int, device: torch.device, move: bool) -> float:
    """Seconds for ``steps`` batches, each on ``device`` (``move``: copied there, as a loop does)."""
    synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        batch = next(batches)
        if move and device.type == "cuda":
            batch = [t.to(device, non_blocking=True) for t in batch]
        del batch
    synchronize(device)
    return time.perf_counter() - started


def _batch_bytes(config: TokenConfig) -> int:
    """Bytes of one batch of (x, y) int64: what torch's loaders and get_batch copy per step."""
    return 2 * config.batch_size * config.seq_len * 8


def gpuload_modelled(config: TokenConfig, card: int) -> tuple[float, dict[str, Any]]:
    """H2D bytes per step gpuload would copy on a pretended card, from the cache plan of the
    token bytes (not the windows): 0 when the buffer fits the device tier, else each batch's
    uint16 windows."""
    settings = CacheSettings.resolve()
    memory = MemoryInfo(free=card, total=card)
    row = row_tokens(config.seq_len, config.num_tokens)  # the loader's row store, as it plans it
    rows = config.num_tokens // row
    plan = settings.array_plan(2 * row, rows, memory, host_memory(), device=pretended_card(card), shared=False)
    whole = plan.device_samples == rows
    per_step = 0.0 if whole else float(config.batch_size * (config.seq_len + 1) * 2)
    return per_step, {"cache_plan_modelled": plan.describe(), "cache_plan_modelled_for": pretended_card(card),
                      "fill_bytes_modelled": plan.fill_bytes}


def run_tokens(config: TokenConfig, device: torch.device, folder: Path, card: int = DEFAULT_PRETENDED_CARD,
               say: Callable[[str], None] = lambda line: None) -> list[TokenRow]:
    """Write the shard into ``folder`` and time every loader for ``config.rounds`` rounds."""
    path = write_synthetic_shard(folder / "synthetic_000000.bin", config.num_tokens, config.seed)
    dataset = TokenWindows(path, config.seq_len)
    rows = [TokenRow("gpuload DataLoader")] + [
        TokenRow(f"torch DataLoader (num_workers={w})") for w in config.torch_workers
    ] + [TokenRow("nanoGPT get_batch loop")]
    for round_ in range(config.rounds):
        for row in rows:
            gc.collect()
            before, anon_before = resident_bytes(), anonymous_bytes()
            seed = config.seed + round_
            closer: Callable[[], None] = _nothing
            if row.name.startswith("gpuload"):
                loader = gpuload.DataLoader(dataset, batch_size=config.batch_size, shuffle=True,
                                            generator=torch.Generator().manual_seed(seed), device=device)
                batches, move = iter(_forever(loader)), False
                closer = loader.close
            elif row.name.startswith("torch"):
                workers = int(row.name.split("=")[1].rstrip(")"))
                theirs = TorchDataLoader(dataset, batch_size=config.batch_size, shuffle=True, num_workers=workers,
                                         pin_memory=device.type == "cuda", persistent_workers=workers > 0,
                                         generator=torch.Generator().manual_seed(seed))
                batches, move = iter(_forever(theirs)), True
                closer = shutdown_workers(theirs)
            else:
                batches, move = get_batch_loop(path, config, device), False
            try:
                _steps(batches, max(2, config.steps // 10), device, move)  # warm-up: workers start, cache fills
                bytes_before = loader.stats.bytes_h2d if row.name.startswith("gpuload") else 0
                row.seconds.append(_steps(batches, config.steps, device, move))
                row.rss_growth_bytes.append(resident_bytes() - before)
                row.anon_growth_bytes.append(anonymous_bytes() - anon_before)
                if row.name.startswith("gpuload"):
                    if device.type == "cuda":
                        row.h2d_bytes_per_step = (loader.stats.bytes_h2d - bytes_before) / config.steps
                    else:
                        row.h2d_bytes_per_step, notes = gpuload_modelled(config, card)
                        row.h2d_modelled = True
                        row.notes.update(notes)
                    row.notes["path"] = loader.stats.path
                    row.notes["token_bytes"] = loader.stats.extra.get("tokens", {}).get("token_bytes")
                    if round_ == config.rounds - 1:
                        row.stages = stage_row(row.name, loader, device, config.steps)
                else:
                    row.h2d_bytes_per_step, row.h2d_modelled = _batch_bytes(config), device.type != "cuda"
            finally:
                closer()
                del batches
        say(f"  round {round_ + 1}/{config.rounds} done")
    del dataset
    return rows


def _nothing() -> None:
    """Closes a loader that holds nothing (the get_batch loop)."""


def _forever(loader: Any) -> Iterator[Any]:
    """Batches across epoch ends (a step count may pass one)."""
    while True:
        yield from loader


def shutdown_workers(loader: TorchDataLoader) -> Callable[[], None]:
    """A closer that stops a torch DataLoader's persistent workers, if it started any."""

    def close() -> None:
        iterator = loader._iterator
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()

    return close


def ratios(rows: list[TokenRow], config: TokenConfig) -> dict[str, float]:
    """gpuload's samples/s over torch's with 0 workers and over get_batch's."""
    rate = {row.name: row.samples_per_s(config) for row in rows}
    ours = rate["gpuload DataLoader"]
    found = {"vs_get_batch": ours / rate["nanoGPT get_batch loop"]}
    if "torch DataLoader (num_workers=0)" in rate:
        found["vs_torch_0_workers"] = ours / rate["torch DataLoader (num_workers=0)"]
    return found


def format_tokens(rows: list[TokenRow], config: TokenConfig) -> str:
    """A table of every loader, within 100 columns."""
    mib = 2**20
    header = (f"{'loader':<34} {'samples/s':>10} {'tokens/s':>12} {'x torch0':>8} {'RSS +MiB':>9} "
              f"{'anon +MiB':>9} {'H2D/step':>11}")
    lines = [header, "-" * len(header)]
    rates = {row.name: row.samples_per_s(config) for row in rows}
    base = rates.get("torch DataLoader (num_workers=0)") or next(iter(rates.values()))
    for row in rows:
        rate = rates[row.name]
        h2d = format_bytes(int(row.h2d_bytes_per_step)) + ("*" if row.h2d_modelled else "")
        lines.append(f"{row.name:<34} {rate:>10,.0f} {rate * config.seq_len:>12,.0f} {rate / base:>8.1f} "
                     f"{max(row.rss_growth_bytes) / mib:>9.1f} {max(row.anon_growth_bytes) / mib:>9.1f} {h2d:>11}")
    lines += textwrap.wrap("RSS: resident growth, mapped file pages included (a memmap's pages, shared with the "
                           "OS page cache); anon: memory the process allocated", WIDTH)
    if any(row.h2d_modelled for row in rows):
        lines += textwrap.wrap("*: modelled for a card (torch and get_batch: their int64 batch; gpuload: its "
                               "cache plan of the token bytes)", WIDTH)
    return "\n".join(lines)


def tokens_headline(found: dict[str, float], load_average: tuple[float, ...] | None) -> str:
    torch0 = found.get("vs_torch_0_workers")
    parts = [f"{torch0:.1f}x torch's DataLoader (num_workers=0; target {TORCH_TARGET:.0f}x)"] if torch0 else []
    parts.append(f"{found['vs_get_batch']:.1f}x nanoGPT's get_batch (target {GET_BATCH_TARGET:.0f}x)")
    load = f", load average {load_average[0]:.2f}" if load_average else ""
    return "gpuload over TokenWindows: " + ", ".join(parts) + load


def run_tokens_bench(quick: bool, batch_size: int | None, device: torch.device, out: Path,
                     environment: dict[str, Any], quiet: bool = False,
                     torch_workers: tuple[int, ...] | None = None, card: int | None = None) -> int:
    """``gpuload bench --scenario tokens``: run, print the table and the ratios, write
    ``bench.json`` and ``bench.png`` (the stage panel); 0. The shard lives in a temporary folder, removed at the end."""
    config = TokenConfig.quick() if quick else TokenConfig()
    if batch_size or torch_workers is not None:
        config = TokenConfig(**{**config.__dict__, **({"batch_size": batch_size} if batch_size else {}),
                                **({"torch_workers": tuple(torch_workers)} if torch_workers is not None else {})})
    say = (lambda *lines: None) if quiet else (lambda *lines: print(*lines, sep="\n", flush=True))
    say(*textwrap.wrap(
        f"gpuload bench: tokens, a synthetic {config.num_tokens:,}-token uint16 shard "
        f"({format_bytes(config.num_tokens * 2)}), seq_len {config.seq_len}, batch {config.batch_size}, shuffled, "
        f"{config.rounds} round(s) of {config.steps} steps per loader, on {device}", WIDTH, subsequent_indent="    "))
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    with tempfile.TemporaryDirectory(prefix="gpuload-tokens-") as folder:
        rows = run_tokens(config, device, Path(folder), card or DEFAULT_PRETENDED_CARD, say)
    load_after = os.getloadavg() if hasattr(os, "getloadavg") else None
    found = ratios(rows, config)
    say("", format_tokens(rows, config), "")
    write_json(out / "bench.json", {
        "scenario": "tokens", "config": config.__dict__, "environment": environment,
        "load_average_before": load_before, "load_average_after": load_after,
        "targets": {"vs_torch_0_workers": TORCH_TARGET, "vs_get_batch": GET_BATCH_TARGET},
        "ratios": found, "results": [row.as_dict(config) for row in rows],
        "stages": (traced := [row.stages for row in rows if row.stages]),
    })
    write_stages_chart(out / "bench.png", traced, f"gpuload bench: tokens, batch {config.batch_size}, {device}")
    busy = busy_note(max(load_before[0], load_after[0]) if load_before and load_after else None, os.cpu_count())
    if busy:
        say(busy)
    print(*textwrap.wrap(tokens_headline(found, load_after), WIDTH, subsequent_indent="    "), sep="\n")
    print(f"results: {out / 'bench.json'}; chart: {out / 'bench.png'}")
    return 0
