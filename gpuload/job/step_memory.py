"""A training step's peak device memory, estimated without running it on a GPU.

Under ``FakeTensorMode`` tensors carry shapes, dtypes and devices but no storage, so a step
runs in about the same time whatever its batch size and allocates nothing. torch's
``MemTracker`` (``torch.distributed._tools.mem_tracker``) watches every storage the step
creates and keeps the peak, by kind: parameters, buffers, gradients, optimizer state,
activations, temporaries, inputs. Two steps run; the second is traced: it runs beside the
optimizer state made by the first, the steady state of a training job. A tracer keeps its fake
model and optimizer in that state, so a later batch size runs only the traced step.

The peak as a function of batch size is ``fixed + per_sample * b``, fitted through the two
largest traced batch sizes. A small batch may peak in the optimizer step instead (its
temporaries do not grow with the batch): ``floor`` keeps that.

Without CUDA, fake CUDA tensors cannot run ``backward()`` (autograd asks the driver for a
context; pytorch issue 92627), so the step is traced on fake CPU tensors with the optimizer's
``foreach`` path forced, as CUDA would choose it. The CUDA allocator's 512-byte rounding is then
not applied: less than 512 bytes per live tensor.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from gpuload.cache.budget import format_bytes
from gpuload.device import cuda_available, resolve_device

__all__ = ["StepTrace", "StepMemory", "StepTracer", "OptimizerSpec", "estimate_step_memory", "DEFAULT_TRACE_SIZES"]

OptimizerSpec = str | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | torch.optim.Optimizer | None
DEFAULT_TRACE_SIZES = (8, 64)
_OPTIMIZERS: dict[str, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params),
    "adam": lambda params: torch.optim.Adam(params),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}
_KINDS = {  # MemTracker's reference types -> the words a plan prints
    "Parameter": "parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Optstate": "optimizer state",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "inputs",
    "Total": "total",
}
STATE_KINDS = ("parameters", "buffers", "gradients", "optimizer state")


@dataclass(frozen=True)
class StepTrace:
    """One traced batch size: the step's peak bytes, what was live at the peak, and the
    model's state (``STATE_KINDS``) after the optimizer step, each kind counted once."""

    batch_size: int
    peak: int
    at_peak: dict[str, int]
    state: dict[str, int]
    seconds: float


@dataclass(frozen=True)
class StepMemory:
    """A step's peak bytes as a function of batch size: ``max(fixed + per_sample * b, floor)``."""

    traces: tuple[StepTrace, ...]
    fixed: float
    per_sample: float
    floor: int
    device: str
    notes: tuple[str, ...] = field(default=())

    @classmethod
    def fit(cls, traces: Iterable[StepTrace], device: str, notes: tuple[str, ...] = ()) -> StepMemory:
        """The line through the two largest traced batch sizes, and the floor below it."""
        by_size = {trace.batch_size: trace for trace in traces}
        points = tuple(by_size[b] for b in sorted(by_size))
        if len(points) < 2:
            raise ValueError("fitting a step's memory needs traces at two or more batch sizes")
        low, high = points[-2], points[-1]
        per_sample = max(0.0, (high.peak - low.peak) / (high.batch_size - low.batch_size))
        fixed = high.peak - per_sample * high.batch_size
        above = [p.peak for p in points if p.peak > fixed + per_sample * p.batch_size]
        return cls(points, fixed, per_sample, max(above, default=0), device, notes)

    def peak(self, batch_size: int) -> int:
        """Estimated peak bytes of one step at ``batch_size``."""
        return max(math.ceil(self._line(batch_size)), self.floor)

    def _line(self, batch_size: int) -> float:
        return self.fixed + self.per_sample * batch_size

    @property
    def state(self) -> dict[str, int]:
        """Parameters, buffers, gradients and optimizer state, as traced (batch-independent)."""
        return self.traces[-1].state

    @property
    def state_bytes(self) -> int:
        return sum(self.state.values())

    @property
    def seconds(self) -> float:
        """Time spent tracing, all batch sizes together."""
        return sum(trace.seconds for trace in self.traces)

    @property
    def residual(self) -> float:
        """Largest relative gap between a traced peak and the fitted function."""
        return max(abs(self.peak(t.batch_size) - t.peak) / t.peak for t in self.traces if t.peak)

    def describe(self) -> str:
        """The fitted function, the model state and how it was traced."""
        state = ", ".join(f"{kind} {format_bytes(self.state.get(kind, 0))}" for kind in STATE_KINDS)
        traced = ", ".join(f"{t.batch_size}: {format_bytes(t.peak)}" for t in self.traces)
        floor_shows = self.floor > 1.05 * self._line(self.traces[0].batch_size)
        return "\n".join([
            f"step peak(batch) = {format_bytes(max(0.0, self.fixed))} + batch x {format_bytes(self.per_sample)}"
            + (f" (at least {format_bytes(self.floor)})" if floor_shows else ""),
            f"  model state: {state}",
            f"  traced on fake {self.device} tensors at batch {traced} ({self.seconds:.1f} s"
            + (f"; the line fits each within {100 * self.residual:.1f}%)" if len(self.traces) > 2 else ")"),
            *(f"  note: {note}" for note in self.notes),
        ])

    __str__ = describe


