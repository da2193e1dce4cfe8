"""Device memory in a benchmark run: the loader's share apart from the model's.

torch's caching allocator counts every byte the process allocates on a device, whoever asked.
The model's share is read from its own tensors (parameters, gradients, optimizer state) and
from one step run on its own (the activations autograd saves, and on a GPU the allocator's
peak during the step); the loader's share is the allocator's peak outside training steps,
less the model's state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, Protocol, cast

import torch

from gpuload.bench.measure import synchronize

__all__ = ["ModelMemory", "LoaderDeviceMemory", "tensor_bytes", "measure_model_memory"]


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each storage counted once (views share one)."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class ModelMemory:
    """Memory the training step's model takes, measured on the device it runs on.

    ``state_bytes``: parameters, buffers, gradients and optimizer state, held for the whole run.
    ``saved_activation_bytes``: tensors autograd saved for backward in one step (any device).
    ``activation_peak_bytes``: the allocator's peak during one step above what was allocated
    before it (activations, rebuilt gradients, workspaces); None on a CPU, which has no
    device allocator to ask.
    """

    device: str
    state_bytes: int
    saved_activation_bytes: int
    activation_peak_bytes: int | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _ModelStep(Protocol):
    """A training step with a model (``gpuload.bench.steps.SmallCnnStep``)."""

    def parameters(self) -> Iterable[torch.Tensor]: ...


def measure_model_memory(step: Callable[[Any], None], batch: Any, device: torch.device) -> ModelMemory | None:
    """The model's memory for a step with a model (``step.state_bytes``), else None.

    Runs the step once more on ``batch``, with autograd's saved-tensor hooks counting what the
    forward pass keeps for backward (the parameters themselves are not counted twice).
    """
    state_bytes = getattr(step, "state_bytes", None)
    if state_bytes is None:
        return None
    model = cast(_ModelStep, step)  # a step with state_bytes is a model's (gpuload.bench.steps)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step(batch)
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
    return ModelMemory(str(device), state_bytes(), sum(saved.values()), peak)


class LoaderDeviceMemory:
    """Peak device memory a loader takes, the model's excluded; every reading is None on a CPU.

    The allocator's peak is sampled when each step starts and reset when it returns, so the
    peak seen covers the loader's work between steps (its cache tier, batches in flight, the
    batch the step gets) and never a step's activations; the model's state is taken off.
    """

    def __init__(self, device: torch.device, model_state: Callable[[], int] = lambda: 0) -> None:
        self.device, self.model_state = device, model_state
        self._cuda = device.type == "cuda"
        self._base = self._peak = 0

    def start(self) -> None:
        """Start counting from what is allocated now (earlier loaders' leftovers, the model)."""
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device) - self.model_state()
            self._peak = 0

    def _sample(self) -> None:
        peak = torch.cuda.max_memory_allocated(self.device) - self._base - self.model_state()
        self._peak = max(self._peak, peak)

    def around(self, step: Callable[[Any], None] | None) -> Callable[[Any], None] | None:
        """``step``, sampling the loader's peak before it and leaving the step's own peak out."""
        if step is None or not self._cuda:
            return step

        def counted(batch: Any) -> None:
            self._sample()
            step(batch)
            torch.cuda.reset_peak_memory_stats(self.device)

        return counted

    def read(self) -> int | None:
        """Peak bytes since ``start()``; None on a CPU."""
        if not self._cuda:
            return None
        self._sample()
        return max(0, self._peak)
