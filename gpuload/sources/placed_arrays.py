"""In-memory arrays found in a dataset, placed where the cache plan says, and gathered there.

``find_columns`` recognises datasets whose samples are rows of arrays (``TensorDataset``,
``gpuload.ArrayDataset``, a bare tensor or numpy array) and proves, on sample 0, that a gather
reproduces torch's fetch + collate exactly. ``ArrayColumns.place`` puts them in their serving
place (a rank's share, the cache's tiers, or left where they are) and the resulting
:class:`ResidentColumns` gathers each batch there; rows kept in host memory reach the device
through the loader's prefetcher (the one host-to-device path).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten
from torch.utils.data import TensorDataset

from gpuload.cache import CacheSettings, StoreStats, TieredArrayStore, format_bytes
from gpuload.cache.array_store import BatchRequest, gatherable, private_host_tier
from gpuload.cache.chunked_rows import ChunkedRows, take_rows
from gpuload.cache.disk import Fingerprint, fingerprint_arrays
from gpuload.datasets.arrays import ArrayDataset
from gpuload.device import device_memory, host_memory
from gpuload.distributed.group import current_context
from gpuload.distributed.shared_host import node_host_tier
from gpuload.distributed.split_store import SplitStore, split_arrays
from gpuload.prefetch import Fill, TensorSpec
from gpuload.sampling import in_range
from gpuload.timeline import gather_stage, stage
from gpuload.transfer import Staging, to_device

__all__ = ["ArrayColumns", "ResidentColumns", "find_columns", "raw_columns", "same_arrays", "staged_copier"]


def raw_columns(dataset: Any) -> list[torch.Tensor] | None:
    if isinstance(dataset, TensorDataset) and type(dataset).__getitem__ is TensorDataset.__getitem__:
        return list(dataset.tensors)
    if isinstance(dataset, ArrayDataset) and type(dataset).__getitem__ is ArrayDataset.__getitem__:
        return list(dataset.columns.values())
    if type(dataset) is torch.Tensor:
        return [dataset]
    if type(dataset) is np.ndarray and dataset.dtype.kind in "biuf" and dataset.ndim > 0:
        try:
            return [torch.from_numpy(dataset)]
        except (ValueError, TypeError):  # negative strides, unsupported dtypes
            return None
    return None


def same_arrays(now: list[torch.Tensor], placed: list[torch.Tensor]) -> bool:
    """Whether ``now`` are the arrays ``placed`` was made from: the same memory, shape, strides
    and dtype (numpy arrays are wrapped anew each time, so identity alone would not do; the
    placed tensors are still held, so their memory cannot have been reused)."""
    return len(now) == len(placed) and all(
        a is b
        or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)
        for a, b in zip(now, placed)
    )


def find_columns(
    dataset: Any, collate_fn: Callable[[Any], Any], batched: bool
) -> ArrayColumns | None:
    """The dataset's arrays and the batch structure, when gathering equals torch's collation.

    Returns None (use torch's path) unless the dataset is plain rows of strided arrays and
    collating sample 0 gives exactly those arrays' first rows, with the same dtypes and shapes.
    """
    columns = raw_columns(dataset)
    if not columns or any(c.layout != torch.strided or c.dim() == 0 for c in columns):
        return None
    if columns[0].shape[0] == 0:
        return None
    sample = dataset[0]
    template = collate_fn([sample]) if batched else collate_fn(sample)
    leaves, spec = tree_flatten(template)
    if len(leaves) != len(columns):
        return None
    for leaf, column in zip(leaves, columns):
        expected = column[0:1] if batched else column[0]
        if not isinstance(leaf, torch.Tensor) or leaf.dtype != column.dtype:
            return None
        if leaf.shape != expected.shape or not torch.equal(leaf, expected):
            return None
    return ArrayColumns(columns, spec, columns[0].shape[0])


_DEVICE_GATHER = gather_stage("device")  # the timeline's stage of a gather in place


def _batch_builder(spec: TreeSpec) -> Callable[[list[torch.Tensor]], Any]:
    """A function from leaves to the batch structure; direct for a flat list, tuple or dict."""
    if spec.is_leaf():
        return lambda leaves: leaves[0]
    children = spec.children() if hasattr(spec, "children") else spec.children_specs
    flat = all(child.is_leaf() for child in children)
    if flat and spec.type is list:
        return list
    if flat and spec.type is tuple:
        return tuple
    if flat and spec.type is dict:
        keys = list(spec.context)
        return lambda leaves: dict(zip(keys, leaves))
    return lambda leaves: tree_unflatten(leaves, spec)


@dataclass
class ArrayColumns:
    """Host arrays with one row per sample, and the tree structure a batch of them takes;
    ``disk``: the cache's disk tier may keep them (False for arrays read from a local file,
    which is its own disk tier); ``split_beside()``: the bytes per sample of what splits over the
    ranks with them (a table's decoded images), counted when the ranks decide the split."""

    columns: list[torch.Tensor]
    spec: TreeSpec
    num_samples: int
    disk: bool = True
    split_beside: Callable[[], int] | None = None

    def __post_init__(self) -> None:
        self.build = _batch_builder(self.spec)

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.columns)

    def place(
        self, device: torch.device, settings: CacheSettings, owner: Hashable, batch_sampler: Any = None,
        staging: Staging | None = None,
    ) -> ResidentColumns:
        """Put the arrays where the cache plan says: device, host memory, or left at the source.

        In a torch.distributed job whose ``cache_scope`` splits the dataset over ranks (and
        whose ``batch_sampler`` is torch's over a ``DistributedSampler``), a
        ``SplitStore`` over a store of this rank's rows holds its share. ``cache="off"`` (or a plan that caches
        nothing) keeps the arrays where they are and streams every batch through the
        prefetcher's pinned slots. On a CPU device the arrays are served in place. Otherwise a
        ``TieredArrayStore`` holds the plan's tiers (device, host); in a torch.distributed job the
        node's ranks share one host tier (``distributed.shared_host``), or each keeps its own in
        its share of the node's host budget. ``staging``: the loader's route to the device, which
        the indices a batch gathers there take.
        """
        split = split_arrays(self.columns, settings, device, batch_sampler, owner, staging=staging,
                               beside=self.split_beside)
        if split is not None:
            return ResidentColumns(self, self.columns, device, split.plan.kind, copies_batches=False, store=split,
                                   staging=staging)
        if settings.mode.value == "off":
            return ResidentColumns(self, self.columns, device, "host-gather", copies_batches=True, staging=staging)
        if device.type == "cpu":
            # A table column's chunks are joined once: host memory is this device's own tier, and a
            # batch gathers from one tensor 9x faster than from its chunks (0.2 vs 1.8 ms for 256
            # rows of 3 KiB from 1,000-row chunks, one core).
            joined = [column.clone() if isinstance(column, ChunkedRows) else column for column in self.columns]
            return ResidentColumns(self, joined, device, "device-gather", copies_batches=False)
        shared_host = node_host_tier(settings, device, batch_sampler)  # every rank must then place
        context = current_context()
        plan = settings.array_plan(
            self.nbytes // self.num_samples, self.num_samples, device_memory(device), host_memory(),
            device=device, owner=owner,
            host_copies=context.local_world_size if context is not None and shared_host is None else 1,
            disk=self.disk,
        )
        if plan.device_samples + plan.host_samples + plan.samples_in("disk") == 0 and shared_host is None:
            warnings.warn(
                f"gpuload: nothing of the dataset ({format_bytes(self.nbytes)}) fits the cache "
                f"budget on {device}; batches stream from the host each step. {plan.describe()}",
                stacklevel=3,
            )
            return ResidentColumns(self, self.columns, device, "host-gather", copies_batches=True, staging=staging)

        def identity() -> Fingerprint:  # the disk tier's key, taken only when it keeps rows
            return fingerprint_arrays(self.columns, key=settings.disk_key)

        store = TieredArrayStore(self.columns, plan, device, owner=owner, host_tier=shared_host or private_host_tier,
                                 settings=settings, identity=identity, staging=staging)
        path = "device-gather" if plan.device_samples == self.num_samples else f"tiered ({plan.kind})"
        return ResidentColumns(self, self.columns, device, path, copies_batches=False, store=store, staging=staging)


