"""Packed documents: ``gpuload bench --scenario packing``.

A synthetic corpus of documents with log-normal lengths (``exp(N(log(median), sigma))`` tokens,
clipped to ``[2, max_tokens]``: by default median 400, sigma 1.0, mean about 660, 1% over
4,000; roughly what web text and SFT data look like), each begun by GPT-2's end-of-text id.
Served side by side in one process, rounds interleaved (the machine may be busy):

- gpuload's DataLoader over :class:`~gpuload.PackedTokens`, greedy and best-fit, batches of
  ``rows`` rows of ``seq_len``;
- gpuload over :class:`~gpuload.TokenWindows` of the same token stream and shape (no document
  boundaries): what packing costs per step on top of plain windows;
- torch's DataLoader padding each batch to its longest document (documents cut at ``seq_len``),
  with as many documents a batch as fill ``rows x seq_len`` tokens on average;
- a torchtune-style ``PackedDataset`` built ahead (greedy, a document that does not fit starts
  the next pack, as torchtune's default ``split_across_pack=False``; packs held as tensors),
  served by torch's DataLoader; its build time is reported apart;
- transformers' ``DataCollatorWithFlattening`` over a map-style dataset of token lists (as a
  ``datasets`` column hands them), under torch's DataLoader: one flattened row per batch.

Reported: document tokens per second (what training learns from: a batch's tokens less its
padding), the padding fraction, and seconds per step; after the last round, each gpuload loader
runs as many steps more, untimed, with its timeline on: the chart (``bench.png``) is the stage
panel of the main bench. Then the packing cost: ``pairs`` pairs of one greedy packed step and
one windows step, the order alternating within pairs (:func:`~gpuload.bench.measure.time_pairs`),
the paired difference as a share of a windows step (:func:`~gpuload.bench.measure.paired_overhead`):
a round's ratio moves by tens of percent on a busy machine, a paired one far less. Targets
(issue 38): padding under 1% greedy and 0.2% best-fit, gpuload's packed step within 5% of the
windows step, and at least 5x the collator's tokens/s.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

import gpuload
from gpuload.bench.measure import paired_overhead, stage_row, synchronize, time_pairs
from gpuload.bench.report import WIDTH, busy_note, write_json, write_stages_chart
from gpuload.datasets.packing import IGNORE_INDEX

__all__ = ["PackingConfig", "PackingCost", "PackingRow", "run_packing", "run_packing_bench", "synthetic_documents",
           "torchtune_style_packs"]

EOT = 50256  # GPT-2's <|endoftext|>
PADDING_TARGETS = {"greedy": 0.01, "best_fit": 0.002}
WINDOWS_OVERHEAD_TARGET = 0.05  # packed step over the windows step, at most
COLLATOR_TARGET = 5.0  # gpuload's tokens/s over DataCollatorWithFlattening's, at least


@dataclass(frozen=True)
class PackingConfig:
    """What one run measures (recorded in the JSON)."""

    documents: int = 20_000
    median_tokens: int = 400
    sigma: float = 1.0
    max_tokens: int = 16_384
    seq_len: int = 2048
    rows: int = 8
    steps: int = 40
    rounds: int = 3
    window: int = 4096
    seed: int = 0
    pairs: int = 400  # alternating pairs of a packed and a windows step, for the packing cost

    @classmethod
    def quick(cls) -> PackingConfig:
        return cls(documents=2_000, steps=10, rounds=1, pairs=50)


@dataclass
class PackingRow:
    """One loader's rounds: seconds for ``steps`` batches; its padding and document tokens a step."""

    name: str
    seconds: list[float] = field(default_factory=list)
    padding: float = 0.0
    tokens_per_step: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)
    stages: dict[str, Any] | None = None  # a gpuload loader's traced steps after the last round (stage_row)

    def tokens_per_s(self, config: PackingConfig) -> float:
        return config.steps * self.tokens_per_step / statistics.median(self.seconds)

    def as_dict(self, config: PackingConfig) -> dict[str, Any]:
        return {**self.__dict__, "tokens_per_s": self.tokens_per_s(config),
                "seconds_per_step": statistics.median(self.seconds) / config.steps}


