"""ArrayDataset: in-memory tensors or arrays that gpuload can keep on the device whole."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

ArrayLike = torch.Tensor | np.ndarray

__all__ = ["ArrayDataset", "as_tensor_columns"]


def _to_tensor(name: str, array: Any) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array
    if isinstance(array, np.ndarray):
        if array.dtype == object or array.dtype.kind in "USV":
            raise TypeError(
                f"ArrayDataset column {name} has numpy dtype {array.dtype}, which torch cannot "
                "hold; convert it to a numeric array or keep it in a regular Dataset"
            )
        return torch.from_numpy(array)
    raise TypeError(
        f"ArrayDataset column {name} is a {type(array).__name__}; pass torch tensors or numpy "
        "arrays (one row per sample)"
    )


def as_tensor_columns(columns: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Check that ``columns`` are arrays with one shared first dimension; return them as tensors.

    Numpy arrays are wrapped without a copy. Raises a ValueError naming each column's length
    when they disagree, so a misaligned label array is caught before the first epoch.
    """
    tensors = {name: _to_tensor(name, array) for name, array in columns.items()}
    if not tensors:
        raise ValueError("ArrayDataset needs at least one array")
    for name, tensor in tensors.items():
        if tensor.dim() == 0:
            raise ValueError(
                f"ArrayDataset column {name} is a 0-dimensional array; each column needs one "
                "row per sample along its first dimension"
            )
    lengths = {name: tensor.shape[0] for name, tensor in tensors.items()}
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"{name}: {length}" for name, length in lengths.items())
        raise ValueError(
            f"ArrayDataset columns must have the same number of samples (first dimension); "
            f"got {listed}"
        )
    return tensors


class ArrayDataset(Dataset):
    """A map-style dataset over arrays that share their first dimension.

    ``ArrayDataset(images, labels)`` yields tuples ``(images[i], labels[i])`` like
    ``TensorDataset``; ``ArrayDataset(image=images, label=labels)`` yields dicts. Numpy arrays
    are accepted without a copy. gpuload.DataLoader recognises it and serves each batch with one
    gather on the device instead of per-sample Python.
    """

    def __init__(self, *arrays: ArrayLike, **named_arrays: ArrayLike) -> None:
        if arrays and named_arrays:
            raise ValueError(
                "ArrayDataset takes either positional arrays (samples are tuples) or keyword "
                "arrays (samples are dicts), not both"
            )
        if named_arrays:
            self.columns = as_tensor_columns(named_arrays)
            self.named = True
        else:
            self.columns = as_tensor_columns({f"#{i}": a for i, a in enumerate(arrays)})
            self.named = False

    def __len__(self) -> int:
        return next(iter(self.columns.values())).shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...] | dict[str, torch.Tensor]:
        if self.named:
            return {name: tensor[index] for name, tensor in self.columns.items()}
        return tuple(tensor[index] for tensor in self.columns.values())

    def __repr__(self) -> str:
        shapes = ", ".join(
            f"{name}={tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}"
            for name, t in self.columns.items()
        )
        return f"ArrayDataset({shapes})"
