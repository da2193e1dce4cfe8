"""The Source contract: which thread runs an epoch's work is decided in one place."""

from __future__ import annotations

import pytest
import torch

from gpuload.sources import Schedule, ahead_on_device, runs_ahead

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)  # a device object needs no GPU


def schedule(**flags) -> Schedule:
    return Schedule(lambda ahead: pytest.fail("not started here"), **flags)


@pytest.mark.parametrize(("flags", "device", "depth", "ahead"), [
    ({}, CUDA, None, True),  # on a GPU the work overlaps the loop's compute
    ({}, CPU, None, False),  # on a CPU only where the schedule says so ...
    ({"ahead_on_cpu": True}, CPU, None, True),
    ({}, CPU, 2, True),  # ... or where prefetch_depth asks for it
    ({}, CUDA, 0, False),  # prefetch_depth=0: always in the loop's thread
    ({"ahead_on_cpu": True}, CPU, 0, False),
    ({"ahead": False}, CUDA, 4, False),  # nothing to run ahead (served in place, a stateful stream)
])
def test_runs_ahead_decides_from_the_schedule_the_device_and_prefetch_depth(flags, device, depth, ahead) -> None:
    assert runs_ahead(schedule(**flags), device, depth) is ahead


def test_batch_sized_transforms_run_ahead_only_on_a_gpu() -> None:
    assert ahead_on_device(True, CUDA) and not ahead_on_device(True, CPU) and not ahead_on_device(False, CUDA)
