"""A table's columns as gpuload serves them: fixed-width ones to the array tiers, the rest per batch.

``table_columns`` walks a dataset's collated sample (torch's ``default_collate`` of one row)
beside the Arrow schema and makes one leaf per column of the batch:

- fixed-width columns (numbers, bools, fixed-size lists of them) become arrays the array tiers
  place and gather from: one chunk already in its type is a view of the memory-mapped file,
  several chunks (or a mapping) a :class:`~gpuload.cache.chunked_rows.ChunkedRows` over the
  chunks where they lie (no host copy of the whole column);
- variable-length lists keep their values and each row's start and length, and are gathered
  per batch (stacked when their lengths agree, as torch's collate stacks them);
- strings and bytes are taken per batch from the Arrow column, as lists like torch's collate.

Each leaf casts to the dtype the collated sample has (``datasets``' formats change some:
``torch`` makes ints int64 and floats float32, no format makes them Python numbers) after the
gather, so the cache keeps the narrower Arrow type. Nulls follow what the dataset's samples
give: NaN where the format gives NaN (``numpy``/``torch`` numbers), else the batch fails the
way torch's collate fails, naming the column. The built batch of the collated sample's row is
compared with torch's before anything is served: a table this cannot reproduce stays on
torch's path.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch.utils._pytree import tree_flatten
from torch.utils.data import default_collate

from gpuload.cache.chunked_rows import ChunkedRows
from gpuload.datasets.arrow import import_optional, torch_dtype
from gpuload.datasets.column_images import image_column_error
from gpuload.sources.placed_arrays import ArrayColumns
from gpuload.transfer import Staging, to_device

__all__ = ["TableColumns", "TableView", "fetch", "same_batch", "table_columns"]

# How many leading rows are tried for one whose columns are all non-null (its collated sample
# tells each column's batch type).
_TEMPLATE_ROWS = 64


@dataclass(frozen=True)
class TableView:
    """What a dataset's samples are made from: the Arrow ``table``, the table row of each sample
    (``rows``; None: sample i is row i) and the format of the sample's values (``"arrow"``:
    an ArrowTable's tensors; ``datasets``' ``"python"`` (format None), ``"numpy"`` or ``"torch"``);
    ``images``: its columns of encoded images, each with whether an image must be RGB
    (``ColumnImages.rgb_only``); ``origin``: what identifies the table besides its contents (the
    files it was read from, ``datasets``' fingerprint), None for a table made in memory."""

    table: Any
    rows: torch.Tensor | None
    format: str
    images: dict[str, bool] = dataclasses.field(default_factory=dict)
    origin: dict[str, Any] | None = None


@dataclass(frozen=True)
class Nulls:
    """A column's nulls: ``valid`` per sample; a batch holding one becomes ``dtype`` with NaN
    there (what ``datasets`` gives a number), or fails naming ``column`` when ``dtype`` is None
    (torch's collate fails on None)."""

    column: str
    valid: torch.Tensor
    dtype: torch.dtype | None

    def check(self, flat: torch.Tensor) -> torch.Tensor | None:
        """The batch's null positions (None when it has none); raises when they have no tensor form."""
        valid = self.valid[flat]
        if bool(valid.all()):
            return None
        if self.dtype is None:
            index = int(flat[~valid][0])
            raise TypeError(
                f"column {self.column!r} is null at sample {index}: the dataset gives None there, which "
                "torch's default_collate cannot batch; fill the nulls (Dataset.map) or filter those rows out"
            )
        return ~valid


class Leaf:
    """One column of the batch, made from the gathered fixed-width tensors and the indices;
    ``epoch`` numbers the epoch (the transforms' randomness), None for the check of a batch
    against torch's before serving (images untransformed)."""

    def batch(self, fixed: list[torch.Tensor], flat: torch.Tensor, device: torch.device, epoch: int | None,
              staging: Staging | None) -> Any:
        raise NotImplementedError


def _listed(tensor: torch.Tensor, depth: int) -> Any:
    """``tensor`` (batch first) as the nested lists torch's collate makes of rows of lists."""
    if depth == 0:
        return tensor
    return [_listed(column, depth - 1) for column in tensor.unbind(1)]


def _with_nulls(tensor: torch.Tensor, nulls: Nulls | None, flat: torch.Tensor, dtype: torch.dtype,
                staging: Staging | None) -> torch.Tensor:
    missing = nulls.check(flat) if nulls is not None else None
    if missing is None or nulls is None or nulls.dtype is None:
        return tensor.to(dtype)
    (where,) = to_device([missing], tensor.device, staging)
    return tensor.to(nulls.dtype).masked_fill(where.view(-1, *[1] * (tensor.dim() - 1)), float("nan"))


@dataclass
class FixedLeaf(Leaf):
    """A fixed-width column: the ``slot``-th array the tiers gather, cast to ``dtype``;
    ``depth`` levels of lists when the samples hold lists of Python numbers."""

    slot: int
    dtype: torch.dtype
    depth: int
    nulls: Nulls | None

    def batch(self, fixed: list[torch.Tensor], flat: torch.Tensor, device: torch.device, epoch: int | None,
              staging: Staging | None) -> Any:
        return _listed(_with_nulls(fixed[self.slot], self.nulls, flat, self.dtype, staging), self.depth)


@dataclass
class RaggedLeaf(Leaf):
    """A variable-length list column: ``values`` with each sample's ``starts`` and ``lengths``."""

    column: str
    values: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    dtype: torch.dtype
    listed: bool
    nulls: Nulls | None

    def batch(self, fixed: list[torch.Tensor], flat: torch.Tensor, device: torch.device, epoch: int | None,
              staging: Staging | None) -> Any:
        if self.nulls is not None:
            self.nulls.check(flat)
        starts, lengths = self.starts[flat], self.lengths[flat]
        length = int(lengths[0])
        if bool((lengths != length).any()):
            other = int(lengths[lengths != length][0])
            raise RuntimeError(
                f"column {self.column!r} holds lists of {length} and {other} values in one batch, which torch's "
                "default_collate cannot stack; pass a collate_fn that pads them (torch's DataLoader then serves)"
            )
        rows = self.values[(starts[:, None] + torch.arange(length)).reshape(-1)].view(len(flat), length)
        (rows,) = to_device([rows], device, staging)
        return _listed(rows.to(self.dtype), 1 if self.listed else 0)


@dataclass
class TextLeaf(Leaf):
    """A string or bytes column, taken per batch from Arrow; ``rows``: each sample's table row."""

    column: str
    array: Any
    rows: torch.Tensor | None
    convert: Callable[[Any], Any] | None

    def batch(self, fixed: list[torch.Tensor], flat: torch.Tensor, device: torch.device, epoch: int | None,
              staging: Staging | None) -> Any:
        pa = import_optional("pyarrow")
        rows = flat if self.rows is None else self.rows[flat]
        values = self.array.take(pa.array(rows.numpy())).to_pylist()
        if values[0] is None:  # torch's collate passes None on, unless the batch starts with one
            raise TypeError(
                f"column {self.column!r} is null at sample {int(flat[0])}: the dataset gives None there, which "
                "torch's default_collate cannot batch; fill the nulls (Dataset.map) or filter those rows out"
            )
        if self.convert is None or None in values:  # numpy holds a batch with a None as Python objects
            return values
        return [self.convert(value) for value in values]


@dataclass
class StructLeaf(Leaf):
    """A struct column: a dict of its fields' leaves (a null struct has no batch form)."""

    fields: dict[str, Leaf]
    nulls: Nulls | None

    def batch(self, fixed: list[torch.Tensor], flat: torch.Tensor, device: torch.device, epoch: int | None,
              staging: Staging | None) -> Any:
        if self.nulls is not None:
            self.nulls.check(flat)
        return {name: leaf.batch(fixed, flat, device, epoch, staging) for name, leaf in self.fields.items()}


@dataclass
class TableColumns:
    """The table's fixed-width columns for the array tiers (``arrays``) and the batch's
    structure (``root``), which completes each gathered batch."""

    arrays: ArrayColumns
    root: Leaf

    def batch(self, fixed: list[torch.Tensor], flat: torch.Tensor, device: torch.device, epoch: int | None,
              staging: Staging | None) -> Any:
        """The batch of samples ``flat`` (host int64) in ``epoch``, from the tiers' gathered ``fixed`` arrays;
        what it puts on ``device`` goes through ``staging`` (the loader's)."""
        return self.root.batch(fixed, flat.cpu(), device, epoch, staging)


def _readable(array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # Arrow's buffers are read-only; gpuload only reads them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def _list_levels(arrow_type: Any) -> tuple[Any, tuple[int, ...]]:
    """The number type inside nested fixed-size lists, and the lists' sizes."""
    pa = import_optional("pyarrow")
    shape: list[int] = []
    while pa.types.is_fixed_size_list(arrow_type):
        shape.append(arrow_type.list_size)
        arrow_type = arrow_type.value_type
    return arrow_type, tuple(shape)


def _flat_values(chunk: Any, shape: tuple[int, ...]) -> np.ndarray | None:
    """A chunk's numbers, row after row, without a copy where Arrow's layout allows (None when
    a list holds a null value: torch's collate has no batch for it)."""
    pa = import_optional("pyarrow")
    pc = import_optional("pyarrow.compute")
    values = chunk
    for size in shape:
        values = values.values.slice(values.offset * size, len(values) * size)
    if shape and values.null_count:
        return None
    if values.null_count:
        values = pc.fill_null(values, pa.scalar(False if pa.types.is_boolean(values.type) else 0, values.type))
    return values.to_numpy(zero_copy_only=False)


def _fixed_tensor(array: Any, shape: tuple[int, ...], dtype: torch.dtype,
                  rows: torch.Tensor | None) -> torch.Tensor | ChunkedRows | None:
    """The column as its samples' rows (``rows``: each sample's table row, None: row i), copying
    nothing where Arrow's layout allows: one chunk without a mapping is a view of the
    memory-mapped file; several chunks, or a mapping, are :class:`ChunkedRows` over the chunks
    where they lie, which the cache tiers copy their rows out of a piece at a time (no host copy
    of the whole column first)."""
    parts = []
    for chunk in array.chunks:
        part = _flat_values(chunk, shape)
        if part is None:
            return None
        parts.append(_readable(part).view(dtype).reshape(-1, *shape))
    if not parts:
        return torch.empty((0, *shape), dtype=dtype)
    if len(parts) == 1 and rows is None:
        return parts[0]
    return ChunkedRows(parts, rows)


def _ragged(array: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A list column's values (one copy per chunk beyond the first) and each row's start, length."""
    values, starts, lengths = [], [], []
    base = 0
    for chunk in array.chunks:
        if chunk.values.null_count:
            return None
        offsets = torch.from_numpy(chunk.offsets.to_numpy().astype(np.int64))
        values.append(_readable(chunk.values.to_numpy(zero_copy_only=False)))
        starts.append(offsets[:-1] + base)
        lengths.append(offsets[1:] - offsets[:-1])
        base += len(chunk.values)
    if not values:
        return None
    flat = values[0] if len(values) == 1 else torch.cat(values)
    return flat, torch.cat(starts), torch.cat(lengths)


def _in_sample_order(tensor: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return tensor if rows is None else tensor.index_select(0, rows)


class _Walk:
    """Makes the leaves of one table (see :func:`table_columns`)."""

    def __init__(self, dataset: Any, view: TableView) -> None:
        self.dataset = dataset
        self.view = view
        self.arrays: list[torch.Tensor | ChunkedRows] = []

    def nulls(self, name: str, array: Any, number: bool, in_struct: bool) -> Nulls | None:
        """The column's nulls; a top-level number column's batch with a null takes the dtype the
        dataset gives it (datasets' formats: NaN in a float), asked of the dataset itself."""
        if not array.null_count:
            return None
        valid = _in_sample_order(
            torch.from_numpy(array.is_valid().to_numpy(zero_copy_only=False).astype(np.bool_)), self.view.rows)
        if bool(valid.all()):  # the nulls are in rows no sample reads
            return None
        dtype = None
        if number and not in_struct:
            try:
                (row,) = fetch(self.dataset, [int(torch.nonzero(~valid)[0])])
                null = default_collate([row[name]])
            except Exception:  # whatever the dataset's or torch's fetch raises: no batch form
                null = None
            if isinstance(null, torch.Tensor) and null.is_floating_point() and bool(null.isnan().all()):
                dtype = null.dtype
        return Nulls(name, valid, dtype)

    def leaf(self, name: str, array: Any, sample: Any, in_struct: bool) -> Leaf | None:
        pa = import_optional("pyarrow")
        kind = array.type
        if isinstance(sample, dict) and pa.types.is_struct(kind):
            return self.struct(name, array, sample)
        if isinstance(sample, list) and sample and isinstance(sample[0], (str, bytes)):
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
                    or pa.types.is_large_binary(kind)):
                return None
            if any(type(value) is not type(sample[0]) for value in sample):
                return None
            convert = None if type(sample[0]) in (str, bytes) else type(sample[0])
            return TextLeaf(name, array, self.view.rows, convert)
        leaves, _ = tree_flatten(sample)
        if not leaves or not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
            return None
        dtype = leaves[0].dtype
        listed = not isinstance(sample, torch.Tensor)
        if pa.types.is_list(kind) or pa.types.is_large_list(kind):
            return self.ragged(name, array, dtype, listed, in_struct)
        number, shape = _list_levels(kind)
        stored = torch_dtype(number)
        if stored is None:
            return None
        tensor = _fixed_tensor(array, shape, stored, self.view.rows)
        if tensor is None:
            return None
        self.arrays.append(tensor)
        depth = len(shape) if listed else 0
        nulls = self.nulls(name, array, not shape, in_struct)
        return FixedLeaf(len(self.arrays) - 1, dtype, depth, nulls)

    def ragged(self, name: str, array: Any, dtype: torch.dtype, listed: bool, in_struct: bool) -> Leaf | None:
        if torch_dtype(array.type.value_type) is None:
            return None
        parts = _ragged(array)
        if parts is None:
            return None
        values, starts, lengths = parts
        rows = self.view.rows
        return RaggedLeaf(name, values, _in_sample_order(starts, rows), _in_sample_order(lengths, rows), dtype,
                          listed, self.nulls(name, array, False, in_struct))

    def struct(self, name: str, array: Any, sample: dict[str, Any]) -> Leaf | None:
        kind = array.type
        if [field.name for field in kind] != list(sample):
            return None
        fields: dict[str, Leaf] = {}
        for position, field in enumerate(kind):
            leaf = self.leaf(f"{name}.{field.name}", _field(array, position), sample[field.name], in_struct=True)
            if leaf is None:
                return None
            fields[field.name] = leaf
        return StructLeaf(fields, self.nulls(name, array, False, in_struct=True))


def _nan_free(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.nan_to_num(0.0, posinf=float("inf"), neginf=float("-inf")) if tensor.is_floating_point() else tensor


def same_batch(a: Any, b: Any) -> bool:
    """Whether two batches are equal in structure, types, dtypes, shapes and values (NaN equal to NaN)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(_nan_free(a), _nan_free(b)) and torch.equal(a.isnan(), b.isnan()))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_batch(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_batch(x, y) for x, y in zip(a, b))
    return bool(a == b)


def fetch(dataset: Any, indices: list[int]) -> list[Any]:
    """The samples torch's fetcher takes for a batch: ``__getitems__`` where the dataset has one
    (a ``datasets.Dataset`` formats a batch at once, which can give other dtypes than one row)."""
    getitems = getattr(dataset, "__getitems__", None)
    return getitems(indices) if getitems else [dataset[index] for index in indices]


def _field(array: Any, position: int) -> Any:
    """A struct column's ``position``-th field, as a column of the same rows."""
    pa = import_optional("pyarrow")
    return pa.chunked_array([chunk.flatten()[position] for chunk in array.chunks], array.type[position].type)


def _valid(array: Any) -> np.ndarray:
    """Per row: the column holds no null there, in a struct's fields neither."""
    pa = import_optional("pyarrow")
    valid = array.is_valid().to_numpy(zero_copy_only=False).astype(np.bool_)
    if pa.types.is_struct(array.type):
        for position in range(array.type.num_fields):
            valid &= _valid(_field(array, position))
    return valid


def _collated(dataset: Any, view: TableView, indices: list[int]) -> Any:
    """torch's collate of the samples at ``indices``, each PIL image of an image column (format
    None) taken as the uint8 (C, H, W) tensor it holds, as torchvision's ``PILToTensor`` takes it:
    what gpuload's decoders give, to compare with."""
    samples = fetch(dataset, indices)
    if view.format == "python" and view.images:
        samples = [dict(sample, **{name: _pil_tensor(sample[name]) for name in view.images if name in sample})
                   for sample in samples]
    return default_collate(samples)


def _pil_tensor(image: Any) -> torch.Tensor:
    pixels = torch.from_numpy(np.array(image))
    return (pixels.unsqueeze(-1) if pixels.dim() == 2 else pixels).permute(2, 0, 1).contiguous()


def _template_row(dataset: Any, view: TableView) -> tuple[int, dict[str, Any]] | None:
    """The first of the leading samples with no null in any column whose collated sample is a dict
    with no None in it."""
    valid = np.ones(view.table.num_rows, dtype=np.bool_)
    for name, array in zip(view.table.column_names, view.table.columns):
        # an image struct's path is null where it holds the bytes (also in a column not served)
        image = name in view.images or image_column_error(array.type) is None
        valid &= array.is_valid().to_numpy(zero_copy_only=False) if image else _valid(array)
    in_order = _in_sample_order(torch.from_numpy(valid), view.rows)
    for index in torch.nonzero(in_order).flatten()[:_TEMPLATE_ROWS].tolist():
        try:
            sample = _collated(dataset, view, [index])
        except Exception:  # torch's fetch of this row fails as it would in torch's loader
            continue
        if isinstance(sample, dict) and None not in tree_flatten(sample)[0]:
            return index, sample
    return None


def table_columns(dataset: Any, view: TableView, image_leaf: Callable[[str], Leaf] | None = None
                  ) -> TableColumns | None:
    """The dataset's columns as gpuload serves them, or None when some column has no such form
    (a type Arrow gives no buffer for, a decoded feature, a null in a list, no fixed-width
    column at all) or the batch of one row would differ from torch's: torch's path serves then.
    ``image_leaf(name)`` makes the leaf of each of ``view.images``, decoded by the image path."""
    found = _template_row(dataset, view)
    if found is None:
        return None
    index, sample = found
    walk = _Walk(dataset, view)
    fields: dict[str, Leaf] = {}
    for name, value in sample.items():
        if name not in view.table.column_names:
            return None
        if name in view.images and image_leaf is not None:
            fields[name] = image_leaf(name)
            continue
        leaf = walk.leaf(name, view.table.column(name), value, in_struct=False)
        if leaf is None:
            return None
        fields[name] = leaf
    if not walk.arrays:
        return None
    # ChunkedRows answers the tensor questions the array path asks of its source arrays
    arrays = cast(list[torch.Tensor], walk.arrays)
    columns = TableColumns(ArrayColumns(arrays, tree_flatten(arrays)[1], len(dataset), disk=False),
                           StructLeaf(fields, None))
    if not _made_alike(columns, torch.tensor([index]), sample):
        return None
    leading = list(range(min(len(dataset), _TEMPLATE_ROWS)))
    try:
        batch = _collated(dataset, view, leading)
    except Exception:  # nulls (datasets' formatters raise AttributeError on some), lists of
        # other lengths: each batch is checked as it is made
        return columns
    return columns if _made_alike(columns, torch.tensor(leading), batch) else None


def _made_alike(columns: TableColumns, flat: torch.Tensor, expected: Any) -> bool:
    """Whether the batch of samples ``flat``, made here on the CPU, is ``expected`` (torch's)."""
    try:
        made = columns.batch([array.index_select(0, flat) for array in columns.arrays.columns], flat,
                             torch.device("cpu"), None, None)
    except (TypeError, RuntimeError):
        return False
    return same_batch(made, expected)
