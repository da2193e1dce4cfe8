"""Background threads stopped before the interpreter shuts down.

A daemon thread still inside torch when Python finalizes aborts the whole process: coming back
from C++ it may not take the GIL again, and the unwinding that ends it crosses C++ code that
must not unwind ("terminate called without an active exception", SIGABRT, exit status 134).
A script that breaks out of a gpuload loop and ends without ``close()`` leaves its prefetch
thread making the next batches just then. So such a thread is started here: listed while it
runs, with how to stop it; at exit (``atexit``, before the interpreter finalizes) every listed
thread is told to stop and waited for, up to its own bound.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_running: dict[threading.Thread, tuple[Callable[[], None], float]] = {}
_lock = threading.Lock()


def start_stoppable(
    target: Callable[..., None], args: tuple[Any, ...], name: str, stop: Callable[[], None], join_timeout: float,
) -> threading.Thread:
    """Start ``target(*args)`` on a daemon thread named ``name``, listed until it returns: at
    interpreter exit ``stop()`` is called and the thread waited for up to ``join_timeout`` s.
    ``stop`` must not keep alive what the thread's owner lets go of (it is held while it runs)."""
    thread = threading.Thread(target=_run_listed, args=(target, args), name=name, daemon=True)
    with _lock:
        _running[thread] = (stop, join_timeout)
    try:
        thread.start()
    except BaseException:
        with _lock:
            _running.pop(thread, None)
        raise
    return thread


def running() -> list[threading.Thread]:
    """The listed threads that have not returned yet."""
    with _lock:
        return list(_running)


def _run_listed(target: Callable[..., None], args: tuple[Any, ...]) -> None:
    try:
        target(*args)
    finally:
        with _lock:
            _running.pop(threading.current_thread(), None)


@atexit.register
def stop_all_before_exit() -> None:
    """Stop every listed thread and wait for each (:func:`stop_and_wait`): run at interpreter exit."""
    stop_and_wait(running())


def stop_and_wait(threads: list[threading.Thread]) -> None:
    """Stop ``threads`` (those still listed) and wait for each, up to its bound counted from
    now; name on stderr any that did not end."""
    with _lock:
        listed = [(thread, _running[thread]) for thread in threads if thread in _running]
    for _, (stop, _) in listed:
        try:
            stop()
        except Exception:  # noqa: BLE001 - at exit: the others are still stopped
            pass
    began = time.monotonic()
    for thread, (_, join_timeout) in listed:
        thread.join(max(0.0, began + join_timeout - time.monotonic()))
    alive = [f"{thread.name} (waited {join_timeout:g} s)" for thread, (_, join_timeout) in listed if thread.is_alive()]
    if alive:
        sys.stderr.write(
            f"gpuload: at exit, {', '.join(alive)} did not stop (a batch still being made); the "
            "process may abort as the interpreter shuts down under it. close() the loader, or let "
            "its loop end, before the script ends\n"
        )


def _none_in_a_forked_child() -> None:
    """A forked child runs none of its parent's threads (and its lock may have been held)."""
    global _lock
    _lock = threading.Lock()
    _running.clear()


os.register_at_fork(after_in_child=_none_in_a_forked_child)
