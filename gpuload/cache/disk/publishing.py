"""Blocks published behind the loop: a complete block's fsync, checksum, rename and manifest entry
done on one background thread, so filling the disk tier does not delay the batch that completes a
block (the fsync and CRC-32 of a 64 MiB block take tens of milliseconds).

The thread publishes only what the cache already owns: a block whose rows are all in its ``.part``
file (nothing writes them any more), never a tensor the caller could change. At most
:data:`PENDING_BLOCKS` blocks wait at a time; a writer that would queue more first waits for the
oldest (``room``). Callers wait for the blocks they are about to look at (``wait``), so this
process never reads its own rows from the source while their block is about to be published.
A failure is kept and handed to the cache's next call in the caller's thread (``failure``), where
it is warned about or raised; the blocks still waiting are then left unpublished (their ``.part``
files are discarded by the entry's next lone user, as a killed process's are). ``wait()`` with no
blocks is the flush: the cache calls it at ``close``, and every publisher still busy is waited
for at interpreter exit.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable

from gpuload.exit_threads import stop_all_before_exit

PENDING_BLOCKS = 4
"""Complete blocks that may wait for publication at once (their bytes are on disk, not in memory)."""


class BlockPublisher:
    """Runs ``publish(block, size, inode)`` for each queued block, in order, on one daemon thread
    that ends when nothing is queued (started again by the next ``queue``)."""

    def __init__(self, publish: Callable[[int, int, int], None], limit: int = PENDING_BLOCKS) -> None:
        self._publish = publish
        self._limit = limit
        self._cond = threading.Condition()
        self._pending: OrderedDict[int, tuple[int, int]] = OrderedDict()  # block -> (size, inode), oldest first
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        _LIVE.add(self)

    @property
    def pending(self) -> int:
        """Blocks queued and not yet published."""
        with self._cond:
            return len(self._pending)

    def queued(self) -> set[int]:
        """The blocks queued and not yet published."""
        with self._cond:
            return set(self._pending)

    def queue(self, block: int, size: int, inode: int) -> None:
        """Publish ``block`` (its part's final ``size`` and ``inode``) behind the caller; never waits
        (the caller may hold the entry's locks, which publishing takes)."""
        with self._cond:
            if self._failure is not None or block in self._pending:
                return
            self._pending[block] = (size, inode)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gpuload-disk-publish", daemon=True)
                self._thread.start()

    def room(self) -> None:
        """Wait until fewer than ``limit`` blocks are queued. Never with the entry's locks held."""
        with self._cond:
            while len(self._pending) >= self._limit and self._thread is not None:
                self._cond.wait()

    def wait(self, blocks: Iterable[int] | None = None) -> None:
        """Wait until ``blocks`` (None: all) are published or given up. Never with the entry's locks held."""
        with self._cond:
            if blocks is None:
                while self._thread is not None:
                    self._cond.wait()
                return
            wanted = set(blocks)
            while self._thread is not None and not wanted.isdisjoint(self._pending):
                self._cond.wait()

    def failure(self) -> BaseException | None:
        """The error that stopped publishing, once (None if none)."""
        with self._cond:
            failure, self._failure = self._failure, None
            return failure

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._pending:
                    self._thread = None
                    self._cond.notify_all()
                    return
                block, (size, inode) = next(iter(self._pending.items()))
            try:
                self._publish(block, size, inode)
            except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
                with self._cond:
                    self._failure = error
                    self._pending.clear()  # their parts stay unpublished
                    self._cond.notify_all()
                continue
            with self._cond:
                self._pending.pop(block, None)
                self._cond.notify_all()


_LIVE: weakref.WeakSet[BlockPublisher] = weakref.WeakSet()


@atexit.register
def _publish_before_exit() -> None:
    """At interpreter exit (before daemon threads stop): every queued block published, once the
    prefetch threads that could queue more have stopped (whichever exit hook runs first)."""
    stop_all_before_exit()
    for publisher in list(_LIVE):
        publisher.wait()


def _none_in_a_forked_child() -> None:
    """A forked child has no publishing thread: the parent's queue is the parent's to publish."""
    for publisher in list(_LIVE):
        publisher._cond = threading.Condition()
        publisher._pending.clear()
        publisher._thread = None
        publisher._failure = None


os.register_at_fork(after_in_child=_none_in_a_forked_child)
