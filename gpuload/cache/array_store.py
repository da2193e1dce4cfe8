"""In-memory arrays placed over the tiers a plan names, served by one gather per batch.

:class:`TieredArrayStore` holds a tuple, list or dict of tensors with one row per sample,
placed as a :class:`~gpuload.cache.plan.CachePlan` says (``plan.tiers``, in order, each built
by its class in :mod:`gpuload.cache.tiers`; the source arrays serve the rest). A batch is split
by where its rows live (:meth:`TieredArrayStore.request`, a read through the store's keyed
tiers, :func:`~gpuload.cache.chain.read_through`): rows on the device are gathered there, the
others are gathered on the host into the loader's staging and copied by its prefetcher, the one
host-to-device path; the store copies nothing per batch itself.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from gpuload.cache.budget import LEDGER, BudgetLedger, format_bytes
from gpuload.cache.chain import read_through
from gpuload.cache.chunked_rows import ChunkedRows, gatherable
from gpuload.cache.oom import CacheFallbackWarning, is_oom
from gpuload.cache.plan import CachePlan, TierPlan
from gpuload.cache.store import Store, StoreStats, StreamGuard, TierCounts
from gpuload.cache.tiers import TIERS, HostTier, Placing, RowsByKey, SourceTier, Tier
from gpuload.sampling import in_range
from gpuload.timeline import gather_stage, stage
from gpuload.transfer import Staging, to_device

if TYPE_CHECKING:
    from gpuload.cache.disk import Fingerprint
    from gpuload.cache.settings import CacheSettings

__all__ = ["BatchRequest", "HostTier", "HostTierMaker", "StoreStats", "TierMaker", "TieredArrayStore", "gatherable",
           "private_host_tier"]


TierMaker = Callable[[list[torch.Tensor], int, int, int], Tier]
"""``(source columns, first row, rows wanted, the tier's most bytes) -> Tier``: builds a tier
otherwise than its class would (the host tier shared by a node's ranks). A maker may hold other
rows than asked (a node's shared copy); the store serves from it the rows past the tiers before
it. The maker is always called, once, also for no rows (a node's maker is a collective)."""

HostTierMaker = TierMaker


def private_host_tier(source: list[torch.Tensor], first: int, rows: int, budget: int = 0) -> HostTier:
    """This process's own copy of rows ``[first, first + rows)`` in pageable host memory.

    ``budget`` is not needed: the plan already fitted ``rows`` to it."""
    return HostTier.allocate(source, first, rows, Placing(torch.device("cpu")))


@dataclass
class BatchRequest:
    """One batch split by where its rows live.

    ``on_device``: per column, the rows held on the device, already gathered there (on the
    stream current when the request was made), in the batch's grouped order;
    ``staged_shapes``: per column, the ``(shape, dtype)`` of the rows that must cross from host
    memory (no rows: nothing to stage); ``fill_staged(views)`` gathers those rows into host
    tensors of those shapes (the loader's pinned staging); ``assemble(on_device, staged)``
    puts both back in the batch's order and structure, on the device.
    """

    on_device: list[torch.Tensor]
    staged_shapes: list[tuple[tuple[int, ...], torch.dtype]]
    fill_staged: Callable[[list[torch.Tensor]], None]
    assemble: Callable[[list[torch.Tensor], list[torch.Tensor]], Any]

    @property
    def stages(self) -> bool:
        """Whether some rows must cross from host memory."""
        return bool(self.staged_shapes) and self.staged_shapes[0][0][0] > 0


Copier = Callable[[BatchRequest], list[torch.Tensor]]
"""Copies a request's staged rows to the device (``fill_staged`` into staging, then the copy):
the loader's prefetcher; tests pass a stand-in."""


class TieredArrayStore(Store):
    """Array data placed over the plan's tiers, served by ``gather`` / ``request``.

    Samples go to the plan's tiers in order (``plan.tiers``); the rest stay in the source
    tensors. On a CPU ``device`` the device tier is a view of the source (no copy). When a tier
    cannot be allocated (out of memory) its samples go to the next tier, up to that tier's
    ``room`` in the plan (the host tier's: what the host budget holds), else to the source,
    with one :class:`CacheFallbackWarning` per store. The device bytes are booked in ``ledger``
    under ``owner`` until :meth:`close`. ``host_tier`` builds the host tier (a
    :data:`TierMaker`, e.g. a node's shared copy); by default each store keeps its own copy.
    Every other tier is built by its class (``allocate``) from the store's
    :class:`~gpuload.cache.tiers.Placing`: the device, ``settings`` and ``identity`` (what
    produced the arrays, the key of the disk tier's entry; without both a plan's disk tier
    stays empty).
    ``tiers`` maps further tier names to their classes (default: the registered ones).
    An array may be a :class:`~gpuload.cache.chunked_rows.ChunkedRows` (a table column's chunks,
    in place): the tiers copy their rows out of it, the source tier gathers the rest from it.
    ``stage_host_rows``: whether host rows go through the loader's staging (default: on any
    target but the CPU). ``staging``: the loader's route to the device for the row indices a
    batch gathers there (None: one pinned copy on the current stream, outside a loader).
    """

    def __init__(
        self,
        data: Any,
        plan: CachePlan,
        device: torch.device | str,
        *,
        ledger: BudgetLedger = LEDGER,
        owner: Hashable | None = None,
        host_tier: HostTierMaker = private_host_tier,
        settings: CacheSettings | None = None,
        identity: Callable[[], Fingerprint] | None = None,
        tiers: Mapping[str, type[Tier]] | None = None,
        stage_host_rows: bool | None = None,
        staging: Staging | None = None,
    ) -> None:
        self.staging = staging
        leaves, self._spec = tree_flatten(data)
        if not leaves or not all(isinstance(t, (torch.Tensor, ChunkedRows)) for t in leaves):
            kinds = ", ".join(type(t).__name__ for t in leaves) or "nothing"
            raise TypeError(
                f"TieredArrayStore needs a tensor or a tuple/list/dict of tensors, got {kinds}; "
                "wrap numpy arrays with torch.from_numpy"
            )
        for leaf in leaves:
            if leaf.dim() == 0 or leaf.layout != torch.strided:
                raise ValueError(
                    f"every array needs one row per sample (a strided tensor with >= 1 dim); got "
                    f"shape {tuple(leaf.shape)}, layout {leaf.layout}"
                )
        lengths = [leaf.shape[0] for leaf in leaves]
        if len(set(lengths)) != 1:
            raise ValueError(f"arrays must share their first dimension; got lengths {lengths}")
        self._num_samples = lengths[0]
        self._row_bytes = [leaf.numel() * leaf.element_size() // max(1, leaf.shape[0]) for leaf in leaves]
        bytes_per_sample = sum(self._row_bytes)
        if plan.num_samples != self._num_samples or plan.bytes_per_sample != bytes_per_sample:
            raise ValueError(
                f"the plan is for {plan.num_samples} samples of {plan.bytes_per_sample} bytes but "
                f"the data has {self._num_samples} samples of {bytes_per_sample} bytes; make the "
                "plan from this data"
            )
        self._dtypes = [leaf.dtype for leaf in leaves]
        self._source = [gatherable(leaf if leaf.device.type == "cpu" else leaf.cpu()) for leaf in leaves]
        self.device = torch.device(device)
        # Rows outside the device tiers cross to the device through the loader's staging; on a
        # CPU target they are gathered in place unless ``stage_host_rows`` asks for the staging
        # path there too (the same control flow, tested without a GPU).
        self._on_card = self.device.type != "cpu"  # a device tier is a copy, booked in the ledger
        self._copies = self._on_card if stage_host_rows is None else stage_host_rows
        self._plan = plan
        self._ledger = ledger
        self._owner: Hashable = owner if owner is not None else ("TieredArrayStore", id(self))
        self._lock = threading.Lock()
        self._warned = False
        self._closed = False
        self._stats = StoreStats()
        self._hits: list[int] = []
        self._kinds = dict(TIERS if tiers is None else tiers)
        self._makers: dict[str, TierMaker] = {"host": host_tier}  # tiers built otherwise than by their class
        self._placing = Placing(self.device, settings, identity)
        self._tiers: list[Tier] = []  # the plan's tiers as placed, then the source
        self._counts: list[int] = []  # rows each tier serves (a maker's tier may hold more)
        self._starts: list[int] = []  # the first row each tier serves (it serves a run of rows)
        self._streams = StreamGuard(self.device)  # orders and protects the device tier's rows
        self._place()

    # -- placement -------------------------------------------------------------------------

    def _warn(self, message: str) -> None:
        self._stats.fallbacks += 1
        if not self._warned:
            self._warned = True
            warnings.warn(f"gpuload cache: {message}", CacheFallbackWarning, stacklevel=4)

    def _place(self) -> None:
        bps = self._plan.bytes_per_sample
        first, carried = 0, 0
        for tier_plan in self._plan.tiers:
            wanted = min(tier_plan.samples + carried, tier_plan.most, self._num_samples - first)
            tier = self._allocate(tier_plan, first, wanted)
            # A tier may hold rows before ``first`` (a node's shared copy starts at the smallest
            # device tier of its ranks): those are served by the tiers before it.
            start, stop = max(first, tier.first), tier.first + tier.rows
            served = max(0, stop - start)
            carried = wanted - served if wanted > served else 0
            self._tiers.append(tier)
            self._counts.append(served)
            self._starts.append(start)
            first = start + served
        # The source serves every row the tiers before it do not (they are asked first).
        self._tiers.append(SourceTier.allocate(self._source, 0, self._num_samples, self._placing))
        self._counts.append(self._num_samples - first)
        self._starts.append(0)
        self._hits = [0] * len(self._tiers)
        device_rows = self._device_rows()
        if self._on_card and device_rows:
            self._ledger.set_used(self._owner, device_rows * bps, device=self.device)
            self._stats.fill_bytes += device_rows * bps
            self._streams.replaced([])  # later gathers, on any stream, wait for the fill

    def _allocate(self, tier_plan: TierPlan, first: int, rows: int) -> Tier:
        """The tier ``tier_plan`` names, with rows ``[first, first + rows)`` (built by its maker
        when one is given), or an empty one when it does not fit (warned)."""
        bps, name = self._plan.bytes_per_sample, tier_plan.name
        kind = self._kinds.get(name)
        if kind is None:
            raise ValueError(f"the plan names a tier {name!r} that no class is registered for "
                             f"(known: {', '.join(self._kinds)})")
        on_device = kind.on_device and self._on_card
        if on_device and rows:
            self._ledger.reserve(rows * bps, self._owner, device=self.device)
        try:
            maker = self._makers.get(name)
            if maker is not None:
                return maker(self._source, first, rows, tier_plan.most * bps)
            return kind.allocate(self._source, first, rows, self._placing)
        except RuntimeError as error:
            if not is_oom(error):
                raise
            if on_device:
                self._ledger.release(self._owner)
                self._warn(f"out of memory placing {rows} samples ({format_bytes(rows * bps)}) on "
                           f"{self.device}; they are served from the tiers after it (host memory, else the source)")
            else:
                self._warn(f"out of host memory keeping {rows} samples ({format_bytes(rows * bps)}) "
                           f"in the {name} tier; they are read from the source instead")
            return kind(first, [])

    def _device_rows(self) -> int:
        return sum(count for tier, count in zip(self._tiers, self._counts) if tier.on_device)

    def shrink(self, max_device_bytes: int) -> int:
        """Keep at most ``max_device_bytes`` on the device; the rows let go are read from the
        source. Returns the device bytes freed. Safe while another thread gathers: the rows
        a tier serves and its columns are swapped together under the lock, a gather reads both under it (the tiers'
        snapshots), and on CUDA the old storage stays protected on every stream that gathered
        from it."""
        bps = self._plan.bytes_per_sample
        device = [p for p, tier in enumerate(self._tiers) if tier.on_device]
        if self._closed or not device:
            return 0
        position = device[0]
        tier, old = self._tiers[position], self._counts[position]
        keep = max(0, min(old, max_device_bytes // bps))
        if keep >= old:
            return 0
        if not self._on_card:
            self._set_device_rows(position, tier.columns, keep)
            return 0
        kept: list[torch.Tensor] = []
        self._streams.before_replacing()
        try:
            kept = [column[:keep].clone() for column in tier.columns] if keep else []
        except RuntimeError as error:
            if not is_oom(error):
                raise
            # No room for both copies at once: serve from the source while the kept rows are
            # staged on the host and copied back into a smaller allocation.
            staged = [column[:keep].cpu() for column in tier.columns]
            self._set_device_rows(position, [], 0)
            try:
                kept = [rows.to(self.device) for rows in staged]
            except RuntimeError as again:
                if not is_oom(again):
                    raise
                kept, keep = [], 0
                self._warn(f"out of memory while shrinking the device tier on {self.device}; it is now empty")
        self._set_device_rows(position, kept, keep)
        self._ledger.reserve(keep * bps, self._owner, device=self.device)
        self._ledger.set_used(self._owner, keep * bps, device=self.device)
        return (old - keep) * bps

    def _set_device_rows(self, position: int, columns: list[torch.Tensor], count: int) -> None:
        """The device tier's rows and the count it serves swapped at once: a gather sees the old
        rows with the old count, or the new ones after waiting for them (the guard's event is set
        inside the lock); the rows let go are the source's to serve."""
        source = len(self._tiers) - 1
        with self._lock:
            tier, old = self._tiers[position], self._counts[position]
            self._counts[source] += old - count
            self._counts[position] = count
            previous = tier.columns
            tier.columns = columns
            self._streams.replaced(previous)

    def close(self) -> None:
        """Drop every tier's rows and the ledger booking. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            tiers, self._tiers = self._tiers, []
            self._counts = []
        for tier in tiers:
            if tier.on_device:
                self._streams.replaced(tier.columns)
            tier.close()
        self._source = []
        self._ledger.release(self._owner)

    def __enter__(self) -> TieredArrayStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- serving ---------------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        return self._num_samples

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def plan(self) -> CachePlan:
        """The plan asked for (after fallbacks, ``stats`` says what was actually placed)."""
        return self._plan

    def tier(self, name: str) -> Tier | None:
        """The placed tier called ``name`` (None when the store has none)."""
        with self._lock:
            return next((tier for tier in self._tiers if tier.name == name), None)

    def keyed_tiers(self, gathers: bool = True) -> list[RowsByKey]:
        """The placed tiers as they serve now, each answering the chain's keyed lookups
        (:func:`~gpuload.cache.chain.read_through`) for the run of rows it serves, the source's
        last (every row: it is asked only for those the tiers before it lack). Each gives its
        rows gathered (on a device tier, its slots moved there through the loader's staging),
        or, when not ``gathers``, its slots for :meth:`request` to gather."""
        with self._lock:
            if self._copies:
                self._streams.use()  # after the device tier's latest rows, protected on this stream
            # The rows as of the counts: a shrink from another thread swaps the device tier's
            # columns for fewer rows, which a later count would index past (a device assert on CUDA).
            placed = [(tier.snapshot(), start, start + count)
                      for tier, start, count in zip(self._tiers, self._starts, self._counts)]
        if not placed:
            raise RuntimeError("this TieredArrayStore was closed while a batch was gathered")
        *tiers, (source, _, _) = placed
        moves = self._copies and gathers
        device_slots = lambda slots: to_device([slots], self.device, self.staging)[0]  # noqa: E731
        keyed = [RowsByKey(tier, device_slots if moves and tier.on_device else None, serves=(start, stop),
                           gathers=gathers) for tier, start, stop in tiers]
        keyed.append(RowsByKey(source, gathers=gathers))
        return keyed

    @property
    def copies(self) -> bool:
        """Whether rows outside the device tiers must cross to the device (a CUDA target)."""
        return self._copies

    @property
    def all_on_device(self) -> bool:
        """Whether every row is served from the device's memory (no batch needs staging)."""
        with self._lock:
            return not self._copies or self._device_rows() == self._num_samples

    def whole_on_device(self) -> list[torch.Tensor] | None:
        """The columns (signed views, as stored) when one device tier holds every row, marked
        used on the current stream (ordered after the fill, protected against a later shrink),
        for a caller that gathers from them its own way; None when some row is elsewhere."""
        with self._lock:
            for tier, count in zip(self._tiers, self._counts):
                if tier.on_device and count == self._num_samples:
                    self._streams.use()
                    return list(tier.snapshot().columns)
        return None

    @property
    def device_bytes(self) -> int:
        with self._lock:
            return self._device_rows() * self._plan.bytes_per_sample if self._on_card else 0

    @property
    def stats(self) -> StoreStats:
        """A snapshot of the counters."""
        bps = self._plan.bytes_per_sample
        with self._lock:
            snapshot = StoreStats(**{k: v for k, v in self._stats.as_dict().items() if k != "tiers"})
            tiers = [TierCounts(count, count * bps, hits) for count, hits in zip(self._counts, self._hits)]
            names = [tier.name for tier in self._tiers]
            shared = [tier.shared_by for tier in self._tiers]
        snapshot.tiers = dict(zip(names, tiers))
        for name, counts, shared_by in zip(names, tiers, shared):
            if name == "device":
                snapshot.device_samples, snapshot.device_hits = counts.samples, counts.hits
                snapshot.device_bytes = counts.bytes if self._on_card else 0
            elif name == "host":
                snapshot.host_samples, snapshot.host_bytes = counts.samples, counts.bytes
                snapshot.host_hits = counts.hits
                snapshot.host_shared_ranks = shared_by if counts.samples else 0
            elif name == "source":
                snapshot.source_samples, snapshot.source_hits = counts.samples, counts.hits
        return snapshot

    def _check(self, indices: Any) -> torch.Tensor:
        if self._closed:
            raise RuntimeError("this TieredArrayStore was closed; build a new one to gather again")
        return in_range(indices, self._num_samples)

    def request(self, indices: Any) -> BatchRequest:
        """Rows ``indices`` split by where they live (see :class:`BatchRequest`): read through
        the store's keyed tiers (:meth:`keyed_tiers`, each giving its rows' slots).

        Device rows are gathered now, on the current stream, with one ``index_select`` per
        column and tier; host rows when the loader's staging calls ``fill_staged``. Rows are
        grouped by tier and put back in order with one final ``index_select`` (0.05 ms for 512
        rows on one CPU core, where ``index_copy_`` of 200 rows takes 1.0 ms).
        """
        flat = self._check(indices)
        keyed = self.keyed_tiers(gathers=False)
        hits, _ = read_through(keyed[:-1], flat, keyed[-1])  # the source has every row: none missing
        # Each tier's share: (depth, tier, where in the batch, its slots, how many), gathered on
        # the device now or on the host into the staging.
        on_device: list[tuple[int, Tier, torch.Tensor | None, torch.Tensor, int]] = []
        staged: list[tuple[int, Tier, torch.Tensor | None, torch.Tensor, int]] = []
        staged_rows = 0
        for depth, at, slots in hits:
            tier, count = keyed[depth].tier, flat.numel() if at is None else at.numel()
            if tier.on_device and self._copies:
                on_device.append((depth, tier, at, slots, count))
            else:
                staged.append((depth, tier, at, slots, count))
                staged_rows += count
        # Grouped (several tiers' rows, each share's ``at`` a tensor): put back in order in ``assemble``.
        order = torch.cat([at for _, _, at, _, _ in on_device + staged if at is not None]) if len(hits) > 1 else None
        columns = range(len(self._source))
        device_leaves: list[torch.Tensor] = []
        if on_device:
            moved = to_device([share[3] for share in on_device], self.device, self.staging)
            for c in columns:
                with stage(gather_stage("device")):
                    parts = [share[1].gather(c, rows) for share, rows in zip(on_device, moved)]
                device_leaves.append(parts[0] if len(parts) == 1 else torch.cat(parts))

        def fill_staged(views: list[torch.Tensor]) -> None:
            for c, view in zip(columns, views):
                begin = 0
                for _, tier, _, slots, count in staged:
                    end = begin + count
                    with stage(gather_stage(tier.name)):
                        tier.gather(c, slots, out=view[begin:end])
                    begin = end

        shapes = [((staged_rows, *source.shape[1:]), source.dtype) for source in self._source] if staged else []
        inverse = torch.argsort(order) if order is not None else None  # (grouped) host indices, moved in ``assemble``

        def assemble(device_part: list[torch.Tensor], staged_part: list[torch.Tensor]) -> Any:
            # Runs where the batch is used (the loop's thread and stream): the order it puts the
            # rows back in is moved there too, so no tensor of another stream is left unprotected.
            back = to_device([inverse], self.device, self.staging)[0] if inverse is not None else None
            leaves = []
            for c in columns:
                pieces = ([device_part[c]] if device_part else []) + ([staged_part[c]] if staged_part else [])
                if not pieces:  # an empty batch
                    source = self._source[c]
                    pieces = [torch.empty((0, *source.shape[1:]), dtype=source.dtype, device=self.device)]
                leaf = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
                if back is not None:
                    leaf = leaf.index_select(0, back)
                leaves.append(leaf.view(self._dtypes[c]))
            return tree_unflatten(leaves, self._spec)

        moved_bytes = staged_rows * sum(self._row_bytes) if self._on_card else 0
        with self._lock:
            for depth, _, _, _, count in on_device + staged:
                if depth < len(self._hits):
                    self._hits[depth] += count
            self._stats.h2d_bytes += moved_bytes
        return BatchRequest(device_leaves, shapes, fill_staged, assemble)

    def gather(self, indices: Any, copy: Copier | None = None) -> Any:
        """Rows ``indices`` of every array, in the data's structure, on the target device.

        Rows in host memory reach a CUDA device only through ``copy`` (the loader's
        prefetcher staging them); on a CPU target they are gathered in place.
        """
        request = self.request(indices)
        if not request.stages:
            return request.assemble(request.on_device, [])
        if self._copies:
            if copy is None:
                raise RuntimeError(
                    f"rows of this batch are in host memory and must be copied to {self.device} through "
                    "the loader's staging (gather(indices, copy=...)); the store copies nothing itself"
                )
            return request.assemble(request.on_device, copy(request))
        views = [torch.empty(shape, dtype=dtype) for shape, dtype in request.staged_shapes]
        request.fill_staged(views)
        return request.assemble(request.on_device, views)

    def __repr__(self) -> str:
        s = self.stats
        return (
            f"TieredArrayStore({self._num_samples} samples on {self.device}: "
            + ", ".join(f"{name} {counts.samples}" for name, counts in s.tiers.items())
            + f"{', closed' if self._closed else ''})"
        )

