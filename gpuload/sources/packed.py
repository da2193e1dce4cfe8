"""Packed documents: the plan's rows are made once and cached, and a batch is one gather of rows.

``detect`` recognises a :class:`gpuload.datasets.packing.PackedTokens` served with its own
collate (``collate_fn=PackedTokens.collate``). The cache holds the packing plan's rows as
:mod:`gpuload.datasets.packed_rows` makes them (labels, ids and positions, each at the width its
values need); a batch is one gather of its rows and one widening a field, on the device. Per step
only the row indices and the int32 ``cu_seqlens`` (made on the host from the plan) cross to the
device (counted in ``stats.extra["packing"]``).

- on a CUDA device, the rows in the device tier when the cache plan holds them (a
  ``TieredArrayStore``: booked in the budget's ledger, given back by ``close`` and by a shrink,
  after which the rows it let go cross from the host through the loader's staging);
- with ``cache="off"`` on a CUDA device, each batch made on the host from the token buffer by
  ``gather_rows`` and copied through the loader's staging;
- on a CPU device, the rows themselves, in place.

Batches are made in the loop's thread: on the device they cost a few small kernels, and the
host path's copy overlaps the step through the loader's staging stream.
"""

from __future__ import annotations

from typing import Any

import torch

from gpuload.cache import CachePlan, Store, TieredArrayStore, format_bytes
from gpuload.datasets.packed_rows import PackedRows, packed_rows
from gpuload.datasets.packing import PackedTokens, collate_packed, gather_rows
from gpuload.datasets.tokens import signed_view
from gpuload.device import device_memory, host_memory
from gpuload.distributed.split_store import decline_split, split_context
from gpuload.sampling import in_range
from gpuload.sources import Indices, Schedule, Setup, Source, Work
from gpuload.sources.placed_arrays import staged_copier
from gpuload.sources.tokens import buffer_stats
from gpuload.transfer import to_device

__all__ = ["PER_RANK_REASON", "PackedSource", "detect"]

PER_RANK_REASON = (
    "packed documents keep a whole copy of the token buffer per rank: it is small next to the device "
    "(ids, not rows), and a copy split over ranks would make every batch a collective exchanging its tokens"
)
_CLOSED = "this gpuload.DataLoader was closed; iterate a new loader instead"


def detect(setup: Setup) -> PackedSource | None:
    """A PackedSource for a :class:`PackedTokens` (not a subclass that changes its rows) batched
    with its own collate, else None (torch's path serves it as any dataset)."""
    dataset = setup.dataset
    if not isinstance(dataset, PackedTokens) or type(dataset).__getitem__ is not PackedTokens.__getitem__:
        return None
    if not (setup.map_style and setup.batched) or setup.collate_fn is not collate_packed or setup.transforms:
        return None
    if setup.worker_code:
        return None  # a worker_init_fn asks for worker processes: torch's path runs it
    return PackedSource(setup, dataset)


