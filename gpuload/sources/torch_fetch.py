"""torch's own fetching, as gpuload drives it: one batch read from a dataset (with the sample
named when it raises), torch's workers running an epoch while the batches' indices are recorded,
and chunks of a dataset read and prepared for the column store.

With workers, a private torch DataLoader over the same dataset, sampler and generator runs the
epoch, its batch sampler wrapped by ``RecordingSampler`` (it notes each index batch it hands
out, in order) and its collate function by ``KeepSamples`` (it returns the samples beside the
batch, until the cache says it is full). Batches come back in the order their indices were
drawn (``in_order=True``), so the k-th batch belongs to the k-th recorded index batch.
"""

from __future__ import annotations

import itertools
import multiprocessing
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import default_collate, default_convert
from torch.utils.data.dataloader import DataLoader as TorchDataLoader

from gpuload.cache.columns import Part, prepare
from gpuload.timeline import stage
from gpuload.worker_start import start_workers

__all__ = ["EpochPlaces", "HandedOver", "KeepSamples", "RecordingSampler", "TorchBatches", "TorchLoading",
           "WorkerBatches", "add_note", "fetch", "is_default_collate", "per_batch", "read_prepared"]


class KeepSamples:
    """A collate function that also returns the batch's samples prepared for the column store
    (``gpuload.cache.columns.prepare``), while ``sending`` is set.

    Picklable, so it travels to worker processes; ``sending`` is shared memory the loader
    clears once the cache cannot take more, so workers stop preparing samples. A prepared
    batch sends one tensor per column instead of every sample's tensors; with torch's
    default_collate the batch is built from the same columns, so they cross once.
    """

    def __init__(self, collate_fn: Callable[[Any], Any], batched: bool) -> None:
        self.collate_fn = collate_fn
        self.batched = batched
        self.by_column = batched and collate_fn is default_collate
        self.sending = multiprocessing.get_context().Value("b", 1, lock=False)

    def __call__(self, samples: Any) -> tuple[Any, Any]:
        if not self.sending.value:
            return None, self.collate_fn(samples)
        part = prepare(samples if self.batched else [samples])
        return part, part.batch() if self.by_column else self.collate_fn(samples)


class RecordingSampler:
    """Wraps an index sampler and records, in order, each index (batch) its iterator yields.

    Iterating it draws exactly what the wrapped sampler draws; each new ``iter()`` starts a new
    record, as torch's iterators call ``iter()`` once per epoch.
    """

    def __init__(self, sampler: Iterable[Any]) -> None:
        self.sampler = sampler
        self.drawn: deque[Any] = deque()

    def __iter__(self) -> Iterator[Any]:
        drawn: deque[Any] = deque()
        self.drawn = drawn
        for index in self.sampler:
            drawn.append(index)
            yield index

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]


@contextmanager
def read_prepared(
    dataset: Any, chunks: list[list[int]], num_workers: int, worker_options: dict[str, Any], batched: bool = True
) -> Iterator[Iterable[Part]]:
    """Each chunk of dataset indices read and prepared for the column store, in order: in this
    process (``batched``: through ``__getitems__`` when the dataset has it, as torch's fetcher),
    or by ``num_workers`` torch workers (with a private generator, so the user's random state is
    untouched), stopped on leaving even after an error."""
    if num_workers == 0:
        yield (prepare(fetch(dataset, chunk, batched)) for chunk in chunks)
        return
    reader: Iterator[Part] = start_workers(iter, TorchDataLoader(
        dataset, batch_sampler=chunks, num_workers=num_workers, collate_fn=prepare,
        generator=torch.Generator(), **worker_options,
    ))
    try:
        yield reader
    finally:
        reader._shutdown_workers()  # type: ignore[attr-defined]  # torch's worker iterator has it; its stub does not


@dataclass(frozen=True)
class EpochPlaces:
    """Where the batches of the epoch being started sit among its index batches, for torch's
    workers handing them over as they finish (``in_order=False``): ``places``, each remaining
    batch's place when the epoch is taken up mid-way (None: they follow each other from the
    first); ``note(place)``, called in the loop's thread with the place of each batch handed
    over, so the loader's position records which were done (None: nothing to note, the rest of
    the epoch was cut at another batch size)."""

    places: list[int] | None = None
    note: Callable[[int | None], None] | None = None


@dataclass(frozen=True)
class TorchLoading:
    """torch's own loading of the loader's dataset: the loader's torch iterator for one epoch
    (``iterate``), and what it takes to build a private torch DataLoader that runs the same
    epoch through the same workers to fill the cache (``options``: worker_init_fn,
    multiprocessing_context, timeout, prefetch_factor, persistent_workers, pin_memory,
    pin_memory_device, in_order, generator). ``seed_drawn()``: whether the persistent workers'
    base seed was drawn already in this run (torch draws it once, when its persistent iterator
    is first made; a resumed run must not again): the loader's draw state says.
    ``epoch_places()``: the :class:`EpochPlaces` of the epoch being started (the loader's position
    says)."""

    iterate: Callable[[], Iterator[Any]]
    index_sampler: Any
    num_workers: int
    options: dict[str, Any] = field(default_factory=dict)
    seed_drawn: Callable[[], bool] = lambda: False
    epoch_places: Callable[[], EpochPlaces] = EpochPlaces


