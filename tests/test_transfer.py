"""gpuload.transfer: how many samples a batch holds, whatever its structure; host copies of device tensors."""

import pytest
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


def test_map_leaves_keeps_each_container_type_where_it_can() -> None:
    from types import MappingProxyType

    from containers import Fields

    from gpuload.transfer import map_leaves, move_to_device

    double = lambda tensor: tensor * 2  # noqa: E731
    proxied = map_leaves(MappingProxyType({"x": torch.ones(2)}), double)
    assert isinstance(proxied, MappingProxyType) and proxied["x"].tolist() == [2.0, 2.0]
    fields = map_leaves(Fields(x=torch.ones(1), name="a"), double)
    assert type(fields) is dict and fields["x"].tolist() == [2.0] and fields["name"] == "a"
    assert map_leaves(range(3), double) == [0, 1, 2]  # range(list) is no range: a list of the leaves
    assert map_leaves((b"raw", "text"), double) == (b"raw", "text")
    moved = move_to_device({"x": [torch.ones(2)]}, torch.device("cpu"))
    assert moved["x"][0].device == torch.device("cpu") and moved["x"][0].tolist() == [1.0, 1.0]


def test_map_leaves_passes_plain_items_without_a_walk_each() -> None:
    """A batch's list of names (plain str, numbers, None) comes back equal, and ``is_leaf`` is
    asked only about the rest; tensors beside and below them are still mapped."""
    from gpuload.transfer import map_leaves

    asked: list[object] = []

    def is_leaf(value: object) -> bool:
        asked.append(value)
        return False

    names = [f"s{i}" for i in range(4)]
    batch = {"x": torch.ones(2), "name": names, "mixed": (1, 2.5, None, True, b"b", [torch.ones(1)])}
    out = map_leaves(batch, lambda tensor: tensor * 2, is_leaf=is_leaf)
    assert out["name"] == names and type(out["name"]) is list
    assert out["mixed"][:5] == (1, 2.5, None, True, b"b") and type(out["mixed"]) is tuple
    assert out["x"].tolist() == [2.0, 2.0] and out["mixed"][5][0].tolist() == [2.0]
    assert not any(isinstance(value, (str, bytes, int, float)) or value is None for value in asked)


def test_host_tensors_need_no_host_copy():
    from gpuload.transfer import pinned_host_copies

    host = [torch.zeros(2, 3), torch.ones(4)]
    assert all(a is b for a, b in zip(pinned_host_copies(host), host))


@pytest.mark.gpu
def test_gpu_device_tensors_come_back_pinned_with_their_layout():
    from gpuload.transfer import pinned_host_copies

    hwc = torch.arange(5 * 7 * 3, dtype=torch.uint8, device="cuda").view(5, 7, 3).permute(2, 0, 1)
    (copy,) = pinned_host_copies([hwc])
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    assert copy.is_pinned() and copy.stride() == hwc.stride() and torch.equal(copy, hwc.cpu())


def test_tensors_already_on_the_device_are_returned_as_they_are():
    from gpuload.transfer import to_device

    on_meta = [torch.empty(2, 3, device="meta"), torch.empty(4, device="meta")]  # a device that is not the CPU
    moved = to_device(on_meta, torch.device("meta"), None)
    assert len(moved) == 2 and all(a is b for a, b in zip(moved, on_meta))


def test_move_staged_on_the_cpu_keeps_the_batch_as_it_is():
    from gpuload.transfer import move_staged

    hwc = torch.arange(24, dtype=torch.uint8).view(2, 4, 3).permute(2, 0, 1)
    batch = {"image": hwc, "rest": [torch.ones(2), "label", 3]}
    moved = move_staged(batch, torch.device("cpu"), None)
    assert moved["image"] is hwc and moved["rest"][0] is batch["rest"][0] and moved["rest"][1:] == ["label", 3]
