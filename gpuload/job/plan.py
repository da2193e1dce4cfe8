"""One memory plan for the whole job: the model's step, gpuload's prefetch slots and its cache.

The card's memory, less the cache reserve (``CacheSettings``: default max(2 GiB, 10%); it
covers the CUDA context, cuDNN/cuBLAS workspaces and fragmentation), is shared by

- the training step, whose peak grows with the batch size (:mod:`gpuload.job.step_memory`);
- the prefetch slots: ``gpuload.prefetch.default_depth`` batches of the loader's bytes, in
  flight on the device while the step runs;
- the cache's device tier, placed by ``gpuload.cache.make_plan`` in what the two leave free.

The recommendation: with a fixed ``batch_size``, the cache takes what that batch leaves. Else,
when the whole dataset (or the ``cache_size`` the user set) fits beside a batch of
``batch_multiple``, the largest batch beside it; when it does not, the largest batch that fits,
and the cache takes the rest. Either way the trade-off against the other choice is printed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from gpuload.cache.budget import format_bytes, parse_size, resolve_reserve
from gpuload.cache.plan import CachePlan, make_plan
from gpuload.cache.settings import CacheSettings
from gpuload.device import MemoryInfo, cuda_available, resolve_device
from gpuload.device import device_memory as read_device_memory
from gpuload.device import host_memory as read_host_memory
from gpuload.job.dataset_size import DatasetShape, dataset_shape
from gpuload.job.step_memory import DEFAULT_TRACE_SIZES, OptimizerSpec, StepMemory, StepTrace, StepTracer
from gpuload.prefetch import default_depth

__all__ = ["JobPlan", "plan_job", "plan_from_step", "resident_bytes", "MemorySpec"]

MemorySpec = int | str | MemoryInfo | None
_LARGEST_BATCH = 1 << 20  # the search's ceiling when nothing else bounds the batch
_REFINE_ROUNDS = 3


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """The job's device memory at one batch size: step + prefetch slots + cache <= free - reserve.

    ``batch_size`` is the recommendation (or the user's fixed one); ``fits`` is False when not
    even that batch fits beside nothing. ``step_peak(b)`` answers for any other batch size.
    """

    step: StepMemory
    device_name: str
    memory: MemoryInfo
    host: MemoryInfo
    reserve: int
    settings: CacheSettings
    dataset: DatasetShape | None
    loader_bytes_per_sample: int
    batch_size: int
    batch_fixed: bool
    batch_multiple: int
    fits: bool
    prefetch_depth: int
    cache: CachePlan | None
    tradeoff: tuple[str, ...]

    def step_peak(self, batch_size: int) -> int:
        """The step's estimated peak bytes at ``batch_size``."""
        return self.step.peak(batch_size)

    def replan(self, batch_size: int | None = None, *, dataset: Any = None, device_memory: MemorySpec = None,
               batch_multiple: int | None = None) -> JobPlan:
        """The plan for another batch size (None: recommend one), dataset or card, from the same
        step estimate: nothing is traced again. Arguments left at None keep this plan's."""
        shape = dataset_shape(dataset) if dataset is not None else self.dataset
        memory = _memory(device_memory, "device_memory")
        return plan_from_step(
            self.step, memory=memory or self.memory, settings=self.settings, dataset=shape,
            device_name=_pretended(memory) if memory is not None else self.device_name,
            loader_bytes_per_sample=self.loader_bytes_per_sample if dataset is None else None,
            batch_size=batch_size, batch_multiple=batch_multiple or self.batch_multiple, host=self.host,
        )

    @property
    def room(self) -> int:
        """Device bytes the job may use: free memory minus the reserve."""
        return max(0, self.memory.free - self.reserve)

    @property
    def step_bytes(self) -> int:
        return self.step.peak(self.batch_size)

    @property
    def batch_bytes(self) -> int:
        """Bytes of one batch as the loader delivers it."""
        return self.batch_size * self.loader_bytes_per_sample

    @property
    def prefetch_bytes(self) -> int:
        return self.prefetch_depth * self.batch_bytes

    @property
    def cache_bytes(self) -> int:
        return self.cache.device_bytes if self.cache is not None else 0

    @property
    def total_bytes(self) -> int:
        return self.step_bytes + self.prefetch_bytes + self.cache_bytes

    def describe(self) -> str:
        """The plan as a person reads it: each share of the card, then the trade-off."""
        def line(name: str, nbytes: int, detail: str = "") -> str:
            share = f"{100 * nbytes / self.memory.total:5.1f}%" if self.memory.total else "     "
            return f"  {name:<16}{format_bytes(nbytes):>12}  {share}  {detail}".rstrip()

        chosen = "your batch size" if self.batch_fixed else (
            f"largest that fits, a multiple of {self.batch_multiple}" if self.batch_multiple > 1
            else "largest that fits")
        data = self.dataset
        if data is None:
            cached = "no dataset given"
        elif self.cache is None:
            cached = "none: the batch alone does not fit"
        else:
            cached = f"{self.cache.device_samples} of {data.num_samples} samples ({_percent(self._cached_share())})"
        lines = [
            f"job plan for {self.device_name}: {format_bytes(self.memory.free)} free of "
            f"{format_bytes(self.memory.total)}",
            f"  batch size: {self.batch_size} ({chosen})" if self.fits else
            f"  batch size: {self.batch_size} does NOT fit: the step alone needs "
            f"{format_bytes(self.step_bytes + self.prefetch_bytes)} of the {format_bytes(self.room)} "
            "left after the reserve",
            line("step peak", self.step_bytes, f"{format_bytes(max(0.0, self.step.fixed))} + "
                 f"{self.batch_size} x {format_bytes(self.step.per_sample)} per sample"),
            line("prefetch slots", self.prefetch_bytes,
                 f"{self.prefetch_depth} x {format_bytes(self.batch_bytes)} batches"),
            line("cache", self.cache_bytes, cached),
            line("reserve", self.reserve,
                 f"cache_reserve={self.settings.reserve.value} ({self.settings.reserve.source})"),
            line("left", max(0, self.memory.free - self.reserve - self.total_bytes)),
            *(f"  {text}" for text in self.tradeoff),
            "  " + self.step.describe().replace("\n", "\n  "),
        ]
        return "\n".join(lines)

    __str__ = describe

    def _cached_share(self) -> float:
        if self.cache is None or not self.cache.num_samples:
            return 0.0
        return 100 * self.cache.device_samples / self.cache.num_samples


def resident_bytes(model: Any, optimizer: Any, device: torch.device) -> int:
    """Bytes that a model instance (parameters, buffers, gradients) and an optimizer instance
    (its state) already hold on ``device``: the step's estimate includes them."""
    tensors: list[torch.Tensor] = []
    if isinstance(model, nn.Module):
        for param in model.parameters():
            tensors += [param] + ([param.grad] if param.grad is not None else [])
        tensors += list(model.buffers())
    if isinstance(optimizer, torch.optim.Optimizer):
        tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if tensor.device == device and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _percent(share: float) -> str:
    """A share for people: whole percents, but never 0% or 100% for a share that is not."""
    if 0 < share < 1:
        return f"{share:.2g}%"
    return f"{min(share, 99.9):.1f}%" if 99 < share < 100 else f"{share:.0f}%"


def _pretended(memory: MemoryInfo) -> str:
    return f"a pretended {format_bytes(memory.total)} card"


def _memory(spec: MemorySpec, what: str) -> MemoryInfo | None:
    """A pretended memory pool: bytes or a size like '80GiB' (all free), or a MemoryInfo."""
    if spec is None or isinstance(spec, MemoryInfo):
        return spec
    parsed = parse_size(spec, setting=what, source="keyword")
    if parsed.kind != "bytes":
        raise ValueError(f"{what}={spec!r} must be an absolute size such as '80GiB'")
    return MemoryInfo(free=int(parsed.amount), total=int(parsed.amount))


def _largest(fits: Callable[[int], bool], multiple: int, ceiling: int) -> int:
    """The largest multiple of ``multiple`` up to ``ceiling`` for which ``fits`` holds, else 0.

    A binary search: ``fits`` is monotone but for the prefetch depth's steps (4, 3, then 2 slots
    as batches grow), so the answer always fits, and at worst a few samples more would too."""
    low, high = 0, ceiling // multiple
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle * multiple):
            low = middle
        else:
            high = middle - 1
    return low * multiple


