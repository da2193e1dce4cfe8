"""The epoch iterator the loader hands out, and the open epochs a new epoch or ``close()`` stops.

One class serves every path. It pulls the epoch's items (made in the loop's thread, or by the
prefetcher's thread ahead of it), finishes each in the loop's thread, and counts batches,
samples and the time the loop waited inside ``next()``. It asks the epoch's stop token
(:class:`gpuload.epoch.Epoch`, shared with the prefetcher's thread): an epoch stopped from
another thread (``close()``, a newer epoch sharing torch's persistent iterator) raises
:class:`EpochStoppedError` at its next batch, also from inside the ``next()`` it waits in: it
never ends early as if complete.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from gpuload.epoch import Epoch, EpochStoppedError, one_epoch_at_a_time
from gpuload.resume import Position
from gpuload.sources import Work
from gpuload.stats import LoaderStats
from gpuload.timeline import Timeline

__all__ = ["EpochIterator", "OpenEpochs", "release_torch_frames", "shut_down_workers", "unequal_stack"]

_TORCH_LOADING = ("torch.utils.data", "torch._utils")  # modules of torch's iterators and its re-raise
_UNEQUAL_STACK = "stack expects each tensor to be equal size"  # torch.stack, in torch's default collate
SHAPE_HINT = (
    "gpuload: the samples of this batch have different shapes, which the default collate_fn cannot stack "
    "into one tensor. Give them one shape: in the dataset's __getitem__ (a resize or a crop), with transforms= "
    "on images gpuload serves itself (gpuload.datasets.ImageFolder with transforms.RandomResizedCrop, Resize "
    "or CenterCrop), or pass a collate_fn that pads them or keeps them in a list"
)


def unequal_stack(error: BaseException) -> bool:
    """Whether ``error`` is torch's bare "stack expects each tensor to be equal size" (also as
    re-raised from a worker): the loop gets it again with :data:`SHAPE_HINT` added."""
    return type(error) is RuntimeError and _UNEQUAL_STACK in str(error)


class EpochIterator(Iterator[Any]):
    """One epoch of batches: ``work.finish`` applied to each of ``items`` in the loop's thread.

    ``items`` is ``work.items`` itself, or the prefetcher's epoch over it; ``length`` gives
    ``len()`` as torch's iterators report it (less the batches a resumed epoch skips), fixed
    for the epoch; ``position`` counts the index batches done, for ``state_dict()``, and
    ``on_end(position)`` runs once when the epoch ends. ``epoch``: the stop token it shares with
    the thread making ``items`` ahead (a new one if not given).
    """

    def __init__(
        self,
        work: Work,
        items: Iterator[Any],
        stats: LoaderStats,
        length: Callable[[], int],
        position: Position,
        on_end: Callable[[Position], None],
        epoch: Epoch | None = None,
        timeline: Timeline | None = None,
    ) -> None:
        # as it is when the epoch begins (Timeline.resize takes effect from the next epoch); None: off
        self._timeline = timeline if timeline is not None and timeline.enabled else None
        self._items = items
        self._finish = work.finish
        self._stats = stats
        self._length = length
        self._position = position
        self._on_end = on_end
        self._torch_iterator = work.torch_iterator
        self._epoch = epoch if epoch is not None else Epoch()
        self._pulled = 0  # items pulled from _items: the index the timeline samples by, as their maker counts
        self._full_from = self._first_in_full()  # the next item whose step the timeline records in full
        self._log_step = self._timeline.log.append if self._timeline is not None else None  # the others

    def __getattr__(self, name: str) -> Any:
        # torch's iterator attributes (``_workers``, ...) for code that reads them; a gpuload
        # path runs no worker process, so its ``_workers`` is empty.
        torch_iterator = self.__dict__.get("_torch_iterator")
        if torch_iterator is not None:
            return getattr(torch_iterator, name)
        if name == "_workers":
            return []
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __iter__(self) -> EpochIterator:
        return self

    @property
    def position(self) -> Position:
        return self._position

    @property
    def epoch(self) -> Epoch:
        """The stop token this iterator asks (replaced with the work, see :meth:`replace`)."""
        return self._epoch

    def replace(self, work: Work, items: Iterator[Any], length: Callable[[], int], epoch: Epoch) -> None:
        """Go on with other work from the next batch (the rest of this epoch, cut at another
        batch size), under ``epoch``, its stop token; the items made ahead for the old work are
        never delivered."""
        self._items, self._finish, self._length, self._epoch = items, work.finish, length, epoch
        self._torch_iterator = work.torch_iterator
        self._pulled = 0
        self._full_from = self._first_in_full()

    def __len__(self) -> int:
        return self._length() - self._position.skipped

    def _first_in_full(self) -> int:
        return self._timeline.full_from(0) if self._timeline is not None else 0

    def reads_from(self, torch_iterator: Any) -> bool:
        """Whether this epoch's batches come from ``torch_iterator``."""
        return self._torch_iterator is torch_iterator

    def reads_torch(self) -> bool:
        """Whether this epoch's batches come from one of torch's iterators (its workers)."""
        return self._torch_iterator is not None

    def stop(self, cause: str) -> None:
        """End this epoch before its end: the next ``next()`` (or the one a thread waits in)
        raises :class:`EpochStoppedError` naming ``cause``; an epoch that ended goes on ending."""
        self._epoch.stop(cause)

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for a ``next()`` in progress in another thread to return;
        False if it did not (its thread is still inside the source: a slow sample)."""
        return self._epoch.wait_idle(timeout, background=False)

    def __next__(self) -> Any:
        started = time.perf_counter()
        epoch = self._epoch
        delivered, asking = False, None
        timeline = self._timeline if self._pulled >= self._full_from else None  # this step recorded in full
        if timeline is not None:
            asking = timeline.ask(self._pulled)
        try:
            epoch.enter()  # a stop marked before this is seen here; close() waits for the rest
            try:
                if epoch.cause is not None:
                    epoch.raise_if_stopped(self._position.batches)
                finished = None
                while finished is None:
                    item = next(self._items)
                    self._pulled += 1
                    if epoch.cause is not None:  # stopped while it waited: never deliver, never end short
                        epoch.raise_if_stopped(self._position.batches)
                    finished = self._finish(item)
                    self._position.batches += 1  # also a batch whose every file was skipped
            finally:
                epoch.leave()
            delivered = True
        except StopIteration:
            if not epoch.end():
                epoch.raise_if_stopped(self._position.batches)
            if not self._position.finished:
                self._position.finished = True
                self._on_end(self._position)
            raise
        except EpochStoppedError:
            raise
        except Exception as error:
            release_torch_frames(error)
            epoch.raise_if_stopped(self._position.batches, error)  # torch's iterator torn down under it
            if unequal_stack(error):  # raised unbound: a local holding it would make a cycle through this frame
                raise RuntimeError(f"{error}\n{SHAPE_HINT}") from error
            raise
        finally:
            ready = time.perf_counter()
            wait = ready - started
            self._stats.wait_time_s += wait
            if timeline is not None:
                timeline.got(asking, delivered, started, ready)
                self._full_from = timeline.full_from(self._pulled)
            elif delivered and self._log_step is not None:
                self._log_step((wait, ready))  # recorded with the next step in full
        batch, count = finished
        self._stats.batches += 1
        self._stats.samples += count
        return batch


class OpenEpochs:
    """A loader's epochs not yet stopped (their stop tokens), the iterators reading them and the
    torch iterators they read (weakly held): what a new epoch and ``close()`` stop."""

    def __init__(self) -> None:
        self._epochs: list[Epoch] = []  # held until stopped: a thread may still work inside one
        self._iterators: weakref.WeakSet[EpochIterator] = weakref.WeakSet()
        self._torch: weakref.WeakSet[Any] = weakref.WeakSet()

    def note(self, work: Work, epoch: Epoch) -> Work:
        """``work``'s torch iterator, if any, and ``epoch``, the stop token its threads ask,
        noted for ``close()``."""
        if work.torch_iterator is not None:
            self._torch.add(work.torch_iterator)
        self._keep(epoch)
        return work

    def _keep(self, epoch: Epoch) -> None:
        # those over and left by every thread are forgotten: nothing of them is left to stop
        over = [known for known in self._epochs if known.stopped.is_set() and known.wait_idle(0)]
        self._epochs = [known for known in self._epochs if known is not epoch and known not in over] + [epoch]

    def add(self, iterator: EpochIterator, work: Work, new_epoch: str) -> None:
        """A new epoch's ``iterator``. torch's persistent workers serve every epoch through one
        iterator, which a new epoch resets: an older epoch still reading from it would end short
        without a word, so it is stopped, naming ``new_epoch``."""
        if work.torch_iterator is not None:
            for older in list(self._iterators):
                if older.reads_from(work.torch_iterator):
                    older.stop(one_epoch_at_a_time(new_epoch))
        self._iterators.add(iterator)
        self._keep(iterator.epoch)

    def mark_stopped(self, cause: str) -> bool:
        """Stop every open epoch for ``cause`` (a thread entering ``next()`` from here on raises
        at once); whether any of them reads one of torch's iterators."""
        for epoch in self._epochs:
            epoch.stop(cause)
        return any(iterator.reads_torch() for iterator in list(self._iterators))

    def stop(self, cause: str, wait_s: float) -> tuple[list[Epoch], list[Any]]:
        """Stop every open epoch for ``cause`` and forget them; wait up to ``wait_s`` s for each
        ``next()`` in progress in another thread (the prefetcher's thread is joined by its
        prefetcher). Returns the epochs still worked in (inside their source) and the torch
        iterators they read."""
        epochs, torch_iterators = self._epochs, list(self._torch)
        for epoch in epochs:
            epoch.stop(cause)  # first: a thread that enters next() from here on raises at once
        busy = [epoch for epoch in epochs if not epoch.wait_idle(wait_s, background=False)]
        self._epochs, self._iterators, self._torch = [], weakref.WeakSet(), weakref.WeakSet()
        return busy, torch_iterators


def shut_down_workers(torch_iterators: list[Any]) -> None:
    """End the worker processes of each of torch's iterators now (not when it is freed)."""
    for iterator in torch_iterators:
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


def release_torch_frames(error: BaseException) -> None:
    """Clear the locals of torch's loading frames in the tracebacks of ``error`` and its causes.

    torch re-raises a worker's exception from a frame that keeps it in a local: a reference
    cycle that holds torch's iterator, worker processes included, until the garbage collector
    runs, and the collected iterator then waits 5 s for each worker (its queues are finalized
    first), stalling whatever the program does at that moment. Cleared, the iterator ends with
    its epoch. Tracebacks still print in full; only those frames' locals are gone.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback = current.__traceback__
        while traceback is not None:
            frame = traceback.tb_frame
            if str(frame.f_globals.get("__name__", "")).startswith(_TORCH_LOADING):
                try:
                    frame.clear()
                except RuntimeError:  # a frame still running (torch's code calling ours)
                    pass
            traceback = traceback.tb_next
        pending += [current.__cause__, current.__context__]
