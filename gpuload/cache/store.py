"""The one interface of every cache store: where a dataset's bytes live once read.

Every cached representation (array rows over tiers, a map-style dataset's samples by column
or one by one, decoded images, a rank's share of a dataset split over ranks) is a
:class:`Store`: ``gather`` returns the samples it holds by dataset index, ``shrink`` gives
device memory back when the model needs it, ``stats`` reports, ``close`` gives everything
back. Stores that fill as samples pass (the sample caches) are filling stores
(:class:`FillingStore`) and also take ``put``; the others are filled when they are built
(arrays are placed from their source, a rank's share is read before the first epoch). Sources
depend on this interface, not on a store class, for shrinking, counting and closing.
"""

from __future__ import annotations

import threading
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from gpuload.cache.budget import format_bytes
from gpuload.device import MemoryInfo, device_memory

__all__ = ["FillingStore", "Store", "StoreStats", "StreamGuard", "TierCounts"]


@dataclass
class TierCounts:
    """What one tier holds and served: samples, bytes, and gathered samples (hits)."""

    samples: int = 0
    bytes: int = 0
    hits: int = 0


@dataclass
class StoreStats:
    """Bytes and samples per tier, gathered samples per tier, and host-to-device bytes.

    ``tiers``: every tier by name in order (the source last), for tiers the flat fields do not
    name. ``h2d_bytes`` counts sample data that gathers sent to the device (indices are not
    counted); ``fill_bytes`` the one-time copy that built the device tier;
    ``host_shared_ranks`` how many processes of the node map the host tier's one copy (1: its
    own; 0: no host tier).
    """

    device_samples: int = 0
    host_samples: int = 0
    source_samples: int = 0
    device_bytes: int = 0
    host_bytes: int = 0
    device_hits: int = 0
    host_hits: int = 0
    source_hits: int = 0
    h2d_bytes: int = 0
    fill_bytes: int = 0
    fallbacks: int = 0
    host_shared_ranks: int = 0
    tiers: dict[str, TierCounts] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class StreamGuard:
    """The CUDA streams that used a store's device memory, and the order of memory it replaces.

    A store's device memory is read or written on several streams (the prefetcher's side
    stream ahead of the loop, the loop's own), and replaced (shrunk) on one of them. Every use
    calls :meth:`use` first: it notes the stream and makes it wait (on the device, no host sync)
    for the latest replacement. A replacement calls :meth:`before_replacing` (the current stream
    waits for every noted stream's work queued so far, e.g. a batch still being written) and
    :meth:`replaced` with the memory it let go (kept reserved until every noted stream is done
    with it: ``record_stream``) once the new memory is written. Inert off CUDA.

    Streams are told apart by what they are on the device (:func:`_stream_key`), not by the
    Python object: ``torch.cuda.current_stream()`` returns a new object at each call, so one
    stream used for a million batches is noted once.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._streams: dict[tuple[int, int], Any] = {}
        self._ready: Any = None  # the latest replacement's event
        self._lock = threading.Lock()

    def use(self) -> None:
        """Before reading or writing the store's device memory on the current stream."""
        if not self.cuda:
            return
        stream = torch.cuda.current_stream(self.device)
        with self._lock:
            self._streams.setdefault(_stream_key(stream), stream)
            ready = self._ready
        if ready is not None:
            stream.wait_event(ready)

    def before_replacing(self) -> None:
        """Before the current stream copies memory it will replace: after every use queued."""
        if not self.cuda:
            return
        current = torch.cuda.current_stream(self.device)
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            if _stream_key(stream) != _stream_key(current):
                current.wait_stream(stream)

    def replaced(self, old: list[torch.Tensor]) -> None:
        """After the new memory is written on the current stream: later uses wait for it, and
        ``old`` stays reserved until the streams that used it are done."""
        if not self.cuda:
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        with self._lock:
            self._ready = event
            streams = list(self._streams.values())
        for tensor in old:
            if tensor.is_cuda:
                for stream in streams:
                    tensor.record_stream(stream)


def _stream_key(stream: Any) -> tuple[int, int]:
    """A CUDA stream's identity: its device and its handle (``cudaStream_t``)."""
    return (stream.device_index, stream.cuda_stream)


class Store(ABC):
    """Where a cached representation of a dataset lives (see the module docstring)."""

    device: torch.device
    #: A rank's share of data split over ranks: every batch is a collective, so the batch size
    #: changes only on every rank together, and one rank alone cannot shrink it.
    split_over_ranks: bool = False

    @abstractmethod
    def gather(self, indices: torch.Tensor) -> Any:
        """The held samples at dataset ``indices`` (int64) as one batch, in that order; an
        index the store does not hold raises ``IndexError`` naming it."""

    @abstractmethod
    def shrink(self, max_device_bytes: int) -> int:
        """Keep at most ``max_device_bytes`` in the device's memory, letting go first of what is
        cheapest to get back; returns the bytes freed (0: nothing, e.g. a share other ranks read)."""

    @property
    @abstractmethod
    def stats(self) -> Any:
        """A snapshot of the counters (a dataclass with ``as_dict()``)."""

    @property
    @abstractmethod
    def device_bytes(self) -> int:
        """Bytes of copies this store holds in the memory of its ``device`` (views of the
        source's own arrays count 0)."""

    @abstractmethod
    def close(self) -> None:
        """Give back device and host memory and the budget booking. Safe to call twice."""

    def shrink_to_reserve(
        self, keepable: Callable[[torch.device, MemoryInfo, int], int], refill: str = ""
    ) -> int:
        """On a CUDA device: ``shrink`` to what ``keepable(device, memory, held)`` allows now
        (``CacheSettings.keepable``: free memory must stay above the reserve), warning when it
        frees something; ``refill`` says where the dropped samples come from instead."""
        if self.device.type != "cuda":
            return 0
        held = self.device_bytes
        if not held:
            return 0
        freed = self.shrink(keepable(self.device, device_memory(self.device), held))
        if freed and refill:
            warnings.warn(
                f"gpuload: free memory on {self.device} fell below the reserve; the cache gave back "
                f"{format_bytes(freed)} and {refill}",
                stacklevel=3,
            )
        return freed


class FillingStore(Store):
    """A store filled as samples pass (read by the loop or by workers), up to a budget."""

    @abstractmethod
    def put(self, indices: torch.Tensor, batch: Any) -> int:
        """Keep the samples of ``batch`` (read from the source, in order) under dataset
        ``indices``; returns how many were stored now (0 when full, closed or uncacheable)."""

    @property
    @abstractmethod
    def complete(self) -> bool:
        """Every sample of the dataset is held."""
