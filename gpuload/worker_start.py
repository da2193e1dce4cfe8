"""Starting torch's worker processes so that a forked worker never collects its parent's garbage.

A worker forked from a process inherits that process's unreachable objects, and its first
garbage collection destroys them there. Some cannot be destroyed in a copy: a released gloo
process group (a distributed cache's exchange groups, destroyed but not yet collected) waits in
its destructor for threads that exist only in the parent, so the worker hung for good and the
ranks waiting on it timed out (a rank reading its share of a ``cache_scope='node'`` cache with
forked workers: 2 runs in 3 at load 9, every run started from a git worktree). Python's
documented remedy (:func:`gc.freeze`) is applied while the workers start: what the parent holds
then is left out of every worker's collections, and given back to the parent's as soon as they
are started.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["start_workers"]

T = TypeVar("T")

_lock = threading.Lock()
_starting = 0  # threads inside start_workers: the heap stays frozen until the last one leaves
_froze = False  # whether the first of them froze it (not when the user had frozen it already)


def start_workers(start: Callable[..., T], *args: Any) -> T:
    """``start(*args)`` (``iter()`` of a torch DataLoader, which forks or spawns its workers) with
    this process's objects frozen out of the workers' garbage collection (see the module). A
    heap the user froze (their own :func:`gc.freeze` before forking) is left as they made it."""
    global _starting, _froze
    with _lock:
        if _starting == 0:
            _froze = gc.get_freeze_count() == 0
            if _froze:
                gc.freeze()
        _starting += 1
    try:
        return start(*args)
    finally:
        with _lock:
            _starting -= 1
            if _starting == 0 and _froze:
                gc.unfreeze()
