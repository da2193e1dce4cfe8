"""Several processes on torch.distributed: ``gpuload bench --scenario distributed``.

``--processes N`` ranks (gloo on the CPU; NCCL with one GPU per rank when there are N) each
run, interleaved epoch by epoch, torch's DataLoader + ``DistributedSampler`` over the usual
per-sample ``TensorDataset`` and ``gpuload.DataLoader`` with the same sampler for each
``cache_scope`` asked. Every rank checks that gpuload's batches are torch's (a checksum per
batch, taken outside the timed span) and records its samples/s after the warm-up epoch, the
bytes its loader holds, the bytes it exchanged with the other ranks per epoch and the time it
waited for them. The parent process gathers the ranks' records, prints one row per loader with
the ranks' median and range, and writes ``bench.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

import gpuload
from gpuload.bench.measure import count_samples, synchronize
from gpuload.bench.report import WIDTH, busy_note, display_name, write_json
from gpuload.bench.scenarios import BenchConfig, synthetic_cifar
from gpuload.bench.steps import make_step
from gpuload.cache import format_bytes
from gpuload.device import DeviceError, cuda_available, resolve_device, usable_cpu_count
from gpuload.transfer import move_to_device

__all__ = [
    "DistributedConfig", "SCOPES", "batch_checksum", "choose_device", "distributed_headline",
    "format_distributed", "gather_rows", "parse_scopes", "rank_main", "run_distributed_bench",
]

SCOPES = ("rank", "node", "world", "auto")
DEFAULT_SCOPES = ("rank", "node", "world")
PROCESS_GROUP_TIMEOUT_S = 300


@dataclass(frozen=True)
class DistributedConfig:
    """What every rank runs; recorded in the JSON. ``device``: ``"cpu"`` (gloo) or ``"cuda"``
    (NCCL, rank r on ``cuda:r``); ``threads``: torch's intra-op threads per rank."""

    bench: BenchConfig
    processes: int = 2
    scopes: tuple[str, ...] = DEFAULT_SCOPES
    device: str = "cpu"
    threads: int = 1

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"


def parse_scopes(text: str) -> tuple[str, ...]:
    """``"rank,node,world"`` as a tuple; ``ValueError`` naming what is accepted."""
    scopes = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [s for s in scopes if s not in SCOPES]
    if not scopes or unknown:
        raise ValueError(f"{text!r}: give a comma-separated list of {', '.join(SCOPES)}")
    if len(set(scopes)) != len(scopes):
        raise ValueError(f"{text!r} names a scope twice")
    return scopes


def choose_device(requested: str | None, processes: int) -> str:
    """``"cuda"`` when asked for or, by default, when there is one GPU per rank; else ``"cpu"``.

    ``DeviceError`` when ``cuda`` is asked for without ``processes`` GPUs or with an index
    (rank r always uses ``cuda:r``).
    """
    if requested is not None and requested.startswith("cuda:"):
        raise DeviceError(f"{requested!r}: each rank uses its own GPU (rank r on cuda:r); pass cuda or cpu")
    if requested == "cpu" or (requested is None and not cuda_available()):
        return "cpu"
    try:
        resolve_device(f"cuda:{processes - 1}")
    except DeviceError as error:
        if requested is None:
            return "cpu"
        raise DeviceError(f"cuda with {processes} processes needs one GPU per rank: {error}") from None
    return "cuda"


def batch_checksum(batch: Any) -> torch.Tensor:
    """Two int64 sums per tensor of ``batch`` that change when a row, its position in the
    batch or one of its first 64 bytes' positions changes: cheap enough for every batch."""
    if isinstance(batch, torch.Tensor):
        rows = batch.reshape(batch.shape[0], -1).contiguous()
        data = rows.view(torch.uint8) if rows.numel() else rows.to(torch.uint8)
        data = data.to(torch.int64)
        positions = torch.arange(1, data.shape[0] + 1, device=data.device)
        head = data[:, :64]
        columns = torch.arange(1, head.shape[1] + 1, device=data.device)
        return torch.stack([(data.sum(1) * positions).sum(), (head * columns).sum()])
    leaves = batch.values() if isinstance(batch, dict) else batch
    return torch.cat([batch_checksum(leaf) for leaf in leaves])


