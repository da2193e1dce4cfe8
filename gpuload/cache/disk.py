"""The local-disk tier: rows the host tier would keep, spilled to a folder, memory-mapped back.

What it stores is exactly the host tier's bytes: fixed-shape rows of one or more columns (array
rows, the sample cache's columns, decoded images at their cached size), or a single ragged
column whose rows each have their own shape (whole decoded images of different sizes, a
:data:`RAGGED` dimension in the column's shape). Random-augmentation outputs are never stored,
only their inputs, so an epoch read from disk gives the batches an uncached epoch gives.

Layout of one entry, ``<cache_dir>/<key>/`` (``key``: a digest of the dataset's
:class:`Fingerprint`, the columns, the row count and the rows per block, so another
fingerprint or layout never reads these bytes)::

    manifest.json       published state, replaced atomically; written last
    block-000012.bin    rows [12*B, 13*B): one record per row, the columns side by side
    block-000013.part   a block being filled (any process may write its rows into it)
    rows.fill           one byte per row: 1 once that row's bytes are in its .part
    rows.index          ragged entries: per row, its offset in its .part, shape and dimension order
    entry.json          what the entry is (fingerprint, columns, rows), for ``gpuload cache ls``
    lock                flock'ed (exclusive, briefly) around every write and publication
    users               flock'ed (shared) by every open DiskCache; its mtime: the last open

A row is a record of ``record_bytes``; a block file holds ``B`` consecutive records, so a run of
consecutive rows is one sequential read of one memory map. A ragged block holds its ``B`` rows
back to back in the order they arrived (each in its own dimension order, aligned to its item
size), then its table: per row, an int64 offset, shape and dimension order (``B`` is chosen from
the caller's typical row size, ``row_bytes``). The table is copied from ``rows.index`` when the
block is sealed, so the checksum covers it; a reader checks it too (every row inside the data).
Filling follows the epoch's order: a row goes into its block's ``.part`` at its offset
(``pwrite``; a ragged row at the part's end, its ``rows.index`` entry after it), its flag is
set, and when a block's last row arrives the block is fsync'ed, checksummed (CRC-32), renamed to ``.bin`` and
only then listed in the manifest (itself written to a temporary name, fsync'ed and renamed). A
reader trusts only blocks the manifest lists, after checking each one's size and checksum the
first time this process maps it; a block that fails is reported once (naming the file), dropped
from the manifest and filled again. A process killed mid-fill leaves ``.part`` files and flags
that the next process to open the entry alone discards.

Several processes of a node share one entry: writes happen under the entry lock, so a row's
bytes are written once and each block is published once; rows another process has not
published yet are simply absent (the caller reads them from the source). Nothing is written
outside ``cache_dir``; folders and files are created with the process's umask.

A forked child using a DiskCache its parent opened opens the entry's files again at its first
use (a flock belongs to an open file, which a fork shares: the child's locks must be its own).
Do not edit an entry's files while a job has it open: a block truncated under a live memory map
faults its reader (SIGBUS); ``gpuload cache clear`` skips entries in use.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import re
import sys
import threading
import time
import warnings
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpuload.cache.budget import SizeSpec, default_disk_reserve, disk_budget, format_bytes
from gpuload.cache.entries import MANIFEST, EntryInfo, list_entries, remove_entry
from gpuload.cache.identity import IdentityError, file_identity, hash_array, hash_state
from gpuload.cache.settings import CacheSettings
from gpuload.datasets.arrays import ArrayDataset
from gpuload.datasets.images import ImageSource

__all__ = [
    "FORMAT_VERSION",
    "RAGGED",
    "ColumnSpec",
    "DiskCache",
    "DiskCacheStats",
    "DiskCacheWarning",
    "EntryInfo",
    "Fingerprint",
    "default_disk_reserve",
    "disk_budget",
    "fingerprint_arrays",
    "fingerprint_dataset",
    "fingerprint_for",
    "fingerprint_images",
    "list_entries",
    "remove_entry",
]

FORMAT_VERSION = 2
"""Bumped whenever the bytes on disk change meaning; part of every fingerprint (2: ragged entries)."""

RAGGED = -1
"""A dimension of a ragged column's shape: each row has its own size there (stored per row)."""

DEFAULT_BLOCK_BYTES = 64 << 20
_BLOCK_NAME = re.compile(r"^block-(\d{6,})\.(bin|part)$")
_OPEN_MAPS = 64  # memory maps (each holds a file descriptor) kept open per cache
_OPEN_PARTS = 64
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class DiskCacheWarning(UserWarning):
    """The disk tier cannot be used, stopped growing, or found a damaged file (named)."""


# ---------------------------------------------------------------- identity


@dataclass(frozen=True)
class Fingerprint:
    """What produced an entry's bytes: ``kind`` (``arrays``, ``images``, ``dataset``), a short
    human ``description`` and ``digest``, a hash of everything that identifies the bytes
    (class, length, files with sizes, mtimes, ctimes and inodes, settings, :data:`FORMAT_VERSION`)."""

    kind: str
    description: str
    digest: str

    @classmethod
    def of(cls, kind: str, description: str, parts: Any) -> Fingerprint:
        """The fingerprint of ``parts`` (JSON-like data, or a blake2b hasher already fed)."""
        hasher = hashlib.blake2b(digest_size=16)
        hasher.update(json.dumps({"format": FORMAT_VERSION, "kind": kind}, sort_keys=True).encode())
        if isinstance(parts, type(hasher)):
            hasher.update(parts.digest())
        else:
            hasher.update(_canonical(parts))
        return cls(kind, description, hasher.hexdigest())


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, default=_stable_repr, separators=(",", ":")).encode()


