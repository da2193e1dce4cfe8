"""The epoch iterator: a stop from another thread raises EpochStoppedError, also inside a
next() that waits, and never ends the epoch as if complete; len() stays what it was."""

from __future__ import annotations

import threading

import pytest
import torch

from gpuload.iterators import EpochIterator, OpenEpochs
from gpuload.prefetch import EpochStoppedError
from gpuload.resume import Position, RandomStates
from gpuload.sources import Work
from gpuload.stats import LoaderStats


def epoch_over(items, length: int = 3) -> tuple[EpochIterator, Work, list[Position]]:
    ended: list[Position] = []
    work = Work(iter(items), lambda item: (item, 1))
    position = Position(0, RandomStates([], torch.get_rng_state()))
    return EpochIterator(work, work.items, LoaderStats(), lambda: length, position, ended.append), work, ended


@pytest.mark.parametrize("then", ["ends", "raises"])
def test_a_stop_while_next_waits_raises_epoch_stopped_not_the_end(then: str) -> None:
    entered, release = threading.Event(), threading.Event()

    def items():
        yield 0
        entered.set()
        assert release.wait(10)
        if then == "raises":  # torch's iterator torn down under it
            raise FileNotFoundError("worker shared memory gone")

    iterator, _, ended = epoch_over(items())
    assert next(iterator) == 0
    outcome: list[object] = []

    def waiting_next() -> None:
        try:
            outcome.append(next(iterator))
        except (EpochStoppedError, StopIteration, FileNotFoundError) as error:
            outcome.append(error)

    thread = threading.Thread(target=waiting_next)
    thread.start()
    assert entered.wait(10)
    iterator.stop("the loader was closed")
    assert not iterator.wait_idle(0.05)  # still inside next()
    release.set()
    assert iterator.wait_idle(10)
    thread.join(10)
    assert isinstance(outcome[0], EpochStoppedError) and "batch 1" in str(outcome[0])
    assert not ended and not iterator.position.finished and iterator.position.batches == 1
    with pytest.raises(EpochStoppedError, match="the loader was closed"):
        next(iterator)
    assert len(iterator) == 3


def test_an_ended_epoch_stays_ended_after_a_stop() -> None:
    iterator, _, ended = epoch_over([0, 1])
    assert list(iterator) == [0, 1] and len(ended) == 1
    iterator.stop("the loader was closed")
    with pytest.raises(StopIteration):
        next(iterator)


def test_open_epochs_stop_every_epoch_and_report_those_still_inside() -> None:
    open_epochs = OpenEpochs()
    first, work, _ = epoch_over([0, 1])
    open_epochs.add(first, work, "a new epoch")
    busy, torch_iterators = open_epochs.stop("closed", wait_s=1)
    assert busy == [] and torch_iterators == []
    with pytest.raises(EpochStoppedError, match="closed"):
        next(first)
    assert open_epochs.stop("again", wait_s=1) == ([], [])  # forgotten once stopped
