"""The disk tier's locks: the entry's file lock (``flock``, between processes) and each open
cache's mutex (between threads), which a forked child gets anew.

An entry's ``lock`` file is flock'ed exclusively, briefly, around every write and publication;
its ``users`` file is flock'ed shared by every open cache (exclusively, without waiting, by the
one that recovers what a killed process left). A flock belongs to an open file, which a fork
shares: a forked child opens the entry's files again (``Entry._open_in_this_process``) and gets
a new mutex and no background threads here (``Entry._after_fork``: a thread of the parent may have
held the old mutex at the fork).
"""

from __future__ import annotations

import fcntl
import os
import weakref
from typing import Protocol


class Flock:
    """An exclusive flock held for a ``with`` block."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)


class Guarded(Protocol):
    """What holds a mutex (and threads) a forked child must replace."""

    def _after_fork(self) -> None: ...


_OPEN: weakref.WeakSet[Guarded] = weakref.WeakSet()


def track(guarded: Guarded) -> None:
    """Give ``guarded`` a new mutex (``_after_fork``) in every forked child while it lives."""
    _OPEN.add(guarded)


def _new_mutexes_after_fork() -> None:
    """In a forked child: a new mutex for each cache (a thread of the parent may have held one
    at the fork); each opens its own descriptors at its next use (``_open_in_this_process``)."""
    for guarded in list(_OPEN):
        guarded._after_fork()


os.register_at_fork(after_in_child=_new_mutexes_after_fork)
