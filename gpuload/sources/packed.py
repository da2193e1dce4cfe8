"""Packed documents: the flat token buffer is cached, and a batch is one gather of token positions.

``detect`` recognises a :class:`gpuload.datasets.packing.PackedTokens` served with its own
collate (``collate_fn=PackedTokens.collate``). The cache holds the flat token buffer, as for
token windows. A batch of rows is made from its segments (``PackingPlan.segments``: a few ints
per segment, computed on the host from the plan) by ``gather_rows``: on the device the token
positions are expanded (``repeat_interleave`` with its output size known: no host sync) and the
ids and next ids taken by one gather. Per step only the segment table crosses to the device
(``5 x 8`` bytes a segment and the int32 ``cu_seqlens``, counted in ``stats.extra["packing"]``).

- on a CUDA device, the buffer in the device tier when the cache plan holds it whole (a
  ``TieredArrayStore`` of one row: booked in the budget's ledger, given back by ``close`` and by
  a shrink, which the batches after it see and take the host path);
- else on the host: each batch made there from the buffer (a memmap's pages as the OS caches
  them) and its ``(rows, seq_len)`` tensors copied through the loader's staging;
- on a CPU device, the buffer itself, in place.

Batches are made in the loop's thread: on the device they cost a few small kernels, and the
host path's copy overlaps the step through the loader's staging stream.
"""

from __future__ import annotations

from typing import Any

import torch

from gpuload.cache import CachePlan, Store, TieredArrayStore, format_bytes
from gpuload.datasets.packing import PackedTokens, collate_packed, gather_rows
from gpuload.datasets.tokens import signed_view
from gpuload.device import device_memory, host_memory
from gpuload.distributed.sharded_store import decline_split, split_context
from gpuload.sampling import in_range
from gpuload.sources import Indices, Schedule, Setup, Source, Work
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
    """Batches of packed rows gathered from the cached flat token buffer."""

    def __init__(self, setup: Setup, dataset: PackedTokens) -> None:
        super().__init__(setup)
        self.dataset = dataset
        self.store: TieredArrayStore | None = None
        self.host: torch.Tensor | None = None  # the buffer in host memory (signed view)
        self.notes: dict[str, Any] = {}
        self.index_bytes = 0  # segment tables copied to the device

    def _placed(self) -> bool:
        return self.store is not None or self.host is not None

    def _place(self) -> None:
        setup, dataset = self.setup, self.dataset
        device, settings = setup.device, setup.settings
        tokens = signed_view(dataset.tokens())
        self.notes = {"token_bytes": dataset.nbytes, "tokens": dataset.num_tokens}
        if split_context(settings, device) is not None:
            decline_split(settings, PER_RANK_REASON, stacklevel=6)
            self.notes["cache_scope"] = "rank: " + PER_RANK_REASON
        self.host, self.path = tokens, "device-gather" if device.type == "cpu" else "host-gather"
        if device.type == "cpu" or settings.mode.value == "off":
            return
        plan = settings.array_plan(dataset.nbytes, 1, device_memory(device), host_memory(), device=device,
                                   owner=setup.owner)
        self.notes["cache_plan"] = plan.describe()
        if plan.device_samples >= 1:
            self.place_on_device(plan)
        if self.store is None:
            self.notes["cache"] = f"the token buffer ({format_bytes(dataset.nbytes)}) is not in the device tier"

    def place_on_device(self, plan: CachePlan) -> None:
        """Serve from a one-row store placed by ``plan``; the host keeps serving when its device
        tier does not hold the buffer (a fallback the store warned of)."""
        tokens = signed_view(self.dataset.tokens())
        self.store = TieredArrayStore(tokens.view(1, -1), plan, self.setup.device, owner=self.setup.owner,
                                      staging=self.setup.staging)
        if self.store.whole_on_device() is None:
            self.store.close()
            self.store = None
            return
        self.h2d_bytes += self.store.stats.device_bytes
        self.path = "device-gather"

    def begin_epoch(self) -> None:
        self.dataset.check_unchanged()
        if not self._placed():
            self._place()
        elif self.store is not None:
            self.store.shrink_to_reserve(self.setup.settings.keepable, refill="host memory")

    def warm(self, progress: bool) -> None:
        self.dataset.check_unchanged()
        if not self._placed():
            self._place()

    def _batch(self, request: Indices, indices: Any) -> tuple[dict[str, Any], int]:
        """The batch of rows ``indices``: made where the buffer lives, on the loader's device."""
        host, store, dataset, device = self.host, self.store, self.dataset, self.setup.device
        if host is None:
            raise RuntimeError(_CLOSED)
        rows = indices if request.in_range else in_range(indices, len(dataset))
        if rows.numel() == 0:
            raise IndexError("list index out of range")  # torch collates an empty list, which fails so
        segments = dataset.plan.segments(rows.numpy())
        table, cu_seqlens = torch.from_numpy(segments.table), torch.from_numpy(segments.cu_seqlens)
        count, seq_len, pad_id = segments.rows, dataset.seq_len, dataset.pad_id
        on_device = store.whole_on_device() if store is not None else None
        if on_device is not None:
            table, cu_seqlens = to_device([table, cu_seqlens], device, self.setup.staging)
            self.index_bytes += segments.table.nbytes + segments.cu_seqlens.nbytes
            made = gather_rows(on_device[0].view(-1), dataset.token_dtype, table, cu_seqlens, count, seq_len, pad_id)
        else:
            made = gather_rows(host, dataset.token_dtype, table, cu_seqlens, count, seq_len, pad_id)
            if device.type != "cpu":  # through the loader's staging, which counts the bytes
                copy = request.copy_now or (lambda tensors: to_device(tensors, device, self.setup.staging))
                moved = copy([*made.values(), cu_seqlens])
                made, cu_seqlens = dict(zip(made, moved[:-1])), moved[-1]
        batch: dict[str, Any] = {**made, "cu_seqlens": cu_seqlens, "max_seqlen": segments.max_seqlen}
        return batch, count

    def epoch(self, indices: Indices) -> Schedule:
        """Batches are made in the loop's thread (see the module docstring)."""
        def start(ahead: bool) -> Work:
            return Work(indices.batches(False), lambda index: self._batch(indices, index))

        return Schedule(start, ahead=False)

    def cache_store(self) -> Store | None:
        """The device tier holding the token buffer (None when the host serves it)."""
        return self.store

    def stats(self) -> dict[str, Any]:
        packing = {**self.dataset.packing_stats(), "index_bytes_h2d": self.index_bytes}
        return {**buffer_stats(self.notes, self.store), "packing": packing}

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        self.store, self.host = None, None