def _stable_repr(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(map(repr, value))
    if isinstance(value, (os.PathLike,)):
        return os.fspath(value)
    if isinstance(value, (torch.dtype, np.dtype, torch.device)):
        return str(value)
    text = repr(value)
    if " at 0x" in text:
        raise ValueError(
            f"the disk cache's fingerprint cannot use {text}: its repr changes from run to run; pass "
            "settings made of numbers, strings, lists and dicts (or objects with a stable repr)"
        )
    return f"{type(value).__module__}.{type(value).__qualname__}:{text}"


def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def fingerprint_arrays(arrays: Any, settings: Mapping[str, Any] | None = None, *,
                       key: str | None = None) -> Fingerprint:
    """The fingerprint of in-memory arrays (a tensor, an ndarray, a tuple/list/dict of them, or
    an :class:`~gpuload.datasets.ArrayDataset`): their dtypes, shapes and contents (hashed; about
    a second per GB on one core), or with ``key`` (a string the caller changes whenever the
    contents change) their dtypes and shapes and the key."""
    columns = arrays.columns if isinstance(arrays, ArrayDataset) else arrays
    if isinstance(columns, (torch.Tensor, np.ndarray)):
        columns = {"#0": columns}
    elif isinstance(columns, (tuple, list)):
        columns = {f"#{i}": a for i, a in enumerate(columns)}
    if not isinstance(columns, Mapping) or not columns or not all(
        isinstance(a, (torch.Tensor, np.ndarray)) for a in columns.values()
    ):
        raise TypeError(
            f"fingerprint_arrays takes tensors or numpy arrays (one, or a tuple/list/dict of them), "
            f"not {type(arrays).__name__}"
        )
    hasher = hashlib.blake2b(digest_size=16)
    hasher.update(_canonical({"class": _class_name(arrays), "settings": dict(settings or {}), **_keyed(key)}))
    for name in sorted(columns):
        hasher.update(_canonical(name))
        if key is None:
            hash_array(hasher, columns[name])
        else:
            hasher.update(_canonical([str(columns[name].dtype), list(columns[name].shape)]))
    first = next(iter(columns.values()))
    return Fingerprint.of("arrays", f"{type(arrays).__name__}({len(first)} rows, {len(columns)} columns)", hasher)


def fingerprint_images(dataset: Any, settings: Mapping[str, Any] | None = None, *,
                       key: str | None = None) -> Fingerprint:
    """The fingerprint of image files (a gpuload ImageFolder/ImageList or anything with a
    torchvision-style ``samples`` list of ``(path, label)``): the class, each file's absolute
    path, label and :func:`~gpuload.cache.identity.file_identity` (size, mtime, ctime, inode),
    and ``settings`` (decode size, pre-cache transforms). Changing, replacing, adding or
    removing a file changes it. With ``key``, the paths and labels and the key (no file is
    looked at)."""
    samples = getattr(dataset, "samples", None)
    if not isinstance(samples, Sequence) or isinstance(samples, (str, bytes)):
        raise TypeError(f"fingerprint_images needs a dataset with a samples list of (path, label), not {dataset!r}")
    hasher = hashlib.blake2b(digest_size=16)
    hasher.update(_canonical({"class": _class_name(dataset), "length": len(samples), "settings": dict(settings or {}),
                              **_keyed(key)}))
    for path, label in samples:
        full = os.path.abspath(os.fspath(path))
        try:
            identity: Sequence[int | str] = file_identity(full) if key is None else []
        except OSError as error:
            identity = [f"unreadable: {error.strerror}"]
        hasher.update(_canonical([full, int(label), *identity]))
    return Fingerprint.of("images", f"{type(dataset).__name__}({len(samples)} images)", hasher)


def fingerprint_dataset(dataset: Any, settings: Mapping[str, Any] | None = None, key: str | None = None,
                        skip: Sequence[str | os.PathLike[str]] = ()) -> Fingerprint:
    """The fingerprint of any map-style dataset: its class, its length, the identity of the
    file that defines the class, and either ``key`` (a string the caller promises changes with
    the samples: data, transforms, code) or :func:`~gpuload.cache.identity.hash_state`: the
    dataset's whole pickled state (attributes, slots, nested datasets, functions with their
    closures, arrays by contents) and the identity of every file or folder (each file under it)
    a string anywhere in it names, but those under ``skip`` (the cache's folder).

    :class:`~gpuload.cache.identity.IdentityError` (a ValueError) when that state does not
    pickle (open files, locks, database handles) or names a folder of more than
    :data:`~gpuload.cache.identity.FOLDER_FILES` files: a fingerprint that would not notice
    the data change is worse than none. Data read from elsewhere (a database, a URL) is only
    seen through ``key=``.
    """
    parts: dict[str, Any] = {"class": _class_name(dataset), "settings": dict(settings or {})}
    try:
        parts["length"] = len(dataset)
    except TypeError:
        raise TypeError(
            f"the disk cache stores map-style datasets with a length; {type(dataset).__name__} has none"
        ) from None
    source = sys.modules.get(type(dataset).__module__)
    source_file = getattr(source, "__file__", None)
    if source_file and os.path.exists(source_file):
        parts["code"] = [os.path.abspath(source_file), *file_identity(source_file)]
    hasher = hashlib.blake2b(digest_size=16)
    if key is not None:
        parts.update(_keyed(key))
    else:
        try:
            parts["files"] = hash_state(dataset, hasher, skip)
        except IdentityError as error:
            raise IdentityError(
                f"the disk cache cannot identify {type(dataset).__name__}: {error}; pass cache_key= (a string you "
                "change whenever its samples change), or no cache_dir"
            ) from None
    hasher.update(_canonical(parts))
    return Fingerprint.of("dataset", f"{type(dataset).__name__}({parts['length']} samples)", hasher)


def _keyed(key: str | None) -> dict[str, str]:
    """The caller's key as a fingerprint part (none without one); a key must be a non-empty string."""
    if key is None:
        return {}
    if not isinstance(key, str) or not key.strip():
        raise ValueError(f"cache_key={key!r} must be a non-empty string that changes whenever the data does")
    return {"key": key}


def fingerprint_for(dataset: Any, settings: Mapping[str, Any] | None = None, *, key: str | None = None,
                    skip: Sequence[str | os.PathLike[str]] = ()) -> Fingerprint:
    """The fingerprint of ``dataset``: image files (:func:`fingerprint_images`), arrays
    (:func:`fingerprint_arrays`) or any other dataset (:func:`fingerprint_dataset`; ``skip``:
    folders whose files are not its data).

    ``settings``: what else shapes the stored bytes, e.g. ``{"decode_size": [224, 224],
    "pre_cache": ["Resize(256)", "CenterCrop(224)"]}``. Random augmentations run after the
    cache and are never part of it. ``key``: a string the caller changes whenever the data
    does, used instead of looking at the files, contents or state.
    """
    if isinstance(dataset, ImageSource) or _has_image_samples(dataset):
        return fingerprint_images(dataset, settings, key=key)
    parts = dataset.values() if isinstance(dataset, Mapping) else dataset
    if isinstance(dataset, (ArrayDataset, torch.Tensor, np.ndarray)) or (
        isinstance(dataset, (tuple, list, Mapping)) and dataset
        and all(isinstance(a, (torch.Tensor, np.ndarray)) for a in parts)
    ):
        return fingerprint_arrays(dataset, settings, key=key)
    return fingerprint_dataset(dataset, settings, key=key, skip=skip)


def _has_image_samples(dataset: Any) -> bool:
    samples = getattr(dataset, "samples", None)
    return (
        isinstance(samples, Sequence) and not isinstance(samples, (str, bytes)) and len(samples) > 0
        and all(isinstance(s, Sequence) and len(s) == 2 and isinstance(s[0], (str, os.PathLike)) for s in samples[:16])
    )


# ---------------------------------------------------------------- layout


@dataclass(frozen=True)
class ColumnSpec:
    """One column of a record: its name, torch dtype and the shape of one row."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def ragged(self) -> bool:
        """Whether rows vary in shape (a :data:`RAGGED` dimension): stored one by one."""
        return RAGGED in self.shape

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _itemsize(self.dtype)

    def as_json(self) -> list[Any]:
        return [self.name, str(self.dtype).removeprefix("torch."), list(self.shape)]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _columns(spec: Any) -> tuple[ColumnSpec, ...]:
    if isinstance(spec, Mapping):
        spec = [ColumnSpec(str(n), d, tuple(s)) for n, (s, d) in spec.items()]
    columns = tuple(spec)
    if not columns or not all(isinstance(c, ColumnSpec) for c in columns):
        raise TypeError(
            "columns must be ColumnSpec(name, dtype, shape)s or a dict name -> (shape, dtype), at least one"
        )
    for column in columns:
        if not isinstance(column.dtype, torch.dtype):
            raise TypeError(f"column {column.name!r}: dtype {column.dtype!r} is not a torch.dtype")
        if any(not isinstance(d, int) or d < RAGGED for d in column.shape):
            raise ValueError(
                f"column {column.name!r}: shape {column.shape} must be non-negative ints, or RAGGED (-1) "
                "where rows differ"
            )
    if len({c.name for c in columns}) != len(columns):
        raise ValueError(f"column names repeat: {[c.name for c in columns]}")
    if any(c.ragged for c in columns) and len(columns) != 1:
        raise ValueError("a ragged column (a RAGGED dimension) must be the entry's only column")
    return columns


def _record_bytes(columns: tuple[ColumnSpec, ...], row_bytes: int | None) -> int:
    """Bytes of one row: the record's, or for a ragged column the caller's estimate (``row_bytes``,
    which sizes its blocks)."""
    if not columns[0].ragged:
        return _layout(columns)[1]
    if isinstance(row_bytes, bool) or not isinstance(row_bytes, int) or row_bytes < 1:
        raise ValueError(f"a ragged column needs row_bytes= (a positive int: typical bytes of a row), "
                         f"not {row_bytes!r}")
    return row_bytes


def _layout(columns: tuple[ColumnSpec, ...]) -> tuple[list[int], int]:
    """Each column's byte offset in a record (aligned to its item size) and the record size
    (aligned to the largest item size, so every row of every column stays aligned)."""
    offsets, at, align = [], 0, 1
    for column in columns:
        size = _itemsize(column.dtype)
        align = max(align, size)
        at = -(-at // size) * size
        offsets.append(at)
        at += column.row_bytes
    return offsets, max(align, -(-at // align) * align)


# ---------------------------------------------------------------- budget


def _no_room(folder: Path, budget_bytes: int | SizeSpec | None) -> bool:
    """True, with one :class:`DiskCacheWarning` saying why, when ``budget_bytes`` resolves to 0
    for a new entry under ``folder`` (``auto`` on a file system with less free space than the
    reserve): the tier could store nothing, so nothing is created. A raised error is the caller's."""
    spec = SizeSpec("auto", text="auto") if budget_bytes is None else budget_bytes
    if isinstance(spec, SizeSpec) and spec.kind == "off":
        return True  # asked for: no tier, nothing to say
    existing = folder.absolute()
    while not existing.exists() and existing != existing.parent:  # the folder is made when first used
        existing = existing.parent
    room = disk_budget(existing, spec) if isinstance(spec, SizeSpec) else int(spec)
    if room > 0:
        return False
    if isinstance(spec, SizeSpec) and spec.kind == "auto":
        status = os.statvfs(existing)
        free, total = status.f_bavail * status.f_frsize, status.f_blocks * status.f_frsize
        why = (f"disk_cache_size='auto' is its free space ({format_bytes(free)}) less the reserve "
               f"({format_bytes(default_disk_reserve(total))}): 0 B")
    else:
        why = f"disk_cache_size={getattr(spec, 'text', spec)!r} gives it 0 B"
    warnings.warn(
        f"gpuload disk cache: no room in {folder}: {why}; running without a disk tier. Free space there, point "
        "cache_dir= (or GPULOAD_CACHE_DIR) at a larger file system, or set disk_cache_size",
        DiskCacheWarning, stacklevel=3,
    )
    return True


# ---------------------------------------------------------------- the cache


@dataclass
class DiskCacheStats:
    """Rows and bytes published, rows read (hits) and asked for but absent (misses), rows this
    process wrote, blocks that failed their check and were dropped, and whether it is full or
    stopped (``stopped``: why it no longer writes)."""

    path: str = ""
    budget: int = 0
    rows: int = 0
    published_rows: int = 0
    published_bytes: int = 0
    hits: int = 0
    misses: int = 0
    rows_written: int = 0
    blocks_published: int = 0
    blocks_dropped: int = 0
    full: bool = False
    stopped: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Manifest:
    blocks: dict[int, tuple[int, int]] = field(default_factory=dict)  # block -> (bytes, crc32)
    identity: tuple[int, int] | None = None  # (inode, mtime_ns) of the file this came from


class DiskCache:
    """One dataset's rows on local disk, shared by a node's processes; see the module doc.

    Use: ``cache = DiskCache.open(folder, fingerprint, columns, num_rows, budget)``; then
    ``cache.present(rows)`` says which rows are published (a bool tensor), ``cache.read(rows)``
    returns their columns (one tensor per column, ``len(rows)`` rows each), ``cache.write(rows,
    columns)`` stores rows during the fill (published block by block as blocks complete),
    ``cache.stats()`` and ``cache.close()``. ``open`` returns None, with one warning, when the
    folder cannot be used (read-only, not a folder): the job then runs without a disk tier.
    """

    def __init__(
        self, root: Path, fingerprint: Fingerprint, columns: tuple[ColumnSpec, ...], num_rows: int, budget: int,
        block_bytes: int, auto_budget: bool, row_bytes: int | None = None,
    ) -> None:
        self.root = root
        self.fingerprint = fingerprint
        self.columns = columns
        self.num_rows = num_rows
        self.ragged = columns[0].ragged
        self.offsets, self.record_bytes = ([0], _record_bytes(columns, row_bytes)) if self.ragged else _layout(columns)
        # A ragged row's entry in ``rows.index`` and its block's table: offset, shape, dim order.
        self._entry_words = 1 + 2 * len(columns[0].shape)
        self.block_rows = max(1, block_bytes // max(1, self.record_bytes))
        self.num_blocks = -(-num_rows // self.block_rows) if num_rows else 0
        self.budget = budget
        self._auto_budget = auto_budget
        self._mutex = threading.RLock()
        self._manifest = _Manifest()
        self._verified: set[int] = set()
        self._maps: OrderedDict[int, tuple[mmap.mmap | None, np.ndarray]] = OrderedDict()
        self._parts: OrderedDict[int, tuple[int, int]] = OrderedDict()  # block -> (fd, inode)
        self._stats = DiskCacheStats(path=str(root), budget=budget, rows=num_rows)
        self._closed = False
        self._pid = os.getpid()
        self._lock_fd = self._users_fd = self._flags_fd = self._index_fd = -1
        _OPEN.add(self)
        try:
            self._lock_fd = os.open(root / "lock", os.O_RDWR | os.O_CREAT, 0o666)
            self._users_fd = os.open(root / "users", os.O_RDWR | os.O_CREAT, 0o666)
            self._recover()
            self._flags_fd = os.open(root / "rows.fill", os.O_RDWR | os.O_CREAT, 0o666)
            if os.fstat(self._flags_fd).st_size < num_rows:
                os.ftruncate(self._flags_fd, num_rows)
            if self.ragged:
                self._index_fd = os.open(root / "rows.index", os.O_RDWR | os.O_CREAT, 0o666)
            os.utime(root / "users")
            self._reload(force=True)
        except BaseException:
            self.close()
            raise
        if auto_budget:  # what is published counts as room: the free space is beside it
            self.budget = self._stats.budget = budget + self._stats.published_bytes

    # -- opening ------------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        cache_dir: str | os.PathLike[str],
        fingerprint: Fingerprint,
        columns: Sequence[ColumnSpec] | Mapping[str, tuple[Sequence[int], torch.dtype]],
        num_rows: int,
        budget_bytes: int | SizeSpec | None = None,
        *,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        row_bytes: int | None = None,
    ) -> DiskCache | None:
        """The entry for ``fingerprint`` under ``cache_dir`` (created if missing), or None with
        one :class:`DiskCacheWarning` when the folder cannot be written.

        ``budget_bytes``: bytes this entry may hold; None (or ``SizeSpec("auto")``) is the file
        system's free space less :func:`default_disk_reserve`, re-checked before each new block.
        ``row_bytes``: for a ragged column (rows of their own shapes, :meth:`write_items`), the
        typical bytes of a row, which sizes the blocks.
        """
        spec = _columns(columns)
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0:
            raise ValueError(f"num_rows={num_rows!r} must be a non-negative int")
        if not isinstance(block_bytes, int) or block_bytes < 1:
            raise ValueError(f"block_bytes={block_bytes!r} must be a positive int")
        folder = Path(cache_dir).expanduser()
        key_hash = hashlib.blake2b(digest_size=16)
        block_rows = max(1, block_bytes // max(1, _record_bytes(spec, row_bytes)))  # the layout is part of the key
        key_hash.update(_canonical([fingerprint.digest, [c.as_json() for c in spec], num_rows, block_rows]))
        root = folder / key_hash.hexdigest()
        try:
            if folder.exists() and not folder.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(folder))
            link = _dangling_link(folder)
            if link is not None:  # mkdir would say only "File exists"
                raise FileNotFoundError(errno.ENOENT, f"{link} is a symbolic link to {os.readlink(link)}, which "
                                        "does not exist (a file system not mounted?)")
            if not root.exists() and _no_room(folder, budget_bytes):
                return None  # said why; nothing created
            root.mkdir(parents=True, exist_ok=True)  # mode 0o777 less the umask
            probe = root / f".probe-{os.getpid()}-{threading.get_ident()}"
            with open(probe, "wb"):
                pass
            probe.unlink(missing_ok=True)  # the entry's first user may have discarded it as stale
            auto = budget_bytes is None or (isinstance(budget_bytes, SizeSpec) and budget_bytes.kind == "auto")
            if isinstance(budget_bytes, SizeSpec) or budget_bytes is None:
                budget = disk_budget(root, budget_bytes or SizeSpec("auto"))
            else:
                budget = int(budget_bytes)
            cache = cls(root, fingerprint, spec, num_rows, budget, block_bytes, auto, row_bytes)
        except OSError as error:
            reason = f"{error.filename or folder} ({error.strerror or error})" if error.filename or not error.strerror \
                else f"{folder}: {error.strerror}"
            warnings.warn(
                f"gpuload disk cache: cannot use {reason}; "
                "running without a disk tier. Point cache_dir= (or GPULOAD_CACHE_DIR) at a writable "
                "local folder, or unset it",
                DiskCacheWarning, stacklevel=2,
            )
            return None
        cache._write_description()
        return cache

    @classmethod
    def from_settings(
        cls, settings: CacheSettings, fingerprint: Fingerprint,
        columns: Sequence[ColumnSpec] | Mapping[str, tuple[Sequence[int], torch.dtype]], num_rows: int,
        **options: Any,
    ) -> DiskCache | None:
        """:meth:`open` with the resolved ``cache_dir`` and ``disk_cache_size``; None when no
        folder is set or the size is ``off`` (no disk tier), or the folder cannot be used."""
        folder, size = settings.disk_dir.value, settings.disk_size.value
        if folder is None or size.kind == "off":
            return None
        return cls.open(folder, fingerprint, columns, num_rows, size, **options)

    def _write_description(self) -> None:
        """A small ``entry.json`` (what the entry is) for ``gpuload cache ls``; written once."""
        path = self.root / "entry.json"
        if path.exists():
            return
        document = {
            "format": FORMAT_VERSION, "fingerprint": asdict(self.fingerprint), "num_rows": self.num_rows,
            "columns": [c.as_json() for c in self.columns], "record_bytes": self.record_bytes,
            "block_rows": self.block_rows, "created": time.time(),
        }
        try:
            _atomic_write(path, json.dumps(document, indent=1).encode())
        except OSError:
            pass  # only descriptive; a full disk is reported by the first write

    def _recover(self) -> None:
        """If no other process has this entry open, discard what a killed one left (parts,
        flags, temporary manifests, blocks the manifest does not list); then join as a user."""
        try:
            fcntl.flock(self._users_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fcntl.flock(self._users_fd, fcntl.LOCK_SH)
            return
        with self._entry_lock():
            listed = set(_read_manifest(self.root, self)[0].blocks)
            for entry in os.scandir(self.root):
                match = _BLOCK_NAME.match(entry.name)
                stale = (entry.name.startswith((MANIFEST + ".tmp", ".probe-"))
                         or entry.name in ("rows.fill", "rows.index"))
                if match and (match.group(2) == "part" or int(match.group(1)) not in listed):
                    stale = True
                if stale:  # missing_ok: a probe's own process may remove it meanwhile
                    Path(entry.path).unlink(missing_ok=True)
        fcntl.flock(self._users_fd, fcntl.LOCK_SH)

    def _open_in_this_process(self) -> None:
        """In a forked child: its own descriptors of the entry's files. A flock belongs to an
        open file, which a fork shares: on the inherited descriptors the child would hold the
        parent's locks (the entry lock granted to both at once) instead of its own. The memory
        maps stay: the child reads the same published bytes."""
        with self._mutex:
            if os.getpid() == self._pid:
                return
            self._pid = os.getpid()
            inherited = [fd for fd, _ in self._parts.values()]
            self._parts.clear()
            inherited += [self._flags_fd, self._index_fd, self._lock_fd, self._users_fd]
            self._lock_fd = self._users_fd = self._flags_fd = self._index_fd = -1
            for fd in inherited:
                if fd >= 0:
                    os.close(fd)  # the parent's locks stay: it still has the same files open
            if self._closed:
                return
            try:
                self._lock_fd = os.open(self.root / "lock", os.O_RDWR)
                self._users_fd = os.open(self.root / "users", os.O_RDWR)
                fcntl.flock(self._users_fd, fcntl.LOCK_SH)  # a user, as the parent: nothing to recover
                self._flags_fd = os.open(self.root / "rows.fill", os.O_RDWR)
                if self.ragged:
                    self._index_fd = os.open(self.root / "rows.index", os.O_RDWR)
            except OSError as error:  # the entry removed meanwhile: the source serves
                self._stop(error, Path(error.filename or self.root))
                self.close()

    # -- locks and the manifest ---------------------------------------------------------------

    def _entry_lock(self) -> _Flock:
        return _Flock(self._lock_fd)

    def _reload(self, force: bool = False) -> None:
        """Read the manifest again if another process replaced it since."""
        try:
            status = os.stat(self.root / MANIFEST)
            identity = (status.st_ino, status.st_mtime_ns)
        except FileNotFoundError:
            identity = None
        if not force and identity == self._manifest.identity:
            return
        manifest, problem = _read_manifest(self.root, self)
        if problem and identity != getattr(self, "_reported_manifest", None):
            self._reported_manifest = identity
            warnings.warn(f"gpuload disk cache: {problem}; its blocks are filled again", DiskCacheWarning, stacklevel=3)
        for block in set(self._manifest.blocks) - set(manifest.blocks):
            self._forget(block)
        self._manifest = manifest
        self._stats.published_rows = sum(self._rows_in(b) for b in manifest.blocks)
        self._stats.published_bytes = sum(size for size, _ in manifest.blocks.values())

    def _write_manifest(self) -> None:
        document = {
            "format": FORMAT_VERSION, "fingerprint": self.fingerprint.digest, "num_rows": self.num_rows,
            "record_bytes": self.record_bytes, "block_rows": self.block_rows,
            "columns": [c.as_json() for c in self.columns],
            "blocks": [[b, size, crc] for b, (size, crc) in sorted(self._manifest.blocks.items())],
        }
        _atomic_write(self.root / MANIFEST, json.dumps(document, separators=(",", ":")).encode())
        status = os.stat(self.root / MANIFEST)
        self._manifest.identity = (status.st_ino, status.st_mtime_ns)
        self._stats.published_rows = sum(self._rows_in(b) for b in self._manifest.blocks)
        self._stats.published_bytes = sum(size for size, _ in self._manifest.blocks.values())

    # -- reading ------------------------------------------------------------------------------

    def _rows_in(self, block: int) -> int:
        return min(self.block_rows, self.num_rows - block * self.block_rows)

    def _block_path(self, block: int, suffix: str) -> Path:
        return self.root / f"block-{block:06d}.{suffix}"

    def _as_rows(self, rows: Any) -> np.ndarray:
        if os.getpid() != self._pid:
            self._open_in_this_process()
        array = rows.detach().cpu().numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
        array = array.astype(np.int64, copy=False).reshape(-1)
        if array.size and (array.min() < 0 or array.max() >= self.num_rows):
            bad = array[(array < 0) | (array >= self.num_rows)][0]
            raise IndexError(f"row {bad} is outside the disk cache's {self.num_rows} rows")
        return array

    def present(self, rows: Any) -> torch.Tensor:
        """Which of ``rows`` are published and intact (a bool tensor, one per row). The first
        look at a block in this process checks its size and checksum."""
        array = self._as_rows(rows)
        with self._mutex:
            if self._closed:
                return torch.zeros(len(array), dtype=torch.bool)
            blocks = array // self.block_rows
            wanted = _distinct(blocks)
            if any(b not in self._manifest.blocks for b in wanted):
                self._reload()
            good = np.zeros(len(array), dtype=bool)
            for block in wanted:
                if block in self._verified or (block in self._manifest.blocks and self._map(block) is not None):
                    good[blocks == block] = True
            return torch.from_numpy(good)

    def read(self, rows: Any) -> list[torch.Tensor]:
        """The columns of ``rows`` (published ones; LookupError names an absent row), one tensor
        of ``len(rows)`` rows per column. Each run of consecutive rows is one copy from one
        memory map."""
        array = self._as_rows(rows)
        if self.ragged:
            raise TypeError(f"the disk cache {self.root} holds ragged rows: read them with read_items")
        with self._mutex:
            self._check_present(array)
            n = len(array)
            outs = [torch.empty((n, *column.shape), dtype=column.dtype) for column in self.columns]
            # Each column's rows copied straight out of the maps (one copy, no record buffer).
            targets = [(out.reshape(n, -1).view(torch.uint8).numpy(), offset, column.row_bytes)
                       for out, column, offset in zip(outs, self.columns, self.offsets) if column.row_bytes and n]
            if n:
                blocks = array // self.block_rows
                cuts = np.flatnonzero((np.diff(array) != 1) | (np.diff(blocks) != 0)) + 1
                starts = np.concatenate(([0], cuts))
                ends = np.concatenate((cuts, [n]))
                for start, end in zip(starts.tolist(), ends.tolist()):
                    block = int(blocks[start])
                    first = int(array[start]) - block * self.block_rows
                    records = self._map(block)
                    if records is None:
                        raise LookupError(f"block {block} of the disk cache {self.root} was dropped while reading")
                    run = records[first:first + end - start]
                    for target, offset, size in targets:
                        target[start:end] = run[:, offset:offset + size]
            self._stats.hits += n
        return outs

    def read_items(self, rows: Any) -> list[torch.Tensor]:
        """The rows of a ragged entry (published ones; LookupError names an absent row), each a
        tensor of its own shape and dimension order, copied out of its block's memory map."""
        array = self._as_rows(rows)
        if not self.ragged:
            raise TypeError(f"the disk cache {self.root} holds fixed-size rows: read them with read")
        column, words = self.columns[0], self._entry_words
        ndim = len(column.shape)
        items = []
        with self._mutex:
            self._check_present(array)
            for row in array.tolist():
                block = row // self.block_rows
                view = self._map(block)
                if view is None:
                    raise LookupError(f"block {block} of the disk cache {self.root} was dropped while reading")
                entry = self._table(block, view)[row - block * self.block_rows].tolist()
                offset, shape, order = entry[0], entry[1:1 + ndim], entry[1 + ndim:words]
                stored = [shape[d] for d in order]
                size = int(np.prod(stored, dtype=np.int64)) * _itemsize(column.dtype)
                out = torch.empty(size, dtype=torch.uint8)
                out.numpy()[:] = view[offset:offset + size]
                items.append(out.view(column.dtype).reshape(stored).permute(np.argsort(order).tolist()))
            self._stats.hits += len(array)
        return items

    def _check_present(self, array: np.ndarray) -> None:
        """LookupError naming the first of ``array`` that is not published (misses counted)."""
        ok = self.present(array).numpy()
        if not ok.all():
            self._stats.misses += int((~ok).sum())
            raise LookupError(
                f"row {int(array[~ok][0])} is not in the disk cache {self.root} (present() says which are)"
            )

    def _table(self, block: int, view: np.ndarray) -> np.ndarray:
        """A ragged block's row table (at its end): offset, shape and dimension order per row."""
        words = self._rows_in(block) * self._entry_words
        return view[view.size - words * 8:].view(np.int64).reshape(-1, self._entry_words)

    def _table_problem(self, block: int, view: np.ndarray) -> str:
        """What is wrong with a ragged block's table ("" when every row lies in its data)."""
        words = self._rows_in(block) * self._entry_words
        if view.size < words * 8:
            return f"is {view.size} bytes, too short for its table of {self._rows_in(block)} rows"
        ndim, data_end = len(self.columns[0].shape), view.size - words * 8
        for entry in self._table(block, view).tolist():
            offset, shape, order = entry[0], entry[1:1 + ndim], entry[1 + ndim:]
            size = int(np.prod(shape, dtype=np.int64)) * _itemsize(self.columns[0].dtype)
            if min(shape, default=0) < 0 or sorted(order) != list(range(ndim)) or not 0 <= offset <= data_end - size:
                return "has a damaged row table"
        return ""

    def _map(self, block: int) -> np.ndarray | None:
        """Block ``block``'s records, memory-mapped; checked (size, CRC-32) at first use. None
        (and the block dropped, with a warning naming the file) if it fails the check."""
        if block in self._maps:
            self._maps.move_to_end(block)
            return self._maps[block][1]
        size, crc = self._manifest.blocks[block]
        path = self._block_path(block, "bin")
        expected = size if self.ragged else self._rows_in(block) * self.record_bytes
        try:
            with open(path, "rb") as file:
                actual = os.fstat(file.fileno()).st_size
                if actual != size or size != expected:
                    problem = f"{path} is {actual} bytes, the manifest says {size} (expected {expected})"
                    self._drop(block, problem)
                    return None
                mapped = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_READ) if size else None
        except OSError as error:
            self._drop(block, f"{path} cannot be read ({error.strerror or error})")
            return None
        view = np.frombuffer(mapped, dtype=np.uint8) if mapped is not None else np.empty(0, np.uint8)
        if block not in self._verified:
            if _crc32(view) != crc:
                del view, mapped  # unmapped when the last reference goes
                self._drop(block, f"{path} fails its checksum (its bytes changed after it was written)")
                return None
            problem = self._table_problem(block, view) if self.ragged else ""
            if problem:
                del view, mapped
                self._drop(block, f"{path} {problem}")
                return None
            self._verified.add(block)
        records = view if self.ragged else view.reshape(self._rows_in(block), self.record_bytes)
        self._maps[block] = (mapped, records)
        while len(self._maps) > _OPEN_MAPS:
            self._maps.popitem(last=False)  # unmapped when the last reference goes
        return records

    def _drop(self, block: int, problem: str) -> None:
        """Unpublish a damaged block so it is filled again; one warning naming the file."""
        warnings.warn(
            f"gpuload disk cache: {problem}; its rows are read from the source and the block is written again",
            DiskCacheWarning, stacklevel=4,
        )
        self._stats.blocks_dropped += 1
        try:
            with self._entry_lock():
                self._reload()
                if self._manifest.blocks.get(block) is not None:
                    del self._manifest.blocks[block]
                    self._write_manifest()
                    first = block * self.block_rows
                    os.pwrite(self._flags_fd, bytes(self._rows_in(block)), first)
                    self._block_path(block, "bin").unlink(missing_ok=True)
        except OSError as error:
            self._manifest.blocks.pop(block, None)  # at least this process reads it no more
            self._stop(error, self.root / MANIFEST)
        self._forget(block)
        return None

    def _forget(self, block: int) -> None:
        self._verified.discard(block)
        self._maps.pop(block, None)

    # -- writing ------------------------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        """Whether ``write`` still stores rows (not closed, not stopped by an error)."""
        return not self._closed and not self._stats.stopped

    @property
    def growing(self) -> bool:
        """Whether writes may still store rows: accepting, and not full unless a block this
        process started is unfinished (its rows still fit: its room was taken at its start)."""
        with self._mutex:
            return self.accepting and (not self._stats.full or bool(self._parts))

    def write(self, rows: Any, columns: Sequence[torch.Tensor]) -> int:
        """Store ``rows`` (their ``columns``, one tensor per column with ``len(rows)`` rows of the
        column's shape and dtype); rows already stored or beyond the budget are skipped. Returns
        how many rows were written. A full disk, a read-only folder or another I/O error stops
        the tier from growing, with one warning; what was published stays readable."""
        array = self._as_rows(rows)
        if self.ragged:
            raise TypeError(f"the disk cache {self.root} holds ragged rows: write them with write_items")
        return self._store(array, self._pack(array, columns))

    def write_items(self, rows: Any, items: Sequence[torch.Tensor]) -> int:
        """:meth:`write` for a ragged entry: ``items``, one tensor per row of the column's dtype
        and number of dimensions, each of its own shape (and dimension order, kept)."""
        array = self._as_rows(rows)
        if not self.ragged:
            raise TypeError(f"the disk cache {self.root} holds fixed-size rows: write them with write")
        return self._store(array, self._pack_items(array, items))

    def _store(self, array: np.ndarray, records: np.ndarray) -> int:
        """Write ``records`` (one per row of ``array``) into their blocks' parts, publishing
        the blocks they complete."""
        if not len(array):
            return 0
        order = np.argsort(array, kind="stable")
        array, records = array[order], records[order]
        keep = np.concatenate(([True], np.diff(array) != 0))
        array, records = array[keep], records[keep]
        written = 0
        with self._mutex:
            if not self.accepting:
                return 0
            blocks = array // self.block_rows
            path: Path = self.root
            try:
                with self._entry_lock():
                    self._reload()
                    for block in _distinct(blocks):
                        if block in self._manifest.blocks:
                            continue
                        path = self._block_path(block, "part")
                        fd = self._part(block)
                        if fd is None:
                            continue
                        mine = blocks == block
                        fill = self._append_rows if self.ragged else self._write_rows
                        written += fill(block, fd, array[mine], records[mine])
                        path = self._block_path(block, "bin")
                        self._publish_if_complete(block, fd)
            except OSError as error:
                self._stop(error, Path(error.filename) if error.filename else path)
            self._stats.rows_written += written
        return written

    def _pack(self, array: np.ndarray, columns: Sequence[torch.Tensor]) -> np.ndarray:
        if len(columns) != len(self.columns):
            raise ValueError(f"write got {len(columns)} columns, the disk cache has {len(self.columns)} "
                             f"({', '.join(c.name for c in self.columns)})")
        records = torch.empty((len(array), self.record_bytes), dtype=torch.uint8)
        for spec, offset, value in zip(self.columns, self.offsets, columns):
            want = (len(array), *spec.shape)
            if not isinstance(value, torch.Tensor) or value.dtype != spec.dtype or tuple(value.shape) != want:
                got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(
                    f"column {spec.name!r}: write needs a tensor of shape {want} and dtype "
                    f"{spec.dtype}, got {got}"
                )
            if spec.row_bytes and len(array):
                flat = value.detach().cpu().contiguous().reshape(len(array), -1)
                records[:, offset:offset + spec.row_bytes] = flat.view(torch.uint8)
        return records.numpy()

    def _pack_items(self, array: np.ndarray, items: Sequence[torch.Tensor]) -> np.ndarray:
        """Each item as (its bytes in its own dimension order, shape, order): an object array."""
        if len(items) != len(array):
            raise ValueError(f"write_items got {len(items)} items for {len(array)} rows")
        spec = self.columns[0]
        packed = np.empty(len(array), dtype=object)
        for k, item in enumerate(items):
            if (not isinstance(item, torch.Tensor) or item.dtype != spec.dtype or item.dim() != len(spec.shape)
                    or any(want not in (RAGGED, got) for want, got in zip(spec.shape, item.shape))):
                got = f"{tuple(item.shape)} {item.dtype}" if isinstance(item, torch.Tensor) else type(item).__name__
                raise ValueError(f"column {spec.name!r}: write_items needs tensors of shape {spec.shape} "
                                 f"(-1: any size) and dtype {spec.dtype}, got {got}")
            strides = item.stride()
            order = sorted(range(item.dim()), key=lambda d: (-strides[d], d))  # as laid out in memory
            data = item.detach().cpu().permute(order).contiguous().reshape(-1).view(torch.uint8).numpy()
            packed[k] = (data, list(item.shape), order)
        return packed

    def _part(self, block: int) -> int | None:
        """A descriptor of block ``block``'s ``.part`` (opened, or created within the budget);
        None when the budget or the disk's reserve has no room for it. Entry lock held."""
        path = self._block_path(block, "part")
        cached = self._parts.get(block)
        try:
            inode = os.stat(path).st_ino
        except FileNotFoundError:
            inode = None
        if cached is not None and cached[1] == inode:
            self._parts.move_to_end(block)
            return cached[0]
        if cached is not None:
            self._close_part(block)
        size = self._rows_in(block) * self.record_bytes
        if inode is None:
            if not self._room_for(size):
                self._stats.full = True
                return None
            # No row of the new part is written yet: its flags are cleared before it exists, so
            # a process killed at any point after leaves no set flag over a part's zeros (flags
            # a block left set when its process died between its rename and the manifest).
            os.pwrite(self._flags_fd, bytes(self._rows_in(block)), block * self.block_rows)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                _preallocate(fd, 0 if self.ragged else size)  # a ragged block grows row by row
            except OSError:
                os.close(fd)
                path.unlink(missing_ok=True)
                raise
        else:
            fd = os.open(path, os.O_RDWR)
        self._parts[block] = (fd, os.fstat(fd).st_ino)
        while len(self._parts) > _OPEN_PARTS:
            self._close_part(next(iter(self._parts)))
        return fd

    def _room_for(self, size: int) -> bool:
        """Whether a new block of ``size`` bytes fits (for a ragged entry: ``size`` bytes more)."""
        return self._room_left() >= size

    def _room_left(self) -> int:
        """Bytes the entry may still take: the budget less what is published and the parts being
        filled (each counts a whole block, a ragged one its estimate or more once it grew past
        it), or with the default budget the disk's free space less its reserve, checked now."""
        if self._auto_budget:
            status = os.statvfs(self.root)
            return status.f_bavail * status.f_frsize - default_disk_reserve(status.f_blocks * status.f_frsize)
        parts = [e for e in os.scandir(self.root) if e.name.endswith(".part")]
        whole = self.block_rows * self.record_bytes
        held = sum(max(whole, e.stat().st_size) for e in parts) if self.ragged else len(parts) * whole
        return self.budget - self._stats.published_bytes - held

    def _write_rows(self, block: int, fd: int, rows: np.ndarray, records: np.ndarray) -> int:
        first = block * self.block_rows
        flags = np.frombuffer(os.pread(self._flags_fd, self._rows_in(block), first), dtype=np.uint8)
        todo = flags[rows - first] == 0
        rows, records = rows[todo], records[todo]
        if not len(rows):
            return 0
        cuts = np.flatnonzero(np.diff(rows) != 1) + 1
        for run_rows, run_records in zip(np.split(rows, cuts), np.split(records, cuts)):
            offset = (int(run_rows[0]) - first) * self.record_bytes
            _pwrite_all(fd, memoryview(np.ascontiguousarray(run_records)).cast("B"), offset)  # type: ignore[arg-type]  # numpy stubs
        for run_rows in np.split(rows, cuts):  # flags after the bytes: a set flag means written
            os.pwrite(self._flags_fd, b"\x01" * len(run_rows), int(run_rows[0]))
        return len(rows)

    def _append_rows(self, block: int, fd: int, rows: np.ndarray, items: np.ndarray) -> int:
        """A ragged block's rows not written yet appended to its part, each with its entry in
        ``rows.index`` (offset, shape, order), while the budget has room. Entry lock held."""
        first = block * self.block_rows
        flags = os.pread(self._flags_fd, self._rows_in(block), first)
        align = _itemsize(self.columns[0].dtype)
        end, written = os.fstat(fd).st_size, 0
        room = self._room_left() + max(0, self.block_rows * self.record_bytes - end)  # this part's reserve
        for row, (data, shape, order) in zip(rows.tolist(), items):
            if flags[row - first]:
                continue
            end = -(-end // align) * align
            if data.size > room:
                self._stats.full = True
                break
            _pwrite_all(fd, memoryview(data), end)
            entry = np.array([end, *shape, *order], dtype=np.int64)
            os.pwrite(self._index_fd, entry.tobytes(), row * self._entry_words * 8)
            os.pwrite(self._flags_fd, b"\x01", row)  # after the bytes and the entry: a set flag means written
            end, room, written = end + data.size, room - data.size, written + 1
        return written

    def _seal(self, block: int, fd: int) -> int:
        """The block's final size: a ragged block gets its row table appended (from
        ``rows.index``, offsets within the block). Entry lock held."""
        if not self.ragged:
            return self._rows_in(block) * self.record_bytes
        words = self._rows_in(block) * self._entry_words
        table = os.pread(self._index_fd, words * 8, block * self.block_rows * self._entry_words * 8)
        if len(table) != words * 8:
            raise OSError(errno.EIO, "rows.index is shorter than its rows", str(self.root / "rows.index"))
        start = -(-os.fstat(fd).st_size // 8) * 8
        _pwrite_all(fd, memoryview(table), start)
        return start + len(table)

    def _publish_if_complete(self, block: int, fd: int) -> None:
        """fsync, checksum, rename to ``.bin`` and list in the manifest once every row of the
        block is written. Entry lock held."""
        first = block * self.block_rows
        if os.pread(self._flags_fd, self._rows_in(block), first).count(0):
            return
        size = self._seal(block, fd)  # never 0: a record is at least 1 byte, a ragged table 8 per row
        os.fsync(fd)
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mapped:
            crc = _crc32(np.frombuffer(mapped, dtype=np.uint8))
        target = self._block_path(block, "bin")
        os.rename(self._block_path(block, "part"), target)
        _fsync_folder(self.root)
        self._close_part(block)
        self._manifest.blocks[block] = (size, crc)
        try:
            self._write_manifest()
        except OSError:
            del self._manifest.blocks[block]
            target.unlink(missing_ok=True)
            os.pwrite(self._flags_fd, bytes(self._rows_in(block)), first)
            raise
        self._verified.add(block)
        self._stats.blocks_published += 1

    def _close_part(self, block: int) -> None:
        entry = self._parts.pop(block, None)
        if entry is not None:
            os.close(entry[0])

    def _stop(self, error: OSError, path: Path) -> None:
        """Stop writing, with one warning naming the file and the reason."""
        if self._stats.stopped:
            return
        full = error.errno in _NO_SPACE
        reason = "the disk is full" if full else (error.strerror or str(error))
        self._stats.stopped = f"{path}: {reason}"
        self._stats.full = self._stats.full or full
        for block in list(self._parts):
            self._close_part(block)
        warnings.warn(
            f"gpuload disk cache: writing {path} failed ({reason}); the disk tier stops growing. "
            f"The {self._stats.published_rows} rows already published are still read from it; the rest come "
            "from the source",
            DiskCacheWarning, stacklevel=4,
        )

    # -- the rest -----------------------------------------------------------------------------

    def stats(self) -> DiskCacheStats:
        """The counters (a copy)."""
        with self._mutex:
            return DiskCacheStats(**self._stats.as_dict())

    @property
    def complete(self) -> bool:
        """Every row is published."""
        with self._mutex:
            self._reload()
            return len(self._manifest.blocks) == self.num_blocks

    def close(self) -> None:
        """Unmap, close the files and leave the entry (its published blocks stay for later
        jobs; parts another process is filling stay for it). Safe to call twice."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            for block in list(self._parts):
                self._close_part(block)
            self._maps.clear()  # read() copies out of the maps: nothing points into them
            for fd in (self._flags_fd, self._index_fd, self._lock_fd, self._users_fd):
                if fd >= 0:
                    os.close(fd)  # closing releases this descriptor's flocks
            # Never closed again: the numbers may be reused by other files (a forked child of a
            # closed cache would otherwise close them in _open_in_this_process).
            self._lock_fd = self._users_fd = self._flags_fd = self._index_fd = -1

    def __enter__(self) -> DiskCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        s = self._stats
        return (f"DiskCache({self.root}, {s.published_rows}/{self.num_rows} rows published, "
                f"{format_bytes(s.published_bytes)} of {format_bytes(self.budget)})")


_OPEN: weakref.WeakSet[DiskCache] = weakref.WeakSet()


def _new_mutexes_after_fork() -> None:
    """In a forked child: a new mutex for each cache (a thread of the parent may have held one
    at the fork); each opens its own descriptors at its next use (``_open_in_this_process``)."""
    for cache in list(_OPEN):
        cache._mutex = threading.RLock()


os.register_at_fork(after_in_child=_new_mutexes_after_fork)


class _Flock:
    """An exclusive flock held for a ``with`` block."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)


def _read_manifest(root: Path, cache: DiskCache) -> tuple[_Manifest, str]:
    """The manifest's blocks, or an empty one and the problem when it does not describe this
    entry (damaged, another format, other columns)."""
    path = root / MANIFEST
    try:
        status = os.stat(path)
        data = path.read_bytes()
    except FileNotFoundError:
        return _Manifest(), ""
    identity = (status.st_ino, status.st_mtime_ns)
    try:
        document = json.loads(data)
        expected = {
            "format": FORMAT_VERSION, "fingerprint": cache.fingerprint.digest, "num_rows": cache.num_rows,
            "record_bytes": cache.record_bytes, "block_rows": cache.block_rows,
            "columns": [c.as_json() for c in cache.columns],
        }
        for name, value in expected.items():
            if document[name] != value:
                return _Manifest(identity=identity), f"{path} is for another {name} ({document[name]!r}, not {value!r})"
        blocks = {int(b): (int(size), int(crc)) for b, size, crc in document["blocks"]}
        if any(not 0 <= b < cache.num_blocks for b in blocks):
            raise ValueError("a block number is out of range")
    except (ValueError, KeyError, TypeError) as error:
        return _Manifest(identity=identity), f"{path} is damaged ({type(error).__name__}: {error})"
    return _Manifest(blocks, identity), ""


def _dangling_link(folder: Path) -> Path | None:
    """The symbolic link on the way to ``folder`` (itself or a folder above it) whose target
    does not exist, if any."""
    for path in (folder, *folder.parents):
        if path.is_symlink():
            return None if path.exists() else path
        if path.exists():
            return None
    return None


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary name: write, fsync, rename, fsync the folder."""
    temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            _pwrite_all(fd, memoryview(data), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def _fsync_folder(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


def _preallocate(fd: int, size: int) -> None:
    """Reserve ``size`` bytes now, so a full disk shows at the block's start, not halfway."""
    if size == 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


def _distinct(values: np.ndarray) -> list[int]:
    """The distinct values, sorted (not ``np.unique``: its first call in a process imports
    ``numpy.ma``, 0.4 s on a busy core, inside the first batch)."""
    return sorted(set(values.tolist()))


def _crc32(data: np.ndarray) -> int:
    crc, step = 0, 16 << 20
    for start in range(0, data.size, step):
        crc = zlib.crc32(memoryview(data[start:start + step]), crc)  # type: ignore[arg-type]  # numpy stubs: no __buffer__ before 3.12
    return crc
