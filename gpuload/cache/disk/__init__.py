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
    block-000012.bin    rows [12*B, 13*B): one record per row, the columns side by side; then
                        its trailer: a uint64 checksum (XXH3) per 64 KiB stripe of those bytes
    block-000013.part   a block being filled (any process may write its rows into it)
    rows.fill           one byte per row: 1 once that row's bytes are in its .part
    rows.index          ragged entries: per row, its offset in its .part, shape and dimension order
    entry.json          what the entry is (format, fingerprint, columns, rows; a sample cache's: the
                        samples' structure, so a later job reads no sample to open it), for
                        ``gpuload cache ls``
    lock                flock'ed (exclusive, briefly) around every write and publication
    users               flock'ed (shared) by every open DiskCache; its mtime: the last open

A row is a record of ``record_bytes``; a block file holds ``B`` consecutive records, so a run of
consecutive rows is one sequential read of one memory map. A ragged block holds its ``B`` rows
back to back in the order they arrived (each in its own dimension order, aligned to its item
size), then its table: per row, an int64 offset, shape and dimension order (``B`` is chosen from
the caller's typical row size, ``row_bytes``). The table is copied from ``rows.index`` when the
block is sealed, so the stripe checksums cover it; a reader checks it too (every row inside the
data). Filling follows the epoch's order: a row goes into its block's ``.part`` at its offset
(``pwrite``; a ragged row at the part's end, its ``rows.index`` entry after it), its flag is
set, and when a block's last row arrives the block gets its trailer of stripe checksums, is
fsync'ed, renamed to ``.bin`` and only then listed in the manifest with its data's size and
the trailer's checksum (the manifest itself written to a temporary name, fsync'ed and renamed):
in the write that completes it, or with ``publish_behind`` (the tiers' caches) on a background
thread (:mod:`~gpuload.cache.disk.publishing`). A reader trusts only blocks the manifest lists:
the first time this process maps one it checks its size and trailer, then each stripe the first
time a row in it is looked at (:mod:`~gpuload.cache.disk.checking`); a block that fails is
reported once (naming the file, and the rows of a failing stripe), dropped from the manifest
and filled again. A process killed mid-fill leaves ``.part`` files and flags
that the next process to open the entry alone discards.

Several processes of a node share one entry: writes happen under the entry lock, so a row's
bytes are written once and each block is published once; rows another process has not
published yet are simply absent (the caller reads them from the source). Nothing is written
outside ``cache_dir``; folders and files are created with the process's umask.

A forked child using a DiskCache its parent opened opens the entry's files again at its first
use (a flock belongs to an open file, which a fork shares: the child's locks must be its own).
Do not edit an entry's files while a job has it open: a block truncated under a live memory map
faults its reader (SIGBUS); ``gpuload cache clear`` skips entries in use.

The package, one concept a module: :mod:`~gpuload.cache.disk.fingerprint` (what produced an
entry's bytes), :mod:`~gpuload.cache.disk.blocks` (the bytes of a block), :mod:`~gpuload.cache.disk.files`
(durable writes, stripe checksums), :mod:`~gpuload.cache.disk.checking` (stripes checked as reads touch them),
:mod:`~gpuload.cache.disk.publishing` (blocks published behind the loop),
:mod:`~gpuload.cache.disk.locking` (file locks, forks),
:mod:`~gpuload.cache.disk.manifest` (what is published), :mod:`~gpuload.cache.disk.entry` (one entry
open in this process), :mod:`~gpuload.cache.disk.reading`, :mod:`~gpuload.cache.disk.writing`,
:mod:`~gpuload.cache.disk.cache` (:class:`DiskCache`, opening an entry). The listing and removal
of entries (``gpuload cache``) is :mod:`gpuload.cache.entries`; the disk budget
:func:`~gpuload.cache.budget.disk_budget`.
"""

from __future__ import annotations

from gpuload.cache.budget import default_disk_reserve, disk_budget
from gpuload.cache.disk.blocks import DEFAULT_BLOCK_BYTES, RAGGED, ColumnSpec
from gpuload.cache.disk.cache import DiskCache
from gpuload.cache.disk.entry import DiskCacheStats, DiskCacheWarning
from gpuload.cache.disk.fingerprint import (
    Fingerprint,
    fingerprint_arrays,
    fingerprint_dataset,
    fingerprint_for,
    fingerprint_images,
)
from gpuload.cache.entries import FORMAT_VERSION, EntryInfo, list_entries, remove_entry

__all__ = [
    "DEFAULT_BLOCK_BYTES",
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
