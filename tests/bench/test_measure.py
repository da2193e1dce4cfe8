"""The benchmark's measuring code: epoch timing, wait share, byte counters, ratios, table."""

from __future__ import annotations

import dataclasses
import mmap
import time

import pytest
import torch

from gpuload.bench.measure import EpochTimes, HostPeak, count_samples, time_epochs, time_step
from gpuload.bench.report import add_ratios, format_table
from gpuload.bench.run import IDEAL_EPOCHS, run_loaders
from gpuload.bench.scenarios import BenchConfig, LoaderSpec, inmemory_loaders

CPU = torch.device("cpu")


def slow_epoch(batches: int, seconds: float):
    def epoch():
        for _ in range(batches):
            time.sleep(seconds)
            yield torch.zeros(4, 2), torch.zeros(4)

    return epoch


def test_time_epochs_separates_warm_up_and_counts() -> None:
    seen = []
    times = time_epochs(slow_epoch(3, 0.01), CPU, epochs=2, on_epoch=seen.append)
    assert seen == [0, 1, 2]
    assert len(times.wall_s) == 3 and len(times.steady_s) == 2
    assert times.batches == 3 and times.samples_per_epoch == 12
    assert all(t >= 0.03 for t in times.wall_s)
    assert times.samples_per_s == pytest.approx(12 / times.median_s)


def test_wait_share_is_the_time_not_spent_stepping() -> None:
    times = EpochTimes(wall_s=[9.0, 1.0, 1.0, 1.0], batches=10)
    assert times.wait_share(step_s=0.06) == pytest.approx(0.4)
    assert times.wait_share(step_s=0.2) == 0.0  # never negative
    assert times.median_s == 1.0 and times.spread_s == 0.0 and times.first_s == 9.0


def test_the_exposed_wait_per_step_is_the_time_inside_next_and_not_the_step() -> None:
    """Around the loop, alike for every loader: 30 ms inside next() per batch counts, the step
    (a 20 ms sleep, outside next()) does not."""
    step = lambda batch: time.sleep(0.02)  # noqa: E731
    times = time_epochs(slow_epoch(3, 0.03), CPU, epochs=1, step=step)
    assert len(times.wait_s) == 2 and all(wait <= wall for wait, wall in zip(times.wait_s, times.wall_s))
    assert times.wait_per_step_s >= 0.03
    assert all(wall - wait >= 3 * 0.02 for wait, wall in zip(times.wait_s, times.wall_s))  # the steps: not waits
    fast = time_epochs(slow_epoch(3, 0.0), CPU, epochs=1, step=step)
    assert fast.wait_per_step_s < times.wait_per_step_s


def test_wait_share_measured_with_a_real_step() -> None:
    step = lambda batch: time.sleep(0.01)  # noqa: E731
    step_s = time_step(step, None, CPU)
    assert 0.009 < step_s < 0.05
    data_bound = time_epochs(slow_epoch(4, 0.03), CPU, epochs=1, step=step)
    assert data_bound.wait_share(step_s) > 0.5


def test_count_samples_reads_the_leading_dimension() -> None:
    assert count_samples(torch.zeros(7, 3)) == 7
    assert count_samples({"image": torch.zeros(5, 1)}) == 5
    assert count_samples([torch.zeros(2), torch.zeros(2)]) == 2


def test_host_peak_reads_a_number_on_linux() -> None:
    """64 MiB of new pages raise the peak. They are mapped here, not taken from malloc: after
    the bench ran in this process (its malloc thresholds) a freed heap stays resident, and a
    bytearray reused it without the resident size growing (seen in a suite run under xdist)."""
    peak = HostPeak()
    peak.reset()
    before = peak.read()
    with mmap.mmap(-1, 64 * 2**20) as block:
        block[::4096] = b"x" * len(block[::4096])
        after = peak.read()
    assert before is None or (after is not None and after >= before + 32 * 2**20)


