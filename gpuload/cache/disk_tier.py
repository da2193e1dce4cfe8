"""The disk tier: rows the memory tiers do not hold, kept in ``cache_dir`` and memory-mapped back.

Two users, one :class:`~gpuload.cache.disk.DiskCache` each:

- :class:`DiskTier` (registered as ``"disk"``, built like every tier from the store's
  :class:`~gpuload.cache.tiers.Placing`) is a tier of the array store: rows
  ``[first, first + rows)`` of every array, written to the folder when the store places them
  (skipped for rows a published entry already has) and gathered from the memory maps after.
- :class:`DiskRows` is the disk tier of a sample cache (:mod:`gpuload.sources.sample_cache`):
  a dataset's samples as fixed-shape column rows by index, written as batches are read from the
  dataset, read back for the samples the memory tiers lack; a later job with the same
  fingerprint starts from them.
- :class:`DiskImages` is the disk tier of gpuload's image source: whole decoded images (each of
  its own shape, a ragged entry) by dataset index, written as they are decoded and read back
  instead of reading and decoding their files.

Only deterministic bytes are stored (the sample cache's samples when the probe finds them
deterministic); a fingerprint of what produced them (:func:`~gpuload.cache.disk.fingerprint_for`)
keys the entry, so changed data never reads old rows.
"""

from __future__ import annotations

import json
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import numpy as np
import torch

from gpuload.cache.columns import Branch, Column, Part, column_rows, layout, prepare
from gpuload.cache.disk import (
    DEFAULT_BLOCK_BYTES,
    RAGGED,
    ColumnSpec,
    DiskCache,
    DiskCacheWarning,
    Fingerprint,
    fingerprint_dataset,
    fingerprint_for,
    list_entries,
)
from gpuload.cache.probe import estimate_image_bytes, looks_deterministic
from gpuload.cache.settings import CacheSettings
from gpuload.cache.tiers import Placing, Tier, register_tier
from gpuload.transfer import pinned_host_copies

__all__ = ["DiskImages", "DiskRows", "DiskTier", "sample_fingerprint"]

_FILL_ROWS = 4096  # rows written per call while the array store places a disk tier
BLOCK_BYTES = DEFAULT_BLOCK_BYTES
"""Bytes of one block file (rows published together); tests make it small."""


def _specs(columns: Sequence[torch.Tensor]) -> list[ColumnSpec]:
    return [ColumnSpec(f"#{k}", column.dtype, tuple(column.shape[1:])) for k, column in enumerate(columns)]


