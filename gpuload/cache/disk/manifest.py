"""An entry's manifest: the blocks published (each one's data size and the checksum of its trailer of
stripe checksums), under a header that says which entry it describes (format, fingerprint, rows,
layout, stripe size). Written last, atomically:
a block is published once the manifest lists it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuload.cache.disk.files import atomic_write
from gpuload.cache.entries import MANIFEST


@dataclass
class Manifest:
    """The published blocks as one process last read or wrote them."""

    blocks: dict[int, tuple[int, int]] = field(default_factory=dict)  # block -> (data bytes, its trailer's checksum)
    identity: tuple[int, int] | None = None  # (inode, mtime_ns) of the file this came from


def file_identity_of(root: Path) -> tuple[int, int] | None:
    """(inode, mtime_ns) of the entry's manifest, None when there is none: another process
    replaced it when this changes."""
    try:
        status = os.stat(root / MANIFEST)
    except FileNotFoundError:
        return None
    return status.st_ino, status.st_mtime_ns


def read_manifest(root: Path, header: dict[str, Any], num_blocks: int) -> tuple[Manifest, str]:
    """The manifest's blocks, or an empty one and the problem when it does not describe the
    entry whose ``header`` is given (damaged, another format, other columns)."""
    path = root / MANIFEST
    try:
        status = os.stat(path)
        data = path.read_bytes()
    except FileNotFoundError:
        return Manifest(), ""
    identity = (status.st_ino, status.st_mtime_ns)
    try:
        document = json.loads(data)
        for name, value in header.items():
            if document[name] != value:
                return Manifest(identity=identity), f"{path} is for another {name} ({document[name]!r}, not {value!r})"
        blocks = {int(b): (int(size), int(crc)) for b, size, crc in document["blocks"]}
        if any(not 0 <= b < num_blocks for b in blocks):
            raise ValueError("a block number is out of range")
    except (ValueError, KeyError, TypeError) as error:
        return Manifest(identity=identity), f"{path} is damaged ({type(error).__name__}: {error})"
    return Manifest(blocks, identity), ""


def write_manifest(root: Path, header: dict[str, Any], manifest: Manifest) -> None:
    """Publish ``manifest`` under ``header`` atomically; its identity becomes the new file's."""
    document = {**header, "blocks": [[b, size, crc] for b, (size, crc) in sorted(manifest.blocks.items())]}
    atomic_write(root / MANIFEST, json.dumps(document, separators=(",", ":")).encode())
    manifest.identity = file_identity_of(root)
