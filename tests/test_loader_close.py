"""close() from another thread while a loop iterates: the loop raises EpochStoppedError, never
ends early as if complete, never hangs, and the workers end (persistent ones too)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.utils.data import Dataset

import gpuload
from gpuload.prefetch import EpochStoppedError


class Slowish(Dataset):
    """64 samples that take a few milliseconds each, so a loop is mid-epoch when close() comes."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> int:
        time.sleep(0.003)
        return index


def close_while_looping(prefetch_depth: int | None, warm: bool) -> tuple[str, int]:
    """What a loop in another thread saw when the main thread closed its loader mid-epoch."""
    before = set(torch.multiprocessing.active_children())
    loader = gpuload.DataLoader(Slowish(), batch_size=4, device="cpu", num_workers=2, persistent_workers=True,
                                prefetch_depth=prefetch_depth)
    if warm:
        assert len(list(loader)) == 16  # the persistent workers then serve the next epoch too
    outcome: list[tuple[str, int]] = []
    looping = threading.Event()

    def loop() -> None:
        got = 0
        try:
            for _ in loader:
                got += 1
                looping.set()
                time.sleep(0.005)
            outcome.append(("complete", got))
        except EpochStoppedError:
            outcome.append(("stopped", got))
        except BaseException as error:  # noqa: BLE001 - the defect: anything else (FileNotFoundError, ...)
            outcome.append((repr(error), got))

    thread = threading.Thread(target=loop)
    thread.start()
    assert looping.wait(30)
    loader.close()
    thread.join(30)
    assert not thread.is_alive(), "the loop hung after close()"
    workers = set(torch.multiprocessing.active_children()) - before
    assert not [worker for worker in workers if worker.is_alive()], "close() left workers running"
    return outcome[0]


@pytest.mark.parametrize("prefetch_depth", [None, 2])
def test_close_from_another_thread_stops_a_loop_over_persistent_workers(prefetch_depth: int | None) -> None:
    for warm in (False, True):
        kind, got = close_while_looping(prefetch_depth, warm)
        assert kind == "stopped" and got < 16, (kind, got)


@pytest.mark.slow
@pytest.mark.parametrize("prefetch_depth", [None, 2])
def test_close_from_another_thread_holds_twenty_times_in_a_row(prefetch_depth: int | None) -> None:
    outcomes = [close_while_looping(prefetch_depth, warm=trial % 2 == 1) for trial in range(20)]
    assert all(kind == "stopped" and got < 16 for kind, got in outcomes), outcomes
