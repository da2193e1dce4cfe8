"""The sample cache hands collation exactly what torch's path does: same types, dtypes, values
and structure, with default_collate, a custom collate_fn and batch_size=None, in the epoch that
fills the cache and once it is complete (issue 25, items 5 and 6).

A property-based test draws nested structures (dicts, lists, tuples, namedtuples) of tensors,
NumPy arrays (0-d included), NumPy and Python scalars, strings, None and nn.Parameters, with
leaves whose dtype varies between samples, and compares every batch with torch's DataLoader.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from equivalence import assert_same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpuload
from gpuload.cache.columns import worker_collate

Pair = collections.namedtuple("Pair", ["first", "second"])


class Tagged(list):
    """A list subclass whose constructor takes more than the items (torch's collate falls back to a list)."""

    def __init__(self, items: list[Any], tag: str) -> None:
        super().__init__(items)
        self.tag = tag

FLOATS = (torch.float32, torch.float64, torch.float16)
INTS = (torch.int64, torch.int32, torch.uint8)
# Families of dtypes one leaf may mix between samples. Within a family torch's worker process
# casts the batch into the first sample's dtype; across families it would raise there.
FAMILIES = (FLOATS, INTS)


def assert_exact(ours: Any, theirs: Any, where: str = "batch") -> None:
    """Equal structure, types (nn.Parameter, 0-d ndarray vs numpy scalar), dtypes,
    ``requires_grad`` and values."""
    assert_same(ours, theirs, where, exact=True)


# ------------------------------------------------------------------ samples drawn by hypothesis


@dataclass(frozen=True)
class Leaf:
    """How one leaf of sample ``i`` is made: its kind, shape, and dtype (``dtypes[i % n]``)."""

    kind: str  # tensor, array, parameter, number, numpy_scalar, string, none
    shape: tuple[int, ...] = ()
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)

    def make(self, i: int) -> Any:
        dtype = self.dtypes[i % len(self.dtypes)]
        values = (torch.arange(int(np.prod(self.shape)), dtype=torch.float64).reshape(self.shape) * 3 + i) / 4
        if self.kind == "tensor":
            return values.to(dtype)
        if self.kind == "array":
            return values.to(dtype).numpy()
        if self.kind == "parameter":
            return torch.nn.Parameter(values.to(torch.float32), requires_grad=bool(i % 2))
        if self.kind == "number":  # Python int for some samples, float or bool for others
            return [i, i / 4, bool(i % 2)][i % len(self.dtypes)]
        if self.kind == "numpy_scalar":
            return values.to(dtype).numpy()[()] if values.dim() == 0 else values.to(dtype).numpy().flat[0]
        if self.kind == "string":
            return f"sample {i}"
        return None


def leaves(default_collate: bool, workers: bool) -> st.SearchStrategy[Leaf]:
    """Leaves torch's collate path can take (default_collate takes no None; a worker process
    stacks no tensor that requires grad)."""
    kinds = ["tensor", "array", "number", "numpy_scalar", "string"]
    if not default_collate:
        kinds.append("none")
    if not (default_collate and workers):
        kinds.append("parameter")
    shapes = st.lists(st.integers(1, 3), max_size=2).map(tuple)
    dtypes = st.sampled_from(FAMILIES).flatmap(lambda family: st.lists(st.sampled_from(family), min_size=1, max_size=3))
    return st.builds(Leaf, st.sampled_from(kinds), shapes, dtypes.map(tuple))


def trees(leaf: st.SearchStrategy[Leaf]) -> st.SearchStrategy[Any]:
    """Nested containers of leaves, as specs: ("dict", {...}), ("list", [...]), ("tuple", ...), ("pair", ...)
    (a namedtuple), and a defaultdict, an OrderedDict and a list subclass."""

    def containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of(
            st.dictionaries(st.sampled_from("abcd"), children, min_size=1, max_size=3).map(lambda d: ("dict", d)),
            st.lists(children, min_size=1, max_size=3).map(lambda items: ("list", items)),
            st.lists(children, min_size=1, max_size=3).map(lambda items: ("tuple", items)),
            st.tuples(children, children).map(lambda items: ("pair", list(items))),
            st.dictionaries(st.sampled_from("abcd"), children, min_size=1, max_size=2)
            .map(lambda d: ("defaultdict", d)),
            st.dictionaries(st.sampled_from("abcd"), children, min_size=1, max_size=2).map(lambda d: ("ordered", d)),
            st.lists(children, min_size=1, max_size=2).map(lambda items: ("tagged", items)),
        )

    return st.recursive(leaf, containers, max_leaves=6)


def build(spec: Any, i: int) -> Any:
    """Sample ``i`` of a drawn spec: fresh objects every call, as a dataset reading them would."""
    if isinstance(spec, Leaf):
        return spec.make(i)
    kind, children = spec
    if kind == "dict":
        return {key: build(child, i) for key, child in children.items()}
    if kind == "defaultdict":
        return collections.defaultdict(list, {key: build(child, i) for key, child in children.items()})
    if kind == "ordered":
        return collections.OrderedDict((key, build(child, i)) for key, child in children.items())
    items = [build(child, i) for child in children]
    return {"list": list, "tuple": tuple, "pair": lambda xs: Pair(*xs),
            "tagged": lambda xs: Tagged(xs, "tag")}[kind](items)


class Drawn(tud.Dataset):
    def __init__(self, spec: Any, n: int) -> None:
        self.spec, self.n = spec, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        return build(self.spec, index)


