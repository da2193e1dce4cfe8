"""Benchmark output: a table for people, a JSON document and a PNG chart for later."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["format_table", "format_details", "write_json", "write_chart", "add_ratios"]


def add_ratios(results: list[dict[str, Any]]) -> None:
    """Add ``x_baseline`` (vs torch, num_workers=0) and ``of_ideal`` (vs the first ideal)."""
    baseline = next((r for r in results if r["kind"] == "baseline"), results[0])
    ideal = next((r for r in results if r["kind"] == "ideal"), None)
    for r in results:
        r["x_baseline"] = r["samples_per_s"] / baseline["samples_per_s"]
        r["of_ideal"] = r["samples_per_s"] / ideal["samples_per_s"] if ideal else None
        r["baseline_name"], r["ideal_name"] = baseline["name"], ideal["name"] if ideal else None


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 2**20


def format_table(results: list[dict[str, Any]]) -> str:
    """A fixed-width table: throughput, epoch times, waiting, bytes moved, memory, ratios.

    "1st" columns are the warm-up epoch, which fills a cache; the others are steady epochs.
    """
    header = (
        f"{'loader':<48} {'samples/s':>11} {'epoch s (median ± spread)':>26} {'1st epoch s':>11} "
        f"{'wait %':>7} {'H2D MiB 1st':>11} {'H2D MiB/epoch':>13} {'H2D GB/s':>8} {'loader dev MiB':>14} "
        f"{'x torch(nw=0)':>13} {'% of ideal':>10}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        wait = None if r["wait_share"] is None else 100 * r["wait_share"]
        of_ideal = "-" if r["of_ideal"] is None else f"{100 * r['of_ideal']:.1f}%"
        epoch = f"{r['median_epoch_s']:.4f} ± {r['spread_s']:.4f}"
        device_mib = _cell(_mib(r.get("loader_device_peak_bytes")), ".1f")
        lines.append(
            f"{r['name']:<48} {r['samples_per_s']:>11,.0f} "
            f"{epoch:>26} {r['first_epoch_s']:>11.4f} "
            f"{_cell(wait, '.1f'):>7} {r['h2d_bytes_first_epoch'] / 2**20:>11.1f} "
            f"{r['h2d_bytes_per_epoch'] / 2**20:>13.1f} {r['h2d_gbps']:>8.2f} {device_mib:>14} "
            f"{r['x_baseline']:>13.2f} {of_ideal:>10}"
        )
    ideal = results[0]["ideal_name"]
    lines.append(f"x torch: against {results[0]['baseline_name']}" + (f"; % of ideal: against {ideal}" if ideal else ""))
    if all(r.get("loader_device_peak_bytes") is None for r in results):
        lines.append("loader dev MiB: n/a, the loaders run on the CPU (no device memory to measure)")
    return "\n".join(lines)


def _tiers(counts: dict[str, Any]) -> str:
    return (f"{counts['device_samples']} samples on the device, {counts['host_samples']} in pinned host "
            f"memory, {counts['source_samples']} from the source")


def format_details(results: list[dict[str, Any]], model_memory: dict[str, Any] | None) -> str:
    """What served each gpuload row (path, tiers, measured or modelled plan) and the model's memory."""
    lines = []
    for r in results:
        if "path" not in r:
            continue
        line = f"{r['name']}: path {r['path']}"
        if "cache" in r:
            line += f"; measured: {_tiers(r['cache'])}"
        elif r.get("path") == "device-gather" and r.get("cache_plan_modelled"):
            line += " (on the CPU the arrays are served in place, no tiers are built)"
        plan = r.get("cache_plan_modelled")
        if plan:
            line += (
                f"\n    modelled for {r['cache_plan_modelled_for']}: plan {plan['kind']}, {_tiers(plan)}; "
                f"H2D {plan['h2d_bytes_first_epoch'] / 2**20:.1f} MiB in epoch 1, "
                f"{plan['h2d_bytes_per_epoch'] / 2**20:.1f} MiB per later epoch"
            )
        lines.append(line)
    if model_memory:
        peak = model_memory["activation_peak_bytes"]
        where = model_memory["device"]
        lines.append(
            f"model (cnn step) on {where}: parameters + gradients + optimizer state "
            f"{model_memory['state_bytes'] / 2**20:.2f} MiB; activations saved for backward "
            f"{model_memory['saved_activation_bytes'] / 2**20:.1f} MiB per step; device activation peak "
            + (f"{peak / 2**20:.1f} MiB" if peak is not None else "n/a on the CPU")
            + ("" if where.startswith("cuda") else " (these are host bytes)")
        )
    return "\n".join(lines)


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write the full result document (configuration, environment, per-loader numbers)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str) + "\n", encoding="utf-8")


def write_chart(path: Path, results: list[dict[str, Any]], title: str) -> None:
    """A PNG bar chart of samples/s per loader, with the spread and the ratio to torch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in results]
    rates = [r["samples_per_s"] for r in results]
    errors = [
        r["samples_per_s"] * r["spread_s"] / r["median_epoch_s"] if r["median_epoch_s"] else 0 for r in results
    ]
    colors = {"baseline": "#888888", "loader": "#4c72b0", "ideal": "#55a868"}
    figure, axis = plt.subplots(figsize=(10, 0.6 * len(results) + 1.5))
    bars = axis.barh(names, rates, xerr=errors, color=[colors.get(r["kind"], "#4c72b0") for r in results])
    for bar, r, error in zip(bars, results, errors):
        axis.text(bar.get_width() + error, bar.get_y() + bar.get_height() / 2, f"  {r['x_baseline']:.1f}x",
                  va="center", fontsize=9)
    axis.invert_yaxis()
    axis.set_xlabel("samples/s (median of steady epochs; bars show the spread)")
    axis.set_title(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
