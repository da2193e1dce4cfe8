"""gpuload.DataLoader yields what torch's DataLoader yields, batch for batch, epoch after epoch."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from equivalence import assert_same, assert_same_epochs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import (
    BatchSampler,
    Dataset,
    IterableDataset,
    RandomSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data.distributed import DistributedSampler

import gpuload

Point = collections.namedtuple("Point", ["x", "label"])


class RichDataset(Dataset):
    """Generic samples of every kind default_collate knows: the torch path."""

    def __init__(self, n: int, kind: str) -> None:
        self.n, self.kind = n, kind
        self.x = torch.arange(n * 6, dtype=torch.float32).view(n, 2, 3)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = self.x[i]
        if self.kind == "tuple":
            return x, i
        if self.kind == "dict":
            return {"x": x, "name": f"s{i}", "w": float(i) / 2}
        if self.kind == "namedtuple":
            return Point(x, i)
        if self.kind == "nested":
            return {"pair": (x, np.int64(i)), "meta": {"id": i, "tag": [f"t{i}", i % 3]}}
        if self.kind == "numpy":
            return x.numpy(), np.float32(i)
        raise AssertionError(self.kind)


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield torch.full((2,), i, dtype=torch.int16), i


def array_datasets(n: int) -> dict[str, object]:
    images = torch.randint(0, 256, (n, 3, 4, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    labels = torch.arange(n) % 7
    return {
        "TensorDataset": TensorDataset(images, labels),
        "ArrayDataset-tuple": gpuload.ArrayDataset(images.numpy(), labels.numpy()),
        "ArrayDataset-dict": gpuload.ArrayDataset(image=images, label=labels.float()),
        "tensor": images,
        "ndarray": labels.numpy().astype(np.float32),
    }


def twin_loaders(dataset, seed: int | None = 0, **kwargs):
    ours = gpuload.DataLoader(
        dataset, generator=None if seed is None else torch.Generator().manual_seed(seed), device="cpu", **kwargs
    )
    theirs = TorchDataLoader(
        dataset, generator=None if seed is None else torch.Generator().manual_seed(seed), **kwargs
    )
    return ours, theirs


LOADER_KWARGS = [
    dict(batch_size=1),
    dict(batch_size=7, shuffle=True),
    dict(batch_size=7, shuffle=True, drop_last=True),
    dict(batch_size=100, shuffle=True),
    dict(batch_size=100, shuffle=True, drop_last=True),
    dict(batch_size=None, shuffle=True),
    dict(batch_size=None),
    dict(batch_size=5, sampler="random-replacement"),
    dict(batch_size=5, sampler="subset"),
    dict(batch_size=5, sampler="weighted"),
    dict(batch_size=5, sampler="list"),
    dict(batch_sampler="lists"),
    dict(batch_sampler="BatchSampler"),
]


def resolve_kwargs(kwargs: dict, n: int, seed: int) -> dict:
    """Build fresh samplers for one loader (each loader needs its own generator)."""
    kwargs = dict(kwargs)
    g = torch.Generator().manual_seed(seed + 1)
    sampler = kwargs.pop("sampler", None)
    if sampler == "random-replacement":
        kwargs["sampler"] = RandomSampler(range(n), replacement=True, num_samples=n + 3, generator=g)
    elif sampler == "subset":
        kwargs["sampler"] = SubsetRandomSampler(list(range(0, n, 2)), generator=g)
    elif sampler == "weighted":
        kwargs["sampler"] = WeightedRandomSampler(torch.rand(n, generator=torch.Generator().manual_seed(3)), n,
                                                  generator=g)
    elif sampler == "list":
        kwargs["sampler"] = list(reversed(range(n)))
    batch_sampler = kwargs.pop("batch_sampler", None)
    if batch_sampler == "lists":
        kwargs["batch_sampler"] = [[i, (i * 7) % n] for i in range(0, n, 3)]
    elif batch_sampler == "BatchSampler":
        kwargs["batch_sampler"] = BatchSampler(RandomSampler(range(n), generator=g), 6, drop_last=False)
    return kwargs


@pytest.mark.parametrize("cache", ["auto", "off"])
@pytest.mark.parametrize("kwargs", LOADER_KWARGS, ids=str)
@pytest.mark.parametrize("name", list(array_datasets(1)))
def test_array_datasets_match_torch(name: str, kwargs: dict, cache: str) -> None:
    """cache="off" stages every batch through the prefetcher's ring, even on the CPU."""
    n = 37
    dataset = array_datasets(n)[name]
    ours = gpuload.DataLoader(dataset, generator=torch.Generator().manual_seed(5), device="cpu", cache=cache,
                              **resolve_kwargs(kwargs, n, 5))
    theirs = TorchDataLoader(dataset, generator=torch.Generator().manual_seed(5), **resolve_kwargs(kwargs, n, 5))
    assert len(ours) == len(theirs)
    assert_same_epochs(ours, theirs, epochs=3)
    assert ours.stats.path == ("device-gather" if cache == "auto" else "host-gather")
    ours.close()


