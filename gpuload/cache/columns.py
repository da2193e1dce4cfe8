"""A dataset's samples stored by column: one preallocated tensor per leaf, one row per sample.

Most map-style datasets return samples of one structure: the same tree of tuples, lists, dicts
and namedtuples, with a tensor, array or number of one dtype and shape at each leaf.
:func:`prepare` reads that structure from a batch of samples (in the loop or in a worker
process) and collates each leaf exactly as torch's ``default_collate`` does; a
:class:`ColumnStore` keeps each fixed-shape leaf in one tensor (rows allocated up front for the
whole dataset, or as many as the budget holds) and writes a batch's rows with one
``index_copy_`` per leaf. A cached batch is one ``index_select`` per column. Leaves that are not
fixed-shape (strings, variable-length tensors, other objects, a subtree whose structure varies
between samples) are kept per sample for that leaf only and collated by ``default_collate``.

Why a gather equals ``default_collate`` of the samples: a column only ever holds values of
one exact type, dtype and shape, so its rows are what ``default_collate`` makes of each value;
containers are rebuilt as ``default_collate`` builds them (a tuple of leaves becomes a list).
Anything that breaks the rule turns that part of the tree into per-sample storage first.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_leaves
from torch.utils.data import default_collate
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

from gpuload.cache.budget import LEDGER, BudgetLedger, format_bytes
from gpuload.cache.oom import CacheFallbackWarning, is_oom
from gpuload.cache.sample_store import BudgetedStore, Uncacheable, copy_value
from gpuload.transfer import Staging, move_staged, to_device

__all__ = ["Branch", "Column", "ColumnStore", "Objects", "Part", "column_rows", "layout", "prepare", "rebuild",
           "worker_collate"]

_dtype = attrgetter("dtype")
_NUMBERS = (int, float, bool)
_HOST = torch.device("cpu")


# ---------------------------------------------------------------- one batch, prepared


@dataclass
class Branch:
    """A container of the same type and length (dict: keys, in order) in every sample."""

    kind: type  # tuple, list, dict or a namedtuple class
    keys: tuple[Any, ...] | int  # a dict's keys, else the length
    children: list[Part]

    def batch(self) -> Any:
        return _build(self.kind, self.keys, [child.batch() for child in self.children])


@dataclass
class Column:
    """A leaf whose values share one exact type (and dtype): ``rows`` is their default_collate."""

    kind: type  # torch.Tensor, np.ndarray, int, float, bool or a numpy scalar type
    dtype: Any  # the values' own dtype (tensors, arrays), else None
    rows: torch.Tensor

    def batch(self) -> torch.Tensor:
        return self.rows


@dataclass
class Objects:
    """A leaf (or subtree) kept per sample: ``values`` as torch hands them to collate."""

    values: Sequence[Any]

    def batch(self) -> Any:
        return default_collate(self.values)


Part = Branch | Column | Objects


def _stack_as_in_worker(batch: Sequence[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
    """Tensors stacked as torch's ``default_collate`` stacks them in a worker process: into an
    output of the first tensor's dtype (so float32 and float64 samples give float32, where the
    main process promotes to float64), raising what torch raises there."""
    elem = batch[0]
    if elem.is_nested or elem.layout != torch.strided:
        return collate_tensor_fn(batch)  # torch's own error for nested and sparse tensors
    return torch.stack(batch, 0, out=elem.new_empty((len(batch), *elem.shape)))


_WORKER_COLLATE_MAP = {**default_collate_fn_map, torch.Tensor: _stack_as_in_worker}


def worker_collate(batch: Sequence[Any]) -> Any:
    """``default_collate`` as it runs in a DataLoader worker process (see ``_stack_as_in_worker``):
    what a cache serving a loader with workers collates per-sample leaves with in the main process."""
    return collate(batch, collate_fn_map=_WORKER_COLLATE_MAP)


def _build(kind: type, keys: tuple[Any, ...] | int, children: list[Any]) -> Any:
    """A batch container from its collated children, as default_collate builds it."""
    if kind is dict:
        return dict(zip(keys, children))  # type: ignore[arg-type]
    if kind is tuple or kind is list:
        return children  # default_collate turns a tuple of leaves into a list too
    return kind(*children)  # a namedtuple


def _is_namedtuple(kind: type) -> bool:
    return issubclass(kind, tuple) and hasattr(kind, "_fields")


def _branch(values: Sequence[Any], kind: type) -> Branch | None:
    """The values as one container shape, with each child's values, or None if they differ."""
    first = values[0]
    if not first or set(map(type, values)) != {kind}:  # an empty container is kept per sample
        return None
    if kind is dict:
        keys = tuple(first)
        if set(map(tuple, values)) != {keys}:
            return None
        return Branch(kind, keys, [prepare([value[key] for value in values]) for key in keys])
    try:
        children = list(zip(*values, strict=True))  # tuples, as torch hands them to collate
    except ValueError:  # lengths differ
        return None
    return Branch(kind, len(first), [prepare(child) for child in children])


