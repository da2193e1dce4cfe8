"""``gpuload plan``: every bad argument or input is one line naming it, exit 2, no traceback; and
the job plan (``--model``) from the command line."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from gpuload.cli import main


@pytest.fixture(autouse=True)
def clean_env(tmp_path: Path, monkeypatch) -> None:
    for name in ("GPULOAD_CACHE", "GPULOAD_CACHE_SIZE", "GPULOAD_CACHE_RESERVE", "GPULOAD_CONFIG", "GPULOAD_JOB"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("flag, value", [("--probe-images", "0"), ("--probe-images", "-1"), ("--device", "foo")])
def test_bad_flags_are_refused_by_the_parser(flag: str, value: str, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["plan", flag, value])
    assert exited.value.code == 2
    assert one_error(capsys).startswith(f"gpuload plan: error: argument {flag}: ")


def test_corrupt_array_files_are_named(tmp_path: Path, capsys) -> None:
    npz = tmp_path / "broken.npz"
    npz.write_bytes(b"PK\x03\x04 truncated")
    assert main(["plan", str(npz), "--device-memory", "8GiB"]) == 2
    assert one_error(capsys).startswith(f"gpuload plan: error: cannot read {npz} as .npz arrays: ")
    npy = tmp_path / "short.npy"
    np.save(npy, np.zeros((100, 4)))
    npy.write_bytes(npy.read_bytes()[:90])
    assert main(["plan", str(npy), "--device-memory", "8GiB"]) == 2
    assert f"cannot read {npy} as .npy arrays" in one_error(capsys)


def test_a_job_error_names_the_flag_not_a_keyword(capsys) -> None:
    assert main(["plan", "--job", "nosuch", "--device-memory", "8GiB"]) == 2
    line = one_error(capsys)
    assert line.startswith("gpuload plan: error: argument --job: 'nosuch' names a job but there is no config file")
    assert "keyword" not in line


def test_an_image_header_claiming_a_huge_size_is_a_bad_file_not_a_crash(tmp_path: Path, capsys) -> None:
    header = struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(header)) + b"IHDR" + header + struct.pack(">I", zlib.crc32(b"IHDR" + header))
    folder = tmp_path / "images" / "cat"
    folder.mkdir(parents=True)
    (folder / "bomb.png").write_bytes(b"\x89PNG\r\n\x1a\n" + chunk)
    assert main(["plan", str(tmp_path / "images"), "--device-memory", "8GiB"]) == 2
    assert one_error(capsys).startswith(f"gpuload plan: error: cannot read image {folder / 'bomb.png'}: ")


def test_an_image_folder_is_planned_as_the_loader_reads_it(tmp_path: Path, capsys) -> None:
    from PIL import Image

    root = tmp_path / "images"
    (root / "cat").mkdir(parents=True)
    Image.new("RGB", (8, 6)).save(root / "cat" / "a.jpg")
    for name in ("b.gif", "c.tif", "d.ppm"):  # formats ImageFolder does not load
        Image.new("RGB", (8, 6)).save(root / "cat" / name)
    Image.new("RGB", (8, 6)).save(root / "top-level.jpg")  # not in a class folder
    assert main(["plan", str(root), "--device-memory", "8GiB"]) == 0
    assert "image folder " + str(root) + ": 1 images;" in capsys.readouterr().out
    assert main(["plan", str(root / "cat"), "--device-memory", "8GiB"]) == 2  # files, but no class folders
    assert "no class folders" in one_error(capsys)


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
