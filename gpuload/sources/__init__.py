"""The Source contract: one data path turns an epoch's batch indices into batches on a device.

Five implementations, chosen in this order (``choose.choose_source``):

- ``tokens.TokenSource``: token windows (``gpuload.TokenWindows``), one gather of the flat token
  buffer per batch;
- ``packed.PackedSource``: documents packed into rows (``gpuload.PackedTokens``), one gather of
  the flat token buffer per batch;
- ``arrays.ArraySource``: in-memory arrays (``TensorDataset``, ``gpuload.ArrayDataset``, a tensor
  or numpy array) placed by the cache plan; one gather per batch;
- ``images.ImageFileSource``: image files, read, decoded a batch at once and transformed;
- ``samples.SampleSource``: any other dataset: torch fetches and collates (its workers too),
  with a sample cache in front when the cache settings allow.

A Source is built once per loader (each module's ``detect`` says whether it can serve the
dataset; ``SampleSource`` serves any) and answers the loader's questions: fill the cache now
(``warm``), get ready for an epoch (``begin_epoch``: place data, decide or shrink caches), say
how this epoch's work runs (``schedule``), report counters (``stats``), give memory back
(``close``, or part of the device cache: ``shrink_cache``). The loader owns the epochs.

A source knows nothing of ranks. When its store is split over ranks
(``distributed.split_store.SplitStore``, decided where the source makes its store), the
loader serves it through :class:`~gpuload.sources.exchanged.Exchanged`, a wrapper source that
runs the exchange and hands the rows it gathers to the source, which makes its batches of them
(:meth:`Source.from_rows`) as of rows gathered anywhere. A source keeps whatever its decision
chose in one slot (its own cache, its share of a store split over ranks, or nothing), and the
object held there says what the source reports of it (path, stats, close).

``Source.schedule`` answers with a :class:`Schedule`: whether the work may run ahead of the loop
(and on a CPU device by default), whether the prefetcher stages its host batches, and how many
batches it holds in flight. The loader decides from it, in one place (:func:`runs_ahead`),
which thread runs the work, then starts it: a :class:`Work` splits it in two. ``items`` may run
in the prefetcher's thread (reading, decoding, gathering into pinned slots), ``finish`` always
runs in the loop's thread (what must happen in order with the loop: transforms on CPU tensors,
counters, device copies when nothing runs ahead). A source receives indices only: the loader
draws them (``gpuload.sampling``) and takes a resumed epoch up where it was (``gpuload.resume``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpuload.cache import CacheSettings, Store
from gpuload.stats import LoaderStats
from gpuload.transfer import Staging

__all__ = [
    "DEFAULT_DEPTH", "FromRows", "Indices", "RestOfEpoch", "Schedule", "Setup", "Source", "Work", "ahead_on_device",
    "runs_ahead",
]

# Batches in flight when their size is unknown before the first one: double buffering, one
# being copied (or made) while the next is made.
DEFAULT_DEPTH = 2


@dataclass(frozen=True)
class Setup:
    """What every source knows of its loader: where batches go, the cache settings, whether
    batches are collated (``batched``: torch's auto-collation), the counters to update,
    ``owner``, the name its caches book their memory under, and the transform list with the
    seed of its randomness (the generator's initial seed) and what to do with bad files;
    ``worker_code``: the user gave a ``worker_init_fn`` for worker processes, which only
    torch's path (SampleSource) runs: the array and image paths serve batches in this process;
    ``batch_sampler``: the loader's (None without auto-collation), for sources that must know
    every rank's indices ahead (a split cache over torch.distributed ranks); ``staging``: the
    loader's copy route to the device (its prefetcher's pinned slots and side stream; None on a
    CPU device), which every host-to-device copy made inside a batch names (``transfer.to_device``)."""

    dataset: Any
    map_style: bool
    device: torch.device
    settings: CacheSettings
    batched: bool
    batch_size: int | None
    collate_fn: Callable[[Any], Any]
    stats: LoaderStats
    owner: str
    transforms: Sequence[Any] | None = None
    seed: int = 0
    on_error: str = "raise"
    worker_code: bool = False
    batch_sampler: Any = None
    staging: Staging | None = None


@dataclass(frozen=True)
class RestOfEpoch:
    """The part of an epoch that :attr:`Indices.draw` yields when the epoch is taken up mid-way
    (``load_state_dict``, or the rest of an epoch after ``set_batch_size``): only the batches
    after that point. ``cut``: ``(batches done, samples done, batch size)`` when they are the
    rest of the epoch's sample order from that sample cut at that size, so whoever computes
    other ranks' batches (the exchange) cuts theirs alike (None: the batches as the epoch's
    sampler cuts them)."""

    cut: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class Indices:
    """One epoch's batch indices as the loader draws them, and what a source must know of them.

    ``number`` counts epochs from 0 (the transforms' randomness depends on it); ``draw`` makes
    this epoch's index iterator exactly as torch's iterator would (consuming the generator the
    same way), and must be called at most once, only by sources that make batches from
    indices; ``in_range``: the drawn indices are int64 tensors already known to lie in
    ``[0, len(dataset))`` (torch's Random and Sequential samplers over the whole dataset), so
    they need no check. ``rest``: the epoch is taken up mid-way (see :class:`RestOfEpoch`), so a
    source that otherwise runs torch's own iterator (which would start the epoch from its
    beginning) makes batches from the drawn ones instead; None: the whole epoch.
    ``copy_now``: copies a host batch (or a prefetcher ``Fill``) to the device through the
    loader's staging in the caller's thread, for batches made in the loop's thread: the one
    host-to-device path (``Prefetcher.copy_now``). What torch's own path needs beside (where
    its workers' batches sit in the epoch) it gets from its ``TorchLoading``.
    """

    number: int
    draw: Callable[[], Iterator[Any]]
    in_range: bool = False
    rest: RestOfEpoch | None = None
    copy_now: Callable[[Any], Any] | None = None

    @property
    def resumed(self) -> bool:
        """Whether the epoch is taken up mid-way (``draw`` yields only the rest)."""
        return self.rest is not None

    def batches(self, ahead: bool) -> Iterator[Any]:
        """This epoch's batch indices. Ahead of the loop they are all drawn now, in the loop's
        thread, so the samplers' random draws never race the loop's own use of torch's
        generator; in the loop they are drawn batch by batch, as torch draws them."""
        drawn = self.draw()
        return iter(list(drawn)) if ahead else drawn


@dataclass
class Work:
    """A source's work for one epoch, started for one thread placement.

    ``items`` run ahead in the prefetcher's thread when the work was started ahead (else in
    the loop's thread); ``finish`` turns each item into ``(batch, sample count)`` in the loop's
    thread, or None when the item holds nothing to deliver (every file of an image batch
    skipped). ``length``: gives ``len()`` of the epoch when it is not the index sampler's;
    ``from_torch``: torch's own iterator made this epoch (it drew its workers' base seed);
    ``torch_iterator``: that iterator, whose attributes (``_workers``...) the loader's
    iterator shows.
    """

    items: Iterator[Any]
    finish: Callable[[Any], tuple[Any, int] | None]
    length: Callable[[], int] | None = None
    from_torch: bool = False
    torch_iterator: Any = None


@dataclass(frozen=True)
class Schedule:
    """How a source's epoch may run, and how to start it.

    ``start(ahead)`` makes the :class:`Work` for the thread the loader chose (called once).
    ``ahead``: the work may run ahead of the loop at all (False: batches are served in place,
    arrays already on the device, or a stream whose own state must stay the loop's position);
    ``ahead_on_cpu``: it runs ahead on a CPU device too when ``prefetch_depth`` is not set
    (decoding and collating already use every core there, DALI's threads and torch's, so
    running them ahead measured no faster: 332 vs 352 images/s on 2 cores); ``staged``: the
    prefetcher packs host batches into pinned slots and copies them (False: the source makes
    its batches on the device itself, the prefetcher only runs it ahead); ``depth``: the
    batches the prefetcher holds in flight unless the user chose (``prefetch_depth``).
    """

    start: Callable[[bool], Work]
    ahead: bool = True
    ahead_on_cpu: bool = False
    staged: bool = True
    depth: int = DEFAULT_DEPTH


@dataclass(frozen=True)
class FromRows:
    """How a source makes batches from rows gathered for it (:meth:`Source.from_rows`): ``made``
    runs on each item where the rows are gathered (ahead of the loop when they are gathered
    there; None: nothing to do there); ``finish`` runs in the loop's thread and gives
    ``(batch, sample count)``, or None when the item holds nothing to deliver."""

    finish: Callable[[Any], tuple[Any, int] | None]
    made: Callable[[Any], Any] | None = None


def runs_ahead(schedule: Schedule, device: torch.device, prefetch_depth: int | None) -> bool:
    """Whether an epoch's work runs in the prefetcher's thread, ahead of the loop: the one place
    that decides it.

    ``prefetch_depth=0`` keeps it in the loop's thread, and so does a schedule with nothing to
    run ahead. On a GPU the copies, reads and decoding overlap the loop's compute; on a CPU
    device the schedule says (``ahead_on_cpu``) unless ``prefetch_depth`` is set.
    """
    if prefetch_depth == 0 or not schedule.ahead:
        return False
    if device.type == "cpu" and prefetch_depth is None:
        return schedule.ahead_on_cpu
    return True


def ahead_on_device(ahead: bool, device: torch.device) -> bool:
    """Whether batch-sized transforms run in the prefetcher's thread: only ahead on a GPU (on
    the side stream). On a CPU they stay in the loop's thread: their float buffers page-fault
    afresh each batch when allocated from a background thread's malloc arena (measured 30%
    slower)."""
    return ahead and device.type == "cuda"


class Source(ABC):
    """One data path of the loader (see the module docstring)."""

    #: What ``loader.stats.path`` says while this source serves.
    path: str = ""
    #: Bytes this source copied host-to-device so far (cache fills, batches copied in the
    #: loop's thread); the loader adds them to ``stats.bytes_h2d``. Only the thread making
    #: the items writes it.
    h2d_bytes: int = 0
    #: Whether rows gathered for this source elsewhere (:meth:`from_rows`) may be gathered ahead
    #: of the loop, where whoever gathers them allows it; False: each batch's in the loop's thread.
    rows_ahead: bool = True

    def __init__(self, setup: Setup) -> None:
        self.setup = setup

    def begin_epoch(self) -> None:  # noqa: B027 - optional: a source with nothing to place keeps it
        """Get ready for the next epoch: place the data or decide the cache the first time;
        later, give memory back if the model has grown into the reserve."""

    @abstractmethod
    def schedule(self, indices: Indices) -> Schedule:
        """How this epoch's work runs, and how to start it (see :class:`Schedule`); called
        after ``begin_epoch``."""

    def from_rows(self, number: int, ahead: bool) -> FromRows:
        """How batches of epoch ``number`` are made from rows of this source's store gathered
        elsewhere, one batch's rows per item (what a store split over ranks exchanges, served by
        ``sources.exchanged.Exchanged``); ``ahead``: the rows are gathered in the prefetcher's
        thread. Only a source whose store may hold a share of rows has one."""
        raise NotImplementedError(f"{type(self).__name__} makes no batches from gathered rows")

    def warm(self, progress: bool) -> None:  # noqa: B027 - optional: a source without a cache keeps it
        """Fill the cache now, in one pass, without touching samplers or random generators."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Entries for ``loader.stats.extra`` (cache counters, decisions)."""

    @abstractmethod
    def cache_store(self) -> Store | None:
        """The store serving this source's batches now (None: no cache). The loader's questions
        about the cache (its device bytes, shrinking it, whether it is split over ranks) are
        answered from it, the same way for every source."""

    def device_cache_bytes(self) -> int:
        """Bytes this source's cache holds in the memory of the loader's device (0: none)."""
        store = self.cache_store()
        return store.device_bytes if store is not None and store.device == self.setup.device else 0

    def shrink_cache(self, max_device_bytes: int) -> int:
        """Keep at most ``max_device_bytes`` of the cache in the device's memory, letting go
        first of what is cheapest to get back; returns the bytes freed (0: nothing to free; a
        share split over ranks frees nothing, and says why)."""
        store = self.cache_store()
        if store is None or not (store.split_over_ranks or self.device_cache_bytes()):
            return 0
        return store.shrink(max_device_bytes)

    def split_over_ranks(self) -> bool:
        """Whether the data is split over ranks (``cache_scope`` node/world in force): each batch
        is then a collective, and every rank must make the same batches."""
        store = self.cache_store()
        return store is not None and store.split_over_ranks

    def close(self) -> None:  # noqa: B027 - optional: a source holding no memory keeps it
        """Give back device and pinned memory; the next epoch rebuilds what it needs."""
