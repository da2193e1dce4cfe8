"""The disk tier's cache: an entry opened (or created) for a fingerprint under ``cache_dir``,
read and filled; see the package doc for the entry's files."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from gpuload.cache.budget import SizeSpec, default_disk_reserve, disk_budget, disk_space, format_bytes
from gpuload.cache.disk.blocks import DEFAULT_BLOCK_BYTES, ColumnSpec, parse_columns, record_bytes_of
from gpuload.cache.disk.entry import DiskCacheWarning
from gpuload.cache.disk.files import atomic_write, dangling_link
from gpuload.cache.disk.fingerprint import Fingerprint, canonical
from gpuload.cache.disk.reading import EntryReader
from gpuload.cache.disk.writing import EntryWriter
from gpuload.cache.entries import FORMAT_VERSION
from gpuload.cache.settings import CacheSettings


class DiskCache(EntryReader, EntryWriter):
    """One dataset's rows on local disk, shared by a node's processes; see :mod:`gpuload.cache.disk`.

    Use: ``cache = DiskCache.open(folder, fingerprint, columns, num_rows, budget)``; then
    ``cache.present(rows)`` says which rows are published (a bool tensor), ``cache.read(rows)``
    returns their columns (one tensor per column, ``len(rows)`` rows each), ``cache.write(rows,
    columns)`` stores rows during the fill (published block by block as blocks complete),
    ``cache.stats()`` and ``cache.close()``. ``open`` returns None, with one warning, when the
    folder cannot be used (read-only, not a folder): the job then runs without a disk tier.
    """

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
        publish_behind: bool = False,
        about: Mapping[str, Any] | None = None,
    ) -> DiskCache | None:
        """The entry for ``fingerprint`` under ``cache_dir`` (created if missing), or None with
        one :class:`DiskCacheWarning` when the folder cannot be written.

        ``budget_bytes``: bytes this entry may hold; None (or ``SizeSpec("auto")``) is the file
        system's free space less :func:`default_disk_reserve`, re-checked before each new block.
        ``row_bytes``: for a ragged column (rows of their own shapes, :meth:`write_items`), the
        typical bytes of a row, which sizes the blocks. ``publish_behind``: a complete block's
        fsync, checksum and publication happen on a background thread
        (:mod:`~gpuload.cache.disk.publishing`), not in the ``write`` that completes it; reads,
        ``stats``, ``complete`` and ``close`` wait for the blocks this process queued.
        ``about``: more of what the entry is (JSON values), kept in its ``entry.json`` when this
        open creates it (the sample cache keeps its samples' structure there).
        """
        spec = parse_columns(columns)
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0:
            raise ValueError(f"num_rows={num_rows!r} must be a non-negative int")
        if not isinstance(block_bytes, int) or block_bytes < 1:
            raise ValueError(f"block_bytes={block_bytes!r} must be a positive int")
        folder = Path(cache_dir).expanduser()
        key_hash = hashlib.blake2b(digest_size=16)
        block_rows = max(1, block_bytes // max(1, record_bytes_of(spec, row_bytes)))  # the layout is part of the key
        key_hash.update(canonical([fingerprint.digest, [c.as_json() for c in spec], num_rows, block_rows]))
        root = folder / key_hash.hexdigest()
        try:
            if folder.exists() and not folder.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(folder))
            link = dangling_link(folder)
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
            cache = cls(root, fingerprint, spec, num_rows, budget, block_bytes, auto, row_bytes, publish_behind)
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
        cache._write_description(about or {})
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

    def _write_description(self, about: Mapping[str, Any]) -> None:
        """A small ``entry.json`` (what the entry is, and ``about`` it) for ``gpuload cache ls``
        and later jobs; written once."""
        path = self.root / "entry.json"
        if path.exists():
            return
        document = {
            **about, "format": FORMAT_VERSION, "fingerprint": asdict(self.fingerprint), "num_rows": self.num_rows,
            "columns": [c.as_json() for c in self.columns], "record_bytes": self.record_bytes,
            "block_rows": self.block_rows, "created": time.time(),
        }
        try:
            atomic_write(path, json.dumps(document, indent=1).encode())
        except OSError:
            pass  # only descriptive; a full disk is reported by the first write

    def __enter__(self) -> DiskCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



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
        free, total = disk_space(existing)
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