# ----------------------------------------------------------------------------- in each rank


@dataclass
class _Measured:
    """One loader on one rank: what it did each epoch."""

    name: str
    kind: str  # "baseline" (torch, the first worker count), "torch" or "gpuload"
    scope: str | None
    epoch_s: list[float]
    loop_wait_s: list[float]
    samples_per_epoch: int = 0
    batches_per_epoch: int = 0
    equal: bool = True
    path: str = ""
    held_bytes: int = 0
    held_where: str = "-"
    exchange: dict[str, Any] | None = None


class _RankLoader:
    """A loader on this rank with its sampler, and how to read what it holds afterwards."""

    def __init__(self, measured: _Measured, loader: TorchDataLoader, sampler: DistributedSampler) -> None:
        self.measured, self.loader, self.sampler = measured, loader, sampler

    def record_holdings(self, dataset_bytes: int, device: torch.device) -> None:
        if not isinstance(self.loader, gpuload.DataLoader):
            return
        stats, measured = self.loader.stats, self.measured
        measured.path = stats.path
        exchange, cache = stats.extra.get("exchange"), stats.extra.get("cache")
        if exchange is not None:
            measured.exchange = dict(exchange)
            measured.held_bytes, measured.held_where = exchange["shard_bytes"], _where(device)
        elif cache is not None and cache.get("device_bytes", 0) + cache.get("host_bytes", 0):
            measured.held_bytes = cache["device_bytes"] + cache["host_bytes"]
            measured.held_where = "device" if not cache["host_bytes"] else "device+host"
        else:  # a CPU device serves the arrays where they are
            measured.held_bytes, measured.held_where = dataset_bytes, "in place"

    def close(self) -> None:
        if isinstance(self.loader, gpuload.DataLoader):
            self.loader.close()
        elif self.loader._iterator is not None:
            self.loader._iterator._shutdown_workers()  # type: ignore[attr-defined]  # torch's iterators have it; its stub does not


def _where(device: torch.device) -> str:
    return "device" if device.type == "cuda" else "host"


def _rank_loaders(config: DistributedConfig, dataset: TensorDataset, device: torch.device) -> list[_RankLoader]:
    """torch at each worker count, then gpuload at each scope, each with its own sampler."""
    bench = config.bench

    def sampler() -> DistributedSampler:
        return DistributedSampler(dataset, shuffle=True, seed=bench.seed)

    loaders = []
    for position, workers in enumerate(bench.torch_workers):
        made = sampler()
        loader = TorchDataLoader(dataset, batch_size=bench.batch_size, sampler=made, num_workers=workers,
                                 pin_memory=device.type == "cuda", persistent_workers=workers > 0)
        kind = "baseline" if position == 0 else "torch"
        loaders.append(_RankLoader(_Measured(f"torch DataLoader (num_workers={workers})", kind, None, [], []),
                                   loader, made))
    for scope in config.scopes:
        made = sampler()
        loader = gpuload.DataLoader(dataset, batch_size=bench.batch_size, sampler=made, device=device,
                                    cache_scope=scope)
        loaders.append(_RankLoader(_Measured(f"gpuload DataLoader (scope {scope})", "gpuload", scope, [], []),
                                   loader, made))
    return loaders


