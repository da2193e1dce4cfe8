"""``gpuload.bench.modelled``: the plan a CPU run models refuses a dataset without samples clearly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from gpuload.bench.modelled import modelled_plan
from gpuload.bench.scenarios import load_arrays


def test_a_dataset_without_samples_is_a_value_error_not_a_division_by_zero() -> None:
    with pytest.raises(ValueError, match="the dataset holds no samples"):
        modelled_plan(TensorDataset(torch.zeros(0, 3)), "auto", None, 16 << 30)


def test_load_arrays_refuses_zero_rows_naming_the_file(tmp_path) -> None:
    path = tmp_path / "zero.npy"
    np.save(path, np.zeros((0, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="zero.npy holds 0 rows"):
        load_arrays(str(path))