class TorchBatches(Iterator[Any]):
    """An epoch of batches with the length of the torch iterator that makes them."""

    def __init__(self, inner: Iterator[Any], length: Callable[[], int], torch_iterator: Any) -> None:
        self._inner, self.length, self.torch_iterator = inner, length, torch_iterator

    def __next__(self) -> Any:
        with stage("read"):  # torch's fetch and collate, here or in its workers
            return next(self._inner)


def fetch(dataset: Any, indices: list[Any], batched: bool) -> list[Any]:
    """The samples of ``indices``, read as torch's map-style fetcher reads them; an exception
    keeps its type and message and gets a note naming the dataset index."""
    with stage("read"):
        return _fetch(dataset, indices, batched)


def _fetch(dataset: Any, indices: list[Any], batched: bool) -> list[Any]:
    getitems = getattr(dataset, "__getitems__", None) if batched else None
    if getitems is not None:  # a batch's samples in one call
        try:
            return list(getitems(indices))
        except Exception as error:
            add_note(error, f"gpuload: raised by {type(dataset).__name__}.__getitems__ "
                            f"for the batch of dataset indices {indices}")
            raise
    samples = []
    for index in indices:
        try:
            samples.append(dataset[index])
        except Exception as error:
            add_note(error, f"gpuload: raised while reading dataset index {index} ({type(dataset).__name__})")
            raise
    return samples


def add_note(error: BaseException, note: str) -> None:
    """Add ``note`` to ``error`` (shown under its message in a traceback); Python 3.10 has no
    notes, and there the exception is left as it is rather than replaced."""
    if hasattr(error, "add_note"):
        error.add_note(note)


def per_batch(items: Iterator[Any], make: Callable[[Any], Any],
              at_end: Callable[[], object] | None = None) -> Iterator[Any]:
    """``make(item)`` for each of ``items``, going on after a batch that raised, as torch's
    iterators do (the failed batch is consumed; the next ``next()`` makes the one after), and
    ``at_end()`` once when the items run out. (``map``: no Python frame of its own per batch.)"""
    if at_end is None:
        return map(make, items)
    return map(make, itertools.chain(items, _calls_at_end(at_end)))


def _calls_at_end(at_end: Callable[[], object]) -> Iterator[Any]:
    """Nothing, calling ``at_end()`` when asked for its (absent) first item."""
    at_end()
    yield from ()


class HandedOver(Iterator[Any]):
    """torch's multi-process iterator of a map-style epoch, noting (``note``) the place of each
    batch it hands over among the epoch's index batches: with ``in_order=False`` workers hand
    batches over as they finish, so the k-th handed over need not be the k-th drawn. The place
    is the task torch's iterator no longer waits for after ``next()``; ``places`` maps its own
    batch numbers to the epoch's (the rest of a resumed epoch), None when they are the same."""

    def __init__(self, inner: Any, places: list[int] | None, note: Callable[[int | None], None]) -> None:
        self._inner, self._places, self._note = inner, places, note

    def __next__(self) -> Any:
        waiting = set(getattr(self._inner, "_task_info", ()))
        item = next(self._inner)
        done = waiting.difference(getattr(self._inner, "_task_info", ()))
        if len(done) != 1:  # another torch than this was written for: the place is unknown (None)
            self._note(None)
        else:
            number = done.pop()
            self._note(self._places[number] if self._places is not None else number)
        return item


class WorkerBatches(Iterator[Any]):
    """A worker epoch's batches from torch's (samples, batch) pairs. Batches come back in the
    order their indices were drawn (``in_order=True``), so the k-th is the k-th ``recorder``
    noted: ``take(indices, samples)`` gets each (for the cache), also past a batch that raised
    (torch's iterator goes on; that batch's indices are dropped, and the exception, re-raised by
    torch from the worker, gets a note naming them). ``at_end()`` runs once at the end."""

    def __init__(self, pairs: Iterator[Any], recorder: RecordingSampler, take: Callable[[Any, Any], Any],
                 at_end: Callable[[], None] | None) -> None:
        self._pairs, self._recorder, self._take, self._at_end = pairs, recorder, take, at_end

    def __next__(self) -> Any:
        try:
            with stage("read"):
                samples, batch = next(self._pairs)
        except StopIteration:
            at_end, self._at_end = self._at_end, None
            if at_end is not None:
                at_end()
            raise
        except Exception as error:
            drawn = self._recorder.drawn
            if drawn:
                indices = drawn.popleft()
                shown = indices.tolist() if isinstance(indices, torch.Tensor) else indices
                add_note(error, f"gpuload: raised in a worker reading the batch of dataset indices {shown}")
            raise
        drawn = self._recorder.drawn
        self._take(drawn.popleft() if drawn else None, samples)
        return batch


def is_default_collate(collate_fn: Callable[[Any], Any]) -> bool:
    return collate_fn in (default_collate, default_convert)
