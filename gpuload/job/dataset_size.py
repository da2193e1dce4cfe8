"""How big is a dataset: its sample count and bytes per sample, without loading it.

Used by ``gpuload plan`` and :func:`gpuload.plan_job`. An image folder is read as the loader reads it
(``ImageFolder``) and estimated from the decoded size of a few images' headers (3*H*W uint8, plus
an int64 label, by the estimator the image cache uses); an ``.npy``/``.npz`` file from
its header; Parquet files, an Arrow file, a ``save_to_disk`` folder or an Arrow-backed dataset
from the schema; a ``.bin`` token shard, or a glob of them, from their headers (their tokens); a
synthetic name from a table; an in-memory dataset from a few of its samples.
"""

from __future__ import annotations

import glob
import math
from collections.abc import Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpuload.array_files import read_array_file
from gpuload.cache.budget import format_bytes
from gpuload.cache.probe import probe_images
from gpuload.datasets.arrow import ArrowTable, arrow_table, cached_bytes, import_optional
from gpuload.datasets.images import ImageFolder
from gpuload.datasets.tokens import read_shard, shard_paths
from gpuload.transfer import batch_nbytes

__all__ = ["DatasetShape", "arrow_path", "estimate_dataset", "dataset_shape", "image_folder", "LABEL_BYTES",
           "SYNTHETIC"]

LABEL_BYTES = 8  # one int64 class label per sample
SYNTHETIC = {
    # name: (samples, bytes per sample, description)
    "cifar": (50_000, 3 * 32 * 32 + LABEL_BYTES, "CIFAR-10 train: 50000 x 3x32x32 uint8 + int64 label"),
    "imagenet": (
        1_281_167,
        3 * 224 * 224 + LABEL_BYTES,
        "ImageNet-1k train at 224x224: 1281167 x 3x224x224 uint8 + int64 label",
    ),
}


@dataclass(frozen=True)
class DatasetShape:
    """How many samples, how many bytes each, and how that was found out."""

    num_samples: int
    bytes_per_sample: int
    description: str


def image_folder(path: Path) -> ImageFolder:
    """The folder as ``gpuload.DataLoader`` would read it: ImageFolder's files, nothing it skips."""
    try:
        return ImageFolder(path)
    except OSError as error:  # no class folders, or classes without images
        raise ValueError(f"{error}; give an image folder, an .npy/.npz file, or --synthetic") from None


def _image_folder(path: Path, probes: int) -> DatasetShape:
    """The folder as ``gpuload.DataLoader`` loads it, sized from a few headers by the estimator
    the image cache uses. A probed file whose header cannot be read, or claims more pixels than
    the decoder's limit (a decompression bomb), is one the loader would skip or refuse: it is
    left out of the estimate and named on a line of its own."""
    folder = image_folder(path)
    probe = probe_images(folder, probes)
    sizes = probe.sizes
    bad = ""
    if probe.bad:
        bad = (f"\n  bad files: {len(probe.bad)} of the {probe.probed} probed would be skipped or refused: "
               + "; ".join(probe.bad[:3]) + ("; ..." if len(probe.bad) > 3 else ""))
    if not sizes:
        raise ValueError(f"cannot read image {folder.path(0)}: none of the {probe.probed} probed images can be "
                         f"loaded:{bad}")
    decoded = [d for d, _ in sizes]
    per_sample = math.ceil(sum(decoded) / len(decoded)) + LABEL_BYTES
    return DatasetShape(
        len(folder),
        per_sample,
        f"image folder {path}: {len(folder)} images; {len(sizes)} probed, decoded RGB uint8 "
        f"{format_bytes(min(decoded))} to {format_bytes(max(decoded))} "
        f"(mean {format_bytes(per_sample - LABEL_BYTES)}) + int64 label; "
        f"encoded mean {format_bytes(sum(e for _, e in sizes) / len(sizes))} on disk{bad}",
    )


def _array_file(path: Path) -> DatasetShape:
    arrays = read_array_file(path)
    return DatasetShape(arrays.rows, arrays.bytes_per_row, arrays.describe())


def estimate_dataset(path: str | None, synthetic: str | None, probes: int = 16) -> DatasetShape:
    """Sample count and bytes per sample of the dataset the user names."""
    if path is None:
        samples, per_sample, description = SYNTHETIC[synthetic or "cifar"]
        return DatasetShape(samples, per_sample, f"synthetic {description}")
    if arrow_path(path):
        return _arrow(path)
    if any(ch in path for ch in "*?["):  # a glob of token shards, as TokenWindows takes
        shards = shard_paths(path)
        assert shards is not None  # a path always names files (none matching is a TokenFileError)
        return _token_shards(shards)
    where = Path(path)
    if where.is_dir():
        return _image_folder(where, probes)
    if where.is_file() and where.suffix in (".npy", ".npz"):
        return _array_file(where)
    if where.is_file() and where.suffix == ".bin":
        return _token_shard(where)
    raise ValueError(f"{path} is neither an image folder nor an existing .npy/.npz file, .bin token shard, "
                     "Arrow file or Parquet file")