def plan_from_step(
    step: StepMemory,
    *,
    memory: MemoryInfo,
    device_name: str = "the device",
    settings: CacheSettings | None = None,
    dataset: DatasetShape | None = None,
    loader_bytes_per_sample: int | None = None,
    batch_size: int | None = None,
    batch_multiple: int = 8,
    host: MemoryInfo | None = None,
    device: torch.device | None = None,
) -> JobPlan:
    """The plan for a step already estimated: pure arithmetic, for any pretended card.

    ``loader_bytes_per_sample`` is what one sample weighs in the loader's batches (default: the
    dataset's bytes per sample). The cache's budget comes from ``settings`` exactly as a loader
    would resolve it (``CacheSettings.device_room``) on the memory the step and the prefetch
    slots leave free; ``make_plan`` places it.
    """
    settings = settings or CacheSettings.resolve()
    host = host or read_host_memory()
    if batch_multiple < 1:
        raise ValueError(f"batch_multiple must be at least 1, got {batch_multiple}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    per_sample = loader_bytes_per_sample or (dataset.bytes_per_sample if dataset is not None else 0)
    reserve = resolve_reserve(settings.reserve_spec, memory, source=settings.reserve.source, device_name=device_name)
    room = max(0, memory.free - reserve)
    host_limit = host.free // 16  # default_depth's own cap on the pinned ring

    def depth(b: int) -> int:
        return default_depth(b * per_sample, host_limit) if per_sample else 0

    def job_bytes(b: int) -> int:  # the step and the prefetch slots, without the cache
        return step.peak(b) + depth(b) * b * per_sample

    def cache_beside(b: int) -> CachePlan | None:
        if dataset is None:
            return None
        free_after = max(0, memory.free - job_bytes(b))
        seen = MemoryInfo(free=free_after, total=memory.total)
        budget = settings.device_room(device or torch.device("cuda", 0), seen) if settings.off_reason() is None else 0
        return make_plan(dataset.bytes_per_sample, dataset.num_samples, free_after, host.free, budget, reserve,
                         settings.mode.value, device_total=memory.total, host_total=host.total)

    def cached(b: int) -> int:
        plan = cache_beside(b)
        return plan.device_bytes if plan is not None else 0

    ceiling = min(_LARGEST_BATCH, dataset.num_samples if dataset is not None else _LARGEST_BATCH)
    multiple = batch_multiple if ceiling >= batch_multiple else 1
    largest_alone = _largest(lambda b: job_bytes(b) <= room, multiple, ceiling)
    if largest_alone == 0 and multiple > 1:  # not even one multiple fits: any batch size that does
        multiple, largest_alone = 1, _largest(lambda b: job_bytes(b) <= room, 1, ceiling)
    if batch_size is not None:
        chosen, fits = batch_size, job_bytes(batch_size) <= room
    elif largest_alone == 0:
        chosen, fits = multiple, False
    else:
        smallest = min(multiple, largest_alone)
        wanted = cached(smallest)  # the cache as large as it can be beside the smallest batch
        whole = dataset is not None and wanted >= dataset.num_samples * dataset.bytes_per_sample
        if whole or (dataset is not None and settings.size_spec.kind in ("bytes", "fraction") and wanted):
            beside = _largest(lambda b: job_bytes(b) + wanted <= room, multiple, ceiling)
            chosen = beside if beside >= smallest else smallest
        else:
            chosen = largest_alone
        fits = True
    cache = cache_beside(chosen) if fits else None
    plan = JobPlan(
        step=step, device_name=device_name, memory=memory, host=host, reserve=reserve, settings=settings,
        dataset=dataset, loader_bytes_per_sample=per_sample, batch_size=chosen, batch_fixed=batch_size is not None,
        batch_multiple=multiple, fits=fits, prefetch_depth=depth(chosen), cache=cache, tradeoff=(),
    )
    return _with_tradeoff(plan, largest_alone, job_bytes, cache_beside, room)


def _with_tradeoff(
    plan: JobPlan, largest_alone: int, job_bytes: Callable[[int], int],
    cache_beside: Callable[[int], CachePlan | None], room: int,
) -> JobPlan:
    """The plan with one or two lines saying what the other choice would give."""
    b, data = plan.batch_size, plan.dataset
    lines: list[str] = []
    if not plan.fits:
        if largest_alone:
            lines.append(f"the largest batch that fits (with no cache) is {largest_alone}")
        else:
            lines.append(f"no batch fits: the step needs {format_bytes(job_bytes(1))} at batch 1, "
                         f"{format_bytes(room)} is left after the reserve")
    elif data is None or plan.cache is None:
        lines.append(f"batch {b} fits; the largest that fits is {largest_alone}")
    else:
        def planned(batch: int) -> CachePlan:
            cache = cache_beside(batch)
            assert cache is not None  # cache_beside plans a cache for any batch once a dataset is given
            return cache

        def off_device(cache: CachePlan) -> str:
            share = 100 * (cache.num_samples - cache.device_samples) / cache.num_samples
            where = "on the host" if cache.source_samples == 0 else "off the device"
            return f"{_percent(share)} of the data {where}"

        if plan.cache.device_samples == data.num_samples:
            head = f"batch {b} + whole dataset cached ({format_bytes(plan.cache_bytes)})"
            bigger = min(2 * b, largest_alone)  # twice the batch, or the largest batch that fits at all
            if bigger <= b:
                multiple = f" (a multiple of {plan.batch_multiple})" if plan.batch_multiple > 1 else ""
                lines.append(f"{head}; no larger batch{multiple} fits")
            else:
                largest = " (the largest that fits)" if bigger == largest_alone else ""
                lines.append(f"{head}; batch {bigger}{largest} would leave {off_device(planned(bigger))}")
        else:
            head = f"batch {b} + {_percent(plan._cached_share())} of the data cached, {off_device(plan.cache)}"
            smaller = b // 2
            if smaller >= 1:
                other = planned(smaller)
                what = ("the whole dataset" if other.device_samples == data.num_samples
                        else f"{_percent(100 * other.device_samples / data.num_samples)} of the data")
                lines.append(f"{head}; batch {smaller} would cache {what}")
            else:
                lines.append(head)
    return dataclasses.replace(plan, tradeoff=tuple(lines))


def plan_job(
    model: nn.Module | Callable[[], nn.Module],
    sample: Any,
    *,
    optimizer: OptimizerSpec = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    autocast: torch.dtype | None = None,
    dataset: Any = None,
    device_memory: MemorySpec = None,
    cache: str | bool | CacheSettings | None = None,
    cache_size: int | float | str | None = None,
    cache_reserve: int | float | str | None = None,
    batch_size: int | None = None,
    batch_multiple: int = 8,
    host_memory: MemorySpec = None,
    trace_batch_sizes: tuple[int, ...] = DEFAULT_TRACE_SIZES,
) -> JobPlan:
    """Plan the job's device memory: the training step, gpuload's prefetch slots and cache.

    ``model`` is a module or a function returning one (called under the fake mode: never built
    for real); ``sample`` one input without the batch dimension (see
    :class:`~gpuload.job.step_memory.StepTracer`); ``optimizer`` a name (``"adamw"``, ``"adam"``,
    ``"sgd"``), an optimizer class or instance, or None for forward and backward only;
    ``autocast`` a mixed-precision dtype the forward runs under (``torch.bfloat16``).
    ``dataset`` (a map-style dataset, tensor, array, path or DatasetShape) sizes the cache and
    the prefetch slots; without it the slots hold ``sample``-sized batches and nothing is
    cached. ``device_memory`` pretends a card (``"80GiB"``, bytes or a MemoryInfo); by default
    the current CUDA device. ``cache``, ``cache_size``, ``cache_reserve`` are the DataLoader's
    settings (or pass resolved :class:`CacheSettings` as ``cache``). ``batch_size`` fixes the
    batch; else the largest multiple of ``batch_multiple`` is recommended.

    The step is traced at ``trace_batch_sizes`` (and the user's batch size), then once more at
    the recommended batch, which is lowered if that exact trace does not fit.
    """
    host = _memory(host_memory, "host_memory")
    settings = cache if isinstance(cache, CacheSettings) else CacheSettings.resolve(
        cache=cache, cache_size=cache_size, cache_reserve=cache_reserve)
    memory = _memory(device_memory, "device_memory")
    device: torch.device | None = None
    if memory is not None:
        device_name = _pretended(memory)
    elif cuda_available():
        device = resolve_device(None)
        memory, device_name = read_device_memory(device), str(device)
        already = resident_bytes(model, optimizer, device)
        if already:  # the step's estimate counts them: as free, they are not counted twice
            memory = MemoryInfo(free=min(memory.total, memory.free + already), total=memory.total)
            device_name += f" (the model's {format_bytes(already)} already there counted as free)"
    else:
        raise ValueError("no CUDA device here: pass device_memory='80GiB' (any size) to plan for a card")
    shape = dataset_shape(dataset) if dataset is not None else None
    sample_bytes = sum(t.numel() * t.element_size() for t in tree_leaves(sample) if isinstance(t, torch.Tensor))
    tracer = StepTracer(model, sample, optimizer=optimizer, loss_fn=loss_fn, autocast=autocast)
    sizes = set(trace_batch_sizes) | ({batch_size} if batch_size is not None else set())
    traces: dict[int, StepTrace] = {b: tracer.trace(b) for b in sorted(sizes)}

    def plan_now() -> JobPlan:
        step = StepMemory.fit(traces.values(), tracer.device.type, tracer.notes())
        return plan_from_step(
            step, memory=memory, device_name=device_name, settings=settings, dataset=shape,
            loader_bytes_per_sample=None if shape is not None else sample_bytes, batch_size=batch_size,
            batch_multiple=batch_multiple, host=host, device=device,
        )

    plan = plan_now()
    for _ in range(_REFINE_ROUNDS):  # the fit is a line: check the chosen batch with its own trace
        if not plan.fits or plan.batch_size in traces:
            break
        traces[plan.batch_size] = tracer.trace(plan.batch_size)
        plan = plan_now()
    return plan