def _whole_step_tracker(tracker: type) -> type:
    """torch's ``MemTracker`` keeping the peak of the whole step only, which is all a plan reads.

    After every operation ``MemTracker`` also updates the peak of each module running it, looping
    over every module it has seen: for ResNet-50, about half of a trace's time. The step's peak,
    and the snapshot at it, are kept as ``MemTracker`` keeps them (where its internals are not as
    this expects, its own update runs)."""

    class WholeStepTracker(tracker):
        def _update_peak_stats(self, peak_state: Any) -> None:
            try:
                current, peaks, at_peak = self._curr_mem_snap, self._peak_mem, self._peak_mem_snap
                totals = {device: snapshot["Total"] for device, snapshot in current.items()}
            except (AttributeError, KeyError):
                return super()._update_peak_stats(peak_state)
            for device, total in totals.items():
                if peaks.get(device, 0) < total:
                    peaks[device] = total
                    at_peak[device] = copy.deepcopy(current[device])

    return WholeStepTracker


def _trace_device() -> torch.device:
    """Fake CUDA when this machine has CUDA (backward needs its context), else fake CPU."""
    if cuda_available():
        device = resolve_device(None)
        torch.empty(1, device=device)  # creates the context autograd asks for (pytorch issue 92627)
        return device
    return torch.device("cpu")


def _fake_module(
    model: nn.Module | Callable[[], nn.Module], mode: Any, device: torch.device
) -> tuple[nn.Module, dict[int, torch.Tensor]]:
    """A copy of ``model`` whose parameters and buffers are fake tensors on ``device``, and the
    map from each real parameter's id to its fake one. A factory is called under the fake mode,
    so even a model larger than this machine's memory is never built for real."""
    built_here = not isinstance(model, nn.Module)
    if not isinstance(model, nn.Module):
        with mode:
            model = model()
        if not isinstance(model, nn.Module):
            raise TypeError(f"the model factory returned a {type(model).__name__}, not a torch.nn.Module")
    memo: dict[int, Any] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        fake = tensor.detach() if built_here else mode.from_tensor(tensor.detach())
        with mode:
            fake = fake.to(device)
        if isinstance(tensor, nn.Parameter):
            fake = nn.Parameter(fake, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = fake
    fakes = {} if built_here else dict(memo)  # deepcopy adds its own entries to memo
    return copy.deepcopy(model, memo).train(), fakes  # deepcopy takes the fakes from memo: no real bytes copied


def _fake_optimizer(
    spec: OptimizerSpec, model: nn.Module, fakes: dict[int, torch.Tensor], device: torch.device
) -> torch.optim.Optimizer | None:
    if spec is None:
        return None
    if isinstance(spec, torch.optim.Optimizer):
        if not fakes:
            raise TypeError("an optimizer instance needs the model instance it was built for, not a factory")
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [fakes[id(p)] for p in group["params"]]}
            for group in spec.param_groups
        ]
        optimizer_type: Any = type(spec)  # a subclass, built as its users build it: from param groups
        optimizer = optimizer_type(groups)
    elif isinstance(spec, str):
        if spec.lower() not in _OPTIMIZERS:
            raise ValueError(f"optimizer {spec!r} is not one of {', '.join(_OPTIMIZERS)}; or pass an optimizer class")
        optimizer = _OPTIMIZERS[spec.lower()](model.parameters())
    elif callable(spec):
        optimizer = spec(model.parameters())
    else:
        raise TypeError(f"optimizer={spec!r}: give a name ({', '.join(_OPTIMIZERS)}), an optimizer class or instance")
    if device.type == "cpu":  # CUDA's default: one foreach kernel over all parameters, with its temporaries
        for group in optimizer.param_groups:
            if group.get("foreach", False) is None and not group.get("fused"):
                group["foreach"] = True
    return optimizer


