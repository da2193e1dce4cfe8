"""The samples scenario: many small samples, torch's DataLoader beside gpuload's sample cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpuload.bench.samples import (
    SampleRun,
    SmallSamples,
    draw_samples_chart,
    format_samples,
    run_samples,
    samples_headline,
    targets_met,
)
from tests.bench.stage_panel import assert_traced, stage_bars

STORED = Path(__file__).parent / "samples-cpu.json"  # a real --quick run on the 2-core CPU machine


def test_a_small_run_fills_the_cache_and_reports_every_target() -> None:
    run = run_samples(3_000, 0, 256, torch.device("cpu"), rounds=1, cached_epochs=1)
    assert len(run.torch_s) == len(run.fill_s) == len(run.cached_s) == len(run.rss_growth_bytes) == 1
    assert "by column: 2 column(s) [int64[8], int64[]]" in run.layout
    assert run.data_bytes == 3_000 * 72 == len(SmallSamples(3_000)) * SmallSamples.sample_bytes
    table = format_samples([run])
    assert "fill/torch" in table and "    3,000       0" in table
    # Whether this machine met the targets depends on its load: only that they are reported.
    (row,) = [line for line in table.splitlines() if line.startswith("    3,000")]
    assert row.endswith(("  all met", "  MISSED"))
    assert all(len(line) <= 100 for line in table.splitlines())


def test_missed_targets_are_named_within_100_columns() -> None:
    slow = SampleRun(400_000, 2, 256, torch_s=[1.0], fill_s=[13.3], cached_s=[0.9],
                     rss_growth_bytes=[1 << 40], layout="")
    met = SampleRun(400_000, 2, 256, torch_s=[1.0], fill_s=[1.0], cached_s=[0.1], rss_growth_bytes=[0],
                    layout="")
    lines = format_samples([slow, met]).splitlines()
    first = next(k for k, line in enumerate(lines) if line.startswith("  400,000"))
    assert lines[first].endswith("  MISSED") and lines[first + 1].strip() == "missed: fill, cached, memory"
    assert lines[first + 2].startswith("  400,000") and lines[first + 2].endswith("  all met")
    assert all(len(line) <= 100 for line in lines), max(map(len, lines))


def test_a_cache_that_did_not_fill_is_an_error_not_a_cached_rate(pretend_host_memory) -> None:
    pretend_host_memory(free=64 * 1024)  # room for a few hundred of the 3,000 samples
    with pytest.warns(UserWarning, match="sample cache of this SmallSamples is partial"), \
            pytest.raises(RuntimeError, match="gpuload's sample cache did not fill: "):
        run_samples(3_000, 0, 256, torch.device("cpu"), rounds=1, cached_epochs=1)


def test_targets_are_the_issues() -> None:
    run = SampleRun(400_000, 0, 256, torch_s=[1.0], fill_s=[1.3], cached_s=[0.2], rss_growth_bytes=[0],
                    layout="")
    assert targets_met(run) == {"fill": True, "cached": True, "memory": True}
    run.fill_s, run.cached_s = [1.31], [0.21]
    run.rss_growth_bytes = [2 * 400_000 * 72 + (64 << 20) + 1]
    assert targets_met(run) == {"fill": False, "cached": False, "memory": False}


def test_the_chart_from_a_stored_run_shows_every_bar_and_the_headline_says_it() -> None:
    import matplotlib.pyplot as plt

    runs = json.loads(STORED.read_text())["runs"]
    figure = draw_samples_chart(runs, "gpuload bench: samples")
    try:
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        axis = figure.axes[0]
        frame = axis.get_window_extent(renderer)
        bars = {patch.get_gid(): patch.get_window_extent(renderer) for patch in axis.patches if patch.get_gid()}
        assert len(bars) == 3 * len(runs)
        for gid, bar in bars.items():
            assert min(bar.x1, frame.x1) - max(bar.x0, frame.x0) >= 5, gid  # visible on the log scale
    finally:
        plt.close(figure)
    headline = samples_headline(runs)
    assert headline.startswith("gpuload: cached epochs") and "x faster than torch's DataLoader" in headline


def test_the_scenario_writes_its_json_and_chart_and_prints_the_headline(tmp_path: Path, monkeypatch, capsys) -> None:
    from gpuload.bench import samples

    assert samples.scenario_runs(False, 5_000) == [(5_000, 0), (5_000, 2)]
    assert samples.scenario_runs(True, None) == [(100_000, 0), (200_000, 2)]
    monkeypatch.setattr(samples, "scenario_runs", lambda quick, count: [(count, 0)])  # no worker start-up here
    assert samples.run_samples_bench(True, 2_000, 128, torch.device("cpu"), tmp_path, {"host": "test"}) == 0
    out = capsys.readouterr().out
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["scenario"] == "samples" and document["environment"] == {"host": "test"}
    (run,) = document["runs"]
    assert run["num_samples"] == 2_000 and run["batch_size"] == 128 and len(run["torch_s"]) == 1
    assert_traced(run["stages"], "2,000 samples, num_workers=0")  # the stage panel's data
    assert "gather.host" in run["stages"]["stage_ms_per_step"]  # a cached epoch: served from the sample cache
    figure = draw_samples_chart(document["runs"], "gpuload bench: samples")
    try:
        assert stage_bars(figure) == {"2,000 samples, num_workers=0"}
    finally:
        import matplotlib.pyplot as plt

        plt.close(figure)
    assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG")
    assert "batch 128" in out and "done: 2,000 samples, num_workers=0" in out
    assert f"results: {tmp_path / 'bench.json'}; chart: {tmp_path / 'bench.png'}" in out
    assert samples_headline([]) == ""


def test_resident_bytes_is_zero_where_proc_is_missing(monkeypatch) -> None:
    from gpuload.bench import samples

    assert samples.resident_bytes() > 0

    def no_proc(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise FileNotFoundError(path)

    monkeypatch.setattr(samples, "open", no_proc, raising=False)
    assert samples.resident_bytes() == 0


def test_no_cpu_ratio_when_torch_took_no_measurable_cpu_time() -> None:
    run = SampleRun(1_000, 0, 256, torch_s=[1.0], fill_s=[1.0], cached_s=[0.5], rss_growth_bytes=[0], layout="",
                    torch_cpu_s=[0.0], fill_cpu_s=[0.01])
    assert run.fill_cpu_ratio is None and run.as_dict()["fill_cpu_ratio"] is None
    run.torch_cpu_s = [0.02]
    assert run.fill_cpu_ratio == pytest.approx(0.5)
