"""Benchmark output: tables and a chart that answer two questions, and a JSON document.

How much faster than torch's DataLoader? Samples/s per loader, the spread of the measured
epochs, the ratio to torch and to an ideal (whose best epoch is the bound). How many bytes
cross to the device per epoch? Epoch 1 (a cache's fill) and each later epoch, measured on a
GPU, modelled for a pretended card on a CPU. The tables fit 100 columns; ``headline`` says the
result in one line. Everything here reads only the result dicts, whatever the scenario.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from gpuload.verdict import STAGES

__all__ = [
    "add_ratios", "format_table", "format_details", "headline", "busy_note", "write_json", "write_chart", "draw_chart",
    "display_name", "h2d_figures", "epoch_rates", "stage_shares", "stages_panel", "draw_stages_chart",
    "write_stages_chart", "WIDTH",
]

WIDTH = 100  # columns every printed line fits in
NAME_WIDTH = 38


def display_name(name: str) -> str:
    """A loader's name as the table and the chart show it: short, at most ``NAME_WIDTH`` wide."""
    short = name.replace("torch DataLoader", "torch").replace("gpuload DataLoader", "gpuload") \
        .replace(" + v2 transforms", " + v2")
    return short if len(short) <= NAME_WIDTH else short[: NAME_WIDTH - 1] + "~"


def _is_gpuload(row: dict[str, Any]) -> bool:
    return row["kind"] != "ideal" and row["name"].startswith("gpuload")


def _is_torch(row: dict[str, Any]) -> bool:
    return row["kind"] != "ideal" and row["name"].startswith("torch")


def epoch_rates(row: dict[str, Any]) -> list[float]:
    """Samples/s of each steady epoch."""
    samples = row.get("samples_per_epoch") or row["samples_per_s"] * row["median_epoch_s"]
    return [samples / s if s > 0 else float("inf") for s in row["steady_epoch_s"]]


def add_ratios(results: list[dict[str, Any]]) -> None:
    """Add ``x_baseline`` (vs torch, num_workers=0) and ``of_ideal`` (vs the first ideal's best epoch).

    A loader's median above the ideal's best epoch is noise (the ideal does strictly less work):
    ``of_ideal_within_noise`` flags it, and the table prints no percentage above 100.
    """
    baseline = next((r for r in results if r["kind"] == "baseline"), results[0])
    ideal = next((r for r in results if r["kind"] == "ideal"), None)
    ideal_best = max(epoch_rates(ideal)) if ideal else None
    for r in results:
        r["x_baseline"] = r["samples_per_s"] / baseline["samples_per_s"]
        r["of_ideal"] = r["samples_per_s"] / ideal_best if ideal_best and r["kind"] != "ideal" else None
        r["of_ideal_within_noise"] = r["of_ideal"] is not None and r["of_ideal"] > 1
        r["baseline_name"], r["ideal_name"] = baseline["name"], ideal["name"] if ideal else None
        r["ideal_best_samples_per_s"] = ideal_best


def h2d_figures(row: dict[str, Any]) -> tuple[int, int, str | None] | None:
    """(epoch-1 bytes, bytes per later epoch, basis when modelled) or None when nothing says.

    Measured on a GPU (basis None); on a CPU, or where a loader does not count its own copies,
    the row's ``h2d_modelled`` figures.
    """
    if row.get("h2d_measured", True):
        return int(row["h2d_bytes_first_epoch"]), int(row["h2d_bytes_per_epoch"]), None
    modelled = row.get("h2d_modelled")
    if not modelled:
        return None
    return modelled["first_epoch"], modelled["per_epoch"], modelled["basis"]


def _modelled_card(results: list[dict[str, Any]]) -> str | None:
    """"a pretended 16 GiB card" when any row is modelled for one."""
    cards = [(r.get("h2d_modelled") or {}).get("card") or r.get("cache_plan_modelled_for") for r in results]
    return next((card for card in cards if card), None)


def _legend_below(axis) -> None:
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8, frameon=False)


