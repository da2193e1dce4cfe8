"""``gpuload bench --scenario distributed``: 2 gloo ranks end to end, the report from a stored
run, the checksum, and the arguments it refuses."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch

from gpuload.bench.distributed import (
    DistributedConfig,
    batch_checksum,
    choose_device,
    distributed_headline,
    format_distributed,
    gather_rows,
    parse_scopes,
    run_distributed_bench,
)
from gpuload.bench.scenarios import BenchConfig
from gpuload.cli import main
from gpuload.device import DeviceError, cuda_available

STORED = Path(__file__).parent / "distributed-cpu.json"  # a real default run, 2 CPU ranks


def test_two_ranks_get_torchs_batches_and_the_split_scopes_hold_half(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (10_000.0, 0.0, 0.0))  # the run notes a busy machine
    args = ["bench", "--scenario", "distributed", "--samples", "1000", "--batch-size", "100", "--epochs", "1",
            "--device", "cpu", "--out", str(tmp_path)]
    assert main(args) == 0
    document = json.loads((tmp_path / "bench.json").read_text())
    rows = {row["scope"] or "torch": row for row in document["rows"]}
    assert list(rows) == ["torch", "rank", "node", "world"]
    assert document["config"]["backend"] == "gloo" and document["config"]["processes"] == 2
    dataset_bytes = document["ranks"][0]["dataset_bytes"]
    assert dataset_bytes == 1000 * (3 * 32 * 32 + 8)
    for row in rows.values():
        assert row["equal"] == [True, True], row["name"]
        assert row["samples_per_epoch"] == [500, 500] and row["batches_per_epoch"] == [5, 5]
        assert all(rate > 0 for rate in row["samples_per_s"]) and len(row["x_torch"]) == 2
    assert rows["torch"]["x_torch"] == [1.0, 1.0] and rows["torch"]["held_where"] == "-"
    assert rows["rank"]["held_bytes"] == [dataset_bytes] * 2 and rows["rank"]["held_where"] == "in place"
    assert rows["rank"]["bytes_received_per_epoch"] == [None, None]
    for scope in ("node", "world"):
        row = rows[scope]
        assert row["path"] == f"sharded-{scope}" and row["ranks_per_copy"] == 2 and row["held_where"] == "host"
        assert sum(row["held_bytes"]) == dataset_bytes  # one copy, split over the two ranks
        # Each rank holds half the rows, so it receives about half of its 500 samples' bytes.
        assert all(0 < received < 500 * (3 * 32 * 32 + 8) for received in row["bytes_received_per_epoch"])
        assert row["bytes_sent_per_epoch"][0] == row["bytes_received_per_epoch"][1]
        assert all(waited >= 0 for waited in row["exchange_wait_s_per_epoch"])
    assert document["environment"]["load_average_during"] == 10_000.0
    out = capsys.readouterr().out
    assert "gpuload (scope world)" in out and "BATCHES DIFFER" not in out
    assert "note: the machine was busy (load average 10000.0 on" in out
    assert out.rstrip().endswith(f"results: {tmp_path / 'bench.json'}")


def test_a_rank_that_raises_fails_the_run_with_its_error(tmp_path: Path, capsys) -> None:
    config = DistributedConfig(BenchConfig(num_samples=64, batch_size=16, epochs=1, torch_workers=(0,), step="spin"))
    assert run_distributed_bench(config, tmp_path, {}, quiet=True) == 1
    error = capsys.readouterr().err
    assert "gpuload bench: a rank failed: ProcessRaisedException" in error and "unknown step 'spin'" in error
    assert not (tmp_path / "bench.json").exists()


def test_the_report_from_a_stored_run_fits_100_columns_and_says_each_scope() -> None:
    document = json.loads(STORED.read_text())
    table = format_distributed(document)
    assert all(len(line) <= 100 for line in table.splitlines())
    lines = table.splitlines()
    for name in ("torch (num_workers=0)", "gpuload (scope rank)", "gpuload (scope node)", "gpuload (scope world)"):
        assert any(line.startswith(name) for line in lines), name
    world = next(line for line in lines if line.startswith("gpuload (scope world)"))
    assert "73.43 MiB host" in world and "36.77 MiB" in world  # half of 146.9 MiB held, a quarter received
    assert "146.87 MiB in place" in next(line for line in lines if line.startswith("gpuload (scope rank)"))
    assert "BATCHES DIFFER" not in table
    headline = distributed_headline(document)
    assert headline.startswith("gpuload per rank, 2 gloo ranks, against torch's DataLoader + DistributedSampler")
    assert "world" in headline and "(the dataset: 146.87 MiB)" in headline


def test_a_rank_whose_batches_differ_is_flagged() -> None:
    document = copy.deepcopy(json.loads(STORED.read_text()))
    document["ranks"][1]["loaders"][2]["equal"] = False
    document["rows"] = gather_rows(document["ranks"])
    node = next(line for line in format_distributed(document).splitlines() if line.startswith("gpuload (scope node)"))
    assert node.endswith("BATCHES DIFFER")
    assert distributed_headline(document).endswith("BATCHES DIFFERED from torch's")


def test_rows_take_each_ranks_ratio_to_its_own_torch() -> None:
    def loader(kind: str, seconds: list[float], scope: str | None = None) -> dict:
        return {"name": kind, "kind": kind, "scope": scope, "path": "", "equal": True, "samples_per_epoch": 100,
                "batches_per_epoch": 1, "epoch_s": seconds, "loop_wait_s": [0.0] * len(seconds),
                "held_bytes": 0, "held_where": "-", "exchange": None}

    ranks = [{"loaders": [loader("baseline", [9.0, 1.0, 1.0]), loader("gpuload", [9.0, 0.5, 0.25], "node")]},
             {"loaders": [loader("baseline", [9.0, 2.0, 2.0]), loader("gpuload", [9.0, 0.5, 0.5], "node")]}]
    baseline, ours = gather_rows(ranks)
    assert baseline["samples_per_s"] == [100.0, 50.0] and baseline["x_torch"] == [1.0, 1.0]
    # Steady epochs only (the warm-up's 9 s is left out): medians 0.375 s and 0.5 s.
    assert ours["samples_per_s"] == pytest.approx([100 / 0.375, 200.0])
    assert ours["x_torch"] == pytest.approx([1 / 0.375, 4.0])
    assert ours["first_epoch_s"] == [9.0, 9.0]


def test_the_checksum_sees_order_content_and_every_leaf() -> None:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (6, 3, 4, 4), dtype=torch.uint8, generator=g)
    labels = torch.arange(6)
    batch = [images, labels, labels % 2 == 0, torch.randn(6, 2, dtype=torch.float64, generator=g)]
    reference = batch_checksum(batch)
    assert reference.dtype == torch.int64 and reference.shape == (8,)
    assert torch.equal(batch_checksum([t.clone() for t in batch]), reference)
    swapped = [t[[1, 0, 2, 3, 4, 5]] for t in batch]
    assert not torch.equal(batch_checksum(swapped), reference)
    changed = [images.clone(), labels, batch[2], batch[3]]
    changed[0][3, 1, 2, 0] ^= 1
    assert not torch.equal(batch_checksum(changed), reference)
    assert torch.equal(batch_checksum({"x": images, "y": labels}), batch_checksum([images, labels]))


def test_scopes_and_devices_are_checked() -> None:
    assert parse_scopes("rank, world") == ("rank", "world")
    for text in ("", "rank,galaxy", "node,node"):
        with pytest.raises(ValueError, match="rank, node, world, auto|twice"):
            parse_scopes(text)
    assert choose_device("cpu", 2) == "cpu"
    with pytest.raises(DeviceError, match="rank r on cuda:r"):
        choose_device("cuda:0", 2)
    if not cuda_available():
        assert choose_device(None, 2) == "cpu"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scenario", "distributed", "--processes", "1"], "argument --processes: 1 must be at least 2"),
        (["--scenario", "distributed", "--scopes", "rank,galaxy"], "argument --scopes: 'rank,galaxy'"),
        (["--scopes", "rank"], "argument --scopes: only applies to --scenario distributed"),
        (["--scenario", "inmemory", "--processes", "4"], "argument --processes: only applies to --scenario"),
        (["--scenario", "distributed", "--data", "x.npy"], "argument --data: the distributed scenario makes"),
        (["--scenario", "distributed", "--device-memory", "16GiB"], "argument --device-memory:"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], message: str, tmp_path: Path, capsys) -> None:
    assert main(["bench", *args, "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert message in error, error
    assert not (tmp_path / "bench.json").exists()


@pytest.mark.gpu
def test_nccl_ranks_with_a_gpu_each_hold_their_share_on_the_device(tmp_path: Path) -> None:
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip(f"needs 2 CUDA devices for NCCL between ranks (one per rank); this machine has {count}")
    args = ["bench", "--scenario", "distributed", "--samples", "1000", "--batch-size", "100", "--epochs", "1",
            "--device", "cuda", "--out", str(tmp_path)]
    assert main(args) == 0
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["config"]["backend"] == "nccl"
    dataset_bytes = document["ranks"][0]["dataset_bytes"]
    rows = {row["scope"] or "torch": row for row in document["rows"]}
    assert all(row["equal"] == [True, True] for row in rows.values())
    assert rows["rank"]["held_where"] == "device" and rows["rank"]["held_bytes"] == [dataset_bytes] * 2
    for scope in ("node", "world"):
        assert rows[scope]["held_where"] == "device" and sum(rows[scope]["held_bytes"]) == dataset_bytes


@pytest.mark.parametrize("gpus", [1, 4])
def test_cuda_is_the_default_only_with_a_gpu_per_rank(monkeypatch: pytest.MonkeyPatch, gpus: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert choose_device(None, 2) == ("cuda" if gpus >= 2 else "cpu")
    if gpus >= 2:
        assert choose_device("cuda", 2) == "cuda"
    else:
        with pytest.raises(DeviceError, match=r"^cuda with 2 processes needs one GPU per rank: device='cuda:1' does "
                           r"not exist: this machine has 1 CUDA device\(s\), cuda:0 to cuda:0$"):
            choose_device("cuda", 2)


def test_no_headline_without_a_gpuload_row() -> None:
    document = json.loads(STORED.read_text())
    assert distributed_headline(document) != ""
    document["rows"] = [r for r in document["rows"] if r["kind"] != "gpuload"]
    assert distributed_headline(document) == ""


def test_an_epoch_runs_the_step_on_every_batch_and_close_stops_torchs_workers() -> None:
    from torch.utils.data import DataLoader as TorchDataLoader
    from torch.utils.data import TensorDataset

    from gpuload.bench import distributed as bench

    data = TensorDataset(torch.arange(12))
    loader = TorchDataLoader(data, batch_size=4, num_workers=1, persistent_workers=True)
    rank_loader = bench._RankLoader(bench._Measured("torch DataLoader (num_workers=1)", "torch", None, [], []),
                                    loader, None)
    stepped: list[list[int]] = []
    checksums = bench._timed_epoch(rank_loader, torch.device("cpu"), lambda batch: stepped.append(batch[0].tolist()))
    assert stepped == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]] and len(checksums) == 3
    workers = loader._iterator._workers
    assert all(worker.is_alive() for worker in workers)
    rank_loader.close()
    assert not any(worker.is_alive() for worker in workers)