@dataclass
class PackingCost:
    """Seconds of single greedy packed steps and windows steps timed in pairs, the packed step
    leading in the even pairs (:func:`~gpuload.bench.measure.time_pairs`)."""

    packed_s: list[float]
    windows_s: list[float]

    @property
    def pairs(self) -> int:
        return len(self.packed_s)

    @property
    def overhead(self) -> float:
        """A packed step over a windows step, less one (the paired difference over a windows step)."""
        return paired_overhead(self.packed_s, self.windows_s)

    def line(self) -> str:
        return f"packing cost: {self.overhead:+.1%} of a windows step (median of {self.pairs} pairs)"

    def as_dict(self) -> dict[str, Any]:
        return {"pairs": self.pairs, "overhead": self.overhead,
                "packed_ms_per_step": 1e3 * statistics.median(self.packed_s),
                "windows_ms_per_step": 1e3 * statistics.median(self.windows_s),
                "packed_s": self.packed_s, "windows_s": self.windows_s}


def synthetic_documents(config: PackingConfig) -> list[np.ndarray]:
    """The corpus: documents of log-normal lengths, each ``[EOT, ids...]`` (int64)."""
    rng = np.random.default_rng(config.seed)
    lengths = np.clip(rng.lognormal(math.log(config.median_tokens), config.sigma, size=config.documents),
                      2, config.max_tokens).astype(np.int64)
    ids = rng.integers(0, EOT, size=int(lengths.sum()), dtype=np.int64)
    documents = np.split(ids, np.cumsum(lengths)[:-1])
    for document in documents:
        document[0] = EOT
    return documents


class _Documents(Dataset[Any]):
    """A map-style dataset of documents: tensors (cut at ``seq_len``) or ``{"input_ids": list}``."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Any:
        return self.items[index]


class _Tally:
    """Document tokens and batch tokens of the batches a collate made."""

    def __init__(self) -> None:
        self.documents = 0
        self.total = 0

    @property
    def padding(self) -> float:
        return 1 - self.documents / self.total if self.total else 0.0


def pad_to_longest(tally: _Tally) -> Callable[[list[torch.Tensor]], dict[str, torch.Tensor]]:
    """torch's usual LM collate: documents right-padded to the batch's longest, labels shifted."""
    def collate(documents: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        longest = max(len(d) for d in documents)
        ids = torch.zeros(len(documents), longest, dtype=torch.int64)
        labels = torch.full((len(documents), longest), IGNORE_INDEX, dtype=torch.int64)
        mask = torch.zeros(len(documents), longest, dtype=torch.bool)
        for row, document in enumerate(documents):
            ids[row, : len(document)] = document
            labels[row, : len(document) - 1] = document[1:]
            mask[row, : len(document)] = True
        tally.documents += int(mask.sum())
        tally.total += mask.numel()
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    return collate


def torchtune_style_packs(documents: list[np.ndarray], seq_len: int) -> list[dict[str, torch.Tensor]]:
    """torchtune's ``PackedDataset`` built ahead: documents (cut at ``seq_len``) appended in order to
    the current pack until the next one does not fit, which starts a new pack; each pack padded
    to ``seq_len``, with its labels, positions and sequence lengths as tensors."""
    packs: list[dict[str, torch.Tensor]] = []
    tokens: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    lengths: list[int] = []

    def close() -> None:
        pad = seq_len - len(tokens)
        packs.append({
            "tokens": torch.tensor(tokens + [0] * pad), "labels": torch.tensor(labels + [IGNORE_INDEX] * pad),
            "input_pos": torch.tensor(positions + list(range(pad))),
            "seq_lens": torch.tensor(lengths + [pad] * (pad > 0)),
        })
        for done in (tokens, labels, positions, lengths):
            done.clear()

    for document in documents:
        ids = document[:seq_len].tolist()
        if len(tokens) + len(ids) > seq_len:
            close()
        tokens.extend(ids)
        labels.extend(ids[1:] + [IGNORE_INDEX])
        positions.extend(range(len(ids)))
        lengths.append(len(ids))
    if tokens:
        close()
    return packs


def collate_packs(packs: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Packs stacked, with the flattened batch's ``cu_seqlens`` from their sequence lengths."""
    lengths = torch.cat([pack["seq_lens"] for pack in packs])
    return {"tokens": torch.stack([p["tokens"] for p in packs]), "labels": torch.stack([p["labels"] for p in packs]),
            "input_pos": torch.stack([p["input_pos"] for p in packs]),
            "cu_seqlens": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)}


