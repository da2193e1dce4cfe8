"""The disk tier's entries as folders in a ``cache_dir``: listing them and removing them
(``gpuload cache ls`` and ``clear``).

Free of torch and NumPy, so that the command answers at once. Other processes may fill, open
or clear the same folder meanwhile: a file or an entry that vanishes while it is read is left
out, and an entry a process opens while it is being removed is left to that process.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ENTRY_NAME", "FORMAT_VERSION", "MANIFEST", "USERS", "EntryInfo", "list_entries", "remove_entry"]

FORMAT_VERSION = 3
"""Bumped whenever the bytes on disk change meaning; part of every fingerprint (2: ragged entries;
3: a trailer of stripe checksums after each block's data, the manifest holding its checksum). An
entry of another format is never read (its fingerprint differs); ``gpuload cache ls`` names it."""

MANIFEST = "manifest.json"
USERS = "users"
"""The file each process that has the entry open holds a shared ``flock`` on."""
ENTRY_NAME = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class EntryInfo:
    """One entry of a cache folder as ``gpuload cache ls`` shows it."""

    path: Path
    description: str
    fingerprint: str
    kind: str
    num_rows: int
    published_rows: int
    bytes_on_disk: int
    last_used: float
    in_use: bool
    problem: str = ""


def list_entries(cache_dir: str | os.PathLike[str]) -> list[EntryInfo]:
    """The gpuload entries in ``cache_dir`` (folders named by a 32-hex key), newest use first;
    other files and folders there are not gpuload's and are left out, and so is an entry
    removed while it is read."""
    folder = Path(cache_dir).expanduser()
    try:
        items = sorted(os.scandir(folder), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    entries = []
    for item in items:
        if ENTRY_NAME.match(item.name) and item.is_dir(follow_symlinks=False):
            entry = _read_entry(Path(item.path))
            if entry is not None:
                entries.append(entry)
    return sorted(entries, key=lambda e: -e.last_used)


def _read_entry(root: Path) -> EntryInfo | None:
    """What ``root`` holds; None when it was removed meanwhile."""
    problem, description, digest, kind, num_rows, block_rows, published = "", "?", "?", "?", 0, 1, 0
    try:
        info = json.loads((root / "entry.json").read_bytes())
        fingerprint = info["fingerprint"]
        description, digest, kind = fingerprint["description"], fingerprint["digest"], fingerprint["kind"]
        num_rows, block_rows = int(info["num_rows"]), int(info["block_rows"])
        written = info.get("format", FORMAT_VERSION)
        if written != FORMAT_VERSION:
            by = "an older" if isinstance(written, int) and written < FORMAT_VERSION else "another"
            problem = f"format {written}, {by} gpuload's: never read (`gpuload cache clear` removes it)"
    except (OSError, ValueError, KeyError, TypeError) as error:
        problem = f"no readable entry.json ({type(error).__name__})"
    try:
        manifest = json.loads((root / MANIFEST).read_bytes())
        published = sum(min(block_rows, num_rows - b * block_rows) for b, _, _ in manifest["blocks"])
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as error:
        problem = problem or f"damaged manifest ({type(error).__name__})"
    size, used = 0, 0.0
    try:
        files = list(os.scandir(root))
    except FileNotFoundError:
        return None
    for file in files:
        try:  # a filling process renames parts and manifests, a clearing one removes them
            status = file.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        size += status.st_blocks * 512
        used = max(used, status.st_mtime) if file.name in (USERS, MANIFEST) else used
    return EntryInfo(root, description, digest, kind, num_rows, published, size, used, _in_use(root), problem)


def _in_use(root: Path) -> bool:
    try:
        fd = os.open(root / USERS, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def remove_entry(entry: EntryInfo | str | os.PathLike[str]) -> bool:
    """Delete one entry folder unless a process has it open (then False). Holds its ``users``
    lock exclusively while deleting, so no process can join it halfway; a process that opens
    the entry meanwhile (its first files appear while this deletes) keeps it: False."""
    root = Path(entry.path if isinstance(entry, EntryInfo) else entry)
    if not ENTRY_NAME.match(root.name):
        raise ValueError(f"{root} is not a gpuload disk cache entry (a folder named by a 32-hex key)")
    try:
        fd = os.open(root / USERS, os.O_RDONLY)
    except FileNotFoundError:  # no process has opened it yet, or it is gone
        return _remove_files(root, _names(root))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        _remove_files(root, [name for name in _names(root) if name != USERS], keep_folder=True)
        if any(name != USERS for name in _names(root)):
            return False  # a process opened it meanwhile: it waits for this lock, then uses the entry
        return _remove_files(root, [USERS])
    finally:
        os.close(fd)


def _names(root: Path) -> list[str]:
    """The files in ``root``; none when another clear removed it meanwhile."""
    try:
        return os.listdir(root)
    except FileNotFoundError:
        return []


def _remove_files(root: Path, names: list[str], *, keep_folder: bool = False) -> bool:
    """Remove ``names`` in ``root`` (gone already is fine), then ``root`` unless ``keep_folder``;
    False when ``root`` is not empty then (a process put files there meanwhile)."""
    for name in names:
        path = root / name
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            pass
    if keep_folder:
        return True
    try:
        root.rmdir()
    except FileNotFoundError:
        pass
    except OSError as error:
        if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        return False
    return True