def _default_loss(output: Any) -> torch.Tensor:
    """The mean of each floating output, summed: a scalar whose backward reaches every output."""
    leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise ValueError("the model's output holds no floating-point tensor to take a loss of; pass loss_fn")
    return sum((t.mean() for t in leaves[1:]), leaves[0].mean())


def _kinds(snapshot: dict[Any, dict[Any, int]], device: torch.device) -> dict[str, int]:
    """One device type's bytes by kind, from a MemTracker snapshot."""
    kinds: dict[str, int] = {}
    for dev, parts in snapshot.items():
        if torch.device(dev).type != device.type:
            continue
        for key, nbytes in parts.items():
            name = _KINDS.get(getattr(key, "value", key), str(key))
            kinds[name] = kinds.get(name, 0) + int(nbytes)
    return kinds


class StepTracer:
    """Traces the training step of one model, input and optimizer at any batch size.

    ``sample`` is one sample as the model takes it, without the batch dimension: a tensor, a
    tuple of tensors (passed positionally) or a dict (passed as keywords); only its shapes and
    dtypes are used. ``loss_fn(output)`` returns the scalar to backpropagate (default: the mean
    of each floating output); it runs under the fake mode, so it may make targets with
    ``torch.zeros(..., device=output.device)``. ``autocast`` (``torch.bfloat16`` or
    ``torch.float16``) runs the forward and the loss under ``torch.autocast``, as a mixed
    precision loop does (off CUDA with the CPU's autocast op list, which differs slightly).
    """

    def __init__(
        self,
        model: nn.Module | Callable[[], nn.Module],
        sample: Any,
        *,
        optimizer: OptimizerSpec = None,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        autocast: torch.dtype | None = None,
    ) -> None:
        try:
            from torch._subclasses.fake_tensor import FakeTensorMode
            from torch.distributed._tools.mem_tracker import MemTracker
        except ImportError as error:  # a torch built without torch.distributed
            raise RuntimeError(
                f"estimating a step's memory needs torch.distributed's MemTracker, which this torch "
                f"({torch.__version__}) lacks: {error}"
            ) from None
        if not isinstance(model, nn.Module) and not callable(model):
            raise TypeError(f"model must be a torch.nn.Module or a function returning one, not {type(model).__name__}")
        if not any(isinstance(t, torch.Tensor) for t in tree_leaves(sample)):
            raise TypeError(
                "sample must be a tensor, or a tuple or dict of tensors: one sample without the batch dimension")
        self._fake_mode_type, self._tracker_type = FakeTensorMode, _whole_step_tracker(MemTracker)
        self.model, self.sample, self.optimizer, self.loss_fn = model, sample, optimizer, loss_fn or _default_loss
        if autocast not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"autocast={autocast!r}: use torch.bfloat16, torch.float16 or None")
        self.autocast = autocast
        self.device = _trace_device()
        # The fake mode, model and optimizer after a finished step (the steady state), for the next trace.
        self._steady: tuple[Any, nn.Module, torch.optim.Optimizer | None] | None = None

    def trace(self, batch_size: int) -> StepTrace:
        """Trace a training step at ``batch_size`` on fake tensors and return its peak; the first
        trace runs one untraced step before it, to make the optimizer state it runs beside."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        started = time.perf_counter()
        with warnings.catch_warnings():  # deepcopy of a fake module (nn.TransformerEncoder does one) asks for data_ptr
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            return self._trace(batch_size, started)

    def _trace(self, batch_size: int, started: float) -> StepTrace:
        steady, self._steady = self._steady, None  # kept again only once this trace's steps finish
        if steady is None:
            mode = self._fake_mode_type(allow_non_fake_inputs=True)
            model, fakes = _fake_module(self.model, mode, self.device)
            with mode:
                optimizer = _fake_optimizer(self.optimizer, model, fakes, self.device)
        else:
            mode, model, optimizer = steady
        with mode:
            batch = tree_map_only(
                torch.Tensor, lambda t: torch.empty((batch_size, *t.shape), dtype=t.dtype, device=self.device),
                self.sample,
            )
            state: dict[str, int] = {}
            if steady is None:
                self._step(model, batch, optimizer)  # untraced: it makes the optimizer state of the steady state
            tracker = self._tracker_type()
            tracker.track_external(model, *([optimizer] if optimizer is not None else []), *tree_leaves(batch))
            with tracker:
                self._step(model, batch, optimizer, after_update=lambda: state.update(
                    _kinds(tracker.get_tracker_snapshot("current"), self.device)))
            at_peak = _kinds(tracker.get_tracker_snapshot("peak"), self.device)
        self._steady = (mode, model, optimizer)
        peak = at_peak.pop("total", sum(at_peak.values()))
        state = {kind: state.get(kind, 0) for kind in STATE_KINDS}
        return StepTrace(batch_size, peak, at_peak, state, time.perf_counter() - started)

    def _step(self, model: nn.Module, batch: Any, optimizer: torch.optim.Optimizer | None,
              after_update: Callable[[], None] | None = None) -> None:
        """One training step as a loop runs it; ``after_update`` looks before the gradients go."""
        with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            output = model(**batch) if isinstance(batch, dict) else (
                model(*batch) if isinstance(batch, (tuple, list)) else model(batch))
            loss = self.loss_fn(output)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        if after_update is not None:
            after_update()
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        del output, loss  # a loop's output lives until the step ends

    def notes(self) -> tuple[str, ...]:
        """What the estimate assumed, for the printed plan."""
        notes = []
        if self.autocast is not None:
            notes.append(f"forward and loss under torch.autocast({str(self.autocast).removeprefix('torch.')})")
        if self.device.type == "cpu":
            notes.append("no CUDA here: traced on fake CPU tensors, without CUDA's 512-byte rounding")
        notes.append("cuDNN/cuBLAS workspaces are not counted: the reserve covers them")
        return tuple(notes)


def estimate_step_memory(
    model: nn.Module | Callable[[], nn.Module],
    sample: Any,
    *,
    optimizer: OptimizerSpec = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    autocast: torch.dtype | None = None,
    batch_sizes: Iterable[int] = DEFAULT_TRACE_SIZES,
) -> StepMemory:
    """Trace the step at each of ``batch_sizes`` (two or more) and fit its peak; see :class:`StepTracer`."""
    tracer = StepTracer(model, sample, optimizer=optimizer, loss_fn=loss_fn, autocast=autocast)
    return StepMemory.fit([tracer.trace(b) for b in sorted(set(batch_sizes))], tracer.device.type, tracer.notes())