def _column(values: Sequence[Any], kind: type) -> Column | None:
    """The values as one column, or None when they are not all one fixed-shape kind."""
    if set(map(type, values)) != {kind}:
        return None
    dtype = None
    if kind is torch.Tensor or kind is np.ndarray:
        dtypes = set(map(_dtype, values))
        if len(dtypes) != 1:
            return None
        dtype = dtypes.pop()
        if kind is np.ndarray and dtype.kind not in "biufc":
            return None
    elif kind not in _NUMBERS and not (issubclass(kind, np.generic) and np.dtype(kind).kind in "biufc"):
        return None
    try:
        rows = default_collate(values)
    except Exception:  # noqa: BLE001 - kept per sample, where default_collate raises it again
        return None
    if type(rows) is not torch.Tensor or rows.requires_grad or rows.layout != torch.strided:
        return None
    if rows.device.type != "cpu" or rows.is_conj() or rows.is_neg():
        return None
    return Column(kind, dtype, rows)


def prepare(values: Sequence[Any]) -> Part:
    """A batch of samples (or of one leaf's values) split along their common structure.

    ``prepare(samples).batch()`` equals ``default_collate(samples)``; picklable, so a worker
    process can prepare its batch and send the columns instead of every sample.
    """
    kind = type(values[0])
    if kind in (tuple, list, dict) or _is_namedtuple(kind):
        part = _branch(values, kind)
    else:
        part = _column(values, kind)
    return part if part is not None else Objects(values)


def layout(part: Part) -> Hashable | None:
    """What a prepared batch looks like apart from its length: its containers and each column's
    kind, dtype and row shape; None when some leaf is kept per sample. Batches of one layout
    join by column into what ``default_collate`` makes of all their samples together."""
    if isinstance(part, Branch):
        children = tuple(layout(child) for child in part.children)
        return None if None in children else (part.kind, part.keys, children)
    if isinstance(part, Column):
        return part.kind, part.dtype, part.rows.dtype, tuple(part.rows.shape[1:])
    return None


def column_rows(part: Part) -> list[torch.Tensor]:
    """The rows of every column of a prepared batch, depth first (the order ``rebuild`` takes)."""
    if isinstance(part, Branch):
        return [rows for child in part.children for rows in column_rows(child)]
    return [part.rows] if isinstance(part, Column) else []


def rebuild(template: Part, rows: Sequence[torch.Tensor]) -> Any:
    """The batch ``default_collate`` makes when its columns (in ``column_rows`` order) are
    ``rows``, in the structure of ``template`` (a prepared batch of the same layout)."""
    return _rebuilt(template, iter(rows))


def _rebuilt(part: Part, rows: Iterator[torch.Tensor]) -> Any:
    if isinstance(part, Branch):
        return _build(part.kind, part.keys, [_rebuilt(child, rows) for child in part.children])
    return next(rows)


# ---------------------------------------------------------------- the store


class _Stored:
    """A node of the stored tree. ``gather``: the collated batch of rows ``slots``;
    ``views``: fresh per-sample values of those rows."""

    def gather(self, slots: torch.Tensor, where: torch.Tensor, collate: Callable[[Any], Any]) -> Any:
        """``collate``: what per-sample leaves are collated with (``default_collate`` as the
        loader's torch path runs it: in this process, or ``worker_collate``)."""
        raise NotImplementedError

    def views(self, slots: torch.Tensor, where: torch.Tensor) -> list[Any]:
        raise NotImplementedError