def _timed_epoch(
    rank_loader: _RankLoader, device: torch.device, step: Callable[[Any], None] | None
) -> list[torch.Tensor]:
    """One epoch of ``rank_loader``, timed without its checksums; returns them (one per batch)."""
    measured, moves = rank_loader.measured, not isinstance(rank_loader.loader, gpuload.DataLoader)
    checksums: list[torch.Tensor] = []
    checking = waited = 0.0
    samples = 0
    synchronize(device)
    started = time.perf_counter()
    batches = iter(rank_loader.loader)
    while True:
        asked = time.perf_counter()
        batch = next(batches, None)
        waited += time.perf_counter() - asked
        if batch is None:
            break
        if moves and device.type == "cuda":
            batch = move_to_device(batch, device, non_blocking=True)
        samples += count_samples(batch)
        began = time.perf_counter()
        checksums.append(batch_checksum(batch))
        checking += time.perf_counter() - began
        if step is not None:
            step(batch)
    synchronize(device)
    measured.epoch_s.append(time.perf_counter() - started - checking)
    measured.loop_wait_s.append(waited)
    measured.samples_per_epoch, measured.batches_per_epoch = samples, len(checksums)
    return checksums


def _same(expected: list[torch.Tensor], got: list[torch.Tensor]) -> bool:
    return len(expected) == len(got) and (not got or torch.equal(torch.stack(expected), torch.stack(got)))


def measure_rank(config: DistributedConfig, rank: int, device: torch.device, step: Callable[[Any], None] | None,
                 progress: Callable[[int, int], None] = lambda done, total: None) -> dict[str, Any]:
    """Run every loader on this rank, interleaved epoch by epoch (each epoch's order rotated by
    one), each batch's checksum compared with torch's; every rank calls this together."""
    dataset = synthetic_cifar(config.bench)
    dataset_bytes = sum(t.numel() * t.element_size() for t in dataset.tensors)
    loaders = _rank_loaders(config, dataset, device)
    try:
        for epoch in range(config.bench.epochs + 1):
            checksums: dict[int, list[torch.Tensor]] = {}
            # Each epoch starts with the next loader, so that none always follows the same one.
            for index in [(epoch + k) % len(loaders) for k in range(len(loaders))]:
                loaders[index].sampler.set_epoch(epoch)
                dist.barrier()  # each loader's epoch starts together on every rank
                checksums[index] = [c.cpu() for c in _timed_epoch(loaders[index], device, step)]
            for index, rank_loader in enumerate(loaders):  # against torch's, the baseline (first)
                rank_loader.measured.equal &= _same(checksums[0], checksums[index])
            progress(epoch + 1, config.bench.epochs + 1)
        for rank_loader in loaders:
            rank_loader.record_holdings(dataset_bytes, device)
    finally:
        for rank_loader in loaders:
            rank_loader.close()
    return {"rank": rank, "device": str(device), "dataset_bytes": dataset_bytes,
            "loaders": [asdict(rank_loader.measured) for rank_loader in loaders]}


def rank_main(rank: int, config: DistributedConfig, init_file: str, out_dir: str, quiet: bool) -> None:
    """One spawned rank: join the group, measure, write ``rank<r>.json``, leave the group."""
    torch.set_num_threads(config.threads)
    os.environ["LOCAL_WORLD_SIZE"] = str(config.processes)  # every rank runs on this machine
    if config.device == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
    # Before the group: a rank failing while a peer still joins it leaves the peer with gloo's
    # "Connection closed by peer", which could be the error reported instead of this one.
    step = make_step(config.bench.step, device, config.bench.step_ms)
    dist.init_process_group(config.backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=config.processes, timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
    try:
        def progress(done: int, total: int) -> None:
            if rank == 0 and not quiet:
                print(f"  epoch {done} of {total} done on every loader", flush=True)

        found = measure_rank(config, rank, device, step, progress)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(found))
    finally:
        # Ended here, not left to the interpreter's exit: gloo's threads torn down during static
        # destruction abort the process now and then.
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- in the parent


def _steady(values: list[float]) -> list[float]:
    return values[1:] or values


