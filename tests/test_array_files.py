"""``gpuload.array_files``: an .npy/.npz file's arrays from their headers, each bad file one clear ValueError."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from gpuload.array_files import read_array_file


def test_a_good_npz_is_read_from_its_headers(tmp_path: Path) -> None:
    path = tmp_path / "data.npz"
    np.savez(path, x=np.zeros((300, 3, 8, 8), dtype=np.uint8), y=np.arange(300))
    arrays = read_array_file(path)
    assert arrays.rows == 300 and arrays.bytes_per_row == 3 * 8 * 8 + 8
    assert arrays.describe() == f"arrays in {path}: x (300, 3, 8, 8) uint8, y (300,) int64"


@pytest.mark.parametrize("write, says", [
    (lambda p: np.save(p, np.zeros((0, 4))), "holds 0 rows: each row is a sample"),
    (lambda p: p.write_text("a text file\n"), "is not a NumPy array (it does not start with NumPy's .npy header)"),
    (lambda p: np.save(p, np.array([None, 1], dtype=object), allow_pickle=True), "holds Python objects"),
    (lambda p: np.save(p, np.float64(1.0)), "is 0-dimensional"),
    (lambda p: p.write_bytes(_npy_bytes(np.zeros((100, 4)))[:-16]), "is cut short: its header promises 3200 bytes"),
])
def test_each_unusable_npy_is_one_error_naming_the_file(tmp_path: Path, write, says: str) -> None:
    path = tmp_path / "data.npy"
    write(path)
    with pytest.raises(ValueError, match="data.npy") as raised:
        read_array_file(path)
    assert says in str(raised.value) and "pickle" not in str(raised.value)


def _npy_bytes(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def test_npz_problems_name_the_file_and_the_arrays(tmp_path: Path) -> None:
    mixed = tmp_path / "mixed.npz"
    np.savez(mixed, a=np.zeros((4, 2)), b=np.zeros(5))
    with pytest.raises(ValueError, match=r"the arrays in .*mixed.npz must have the same number of rows .*a: 4, b: 5"):
        read_array_file(mixed)
    empty = tmp_path / "empty.npz"
    np.savez(empty)
    with pytest.raises(ValueError, match="holds no arrays"):
        read_array_file(empty)
    not_zip = tmp_path / "fake.npz"
    not_zip.write_text("hello")
    with pytest.raises(ValueError, match="not a NumPy .npz file"):
        read_array_file(not_zip)
    cut = tmp_path / "cut.npz"
    with zipfile.ZipFile(cut, "w") as archive:
        archive.writestr("x.npy", _npy_bytes(np.zeros((10, 10)))[:-8])
    with pytest.raises(ValueError, match="array 'x' is cut short"):
        read_array_file(cut)


def test_other_paths_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="No such file or directory"):
        read_array_file(tmp_path / "missing.npy")
    (tmp_path / "data.csv").write_text("1,2\n")
    with pytest.raises(ValueError, match="it is not an .npy or .npz file"):
        read_array_file(tmp_path / "data.csv")


def test_it_imports_without_torch() -> None:
    code = "import sys, gpuload.array_files, gpuload.sizes; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