def _size(nbytes: float) -> str:
    """Bytes to one decimal in the largest binary unit below them: "0 B", "29.4 MiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value < 1e9 else f"{value / 1e9:.2f} billion"


def _ratio(x: float) -> str:
    return f"{x:.2f}x" if x < 100 else f"{x:,.0f}x"


def _spread_pct(row: dict[str, Any]) -> str:
    rates = epoch_rates(row)
    if len(rates) < 2 or row["samples_per_s"] <= 0:
        return "-"
    return f"±{50 * (max(rates) - min(rates)) / row['samples_per_s']:.0f}%"


def _of_ideal(row: dict[str, Any]) -> str:
    if row["kind"] == "ideal":
        return "bound" if row["name"] == row["ideal_name"] else "-"
    if row["of_ideal"] is None:
        return "-"
    return "~100%*" if row["of_ideal_within_noise"] else f"{100 * row['of_ideal']:.0f}%"


def _speed_table(results: list[dict[str, Any]]) -> list[str]:
    waits = any(r.get("wait_share") is not None for r in results)
    header = (f"{'loader':<{NAME_WIDTH}} {'samples/s':>13} {'spread':>7} {'1st epoch':>10} {'x torch':>8} "
              f"{'of ideal':>9}" + (f" {'wait':>5}" if waits else ""))
    lines = [header, "-" * len(header)]
    for r in results:
        wait = "-" if r.get("wait_share") is None else f"{100 * r['wait_share']:.0f}%"
        lines.append(
            f"{display_name(r['name']):<{NAME_WIDTH}} {_rate(r['samples_per_s']):>13} {_spread_pct(r):>7} "
            f"{r['first_epoch_s']:>8.3f} s {_ratio(r['x_baseline']):>8} {_of_ideal(r):>9}"
            + (f" {wait:>5}" if waits else "")
        )
    notes = [f"samples/s: median of the steady epochs; spread: half their range. x torch: against "
             f"{display_name(results[0]['baseline_name'])}."]
    ideal = results[0]["ideal_name"]
    if ideal:
        ideal_row = next(r for r in results if r["name"] == ideal)
        notes.append(f"of ideal: against the best of {len(ideal_row['steady_epoch_s'])} epochs of {ideal} "
                     f"({_rate(results[0]['ideal_best_samples_per_s'])} samples/s).")
    if any(r["of_ideal_within_noise"] for r in results):
        notes.append("* faster than the ideal's best epoch: within this run's noise, not a result (the "
                     "ideal does less work than any loader).")
    if waits:
        notes.append("wait: share of a steady epoch the loop spent waiting for data instead of stepping.")
    return lines + _wrapped(" ".join(notes))


MEASURED = "measured on the device"


def _bytes_title(figures: list[tuple[int, int, str | None] | None], card: str | None) -> str:
    """What the bytes figures are: all measured (a GPU), all modelled (a CPU), or a mix."""
    kinds = {f[2] is None for f in figures if f is not None}
    if kinds == {False}:
        return f"modelled for {card or 'a card'}"
    return f"measured; modelled for {card or 'a card'} where marked" if kinds == {True, False} else "measured"


def _bytes_table(results: list[dict[str, Any]]) -> list[str]:
    rows = [r for r in results if r["kind"] != "ideal"]
    figures = [h2d_figures(r) for r in rows]
    title = _bytes_title(figures, _modelled_card(results))
    modelled = title != "measured"
    bases = list(dict.fromkeys(f[2] or MEASURED for f in figures if f is not None))
    measured_memory = any(r.get("loader_device_peak_bytes") is not None for r in rows)
    nothing_crosses = " (on a CPU nothing crosses)" if MEASURED not in bases else ""
    header = f"{'loader':<{NAME_WIDTH}} {'epoch 1':>12} {'each later':>12}"
    header += "  basis" if modelled else f" {'GB/s':>6}" + (f" {'loader device peak':>19}" if measured_memory else "")
    lines = [f"host-to-device bytes per epoch, {title}{nothing_crosses}", header, "-" * len(header)]
    for r, f in zip(rows, figures):
        line = f"{display_name(r['name']):<{NAME_WIDTH}} "
        if f is None:
            lines.append(line + f"{'n/a':>12} {'n/a':>12}" + ("  (not modelled)" if modelled else ""))
            continue
        line += f"{_size(f[0]):>12} {_size(f[1]):>12}"
        if modelled:
            line += f"  [{bases.index(f[2] or MEASURED) + 1}]"
        else:
            peak = r.get("loader_device_peak_bytes")
            line += f" {r['h2d_gbps']:>6.2f}"
            if measured_memory:
                line += f" {'-' if peak is None else _size(peak):>19}"
        lines.append(line)
    if modelled:
        for number, basis in enumerate(bases, 1):
            lines.extend(_wrapped(f"[{number}] {basis}"))
    return lines


def _wrapped(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent=indent or "    ", break_on_hyphens=False)


def _wait_table(results: list[dict[str, Any]]) -> list[str]:
    """Each loader's exposed wait per step, measured around the loop (``next()``) the same way for
    gpuload and torch, and for gpuload the stage its timeline names."""
    rows = [r for r in results if r.get("wait_ms_per_step") is not None and r["kind"] != "ideal"]
    if not rows:
        return []
    header = f"{'loader':<{NAME_WIDTH}} {'wait/step':>10}  top stage (gpuload's timeline)"
    lines = ["", header, "-" * len(header)]
    for r in rows:
        stage = STAGES.get(r.get("top_stage") or "", "-")
        lines.append(f"{display_name(r['name']):<{NAME_WIDTH}} {r['wait_ms_per_step']:>7.3f} ms  {stage}")
    return lines + _wrapped("wait/step: the loop's median time inside next() per step of a steady epoch, "
                            "timed around the loop alike for every loader (on a GPU: host time).")


def format_table(results: list[dict[str, Any]]) -> str:
    """Two tables, each line at most ``WIDTH`` columns: speed per loader, then bytes per epoch."""
    return "\n".join([*_speed_table(results), "", *_bytes_table(results), *_wait_table(results)])


def _tiers(counts: dict[str, Any]) -> str:
    return (f"{counts['device_samples']} samples on the device, {counts['host_samples']} in host "
            f"memory, {counts['source_samples']} from the source")


def format_details(results: list[dict[str, Any]], model_memory: dict[str, Any] | None) -> str:
    """What served each gpuload row (path, tiers, measured or modelled plan) and the model's memory."""
    lines = []
    for r in results:
        if "path" not in r:
            continue
        line = f"{display_name(r['name'])}: path {r['path']}"
        if "cache" in r:
            line += f"; measured: {_tiers(r['cache'])}"
        elif r.get("path") == "device-gather" and r.get("cache_plan_modelled"):
            line += " (on the CPU the arrays are served in place, no tiers are built)"
        plan = r.get("cache_plan_modelled")
        if plan:
            line += f"; modelled for {r['cache_plan_modelled_for']}: plan {plan['kind']}, {_tiers(plan)}"
        lines.extend(_wrapped(line))
    if model_memory:
        peak = model_memory["activation_peak_bytes"]
        where = model_memory["device"]
        lines.extend(_wrapped(
            f"model (cnn step) on {where}: parameters + gradients + optimizer state "
            f"{model_memory['state_bytes'] / 2**20:.2f} MiB; activations saved for backward "
            f"{model_memory['saved_activation_bytes'] / 2**20:.1f} MiB per step; device activation peak "
            + (f"{peak / 2**20:.1f} MiB" if peak is not None else "n/a on the CPU")
            + ("" if where.startswith("cuda") else " (these are host bytes)")
        ))
    return "\n".join(lines)


