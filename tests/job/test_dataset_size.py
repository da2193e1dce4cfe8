"""Dataset sizes from what a user holds: arrays, tensors, map-style datasets, paths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gpuload.job.dataset_size import DatasetShape, dataset_shape, estimate_dataset


def _sizes(shape: DatasetShape) -> tuple[int, int]:
    return shape.num_samples, shape.bytes_per_sample


def test_arrays_and_tensors_count_rows() -> None:
    assert _sizes(dataset_shape(np.zeros((100, 3, 8, 8), dtype=np.uint8))) == (100, 192)
    assert _sizes(dataset_shape(torch.zeros(50, 10, dtype=torch.float16))) == (50, 20)


def test_map_style_dataset_counts_every_tensor_of_a_sample() -> None:
    data = torch.utils.data.TensorDataset(torch.zeros(30, 3, 4, 4), torch.zeros(30, dtype=torch.long))
    shape = dataset_shape(data)
    assert (shape.num_samples, shape.bytes_per_sample) == (30, 3 * 4 * 4 * 4 + 8)

    class Dicts(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 7

        def __getitem__(self, index: int) -> dict:
            return {"image": np.zeros((2, 2), dtype=np.uint8), "label": index, "weight": 0.5}

    assert _sizes(dataset_shape(Dicts())) == (7, 4 + 8 + 8)


def test_paths_and_shapes_pass_through(tmp_path: Path) -> None:
    path = tmp_path / "x.npy"
    np.save(path, np.zeros((12, 5), dtype=np.float32))
    assert _sizes(dataset_shape(str(path))) == (12, 20) == _sizes(estimate_dataset(str(path), None))
    known = DatasetShape(3, 4, "given")
    assert dataset_shape(known) is known


def test_what_has_no_size_is_refused() -> None:
    with pytest.raises(TypeError, match="map-style dataset"):
        dataset_shape(iter([1, 2]))
    with pytest.raises(ValueError, match="empty"):
        dataset_shape(torch.utils.data.TensorDataset(torch.zeros(0, 2)))


def test_a_path_that_is_no_dataset_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a dataset")
    for path in (tmp_path / "missing", tmp_path / "notes.txt"):
        with pytest.raises(ValueError, match=f"^{path} is neither an image folder nor an existing .npy/.npz file, "
                           ".bin token shard, Arrow file or Parquet file$"):
            estimate_dataset(str(path), None)


def test_a_token_shard_counts_its_tokens_not_windows(tmp_path: Path) -> None:
    from gpuload.datasets.tokens import TokenFileError, write_shard

    shard = write_shard(tmp_path / "train_000.bin", np.arange(1000) % 500)
    shape = estimate_dataset(str(shard), None)
    assert _sizes(shape) == (1000, 2) and "1000 uint16 tokens" in shape.description
    raw = tmp_path / "raw.bin"
    raw.write_bytes(b"\0" * 64)
    with pytest.raises(TokenFileError, match=r"raw\.bin: not a token shard"):
        estimate_dataset(str(raw), None)


def test_a_datasets_dataset_is_sized_from_its_schema_through_its_index_mapping() -> None:
    pa = pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_dict({
        "vector": pa.array([[1.0, 2.0, 3.0]] * 10, pa.list_(pa.float64(), 3)),
        "label": pa.array(range(10), pa.int32()),
        "text": ["x"] * 10,
    }).select([1, 3, 5])
    shape = dataset_shape(dataset)
    assert (shape.num_samples, shape.bytes_per_sample) == (3, 3 * 8 + 4)
    assert "read from the table per batch: text (string)" in shape.description
