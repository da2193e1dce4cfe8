"""Index plans: which sample indices each batch takes, drawn with torch's own samplers.

For the device-gather path the per-batch Python of ``BatchSampler`` (lists of ints, then a
tensor per batch) costs more than the gather itself. When the batch sampler is torch's own
``BatchSampler`` over one of torch's samplers, the epoch's index sequence is drawn as tensors
and cut into batches as views: the same indices in the same order, from the same random
stream, and each random draw happens at the same batch as with torch, so an epoch abandoned
early leaves the generator exactly where torch's would.

``RandomSampler`` draws several times per epoch (a permutation per pass over the data, plus a
tail draw; chunks of 32 with replacement). Its draws are replayed with tensor ops; the replay is
checked once per kind of sampler against the real iterator on a copy of the random state, and
the real iterator is used instead if they ever disagree (a different torch release, say).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass
from numbers import Integral
from typing import Any, TypeGuard, cast

import torch
from torch.utils.data import (
    BatchSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

__all__ = [
    "MAX_BATCH_SIZE", "DrawState", "begin_drawing", "can_draw_whole_epoch", "checked_batch_size", "cut_order",
    "draw_epoch", "draw_order", "draws_in_range", "epoch_batches", "epoch_order", "in_range", "start_epoch_like_torch",
]

# The largest batch size ``set_batch_size`` takes (index tensors and kernels count in int32).
MAX_BATCH_SIZE = 2**31 - 1

# torch samplers that draw everything at their first index (or draw nothing): draining them
# into one tensor at the first batch is exactly what BatchSampler's first pull does.
_SINGLE_DRAW_SAMPLERS = (
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    DistributedSampler,
)

# One random draw of a sampler's pass: (start position, draw); ``draw`` runs when BatchSampler
# would pull index ``start``.
Draw = tuple[int, Callable[[], torch.Tensor]]

_replay_matches: dict[tuple[bool, bool, bool, bool], bool] = {}


@dataclass(eq=False)
class DrawState:
    """What draws a loader's epochs of indices as torch's iterator draws them, and what a resume
    checks and restores: torch's arguments that decide the order, whether the loader batches
    (torch's automatic collation) and whether the persistent workers' seed is drawn (once a run).

    The loader owns one and passes it to this module and :mod:`gpuload.resume`, which read and
    write nothing else of the loader; the loader keeps the attributes torch lets a user reassign
    after construction (:attr:`FOLLOWED`) and the batch size in force in step with its own."""

    #: the loader's attributes a user may reassign after construction, followed here
    FOLLOWED = ("generator", "num_workers", "in_order", "transforms")

    dataset: Any
    sampler: Any
    batch_sampler: Any  # None without automatic batching (batch_size=None)
    generator: torch.Generator | None
    batch_size: int | None  # in force (set_batch_size changes it)
    drop_last: bool
    num_workers: int
    persistent_workers: bool
    in_order: bool
    map_style: bool  # a map-style dataset (torch's _DatasetKind.Map), not an IterableDataset
    transforms: Any = None
    built_batch_size: int | None = None  # the batch size the loader was built with
    seed_drawn: bool = False  # the persistent workers' base seed has been drawn

    @classmethod
    def of(cls, loader: Any, map_style: bool) -> DrawState:
        """The draw state of torch-style ``loader`` as just built."""
        return cls(
            dataset=loader.dataset, sampler=loader.sampler, batch_sampler=loader.batch_sampler,
            generator=loader.generator, batch_size=loader.batch_size, drop_last=loader.drop_last,
            num_workers=loader.num_workers, persistent_workers=loader.persistent_workers,
            in_order=loader.in_order, map_style=map_style, transforms=getattr(loader, "transforms", None),
            built_batch_size=loader.batch_size,
        )

    @property
    def batched(self) -> bool:
        """Whether the loader makes batches (torch's automatic collation)."""
        return self.batch_sampler is not None

    @property
    def index_sampler(self) -> Any:
        """What an epoch's iterator pulls from: the batch sampler, or the sampler without batching."""
        return self.batch_sampler if self.batched else self.sampler


def start_epoch_like_torch(draw: DrawState, seed_drawn: bool) -> tuple[Iterator[Any], bool]:
    """The index sampler's iterator for a new epoch, consuming the generator exactly as torch's
    iterator does; returns it and whether the persistent workers' seed has been drawn.

    torch draws a base seed for its workers from the loader's generator each time an iterator is
    made (once only with persistent workers), after calling ``iter()`` on the index sampler,
    and multi-process iterators call ``iter()`` on it a second time. Matching this keeps the
    sampler's random stream, and so the batch order, identical to torch's.
    """
    sampler_iter = iter(draw.index_sampler)
    persistent = draw.persistent_workers and draw.num_workers > 0
    if not (persistent and seed_drawn):
        torch.empty((), dtype=torch.int64).random_(generator=draw.generator)
        seed_drawn = True
        if draw.num_workers > 0:
            sampler_iter = iter(draw.index_sampler)
    else:
        sampler_iter = iter(draw.index_sampler)
    return sampler_iter, seed_drawn


def begin_drawing(draw: DrawState) -> Iterator[Any]:
    """:func:`start_epoch_like_torch` for ``draw``, noting on it whether the persistent workers'
    seed has been drawn (``seed_drawn``, drawn once in a run)."""
    indices, draw.seed_drawn = start_epoch_like_torch(draw, draw.seed_drawn)
    return indices


def draw_epoch(draw: DrawState) -> Iterator[Any]:
    """The next epoch of index batches, drawn as torch's iterator draws them (as int64 tensors
    for torch's samplers)."""
    indices = begin_drawing(draw)
    if draw.batched and can_draw_whole_epoch(draw.batch_sampler):
        return epoch_batches(draw.batch_sampler)
    return indices


def draw_order(draw: DrawState) -> torch.Tensor | list[Any]:
    """The next epoch as one flat sample order, drawn as torch's iterator and BatchSampler draw
    it (for cutting at another batch size)."""
    begin_drawing(draw)
    return epoch_order(draw.batch_sampler.sampler)


def checked_batch_size(draw: DrawState, batch_size: Any) -> int:
    """``batch_size`` if the loader that ``draw`` draws for can change to it, else the
    ValueError saying why."""
    if not draw.map_style:
        raise ValueError(
            f"set_batch_size: an IterableDataset ({type(draw.dataset).__name__}) makes its own "
            "batches from its stream; gpuload cannot re-cut them (build a new DataLoader)"
        )
    if draw.built_batch_size is None:
        if draw.batch_sampler is not None:
            raise ValueError(
                "set_batch_size: batch_sampler option is mutually exclusive with batch_size, "
                "shuffle, sampler, and drop_last; this loader's batch_sampler= makes its batches, "
                "so change the size there (or build the loader with batch_size= and sampler=)"
            )
        raise ValueError(
            "set_batch_size: this loader was built with batch_size=None (no automatic batching: "
            "each item is one sample); build it with a batch_size to change it later"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise ValueError(
            f"batch_size should be a positive integer value up to {MAX_BATCH_SIZE}, but got "
            f"batch_size={batch_size!r}"
        )
    return batch_size


def can_draw_whole_epoch(batch_sampler: object) -> TypeGuard[BatchSampler]:
    """True when ``batch_sampler`` is torch's BatchSampler over one of torch's own samplers
    (a SubsetRandomSampler only over integer indices: its keys may be anything)."""
    if type(batch_sampler) is not BatchSampler:
        return False
    sampler = batch_sampler.sampler
    if type(sampler) is SubsetRandomSampler:
        return _integers(sampler.indices)
    return type(sampler) in (*_SINGLE_DRAW_SAMPLERS, RandomSampler)


def _integers(indices: Any) -> bool:
    """Whether every one of ``indices`` is an integer (a sampler's keys may be anything)."""
    if isinstance(indices, range):
        return True
    if isinstance(indices, torch.Tensor):
        return not indices.dtype.is_floating_point and not indices.dtype.is_complex
    return all(isinstance(index, Integral) and not isinstance(index, bool) for index in indices)


def draws_in_range(batch_sampler: object, num_samples: int) -> bool:
    """True when every index the epoch draws lies in ``[0, num_samples)`` without a check:
    torch's BatchSampler over its Random or Sequential sampler of exactly that many samples."""
    if not can_draw_whole_epoch(batch_sampler):
        return False
    sampler = batch_sampler.sampler
    return (type(sampler) is RandomSampler or type(sampler) is SequentialSampler) \
        and len(sampler.data_source) == num_samples


def in_range(indices: object, size: int) -> torch.Tensor:
    """``indices`` (an int, a sequence or a tensor) as a flat int64 CPU tensor in ``[0, size)``.

    Negative indices count from the end, as in torch's indexing; anything outside
    ``[-size, size)`` raises the IndexError torch's tensor indexing raises, naming the index.
    """
    flat = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if flat.numel():
        low, high = (int(v) for v in torch.aminmax(flat))
        if low < -size or high >= size:
            outside = (flat < -size) | (flat >= size)
            bad = int(flat[int(outside.nonzero()[0])])  # the first, as torch's fetch meets it
            raise IndexError(f"index {bad} is out of bounds for dimension 0 with size {size}")
        if low < 0:
            flat = flat.remainder(size)
    return flat


def epoch_batches(batch_sampler: BatchSampler) -> Iterator[torch.Tensor]:
    """Yield the epoch's batches as int64 tensors, as ``iter(batch_sampler)`` would yield lists.

    Draws happen when torch's BatchSampler would make them: a draw for sampler position ``p``
    runs while producing the batch that pulls ``p`` (a batch pulls its ``batch_size`` positions,
    and the one that finds the end pulls position ``len(sampler)``).
    """
    return itertools.chain.from_iterable(_batch_runs(batch_sampler))  # no Python frame per batch


def _batch_runs(batch_sampler: BatchSampler) -> Iterator[tuple[torch.Tensor, ...]]:
    """:func:`epoch_batches`' batches in runs, each cut in one go from the draws made so far:
    the next run is made (and its draws with it) when the batch after the last run is asked."""
    sampler = batch_sampler.sampler
    total = len(cast(Sized, sampler))  # torch's BatchSampler takes len() of it too
    size = batch_sampler.batch_size
    draws = list(_draws(sampler))
    pending: list[torch.Tensor] = []
    buffered = torch.empty(0, dtype=torch.int64)
    start = 0
    while True:
        last_pulled = min(start + size - 1, total)
        while draws and draws[0][0] <= last_pulled:
            pending.append(draws.pop(0)[1]())
        if pending:
            buffered = torch.cat([buffered, *pending])
            pending.clear()
        remaining = total - start
        if remaining <= 0 or (remaining < size and batch_sampler.drop_last):
            return
        # Full batches that pull no position a pending draw starts at are cut in one go.
        next_draw = draws[0][0] if draws else total + 1
        run = max(1, min((next_draw - start) // size, remaining // size))
        chunk, buffered = buffered[: run * size], buffered[run * size :]
        start += run * size
        yield chunk.split(size)


def epoch_order(sampler: Iterable[Any]) -> torch.Tensor | list[Any]:
    """The flat index order of one pass of ``sampler``, making every random draw the pass makes
    (as a whole epoch of torch's BatchSampler over it does, with or without drop_last): an
    int64 tensor, or a list when the sampler yields indices that are not all integers."""
    if type(sampler) in (*_SINGLE_DRAW_SAMPLERS, RandomSampler) and (
            type(sampler) is not SubsetRandomSampler or _integers(sampler.indices)):
        return torch.cat([draw() for _, draw in _draws(sampler)])
    order = list(iter(sampler))
    if all(type(index) is int for index in order):
        return torch.tensor(order, dtype=torch.int64)
    return order


def cut_order(order: torch.Tensor | list[Any], size: int, drop_last: bool) -> list[Any]:
    """``order`` cut into batches of ``size`` (tensors, or lists of indices), as torch's
    BatchSampler cuts its sampler's indices: the last batch is shorter, or with ``drop_last``
    left out when it is. An empty order has no batch (``split`` would give one empty piece)."""
    if len(order) == 0:
        return []
    batches = list(order.split(size)) if isinstance(order, torch.Tensor) else [
        order[start : start + size] for start in range(0, len(order), size)]
    if batches and drop_last and len(batches[-1]) < size:
        batches.pop()
    return batches


def _draws(sampler: Iterable[Any]) -> Iterator[Draw]:
    if type(sampler) is SequentialSampler:
        yield 0, lambda: torch.arange(len(sampler.data_source), dtype=torch.int64)
    elif type(sampler) is RandomSampler and _replay_is_exact(sampler):
        yield from _random_sampler_draws(sampler)
    else:
        yield 0, lambda: torch.tensor(list(iter(sampler)), dtype=torch.int64)


def _random_sampler_draws(sampler: RandomSampler) -> list[Draw]:
    """torch's ``RandomSampler.__iter__``, one Draw per random draw it makes."""
    n = len(sampler.data_source)
    num_samples = sampler.num_samples
    state: dict[str, torch.Generator] = {}

    def generator() -> torch.Generator:
        if "g" not in state:
            if sampler.generator is None:
                seed = int(torch.empty((), dtype=torch.int64).random_().item())
                state["g"] = torch.Generator()
                state["g"].manual_seed(seed)
            else:
                state["g"] = sampler.generator
        return state["g"]

    def randint(count: int) -> Callable[[], torch.Tensor]:
        return lambda: torch.randint(high=n, size=(count,), dtype=torch.int64, generator=generator())

    def randperm(keep: int | None) -> Callable[[], torch.Tensor]:
        return lambda: torch.randperm(n, generator=generator())[:keep]

    if sampler.replacement:
        chunks = num_samples // 32
        draws = [(32 * i, randint(32)) for i in range(chunks)]
        return draws + [(32 * chunks, randint(num_samples % 32))]
    passes = num_samples // n
    draws = [(n * i, randperm(None)) for i in range(passes)]
    return draws + [(n * passes, randperm(num_samples % n))]


def _replay_is_exact(sampler: RandomSampler) -> bool:
    """Check once per kind of RandomSampler, on a copy of the random state, that the replay
    equals torch's iterator.

    What is checked is torch's algorithm, which depends on ``replacement``, on whether the
    sampler has its own generator, and on whether the epoch has whole passes and a tail, not
    on the dataset's size: so the check runs on a small sampler of the same kind (a few
    milliseconds, where one over ImageNet's 1.28 M indices takes a second).
    """
    n, num_samples = len(sampler.data_source), sampler.num_samples
    kind = (sampler.replacement, sampler.generator is None, num_samples // max(n, 1) > 0, num_samples % max(n, 1) > 0)
    if kind not in _replay_matches:
        small = min(n, 1000)
        if sampler.replacement:
            small_samples = min(num_samples, 3 * 32 + num_samples % 32)
        else:
            small_samples = (num_samples // n) * small + (min(num_samples % n, small - 1) if num_samples % n else 0)
        global_state = torch.get_rng_state()
        own_state = None if sampler.generator is None else sampler.generator.get_state()

        def run(replay: bool) -> tuple[torch.Tensor, torch.Tensor]:
            torch.set_rng_state(global_state)
            generator = None
            if own_state is not None:
                generator = torch.Generator()
                generator.set_state(own_state)
            shadow = RandomSampler(range(small), sampler.replacement, small_samples, generator)
            if replay:
                order = torch.cat([draw() for _, draw in _random_sampler_draws(shadow)])
            else:
                order = torch.tensor(list(iter(shadow)), dtype=torch.int64)
            after = torch.get_rng_state() if generator is None else generator.get_state()
            return order, after

        try:
            real, replayed = run(replay=False), run(replay=True)
            _replay_matches[kind] = all(torch.equal(a, b) for a, b in zip(real, replayed))
        finally:
            torch.set_rng_state(global_state)
    return _replay_matches[kind]