def test_host_peak_is_none_where_the_kernel_does_not_say(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from gpuload.bench import measure

    status = {"text": "Name:\tpython\nVmHWM:\t  2048 kB\n"}
    monkeypatch.setattr(measure, "open", lambda path, *args, **kwargs: io.StringIO(status["text"]), raising=False)
    assert HostPeak().read() == 2048 * 1024
    status["text"] = "Name:\tpython\n"  # no VmHWM line
    assert HostPeak().read() is None

    def no_proc(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise PermissionError(path)  # /proc not mounted, or not readable

    monkeypatch.setattr(measure, "open", no_proc, raising=False)
    peak = HostPeak()
    peak.reset()  # nothing to reset: no error
    assert peak.read() is None


@pytest.mark.parametrize("library", [None, "libc-gpuload-test-missing.so.6"])
def test_the_steady_allocator_is_not_applied_without_glibc(library: str | None,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes.util

    from gpuload.bench.run import steady_host_allocator

    monkeypatch.setattr(ctypes.util, "find_library", lambda name: library)
    assert steady_host_allocator() is False


def test_run_loaders_counts_bytes_per_epoch_and_ratios() -> None:
    counter = {"bytes": 0}

    def open_spec(per_batch: int):
        def open_():
            def epoch():
                for _ in range(2):
                    counter["bytes"] += per_batch
                    yield torch.zeros(3, 1)
            return epoch, lambda: counter["bytes"], lambda: None
        return open_

    specs = [LoaderSpec("base", open_spec(10), "baseline"), LoaderSpec("ideal", open_spec(0), "ideal")]
    results = run_loaders(specs, CPU, epochs=2, step=None)
    assert results[0]["h2d_bytes_per_epoch"] == 20 and results[0]["h2d_bytes_first_epoch"] == 20
    assert results[1]["h2d_bytes_per_epoch"] == 0
    assert len(results[0]["steady_epoch_s"]) == 2 and len(results[1]["steady_epoch_s"]) == IDEAL_EPOCHS
    add_ratios(results)
    assert results[0]["x_baseline"] == 1.0 and results[1]["of_ideal"] is None
    ideal_best = 2 * 3 / min(results[1]["steady_epoch_s"])  # 2 batches of 3 samples per epoch
    assert results[0]["of_ideal"] == pytest.approx(results[0]["samples_per_s"] / ideal_best)
    table = format_table(results)
    assert "base" in table and "of ideal" in table
    assert results[0]["wait_ms_per_step"] >= 0 and "wait/step" in table


def test_inmemory_scenario_lists_every_loader_and_ideal() -> None:
    config = BenchConfig(num_samples=64, batch_size=16, epochs=1, torch_workers=(0,))
    dataset, specs = inmemory_loaders(config, CPU)
    assert len(dataset) == 64
    kinds = [s.kind for s in specs]
    assert kinds[0] == "baseline" and kinds.count("ideal") == 1  # no replay without a step: it would time a list
    with_step = inmemory_loaders(dataclasses.replace(config, step="sleep"), CPU, dataset)[1]
    assert [s.name for s in with_step if s.kind == "ideal"][1] == "ideal: replay of prepared batches"
    for spec in specs:
        make_epoch, bytes_h2d, close = spec.open()
        batches = list(make_epoch())
        assert len(batches) == 4 and bytes_h2d() == 0
        close()


def test_format_details_reports_measured_tiers_and_the_model() -> None:
    from gpuload.bench.report import format_details

    tiers = {"device_samples": 6, "host_samples": 4, "source_samples": 0}
    rows = [
        {"name": "torch"},
        {"name": "gpuload part", "path": "tiered (device+host)", "cache": tiers},
    ]
    model = {"device": "cpu", "state_bytes": 2**20, "saved_activation_bytes": 3 * 2**20, "activation_peak_bytes": None}
    text = format_details(rows, model)
    assert "gpuload part: path tiered (device+host); measured: 6 samples on the device, 4 in host" in text
    assert "torch" not in text.splitlines()[0]
    assert "1.00 MiB" in text and "3.0 MiB per step" in text and "n/a on the CPU" in text
    assert format_details([{"name": "torch"}], None) == ""


def test_a_gpuload_row_gets_its_stages_from_one_traced_epoch_after_the_timed_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The timed epochs run with the timeline as the loader has it (off by default: its cost stays
    out of the rates); one more epoch, untimed, with the timeline on says where each gpuload
    loader's time goes. torch's rows and the ideal have no stages, only the wait around the loop."""
    import gpuload

    monkeypatch.delenv("GPULOAD_TIMELINE", raising=False)
    recorded: list[tuple[int, int]] = []  # (steps kept, steps recorded) as each epoch begins
    original = gpuload.DataLoader.__iter__

    def counting_iter(self):
        recorded.append((self.timeline.capacity, self.timeline.step_count))
        return original(self)

    monkeypatch.setattr(gpuload.DataLoader, "__iter__", counting_iter)
    config = BenchConfig(num_samples=96, batch_size=16, epochs=2, torch_workers=(0,))
    _, specs = inmemory_loaders(config, CPU)
    results = run_loaders(specs, CPU, config.epochs, step=None)
    rows = {r["name"]: r for r in results}
    assert rows["torch DataLoader (num_workers=0)"]["stage_ms_per_step"] is None
    assert rows["ideal: index_select on the device"]["stage_ms_per_step"] is None
    for name, tier in (("gpuload DataLoader (device cache)", "gather.device"),
                       ("gpuload DataLoader (streaming, no cache)", "gather.host")):
        stages = rows[name]["stage_ms_per_step"]
        assert stages and all(ms >= 0 for ms in stages.values()) and tier in stages, (name, stages)
        assert rows[name]["top_stage"] == max(stages, key=stages.__getitem__)
    # each loader: a warm-up and 2 timed epochs with the timeline off, then the traced epoch
    assert recorded == [(0, 0), (0, 0), (0, 0), (1000, 0)] * 2, recorded
