"""Training steps for the benchmark: a synthetic step of fixed duration, or a small real CNN."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpuload.bench.memory import tensor_bytes

__all__ = ["GpuSleepStep", "make_step", "SmallCnnStep"]


def _images(batch: Any) -> torch.Tensor:
    return batch["image"] if isinstance(batch, dict) else batch[0]


class GpuSleepStep:
    """``seconds`` of GPU time per step: a kernel that spins, leaving the host and PCIe free.

    ``torch.cuda._sleep`` spins for clock cycles, and the clock rises under load (GPU boost:
    cycles counted at idle clocks made steps about 5x shorter), so the spins are timed with
    CUDA events, a new one as soon as the last timing is read, and the cycles follow the latest
    timing: read once its end event is done (``query``), never waited for on the host, so a
    step adds no host sync.
    """

    PROBE_CYCLES = 10_000_000

    def __init__(self, device: torch.device, seconds: float) -> None:
        self.device, self.seconds = device, seconds
        with torch.cuda.device(device):
            probe = self._timed(self.PROBE_CYCLES)
            probe[2].synchronize()  # once, before the first step
        self.cycles = self._rescaled(*probe)
        self._pending: tuple[int, Any, Any] | None = None

    @staticmethod
    def _timed(cycles: int) -> tuple[int, Any, Any]:
        """A spin of ``cycles`` between two timing events, on the current stream."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        return cycles, start, end

    def _rescaled(self, cycles: int, start: Any, end: Any) -> int:
        """The cycles that last ``seconds`` at the clock this spin of ``cycles`` ran at."""
        elapsed_s = start.elapsed_time(end) / 1000
        return max(1, int(cycles / elapsed_s * self.seconds)) if elapsed_s > 0 else cycles

    def __call__(self, batch: Any) -> None:
        with torch.cuda.device(self.device):
            if self._pending is not None and self._pending[2].query():
                self.cycles = self._rescaled(*self._pending)
                self._pending = None
            if self._pending is None:
                self._pending = self._timed(self.cycles)
            else:
                torch.cuda._sleep(self.cycles)


class SmallCnnStep:
    """Forward and backward of a small CNN on the batch, converted to float on the device.

    ``state_bytes()`` and ``parameters()`` let the benchmark tell the model's memory apart from
    the loader's.
    """

    def __init__(self, device: torch.device) -> None:
        self.model = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
            nn.Flatten(), nn.Linear(64, 10),
        ).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def parameters(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def state_bytes(self) -> int:
        """Bytes of parameters, buffers, gradients and optimizer state, as held right now."""
        state = [value for entry in self.optimizer.state.values() for value in entry.values()
                 if isinstance(value, torch.Tensor)]
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return tensor_bytes([*self.model.parameters(), *self.model.buffers(), *grads, *state])

    def __call__(self, batch: Any) -> None:
        images = _images(batch)
        x = images.float().div_(255) if images.dtype == torch.uint8 else images.float()
        loss = self.model(x).square().mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()


def make_step(kind: str, device: torch.device, step_ms: float) -> Callable[[Any], None] | None:
    """``"none"``: no step; ``"sleep"``: ``step_ms`` of GPU (or, on CPU, idle) time; ``"cnn"``.

    On a CPU device the synthetic step sleeps, modelling a GPU step during which the host is
    free to load data; the CNN step really computes, on whichever device is used.
    """
    if kind == "none":
        return None
    if kind == "cnn":
        return SmallCnnStep(device)
    if kind != "sleep":
        raise ValueError(f"unknown step {kind!r}; use none, sleep or cnn")
    if device.type == "cuda":
        return GpuSleepStep(device, step_ms / 1000)
    return lambda batch: time.sleep(step_ms / 1000)
