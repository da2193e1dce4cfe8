"""The report answers its two questions legibly for every scenario, from stored result documents.

The fixtures under ``fixtures/`` are the JSON documents of real quick runs on the 2-core CPU
machine (``*-cpu.json``), and one GPU-shaped document made by hand from issue 18's figures (a
replay ideal at 1.7 billion samples/s, bytes measured). A scenario's document dropped there is
checked the same way.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from gpuload.bench.report import (
    WIDTH,
    add_ratios,
    display_name,
    draw_chart,
    format_details,
    format_table,
    h2d_figures,
    headline,
    write_chart,
    write_json,
)

FIXTURES = sorted((Path(__file__).parent / "fixtures").glob("*.json"))
MIN_BAR_PIXELS = 5


def load(path: Path) -> dict:
    document = json.loads(path.read_text())
    add_ratios(document["results"])
    return document


def visible_width(patch, axis, renderer) -> float:
    """Pixels of the bar inside the axes, as drawn."""
    bar, frame = patch.get_window_extent(renderer), axis.get_window_extent(renderer)
    return min(bar.x1, frame.x1) - max(bar.x0, frame.x0)


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_every_loader_bar_is_visible_and_every_ideal_is_a_line(path: Path) -> None:
    import matplotlib.pyplot as plt

    document = load(path)
    results = document["results"]
    figure = draw_chart(results, f"gpuload bench: {document['scenario']}")
    try:
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        speed, moved = figure.axes[:2]
        bars = {patch.get_gid(): patch for axis in (speed, moved) for patch in axis.patches}
        loaders = [r for r in results if r["kind"] != "ideal"]
        for r in loaders:
            width = visible_width(bars[f"speed:{r['name']}"], speed, renderer)
            assert width >= MIN_BAR_PIXELS, f"{r['name']}: its bar is {width:.1f} px wide"
            assert {f"bytes-first:{r['name']}", f"bytes-later:{r['name']}"} <= set(bars)
        assert len(speed.patches) == len(loaders)  # ideals are reference lines, not bars
        ideal_lines = [line for line in speed.get_lines() if line.get_label().startswith("ideal")]
        assert len(ideal_lines) == sum(r["kind"] == "ideal" for r in results)
        labels = [tick.get_text() for tick in speed.get_yticklabels()]
        assert labels == [display_name(r["name"]) for r in loaders]
        modelled = "modelled" in moved.get_title()
        assert modelled == path.stem.endswith("-cpu")
    finally:
        plt.close(figure)


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_tables_fit_100_columns_and_print_no_ratio_above_the_ideal(path: Path) -> None:
    results = load(path)["results"]
    text = format_table(results) + "\n" + format_details(results, None)
    too_wide = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not too_wide
    assert not re.search(r"\b(\d{4,}|[1-9]\d{2})%", text.replace("100%*", ""))
    for r in results:
        assert display_name(r["name"]) in text
    line = headline(results)
    assert re.match(r"gpuload \(.+\): [\d.]+x torch's DataLoader.* on this machine; after the first epoch ", line)
    assert ("modelled for a pretended 16 GiB card" in line) == path.stem.endswith("-cpu")


def test_a_loader_faster_than_the_ideals_best_epoch_is_flagged_as_noise() -> None:
    results = json.loads((Path(__file__).parent / "fixtures" / "inmemory-cpu.json").read_text())["results"]
    ideal = next(r for r in results if r["kind"] == "ideal")
    row = next(r for r in results if r["name"] == "gpuload DataLoader (device cache)")
    best = ideal["samples_per_epoch"] / min(ideal["steady_epoch_s"])
    row["samples_per_s"] = best * 1.3
    add_ratios(results)
    assert row["of_ideal"] == pytest.approx(1.3) and row["of_ideal_within_noise"]
    table = format_table(results)
    flagged = next(line for line in table.splitlines() if line.startswith("gpuload (device cache)"))
    assert flagged.endswith("~100%*") and "130%" not in table
    assert "* faster than the ideal's best epoch: within this run's noise, not a result" in table.replace("\n    ", " ")


def test_the_ideal_is_its_best_epoch_and_the_headline_names_both_answers() -> None:
    document = load(Path(__file__).parent / "fixtures" / "inmemory-gpu-shaped.json")
    results = document["results"]
    gather = next(r for r in results if r["name"] == "ideal: index_select on the device")
    assert results[0]["ideal_best_samples_per_s"] == max(
        gather["samples_per_epoch"] / s for s in gather["steady_epoch_s"]
    )
    table = format_table(results)
    assert "host-to-device bytes per epoch, measured" in table and "loader device peak" in table
    line = headline(results)
    assert "after the first epoch 0 B per epoch cross to the device" in line
    assert f"(torch: {4096 * 3080 / 2**20:.1f} MiB)" in line and "modelled" not in line


def test_rows_a_scenario_does_not_model_say_so() -> None:
    results = load(Path(__file__).parent / "fixtures" / "inmemory-cpu.json")["results"]
    for r in results:
        if r["name"].startswith("gpuload"):
            del r["h2d_modelled"]
    table = format_table(results)
    assert "gpuload (device cache)" in table and "(not modelled)" in table
    assert "after the first epoch" not in headline(results)  # no gpuload figures, no bytes claim


def test_results_replace_a_symlink_instead_of_writing_through_it(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    victim = tmp_path / "elsewhere.txt"
    victim.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("bench.json", "bench.png"):
        (out / name).symlink_to(victim)
    document = load(FIXTURES[0])
    write_json(out / "bench.json", document)
    write_chart(out / "bench.png", copy.deepcopy(document["results"]), "t")
    plt.close("all")
    assert victim.read_text() == "keep me"
    assert not (out / "bench.json").is_symlink() and json.loads((out / "bench.json").read_text())["results"]
    assert not (out / "bench.png").is_symlink() and (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.png"]  # no temporary left


def test_measured_and_modelled_rows_side_by_side_are_told_apart() -> None:
    """On a GPU the image rows' bytes are modelled (the loader does not count DALI's copies)."""
    import matplotlib.pyplot as plt

    results = load(Path(__file__).parent / "fixtures" / "images-cpu.json")["results"]
    for r in results:
        if r["name"].startswith("torch"):
            r.update(h2d_measured=True, h2d_bytes_first_epoch=r["h2d_modelled"]["first_epoch"],
                     h2d_bytes_per_epoch=r["h2d_modelled"]["per_epoch"])
    table = format_table(results)
    assert "host-to-device bytes per epoch, measured; modelled for a pretended 16 GiB card where marked" in table
    assert "measured on the device" in table and "nothing crosses" not in table
    figure = draw_chart(results, "t")
    try:
        hatched = {p.get_gid().split(":", 1)[1] for p in figure.axes[1].patches if p.get_hatch()}
        assert hatched == {r["name"] for r in results if r["name"].startswith("gpuload")}
        assert "where marked" in figure.axes[1].get_title()
    finally:
        plt.close(figure)


def test_the_headline_adds_the_ratio_against_torch_with_workers_when_they_beat_the_baseline() -> None:
    results = load(Path(__file__).parent / "fixtures" / "inmemory-cpu.json")["results"]
    assert "with num_workers" not in headline(results)  # the fixture's 2 workers are slower than none
    workers = next(r for r in results if r["name"] == "torch DataLoader (num_workers=2)")
    workers["samples_per_s"] = 534_800
    line = headline(results)
    assert line.startswith("gpuload (device cache): 9.1x torch's DataLoader (num_workers=0), 5.0x with "
                           "num_workers=2 on this machine; after the first epoch 0 B per epoch")


def test_no_headline_without_both_loaders_and_a_busy_note_only_past_the_cores() -> None:
    from gpuload.bench.report import busy_note

    assert headline([]) == ""
    assert busy_note(1.5, 2) == "" and busy_note(None, 2) == "" and busy_note(3.0, None) == ""
    assert busy_note(7.9, 2) == "note: the machine was busy (load average 7.9 on 2 cores): the rates are noisy"
    assert " ".join(busy_note(7.9, 2, threads=4).split()).endswith(
        "noisy; --threads 1 keeps torch's intra-op threads from waiting on each other")


def test_a_failed_write_leaves_neither_a_file_nor_its_temporary(tmp_path: Path) -> None:
    from gpuload.bench.report import _replace_atomically

    def disk_full(handle) -> None:  # type: ignore[no-untyped-def]
        handle.write(b"half a chart")
        raise OSError("No space left on device")

    (tmp_path / "bench.png").write_bytes(b"the previous chart")
    with pytest.raises(OSError, match="No space left on device"):
        _replace_atomically(tmp_path / "bench.png", disk_full)
    assert [p.name for p in tmp_path.iterdir()] == ["bench.png"]
    assert (tmp_path / "bench.png").read_bytes() == b"the previous chart"


def test_a_loader_with_no_byte_figures_is_marked_not_modelled_in_the_chart() -> None:
    import matplotlib.pyplot as plt

    results = copy.deepcopy(load(Path(__file__).parent / "fixtures" / "inmemory-cpu.json")["results"])
    unmodelled = [r for r in results if r["kind"] != "ideal"][-1]
    unmodelled["h2d_measured"], unmodelled["h2d_modelled"] = False, None
    figure = draw_chart(results, "t")
    try:
        moved = figure.axes[1]
        assert [t.get_text() for t in moved.texts].count("not modelled") == 1
        bars = {patch.get_gid() for patch in moved.patches}
        assert f"bytes-later:{unmodelled['name']}" not in bars
        assert all(f"bytes-later:{r['name']}" in bars for r in results if r["kind"] != "ideal" and r is not unmodelled)
    finally:
        plt.close(figure)


def test_the_headline_gives_one_rows_speed_and_bytes_never_another_rows() -> None:
    """A streaming row faster than the device cache (a noisy CPU run): its speed beside the device
    cache's 0 B was a claim no loader made; before: "(with device cache; torch: 12.0 MiB)"."""
    results = load(Path(__file__).parent / "fixtures" / "inmemory-cpu.json")["results"]
    streaming = next(r for r in results if r["name"] == "gpuload DataLoader (streaming, no cache)")
    streaming["samples_per_s"] = 10 * max(r["samples_per_s"] for r in results)
    add_ratios(results)
    line = headline(results)
    per_epoch = h2d_figures(streaming)[1]
    assert line.startswith("gpuload (streaming, no cache): ") and per_epoch > 0
    assert f"after the first epoch {per_epoch / 2**20:.1f} MiB per epoch cross to the device (torch: " in line
    assert "device cache" not in line