class PackedSource(Source):
    """Batches of packed rows gathered from the cached rows of the packing plan."""

    def __init__(self, setup: Setup, dataset: PackedTokens) -> None:
        super().__init__(setup)
        self.dataset = dataset
        self.store: TieredArrayStore | None = None
        self.rows: PackedRows | None = None  # the plan's rows (on a CPU device: served in place)
        self.host: torch.Tensor | None = None  # the token buffer (signed view), with cache="off" on a device
        self.notes: dict[str, Any] = {}
        self.index_bytes = 0  # row indices and cu_seqlens copied to the device

    def _placed(self) -> bool:
        return self.rows is not None or self.host is not None

    def _place(self) -> None:
        setup, dataset = self.setup, self.dataset
        device, settings = setup.device, setup.settings
        self.notes = {"token_bytes": dataset.nbytes, "tokens": dataset.num_tokens}
        if split_context(settings, device) is not None:
            decline_split(settings, PER_RANK_REASON, stacklevel=6)
            self.notes["cache_scope"] = "rank: " + PER_RANK_REASON
        if device.type != "cpu" and settings.mode.value == "off":  # each batch made from the source, copied
            self.host, self.path = signed_view(dataset.tokens()), "host-gather"
            return
        rows = packed_rows(dataset)
        self.rows, self.path = rows, "device-gather"
        self.notes["row_bytes"] = rows.nbytes
        if device.type == "cpu":
            return
        plan = settings.array_plan(rows.nbytes // len(dataset), len(dataset), device_memory(device), host_memory(),
                                   device=device, owner=setup.owner)
        self.notes["cache_plan"] = plan.describe()
        self.place_on_device(plan)

    def place_on_device(self, plan: CachePlan) -> None:
        """Serve from a row store placed by ``plan`` (device tier first; rows it does not hold
        cross through the loader's staging)."""
        rows = self.rows = packed_rows(self.dataset)
        self.store = TieredArrayStore(rows.block, plan, self.setup.device, owner=self.setup.owner,
                                      staging=self.setup.staging)
        self.h2d_bytes += self.store.stats.device_bytes
        whole = self.store.stats.device_samples == len(self.dataset)
        self.path = "device-gather" if whole else f"tiered ({plan.kind})"
        if not whole:
            self.notes["cache"] = f"the packed rows ({format_bytes(rows.nbytes)}) are not all in the device tier"

    def begin_epoch(self) -> None:
        self.dataset.check_unchanged()
        if not self._placed():
            self._place()
        elif self.store is not None:
            self.store.shrink_to_reserve(self.setup.settings.keepable)

    def warm(self, progress: bool) -> None:
        self.dataset.check_unchanged()
        if not self._placed():
            self._place()

    def _batch(self, request: Indices, indices: Any) -> tuple[dict[str, Any], int]:
        """The batch of rows ``indices``, on the loader's device."""
        packed, store, dataset, device = self.rows, self.store, self.dataset, self.setup.device
        if packed is None and self.host is None:
            raise RuntimeError(_CLOSED)
        rows = indices if request.in_range else in_range(indices, len(dataset))
        if rows.numel() == 0:
            raise IndexError("list index out of range")  # torch collates an empty list, which fails so
        if packed is None:
            return self._from_source(request, rows)
        edges, max_seqlen = packed.cu_seqlens(rows.numpy())
        cu_seqlens = torch.from_numpy(edges)
        if store is not None:
            block = store.gather(rows, copy=staged_copier(request.copy_now))
            [cu_seqlens] = to_device([cu_seqlens], device, self.setup.staging)
            self.index_bytes += rows.numel() * 8 + edges.nbytes
        else:
            block = packed.block.index_select(0, rows)
        return {**packed.batch(block), "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}, rows.numel()

    def _from_source(self, request: Indices, rows: torch.Tensor) -> tuple[dict[str, Any], int]:
        """The batch made on the host from the token buffer, copied through the loader's staging
        (``cache="off"`` on a device)."""
        host, dataset, device = self.host, self.dataset, self.setup.device
        if host is None:
            raise RuntimeError(_CLOSED)
        segments = dataset.plan.segments(rows.numpy())
        table, cu_seqlens = torch.from_numpy(segments.table), torch.from_numpy(segments.cu_seqlens)
        made = gather_rows(host, dataset.token_dtype, table, cu_seqlens, segments.rows, dataset.seq_len,
                           dataset.pad_id)
        copy = request.copy_now or (lambda tensors: to_device(tensors, device, self.setup.staging))
        moved = copy([*made.values(), cu_seqlens])
        batch = {**dict(zip(made, moved[:-1])), "cu_seqlens": moved[-1], "max_seqlen": segments.max_seqlen}
        return batch, segments.rows

    def schedule(self, indices: Indices) -> Schedule:
        """Batches are made in the loop's thread (see the module docstring)."""
        def start(ahead: bool) -> Work:
            return Work(indices.batches(False), lambda index: self._batch(indices, index))

        return Schedule(start, ahead=False)

    def cache_store(self) -> Store | None:
        """The row store of the packed rows (None on a CPU device and with ``cache="off"``)."""
        return self.store

    def stats(self) -> dict[str, Any]:
        packing = {**self.dataset.packing_stats(), "index_bytes_h2d": self.index_bytes}
        return {**buffer_stats(self.notes, self.store), "packing": packing}

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        self.store, self.rows, self.host = None, None, None