@dataclass
class _StoredColumn(_Stored):
    kind: type
    dtype: Any
    rows: torch.Tensor  # (capacity, *shape)
    _records: np.ndarray | None = None  # host rows seen by numpy as one record each

    def place(self, rows: torch.Tensor) -> None:
        """Keep ``rows`` as the column's storage. On the host, numpy also sees each row as one
        record: writing scattered rows is then one copy per row (3x faster than ``index_copy_``)."""
        self.rows = rows
        self._records = None
        row_bytes = rows[0].numel() * rows.element_size() if rows.shape[0] else 0
        if rows.device.type == "cpu" and row_bytes:
            try:
                self._records = rows.numpy().reshape(rows.shape[0], -1).view(np.dtype((np.void, row_bytes)))[:, 0]
            except (TypeError, RuntimeError, ValueError):  # dtypes numpy lacks (bfloat16, ...)
                self._records = None

    def write(self, where: np.ndarray, source: torch.Tensor) -> None:
        """Rows ``where`` (host integers) = ``source`` (a batch of rows), both where the column
        lives (see :func:`_write_columns`)."""
        if self._records is not None:
            record = self._records.dtype
            self._records[where] = source.contiguous().numpy().reshape(source.shape[0], -1).view(record)[:, 0]
        else:
            self.rows.index_copy_(0, torch.from_numpy(where).to(torch.int64), source)

    def matches(self, part: Part) -> bool:
        return (
            isinstance(part, Column) and part.kind is self.kind and part.dtype == self.dtype
            and part.rows.dtype == self.rows.dtype and part.rows.shape[1:] == self.rows.shape[1:]
        )

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def gather(self, slots: torch.Tensor, where: torch.Tensor, collate: Callable[[Any], Any]) -> torch.Tensor:
        return self.rows.index_select(0, slots if self.rows.device == slots.device else where)  # as _select

    def views(self, slots: torch.Tensor, where: torch.Tensor) -> list[Any]:
        return _values_of(self._select(slots, where), self.kind, self.dtype)

    def _select(self, slots: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """Rows ``slots`` (host) or ``where`` (the same on the store's device), whichever is
        where this column lives."""
        return self.rows.index_select(0, slots if self.rows.device == slots.device else where)


def _values_of(rows: torch.Tensor, kind: type, dtype: Any) -> list[Any]:
    """The per-sample values whose default_collate is ``rows``, each a fresh object of the
    type the dataset returned (``dtype``: an array's own dtype)."""
    if kind is torch.Tensor:
        return list(rows.unbind(0))
    if kind in _NUMBERS:
        return rows.tolist()
    array = rows.cpu().numpy()
    if kind is np.ndarray:
        array = array.astype(dtype, copy=False)
        return [array[i, ...] for i in range(len(array))]  # ``...``: a 0-d array stays an array
    values = list(array)  # numpy scalars of the dtype's own type
    return values if array.dtype.type is kind else [kind(value) for value in values]


@dataclass
class _StoredObjects(_Stored):
    sequence: type  # tuple or list: what torch hands collate at this position
    device: torch.device  # where its tensors are kept
    values: list[Any]  # by slot
    sizes: list[int]  # bytes by slot

    def gather(self, slots: torch.Tensor, where: torch.Tensor, collate: Callable[[Any], Any]) -> Any:
        values = self.values
        return collate(self.sequence([values[s] for s in slots.tolist()]))

    def views(self, slots: torch.Tensor, where: torch.Tensor) -> list[Any]:
        return [copy_value(self.values[s], self.device)[0] for s in slots.tolist()]


@dataclass
class _StoredBranch(_Stored):
    kind: type
    keys: tuple[Any, ...] | int
    children: list[_Stored] = field(default_factory=list)

    def matches(self, part: Part) -> bool:
        return isinstance(part, Branch) and part.kind is self.kind and part.keys == self.keys

    def gather(self, slots: torch.Tensor, where: torch.Tensor, collate: Callable[[Any], Any]) -> Any:
        return _build(self.kind, self.keys, [child.gather(slots, where, collate) for child in self.children])

    def views(self, slots: torch.Tensor, where: torch.Tensor) -> list[Any]:
        return _samples(self.kind, self.keys, [child.views(slots, where) for child in self.children])


def _samples(kind: type, keys: tuple[Any, ...] | int, children: list[list[Any]]) -> list[Any]:
    """Per-sample containers from each child's per-sample values (the inverse of a transpose)."""
    rows = zip(*children)
    if kind is dict:
        return [dict(zip(keys, row)) for row in rows]  # type: ignore[arg-type]
    if kind is tuple:
        return list(rows)
    if kind is list:
        return list(map(list, rows))
    return [kind(*row) for row in rows]


def _part_values(part: Part) -> list[Any]:
    """The per-sample values a prepared part was made from (fresh for columns)."""
    if isinstance(part, Objects):
        return list(part.values)
    if isinstance(part, Column):
        return _values_of(part.rows, part.kind, part.dtype)
    return _samples(part.kind, part.keys, [_part_values(child) for child in part.children])


@dataclass
class _Write:
    """What one batch puts into the store: rows per column, values per per-sample leaf."""

    columns: list[tuple[_StoredColumn, torch.Tensor]] = field(default_factory=list)
    objects: list[tuple[_StoredObjects, list[Any], list[int | None]]] = field(default_factory=list)
    changed: bool = False  # part of the stored tree became per-sample storage

    def move_objects(self, device: torch.device, staging: Staging | None) -> None:
        """The per-sample values' tensors moved to ``device``, all in one copy through
        ``staging`` (the loader's)."""
        moved = move_staged([values for _, values, _ in self.objects], device, staging)
        self.objects = [(node, values, sizes) for (node, _, sizes), values in zip(self.objects, moved)]


class ColumnStore(BudgetedStore):
    """A map-style dataset's samples by column (see the module docstring), up to ``budget_bytes``.

    The first batch put shows the structure; the columns are then allocated for all
    ``num_samples`` rows when they fit the budget (and ``room()``), else for as many as fit.
    Rows are handed out in the order samples arrive; ``slot_of`` (host memory) maps a dataset
    index to its row, -1 while it is not stored: the presence map. On a CUDA ``device`` the
    columns live there and the bytes are booked in ``ledger``. Host columns are pageable: a
    batch gathered from them is a new tensor, copied to a device through the prefetcher's
    pinned slots, so pinning the columns would buy nothing. ``collate``: what ``gather``
    collates per-sample leaves with, ``default_collate`` as torch runs it for the loader (in its
    process, or in a worker: ``worker_collate``). ``views_only``: the store serves per-sample
    values (``views``, for a collate_fn that is not ``default_collate``) and never collated
    batches; its columns of numbers and numpy values, which a view returns as host objects, are
    then kept in host memory (counted in the same budget), so a view copies nothing back from
    the device: no host sync per batch. ``staging``: the route by which every host tensor the
    store puts on a device goes there (the loader's: its prefetcher's pinned slots and side
    stream; None: one pinned copy on the current stream, for a store used outside a loader).
    """

    def __init__(
        self,
        budget_bytes: int,
        num_samples: int,
        device: torch.device | str = "cpu",
        *,
        ledger: BudgetLedger = LEDGER,
        owner: Hashable | None = None,
        room: Callable[[], int] | None = None,
        collate: Callable[[Any], Any] = default_collate,
        views_only: bool = False,
        staging: Staging | None = None,
    ) -> None:
        super().__init__(budget_bytes, device, ledger=ledger, owner=owner, room=room, num_samples=num_samples)
        self.collate = collate
        self.staging = staging
        self._views_only = views_only
        self._slot_dtype = torch.int32 if num_samples < 2**31 else torch.int64
        self._slot_of = torch.full((num_samples,), -1, dtype=self._slot_dtype)
        self._host_bytes = self._slot_of.numel() * self._slot_of.element_size() if self._device.type == "cpu" else 0
        self._stats.bytes = self._host_bytes
        self._root: _Stored | None = None
        self._capacity = 0
        self._used = 0
        self._short_of_room = False  # free memory (``room``), not the budget, limits the rows
        self.layout = "nothing stored yet"

    # ------------------------------------------------------------ lookups

    def slots(self, keys: torch.Tensor, in_range: bool = False) -> torch.Tensor:
        """The row of each dataset index in ``keys`` (int64), -1 where it is not stored (int32
        or int64 rows). ``in_range``: the keys are known to lie in ``[0, num_samples)``. Under
        the store's lock: a row is seen only once it is written (another thread may be filling)."""
        with self._lock:
            n = self._slot_of.numel()
            if self._closed:
                return torch.full_like(keys, -1, dtype=self._slot_dtype)
            if not in_range and not self._inside(keys):
                inside = (keys >= 0) & (keys < n)
                found = torch.full_like(keys, -1, dtype=self._slot_dtype)
                found[inside] = self._slot_of[keys[inside]]
                return found
            return self._slot_of.index_select(0, keys)

    def _inside(self, keys: torch.Tensor) -> bool:
        """Whether every key is a dataset index in ``[0, num_samples)``."""
        if not keys.numel() or self._closed:
            return not keys.numel()
        at = keys.numpy()  # numpy's min/max: no thread pool to wake for a few hundred keys
        return int(at.min()) >= 0 and int(at.max()) < self._slot_of.numel()

    def __contains__(self, index: object) -> bool:
        return isinstance(index, (int, np.integer)) and 0 <= int(index) < self._slot_of.numel() and int(
            self._slot_of[int(index)]) >= 0

    def count(self, hits: int, misses: int) -> None:
        """Add lookups to the hit and miss counters."""
        self._stats.hits += hits
        self._stats.misses += misses

    def gather(self, indices: torch.Tensor) -> Any:
        """``default_collate`` of the stored samples at dataset ``indices`` (int64); an index not
        stored raises ``IndexError`` naming it."""
        self._check_open()
        slots = self.slots(indices)
        missing = (slots < 0).nonzero().view(-1)
        if missing.numel():
            raise IndexError(f"dataset index {int(indices[missing[0]])} is not in this cache")
        return self.gather_rows(slots)

    def gather_rows(self, slots: torch.Tensor) -> Any:
        """``default_collate`` of the stored samples in rows ``slots`` (all >= 0): one
        ``index_select`` per column, on the store's device."""
        with self._lock:
            self._check_open()
            self._check_collates()
            self._streams.use()
            return self._root.gather(slots, self._where(slots), self.collate)

    def views(self, slots: torch.Tensor) -> list[Any]:
        """Fresh copies of the stored samples in rows ``slots``, for a collate_fn of the user's."""
        with self._lock:
            self._check_open()
            self._streams.use()
            return self._root.views(slots, self._where(slots))

    def _where(self, slots: torch.Tensor) -> torch.Tensor:
        return slots if self._device.type == "cpu" else to_device([slots], self._device, self.staging)[0]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this gpuload.DataLoader's sample cache was closed; iterate the loader again")

    def _check_collates(self) -> None:
        if self._views_only:
            raise RuntimeError("this ColumnStore was made with views_only=True (its number and array columns are in "
                               "host memory): it serves per-sample values (views), not collated batches")

    def assemble(self, slots: torch.Tensor, part: Part) -> Any | None:
        """``default_collate`` of a batch whose rows ``slots >= 0`` are stored and whose other
        samples were read (``part``, prepared from them in order): cached rows gathered, the
        rest placed between them. None when ``part`` does not fit the stored columns."""
        with self._lock:
            self._check_open()
            self._check_collates()
            self._streams.use()
            hit = (slots >= 0).nonzero().view(-1)
            miss = (slots < 0).nonzero().view(-1)
            at = (slots.index_select(0, hit), hit, miss)
            read = column_rows(part)
            moved = to_device([*at, *read], self._device, self.staging)  # one copy
            read_device = dict(zip(map(id, read), moved[3:]))
            return _merge(self._root, part, at, (tuple(moved[:3]), read_device), self._device, self.collate,
                          self.staging)

    # ------------------------------------------------------------ filling

    def put(self, keys: torch.Tensor, part: Part) -> int:
        """Store the samples of ``part`` (prepared from them, in order) under dataset indices
        ``keys``; returns how many were stored now. Parts of the stored tree that the new
        samples do not fit are turned into per-sample storage first. Keys out of range, or
        stored already (another thread may fill the same samples), are not stored again."""
        with self._lock:
            if self._closed or self._stats.full or self.complete:
                self._stats.rejected += keys.numel()
                return 0
            self._streams.use()  # the rows are written on this stream
            write = _Write()
            first_batch = self._root is None
            try:
                root = _stored_tree(part, list, self._device) if first_batch else self._root
                try:
                    self._root = self._plan(root, part, write, list)
                finally:  # leaves turned per-sample stay so, also when a later one fails
                    if write.changed:
                        self.layout = _describe(self._root, self._capacity, self._slot_of.numel(), "changed: ")
                if first_batch:
                    self._allocate(write, keys.numel())
                if self._device.type != "cpu" and write.objects:
                    write.move_objects(self._device, self.staging)
                stored = self._write(keys, write)
                why = f"free memory on {self._device} reached the reserve" if (
                    self._stats.full and self._short_of_room) else None
            except RuntimeError as error:
                if not is_oom(error):
                    raise
                stored, why = -1, f"out of memory on {self._device}"
            first = why is not None and self._stop_filling()
        if first:
            self._warn_stopped(why)
        if stored < 0:
            return 0
        self._book()
        if self.complete:
            self.settle()
        return stored

    def _allocate(self, write: _Write, batch: int) -> None:
        """Rows for the first batch's structure: every sample's when the budget holds them
        (the per-sample leaves counted as the first batch's average), else as many as fit."""
        columns = _columns_of(self._root)
        row_bytes = sum(c.rows.element_size() * c.rows[0].numel() for c in columns)
        object_bytes = sum(sum(n or 0 for n in sizes) for _, _, sizes in write.objects) // max(batch, 1)
        room = budget = self._budget - self._stats.bytes
        if self._room is not None:
            room = min(room, self._room())
        per_row = row_bytes + object_bytes
        capacity = self._slot_of.numel() if per_row == 0 else max(0, min(self._slot_of.numel(), room // per_row))
        self._short_of_room = per_row > 0 and room < budget and capacity < self._slot_of.numel()
        while True:
            try:
                for column in columns:
                    shape = (capacity, *column.rows.shape[1:])
                    on_host = self._views_only and column.kind is not torch.Tensor
                    column.place(torch.empty(shape, dtype=column.rows.dtype, device=_HOST if on_host else self._device))
                break
            except RuntimeError as error:  # out of memory: as many rows as can be allocated
                if not is_oom(error) or capacity == 0:
                    raise
                capacity //= 2
                self._short_of_room = True
        for node in _objects_of(self._root):
            node.values, node.sizes = [None] * capacity, [0] * capacity
        self._capacity = capacity
        self._stats.bytes += sum(column.nbytes for column in columns)
        self.layout = _describe(self._root, capacity, self._slot_of.numel())
        if capacity == 0:
            self._stats.full = True

    def _plan(self, node: _Stored, part: Part, write: _Write, sequence: type) -> _Stored:
        """Match ``part`` to the stored ``node``; returns the node (turned per-sample where the
        part does not fit it) and notes in ``write`` what to store."""
        if isinstance(node, _StoredBranch) and node.matches(part):
            child_sequence = list if node.kind is dict else tuple
            for position, (child, child_part) in enumerate(zip(node.children, part.children)):
                # In place: a child turned per-sample (and counted so) stays in the tree even if
                # a later child's turn runs out of memory.
                node.children[position] = self._plan(child, child_part, write, child_sequence)
            return node
        if isinstance(node, _StoredColumn) and node.matches(part):
            write.columns.append((node, part.rows))
            return node
        if not isinstance(node, _StoredObjects):
            turned = self._per_sample(node, sequence)
            if node is self._root:
                self._root = turned
            node = turned
            write.changed = True
        copies, sizes = [], []
        for value in _part_values(part):
            try:
                copied, nbytes = copy_value(value, _HOST)
            except Uncacheable:
                copied, nbytes = None, None
            copies.append(copied)
            sizes.append(nbytes)
        write.objects.append((node, copies, sizes))  # host copies, moved by ``put`` once the tree is planned
        return node

    def _per_sample(self, node: _Stored, sequence: type) -> _StoredObjects:
        """``node`` turned into per-sample storage, its stored rows kept (lock held)."""
        slots = torch.arange(self._used, dtype=self._slot_dtype)
        values = node.views(slots, self._where(slots)) if self._used else []
        sizes = [copy_value(value, torch.device("cpu"))[1] if not isinstance(value, torch.Tensor)
                 else value.numel() * value.element_size() for value in values]
        freed = sum(column.nbytes for column in _columns_of(node))
        self._stats.bytes += sum(sizes) - freed
        room = self._capacity - self._used
        return _StoredObjects(sequence, self._device, values + [None] * room, sizes + [0] * room)

    def _write(self, keys: torch.Tensor, write: _Write) -> int:
        """Give the new samples rows and write them (lock held); how many were stored."""
        if not write.objects and self._inside(keys):
            stored = self._write_new(keys, write)
            if stored:
                return stored
        n = keys.numel()
        limit = self._slot_of.numel()
        inside = (keys >= 0) & (keys < limit)
        if not bool(inside.all()):
            keys = keys.where(inside, 0)
        current = self._slot_of.index_select(0, keys)
        new = (current < 0) & inside
        extra = None
        if write.objects:
            extra = [sum(sizes[i] for _, _, sizes in write.objects) if all(
                sizes[i] is not None for _, _, sizes in write.objects) else None for i in range(n)]
            cacheable = torch.tensor([nbytes is not None for nbytes in extra])
            self._stats.uncacheable += int((new & ~cacheable).sum())
            new &= cacheable
        fresh = keys[new].unique()
        room = self._capacity - self._used
        take = min(fresh.numel(), room)
        if extra is not None:
            take = self._objects_fit(keys, new, fresh, take, extra)
        if take < fresh.numel():
            self._stats.full = True
            self._stats.rejected += fresh.numel() - take
            fresh = fresh[:take]
        if take:
            self._slot_of[fresh] = torch.arange(self._used, self._used + take, dtype=self._slot_dtype)
            self._used += take
        slots = self._slot_of.index_select(0, keys)
        ok = (slots >= 0) & new
        if not take:
            return 0
        everyone = bool(ok.all())
        positions = None if everyone else ok.nonzero().view(-1)
        target = slots if everyone else slots.index_select(0, positions)
        writes = [(column, rows if everyone else rows.index_select(0, positions)) for column, rows in write.columns]
        try:
            _write_columns(writes, target.numpy(), self._device, self.staging)
        except BaseException:  # an out of memory too: no key may name a row that was not written
            self._slot_of[fresh] = -1
            self._used -= take
            raise
        if write.objects:
            chosen = range(n) if everyone else positions.tolist()
            seen = set()
            for slot, position in zip(target.tolist(), chosen):
                if slot in seen:  # a sample drawn twice in one batch
                    continue
                seen.add(slot)
                for node, values, sizes in write.objects:
                    node.values[slot] = values[position]
                    node.sizes[slot] = sizes[position]
                self._stats.bytes += extra[position]
                self._added(extra[position])
        self._stats.entries = self._used
        return take

    def _write_new(self, keys: torch.Tensor, write: _Write) -> int:
        """The usual case, in a few tensor operations: distinct keys, none stored yet, all in
        range, room for all, columns only. 0 (nothing changed) when that is not the case."""
        n = keys.numel()
        slot_of, at = self._slot_of.numpy(), keys.numpy()  # numpy: a few microseconds per step
        # Checked here, under the lock, even when the caller just found none stored: another
        # thread filling the same samples may have stored some since (each is stored once).
        if self._capacity - self._used < n or slot_of[at].max() >= 0:
            return 0
        rows = np.arange(self._used, self._used + n, dtype=slot_of.dtype)
        slot_of[at] = rows
        if not np.array_equal(slot_of[at], rows):
            slot_of[at] = -1  # a key drawn twice: the general path
            return 0
        try:
            _write_columns(write.columns, rows, self._device, self.staging)
        except BaseException:  # an out of memory too: no key may name a row that was not written
            slot_of[at] = -1
            raise
        self._used += n
        self._stats.entries = self._used
        return n

    def _objects_fit(self, keys: torch.Tensor, new: torch.Tensor, fresh: torch.Tensor, take: int,
                     extra: list[int]) -> int:
        """How many of the ``fresh`` keys' per-sample values fit the budget and room."""
        first_position = {}
        for position, (key, is_new) in enumerate(zip(keys.tolist(), new.tolist())):
            if is_new and key not in first_position:
                first_position[key] = position
        total = 0
        for count, key in enumerate(fresh[:take].tolist()):
            nbytes = extra[first_position[key]]
            if self._stats.bytes + total + nbytes > self._budget:
                return count
            if not self._has_room(total + nbytes):
                self._short_of_room = True
                return count
            total += nbytes
        return take

    # ------------------------------------------------------------ giving memory back

    def shrink(self, max_device_bytes: int) -> int:
        """Keep the first rows that fit ``max_device_bytes`` (in a new, smaller allocation) and
        stop adding; returns the bytes freed. Dropped samples are read from the source again.
        Without memory for the smaller copy beside the old rows, the kept rows go through host
        memory; without memory even then, the store is emptied (with a warning)."""
        max_bytes = max_device_bytes
        with self._lock:
            if self._root is None or self._stats.bytes <= max_bytes:
                return 0
            columns = _columns_of(self._root)
            objects = _objects_of(self._root)
            row_bytes = sum(c.rows[0].numel() * c.rows.element_size() for c in columns) if self._capacity else 0
            keep, held = 0, self._host_bytes
            while keep < self._used:
                nbytes = row_bytes + sum(node.sizes[keep] for node in objects)
                if held + nbytes > max_bytes:
                    break
                held += nbytes
                keep += 1
            before = self._stats.bytes
            # The copy waits (on the device) for rows still being written or read on other
            # streams; the old rows stay reserved until those streams are done with them.
            self._streams.before_replacing()
            try:
                kept = self._kept_rows(columns, keep)
            except BaseException:
                if columns and columns[0].rows.shape[0] == 0:  # the old rows were let go: none is held
                    self._keep_first(0, objects, row_bytes)
                raise
            emptied = kept is None
            if emptied:
                keep = 0
            else:
                for column, rows in zip(columns, kept):
                    column.place(rows)
            self._keep_first(keep, objects, row_bytes)
            freed = before - self._stats.bytes
        if emptied:
            warnings.warn(f"gpuload cache: out of memory while shrinking the sample cache on {self._device}; it is "
                          "now empty and its samples are read from the dataset", CacheFallbackWarning, stacklevel=2)
        if freed:
            self._book()
        return freed

    def _kept_rows(self, columns: list[_StoredColumn], keep: int) -> list[torch.Tensor] | None:
        """Each column's first ``keep`` rows in a new allocation, the old rows let go (lock held;
        the caller places them). Without room for both copies at once, the kept rows are staged
        in host memory and copied back once the old rows are let go (on CUDA the allocator frees
        rows that other streams used once those streams are done, waiting for them before it
        reports out of memory); None when even that finds no room, the columns then holding no
        rows. Every column ends with its ``keep`` rows or, after None or an error raised once
        the old rows were let go, with none: never some shrunk and some not."""
        old = [column.rows for column in columns]
        try:
            kept = [rows[:keep].clone() for rows in old]
        except RuntimeError as error:
            if not is_oom(error):
                raise
        else:
            self._streams.replaced(old)
            return kept
        staged = [rows[:keep].to(_HOST, copy=True) for rows in old]  # out of memory here: nothing changed
        self._streams.replaced(old)
        for column in columns:
            column.place(column.rows.new_empty((0, *column.rows.shape[1:])))
        old.clear()  # the last references: the allocator may now reuse the old rows
        try:
            kept = [rows.to(column.rows.device) for rows, column in zip(staged, columns)]  # host columns stay there
        except RuntimeError as error:
            if not is_oom(error):
                raise
            return None
        self._streams.replaced([])  # later uses wait for the rows copied back
        return kept

    def _keep_first(self, keep: int, objects: list[_StoredObjects], row_bytes: int) -> None:
        """Only the samples in the first ``keep`` slots stay stored, and no more are added (lock
        held; the columns hold ``keep`` rows already). The per-sample tensors let go stay
        reserved, as the old rows do, until the streams that used them are done."""
        dropped = [leaf for node in objects for value in node.values[keep:]
                   for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]
        if dropped:
            self._streams.replaced(dropped)
        for node in objects:
            node.values, node.sizes = node.values[:keep], node.sizes[:keep]
        self._slot_of[self._slot_of >= keep] = -1
        self._capacity = self._used = self._stats.entries = keep
        self._stats.bytes = self._host_bytes + row_bytes * keep + sum(sum(node.sizes) for node in objects)
        self._stats.full = True

    def _drop(self) -> None:
        self._root = None
        self._slot_of = torch.empty(0, dtype=torch.int64)
        self._capacity = self._used = 0

    def describe(self) -> str:
        """One line: how the samples are stored (by column, per sample, and why)."""
        return self.layout


# ---------------------------------------------------------------- tree helpers


def _stored_tree(part: Part, sequence: type, device: torch.device) -> _Stored:
    """An empty stored tree shaped like a prepared batch (columns sized later)."""
    if isinstance(part, Branch):
        child_sequence = list if part.kind is dict else tuple
        return _StoredBranch(part.kind, part.keys, [_stored_tree(c, child_sequence, device) for c in part.children])
    if isinstance(part, Column):
        return _StoredColumn(part.kind, part.dtype, part.rows[:1])
    return _StoredObjects(sequence, device, [], [])


def _leaves_of(node: _Stored, kind: type) -> list[Any]:
    """The stored leaves of one kind (``_StoredColumn`` or ``_StoredObjects``), in tree order."""
    if isinstance(node, _StoredBranch):
        return [leaf for child in node.children for leaf in _leaves_of(child, kind)]
    return [node] if isinstance(node, kind) else []


def _columns_of(node: _Stored) -> list[_StoredColumn]:
    return _leaves_of(node, _StoredColumn)


def _objects_of(node: _Stored) -> list[_StoredObjects]:
    return _leaves_of(node, _StoredObjects)


def _describe(node: _Stored, capacity: int, num_samples: int, prefix: str = "") -> str:
    """How the samples are stored, in one line for ``stats.extra["sample_cache_decision"]``."""
    columns, objects = _columns_of(node), _objects_of(node)
    if not columns:
        return prefix + (
            "per sample: no leaf of the samples has one fixed-shape type (tensors, arrays, numbers) "
            "in containers of one structure (tuples, lists, dicts, namedtuples)"
        )
    row = sum(c.rows[0].numel() * c.rows.element_size() for c in columns) if capacity else 0
    shapes = ", ".join(f"{str(c.rows.dtype).removeprefix('torch.')}{list(c.rows.shape[1:])}" for c in columns)
    rows = "every sample" if capacity == num_samples else f"{capacity} of {num_samples} samples"
    kept = f", {len(objects)} leaf(s) per sample" if objects else ""
    return f"{prefix}by column: {len(columns)} column(s) [{shapes}], {format_bytes(row)} per row, rows for {rows}{kept}"


def _write_columns(writes: list[tuple[_StoredColumn, torch.Tensor]], where: np.ndarray, device: torch.device,
                   staging: Staging | None) -> None:
    """Each column's rows ``where`` (host integers) = its host batch of rows. On a device the
    positions and every column's rows get there in one copy through ``staging``."""
    on_device = [(column, source) for column, source in writes if column.rows.device.type != "cpu"]
    for column, source in writes:
        if column.rows.device.type == "cpu":
            column.write(where, source)
    if not on_device:
        return
    index, *moved = to_device([torch.from_numpy(where).to(torch.int64), *(source for _, source in on_device)], device,
                              staging)
    for (column, _), rows in zip(on_device, moved):
        column.rows.index_copy_(0, index, rows)


def _merge(node: _Stored, part: Part, at: tuple[torch.Tensor, ...],
           on_device: tuple[tuple[torch.Tensor, ...], dict[int, torch.Tensor]], device: torch.device,
           collate: Callable[[Any], Any], staging: Staging | None) -> Any | None:
    """default_collate of cached rows and read samples (``part``), leaf by leaf; None where the
    read samples do not fit a column. ``at``: (rows of the cached samples, their positions in
    the batch, the read samples' positions), on the host; ``on_device``: the same on
    ``device``, and the read columns' rows there (by ``id`` of the host rows); ``collate``: the
    store's, for per-sample leaves; ``staging``: the read per-sample values' route to ``device``."""
    if isinstance(node, _StoredBranch):
        if not node.matches(part):
            return None
        children = [_merge(c, p, at, on_device, device, collate, staging) for c, p in zip(node.children, part.children)]
        if any(child is None for child in children):
            return None
        return _build(node.kind, node.keys, children)
    hit_slots, hit, miss = at
    if isinstance(node, _StoredColumn):
        if not node.matches(part):
            return None
        rows = node.rows
        out = torch.empty((hit.numel() + miss.numel(), *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
        (slots_there, hit_there, miss_there), read_there = on_device
        out.index_copy_(0, hit_there, rows.index_select(0, slots_there))
        out.index_copy_(0, miss_there, read_there[id(part.rows)])
        return out
    read = _part_values(part)
    if device.type != "cpu":
        read = move_staged(read, device, staging)
    values: list[Any] = [None] * (hit.numel() + miss.numel())
    for position, slot in zip(hit.tolist(), hit_slots.tolist()):
        values[position] = node.values[slot]
    for position, value in zip(miss.tolist(), read):
        values[position] = value
    return collate(node.sequence(values))
