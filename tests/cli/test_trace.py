"""``gpuload trace``: a user's loader run for N steps with a stand-in step prints the stage table and
the verdict; every bad source is one line naming it, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuload.cli import main

TRAIN = '''
import time
import torch
import gpuload

class Reads(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, index):
        time.sleep(0.01)
        return torch.full((4,), float(index))

def make():
    return gpuload.DataLoader(Reads(), batch_size=4)

ready = make()
not_a_loader = torch.utils.data.DataLoader(Reads(), batch_size=4)
'''


@pytest.fixture
def train(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    return path


@pytest.mark.parametrize("name", ["make", "ready"])
def test_the_stage_table_and_the_verdict_name_the_slow_reads(train: Path, name: str, capsys) -> None:
    assert main(["trace", f"{train}:{name}", "--steps", "6", "--step-ms", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("6 steps of torch on cpu, stand-in step 1 ms:")  # 6 steps: into a second epoch
    assert "dataset reads" in out.splitlines()[2]  # the table's first row: the largest stage
    assert out.splitlines()[-1].startswith("data-bound") and "num_workers=" in out


def test_a_long_stand_in_step_is_compute_bound(tmp_path: Path, capsys) -> None:
    """100 ms steps against microseconds of data: a stall of the loop's thread on a busy machine
    (tens of ms) still leaves the wait under 5%."""
    (tmp_path / "fast.py").write_text(
        "import torch, gpuload\n"
        "loader = gpuload.DataLoader(torch.utils.data.TensorDataset(torch.arange(64.0)), batch_size=8)\n")
    assert main(["trace", f"{tmp_path / 'fast.py'}:loader", "--steps", "5", "--step-ms", "100"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("compute-bound")


@pytest.mark.parametrize("source, message", [
    ("train.py", "must be written path/to/train.py:NAME"),
    ("missing.py:make", "missing.py is not a file"),
    ("{train}:nothing", "has no 'nothing'"),
    ("{train}:not_a_loader", "gave a DataLoader, not a gpuload.DataLoader"),
    ("no_such_package_here.module:make", "cannot import no_such_package_here.module"),
])
def test_a_bad_source_is_one_line_naming_it(train: Path, source: str, message: str, capsys) -> None:
    assert main(["trace", source.format(train=train)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpuload trace: error:") and message in err, err


def test_a_loader_whose_timeline_is_off_is_refused(train: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("GPULOAD_TIMELINE", "off")
    assert main(["trace", f"{train}:make"]) == 2
    assert "timeline is off" in capsys.readouterr().err
