"""One disk-tier entry open in this process: its files and locks, its manifest as last read,
its counters; recovery after a killed process, reopening after a fork, closing.

:class:`Entry` is what :class:`~gpuload.cache.disk.reading.EntryReader` and
:class:`~gpuload.cache.disk.writing.EntryWriter` share; :class:`~gpuload.cache.disk.DiskCache`
is both.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpuload.cache.budget import format_bytes
from gpuload.cache.disk.blocks import BLOCK_NAME, ColumnSpec, record_bytes_of, record_layout
from gpuload.cache.disk.checking import StripeChecks
from gpuload.cache.disk.files import STRIPE_BYTES
from gpuload.cache.disk.fingerprint import Fingerprint
from gpuload.cache.disk.locking import Flock, track
from gpuload.cache.disk.manifest import Manifest, file_identity_of, read_manifest, write_manifest
from gpuload.cache.disk.publishing import BlockPublisher
from gpuload.cache.entries import FORMAT_VERSION, MANIFEST

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class DiskCacheWarning(UserWarning):
    """The disk tier cannot be used, stopped growing, or found a damaged file (named)."""


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


class Entry:
    """The state of one entry open in this process (see the package doc for its files)."""

    def __init__(
        self, root: Path, fingerprint: Fingerprint, columns: tuple[ColumnSpec, ...], num_rows: int, budget: int,
        block_bytes: int, auto_budget: bool, row_bytes: int | None = None, publish_behind: bool = False,
    ) -> None:
        self.root = root
        self.fingerprint = fingerprint
        self.columns = columns
        self.num_rows = num_rows
        self.ragged = columns[0].ragged
        if self.ragged:
            self.offsets, self.record_bytes = [0], record_bytes_of(columns, row_bytes)
        else:
            self.offsets, self.record_bytes = record_layout(columns)
        # A ragged row's entry in ``rows.index`` and its block's table: offset, shape, dim order.
        self._entry_words = 1 + 2 * len(columns[0].shape)
        self.block_rows = max(1, block_bytes // max(1, self.record_bytes))
        self.num_blocks = -(-num_rows // self.block_rows) if num_rows else 0
        self.budget = budget
        self._auto_budget = auto_budget
        self._mutex = threading.RLock()
        self._manifest = Manifest()
        self._verified: set[int] = set()  # blocks whose every stripe is checked (or this process published)
        self._stripes: dict[int, StripeChecks] = {}  # blocks mapped, some of their stripes not checked yet
        self._behind = publish_behind  # complete blocks published on a background thread (else in write)
        self._publisher = BlockPublisher(self._publish_behind)
        self._maps: OrderedDict[int, tuple[mmap.mmap | None, np.ndarray]] = OrderedDict()
        self._parts: OrderedDict[int, tuple[int, int]] = OrderedDict()  # block -> (fd, inode)
        self._stats = DiskCacheStats(path=str(root), budget=budget, rows=num_rows)
        self._closed = False
        self._pid = os.getpid()
        self._lock_fd = self._users_fd = self._flags_fd = self._index_fd = -1
        track(self)
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

    # -- recovery and forks --------------------------------------------------------------------

    def _recover(self) -> None:
        """If no other process has this entry open, discard what a killed one left (parts,
        flags, temporary manifests, blocks the manifest does not list); then join as a user."""
        try:
            fcntl.flock(self._users_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fcntl.flock(self._users_fd, fcntl.LOCK_SH)
            return
        with self._entry_lock():
            listed = set(read_manifest(self.root, self._header(), self.num_blocks)[0].blocks)
            for entry in os.scandir(self.root):
                match = BLOCK_NAME.match(entry.name)
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

    def _after_fork(self) -> None:
        """In a forked child, at the fork: a new mutex (a thread of the parent may have held the
        old one) and no publishing thread (the parent's is not in this process: its queued
        blocks are the parent's to publish)."""
        self._mutex = threading.RLock()
        self._publisher = BlockPublisher(self._publish_behind)

    # -- locks and the manifest ---------------------------------------------------------------

    def _entry_lock(self) -> Flock:
        return Flock(self._lock_fd)

    def _reload(self, force: bool = False) -> None:
        """Read the manifest again if another process replaced it since."""
        identity = file_identity_of(self.root)
        if not force and identity == self._manifest.identity:
            return
        manifest, problem = read_manifest(self.root, self._header(), self.num_blocks)
        if problem and identity != getattr(self, "_reported_manifest", None):
            self._reported_manifest = identity
            warnings.warn(f"gpuload disk cache: {problem}; its blocks are filled again", DiskCacheWarning, stacklevel=3)
        for block in set(self._manifest.blocks) - set(manifest.blocks):
            self._forget(block)
        self._manifest = manifest
        self._stats.published_rows = sum(self._rows_in(b) for b in manifest.blocks)
        self._stats.published_bytes = sum(size for size, _ in manifest.blocks.values())

    def _header(self) -> dict[str, Any]:
        """What the manifest says of the entry it describes (checked when read)."""
        return {
            "format": FORMAT_VERSION, "fingerprint": self.fingerprint.digest, "num_rows": self.num_rows,
            "record_bytes": self.record_bytes, "block_rows": self.block_rows, "stripe_bytes": STRIPE_BYTES,
            "columns": [c.as_json() for c in self.columns],
        }

    def _write_manifest(self) -> None:
        write_manifest(self.root, self._header(), self._manifest)
        self._stats.published_rows = sum(self._rows_in(b) for b in self._manifest.blocks)
        self._stats.published_bytes = sum(size for size, _ in self._manifest.blocks.values())

    # -- rows and blocks ----------------------------------------------------------------------

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

    def _forget(self, block: int) -> None:
        """This process no longer trusts or maps ``block`` (it was unpublished)."""
        self._verified.discard(block)
        self._stripes.pop(block, None)
        self._maps.pop(block, None)

    # -- stopping -----------------------------------------------------------------------------

    def _close_part(self, block: int) -> None:
        """Close this process's descriptor of block ``block``'s ``.part``, if open."""
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

    # -- publication behind the loop -----------------------------------------------------------

    def _publish_behind(self, block: int, size: int, inode: int) -> None:
        """Publish a complete block (on the publisher's thread); the writer defines it."""
        raise NotImplementedError

    def _salvage(self, block: int, rows: np.ndarray, records: np.ndarray) -> None:
        """Write back the intact ``rows`` of a block just dropped as damaged; the writer defines it."""
        raise NotImplementedError

    def _settle(self, blocks: Iterable[int] | None = None) -> None:
        """Wait until this process's queued blocks ``blocks`` (None: all) are published, and hand
        on what stopped the publishing thread: an OSError stops the tier growing (one warning
        naming the file), anything else is raised here. Never with the mutex held (publishing
        takes it)."""
        self._publisher.wait(blocks)
        failure = self._publisher.failure()
        if failure is None:
            return
        if isinstance(failure, OSError):
            with self._mutex:
                self._stop(failure, Path(failure.filename) if failure.filename else self.root)
            return
        raise RuntimeError(f"gpuload disk cache: publishing a block of {self.root} failed: {failure!r}") from failure

    # -- the rest -----------------------------------------------------------------------------

    def stats(self) -> DiskCacheStats:
        """The counters (a copy), once the blocks this process queued are published."""
        self._settle()
        with self._mutex:
            return DiskCacheStats(**self._stats.as_dict())

    @property
    def complete(self) -> bool:
        """Every row is published, or in a block this process queued for publication (asked at
        every batch's end: never waits; a reader waits for the blocks it asks for)."""
        with self._mutex:
            self._reload()
            return len(self._manifest.blocks.keys() | self._publisher.queued()) == self.num_blocks

    def close(self) -> None:
        """Unmap, close the files and leave the entry (its published blocks stay for later
        jobs; parts another process is filling stay for it), once the blocks this process
        queued are published. Safe to call twice."""
        if not self._closed:
            self._settle()
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

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        s = self._stats
        return (f"DiskCache({self.root}, {s.published_rows}/{self.num_rows} rows published, "
                f"{format_bytes(s.published_bytes)} of {format_bytes(self.budget)})")
