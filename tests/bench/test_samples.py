"""The samples scenario: many small samples, torch's DataLoader beside gpuload's sample cache."""

from __future__ import annotations

import torch

from gpuload.bench.samples import (
    SampleRun,
    SmallSamples,
    format_samples,
    run_samples,
    targets_met,
)


def test_a_small_run_fills_the_cache_and_reports_every_target() -> None:
    run = run_samples(3_000, 0, 256, torch.device("cpu"), rounds=1, cached_epochs=1)
    assert len(run.torch_s) == len(run.fill_s) == len(run.cached_s) == len(run.rss_growth_bytes) == 1
    assert "by column: 2 column(s) [int64[8], int64[]]" in run.layout
    assert run.data_bytes == 3_000 * 72 == len(SmallSamples(3_000)) * SmallSamples.sample_bytes
    table = format_samples([run])
    assert "fill/torch" in table and "   3000       0" in table


def test_targets_are_the_issues() -> None:
    run = SampleRun(400_000, 0, 256, torch_s=[1.0], fill_s=[1.3], cached_s=[0.2], rss_growth_bytes=[0],
                    layout="")
    assert targets_met(run) == {"fill": True, "cached": True, "memory": True}
    run.fill_s, run.cached_s = [1.31], [0.21]
    run.rss_growth_bytes = [2 * 400_000 * 72 + (64 << 20) + 1]
    assert targets_met(run) == {"fill": False, "cached": False, "memory": False}
