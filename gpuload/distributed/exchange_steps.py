"""One epoch of a split store's exchange steps, made in order by one thread at a time, possibly
ahead of the training loop.

Every step is a collective, so every rank must make the same steps in the same order. Running
ahead (in the prefetcher's thread) makes each rank's position depend on timing; this module
keeps it symmetric by construction:

- a step is made at most :data:`RUN_AHEAD_LIMIT` steps past the batches the loop has received
  (``handed_over``), the same bound on every rank;
- when the loop stops the epoch early, the steps are completed (``close``) up to exactly that
  bound, so ranks that stopped at the same batch have made the same collectives, and the next
  epoch (or a resumed loader) starts in step with the others;
- every step, including those, is made under the store's lock: one thread issues the
  exchange's collectives at a time, and a new epoch completes the previous one first.

A collective's host wait is sliced (:func:`wait_work`) so that a closing loader abandons a
collective its peers will never join instead of waiting out the exchange timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Generic, TypeVar

from gpuload.timeline import stage

__all__ = ["RUN_AHEAD_LIMIT", "ExchangeSteps", "LoaderClosedError", "MappedSteps", "wait_work"]

T = TypeVar("T")
U = TypeVar("U")

#: The most steps the exchange runs past the batches the loop has received; also how far an
#: epoch stopped early is completed. The same on every rank (never a per-rank choice such as
#: free memory), so that ranks stopping at the same batch make the same collectives.
RUN_AHEAD_LIMIT = 4
_SLICE = timedelta(milliseconds=50)  # how often a host wait looks whether the loader was closed


class LoaderClosedError(RuntimeError):
    """The loader was closed while its exchange waited for the other ranks: abandoned."""


def wait_work(work: Any, on_host: bool, abandoned: Callable[[], bool]) -> None:
    """Wait for a collective started with ``async_op=True``.

    NCCL (``on_host=False``): the current stream waits for it, the host does not. gloo: the host
    waits, in slices, raising :class:`LoaderClosedError` once ``abandoned()``; the work's own
    error (the group's timeout, a peer gone) is raised as it is.
    """
    if not on_host:
        work.wait()
        return
    while True:
        try:
            work.wait(_SLICE)
            return
        except RuntimeError:
            if work.is_completed():
                work.wait()  # done (or failed) meanwhile: its own outcome
                return
            if abandoned():
                raise LoaderClosedError(
                    "this gpuload.DataLoader was closed while its exchange waited for the other ranks"
                ) from None


class ExchangeSteps(Iterator[T], Generic[T]):
    """Steps ``steps`` of one epoch, each made by ``make(step)`` under ``lock``.

    ``ahead``: the steps run ahead of the loop (in the prefetcher's thread), at most
    :data:`RUN_AHEAD_LIMIT` past the batches the loop received; else each is made when the loop
    asks. The loop calls :meth:`handed_over` for each batch it receives; the prefetcher calls
    :meth:`cancel` from the loop's thread when the epoch stops, then :meth:`close` from its own.
    ``closed()`` says the loader was closed: nothing more is made, not even to complete the epoch.
    """

    def __init__(
        self, steps: range, make: Callable[[int], T], lock: threading.Lock, ahead: bool,
        closed: Callable[[], bool],
    ) -> None:
        self._steps = steps
        self._make = make
        self._lock = lock
        self._limit = RUN_AHEAD_LIMIT if ahead else 0
        self._closed = closed
        self._next = steps.start
        self._handed = 0
        self._state = threading.Condition()
        self._cancelled = False
        self._over = False  # every step made, one failed, or the epoch was completed
        self._settled = threading.Event()  # _over, and no completing step is being made

    def __iter__(self) -> ExchangeSteps[T]:
        return self

    def __next__(self) -> T:
        if self._limit:
            with self._state:
                self._state.wait_for(self._may_go_on)
                if self._cancelled:
                    raise StopIteration
        with self._lock:
            if self._over or self._next >= self._steps.stop:
                self._end()
                raise StopIteration
            try:
                with stage("exchange"):  # less the gathers of this rank's own rows, timed inside it
                    item = self._make(self._next)
            except BaseException:
                self._end()
                raise
            self._next += 1
            return item

    def map(self, fn: Callable[[T], U]) -> MappedSteps[U]:
        """These steps with ``fn`` applied to each item, in the thread that makes them."""
        return MappedSteps(self, fn)

    def _may_go_on(self) -> bool:
        """Stopped, at the epoch's end, or fewer than the limit ahead of the loop."""
        return self._cancelled or self._next >= self._steps.stop or self._next < self._bound()

    def _bound(self) -> int:
        """The first step not to make yet (or, stopping, the last one to complete, exclusive)."""
        return min(self._steps.start + self._handed + self._limit, self._steps.stop)

    def handed_over(self) -> None:
        """The loop received one more batch (its thread calls this)."""
        with self._state:
            self._handed += 1
            self._state.notify_all()

    def cancel(self) -> None:
        """The loop stopped this epoch: a step waiting for the loop to catch up is not made."""
        with self._state:
            self._cancelled = True
            self._state.notify_all()

    @property
    def stopped(self) -> bool:
        """Whether the loop stopped this epoch (:meth:`cancel`)."""
        return self._cancelled

    def close(self) -> None:
        """End the epoch here: make the steps up to the bound every rank stopping at this batch
        reaches (none when the epoch ended, failed, or the loader was closed). Idempotent."""
        with self._lock:
            if self._over:
                return
            self._over = True
            try:
                bound = self._bound()
                while self._next < bound and not self._closed():
                    self._make(self._next)
                    self._next += 1
            finally:
                self._settled.set()

    def settle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the steps :meth:`close` completes after a stop, made by
        the thread that ran them ahead; whether none is left. Closing the loader under them
        would leave this rank's part of a collective in flight, and a peer waiting for it."""
        return not self._limit or self._settled.wait(timeout)

    def _end(self) -> None:
        self._over = True
        self._settled.set()


class MappedSteps(Iterator[U], Generic[U]):
    """:class:`ExchangeSteps` whose items go through ``fn`` as they are made (decoding, counters);
    the prefetcher stops the steps through it (``cancel``, ``close``); the loop tells the steps
    themselves of each batch it receives (``ExchangeSteps.handed_over``)."""

    def __init__(self, steps: ExchangeSteps[Any], fn: Callable[[Any], U]) -> None:
        self._steps, self._fn = steps, fn

    def __iter__(self) -> MappedSteps[U]:
        return self

    def __next__(self) -> U:
        return self._fn(next(self._steps))

    def cancel(self) -> None:
        self._steps.cancel()

    def close(self) -> None:
        self._steps.close()
