"""Opt-in: a training step that survives CUDA running out of memory by taking fewer samples.

:class:`OOMRetry` wraps the user's ``step(batch)``. When the step raises
``torch.cuda.OutOfMemoryError`` (that error only: any other error is the user's and passes
through), it lowers its batch size and runs the same batch's samples again in pieces of the new
size, in order, each sample once. Later batches are split to that size too, so the loop keeps
its loader (and its batch size) as it is.

How far it lowers: with a plan, to the largest batch whose estimated step
(``plan.step_peak(b)``, less the model state that is already resident) fits in the device
memory free after the failed step; always by at least an eighth of the failed size, so a wrong
estimate still converges in a few tries. Without a plan, by half.

Splitting a batch changes the optimization (each piece is its own step). Given the loader
(``loader=``), the wrapper also calls ``loader.set_batch_size`` with the size it settled on, so
later batches come at that size (the epoch's sample order kept) instead of being split; and,
with a plan, it frees part of the loader's device cache when the plan says so: when the cache
holds more than the plan would give it beside the new batch, or when releasing some of it lets
the new batch fit the free memory. The part that goes first is the cheapest to get back (array
rows the host tier also holds, the samples cached last), and a warning says how much went.

A loader whose data is split over ranks (``cache_scope`` node/world) is the exception: every
rank must make the same batches, and only the rank that ran out of memory retries, so its
loader keeps its batch size (and its share of the cache) and the retry splits the later batches
on that rank instead, saying so and how to lower the size on every rank together. Agreeing here
(an ``all_reduce`` at the retry) is not sound: the other ranks are not at a retry to join it.
"""

from __future__ import annotations

import collections.abc
import math
import numbers
import warnings
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch

from gpuload.cache.budget import format_bytes
from gpuload.device import device_memory
from gpuload.job.plan import JobPlan
from gpuload.transfer import map_leaves

__all__ = ["OOMRetry", "BatchSizeLoweredWarning", "BatchSplitError", "ResizableLoader"]

T = TypeVar("T")
_SAFETY = 0.9  # of the free memory the retry plans to fill: the estimate leaves out workspaces


class BatchSizeLoweredWarning(UserWarning):
    """The step ran out of device memory and now runs on smaller pieces of each batch."""


class ResizableLoader(Protocol):
    """What OOMRetry uses of a loader (``gpuload.DataLoader``)."""

    batch_size: int | None
    device_cache_bytes: int
    cache_split_over_ranks: bool

    def set_batch_size(self, batch_size: int) -> None: ...

    def shrink_cache(self, max_device_bytes: int) -> int: ...


def _first_device(batch: Any) -> torch.device | None:
    found: list[torch.device] = []

    def note(tensor: torch.Tensor) -> torch.Tensor:
        found.append(tensor.device)
        return tensor

    map_leaves(batch, note)
    return found[0] if found else None


def _free_on(device: torch.device | None) -> int | None:
    """Device bytes a retry can use now, or None off CUDA: the driver's free memory and the
    blocks torch's caching allocator holds unused, where the failed step's tensors went."""
    if device is None or device.type != "cuda":
        return None
    return device_memory(device).free_to_torch


class BatchSplitError(ValueError):
    """A batch cannot be split into pieces of samples: a part of it does not say which of its
    values belong to which sample."""


def _leading(value: Any) -> int | None:
    """The first dimension of a tensor or NumPy array with one, else None (0-d, or not an array)."""
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim > 0:
        return int(value.shape[0])
    return None


def _is_sequence(value: Any) -> bool:
    return isinstance(value, collections.abc.Sequence) and not isinstance(value, (str, bytes, bytearray))


def _samples_in(batch: Any) -> int | None:
    """The batch's number of samples: the first dimension of its first tensor (or array) that
    has one, in the order ``default_collate`` lays out fields; None when it holds none."""
    found = _leading(batch)
    if found is not None:
        return found
    values = batch.values() if isinstance(batch, collections.abc.Mapping) else batch if _is_sequence(batch) else ()
    for value in values:
        found = _samples_in(value)
        if found is not None:
            return found
    return None


