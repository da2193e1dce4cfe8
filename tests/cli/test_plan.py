"""``gpuload plan``: every bad argument or input is one line naming it, exit 2, no traceback."""

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