def _times(x: float) -> str:
    return f"{x:.0f}x" if x >= 10 else f"{x:.1f}x"


def headline(results: list[dict[str, Any]]) -> str:
    """The result in words: gpuload's fastest row against torch's, and that row's bytes after the
    first epoch (one row's figures: a streaming row's speed beside a cache row's bytes would claim
    what no loader did)."""
    ours = [r for r in results if _is_gpuload(r)]
    theirs = [r for r in results if _is_torch(r)]
    if not ours or not theirs:
        return ""
    baseline = next((r for r in theirs if r["kind"] == "baseline"), theirs[0])
    fastest = max(ours, key=lambda r: r["samples_per_s"])
    torch_name = baseline["name"].replace("torch DataLoader", "torch's DataLoader")
    text = f"{display_name(fastest['name'])}: {_times(fastest['samples_per_s'] / baseline['samples_per_s'])} " \
           f"{torch_name}"
    best_torch = max(theirs, key=lambda r: r["samples_per_s"])
    if best_torch is not baseline:
        workers = re.search(r"num_workers=\d+", best_torch["name"])
        text += (f", {_times(fastest['samples_per_s'] / best_torch['samples_per_s'])} with "
                 f"{workers.group() if workers else display_name(best_torch['name'])}")
    text += " on this machine"
    figures, torch_bytes = h2d_figures(fastest), h2d_figures(baseline)
    if figures is not None and torch_bytes is not None:  # the same row's bytes: never another row's
        text += (f"; after the first epoch {_size(figures[1])} per epoch cross to the device "
                 f"(torch: {_size(torch_bytes[1])})")
        if figures[2] is not None or torch_bytes[2] is not None:
            text += f", modelled for {_modelled_card(results) or 'a card'}"
    return text


def busy_note(load_average: float | None, cpu_count: int | None, threads: int = 1) -> str:
    """A warning when other work competed for the cores during the run, else ""."""
    if load_average is None or not cpu_count or load_average <= cpu_count:
        return ""
    advice = "; --threads 1 keeps torch's intra-op threads from waiting on each other" if threads > 1 else ""
    return "\n".join(_wrapped(
        f"note: the machine was busy (load average {load_average:.1f} on {cpu_count} cores): the rates are "
        f"noisy{advice}"
    ))