Started = tuple[Iterator[Any], Callable[[], None]]  # a loader's batches, and what closes it
Maker = Callable[[int], Started]  # a loader started with a seed


def _forever(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def _timed(batches: Iterator[Any], steps: int, device: torch.device) -> float:
    """Seconds for ``steps`` batches, each on ``device`` (host batches copied there)."""
    synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        batch = next(batches)
        if device.type == "cuda":
            batch = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        del batch
    synchronize(device)
    return time.perf_counter() - started


def run_packing(config: PackingConfig, device: torch.device,
                say: Callable[[str], None] = lambda line: None) -> tuple[list[PackingRow], PackingCost]:
    """Build every loader's data, time each for ``config.rounds`` rounds, interleaved, then the
    greedy packed step against the windows step in ``config.pairs`` alternating pairs."""
    documents = synthetic_documents(config)
    stream = np.concatenate(documents).astype(np.uint16)
    batch_tokens = config.rows * config.seq_len
    cut = [d[: config.seq_len] for d in documents]
    per_batch = max(1, round(batch_tokens / statistics.fmean(len(d) for d in cut)))
    rows: list[PackingRow] = []
    makers: dict[str, Maker] = {}
    opened: dict[str, gpuload.DataLoader] = {}  # each gpuload row's latest loader, traced after the last round

    for strategy in ("greedy", "best_fit"):
        started = time.perf_counter()
        packed = gpuload.PackedTokens(stream, config.seq_len, eot_id=EOT, strategy=strategy, window=config.window)
        stats = packed.packing_stats()
        row = PackingRow(f"gpuload PackedTokens ({strategy})", padding=stats["padding"],
                         tokens_per_step=batch_tokens * stats["fill"],
                         notes={"plan_s": time.perf_counter() - started, **stats})
        rows.append(row)

        def gpuload_packed(seed: int, packed: gpuload.PackedTokens = packed, name: str = row.name) -> Started:
            loader = opened[name] = gpuload.DataLoader(packed, batch_size=config.rows, shuffle=True,
                                                       collate_fn=packed.collate, device=device,
                                                       generator=torch.Generator().manual_seed(seed))
            return iter(_forever(loader)), loader.close
        makers[row.name] = gpuload_packed

    windows = gpuload.TokenWindows(stream, config.seq_len)
    rows.append(PackingRow("gpuload TokenWindows (no documents)", tokens_per_step=batch_tokens))
    windows_row = rows[-1].name

    def gpuload_windows(seed: int) -> Started:
        loader = opened[windows_row] = gpuload.DataLoader(windows, batch_size=config.rows, shuffle=True, device=device,
                                                          generator=torch.Generator().manual_seed(seed))
        return (dict(input_ids=x, labels=y) for x, y in _forever(loader)), loader.close
    makers[rows[-1].name] = gpuload_windows

    tallies = {"pad": _Tally(), "collator": _Tally()}
    padded = _Documents([torch.from_numpy(d) for d in cut])
    rows.append(PackingRow("torch DataLoader, pad to longest", notes={"documents_per_batch": per_batch}))

    def pad_longest(seed: int) -> Started:
        loader = TorchDataLoader(padded, batch_size=per_batch, shuffle=True, collate_fn=pad_to_longest(tallies["pad"]),
                                 generator=torch.Generator().manual_seed(seed))
        return iter(_forever(loader)), _nothing
    makers[rows[-1].name] = pad_longest

    started = time.perf_counter()
    packs = torchtune_style_packs(documents, config.seq_len)
    fill = sum(len(d) for d in cut) / (len(packs) * config.seq_len)
    rows.append(PackingRow("torchtune-style PackedDataset (ahead)", padding=1 - fill,
                           tokens_per_step=batch_tokens * fill,
                           notes={"build_s": time.perf_counter() - started, "packs": len(packs)}))
    pack_set = _Documents(packs)

    def torchtune_like(seed: int) -> Started:
        loader = TorchDataLoader(pack_set, batch_size=config.rows, shuffle=True, collate_fn=collate_packs,
                                 generator=torch.Generator().manual_seed(seed))
        return iter(_forever(loader)), _nothing
    makers[rows[-1].name] = torchtune_like

    try:
        from transformers import DataCollatorWithFlattening
    except ImportError:
        say("  transformers is not installed: its DataCollatorWithFlattening is left out")
    else:
        as_lists = _Documents([{"input_ids": d.tolist()} for d in cut])
        flattening = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
        tally = tallies["collator"]

        def collator(features: list[dict[str, list[int]]]) -> Any:
            batch = flattening(features, return_tensors="pt")
            tally.documents += batch["input_ids"].numel()
            tally.total += batch["input_ids"].numel()
            return dict(batch)

        rows.append(PackingRow("transformers DataCollatorWithFlattening",
                               notes={"documents_per_batch": per_batch}))

        def flattened(seed: int) -> Started:
            loader = TorchDataLoader(as_lists, batch_size=per_batch, shuffle=True, collate_fn=collator,
                                     generator=torch.Generator().manual_seed(seed))
            return iter(_forever(loader)), _nothing
        makers[rows[-1].name] = flattened

    for round_ in range(config.rounds):
        for row in rows:
            gc.collect()
            batches, close = makers[row.name](config.seed + round_)
            counted = tallies["pad"] if row.name.startswith("torch DataLoader") else \
                tallies["collator"] if row.name.startswith("transformers") else None
            try:
                _timed(batches, max(2, config.steps // 10), device)  # warm-up: the cache fills
                if counted is not None:
                    counted.documents = counted.total = 0
                row.seconds.append(_timed(batches, config.steps, device))
                if counted is not None:  # measured on the timed batches
                    row.padding = counted.padding
                    row.tokens_per_step = counted.documents / config.steps
                if round_ == config.rounds - 1 and row.name in opened:
                    row.stages = stage_row(row.name, opened.pop(row.name), device, config.steps)
            finally:
                close()
                del batches
        say(f"  round {round_ + 1}/{config.rounds} done")
    return rows, _packing_cost(makers[rows[0].name], makers[windows_row], config, device)


def _packing_cost(packed: Maker, windows: Maker, config: PackingConfig, device: torch.device) -> PackingCost:
    """Single steps of the two loaders timed in ``config.pairs`` alternating pairs, each warmed up."""
    seed = config.seed + config.rounds
    (packed_batches, close_packed), (windows_batches, close_windows) = packed(seed), windows(seed)
    try:
        for batches in (packed_batches, windows_batches):
            _timed(batches, max(2, config.steps // 10), device)
        gc.collect()
        packed_s, windows_s = time_pairs(lambda: next(packed_batches), lambda: next(windows_batches),
                                         config.pairs, device)
    finally:
        close_packed()
        close_windows()
    return PackingCost(packed_s, windows_s)


def _nothing() -> None:
    """Closes a loader that holds nothing."""


def findings(rows: list[PackingRow], config: PackingConfig, cost: PackingCost) -> dict[str, float]:
    """The numbers the targets name (the packed step over the windows step from the pairs)."""
    by_name = {row.name: row for row in rows}
    greedy, best = by_name["gpuload PackedTokens (greedy)"], by_name["gpuload PackedTokens (best_fit)"]
    found = {"padding_greedy": greedy.padding, "padding_best_fit": best.padding,
             "packed_step_over_windows_step": cost.overhead}
    collator = by_name.get("transformers DataCollatorWithFlattening")
    if collator is not None:
        found["vs_collator_tokens_per_s"] = greedy.tokens_per_s(config) / collator.tokens_per_s(config)
    padded = by_name["torch DataLoader, pad to longest"]
    found["vs_pad_to_longest_tokens_per_s"] = greedy.tokens_per_s(config) / padded.tokens_per_s(config)
    return found


def format_packing(rows: list[PackingRow], config: PackingConfig) -> str:
    """A table of every loader, within 100 columns."""
    header = f"{'loader':<42} {'doc tokens/s':>13} {'padding':>8} {'ms/step':>9} {'x collator':>10}"
    lines = [header, "-" * len(header)]
    rates = {row.name: row.tokens_per_s(config) for row in rows}
    base = rates.get("transformers DataCollatorWithFlattening")
    for row in rows:
        rate = rates[row.name]
        ratio = f"{rate / base:>10.1f}" if base else f"{'-':>10}"
        step_ms = 1000 * statistics.median(row.seconds) / config.steps
        lines.append(f"{row.name:<42} {rate:>13,.0f} {row.padding:>8.2%} {step_ms:>9.2f} {ratio}")
    return "\n".join(lines)


def packing_headline(found: dict[str, float], load_average: tuple[float, ...] | None) -> str:
    parts = [f"padding {found['padding_greedy']:.3%} greedy (target < {PADDING_TARGETS['greedy']:.0%}), "
             f"{found['padding_best_fit']:.3%} best-fit (target < {PADDING_TARGETS['best_fit']:.1%})",
             f"a packed step {found['packed_step_over_windows_step']:+.1%} over a windows step, paired "
             f"(target < {WINDOWS_OVERHEAD_TARGET:.0%})"]
    if "vs_collator_tokens_per_s" in found:
        parts.append(f"{found['vs_collator_tokens_per_s']:.1f}x DataCollatorWithFlattening's tokens/s "
                     f"(target {COLLATOR_TARGET:.0f}x)")
    parts.append(f"{found['vs_pad_to_longest_tokens_per_s']:.1f}x pad-to-longest's")
    load = f", load average {load_average[0]:.2f}" if load_average else ""
    return "gpuload over PackedTokens: " + ", ".join(parts) + load


def run_packing_bench(quick: bool, batch_size: int | None, device: torch.device, out: Any,
                      environment: dict[str, Any], quiet: bool = False) -> int:
    """``gpuload bench --scenario packing``: run, print the table and the findings, write
    ``bench.json`` and ``bench.png`` (the stage panel); 0."""
    config = PackingConfig.quick() if quick else PackingConfig()
    if batch_size:
        config = PackingConfig(**{**config.__dict__, "rows": batch_size})
    say = (lambda *lines: None) if quiet else (lambda *lines: print(*lines, sep="\n", flush=True))
    say(*textwrap.wrap(
        f"gpuload bench: packing, {config.documents:,} synthetic documents of log-normal length (median "
        f"{config.median_tokens}, sigma {config.sigma}, at most {config.max_tokens}), seq_len {config.seq_len}, "
        f"{config.rows} rows a batch, shuffled, {config.rounds} round(s) of {config.steps} steps per loader, on "
        f"{device}", WIDTH, subsequent_indent="    "))
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    rows, cost = run_packing(config, device, say)
    load_after = os.getloadavg() if hasattr(os, "getloadavg") else None
    found = findings(rows, config, cost)
    say("", format_packing(rows, config), "")
    write_json(out / "bench.json", {
        "scenario": "packing", "config": config.__dict__, "environment": environment,
        "load_average_before": load_before, "load_average_after": load_after,
        "targets": {"padding": PADDING_TARGETS, "packed_step_over_windows_step": WINDOWS_OVERHEAD_TARGET,
                    "vs_collator_tokens_per_s": COLLATOR_TARGET},
        "findings": found, "results": [row.as_dict(config) for row in rows], "packing_cost": cost.as_dict(),
        "stages": (traced := [row.stages for row in rows if row.stages]),
    })
    write_stages_chart(out / "bench.png", traced, f"gpuload bench: packing, {config.rows} rows, {device}")
    busy = busy_note(max(load_before[0], load_after[0]) if load_before and load_after else None, os.cpu_count())
    if busy:
        say(busy)
    print(cost.line())
    print(*textwrap.wrap(packing_headline(found, load_after), WIDTH, subsequent_indent="    "), sep="\n")
    print(f"results: {out / 'bench.json'}; chart: {out / 'bench.png'}")
    return 0
