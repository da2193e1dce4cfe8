"""The benchmark's memory attribution: the model's bytes apart from the loader's."""

from __future__ import annotations

import json
import time

import pytest
import torch

from gpuload.bench.memory import LoaderDeviceMemory, measure_model_memory, tensor_bytes
from gpuload.bench.steps import SmallCnnStep

CPU = torch.device("cpu")


def test_tensor_bytes_counts_each_storage_once() -> None:
    block = torch.zeros(1000, dtype=torch.float32)
    assert tensor_bytes([block, block[:10], block.view(10, 100)]) == 4000
    assert tensor_bytes([block, torch.zeros(5, dtype=torch.int64)]) == 4040
    assert tensor_bytes([]) == 0


def test_model_memory_of_the_cnn_step_on_cpu() -> None:
    step = SmallCnnStep(CPU)
    parameter_bytes = tensor_bytes(step.parameters())
    batch = [torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8), torch.zeros(8)]
    memory = measure_model_memory(step, batch, CPU)
    # After a step: parameters, their gradients and SGD's momentum buffers, no more.
    assert memory.state_bytes == 3 * parameter_bytes
    # Saved for backward: at least the float input and the first conv's output (8x32x16x16).
    assert memory.saved_activation_bytes >= 4 * (8 * 3 * 16 * 16 + 8 * 32 * 16 * 16)
    assert memory.activation_peak_bytes is None and memory.device == "cpu"


def test_model_memory_needs_a_step_with_a_model() -> None:
    assert measure_model_memory(lambda batch: None, None, CPU) is None


def test_loader_device_memory_is_not_measured_on_cpu() -> None:
    memory = LoaderDeviceMemory(CPU)
    step = lambda batch: None  # noqa: E731
    memory.start()
    assert memory.around(step) is step and memory.around(None) is None
    assert memory.read() is None


@pytest.mark.gpu
def test_loader_device_memory_leaves_the_steps_activations_out() -> None:
    device = torch.device("cuda")
    model_state = torch.zeros(2**20, dtype=torch.uint8, device=device)  # 1 MiB "parameters"
    memory = LoaderDeviceMemory(device, lambda: tensor_bytes([model_state]))

    def step(batch: torch.Tensor) -> None:
        activations = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
        activations.fill_(1)

    counted = memory.around(step)
    memory.start()
    held = []
    for _ in range(3):
        held.append(torch.empty(4 * 2**20, dtype=torch.uint8, device=device))  # the loader's batches
        counted(held[-1])
    peak = memory.read()
    assert 12 * 2**20 <= peak < 16 * 2**20


@pytest.mark.gpu
def test_model_memory_on_the_device_has_an_activation_peak() -> None:
    device = torch.device("cuda")
    step = SmallCnnStep(device)
    batch = [torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8, device=device)]
    memory = measure_model_memory(step, batch, device)
    assert memory.activation_peak_bytes >= memory.saved_activation_bytes // 2 > 0
    assert memory.state_bytes == 3 * tensor_bytes(step.parameters())


def test_the_steps_a_benchmark_can_take() -> None:
    from gpuload.bench.steps import make_step

    assert make_step("none", CPU, 5.0) is None
    assert isinstance(make_step("cnn", CPU, 5.0), SmallCnnStep)
    sleep = make_step("sleep", CPU, 30.0)
    started = time.perf_counter()
    sleep(None)
    assert time.perf_counter() - started >= 0.03
    with pytest.raises(ValueError, match="^unknown step 'train'; use none, sleep or cnn$"):
        make_step("train", CPU, 5.0)


class _ClockedGpu:
    """Stand-ins for ``torch.cuda._sleep`` and timing events on one stream: a spin of ``c``
    cycles lasts ``c / rate`` seconds of GPU time; ``rate`` rises when the clock boosts. The
    GPU runs ``lag`` spins behind the host (an event is done once that many spins follow it)."""

    def __init__(self, rate: float, lag: int = 0) -> None:
        self.rate, self.lag = rate, lag
        self.now = 0.0  # GPU time at the end of the last spin queued
        self.spins: list[float] = []  # each spin's duration
        self.host_waits = 0
        gpu = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.at, self.spins_before = None, 0

            def record(self, stream=None) -> None:
                self.at, self.spins_before = gpu.now, len(gpu.spins)

            def query(self) -> bool:
                return len(gpu.spins) - self.spins_before >= gpu.lag

            def synchronize(self) -> None:
                gpu.host_waits += 1

            def elapsed_time(self, end: Event) -> float:
                return (end.at - self.at) * 1000

        self.Event = Event

    def sleep(self, cycles: int) -> None:
        self.spins.append(cycles / self.rate)
        self.now += cycles / self.rate


def test_the_gpu_sleep_step_follows_the_clock_when_it_boosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibrated at an idle clock, the spin would last a fifth of the step once the clock runs
    5x faster; timed with events each step, the spins are back to the step's length within a
    few steps, and no step waits for the GPU on the host."""
    import contextlib

    from gpuload.bench.steps import make_step

    gpu = _ClockedGpu(rate=1e9, lag=2)
    monkeypatch.setattr(torch.cuda, "_sleep", gpu.sleep)
    monkeypatch.setattr(torch.cuda, "Event", gpu.Event)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    step = make_step("sleep", torch.device("cuda", 0), 10.0)
    gpu.rate = 5e9  # boost
    for _ in range(20):
        step(None)
    assert gpu.spins[1] == pytest.approx(0.002)  # the idle calibration: a fifth of the step
    assert all(spin == pytest.approx(0.010, rel=1e-3) for spin in gpu.spins[-10:])
    assert gpu.host_waits == 1  # the probe's, before any step


def test_model_memory_as_a_document() -> None:
    memory = measure_model_memory(SmallCnnStep(CPU), [torch.zeros(2, 3, 8, 8, dtype=torch.uint8)], CPU)
    document = memory.as_dict()
    assert document == {"device": "cpu", "state_bytes": memory.state_bytes, "activation_peak_bytes": None,
                        "saved_activation_bytes": memory.saved_activation_bytes}
    assert json.loads(json.dumps(document)) == document