def _replace_atomically(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write ``path`` through a new file beside it, then rename it into place.

    The new file is created exclusively (never through an existing link) and the rename
    replaces whatever ``path`` was, a symlink included, without touching a link's target.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            write(handle)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write the full result document (configuration, environment, per-loader numbers)."""
    text = json.dumps(document, indent=2, default=str) + "\n"
    _replace_atomically(path, lambda handle: handle.write(text.encode("utf-8")))


_COLORS = {"torch": "#8c8c8c", "gpuload": "#3b6fb6", "other": "#c4843a"}


def _color(row: dict[str, Any]) -> str:
    return _COLORS["gpuload" if _is_gpuload(row) else "torch" if _is_torch(row) else "other"]


def draw_chart(results: list[dict[str, Any]], title: str):
    """The report's figure: samples/s on a log scale (ideals as lines), H2D bytes per epoch, and
    (in documents that measured it) where the loop waits: each loader's exposed wait per step, and
    for gpuload the stages' shares of its time (:func:`stage_shares`).

    Each loader's bars carry ``gid`` "speed:NAME", "bytes-first:NAME" / "bytes-later:NAME" and
    "stage:STAGE:NAME"; the wait is the text with ``gid`` "wait:NAME".
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if r["kind"] != "ideal"]
    ideals = [r for r in results if r["kind"] == "ideal"]
    waits = any(r.get("wait_ms_per_step") is not None for r in rows)  # a document from before: two panels
    figure, axes = plt.subplots(
        1, 3 if waits else 2, figsize=(19 if waits else 13, 0.62 * len(rows) + 2.6), sharey=True,
        gridspec_kw={"width_ratios": [3, 2, 2.4] if waits else [3, 2]},
    )
    speed, moved = axes[:2]
    _speed_panel(speed, rows, ideals)
    _bytes_panel(moved, rows, _modelled_card(results))
    if waits:
        stages_panel(axes[2], rows)
    speed.set_yticks(range(len(rows)), [display_name(r["name"]) for r in rows])
    speed.invert_yaxis()
    figure.suptitle(title, fontsize=12)
    figure.tight_layout()
    return figure


def _speed_panel(axis, rows: list[dict[str, Any]], ideals: list[dict[str, Any]]) -> None:
    rates = [r["samples_per_s"] for r in rows]
    low = [min(epoch_rates(r)) for r in rows]
    high = [max(epoch_rates(r)) for r in rows]
    bounds = [max(epoch_rates(r)) for r in ideals]
    floor = min(low + bounds) / 4
    top = max(high + bounds) * 3.5
    axis.set_xscale("log")
    axis.set_xlim(floor, top)
    for y, (r, rate, lo, hi) in enumerate(zip(rows, rates, low, high)):
        bar = axis.barh(y, rate - floor, left=floor, height=0.6, color=_color(r))[0]
        bar.set_gid(f"speed:{r['name']}")
        axis.errorbar(rate, y, xerr=[[rate - lo], [hi - rate]], fmt="none", ecolor="black", capsize=3, lw=1)
        axis.annotate(f"{_times(r['x_baseline'])} torch", (hi, y), xytext=(5, 0), textcoords="offset points",
                      va="center", fontsize=9, bbox={"facecolor": "white", "edgecolor": "none", "pad": 1, "alpha": 0.8})
    styles = ["--", ":", "-."]
    for r, bound, style in zip(ideals, bounds, styles * 3):
        axis.axvline(bound, color="#2f8f4e", linestyle=style, lw=1.4,
                     label=f"{r['name']} (best epoch, {_rate(bound)}/s)")
    if ideals:
        _legend_below(axis)
    axis.set_xlabel("samples/s, log scale (median of steady epochs; whiskers: slowest to fastest epoch)")
    axis.set_title("How much faster than torch's DataLoader?", fontsize=11)
    axis.grid(axis="x", which="major", alpha=0.3)


def _bytes_panel(axis, rows: list[dict[str, Any]], card: str | None) -> None:
    figures = [h2d_figures(r) for r in rows]
    mib = 2**20
    largest = max((max(f[0], f[1]) for f in figures if f is not None), default=0) / mib or 1.0
    title = _bytes_title(figures, card)
    mixed = title.startswith("measured;")
    for y, (r, f) in enumerate(zip(rows, figures)):
        if f is None:
            axis.text(largest * 0.02, y, "not modelled", va="center", fontsize=8, color="#666666")
            continue
        for offset, value, kind, shade in ((-0.18, f[0], "first", "#b9cde8"), (0.18, f[1], "later", "#1f3f73")):
            bar = axis.barh(y + offset, value / mib, height=0.34, color=shade,
                            hatch="//" if mixed and f[2] is not None else None, edgecolor="white",
                            label={"first": "epoch 1 (a cache fills)", "later": "each later epoch"}[kind]
                            if y == 0 else None)[0]
            bar.set_gid(f"bytes-{kind}:{r['name']}")
            axis.text(value / mib + largest * 0.02, y + offset, _size(value), va="center", fontsize=8)
    axis.set_xlim(0, largest * 1.45)
    axis.set_xlabel("MiB host-to-device per epoch" + (", hatched: modelled" if mixed else ""))
    axis.set_title(f"How many bytes cross to the device per epoch?\n({title})", fontsize=11)
    _legend_below(axis)
    axis.grid(axis="x", alpha=0.3)


def stage_shares(row: dict[str, Any]) -> dict[str, float]:
    """The share of a gpuload row's time per step each stage took (summing to 1), in the order of
    :data:`gpuload.verdict.STAGES`; empty for a row with no stage times (torch's, an ideal's)."""
    stage_ms = row.get("stage_ms_per_step") or {}
    total = sum(stage_ms.values())
    if total <= 0:
        return {}
    order = [*STAGES, *sorted(set(stage_ms) - set(STAGES))]
    return {name: stage_ms[name] / total for name in order if stage_ms.get(name, 0) > 0}


def _stage_colors() -> dict[str, Any]:
    import matplotlib

    palette = matplotlib.colormaps["tab20"]  # its strong shades first: neighbouring stages differ
    return {name: palette((2 * k) % 20 + (2 * k) // 20) for k, name in enumerate(STAGES)}


def stages_panel(axis, rows: list[dict[str, Any]]) -> None:
    """Where the loop waits, on ``axis``: per row (``name``, ``wait_ms_per_step``, and for a gpuload
    loader ``stage_ms_per_step`` from a traced epoch) the wait per step and each stage's share of the
    loader's time. Bars carry ``gid`` "stage:STAGE:NAME", the wait text "wait:NAME"."""
    colors = _stage_colors()
    drawn: set[str] = set()
    for y, r in enumerate(rows):
        shares = stage_shares(r)
        left = 0.0
        for name, share in shares.items():
            bar = axis.barh(y - 0.1, 100 * share, left=left, height=0.45, color=colors.get(name, "#999999"),
                            label=STAGES.get(name, name) if name not in drawn else None)[0]
            bar.set_gid(f"stage:{name}:{r['name']}")
            drawn.add(name)
            left += 100 * share
        wait = r.get("wait_ms_per_step")
        text = "wait -" if wait is None else f"wait {wait:.3f} ms/step"
        if shares:
            top = max(shares, key=shares.__getitem__)
            text += f"; top: {STAGES.get(top, top)} {100 * shares[top]:.0f}%"
        else:
            text += " (around the loop; no stage timeline)"
        axis.text(1, y + 0.34, text, va="center", fontsize=8).set_gid(f"wait:{r['name']}")
    axis.set_xlim(0, 100)
    axis.set_xlabel("% of the loader's time per step, by stage (one traced epoch)")
    axis.set_title("Where does the loop wait?\n(wait: time inside next() per step, alike for every loader)",
                   fontsize=11)
    if drawn:
        axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=7, frameon=False)
    axis.grid(axis="x", alpha=0.3)


def draw_stages_chart(rows: list[dict[str, Any]], title: str) -> Any:
    """A figure of the stage panel alone, for a scenario whose report has no other chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 0.62 * len(rows) + 2.6))
    stages_panel(axis, rows)
    axis.set_yticks(range(len(rows)), [display_name(r["name"]) for r in rows])
    axis.invert_yaxis()
    figure.suptitle(title, fontsize=12)
    figure.tight_layout()
    return figure


def write_stages_chart(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    """Draw the stage panel alone (:func:`draw_stages_chart`) and write it as a PNG at ``path``."""
    save_figure(path, draw_stages_chart(rows, title))


def write_chart(path: Path, results: list[dict[str, Any]], title: str) -> None:
    """Draw the report's figure and write it as a PNG at ``path`` (atomically, never through a link)."""
    save_figure(path, draw_chart(results, title))


def save_figure(path: Path, figure: Any) -> None:
    """Write a matplotlib figure as a PNG at ``path`` (atomically, never through a link), and close it."""
    import matplotlib.pyplot as plt

    try:
        _replace_atomically(path, lambda handle: figure.savefig(handle, format="png", dpi=100))
    finally:
        plt.close(figure)