class ResidentColumns:
    """Arrays in their serving place (device, or host for host-gather) that batches gather from."""

    def __init__(
        self,
        source: ArrayColumns,
        columns: list[torch.Tensor],
        device: torch.device,
        path: str,
        copies_batches: bool,
        store: TieredArrayStore | SplitStore | None = None,
        staging: Staging | None = None,
    ) -> None:
        self.source = source
        self.staging = staging  # the loader's route to the device for the indices of a batch
        self.dtypes = [column.dtype for column in columns]
        self.columns = [gatherable(column) for column in columns]  # uint16/32/64 as signed views
        self.device = device
        self.path = path
        self.store = store
        self._where = columns[0].device
        self._copies_batches = copies_batches

    @property
    def placed_bytes(self) -> int:
        """Bytes copied to the device to fill its tier (0 without a store)."""
        return self.store.stats.device_bytes if self.store is not None else 0

    @property
    def stats(self) -> StoreStats | None:
        """Bytes and hits per tier, when a cache store serves the batches."""
        return self.store.stats if self.store is not None else None

    def release(self) -> None:
        """Give back device and pinned memory now, even while an abandoned iterator holds this."""
        self.columns = []
        if self.store is not None:
            self.store.close()

    def shrink_to_reserve(self, settings: CacheSettings) -> int:
        """At an epoch start: give device memory back if the model has grown into the reserve."""
        return self.store.shrink_to_reserve(settings.keepable) if self.store is not None else 0

    @property
    def copies_batches(self) -> bool:
        """True when some batch rows are copied to the device each epoch: the arrays stay on
        the host, or the cache's tiers leave rows in host memory."""
        if isinstance(self.store, TieredArrayStore):
            return not self.store.all_on_device
        return self._copies_batches

    def checked_index(self, indices: Any) -> torch.Tensor:
        """``indices`` as a flat int64 tensor in range, failing the way torch's fetch fails."""
        if not self.columns:
            raise RuntimeError("this gpuload.DataLoader was closed; iterate a new loader instead")
        flat = in_range(indices, self.source.num_samples)
        if flat.numel() == 0:
            raise IndexError("list index out of range")  # torch collates an empty list, which fails so
        return flat

    def gather(
        self, indices: Any, batched: bool, checked: bool = False, copy: Callable[[Any], Any] | None = None,
    ) -> tuple[Any, torch.Tensor, int]:
        """One batch, gathered where the arrays live: (batch, checked indices, bytes moved here).

        ``checked``: the indices are an int64 tensor already known to lie in [0, len), as
        torch's RandomSampler and SequentialSampler over this dataset guarantee. ``copy``: the
        loader's staging (``Prefetcher.copy_now``), which copies rows kept in host memory to the
        device and counts them; nothing else copies a batch.
        """
        if not self.columns:
            raise RuntimeError("this gpuload.DataLoader was closed; iterate a new loader instead")
        flat = indices if checked else self.checked_index(indices)
        if self.store is not None:
            copier = staged_copier(copy)
            leaves = self.store.gather(flat, copy=copier) if isinstance(self.store, TieredArrayStore) else (
                self.store.gather(flat))
            return self._built(leaves, batched), flat, 0
        moved_bytes = 0
        where = flat
        if self._where != flat.device:
            (where,) = to_device([flat], self._where, self.staging)  # not a pageable copy
            moved_bytes = flat.numel() * flat.element_size()
        if self._where != self.device:  # host arrays in the loop's thread (prefetch_depth=0)
            if copy is None:
                raise RuntimeError(f"host arrays reach {self.device} only through the loader's staging")
            return copy(self.fill(flat, batched)), flat, moved_bytes
        with stage(_DEVICE_GATHER):
            leaves = [column.index_select(0, where).view(dtype) for column, dtype in zip(self.columns, self.dtypes)]
        return self._built(leaves, batched), flat, moved_bytes

    def _built(self, leaves: list[torch.Tensor], batched: bool) -> Any:
        if not batched:
            leaves = [leaf.squeeze(0) for leaf in leaves]
        return self.source.build(leaves)

    def request(self, flat: torch.Tensor, batched: bool) -> Fill:
        """A batch of the cache's tiers for the prefetcher: rows on the device gathered now (in
        the prefetcher's thread, on its side stream), the others gathered on the host straight
        into its pinned slot; ``finished`` turns what it delivers into the batch."""
        store = self.store
        assert isinstance(store, TieredArrayStore)  # ArraySource asks only a tiered store for requests
        return _staged_fill(store.request(flat), lambda leaves: self._built(leaves, batched))

    def finished(self, delivered: Any) -> Any:
        """The batch of a delivered :meth:`request`: device and copied rows put in order."""
        on_device, staged, assemble = delivered
        return assemble(on_device, staged)

    def fill(self, flat: torch.Tensor, batched: bool) -> Fill:
        """A batch for the prefetcher, gathered on the host straight into its pinned slot.

        ``flat`` comes from ``checked_index``: the check runs in the loop's thread, in order.
        """
        shapes = [(flat.numel(), *c.shape[1:]) if batched else tuple(c.shape[1:]) for c in self.columns]
        layout = tree_unflatten([TensorSpec(shape, dtype) for shape, dtype in zip(shapes, self.dtypes)],
                                self.source.spec)
        columns = self.columns

        def gather_into(slot: Any) -> None:
            targets, _ = tree_flatten(slot)
            with stage(gather_stage("host")):
                for column, target in zip(columns, targets):
                    take_rows(column, flat, target.view(column.dtype).view(-1, *column.shape[1:]))

        return Fill(layout, gather_into)


