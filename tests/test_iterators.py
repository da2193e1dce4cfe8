"""The epoch iterator: a stop from another thread raises EpochStoppedError, also inside a
next() that waits, and never ends the epoch as if complete; len() stays what it was. A close
waits for a busy epoch before it closes the source; torch's finished frames are released."""

from __future__ import annotations

import threading

import pytest
import torch
from threads import next_in_thread

from gpuload.epoch import when_all_idle
from gpuload.iterators import (
    EpochIterator,
    OpenEpochs,
    release_torch_frames,
)
from gpuload.loader import _close_source_and_workers
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


def test_a_close_left_to_a_busy_epoch_runs_once_it_leaves_next() -> None:
    entered, release = threading.Event(), threading.Event()
    closed, shut_down = threading.Event(), threading.Event()
    events: list[str] = []

    def items():
        yield 0
        entered.set()
        assert release.wait(10)

    iterator, work, _ = epoch_over(items())
    assert next(iterator) == 0
    thread, outcome = next_in_thread(iterator)
    assert entered.wait(10)
    open_epochs = OpenEpochs()
    open_epochs.add(iterator, work, "a new epoch")
    busy, _ = open_epochs.stop("the loader was closed", wait_s=0.01)
    assert busy == [iterator.epoch]

    class Source:
        def close(self) -> None:
            events.append("source closed")
            closed.set()

    class TorchIterator:
        def _shutdown_workers(self) -> None:
            events.append("workers shut down")
            shut_down.set()

    when_all_idle(busy, lambda: _close_source_and_workers(Source(), [TorchIterator(), None]))
    assert not closed.wait(0.2)  # the epoch is still inside next()
    release.set()
    assert shut_down.wait(10)
    thread.join(10)
    assert events == ["source closed", "workers shut down"] and isinstance(outcome[0], EpochStoppedError)


_TORCH_LIKE_CODE = """
def fetch(held):
    raise KeyError("a worker's error")

def reraise(release, held):
    try:
        fetch(held)
    except KeyError:
        try:
            raise ValueError("the loop's error")
        except ValueError as error:
            release(error)
            return error
"""


def test_releasing_torch_frames_skips_one_still_running_and_clears_the_rest() -> None:
    """torch's code that handles an error and calls gpuload's, which raises: the handling frame
    is still running (it cannot be cleared) and comes first in the error's context."""
    scope = {"__name__": "torch.utils.data._utils.fetch_like"}
    exec(_TORCH_LIKE_CODE, scope)
    error = scope["reraise"](release_torch_frames, object())
    running = error.__context__.__traceback__
    assert running.tb_frame.f_code.co_name == "reraise" and "held" in running.tb_frame.f_locals
    assert running.tb_next.tb_frame.f_code.co_name == "fetch" and running.tb_next.tb_frame.f_locals == {}


class _TwoShapes(torch.utils.data.Dataset):
    """Samples of two heights: torch's default collate cannot stack a batch of them."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.zeros(3, 4 + index % 2, 4), index


@pytest.mark.parametrize("num_workers, cache", [(0, "auto"), (0, "off"), (2, "off")])
def test_samples_of_different_shapes_get_torchs_error_and_what_to_do(num_workers: int, cache: str) -> None:
    """Before: torch's bare "stack expects each tensor to be equal size", no word on the fix."""
    import gpuload

    loader = gpuload.DataLoader(_TwoShapes(), batch_size=4, num_workers=num_workers, cache=cache)
    with pytest.raises(RuntimeError) as raised:
        next(iter(loader))
    message = str(raised.value)
    assert "stack expects each tensor to be equal size" in message
    assert "different shapes" in message and "transforms=" in message and "collate_fn" in message
    loader.close()


def test_other_errors_are_not_given_the_shape_hint() -> None:
    from gpuload.iterators import unequal_stack

    assert not unequal_stack(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not unequal_stack(ValueError("stack expects each tensor to be equal size"))  # not torch's RuntimeError
    assert unequal_stack(RuntimeError("Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback ...\n"
                                      "RuntimeError: stack expects each tensor to be equal size, but got [3, 4, 4]"))
