"""Waiting for threads a test started to end (shared by tests): only threads new since a
snapshot count, since threads of earlier tests may end meanwhile."""

from __future__ import annotations

import threading
import time


def snapshot() -> set[threading.Thread]:
    return set(threading.enumerate())


def wait_threads(baseline: set[threading.Thread], deadline_s: float = 5.0) -> set[threading.Thread]:
    """The threads started since ``baseline`` still alive after waiting up to ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while set(threading.enumerate()) - baseline and time.monotonic() < end:
        time.sleep(0.01)
    return set(threading.enumerate()) - baseline


def next_in_thread(iterator) -> tuple[threading.Thread, list[BaseException]]:
    """A started thread calling ``next(iterator)`` once, and the list that gets what it raises."""
    raised: list[BaseException] = []

    def call_next() -> None:
        try:
            next(iterator)
        except BaseException as error:  # noqa: BLE001 - the test looks at what it was
            raised.append(error)

    thread = threading.Thread(target=call_next)
    thread.start()
    return thread, raised
