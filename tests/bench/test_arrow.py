"""The arrow scenario: gpuload, torch's DataLoader and dataset.iter over one synthetic table."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("datasets")

from gpuload.bench.arrow import ArrowConfig, format_arrow, ratios, run_arrow, write_synthetic_table  # noqa: E402
from gpuload.cli.main import main  # noqa: E402
from gpuload.datasets import ArrowTable, Parquet  # noqa: E402
from tests.bench.stage_panel import assert_traced  # noqa: E402


def test_the_table_holds_an_embedding_a_label_and_token_lists_in_both_files(tmp_path: Path) -> None:
    config = ArrowConfig(rows=70_000, width=4, max_tokens=5)  # two Parquet slices of 64k rows
    saved, parquet = write_synthetic_table(tmp_path, config)
    for table in (ArrowTable(saved).table, Parquet(parquet).table):
        assert table.num_rows == 70_000 and table.column_names == ["embedding", "label", "tokens"]
        embedding = table.schema.field("embedding").type
        assert embedding.list_size == 4 and str(embedding.value_type) == "float"
        lengths = table.column("tokens").combine_chunks().value_lengths().to_numpy()
        assert 1 <= lengths.min() and lengths.max() <= 5 and len(set(lengths.tolist())) > 1
    saved_rows, parquet_rows = ArrowTable(saved), Parquet(parquet)
    for index in (0, 65_536, 69_999):
        assert str(saved_rows[index]) == str(parquet_rows[index])


def test_a_small_run_times_every_loader(tmp_path: Path) -> None:
    config = ArrowConfig(rows=3000, width=8, batch_size=64, epochs=2, torch_workers=(0,))
    rows = run_arrow(config, torch.device("cpu"), tmp_path)
    assert [row.name for row in rows] == ["gpuload DataLoader (datasets.Dataset)", "gpuload DataLoader (Parquet)",
                                          "torch DataLoader (num_workers=0)", "datasets' dataset.iter(batch_size)"]
    assert [len(row.seconds) for row in rows] == [2, 2, 1, 1]
    assert all(row.first_per_s(config) > 0 for row in rows)
    assert rows[0].notes["path"] == rows[1].notes["path"] == "device-gather"  # gpuload's columns, not torch's path
    for row in rows[:2]:  # the stage panel's data: one more epoch of each gpuload loader, traced
        assert row.stages is not None
        assert_traced(row.stages, row.name)
    assert rows[2].stages is None and rows[3].stages is None
    assert set(ratios(rows, config)) == {"cached_vs_dataset_iter", "cached_vs_torch_0_workers"}
    table = format_arrow(rows, config)
    assert all(len(line) <= 100 for line in table.splitlines()) and "1st epoch/s" in table


def test_the_command_runs_and_writes_json(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (10_000.0, 0.0, 0.0))  # the run notes a busy machine
    assert main(["bench", "--scenario", "arrow", "--quick", "--samples", "2000", "--epochs", "2",
                 "--torch-workers", "0", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "gpuload over a datasets.Dataset:" in printed
    assert "x torch's DataLoader (num_workers=0; target 20x)" in printed
    assert "note: the machine was busy (load average 10000.0 on" in printed
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["scenario"] == "arrow" and document["config"]["rows"] == 2000
    assert len(document["results"]) == 4
    assert [row["name"] for row in document["stages"]] == [
        "gpuload DataLoader (datasets.Dataset)", "gpuload DataLoader (Parquet)"]
    assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG")
    assert not list(tmp_path.glob("*.parquet"))  # the table went with its temporary folder
    assert main(["bench", "--scenario", "arrow", "--data", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "the arrow scenario makes its own table" in capsys.readouterr().err