def _host_part(request: BatchRequest) -> list[TensorSpec]:
    """The slot tensors a request's host rows are gathered into (none when all are on the device)."""
    return [TensorSpec(shape, dtype) for shape, dtype in request.staged_shapes] if request.stages else []


def staged_copier(copy: Callable[[Any], Any] | None) -> Callable[[BatchRequest], list[torch.Tensor]] | None:
    """What a tiered store's ``gather`` copies its host rows with (``copy=``), from the loader's
    ``copy_now`` (or a prefetcher's): the rows gathered straight into the pinned slot and copied."""
    if copy is None:
        return None
    return lambda request: copy(Fill(_host_part(request), request.fill_staged))


def _staged_fill(request: BatchRequest, build: Callable[[Any], Any]) -> Fill:
    """``request`` as a :class:`Fill` for the prefetcher's slots: its device rows pass through,
    its host rows are gathered into the slot; the delivered layout is ``(device rows, copied
    rows, assemble)``; ``assemble`` puts them in order and makes the batch with ``build``."""
    specs = _host_part(request)

    def assemble(on_device: list[torch.Tensor], staged: list[torch.Tensor]) -> Any:
        return build(request.assemble(on_device, staged))

    return Fill((request.on_device, specs, assemble), lambda slot: request.fill_staged(slot[1]))