def arrow_path(path: str) -> bool:
    """Whether ``path`` names Parquet files, an Arrow file or a folder of them (``save_to_disk``)."""
    return path.endswith((".parquet", ".arrow")) or (Path(path).is_dir() and any(Path(path).glob("*.arrow")))


def _arrow(path: str) -> DatasetShape:
    """Parquet files (one, or a glob), an Arrow file or a ``save_to_disk`` folder, sized from the
    schema: the fixed-width columns the cache holds (Parquet: from the files' footers alone)."""
    if path.endswith(".parquet"):
        pq = import_optional("pyarrow.parquet")
        files = sorted(glob.glob(path)) if glob.has_magic(path) else [path]
        if not files or not all(Path(file).is_file() for file in files):
            raise ValueError(f"no Parquet file matches {path}")
        rows, schema = sum(pq.read_metadata(file).num_rows for file in files), pq.read_schema(files[0])
        what = f"Parquet {path} ({len(files)} files)" if len(files) > 1 else f"Parquet {path}"
    else:
        try:
            table = ArrowTable(path).table  # memory-mapped: nothing is read
        except OSError as error:  # no such file: the command's one-line error
            raise ValueError(str(error)) from None
        rows, schema, what = table.num_rows, table.schema, f"Arrow table {path}"
    per_row, words = cached_bytes(schema)
    return DatasetShape(rows, max(1, per_row), f"{what}: {rows} rows; {words}")


def _token_shard(path: Path) -> DatasetShape:
    """An llm.c / nanoGPT-speedrun token shard: its tokens, as the loader caches them (not windows)."""
    shard = read_shard(path)  # a TokenFileError (a ValueError) names the file
    described = f"token shard {path}: {len(shard)} {shard.tokens.dtype} tokens (TokenWindows caches the tokens)"
    return DatasetShape(len(shard), shard.tokens.dtype.itemsize, described)


def _token_shards(paths: list[str]) -> DatasetShape:
    """The shards a glob matches, as one TokenWindows caches them: all their tokens."""
    shards = [read_shard(p) for p in paths]  # a TokenFileError (a ValueError) names the file
    dtypes = sorted({str(s.tokens.dtype) for s in shards})
    if len(dtypes) > 1:  # as TokenWindows refuses them
        raise ValueError(f"the shards {paths[0]} .. {paths[-1]} hold ids of different dtypes ({', '.join(dtypes)})")
    itemsize, tokens = shards[0].tokens.dtype.itemsize, sum(len(s) for s in shards)
    return DatasetShape(tokens, itemsize, f"token shards {paths[0]} .. {paths[-1]} ({len(paths)} files): {tokens} "
                        "tokens (TokenWindows caches the tokens)")


def dataset_shape(dataset: Any, probes: int = 3) -> DatasetShape:
    """Sample count and bytes per sample of what a user hands to a loader.

    ``dataset`` may be a :class:`DatasetShape`, a path (see :func:`estimate_dataset`), a tensor
    or array (rows are samples), or a map-style dataset (``len()`` and the mean size of up to
    ``probes`` samples spread over it, counting every tensor or array in a sample).
    """
    if isinstance(dataset, DatasetShape):
        return dataset
    if isinstance(dataset, (str, Path)):
        return estimate_dataset(str(dataset), None)
    if hasattr(dataset, "shape") and hasattr(dataset, "nbytes") and len(dataset.shape) > 0:
        rows = int(dataset.shape[0])
        per_row = int(dataset.nbytes) // rows if rows else 0
        return DatasetShape(rows, max(1, per_row), f"array of shape {tuple(dataset.shape)} {dataset.dtype}")
    table = arrow_table(dataset)
    if table is not None:
        per_row, words = cached_bytes(table.schema)
        count = len(dataset)
        return DatasetShape(count, max(1, per_row), f"{type(dataset).__name__}: {count} rows; {words}")
    if not isinstance(dataset, Sized) or not hasattr(dataset, "__getitem__"):
        raise TypeError(
            f"dataset of type {type(dataset).__name__} has no size gpuload can read: give a map-style "
            "dataset (len() and [i]), a tensor or array, a path, or a DatasetShape"
        )
    count = len(dataset)
    if count == 0:
        raise ValueError("the dataset is empty")
    picks = sorted({round(i * (count - 1) / max(1, probes - 1)) for i in range(probes)})
    sizes = [_sample_nbytes(dataset[i]) for i in picks]
    per_sample = max(1, math.ceil(sum(sizes) / len(sizes)))
    return DatasetShape(
        count, per_sample,
        f"{type(dataset).__name__}: {count} samples; {len(picks)} probed, mean {format_bytes(per_sample)} of tensors",
    )


def _sample_nbytes(sample: Any) -> int:
    """Bytes of the tensors, arrays and numbers in one sample (numbers become int64/float64)."""
    if isinstance(sample, np.ndarray):
        return sample.nbytes
    if isinstance(sample, (int, float)):
        return 8
    if isinstance(sample, dict):
        return sum(_sample_nbytes(v) for v in sample.values())
    if isinstance(sample, (tuple, list)):
        return sum(_sample_nbytes(v) for v in sample)
    return batch_nbytes(sample)
