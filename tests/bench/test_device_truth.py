"""``benchmarks/device_truth.py``: its CPU dry run passes, and each of its verdicts fails on the
data a defect would give (the device run itself needs CUDA; ``device_check.sh`` runs it)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpuload.cache.store import StreamGuard

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def load_truth():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("device_truth", ROOT / "benchmarks" / "device_truth.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_truth"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


truth = load_truth()


# Each check's CPU dry run, each in its own process as the script runs them, and what each writes:
# tests/bench/test_device_check.py's dry run of the truth step (one run of the five checks).


def test_a_wrong_row_or_an_index_served_twice_fails_the_epoch() -> None:
    width = 4
    rows = truth.row_pattern(torch.arange(6), width)
    good = [(rows[:3], torch.arange(3)), (rows[3:], torch.arange(3, 6))]
    result = truth.Result("x", [2], "cpu")
    truth.check_epoch(result, "good", iter(good), width, 6)
    assert not result.problems
    unwritten = rows.clone()
    unwritten[4] = 0  # a row the cache never wrote
    truth.check_epoch(result, "bad", iter([(unwritten[:3], torch.arange(3)), (unwritten[3:], torch.arange(3, 6))]),
                      width, 6)
    twice = [(rows[:3], torch.arange(3)), (rows[:3], torch.arange(3))]
    truth.check_epoch(result, "twice", iter(twice), width, 6)
    assert result.problems == ["bad: 1 row(s) differ from their index's row",
                               "twice: 6 index(es) not served exactly once"]


@pytest.mark.slow
def test_a_decode_that_corrupts_pixels_fails_the_nvjpeg_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What defect 1 does to an image (the poison written over part of it), made by a stand-in
    decoder: the check sees it against the CPU decode."""
    import gpuload.decode._nvjpeg as nvjpeg

    real = nvjpeg._torchvision_decode

    def overwritten(encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        images = real(encoded, device)
        images[0][:, :32, :32] = truth.POISON
        return images

    monkeypatch.setattr(nvjpeg, "_torchvision_decode", overwritten)
    result = truth.check_nvjpeg_stall(CPU, tmp_path)
    assert any("off the CPU decode" in problem for problem in result.problems), result.problems
    assert result.details["worst_max_abs_diff"] > truth.NVJPEG_MAX_TOL


class FakeStream:
    """A stand-in ``torch.cuda.Stream``: equal to another with the same handle, and a new Python
    object from each ``current_stream()``, as torch's are; a new one gets a handle of its own."""

    handles = iter(range(1000, 2000))

    def __init__(self, device: object = None, handle: int | None = None) -> None:
        self.cuda_stream = next(self.handles) if handle is None else handle
        self.device_index, self.device = 0, torch.device("cuda", 0)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and other.cuda_stream == self.cuda_stream

    def __hash__(self) -> int:
        return hash(self.cuda_stream)

    def wait_stream(self, other: FakeStream) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def synchronize(self) -> None:
        pass


@pytest.fixture
def fake_streams(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """torch.cuda's stream calls replaced by ``FakeStream``; ``current[0]`` is the current handle."""
    current = [1]

    @contextlib.contextmanager
    def stream(chosen: FakeStream) -> Iterator[None]:
        saved, current[0] = current[0], chosen.cuda_stream
        try:
            yield
        finally:
            current[0] = saved

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(handle=current[0]))
    return current


def test_the_guard_count_is_the_streams_a_replacement_waits_for(fake_streams: list[int]) -> None:
    guard = StreamGuard(torch.device("cuda", 0))
    for handle in (1, 2, 3):  # three streams, each used once
        fake_streams[0] = handle
        guard.use()
    assert truth.guard_entries(guard, torch.device("cuda", 0)) == 3
    assert truth.guard_entries(guard, CPU) == 0  # inert off CUDA
    assert FakeStream.wait_stream is not None and "counting" not in FakeStream.wait_stream.__qualname__  # restored


def test_a_shrink_that_raises_out_of_memory_fails_the_column_check(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """What defect 5 does (the kept rows' copy needs memory exactly when it is short), forced."""
    import gpuload

    def no_room(self: gpuload.DataLoader, max_device_bytes: int) -> int:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 MiB")

    monkeypatch.setattr(gpuload.DataLoader, "shrink_cache", no_room)
    result = truth.check_column_oom(CPU, tmp_path)
    assert any(p.startswith("shrink_cache(") and "raised: CUDA out of memory" in p for p in result.problems)
    assert result.details["freed"] == -1


def test_rows_a_shrink_leaves_wrong_fail_the_array_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What defect 2 does (a gather reading the new, smaller tier with the old slots), as a shrink
    that overwrites rows the next batches serve (on a CPU the arrays are served in place)."""
    import gpuload

    def overwriting(self: gpuload.DataLoader, max_device_bytes: int) -> int:
        self.dataset.tensors[0][:64] = -1
        return 0

    monkeypatch.setattr(gpuload.DataLoader, "shrink_cache", overwriting)
    result = truth.check_array_shrink(CPU, tmp_path)
    assert result.problems and all("row(s) differ from their index's row" in p for p in result.problems), \
        result.problems


def test_more_than_a_handful_of_guard_entries_after_an_epoch_fails() -> None:
    assert truth.guard_problems({"arrays": [2, 1], "samples": [3]}, {"arrays": 64, "samples": 32}) == []
    assert truth.guard_problems({"arrays": [64]}, {"arrays": 64}) == [
        f"arrays: a StreamGuard orders after 64 streams after 64 batches "
        f"(a handful, at most {truth.HANDFUL}, expected)"]


@pytest.mark.parametrize("held, fails", [
    ([100, 60, 60, 60, 60], None),
    ([100, 60, 59, 60, 58], None),  # a few rows move as other memory does
    ([100, 60, 20, 0, 0], "drains epoch by epoch"),  # defect 6
    ([100, 100, 100, 100, 100], "did not make the cache give any back"),  # the model never entered the reserve
    ([40, 20, 20, 20, 20], "did not take the dataset"),
])
def test_the_epoch_start_shrink_verdict(held: list[int], fails: str | None) -> None:
    problems = truth.drain_problems(held, full=100)
    assert (fails is None and not problems) or (fails is not None and any(fails in p for p in problems)), problems


def test_an_oom_is_told_also_when_the_loader_raised_it_as_the_cause_of_its_own_error() -> None:
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 MiB")
        except RuntimeError as oom:
            raise RuntimeError("batch 1 failed in the prefetcher's copy stage") from oom
    except RuntimeError as error:
        assert truth.is_oom(error)
    assert not truth.is_oom(RuntimeError("CUDA error: an illegal memory access was encountered"))


def test_a_check_whose_process_writes_nothing_is_recorded_as_failed(tmp_path: Path) -> None:
    result = truth.run_isolated("array-shrink", "cpu", tmp_path, timeout=0.01)
    assert not result.passed and "ended without a result" in result.problems[0]
    assert json.loads((tmp_path / "array-shrink.json").read_text())["passed"] is False


def test_an_exception_inside_a_check_is_its_failure_with_the_traceback(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(device: torch.device, work: Path) -> None:
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setitem(truth.CHECKS, "array-shrink", broken)
    result = truth.run_one("array-shrink", CPU, tmp_path)
    assert not result.passed and result.problems == ["RuntimeError: CUDA error: device-side assert triggered"]
    assert "Traceback" in result.details["traceback"]


def test_a_check_the_step_never_reached_is_written_as_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def stopped(name: str, device: str, out: Path, timeout: float) -> None:
        raise KeyboardInterrupt  # as the step's time limit ends the script

    monkeypatch.setattr(truth, "run_isolated", stopped)
    with pytest.raises(KeyboardInterrupt):
        truth.main(["--out", str(tmp_path), "--device", "cpu", "--only", "array-shrink", "column-oom"])
    for name in ("array-shrink", "column-oom"):
        written = json.loads((tmp_path / f"{name}.json").read_text())
        assert not written["passed"] and written["problems"] == ["not run: the step ended before it"]