@register_tier
class DiskTier(Tier):
    """Rows in a :class:`DiskCache` entry, read memory-mapped (a batch's rows are gathered on the
    host into the loader's staging, like the host tier's). ``columns`` holds one empty row of each
    array (its dtype and shape); the rows themselves are in ``disk``."""

    name = "disk"

    def __init__(self, first: int, columns: list[torch.Tensor], *, disk: DiskCache | None = None,
                 rows: int = 0, source: list[torch.Tensor] | None = None) -> None:
        super().__init__(first, columns, release=disk.close if disk is not None else None)
        self.disk = disk
        self._rows = rows if disk is not None else 0
        self._source = source or []  # rows of a block found damaged are read (and written) again from it

    @classmethod
    def allocate(cls, source: list[torch.Tensor], first: int, rows: int, placing: Placing) -> DiskTier:
        """The rows in ``placing.settings``' ``cache_dir`` (``placing.identity`` is called once,
        when there are rows to keep); an empty tier without rows, settings or identity, or when
        the folder cannot be used (warned by the cache)."""
        settings, identity = placing.settings, placing.identity
        if not rows or settings is None or identity is None:
            return cls(first, [])
        whole = identity()  # the tier's rows are an entry of their own: the key names them
        rows_of = Fingerprint.of(whole.kind, f"{whole.description}, rows {first}-{first + rows - 1}",
                                 {"data": whole.digest, "first": first})
        disk = DiskCache.from_settings(settings, rows_of, _specs(source), rows, block_bytes=BLOCK_BYTES,
                                       publish_behind=True)
        if disk is None:
            return cls(first, [])
        return cls.fill(disk, source, first, rows)

    @classmethod
    def fill(cls, disk: DiskCache, source: list[torch.Tensor], first: int, rows: int) -> DiskTier:
        """The tier holding rows ``[first, first + rows)`` of ``source`` in ``disk`` (an entry of
        ``rows`` rows, the tier's row ``k`` being source row ``first + k``): rows not published
        yet are written now; the tier ends at the first row the disk could not take (its
        budget, a full disk)."""
        for start in range(0, rows, _FILL_ROWS):
            end = min(rows, start + _FILL_ROWS)
            wanted = torch.arange(start, end)
            if disk.accepting and not bool(disk.present(wanted).all()):
                disk.write(wanted, [column[first + start:first + end] for column in source])
        held = disk.present(torch.arange(rows)) if rows else torch.zeros(0, dtype=torch.bool)
        missing = (~held).nonzero().view(-1)
        served = int(missing[0]) if missing.numel() else rows
        return cls(first, [column[:0] for column in source], disk=disk, rows=served, source=source)

    @property
    def rows(self) -> int:
        return self._rows

    def snapshot(self) -> DiskTier:
        """The tier itself: its rows are never replaced (no shrink reaches the disk), and a
        gather racing ``close`` must find it closed rather than read an entry closed under it."""
        return self

    def gather(self, column: int, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.disk is None:
            raise RuntimeError("this disk tier was closed")
        try:
            rows = self.disk.read(slots)[column]
        except LookupError:  # a block failed its check (warned, naming it): the source has the rows
            wanted = slots + self.first
            rows = self._source[column].index_select(0, wanted)
            self.disk.write(slots, [source.index_select(0, wanted) for source in self._source])
        if out is None:
            return rows
        out.copy_(rows.view(out.dtype) if rows.dtype != out.dtype else rows)
        return out

    def close(self) -> None:
        self.disk = None
        self._rows = 0
        self._source = []
        super().close()


# ---------------------------------------------------------------- the sample cache's disk tier


def _with_rows(template: Part, rows: Iterator[torch.Tensor]) -> Part:
    """A prepared batch of ``template``'s structure whose columns are ``rows`` (depth first)."""
    if isinstance(template, Branch):
        return Branch(template.kind, template.keys, [_with_rows(child, rows) for child in template.children])
    assert isinstance(template, Column)
    return Column(template.kind, template.dtype, next(rows))


def select_rows(part: Part, positions: torch.Tensor) -> Part:
    """The samples ``positions`` of a prepared batch whose leaves are all columns."""
    return _with_rows(part, (_take_rows(rows, positions) for rows in column_rows(part)))


def _take_rows(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``rows.index_select(0, positions)``; on the host as one copy per row in this thread: torch's
    index_select of rows of more than one dimension splits over its intra-op threads, and on a
    busy machine their barrier took 30-160 ms for a batch's few rows (under a millisecond here)."""
    if rows.device.type != "cpu" or rows.dim() < 2 or not rows.numel():
        return rows.index_select(0, positions)
    flat = rows.contiguous().reshape(len(rows), -1).view(torch.uint8).numpy()
    taken = torch.from_numpy(flat.take(positions.numpy(), axis=0))
    return taken.view(rows.dtype).reshape(len(positions), *rows.shape[1:])


def sample_fingerprint(dataset: Any, settings: CacheSettings) -> Fingerprint:
    """What produced a map-style dataset's samples: ``cache_key=`` when given, else its whole
    state and the files it names (:func:`~gpuload.cache.disk.fingerprint_dataset`; its
    transforms are part of that state), leaving out ``cache_dir``'s own files."""
    folder = settings.disk_dir.value
    return fingerprint_dataset(dataset, key=settings.disk_key, skip=[folder] if folder is not None else [])


def _describe(part: Part) -> Any:
    """A prepared batch's structure as JSON values (containers, each column's kind, dtypes and
    row shape), or None when one is not told by name (a namedtuple, a dict key that is not a
    str or int, a numpy scalar type that does not round-trip through its dtype)."""
    if isinstance(part, Branch):
        children = [_describe(child) for child in part.children]
        kinds = {tuple: "tuple", list: "list", dict: "dict"}
        keys = part.keys if isinstance(part.keys, int) else list(part.keys)
        if part.kind not in kinds or None in children or (
                isinstance(keys, list) and not all(type(key) in (str, int) for key in keys)):
            return None
        return {"branch": kinds[part.kind], "keys": keys, "children": children}
    if not isinstance(part, Column):
        return None
    if part.kind is torch.Tensor:
        kind = "tensor"
    elif part.kind is np.ndarray:
        kind = "ndarray"
    elif part.kind in (int, float, bool):
        kind = part.kind.__name__
    elif issubclass(part.kind, np.generic) and np.dtype(part.kind).type is part.kind:
        kind = "numpy " + np.dtype(part.kind).str
    else:
        return None
    dtype = None if part.dtype is None else (
        str(part.dtype).removeprefix("torch.") if isinstance(part.dtype, torch.dtype) else np.dtype(part.dtype).str)
    return {"column": kind, "dtype": dtype, "rows": str(part.rows.dtype).removeprefix("torch."),
            "shape": list(part.rows.shape[1:])}


def _described(description: Any) -> Part | None:
    """The template (columns of no rows) :func:`_describe` gave ``description``; None if it is
    not one."""
    try:
        if "branch" in description:
            container = {"tuple": tuple, "list": list, "dict": dict}[description["branch"]]
            keys = description["keys"]
            children = [_described(child) for child in description["children"]]
            if None in children:
                return None
            return Branch(container, keys if isinstance(keys, int) else tuple(keys), cast(list[Part], children))
        named = description["column"]
        kinds: dict[str, type] = {"tensor": torch.Tensor, "ndarray": np.ndarray, "int": int, "float": float,
                                  "bool": bool}
        kind = kinds[named] if named in kinds else np.dtype(named.removeprefix("numpy ")).type
        dtype: Any = description["dtype"]
        if dtype is not None:
            dtype = getattr(torch, dtype) if kind is torch.Tensor else np.dtype(dtype)
        rows = torch.empty((0, *description["shape"]), dtype=getattr(torch, description["rows"]))
        return Column(kind, dtype, rows)
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError):
        return None


def _published_template(settings: CacheSettings, fingerprint: Fingerprint) -> Part | None:
    """The structure of the samples an entry of ``fingerprint`` under ``cache_dir`` holds, as
    the job that wrote them kept it in its ``entry.json``; None when none has published rows."""
    folder = settings.disk_dir.value
    for entry in list_entries(folder) if folder is not None else []:
        if entry.fingerprint != fingerprint.digest or not entry.published_rows:
            continue
        try:
            description = json.loads((entry.path / "entry.json").read_bytes()).get("sample")
        except (OSError, ValueError, AttributeError):
            continue
        template = _described(description) if description is not None else None
        if template is not None:
            return template
    return None


class DiskRows:
    """A map-style dataset's samples on disk as fixed-shape column rows, by dataset index.

    Opened with the structure of the samples (``template``: the one an entry of this
    fingerprint keeps, else ``dataset[0]``'s; every leaf must be a fixed-shape column, else
    there is no disk tier). ``read(keys)``: the prepared batch of those samples when
    all are published, else None; ``write(keys, part)``: keep a prepared batch read from the
    dataset (batches of another structure are not kept).
    """

    def __init__(self, disk: DiskCache, template: Part) -> None:
        self.disk = disk
        self.template = template
        self._layout = layout(template)

    @staticmethod
    def identify(dataset: Any, settings: CacheSettings) -> Fingerprint | None:
        """The fingerprint the disk tier would key ``dataset``'s samples by (None without a
        ``cache_dir``): taken before gpuload reads a sample, so every job takes it of the
        dataset in the same state. :class:`~gpuload.cache.identity.IdentityError` when the
        dataset cannot be identified and no ``cache_key=`` is given."""
        if settings.disk_dir.value is None or settings.disk_size.value.kind == "off":
            return None
        try:
            return sample_fingerprint(dataset, settings)
        except TypeError:  # no len(): open() says so
            return None

    @staticmethod
    def probe(dataset: Any, settings: CacheSettings, fingerprint: Fingerprint | None) -> tuple[bool, str]:
        """:func:`~gpuload.cache.probe.looks_deterministic`, without reading a sample when
        ``cache_dir`` already holds published samples of this fingerprint: only a job whose probe
        passed writes them, and the fingerprint is the dataset's whole state (a later job reads
        them back from disk, not from the dataset)."""
        folder = settings.disk_dir.value
        if fingerprint is not None and folder is not None and any(
            entry.fingerprint == fingerprint.digest and entry.published_rows for entry in list_entries(folder)
        ):
            return True, "its samples are on disk, written by a job whose determinism probe passed"
        return looks_deterministic(dataset)

    @classmethod
    def open(cls, dataset: Any, settings: CacheSettings, fingerprint: Fingerprint | None = None) -> DiskRows | None:
        """The disk tier of ``dataset``'s samples in ``settings``' ``cache_dir``, or None: no
        folder set, samples that are not fixed-shape columns, a dataset without a length or a
        folder that cannot be used (each warned once, except the first). A dataset gpuload
        cannot identify without ``cache_key=`` is refused (:class:`~gpuload.cache.identity.IdentityError`)."""
        if settings.disk_dir.value is None or settings.disk_size.value.kind == "off":
            return None
        name = type(dataset).__name__
        # A later job takes the samples' structure from the entry, reading no sample before its
        # first batch (the fingerprint is the dataset's whole state: its samples are those).
        template = _published_template(settings, fingerprint) if fingerprint is not None else None
        try:
            template = template or prepare([dataset[0]])
        except Exception as error:  # noqa: BLE001 - the dataset's own error surfaces when the loop reads it
            warnings.warn(f"gpuload disk cache: reading {name}[0] failed ({type(error).__name__}: {error}); "
                          "no disk tier", DiskCacheWarning, stacklevel=3)
            return None
        if layout(template) is None:
            warnings.warn(f"gpuload disk cache: the samples of this {name} are not fixed-shape tensors, arrays "
                          "and numbers; no disk tier", DiskCacheWarning, stacklevel=3)
            return None
        try:  # IdentityError: refused, cache_key= is needed
            fingerprint = fingerprint or sample_fingerprint(dataset, settings)
        except TypeError as error:  # no len()
            warnings.warn(f"gpuload disk cache: {error}; no disk tier", DiskCacheWarning, stacklevel=3)
            return None
        description = _describe(template)  # kept only when it gives the template back exactly
        kept = _described(description) if description is not None else None
        about = {"sample": description} if kept is not None and layout(kept) == layout(template) else {}
        disk = DiskCache.from_settings(settings, fingerprint, _specs(column_rows(template)), len(dataset),
                                       block_bytes=BLOCK_BYTES, publish_behind=True, about=about)
        return cls(disk, template) if disk is not None else None

    @property
    def complete(self) -> bool:
        return self.disk.complete

    @property
    def accepting(self) -> bool:
        return self.disk.accepting and not self.disk.full  # asked per batch: never waits for publication

    def read(self, keys: torch.Tensor) -> Part | None:
        """The prepared batch of samples ``keys`` when every one is on disk, else None (an index
        past the dataset's length, which torch hands to the dataset, is never on disk)."""
        if not keys.numel() or not bool(self._in_range(keys).all()) or not bool(self.disk.present(keys).all()):
            return None
        try:
            rows = self.disk.read(keys)
        except LookupError:  # a block dropped (damaged) between the check and the read
            return None
        return _with_rows(self.template, iter(rows))

    def write(self, keys: torch.Tensor, part: Part) -> int:
        """Keep the samples of ``part`` (prepared from the dataset, in order) under ``keys``
        (those inside the dataset's length: the entry has a row for each of them only)."""
        if not self.disk.accepting or layout(part) != self._layout:
            return 0
        inside = self._in_range(keys)
        if not bool(inside.all()):
            where = inside.nonzero().view(-1)
            keys, part = keys.index_select(0, where), select_rows(part, where)
            if not keys.numel():
                return 0
        return self.disk.write(keys, column_rows(part))

    def _in_range(self, keys: torch.Tensor) -> torch.Tensor:
        return (keys >= 0) & (keys < self.disk.num_rows)

    def stats(self) -> dict[str, Any]:
        return self.disk.stats().as_dict()

    def close(self) -> None:
        self.disk.close()


# ---------------------------------------------------------------- the image source's disk tier


class DiskImages:
    """Whole decoded images of an image-file dataset on disk, by dataset index (a ragged entry:
    uint8, each of its own shape and dimension order, as the decoder gave it). Keyed by the
    files (paths, sizes, mtimes, ctimes, inodes; or ``cache_key=``) and ``decode`` (what shapes
    the pixels: backend, layout), so a changed file or another decoder never reads old pixels.

    Images decoded on a GPU are copied to pinned host memory without waiting for the device,
    and written once their copy is done (checked at each later write, waited for at ``close``),
    so filling the tier adds no host sync to a batch.
    """

    def __init__(self, disk: DiskCache) -> None:
        self.disk = disk
        self._copying: deque[tuple[list[int], list[torch.Tensor], Any]] = deque()  # rows, host copies, event
        self._lock = threading.Lock()

    @classmethod
    def open(cls, images: Any, settings: CacheSettings, decode: dict[str, Any],
             identify: Callable[[dict[str, Any]], Fingerprint] | None = None) -> DiskImages | None:
        """The disk tier of ``images`` in ``settings``' ``cache_dir``, or None: no folder set, or
        one that cannot be used (warned). ``identify(settings)``: the fingerprint of images that
        are not files (a table's column), given what shapes the pixels; by default the files'."""
        if settings.disk_dir.value is None or settings.disk_size.value.kind == "off" or not len(images):
            return None
        shaped = {"decoded": dict(decode, whole=True)}
        fingerprint = identify(shaped) if identify is not None else fingerprint_for(images, shaped,
                                                                                   key=settings.disk_key)
        decoded, _ = estimate_image_bytes(images)
        spec = [ColumnSpec("image", torch.uint8, (RAGGED, RAGGED, RAGGED))]
        disk = DiskCache.from_settings(settings, fingerprint, spec, len(images), block_bytes=BLOCK_BYTES,
                                       row_bytes=max(1, decoded // len(images)), publish_behind=True)
        return cls(disk) if disk is not None else None

    @property
    def accepting(self) -> bool:
        """Whether images decoded now should be written (room left, not every one published)."""
        return self.disk.growing and not self.disk.complete

    def present(self, positions: Sequence[int]) -> list[bool]:
        return self.disk.present(torch.tensor(positions, dtype=torch.int64)).tolist() if positions else []

    def read(self, positions: Sequence[int]) -> list[torch.Tensor] | None:
        """The images (on the host) of ``positions``, all published; None if a block was dropped
        (damaged, warned) meanwhile: the caller decodes them again."""
        try:
            return self.disk.read_items(torch.tensor(positions, dtype=torch.int64))
        except LookupError:
            return None

    def write(self, positions: Sequence[int], images: Sequence[torch.Tensor]) -> int:
        """Keep whole decoded images (3-D uint8; others are not kept) under their positions."""
        kept = [(p, image) for p, image in zip(positions, images) if image.dim() == 3 and image.dtype == torch.uint8]
        if not kept or not self.disk.accepting:
            return 0
        rows, items = [p for p, _ in kept], [image for _, image in kept]
        if not any(image.is_cuda for image in items):
            return self.disk.write_items(torch.tensor(rows), items)
        copies = pinned_host_copies(items)
        # The copies are queued on the images' device's current stream, which is not the current
        # device's in a thread that never chose it (a loader on cuda:$LOCAL_RANK, no set_device).
        device = next(image.device for image in items if image.is_cuda)  # one decoder: one device
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        with self._lock:
            self._copying.append((rows, copies, done))
        return self._write_copied(wait=False)

    def _write_copied(self, wait: bool) -> int:
        """Write the device images whose host copies are done, in the order they came (all of
        them, waiting for each copy, when ``wait``); the rows written."""
        written = 0
        with self._lock:
            while self._copying:
                rows, copies, done = self._copying[0]
                if not wait and not done.query():
                    break
                done.synchronize()
                self._copying.popleft()
                if self.disk.accepting:
                    written += self.disk.write_items(torch.tensor(rows), copies)
        return written

    def stats(self) -> dict[str, Any]:
        return self.disk.stats().as_dict()

    def close(self) -> None:
        self._write_copied(wait=True)
        self.disk.close()
