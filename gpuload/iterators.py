"""The epoch iterator the loader hands out: a source's epoch, in the loop's thread or ahead.

One class serves every path. It pulls the epoch's items (made in the loop's thread, or by the
prefetcher's thread ahead of it), finishes each in the loop's thread, and counts batches,
samples and the time the loop waited inside ``next()``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from gpuload.prefetch import EpochStoppedError
from gpuload.resume import EpochProgress
from gpuload.sources import Epoch
from gpuload.stats import LoaderStats

__all__ = ["EpochIterator", "release_torch_frames"]

_TORCH_LOADING = ("torch.utils.data", "torch._utils")  # modules of torch's iterators and its re-raise


class EpochIterator(Iterator[Any]):
    """One epoch of batches: ``epoch.finish`` applied to each of ``items`` in the loop's thread.

    ``items`` is ``epoch.items`` itself, or the prefetcher's epoch over it; ``length`` gives
    ``len()`` as torch's iterators report it (less the batches a resumed epoch skips);
    ``progress`` counts the index batches done, for ``state_dict()``, and ``on_end(progress)``
    runs once when the epoch ends.
    """

    def __init__(
        self,
        epoch: Epoch,
        items: Iterator[Any],
        stats: LoaderStats,
        length: Callable[[], int],
        progress: EpochProgress,
        on_end: Callable[[EpochProgress], None],
    ) -> None:
        self._items = items
        self._finish = epoch.finish
        self._stats = stats
        self._length = length
        self._progress = progress
        self._on_end = on_end
        self._torch_iterator = epoch.torch_iterator
        self._stopped_by: str | None = None

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
    def progress(self) -> EpochProgress:
        return self._progress

    def replace(self, epoch: Epoch, items: Iterator[Any], length: Callable[[], int]) -> None:
        """Go on with another epoch's work from the next batch (the rest of this epoch, cut at
        another batch size); the items made ahead for the old one are never delivered."""
        self._items, self._finish, self._length = items, epoch.finish, length
        self._torch_iterator = epoch.torch_iterator

    def __len__(self) -> int:
        return self._length() - self._progress.skipped

    def reads_from(self, torch_iterator: Any) -> bool:
        """Whether this epoch's batches come from ``torch_iterator``."""
        return self._torch_iterator is torch_iterator

    def stop(self, cause: str) -> None:
        """End this epoch before its end: the next ``next()`` raises :class:`EpochStoppedError`
        naming ``cause`` (an epoch that ended already goes on ending)."""
        if not self._progress.finished:
            self._stopped_by = cause

    def __next__(self) -> Any:
        if self._stopped_by is not None:
            raise EpochStoppedError.at(self._progress.batches, self._stopped_by)
        started = time.perf_counter()
        try:
            finished = None
            while finished is None:
                finished = self._finish(next(self._items))
                self._progress.batches += 1  # also a batch whose every file was skipped
        except StopIteration:
            if not self._progress.finished:
                self._progress.finished = True
                self._on_end(self._progress)
            raise
        except Exception as error:
            release_torch_frames(error)
            raise
        finally:
            self._stats.wait_time_s += time.perf_counter() - started
        batch, count = finished
        self._stats.batches += 1
        self._stats.samples += count
        return batch


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
