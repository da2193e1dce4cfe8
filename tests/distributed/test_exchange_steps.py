"""ExchangeSteps without processes: how far the steps run ahead of the loop, how an epoch stopped
early is completed (the same step on every rank), one thread at a time, and the sliced wait."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gpuload.distributed.exchange_steps import (
    RUN_AHEAD_LIMIT,
    ExchangeSteps,
    LoaderClosedError,
    wait_work,
)


class Recorder:
    """``make`` for ExchangeSteps: records the steps made and checks it holds the lock."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self.made: list[int] = []

    def __call__(self, step: int) -> int:
        assert self.lock.locked()
        self.made.append(step)
        return step


def _wait_until(condition, deadline_s: float = 5.0) -> None:
    end = time.monotonic() + deadline_s
    while not condition() and time.monotonic() < end:
        time.sleep(0.005)


def test_in_the_loop_each_step_is_made_when_asked_and_nothing_is_completed_after_a_stop():
    lock = threading.Lock()
    make = Recorder(lock)
    steps = ExchangeSteps(range(3, 9), make, lock, ahead=False, closed=lambda: False)
    assert [next(steps), next(steps)] == [3, 4]
    steps.handed_over()
    steps.handed_over()
    steps.close()
    assert make.made == [3, 4]
    assert list(steps) == []


def test_ahead_the_steps_stop_at_the_limit_past_what_the_loop_received():
    lock = threading.Lock()
    make = Recorder(lock)
    steps = ExchangeSteps(range(20), make, lock, ahead=True, closed=lambda: False)
    runner = threading.Thread(target=lambda: [None for _ in steps])
    runner.start()
    _wait_until(lambda: len(make.made) == RUN_AHEAD_LIMIT)
    time.sleep(0.05)
    assert make.made == list(range(RUN_AHEAD_LIMIT))  # waits for the loop
    steps.handed_over()
    _wait_until(lambda: len(make.made) == RUN_AHEAD_LIMIT + 1)
    assert make.made == list(range(RUN_AHEAD_LIMIT + 1))
    steps.cancel()
    runner.join(2)
    assert not runner.is_alive()


def test_a_stopped_epoch_is_completed_to_the_same_step_however_far_it_had_run():
    expected = list(range(2, 2 + 2 + RUN_AHEAD_LIMIT))  # 2 batches received, then the limit
    for pulled in (2, 3, 2 + RUN_AHEAD_LIMIT):  # the thread's progress differs from rank to rank
        lock = threading.Lock()
        make = Recorder(lock)
        steps = ExchangeSteps(range(2, 30), make, lock, ahead=True, closed=lambda: False)
        next(steps), next(steps)
        steps.handed_over()
        steps.handed_over()
        for _ in range(pulled - 2):
            next(steps)
        steps.cancel()
        steps.close()
        assert make.made == expected, pulled
        steps.close()  # idempotent
        assert make.made == expected


def test_completion_stops_at_the_epochs_end_and_not_at_all_once_closed():
    lock = threading.Lock()
    make = Recorder(lock)
    steps = ExchangeSteps(range(3), make, lock, ahead=True, closed=lambda: False)
    steps.handed_over()
    steps.close()
    assert make.made == [0, 1, 2]
    closed = ExchangeSteps(range(10), Recorder(lock), lock, ahead=True, closed=lambda: True)
    closed.close()
    assert list(closed) == []


def test_a_failed_step_ends_the_epoch_without_completing_it():
    lock = threading.Lock()

    def make(step: int) -> int:
        raise RuntimeError("peer gone")

    steps = ExchangeSteps(range(10), make, lock, ahead=True, closed=lambda: False)
    with pytest.raises(RuntimeError, match="peer gone"):
        next(steps)
    steps.close()  # nothing more is tried
    assert list(steps) == []


def test_cancel_wakes_a_thread_waiting_for_the_loop():
    lock = threading.Lock()
    steps = ExchangeSteps(range(10), Recorder(lock), lock, ahead=True, closed=lambda: False)
    for _ in range(RUN_AHEAD_LIMIT):
        next(steps)
    runner = threading.Thread(target=lambda: list(steps))
    runner.start()
    time.sleep(0.05)
    assert runner.is_alive()
    steps.cancel()
    runner.join(2)
    assert not runner.is_alive()


class FakeWork:
    """A gloo work that completes after ``delay_s`` (or never), failing with ``error``."""

    def __init__(self, delay_s: float | None, error: str | None = None) -> None:
        self.done_at = None if delay_s is None else time.monotonic() + delay_s
        self.error = error
        self.slices = 0

    def is_completed(self) -> bool:
        return self.done_at is not None and time.monotonic() >= self.done_at

    def wait(self, timeout=None) -> bool:
        if timeout is not None and not self.is_completed():
            self.slices += 1
            time.sleep(min(timeout.total_seconds(), 0.01))
            if not self.is_completed():
                raise RuntimeError("Operation timed out!")
        if self.error:
            raise RuntimeError(self.error)
        return True


def test_host_wait_in_slices_returns_when_done_and_raises_the_works_own_error():
    work = FakeWork(0.1)
    wait_work(work, True, lambda: False)
    assert work.slices > 0
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        wait_work(FakeWork(0.05, "Connection closed by peer"), True, lambda: False)


def test_a_work_done_between_a_slices_timeout_and_the_check_is_not_waited_for_again():
    """A slice's wait timed out, but the work completed before ``is_completed`` was asked: its own
    (successful) outcome, whatever the loader's state."""

    class DoneMeanwhile:
        def __init__(self) -> None:
            self.waits: list[object] = []

        def is_completed(self) -> bool:
            return True

        def wait(self, timeout=None) -> bool:
            self.waits.append(timeout)
            if timeout is not None:
                raise RuntimeError("Operation timed out!")
            return True

    work = DoneMeanwhile()
    wait_work(work, True, lambda: True)
    assert len(work.waits) == 2 and work.waits[1] is None


def test_host_wait_is_abandoned_at_the_first_slice_after_the_loader_closes():
    work = FakeWork(None)  # a peer that never joins
    with pytest.raises(LoaderClosedError, match="closed"):
        wait_work(work, True, lambda: work.slices >= 3)  # the loader closes during the third slice
    assert work.slices == 3


def test_device_wait_is_the_streams_not_the_hosts():
    calls = []

    class NcclWork:
        def wait(self, timeout=None):
            calls.append(timeout)
            return True

    wait_work(NcclWork(), False, lambda: True)
    assert calls == [None]


def test_only_gloos_exchange_runs_ahead_of_the_loop():
    """NCCL forbids two threads issuing on two communicators of one GPU at once (DDP's and ours)."""
    from gpuload.distributed.split_store import SplitStore

    store = SplitStore.__new__(SplitStore)
    store.device = torch.device("cpu")
    assert store.runs_ahead
    store.device = torch.device("cuda", 0)
    assert not store.runs_ahead