def as_given(samples: Any) -> Any:
    """A custom collate_fn that hands back what it was given."""
    return samples


COLLATES: dict[str, dict[str, Any]] = {
    "default": dict(batch_size=3),
    "custom": dict(batch_size=3, collate_fn=as_given),
    "none": dict(batch_size=None),
    "none-custom": dict(batch_size=None, collate_fn=as_given),
}


def compare(data: tud.Dataset, options: dict[str, Any], epochs: int = 2, seed: int | None = None) -> None:
    """Every batch of ``epochs`` epochs of gpuload's cached loader equals torch's; the cache is
    complete after the first, so later epochs are served from it. ``seed``: both shuffle, each
    with its own generator of that seed."""
    if seed is not None:
        options = dict(options, shuffle=True)
        ours = gpuload.DataLoader(data, cache="host", generator=torch.Generator().manual_seed(seed), **options)
        theirs = tud.DataLoader(data, generator=torch.Generator().manual_seed(seed), **options)
    else:
        ours = gpuload.DataLoader(data, cache="host", **options)
        theirs = tud.DataLoader(data, **options)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for epoch in range(epochs):
                our_batches, their_batches = list(ours), list(theirs)
                assert len(our_batches) == len(their_batches)
                for k, (a, b) in enumerate(zip(our_batches, their_batches)):
                    assert_exact(a, b, f"epoch {epoch} batch {k}")
                if options.get("drop_last"):  # the samples of a dropped last batch are never read
                    continue
                assert ours.stats.extra["cache"]["complete"], ours.stats.extra
                if epoch:  # with workers, torch's own workers fill the cache in the first epoch
                    assert ours.stats.path == "sample-cache (host)", ours.stats.path
    finally:
        ours.close()


@pytest.mark.parametrize("mode", list(COLLATES))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_cached_samples_are_what_torch_hands_collate(mode: str, data: st.DataObject) -> None:
    spec = data.draw(trees(leaves(default_collate=mode == "default", workers=False)), label="sample")
    n = data.draw(st.integers(2, 7), label="samples")
    options = dict(COLLATES[mode])
    if options["batch_size"] is not None:
        options.update(batch_size=data.draw(st.integers(1, 4), label="batch size"), drop_last=data.draw(st.booleans()))
    compare(Drawn(spec, n), options, seed=data.draw(st.one_of(st.none(), st.integers(0, 9)), label="shuffle seed"))


@pytest.mark.parametrize("mode", ["default", "custom"])
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_cached_samples_with_workers_are_what_torch_hands_collate(mode: str, data: st.DataObject) -> None:
    """With workers torch collates in worker processes; a complete cache serves in the loop's."""
    spec = data.draw(trees(leaves(default_collate=mode == "default", workers=True)), label="sample")
    compare(Drawn(spec, 6), dict(COLLATES[mode], num_workers=2))


# ------------------------------------------------------------------ the cases, fixed


class MixedDtype(tud.Dataset):
    """A leaf that is float32 for odd indices and float64 for even ones (issue 25, item 5)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict[str, Any]:
        dtype = torch.float32 if index % 2 else torch.float64
        return {"x": torch.full((2,), 9 / 7 + index, dtype=dtype),
                "y": np.full(3, index / 7, dtype=np.float32 if index % 2 else np.float64)}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dtype_varying_between_samples_collates_as_torch_does(workers: int) -> None:
    data = MixedDtype()
    options = dict(batch_size=4, shuffle=True, num_workers=workers)
    ours = gpuload.DataLoader(data, cache="host", generator=torch.Generator().manual_seed(1), **options)
    theirs = tud.DataLoader(data, generator=torch.Generator().manual_seed(1), **options)
    for epoch in range(3):
        for k, (a, b) in enumerate(zip(list(ours), list(theirs), strict=True)):
            assert_exact(a, b, f"epoch {epoch} batch {k}")
    assert ours.stats.extra["cache"]["complete"]


def test_worker_collate_keeps_the_first_samples_dtype() -> None:
    """In a worker, torch stacks into the first tensor's dtype; in the main process it promotes."""
    mixed = [torch.tensor([9 / 7], dtype=torch.float32), torch.tensor([9 / 7], dtype=torch.float64)]
    assert worker_collate(mixed).dtype == torch.float32
    assert worker_collate([np.full(2, 1.5), np.ones(2, dtype=np.float32)]).dtype == torch.float64
    assert tud.default_collate(mixed).dtype == torch.float64
    with pytest.raises(TypeError, match="can.t be cast"):  # as torch raises in a worker
        worker_collate([torch.tensor([1]), torch.tensor([1.5])])


def test_views_keep_0d_arrays_and_parameters() -> None:
    """A custom collate_fn gets a 0-d ndarray as an ndarray and an nn.Parameter as one (item 6)."""

    class Data(tud.Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> Any:
            return np.array(index), torch.nn.Parameter(torch.ones(2) * index), np.float32(index)

    seen: list[Callable[[], Any]] = []
    loader = gpuload.DataLoader(Data(), batch_size=2, cache="host",
                                collate_fn=lambda samples: seen.append(samples) or 0)
    for _epoch in range(2):
        list(loader)
    array, parameter, scalar = seen[-1][0]
    assert type(array) is np.ndarray and array.shape == () and array.dtype == np.int64
    assert type(parameter) is torch.nn.Parameter and parameter.requires_grad
    assert type(scalar) is np.float32
