"""The tokens scenario: gpuload, torch's DataLoader and nanoGPT's get_batch over one token shard."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from gpuload.bench.tokens import (
    TokenConfig,
    format_tokens,
    get_batch_loop,
    gpuload_modelled,
    ratios,
    run_tokens,
    write_synthetic_shard,
)
from gpuload.cli.main import main
from gpuload.datasets.tokens import TokenWindows
from tests.bench.stage_panel import assert_traced


def test_the_shard_is_a_speedrun_shard_and_get_batch_reads_it(tmp_path: Path) -> None:
    path = write_synthetic_shard(tmp_path / "s.bin", 10_000, seed=3)
    ds = TokenWindows(path, 16)
    assert ds.num_tokens == 10_000 and ds.token_dtype == torch.uint16
    tokens = ds.tokens().to(torch.int64)
    assert int(tokens.max()) < 50257
    x, y = next(get_batch_loop(path, TokenConfig(num_tokens=10_000, seq_len=16, batch_size=4), torch.device("cpu")))
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    for row_x, row_y in zip(x, y):  # each row is a window of the shard, y shifted by one
        windows = np.lib.stride_tricks.sliding_window_view(tokens.numpy(), 16)
        start = int(np.flatnonzero((windows == row_x.numpy()).all(1))[0])
        assert torch.equal(row_y, tokens[start + 1 : start + 17])


def test_a_small_run_times_every_loader(tmp_path: Path) -> None:
    config = TokenConfig(num_tokens=50_000, seq_len=64, batch_size=8, steps=5, rounds=1, torch_workers=(0,))
    rows = run_tokens(config, torch.device("cpu"), tmp_path)
    assert [row.name for row in rows] == ["gpuload DataLoader", "torch DataLoader (num_workers=0)",
                                          "nanoGPT get_batch loop"]
    assert all(len(row.seconds) == len(row.anon_growth_bytes) == 1 and row.samples_per_s(config) > 0 for row in rows)
    ours = rows[0]
    assert ours.notes["path"] == "device-gather" and ours.notes["token_bytes"] == 100_000
    assert ours.h2d_modelled and ours.h2d_bytes_per_step == 0  # 100 kB of tokens fit a 16 GiB card
    assert rows[1].h2d_bytes_per_step == 2 * 8 * 64 * 8
    assert_traced(ours.stages, "gpuload DataLoader")  # the stage panel's data: its 5 traced steps
    assert rows[1].stages is None and rows[2].stages is None
    found = ratios(rows, config)
    assert set(found) == {"vs_get_batch", "vs_torch_0_workers"}
    table = format_tokens(rows, config)
    assert all(len(line) <= 100 for line in table.splitlines()) and "tokens/s" in table


def test_the_modelled_plan_counts_token_bytes_not_windows() -> None:
    per_step, notes = gpuload_modelled(TokenConfig(num_tokens=100_000_000), 16 << 30)
    assert per_step == 0 and 200_000_000 - 1024 < notes["fill_bytes_modelled"] <= 200_000_000
    per_step, notes = gpuload_modelled(TokenConfig(num_tokens=100_000_000), 1 << 30)  # the 2 GiB reserve leaves 0
    assert per_step == 32 * 1025 * 2 and notes["fill_bytes_modelled"] == 0  # each batch's uint16 windows


def test_the_command_runs_quick_and_writes_json(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (10_000.0, 0.0, 0.0))  # the run notes a busy machine
    assert main(["bench", "--scenario", "tokens", "--quick", "--torch-workers", "0", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "gpuload over TokenWindows:" in printed and "x torch's DataLoader (num_workers=0; target 10x)" in printed
    assert "note: the machine was busy (load average 10000.0 on" in printed
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["scenario"] == "tokens" and document["load_average_after"]
    assert {row["name"] for row in document["results"]} == {
        "gpuload DataLoader", "torch DataLoader (num_workers=0)", "nanoGPT get_batch loop"}
    assert not list(Path(tmp_path).glob("*.bin"))  # the shard went with its temporary folder
    (traced,) = document["stages"]
    assert_traced(traced, "gpuload DataLoader")
    assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG") and "chart: " in printed


def test_anonymous_bytes_is_zero_where_the_kernel_does_not_say(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from gpuload.bench import tokens

    assert tokens.anonymous_bytes() > 0  # this process has heap pages
    status = {"text": "Name:\tpython\nRssAnon:\t  2048 kB\n"}
    monkeypatch.setattr(tokens, "open", lambda path, **kwargs: io.StringIO(status["text"]), raising=False)
    assert tokens.anonymous_bytes() == 2048 * 1024
    status["text"] = "Name:\tpython\n"  # a kernel before 4.5 has no RssAnon line
    assert tokens.anonymous_bytes() == 0
    status["text"] = "RssAnon:\tlots kB\n"
    assert tokens.anonymous_bytes() == 0

    def no_proc(path, **kwargs):  # type: ignore[no-untyped-def]
        raise FileNotFoundError(path)

    monkeypatch.setattr(tokens, "open", no_proc, raising=False)
    assert tokens.anonymous_bytes() == 0


def test_shutdown_stops_torchs_persistent_workers() -> None:
    from torch.utils.data import DataLoader as TorchDataLoader

    from gpuload.bench import tokens

    loader = TorchDataLoader(list(range(8)), batch_size=4, num_workers=1, persistent_workers=True)
    assert [batch.tolist() for batch in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    workers = loader._iterator._workers
    assert all(worker.is_alive() for worker in workers)
    tokens.shutdown_workers(loader)()
    assert not any(worker.is_alive() for worker in workers)
    tokens.shutdown_workers(TorchDataLoader(list(range(8)), batch_size=4))()  # never iterated: nothing to stop