def gather_rows(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per loader from every rank's record: per-rank lists, in rank order."""
    rows = []
    for position, first in enumerate(ranks[0]["loaders"]):
        per_rank = [found["loaders"][position] for found in ranks]
        baseline = [next(m for m in found["loaders"] if m["kind"] == "baseline") for found in ranks]
        rates = [m["samples_per_epoch"] / statistics.median(_steady(m["epoch_s"])) for m in per_rank]
        torch_rates = [m["samples_per_epoch"] / statistics.median(_steady(m["epoch_s"])) for m in baseline]
        exchanges = [m["exchange"] for m in per_rank]
        rows.append({
            "name": first["name"], "kind": first["kind"], "scope": first["scope"], "path": first["path"],
            "equal": [m["equal"] for m in per_rank],
            "samples_per_epoch": [m["samples_per_epoch"] for m in per_rank],
            "batches_per_epoch": [m["batches_per_epoch"] for m in per_rank],
            "first_epoch_s": [m["epoch_s"][0] for m in per_rank],
            "steady_epoch_s": [_steady(m["epoch_s"]) for m in per_rank],
            "samples_per_s": rates,
            "x_torch": [ours / theirs for ours, theirs in zip(rates, torch_rates)],
            "loop_wait_s_per_epoch": [statistics.median(_steady(m["loop_wait_s"])) for m in per_rank],
            "held_bytes": [m["held_bytes"] for m in per_rank],
            "held_where": first["held_where"],
            "bytes_sent_per_epoch": [_per_epoch(e, "bytes_sent_per_epoch") for e in exchanges],
            "bytes_received_per_epoch": [_per_epoch(e, "bytes_received_per_epoch") for e in exchanges],
            "exchange_wait_s_per_epoch": [_per_epoch(e, "wait_s_per_epoch") for e in exchanges],
            "shard_rows": [e["shard_rows"] if e else None for e in exchanges],
            "ranks_per_copy": exchanges[0]["ranks_per_copy"] if exchanges[0] else None,
        })
    return rows


def _per_epoch(exchange: dict[str, Any] | None, key: str) -> float | None:
    """The median over the steady epochs of one exchange counter, None without an exchange."""
    return statistics.median(_steady(exchange[key])) if exchange else None


def _rate(value: float) -> str:
    return f"{value / 1e6:.2f}M" if value >= 1e6 else f"{value / 1e3:.1f}k"


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _median_size(values: list[float | None]) -> str:
    """The median of byte counts, formatted; "-" when none is known."""
    median = _median(values)
    return "-" if median is None else format_bytes(median)


NAME_WIDTH = 23


def format_distributed(document: dict[str, Any]) -> str:
    """The table: one row per loader, the ranks' median and range, in at most 100 columns."""
    rows, config = document["rows"], document["config"]
    header = (f"{'loader':<{NAME_WIDTH}} {'samples/s/rank':>14} {'min-max':>13} {'x torch':>7} "
              f"{'holds per rank':>19} {'recv/epoch':>10} {'waited':>7}")
    lines = [header, "-" * len(header)]
    for row in rows:
        rates = row["samples_per_s"]
        received = _median(row["bytes_received_per_epoch"])
        waited = _median(row["exchange_wait_s_per_epoch"])
        holds = "-" if row["held_where"] == "-" else f"{_median_size(row['held_bytes'])} {row['held_where']}"
        lines.append(
            f"{display_name(row['name']):<{NAME_WIDTH}} {_rate(statistics.median(rates)):>14} "
            f"{_rate(min(rates)) + '-' + _rate(max(rates)):>13} {statistics.median(row['x_torch']):>6.2f}x "
            f"{holds:>19} {'-' if received is None else format_bytes(received):>10} "
            f"{'-' if waited is None else f'{waited:.3f}s':>7}"
            + ("" if all(row["equal"]) else "  BATCHES DIFFER")
        )
    ranks = config["processes"]
    notes = (
        f"samples/s/rank: median over the {ranks} ranks of each rank's median steady epoch (min-max: "
        f"the slowest and fastest rank); x torch: each rank's rate over its own torch "
        f"(num_workers={config['bench']['torch_workers'][0]}) rate, median over ranks. holds: the bytes "
        "of the dataset the loader serves batches from on each rank (in place: the rank's own arrays, "
        "no copy). recv/epoch: bytes a rank received from the others per epoch (it sends as much); "
        "waited: the rank's seconds per epoch in the exchange, waiting for the other ranks included. "
        "Each batch's checksum is compared with torch's outside the timed span."
    )
    lines += textwrap.wrap(notes, WIDTH)
    if config["device"] == "cpu":
        lines += textwrap.wrap("One machine: node and world are the same ranks here (LOCAL_WORLD_SIZE is "
                               "the world size).", WIDTH)
    return "\n".join(lines)


def distributed_headline(document: dict[str, Any]) -> str:
    """The result in one sentence: each scope's speed against torch and what a rank holds."""
    rows, config = document["rows"], document["config"]
    ours = [r for r in rows if r["kind"] == "gpuload"]
    if not ours:
        return ""
    parts = [f"{r['scope']} {statistics.median(r['x_torch']):.2f}x holding {_median_size(r['held_bytes'])}"
             for r in ours]
    dataset = f" (the dataset: {format_bytes(document['ranks'][0]['dataset_bytes'])})" if document.get("ranks") else ""
    return (f"gpuload per rank, {config['processes']} {config['backend']} ranks, against torch's DataLoader + "
            f"DistributedSampler: scope {', '.join(parts)}{dataset}"
            + ("" if all(all(r["equal"]) for r in rows) else "; BATCHES DIFFERED from torch's"))


def spawn_ranks(config: DistributedConfig, quiet: bool) -> list[dict[str, Any]]:
    """Run ``config.processes`` ranks and return their records, in rank order."""
    with tempfile.TemporaryDirectory(prefix="gpuload-distributed-") as folder:
        mp.spawn(rank_main, args=(config, str(Path(folder, "init")), folder, quiet), nprocs=config.processes)
        return [json.loads(Path(folder, f"rank{rank}.json").read_text()) for rank in range(config.processes)]


def _load_average() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _ranks_said(error: Exception) -> Iterator[str]:
    yield f"gpuload bench: a rank failed: {type(error).__name__}"
    yield from str(error).strip().splitlines()[-6:]


def run_distributed_bench(config: DistributedConfig, out: Path, environment: dict[str, Any],
                          quiet: bool = False) -> int:
    """Run the scenario, print the table and its sentence, write ``bench.json``; 0, or 1 when a
    rank failed or a loader's batches differed from torch's."""
    say = (lambda *lines: None) if quiet else (lambda *lines: print(*lines, sep="\n", flush=True))
    bench = config.bench
    say(*textwrap.wrap(
        f"gpuload bench: distributed, {config.processes} processes ({config.backend}, {config.device}), "
        f"{bench.num_samples:,} CIFAR-shaped samples split by DistributedSampler, batch {bench.batch_size}, "
        f"{bench.epochs} timed epochs after 1 warm-up, loaders interleaved epoch by epoch, scopes "
        f"{', '.join(config.scopes)}, {config.threads} torch thread(s) per rank", WIDTH, subsequent_indent="    "))
    load_before = _load_average()
    try:
        ranks = spawn_ranks(config, quiet)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:  # a rank raised, or died
        print(*_ranks_said(error), sep="\n", file=sys.stderr)
        return 1
    load = max(load_before or 0, _load_average() or 0) or None
    document: dict[str, Any] = {"scenario": "distributed", "config": {**asdict(config), "backend": config.backend},
                "environment": {**environment, "load_average_during": load}, "rows": gather_rows(ranks),
                "ranks": ranks}
    say("", format_distributed(document), "")
    busy = busy_note(load, usable_cpu_count(), config.threads)
    if busy:
        say(busy, "")
    write_json(out / "bench.json", document)
    print(*textwrap.wrap(distributed_headline(document), WIDTH, subsequent_indent="    "), sep="\n")
    print(f"results: {out / 'bench.json'}")
    return 0 if all(all(row["equal"]) for row in document["rows"]) else 1
