"""Running a scenario's loaders one after another and collecting every metric per loader."""

from __future__ import annotations

import gc
import os
import platform
import sys
from collections.abc import Callable
from typing import Any

import torch

import gpuload
from gpuload.bench.measure import HostPeak, time_epochs, time_step, trace_epoch
from gpuload.bench.memory import LoaderDeviceMemory, ModelMemory, measure_model_memory
from gpuload.bench.scenarios import LoaderSpec
from gpuload.timeline import timeline_of

__all__ = ["run_loaders", "RunResults", "environment", "steady_host_allocator", "IDEAL_EPOCHS"]

IDEAL_EPOCHS = 5  # an ideal is timed over at least this many epochs; the report takes its best


def steady_host_allocator() -> bool:
    """Keep glibc's malloc from handing large blocks back to the OS between batches.

    By default glibc adapts its mmap threshold as blocks are freed; depending on what ran
    before (worker processes, background threads), later batch-sized allocations of the whole
    process can turn into fresh mmaps that page-fault on every batch, making every loader 3-4x
    slower in a way that depends on the order they ran in. Fixed thresholds give each loader
    the same allocator. Returns whether it applied (glibc only).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 64 * 2**20)) and bool(libc.mallopt(m_trim_threshold, 2**30))
    except (OSError, AttributeError):
        return False


class RunResults(list):
    """One result dict per loader, plus ``model_memory``: the step's model, measured once."""

    model_memory: ModelMemory | None = None


def run_loaders(
    specs: list[LoaderSpec],
    device: torch.device,
    epochs: int,
    step: Callable[[Any], None] | None,
    progress: Callable[[str, int, int], None] = lambda name, done, total: None,
) -> RunResults:
    """Time each loader for a warm-up plus ``epochs`` epochs; one result dict per loader.

    An ideal runs at least ``IDEAL_EPOCHS`` epochs (it is cheap), so that its best epoch is a
    bound a loader's median does not pass by noise alone. Bytes copied host-to-device are
    counted for the warm-up epoch (which fills a cache) and per steady epoch apart; device
    memory is the loader's own, the model's is measured once on the first loader's first batch
    and kept in ``model_memory``. A gpuload loader then runs one more epoch, untimed, with its
    timeline on: each stage's ms per step (``stage_ms_per_step``; None for other loaders).
    """
    results = RunResults()
    step_s: float | None = None
    host_peak = HostPeak()
    loader_memory = LoaderDeviceMemory(device, getattr(step, "state_bytes", lambda: 0))
    counted_step = loader_memory.around(step)
    for spec in specs:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        host_peak.reset()
        make_epoch, bytes_h2d, close = spec.open()
        try:
            if step is not None and step_s is None:
                batch = next(iter(make_epoch()))
                step_s = time_step(step, batch, device)
                results.model_memory = measure_model_memory(step, batch, device)
                del batch
            loader_memory.start()
            bytes_at_start = bytes_h2d()
            first_epoch_bytes: list[int] = []
            timed = max(epochs, IDEAL_EPOCHS) if spec.kind == "ideal" else epochs

            # on_epoch runs only inside this iteration's time_epochs: the loop variables it reads are this spec's.
            def on_epoch(epoch: int) -> None:
                if epoch == 0:
                    first_epoch_bytes.append(bytes_h2d() - bytes_at_start)  # noqa: B023
                progress(spec.name, epoch + 1, timed + 1)  # noqa: B023

            times = time_epochs(make_epoch, device, timed, counted_step, on_epoch)
            steady_bytes = (bytes_h2d() - bytes_at_start - first_epoch_bytes[0]) / max(timed, 1)
            timeline = timeline_of(make_epoch)  # a gpuload loader's: one more epoch, traced
            stage_ms = trace_epoch(make_epoch, timeline, device, step) if timeline is not None else None
        finally:
            loader_device_peak = loader_memory.read()
            close()
        results.append(
            {
                "name": spec.name,
                "kind": spec.kind,
                "first_epoch_s": times.first_s,
                "steady_epoch_s": times.steady_s,
                "median_epoch_s": times.median_s,
                "spread_s": times.spread_s,
                "samples_per_s": times.samples_per_s,
                "samples_per_epoch": times.samples_per_epoch,
                "batches_per_epoch": times.batches,
                "wait_share": times.wait_share(step_s) if step_s is not None else None,
                "wait_ms_per_step": 1e3 * times.wait_per_step_s,
                "stage_ms_per_step": stage_ms,
                "step_s": step_s,
                # A row whose loader does not count its copies carries h2d_modelled on a GPU too.
                "h2d_measured": device.type == "cuda" and "h2d_modelled" not in spec.notes,
                "h2d_bytes_first_epoch": first_epoch_bytes[0],
                "h2d_bytes_per_epoch": steady_bytes,
                "h2d_gbps": steady_bytes / times.median_s / 1e9 if times.median_s > 0 else 0.0,
                "loader_device_peak_bytes": loader_device_peak,
                "host_peak_bytes": host_peak.read(),
                **spec.notes,
            }
        )
    return results


def environment(device: torch.device) -> dict[str, Any]:
    """Versions and machine facts stored beside the numbers."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "gpuload": gpuload.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update(device_name=properties.name, device_memory_bytes=properties.total_memory)
    return info