def test_the_exposed_wait_per_step_is_side_by_side_with_gpuloads_top_stage() -> None:
    results = load(Path(__file__).parent / "fixtures" / "images-cpu.json")["results"]
    assert "wait/step" not in format_table(results)  # a document from before the column: no table
    for k, r in enumerate(results):
        r["wait_ms_per_step"] = 1.5 * (k + 1)
        if r["name"].startswith("gpuload"):
            r["top_stage"] = "decode"
    table = format_table(results)
    rows = table.split("wait/step", 1)[1].splitlines()
    for r in results:
        if r["kind"] == "ideal":
            continue
        row = next(line for line in rows if line.startswith(display_name(r["name"])))
        assert f"{r['wait_ms_per_step']:.3f} ms" in row
        assert row.endswith("image decoding" if r["name"].startswith("gpuload") else "-"), row
    assert all(len(line) <= WIDTH for line in table.splitlines())


def test_the_stage_panel_draws_each_gpuload_rows_stage_shares_and_every_rows_wait() -> None:
    import matplotlib.pyplot as plt

    from gpuload.bench.report import stage_shares

    results = load(Path(__file__).parent / "fixtures" / "inmemory-cpu.json")["results"]
    for k, r in enumerate(results):
        r["wait_ms_per_step"] = 0.25 * (k + 1)
        r["stage_ms_per_step"] = None
    cached = next(r for r in results if r["name"] == "gpuload DataLoader (device cache)")
    streaming = next(r for r in results if r["name"] == "gpuload DataLoader (streaming, no cache)")
    cached["stage_ms_per_step"] = {"gather.device": 0.3, "other": 0.1}
    streaming["stage_ms_per_step"] = {"other": 0.2, "copy": 0.2, "gather.host": 0.6, "a new stage": 0.0}
    assert stage_shares(streaming) == {"gather.host": 0.6, "copy": 0.2, "other": 0.2}  # STAGES' order, none at 0
    assert list(stage_shares(streaming)) == ["gather.host", "copy", "other"]
    assert stage_shares(results[0]) == {} and stage_shares({"stage_ms_per_step": {"read": 0.0}}) == {}
    figure = draw_chart(results, "t")
    try:
        figure.canvas.draw()
        assert len(figure.axes) >= 3
        panel = figure.axes[2]
        segments = {patch.get_gid(): patch.get_width() for patch in panel.patches}
        for r in (cached, streaming):
            drawn = {gid.split(":")[1]: width for gid, width in segments.items() if gid.endswith(f":{r['name']}")}
            assert drawn == pytest.approx({name: 100 * share for name, share in stage_shares(r).items()})
        assert len(segments) == 5  # torch's rows have no stages
        waits = {text.get_gid(): text.get_text() for text in panel.texts}
        loaders = [r for r in results if r["kind"] != "ideal"]
        assert set(waits) == {f"wait:{r['name']}" for r in loaders}
        for r in loaders:
            assert f"wait {r['wait_ms_per_step']:.3f} ms/step" in waits[f"wait:{r['name']}"]
        assert "top: cache gather (device tier) 75%" in waits[f"wait:{cached['name']}"]
        assert "no stage timeline" in waits["wait:torch DataLoader (num_workers=0)"]
        legend = [text.get_text() for text in panel.get_legend().get_texts()]
        assert sorted(legend) == sorted(["cache gather (device tier)", "cache gather (host tier)",
                                         "host-to-device copy", "other loader work (collation, Python)"])
    finally:
        plt.close(figure)


def test_a_document_from_before_the_wait_was_measured_gets_two_panels() -> None:
    import matplotlib.pyplot as plt

    results = load(Path(__file__).parent / "fixtures" / "inmemory-cpu.json")["results"]
    assert all("wait_ms_per_step" not in r for r in results)
    figure = draw_chart(results, "t")
    try:
        assert len([axis for axis in figure.axes if axis.get_title()]) == 2
    finally:
        plt.close(figure)
