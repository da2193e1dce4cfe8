"""One epoch's stop token: what every thread of the epoch asks, and what ``close()`` waits for.

An :class:`Epoch` is shared by everything that serves one epoch: the iterator the loop holds,
the prefetcher's thread making batches ahead, and the sources that wait inside a batch (an
exchange waiting for other ranks). Stopping it (a newer epoch, ``close()``, the loop's wait
abandoned) sets one event that each of them looks at; the loop then gets an
:class:`EpochStoppedError` naming the cause at its next batch, unless it was already handed
the epoch's end. Each thread that works in the epoch does so ``inside()`` it, so whoever closes
can wait for them, or leave the closing of what they use to the last one out (``when_idle``):
no thread polls.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

from gpuload.transfer import Staging

__all__ = ["Epoch", "EpochStoppedError", "one_epoch_at_a_time", "when_all_idle"]


class EpochStoppedError(RuntimeError):
    """An epoch's iterator was stopped before its end (a newer epoch started, or ``close()``)."""

    @classmethod
    def at(cls, next_batch: int, cause: str) -> EpochStoppedError:
        """The error for an epoch stopped by ``cause`` before batch ``next_batch`` (0-based)."""
        return cls(
            f"this epoch's iterator was stopped before its end (batch {next_batch} and those after it "
            f"were not delivered): {cause}"
        )


def one_epoch_at_a_time(reason: str) -> str:
    """Why an epoch was stopped when ``reason`` (what started) reuses what it read from."""
    return (
        f"{reason} started. A loader runs one epoch at a time: iterate it from one thread, "
        "or give each consumer its own loader"
    )


class Epoch:
    """The stop token of one epoch, the threads working inside it, and its copy route.

    ``stopped`` is set by :meth:`stop` (from any thread); background threads wait on it or look
    at it between batches. ``cause`` is what the loop is told; the first stop names it, and a
    stop after :meth:`end` (the loop was handed the end) tells the loop nothing. ``staging``:
    how host tensors a batch needs reach the device (the loader's prefetcher's slots and side
    stream; None on a CPU device, where nothing is copied).
    """

    def __init__(self, staging: Staging | None = None) -> None:
        self.staging = staging
        self.stopped = threading.Event()
        self.cause: str | None = None
        self._ended = False
        self._users = 0  # threads working inside it now
        self._background = 0  # of them, those inside() for all the epoch (the prefetcher's thread)
        self._waiting = 0  # threads in wait_idle
        self._lock = threading.Lock()  # orders stop against end; counts users (a C lock: cheap per batch)
        self._idle = threading.Condition(self._lock)
        self._when_idle: list[Callable[[], None]] = []

    def stop(self, cause: str) -> None:
        """Stop this epoch for ``cause``: threads inside it stop at their next look, and the
        loop gets :class:`EpochStoppedError` naming the first cause, unless it already ended."""
        with self._lock:
            if self.cause is None and not self._ended:
                self.cause = cause
        self.stopped.set()

    def end(self) -> bool:
        """The epoch reached its end (or the loop was handed its failure): a later stop no longer
        tells the loop anything. False if it was stopped first (the end is not delivered)."""
        with self._lock:
            if self.cause is None:
                self._ended = True
        self.stopped.set()  # nothing is left to make
        return self.cause is None

    def raise_if_stopped(self, next_batch: int, error: BaseException | None = None) -> None:
        """Raise :class:`EpochStoppedError` (from ``error``) if the epoch was stopped before its end."""
        if self.cause is not None:
            raise EpochStoppedError.at(next_batch, self.cause) from error

    def enter(self) -> None:
        """A thread starts work inside this epoch (a ``next()``): :meth:`wait_idle` waits for it
        until it calls :meth:`leave`."""
        with self._lock:
            self._users += 1

    def leave(self) -> None:
        """The work :meth:`enter` began is done; the last to leave runs what :meth:`when_idle` was given."""
        with self._lock:
            self._users -= 1
            if not (self._when_idle or self._waiting):
                return
            if self._waiting:
                self._idle.notify_all()
            if self._users:
                return
            callbacks, self._when_idle = self._when_idle, []
        for callback in callbacks:  # in the thread that left last, outside the lock
            callback()

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """:meth:`enter` and :meth:`leave` around a block that runs in the background for all the
        epoch (the prefetcher's thread, which its owner joins itself)."""
        with self._lock:
            self._users += 1
            self._background += 1
        try:
            yield
        finally:
            with self._lock:
                self._background -= 1
            self.leave()

    def wait_idle(self, timeout: float, background: bool = True) -> bool:
        """Wait up to ``timeout`` s (negative: for ever) for the work inside this epoch to leave
        (without ``background``: only the ``next()`` calls; a background thread is joined by its
        owner); False if some is still inside (a slow sample, a source waiting for other ranks)."""
        with self._idle:
            self._waiting += 1
            try:
                self._idle.wait_for(lambda: self._users == (0 if background else self._background),
                                    None if timeout < 0 else timeout)
                return not self._users
            finally:
                self._waiting -= 1

    def when_idle(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once nothing works inside this epoch: now, or in the thread leaving last."""
        with self._lock:
            if self._users:
                self._when_idle.append(callback)
                return
        callback()


def when_all_idle(epochs: Sequence[Epoch], callback: Callable[[], None]) -> None:
    """Run ``callback`` once, when every one of ``epochs`` is idle (now if all are)."""
    pending = [len(epochs)]
    count = threading.Lock()

    def one_idle() -> None:
        with count:
            pending[0] -= 1
            last = pending[0] == 0
        if last:
            callback()

    if not epochs:
        callback()
    for epoch in epochs:
        epoch.when_idle(one_idle)
