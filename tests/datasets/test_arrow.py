"""ArrowTable and Parquet: tables, files and folders read as datasets; pyarrow and datasets optional."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from gpuload.datasets import ArrowTable, Parquet  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def table() -> pa.Table:
    return pa.table({
        "label": pa.array([3, 1, None], pa.int32()),
        "vector": pa.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], pa.list_(pa.float16(), 2)),
        "tokens": pa.array([[1], [2, 3], []], pa.list_(pa.int64())),
        "text": ["a", None, "c"],
        "meta": [{"id": 1, "name": "x"}, {"id": 2, "name": "y"}, None],
    })


def test_import_gpuload_and_its_loader_import_neither_pyarrow_nor_datasets() -> None:
    code = ("import sys, gpuload, gpuload.datasets; gpuload.DataLoader; import gpuload.sources.choose; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pyarrow', 'datasets')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("missing", ["pyarrow", "pyarrow.parquet"])
def test_a_missing_pyarrow_is_one_line_naming_the_extra(missing: str) -> None:
    code = (f"import sys; sys.modules[{missing!r}] = None\n"
            "from gpuload.datasets import ArrowTable, Parquet\n"
            "try:\n    Parquet('x.parquet')\nexcept ImportError as error:\n    print(error)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "gpuload's Arrow support needs pyarrow: pip install 'gpuload[arrow]'\n"


def test_the_arrow_extra_brings_pyarrow_and_datasets_and_the_test_extra_has_them() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {requirement.split(">")[0] for requirement in extras["arrow"]}
    assert names == {"pyarrow", "datasets"}
    assert set(extras["arrow"]) <= set(extras["test"])


def test_samples_are_dicts_of_tensors_in_the_arrow_types_strings_and_none() -> None:
    dataset = ArrowTable(table())
    assert len(dataset) == 3
    first = dataset[0]
    assert list(first) == ["label", "vector", "tokens", "text", "meta"]
    assert first["label"].dtype == torch.int32 and first["label"].item() == 3
    assert first["vector"].dtype == torch.float16 and first["vector"].tolist() == [1.0, 2.0]
    assert first["tokens"].tolist() == [1]
    assert first["text"] == "a"
    assert first["meta"]["id"].item() == 1 and first["meta"]["name"] == "x"
    assert dataset[-1]["label"] is None and dataset[-1]["meta"] is None and dataset[1]["text"] is None
    with pytest.raises(IndexError, match="index 3 is out of range for 3 rows"):
        dataset[3]
    assert "label: int32" in repr(dataset)


def test_a_path_is_memory_mapped_arrow_files_of_a_folder_in_name_order(tmp_path: Path) -> None:
    folder = tmp_path / "saved"
    folder.mkdir()
    whole = table()
    for part, rows in enumerate((whole.slice(0, 2), whole.slice(2))):
        with pa.ipc.new_stream(folder / f"data-{part:05d}.arrow", rows.schema) as writer:
            writer.write_table(rows)
    allocated = pa.total_allocated_bytes()
    dataset = ArrowTable(folder)
    assert pa.total_allocated_bytes() == allocated  # the buffers are the mapped file's, not copies
    assert dataset.table.equals(whole)
    single = ArrowTable(folder / "data-00000.arrow")
    assert len(single) == 2
    with pytest.raises(FileNotFoundError, match="no .arrow files in the folder"):
        ArrowTable(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        ArrowTable(tmp_path / "missing.arrow")
    with pytest.raises(TypeError, match="takes a pyarrow.Table or a path, not a list"):
        ArrowTable([1, 2])


def test_parquet_reads_a_file_or_every_file_a_glob_matches(tmp_path: Path) -> None:
    whole = table()
    pq.write_table(whole.slice(0, 1), tmp_path / "part-0.parquet")
    pq.write_table(whole.slice(1), tmp_path / "part-1.parquet")
    assert Parquet(tmp_path / "part-0.parquet").table.equals(whole.slice(0, 1))
    assert Parquet(str(tmp_path / "part-*.parquet")).table.equals(whole)
    with pytest.raises(FileNotFoundError, match=r"no file matches .*nothing-\*"):
        Parquet(str(tmp_path / "nothing-*.parquet"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        Parquet(tmp_path / "absent.parquet")


def test_columns_chooses_which_are_read_and_in_what_order(tmp_path: Path) -> None:
    pq.write_table(table(), tmp_path / "t.parquet")
    for dataset in (ArrowTable(table(), columns=["text", "label"]), Parquet(tmp_path / "t.parquet", ["text", "label"])):
        assert list(dataset[0]) == ["text", "label"]
    with pytest.raises(KeyError, match="no column nope in this table; it has label, vector"):
        ArrowTable(table(), columns=["label", "nope"])
