"""``gpuload plan --model``: the job plan from the command line, and its one-line errors."""

from __future__ import annotations

import numpy as np
import pytest

from gpuload.cli import main


def test_job_plan_for_a_factory_on_a_pretended_card(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # no gpuload.toml
    data = tmp_path / "data.npz"
    np.savez(data, x=np.zeros((5000, 3, 32, 32), dtype=np.uint8), y=np.zeros(5000, dtype=np.int64))
    args = ["plan", "--model", "job_models:cnn", "--input-shape", "3,32,32", "--optimizer", "sgd",
            "--device-memory", "4GiB", "--host-memory", "64GiB", str(data)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "model: job_models:cnn, input 3x32x32 float32, optimizer sgd" in out
    assert "job plan for a pretended 4.00 GiB card" in out
    assert "(largest that fits, a multiple of 8)" in out and "whole dataset cached" in out
    assert main([*args, "--batch-size", "100"]) == 0
    assert "batch size: 100 (your batch size)" in capsys.readouterr().out


def test_plan_without_model_is_unchanged(capsys) -> None:
    assert main(["plan", "--synthetic", "cifar", "--device-memory", "16GiB", "--host-memory", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("settings:") and "cache plan:" in out and "job plan" not in out


@pytest.mark.parametrize(
    ("model", "shape", "message"),
    [
        ("no_such_module:f", "3,32,32", "cannot import 'no_such_module'"),
        ("job_models:nope", "3,32,32", "has no attribute 'nope'"),
        ("job_models", "3,32,32", "must be written pkg.module:factory"),
        ("job_models:SAMPLES", "3,32,32", "not a function"),
        ("job_models:cnn", "3,x", "positive integers separated by commas"),
        ("job_models:cnn", "3,0,4", "positive integers separated by commas"),
        ("job_models:cnn", "5,32,32", "the training step of job_models:cnn failed on a 5,32,32 input"),
    ],
)
def test_bad_model_or_shape_is_one_line_and_exit_2(model: str, shape: str, message: str, capsys) -> None:
    assert main(["plan", "--model", model, "--input-shape", shape, "--device-memory", "8GiB"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("gpuload plan: error:")


def test_model_needs_an_input_shape(capsys) -> None:
    assert main(["plan", "--model", "job_models:mlp", "--device-memory", "8GiB"]) == 2
    assert "needs both --model and --input-shape" in capsys.readouterr().err
