"""The tokens source: gpuload's batches of TokenWindows equal torch's DataLoader's, on every path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import DistributedSampler

import gpuload
from gpuload.datasets.tokens import TokenFileError, TokenWindows, write_shard
from gpuload.sources.tokens import TokenSource
from equivalence import assert_same, assert_same_epochs


def _ids(n: int, high: int = 65535, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, high, size=n).astype(np.int64)


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    return write_shard(tmp_path / "train_000.bin", _ids(5000))


def _pair(ds: Any, seed: int | None = 1, **kwargs: Any) -> tuple[gpuload.DataLoader, TorchDataLoader]:
    gen = (lambda: torch.Generator().manual_seed(seed)) if seed is not None else (lambda: None)
    ours = gpuload.DataLoader(ds, generator=gen(), **kwargs)
    torch_kwargs = {k: v for k, v in kwargs.items() if k not in ("cache", "prefetch_depth", "device")}
    return ours, TorchDataLoader(ds, generator=gen(), **torch_kwargs)


@pytest.mark.parametrize("source_kind", ["shard", "npy", "array", "tensor", "two_shards", "joined"])
def test_shuffled_batches_equal_torchs(tmp_path: Path, source_kind: str) -> None:
    ids = _ids(4000)
    if source_kind == "shard":
        ds = TokenWindows(write_shard(tmp_path / "a.bin", ids), 64)
    elif source_kind == "npy":
        np.save(tmp_path / "a.npy", ids.astype(np.uint32))
        ds = TokenWindows(tmp_path / "a.npy", 64, stride=33)
    elif source_kind == "array":
        ds = TokenWindows(ids.astype(np.uint16), 64, stride=17)
    elif source_kind == "tensor":
        ds = TokenWindows(torch.from_numpy(ids), 64)
    else:
        paths = [write_shard(tmp_path / "s0.bin", ids[:2500]), write_shard(tmp_path / "s1.bin", ids[2500:])]
        ds = TokenWindows(paths, 64, concatenate=source_kind == "joined")
    ours, theirs = _pair(ds, batch_size=16, shuffle=True)
    assert_same_epochs(ours, theirs, epochs=2)
    assert ours.stats.path == "device-gather"


@pytest.mark.parametrize("drop_last", [False, True])
def test_sequential_and_drop_last(shard: Path, drop_last: bool) -> None:
    ds = TokenWindows(shard, 100, stride=50)
    ours, theirs = _pair(ds, seed=None, batch_size=7, drop_last=drop_last)
    assert len(ours) == len(theirs)
    assert_same_epochs(ours, theirs, epochs=1)


def test_unbatched_items(shard: Path) -> None:
    ds = TokenWindows(shard, 32)
    ours, theirs = _pair(ds, batch_size=None, shuffle=True)
    assert_same_epochs(ours, theirs, epochs=1)
    assert isinstance(ours._source, TokenSource)


def test_distributed_sampler_with_set_epoch(shard: Path) -> None:
    ds = TokenWindows(shard, 40)
    for rank in range(2):
        sampler_ours = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3, drop_last=True)
        sampler_theirs = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3, drop_last=True)
        ours = gpuload.DataLoader(ds, batch_size=8, sampler=sampler_ours)
        theirs = TorchDataLoader(ds, batch_size=8, sampler=sampler_theirs)

        def set_epoch(epoch: int) -> None:
            sampler_ours.set_epoch(epoch)
            sampler_theirs.set_epoch(epoch)

        assert_same_epochs(ours, theirs, epochs=2, before_epoch=set_epoch)


@pytest.mark.parametrize("prefetch_depth", [None, 2])
def test_resume_mid_epoch_gives_the_rest_of_the_run(shard: Path, prefetch_depth: int | None) -> None:
    ds = TokenWindows(shard, 50)

    def loader() -> gpuload.DataLoader:
        return gpuload.DataLoader(ds, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(5),
                                  prefetch_depth=prefetch_depth)

    whole = loader_epochs(loader(), 2)
    first = loader()
    it = iter(first)
    seen = [next(it) for _ in range(5)]
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    rest = loader_epochs(resumed, 2)  # the rest of epoch 0, then epoch 1
    assert_same(seen + rest, whole)


def loader_epochs(loader: gpuload.DataLoader, epochs: int) -> list[Any]:
    return [batch for _ in range(epochs) for batch in loader]


def test_set_batch_size_keeps_the_epochs_order(shard: Path) -> None:
    ds = TokenWindows(shard, 20)
    ours = gpuload.DataLoader(ds, batch_size=10, shuffle=True, generator=torch.Generator().manual_seed(2))
    theirs = TorchDataLoader(ds, batch_size=10, shuffle=True, generator=torch.Generator().manual_seed(2))
    order = torch.cat([x for x, _ in theirs])  # every window once, in torch's order
    it = iter(ours)
    got = [next(it)[0] for _ in range(3)]
    ours.set_batch_size(25)
    rest = list(it)
    assert all(x.shape[0] == 25 for x, _ in rest[:-1])
    assert torch.equal(torch.cat(got + [x for x, _ in rest]), order)


def test_cache_off_streams_through_the_prefetcher(shard: Path) -> None:
    ds = TokenWindows(shard, 64)
    ours, theirs = _pair(ds, batch_size=8, shuffle=True, cache="off", prefetch_depth=2)
    assert_same_epochs(ours, theirs, epochs=2)
    assert ours.stats.path == "host-gather"
    assert ours.stats.extra["prefetch"]["bytes_staged"] == 2 * len(ds) * 65 * 2  # uint16 ids, not int64 windows


def test_cpu_device_serves_the_memmap_in_place(shard: Path) -> None:
    ds = TokenWindows(shard, 64)
    loader = gpuload.DataLoader(ds, batch_size=8)
    next(iter(loader))
    source = loader._source
    assert source.buffer.data_ptr() == ds.tokens().data_ptr()  # no copy of the token buffer
    info = loader.stats.extra["tokens"]
    assert info["token_bytes"] == 5000 * 2 and info["tokens"] == 5000 and info["windows"] == len(ds)


def test_a_file_that_changes_between_epochs_fails_naming_it(shard: Path) -> None:
    ds = TokenWindows(shard, 64)
    loader = gpuload.DataLoader(ds, batch_size=8)
    list(loader)
    write_shard(shard, _ids(6000))
    with pytest.raises(TokenFileError, match=r"train_000\.bin: the token file changed since it was opened"):
        list(loader)


def test_other_collate_or_subclass_takes_torchs_path(shard: Path) -> None:
    ds = TokenWindows(shard, 16)

    def collate(batch: list[Any]) -> torch.Tensor:
        return torch.stack([x for x, _ in batch])

    ours = gpuload.DataLoader(ds, batch_size=4, collate_fn=collate)
    assert not isinstance(ours._source, TokenSource)
    assert torch.equal(next(iter(ours)), next(iter(TorchDataLoader(ds, batch_size=4, collate_fn=collate))))

    class Masked(TokenWindows):
        def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = super().__getitem__(index)
            return x, y * 0

    assert not isinstance(gpuload.DataLoader(Masked(shard, 16), batch_size=4)._source, TokenSource)


def test_bad_sampler_index_fails_like_torch(shard: Path) -> None:
    ds = TokenWindows(shard, 64)
    loader = gpuload.DataLoader(ds, batch_size=2, sampler=[0, len(ds)])
    with pytest.raises(IndexError, match=f"index {len(ds)} is out of bounds"):
        list(loader)


# ------------------------------------------------------------------------------ on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.int64])
def test_device_tier_holds_the_tokens_and_copies_nothing_per_step(tmp_path: Path, dtype: type) -> None:
    ids = _ids(50_000)
    ds = TokenWindows(ids.astype(dtype), 128)
    ours = gpuload.DataLoader(ds, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1),
                              device="cuda", cache_size="1GiB")
    theirs = TorchDataLoader(ds, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        for ours_batch, theirs_batch in zip(ours, theirs, strict=True):
            assert all(t.is_cuda for t in ours_batch)
            assert_same([t.cpu() for t in ours_batch], theirs_batch)
    assert ours.stats.path == "device-gather"
    itemsize = np.dtype(dtype).itemsize
    assert ours.stats.bytes_h2d == len(ids) * itemsize  # the one fill; no batch bytes
    assert ours.stats.extra["cache"]["device_bytes"] == len(ids) * itemsize


@pytest.mark.gpu
def test_host_path_on_cuda_equals_torch(shard: Path) -> None:
    ds = TokenWindows(shard, 64)
    ours, theirs = _pair(ds, batch_size=8, shuffle=True, cache="off", device="cuda")
    for ours_batch, theirs_batch in zip(ours, theirs, strict=True):
        assert_same([t.cpu() for t in ours_batch], theirs_batch)
    assert ours.stats.path == "host-gather"
    assert ours.stats.bytes_h2d == len(ds) * 65 * 2


@pytest.mark.gpu
def test_shrinking_the_device_tier_keeps_the_batches(shard: Path) -> None:
    ds = TokenWindows(shard, 64)
    ours, theirs = _pair(ds, batch_size=8, shuffle=True, device="cuda", cache_size="1GiB")
    ours.warm(progress=False)
    assert ours._source.shrink_cache(1000) == 5000 * 2 - 1000  # 500 uint16 tokens kept on the device
    for ours_batch, theirs_batch in zip(ours, theirs, strict=True):
        assert_same([t.cpu() for t in ours_batch], theirs_batch)
    assert ours.stats.extra["cache"]["device_bytes"] == 1000