@pytest.mark.parametrize("prefetch_depth", [None, 0, 2])
@pytest.mark.parametrize("kwargs", LOADER_KWARGS[:8], ids=str)
@pytest.mark.parametrize("kind", ["tuple", "dict", "namedtuple", "nested", "numpy"])
def test_generic_datasets_match_torch(kind: str, kwargs: dict, prefetch_depth: int | None) -> None:
    """prefetch_depth on the CPU runs torch's fetching in the prefetcher's thread."""
    n = 23
    dataset = RichDataset(n, kind)
    ours = gpuload.DataLoader(dataset, generator=torch.Generator().manual_seed(2), device="cpu",
                              prefetch_depth=prefetch_depth, **resolve_kwargs(kwargs, n, 2))
    theirs = TorchDataLoader(dataset, generator=torch.Generator().manual_seed(2), **resolve_kwargs(kwargs, n, 2))
    assert_same_epochs(ours, theirs, epochs=2)
    assert ours.stats.path == "torch"


def test_global_rng_without_generator_matches_torch() -> None:
    dataset = array_datasets(50)["TensorDataset"]
    ours = gpuload.DataLoader(dataset, batch_size=8, shuffle=True, device="cpu")
    theirs = TorchDataLoader(dataset, batch_size=8, shuffle=True)
    for epoch in range(3):
        torch.manual_seed(100 + epoch)
        our_batches = list(ours)
        after_ours = torch.get_rng_state()
        torch.manual_seed(100 + epoch)
        their_batches = list(theirs)
        assert torch.equal(after_ours, torch.get_rng_state()), "global RNG consumed differently"
        for a, b in zip(our_batches, their_batches, strict=True):
            assert_same(a, b)


def test_generator_is_consumed_like_torch() -> None:
    """After an epoch the user's generator is in the same state as with torch's loader."""
    dataset = array_datasets(40)["TensorDataset"]
    g_ours, g_theirs = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    ours = gpuload.DataLoader(dataset, batch_size=4, shuffle=True, generator=g_ours, device="cpu")
    theirs = TorchDataLoader(dataset, batch_size=4, shuffle=True, generator=g_theirs)
    for _ in range(3):
        list(ours), list(theirs)
        assert torch.equal(g_ours.get_state(), g_theirs.get_state())
    # An iterator that is created but abandoned early still consumes like torch's.
    next(iter(ours)), next(iter(theirs))
    assert torch.equal(g_ours.get_state(), g_theirs.get_state())


@pytest.mark.parametrize("path", ["array", "generic"])
def test_distributed_sampler_with_set_epoch(path: str) -> None:
    n = 30
    dataset = array_datasets(n)["TensorDataset"] if path == "array" else RichDataset(n, "tuple")
    for rank in range(2):
        ours = gpuload.DataLoader(dataset, batch_size=4,
                                  sampler=DistributedSampler(dataset, num_replicas=2, rank=rank, seed=3), device="cpu")
        theirs = TorchDataLoader(dataset, batch_size=4,
                                 sampler=DistributedSampler(dataset, num_replicas=2, rank=rank, seed=3))

        def set_epoch(epoch: int) -> None:  # called only by this iteration's assert_same_epochs
            ours.sampler.set_epoch(epoch)  # noqa: B023
            theirs.sampler.set_epoch(epoch)  # noqa: B023

        assert_same_epochs(ours, theirs, epochs=3, before_epoch=set_epoch)
    first = [b[1].tolist() for b in ours]
    ours.sampler.set_epoch(7)
    assert [b[1].tolist() for b in ours] != first


def test_iterable_dataset_matches_torch() -> None:
    for batch_size in (None, 4):
        ours, theirs = twin_loaders(Stream(10), batch_size=batch_size)
        assert_same_epochs(ours, theirs, epochs=2)


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("path", ["array", "generic", "iterable"])
def test_worker_processes_match_torch(path: str, persistent: bool) -> None:
    n = 29
    dataset = {"array": array_datasets(n)["TensorDataset"], "generic": RichDataset(n, "nested"),
               "iterable": Stream(n)}[path]
    shuffle = path != "iterable"
    ours, theirs = twin_loaders(dataset, batch_size=4, shuffle=shuffle, num_workers=2, persistent_workers=persistent)
    assert_same_epochs(ours, theirs, epochs=2)
    ours.close()


def test_custom_collate_and_overridden_getitem_take_torch_path() -> None:
    class Doubled(TensorDataset):
        def __getitem__(self, i):
            x, y = super().__getitem__(i)
            return x * 2, y

    base = array_datasets(20)["TensorDataset"]
    doubled = Doubled(*base.tensors)
    ours, theirs = twin_loaders(doubled, batch_size=3, shuffle=True)
    assert_same_epochs(ours, theirs)
    assert ours.stats.path == "torch"

    def collate(samples):
        return torch.stack([x for x, _ in samples]).float().mean()

    ours, theirs = twin_loaders(base, batch_size=3, shuffle=True, collate_fn=collate)
    assert_same_epochs(ours, theirs)
    assert ours.stats.path == "torch"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 60),
    batch_size=st.one_of(st.none(), st.integers(1, 70)),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**31),
    dataset_name=st.sampled_from(list(array_datasets(1))),
    generic=st.booleans(),
)
def test_random_configurations_match_torch(n, batch_size, shuffle, drop_last, seed, dataset_name, generic) -> None:
    dataset = array_datasets(n)[dataset_name]
    if generic:
        dataset = torch.utils.data.Subset(dataset, range(n))  # same samples, torch's path
    kwargs = dict(batch_size=batch_size, shuffle=shuffle)
    if batch_size is not None:
        kwargs["drop_last"] = drop_last
    ours, theirs = twin_loaders(dataset, seed=seed, **kwargs)
    assert len(ours) == len(theirs)
    assert_same_epochs(ours, theirs, epochs=2)
