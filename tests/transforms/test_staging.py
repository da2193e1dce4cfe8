"""Per-batch parameters staged to the device: one packed buffer, values and dtypes intact, and
on a GPU no host synchronization anywhere in a transformed batch."""

from __future__ import annotations

import pytest
import torch

from gpuload import transforms as T
from gpuload.transfer import pack, to_device, unpack


def _mixed():
    return [
        torch.tensor([[1, -2, 3]], dtype=torch.int64),
        torch.tensor([True, False, True]),
        torch.tensor(2.5),  # 0-d
        torch.empty(0, 4),
        torch.arange(12, dtype=torch.float32).view(3, 4).t(),  # not contiguous
        torch.tensor([7], dtype=torch.int32),
    ]


def test_pack_and_unpack_round_trip_every_dtype_and_shape():
    tensors = _mixed()
    buffer, offsets = pack(tensors)
    assert buffer.dtype == torch.uint8 and all(offset % 16 == 0 for offset in offsets)
    for got, want in zip(unpack(buffer.clone(), offsets, tensors), tensors):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_to_device_on_the_cpu_returns_the_tensors():
    tensors = _mixed()
    for got, want in zip(to_device(tensors, torch.device("cpu"), None), tensors):
        assert got is want


@pytest.mark.gpu
def test_to_device_copies_once_from_pinned_memory():
    tensors = _mixed()
    out = to_device(tensors, torch.device("cuda"), None)
    assert len({t.untyped_storage().data_ptr() for t in out}) == 1  # one device buffer
    for got, want in zip(out, tensors):
        assert got.is_cuda and torch.equal(got.cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "torch"])
@pytest.mark.parametrize("where", ["cuda", "cpu"])
def test_a_transformed_batch_makes_no_host_sync(backend, where):
    ops = [T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.ColorJitter(0.4, 0.4, 0.4),
           T.ToDtype(torch.float16), T.Normalize((0.5,), (0.25,)), T.RandomErasing(p=0.8), T.ToChannelsLast()]
    batch = torch.randint(0, 256, (8, 3, 30, 40), dtype=torch.uint8).to(where)
    run = dict(device="cuda", backend=backend)
    T.apply_transforms(ops, batch, 0, 0, torch.arange(8), **run)  # compile, warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, used = T.transform_batch(ops, batch, 0, 1, torch.arange(8), **run)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert used == backend and out.shape == (8, 3, 16, 16) and out.is_cuda
    assert torch.equal(out, T.apply_transforms(ops, batch.cuda(), 0, 1, torch.arange(8), **run))


def test_host_images_move_as_they_are_on_the_cpu():
    images = [torch.randint(0, 256, (3, 5, 7), dtype=torch.uint8),
              torch.zeros(5, 6, 3, dtype=torch.uint8).permute(2, 0, 1)]
    moved = T.apply._to_device(images, torch.device("cpu"), None)
    assert all(got is want for got, want in zip(moved, images))
