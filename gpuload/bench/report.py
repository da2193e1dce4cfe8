"""Turning benchmark results into a table for people and a JSON document for machines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpuload.bench.inmemory import LoaderResult

__all__ = ["format_table", "write_json"]


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


def format_table(results: list[LoaderResult], baseline: str, ideal: str) -> str:
    """A fixed-width table: throughput, epoch times, bytes moved, ratios to torch and ideal."""
    by_name = {r.name: r for r in results}
    base = by_name[baseline].times.samples_per_s
    best = by_name[ideal].times.samples_per_s
    header = (
        f"{'loader':<40} {'samples/s':>11} {'epoch s (median ± spread)':>26} "
        f"{'1st epoch s':>11} {'H2D MiB/epoch':>13} {'x torch(nw=0)':>13} {'% of ideal':>10}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        rate = r.times.samples_per_s
        lines.append(
            f"{r.name:<40} {rate:>11,.0f} "
            f"{f'{r.times.median_s:.4f} ± {r.times.spread_s:.4f}':>26} "
            f"{r.times.first_s:>11.4f} {_mib(r.bytes_h2d_per_epoch):>13} "
            f"{rate / base:>13.2f} {100 * rate / best:>9.1f}%"
        )
    return "\n".join(lines)


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write the full result document (configuration, environment, per-loader numbers)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str) + "\n", encoding="utf-8")
