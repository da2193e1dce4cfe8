"""One epoch's stop token: the first cause is what the loop is told, an ended epoch stays ended,
and what a close leaves to busy threads runs in the last one to leave, with no thread of its own."""

from __future__ import annotations

import threading
import time

import pytest
from threads import snapshot, wait_threads
from torch.utils.data import Dataset

from gpuload.epoch import Epoch, EpochStoppedError, when_all_idle


def test_the_first_stop_names_the_cause_and_sets_the_token() -> None:
    epoch = Epoch()
    epoch.raise_if_stopped(0)  # not stopped: nothing
    epoch.stop("the loader was closed")
    epoch.stop("a new epoch")
    assert epoch.stopped.is_set()
    with pytest.raises(EpochStoppedError, match=r"batch 3 .*the loader was closed"):
        epoch.raise_if_stopped(3)
    assert not epoch.end()  # stopped first: the end is not delivered


def test_a_stop_after_the_end_tells_the_loop_nothing_but_stops_the_threads() -> None:
    epoch = Epoch()
    assert epoch.end()
    epoch.stop("the loader was closed")
    epoch.raise_if_stopped(5)
    assert epoch.stopped.is_set() and epoch.cause is None


def test_what_waits_for_idle_runs_once_in_the_thread_that_leaves_last() -> None:
    first, second = Epoch(), Epoch()
    ran: list[str] = []
    inside, leave = threading.Event(), threading.Event()

    def work() -> None:
        with second.inside():
            inside.set()
            assert leave.wait(10)

    worker = threading.Thread(target=work)
    worker.start()
    assert inside.wait(10)
    assert not second.wait_idle(0.01) and first.wait_idle(0)
    when_all_idle([first, second], lambda: ran.append(threading.current_thread().name))
    assert ran == []  # second is still worked in
    leave.set()
    worker.join(10)
    assert ran == [worker.name]
    when_all_idle([], lambda: ran.append("none busy"))
    assert ran == [worker.name, "none busy"]


class _SlowFirst(Dataset):
    """Its first sample takes 1.5 s: a thread is inside the source when close() comes."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> int:
        if index == 0:
            time.sleep(1.5)
        return index


def test_close_leaves_a_busy_epoch_to_its_last_thread_with_no_thread_of_its_own(monkeypatch) -> None:
    """Before: a 'gpuload-close' thread polled every 50 ms for the prefetcher's thread to leave."""
    import gpuload.loader
    from gpuload.prefetch import Prefetcher

    class QuickToGiveUp(Prefetcher):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, join_timeout=0.1, **kwargs)

    monkeypatch.setattr(gpuload.loader, "Prefetcher", QuickToGiveUp)
    baseline = snapshot()
    loader = gpuload.DataLoader(_SlowFirst(), batch_size=4, device="cpu", num_workers=1, prefetch_depth=1)
    iterator = iter(loader)  # its thread is inside torch's next(), waiting 1.5 s for batch 0
    with pytest.warns(RuntimeWarning, match="did not stop"):
        loader.close()
    assert "gpuload-close" not in [thread.name for thread in threading.enumerate()]
    with pytest.raises(EpochStoppedError, match="the loader was closed"):
        next(iterator)
    del iterator
    assert not wait_threads(baseline, deadline_s=15)  # the prefetcher's thread shut the workers down and ended