def _whole(value: Any) -> bool:
    """A per-batch value that every piece gets whole: a 0-d tensor or array, a number, a string, None."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.ndim == 0
    return value is None or isinstance(value, (str, bytes, bytearray, numbers.Number))


def _fields(values: Any, total: int) -> bool:
    """True when ``values`` (a sequence's items, a mapping's values) are fields of a batch, as
    ``default_collate`` lays them out: each runs along the batch or is a per-batch value, and at
    least one runs along the batch."""
    values = list(values)
    return any(_batched(v, total) for v in values) and all(_batched(v, total) or _whole(v) for v in values)


def _batched(value: Any, total: int) -> bool:
    """True when ``value`` runs along the batch: an array of ``total`` rows, a sequence of
    ``total`` items, or a container (mapping, sequence) of fields (:func:`_fields`)."""
    leading = _leading(value)
    if leading is not None:
        return leading == total
    if isinstance(value, collections.abc.Mapping):
        return _fields(value.values(), total)
    if _is_sequence(value):
        return len(value) == total or _fields(value, total)
    return False


def _name(path: str, value: Any) -> str:
    shape = f" of shape {tuple(value.shape)}" if hasattr(value, "shape") else (
        f" of {len(value)} items" if isinstance(value, collections.abc.Sized) else "")
    return f"{path} ({type(value).__name__}{shape})"


def _piece(value: Any, start: int, stop: int, total: int, path: str) -> Any:
    """Samples ``start:stop`` of ``value``, a batch (or part of one) of ``total`` samples.

    Arrays of ``total`` rows are sliced; a sequence of ``total`` items that is not a container
    of batched fields (the list of file names ``default_collate`` makes) is sliced as well;
    mappings, namedtuples and ``default_collate``'s lists of fields are split field by field.
    Values with no batch dimension (0-d tensors, numbers, strings, None) go to every piece.
    Anything else is a :class:`BatchSplitError` naming it: handing it whole to every piece
    would pair it with the wrong samples.
    """
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim == 0:
            return value
        if value.shape[0] != total:
            raise BatchSplitError(f"{_name(path, value)} has {value.shape[0]} rows, not the batch's {total} samples")
        return value[start:stop]
    if _whole(value):
        return value
    if isinstance(value, collections.abc.Mapping):
        parts = {k: _piece(v, start, stop, total, f"{path}[{k!r}]") for k, v in value.items()}
        mapping_type: Any = type(value)  # a Mapping subclass, built from a dict as torch's collate does
        try:
            return mapping_type(parts)
        except TypeError:
            return parts
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_piece(v, start, stop, total, f"{path}.{f}") for f, v in zip(value._fields, value)))
    if _is_sequence(value):
        if _fields(value, total):
            parts_list = [_piece(v, start, stop, total, f"{path}[{i}]") for i, v in enumerate(value)]
            try:
                return type(value)(parts_list)
            except TypeError:
                return parts_list
        if len(value) == total:  # one item per sample
            return value[start:stop]
        raise BatchSplitError(f"{_name(path, value)} has {len(value)} items, not the batch's {total} samples")
    raise BatchSplitError(f"{_name(path, value)} has no batch dimension to split along")


def _split(batch: Any, start: int, stop: int, total: int) -> Any:
    try:
        return _piece(batch, start, stop, total, "batch")
    except BatchSplitError as error:
        raise BatchSplitError(
            f"OOMRetry cannot split this batch of {total} samples into smaller pieces: {error}. "
            "Give every part of the batch one entry per sample (or make a per-batch value a "
            "0-d tensor, a number or a string, which every piece gets whole)"
        ) from None


class OOMRetry(Generic[T]):
    """``step(batch)`` that lowers its batch size on a CUDA out-of-memory error and reruns the
    batch's samples in smaller pieces. Calling it returns the list of ``step``'s results, one per
    piece (one piece until the first out-of-memory error).

    ``plan``: the job's plan, whose per-sample estimate sets the new size. ``loader``: the
    ``gpuload.DataLoader`` the batches come from: its batch size follows the lowered one, and
    its device cache gives memory back when the plan says so (module docstring), unless its data
    is split over ranks (then it is left as it is, and the batches are split). ``free_bytes``:
    how much device memory a retry can use now (default: asked of the batch's CUDA device, the
    caching allocator's unused blocks included); tests pass their own.

    A batch is split sample by sample: tensors and arrays along their first dimension (the
    first one that has a first dimension gives the batch's size), lists with one item per
    sample (file names, captions) by item; 0-d tensors, numbers and strings go whole to every
    piece. A part that has no per-sample layout (a tensor of another length, say) is a
    :class:`BatchSplitError` naming it, raised when a split is needed.
    """

    def __init__(
        self,
        step: Callable[[Any], T],
        *,
        plan: JobPlan | None = None,
        min_batch_size: int = 1,
        free_bytes: Callable[[], int | None] | None = None,
        loader: ResizableLoader | None = None,
    ) -> None:
        if isinstance(min_batch_size, bool) or not isinstance(min_batch_size, numbers.Integral) \
                or min_batch_size < 1:
            raise ValueError(f"min_batch_size must be a whole number of samples, at least 1; got {min_batch_size!r}")
        if loader is not None:
            loader.set_batch_size(loader.batch_size)  # a loader that cannot change says so now, not mid-step
        self.loader: ResizableLoader | None = loader
        self.step: Callable[[Any], T] = step
        self.plan: JobPlan | None = plan
        self.min_batch_size: int = int(min_batch_size)
        self._free_bytes: Callable[[], int | None] | None = free_bytes
        self.batch_size: int | None = None  # None: whole batches, no out-of-memory error yet
        self.retries: int = 0

    def __call__(self, batch: Any) -> list[T]:
        total = _samples_in(batch)
        if total is None:
            total = len(batch) if _is_sequence(batch) else 1
        results: list[T] = []
        start = 0
        while start < total:
            size = min(total - start, self.batch_size or total)
            piece = batch if size == total else _split(batch, start, start + size, total)
            try:
                results.append(self.step(piece))
            except torch.cuda.OutOfMemoryError as error:
                failed, message = size, str(error).splitlines()[0] if str(error) else "out of memory"
            else:
                start += size
                continue
            del piece  # the failed step's tensors go with its frames: measure what is free after
            self._lower(failed, _first_device(batch), message)
        return results

    def _lower(self, failed: int, device: torch.device | None, message: str) -> None:
        if failed <= self.min_batch_size:
            raise torch.cuda.OutOfMemoryError(
                f"the step ran out of device memory at batch size {failed}, the smallest allowed "
                f"(min_batch_size={self.min_batch_size}): {message}"
            )
        lowered = failed - max(1, math.ceil(failed / 8))
        free = None
        if self.plan is None:
            lowered = failed // 2
        else:
            free = self._free_bytes() if self._free_bytes is not None else _free_on(device)
            fits = self._fits(free) if free is not None else None
            if fits is not None:
                lowered = min(lowered, fits)
        self.batch_size = max(self.min_batch_size, lowered)
        self.retries += 1
        estimate = (f"; the plan estimates {format_bytes(self.plan.step.per_sample)} per sample"
                    if self.plan is not None else "")
        loader = self.loader
        if loader is not None and loader.cache_split_over_ranks:
            estimate += (f"; the loader's batch size stays {loader.batch_size} and this rank splits its later "
                         "batches: its data is split over ranks (cache_scope), so every rank must change the "
                         "size at the same batch. To lower it everywhere, agree on the size (dist.all_reduce "
                         "with ReduceOp.MIN, made by every rank at the same step) and call "
                         "loader.set_batch_size(n) on every rank (README: Multi-GPU and multi-node)")
        else:
            freed = self._free_cache(free)
            if freed:
                estimate += (f"; freed {format_bytes(freed)} of the loader's device cache (the part cheapest "
                             "to get back: it is read from its next tier or the dataset again)")
            if loader is not None and loader.batch_size is not None and self.batch_size < loader.batch_size:
                loader.set_batch_size(self.batch_size)
                estimate += "; the loader's next batches come at that size"
        warnings.warn(
            f"the step ran out of device memory at batch size {failed} ({message}); running the "
            f"same samples again in pieces of {self.batch_size}{estimate}",
            BatchSizeLoweredWarning, stacklevel=3,
        )

    def _free_cache(self, free: int | None) -> int:
        """Shrink the loader's device cache to what the plan gives it beside the new batch, and
        further by what the new batch lacks of ``free`` memory; the bytes freed."""
        loader, plan = self.loader, self.plan
        if loader is None or plan is None or self.batch_size is None:
            return 0
        held = loader.device_cache_bytes
        if held <= 0:
            return 0
        keep = held
        if plan.dataset is not None and plan.cache is not None:
            keep = min(keep, plan.replan(self.batch_size).cache_bytes)
        if free is not None:
            missing = self._needed(self.batch_size) - free
            if missing > 0:
                keep = min(keep, held - missing)
        return loader.shrink_cache(max(0, keep)) if keep < held else 0

    def _resident(self) -> float:
        """Model state the step's estimate counts that is already on the device (all but gradients)."""
        assert self.plan is not None
        step = self.plan.step
        return step.state_bytes - step.state.get("gradients", 0)

    def _needed(self, batch_size: int) -> int:
        """Free bytes a step of ``batch_size`` needs, beyond the model state already resident."""
        assert self.plan is not None
        return math.ceil((self.plan.step_peak(batch_size) - self._resident()) / _SAFETY)

    def _fits(self, free: int) -> int | None:
        """The largest batch whose step, beyond the model state already resident, fits ``free``
        (None when the estimate does not grow with the batch: it cannot say)."""
        assert self.plan is not None
        step = self.plan.step
        if step.per_sample <= 0:
            return None
        return max(0, math.floor((_SAFETY * free + self._resident() - step.fixed) / step.per_sample))
