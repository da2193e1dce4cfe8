"""transfer.batch_length: how many samples a batch holds, whatever its structure."""

import torch

from gpuload.transfer import batch_length


def test_the_first_tensor_with_a_batch_dimension_counts():
    assert batch_length(torch.zeros(8, 3)) == 8
    assert batch_length({"x": torch.zeros(8, 3), "y": torch.zeros(8)}) == 8
    assert batch_length([torch.zeros(5, 2), torch.zeros(5)]) == 5


def test_a_0d_first_leaf_does_not_make_a_batch_of_one():
    batch = {"step": torch.tensor(3), "x": torch.zeros(8, 3), "names": [str(i) for i in range(8)]}
    assert batch_length(batch) == 8


def test_only_0d_tensors_is_one_sample():
    assert batch_length({"a": torch.tensor(1.0), "b": torch.tensor(2.0)}) == 1


def test_no_tensor_falls_back_to_len():
    assert batch_length([1, 2, 3]) == 3
    assert batch_length("abc") == 1
    assert batch_length(7) == 1
