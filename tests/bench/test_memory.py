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


def test_model_memory_as_a_document() -> None:
    memory = measure_model_memory(SmallCnnStep(CPU), [torch.zeros(2, 3, 8, 8, dtype=torch.uint8)], CPU)
    document = memory.as_dict()
    assert document == {"device": "cpu", "state_bytes": memory.state_bytes, "activation_peak_bytes": None,
                        "saved_activation_bytes": memory.saved_activation_bytes}
    assert json.loads(json.dumps(document)) == document
