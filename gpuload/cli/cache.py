"""``gpuload cache ls [DIR]`` and ``gpuload cache clear [DIR] [--older-than 7d]``: the disk
tier's entries, and removing them.

DIR defaults to the resolved ``cache_dir`` (``GPULOAD_CACHE_DIR``, else ``gpuload.toml``). Only
gpuload's entry folders are listed or removed; other files in DIR are left alone, and so is an
entry a running process has open or opens meanwhile. Neither torch nor NumPy is imported: the
command answers at once while another process fills the folder.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from gpuload.sizes import CacheSettingError, format_bytes

__all__ = ["add_arguments", "parse_age", "run"]

_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$", re.IGNORECASE)
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"90s"``, ``"2w"`` in seconds (argparse ``type=``)."""
    match = _AGE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age: write a number and s, m, h, d or w (7d, 12h)")
    return float(match.group(1)) * _SECONDS[match.group(2).lower()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``ls`` and ``clear`` subcommands of ``gpuload cache``."""
    actions = parser.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("ls", help="list the disk tier's entries: rows, size, fingerprint, last used")
    listing.add_argument("dir", nargs="?", default=None, help="the cache folder (default: cache_dir from the settings)")
    clear = actions.add_parser("clear", help="remove entries (all, or those unused for --older-than)")
    clear.add_argument("dir", nargs="?", default=None, help="the cache folder (default: cache_dir from the settings)")
    clear.add_argument("--older-than", type=parse_age, default=None, metavar="AGE",
                       help="only entries not used for this long: 7d, 12h, 30m")


def _folder(args: argparse.Namespace) -> Path | None:
    if args.dir is not None:
        return Path(args.dir).expanduser()
    from gpuload.cache.settings import CacheSettings

    try:
        settings = CacheSettings.resolve()
    except CacheSettingError as error:
        print(f"gpuload cache: {error}", file=sys.stderr)
        return None
    if settings.disk_dir.value is None:
        print("gpuload cache: no cache folder: give DIR, or set GPULOAD_CACHE_DIR or cache_dir in gpuload.toml",
              file=sys.stderr)
    return settings.disk_dir.value


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit} ago"
    return f"{max(0, seconds):.0f}s ago"


def run(args: argparse.Namespace) -> int:
    """Run ``gpuload cache ls`` or ``gpuload cache clear``; 0 on success, 1 on a missing folder."""
    folder = _folder(args)
    if folder is None:
        return 1
    if not folder.is_dir():
        print(f"gpuload cache: {folder} is not a folder", file=sys.stderr)
        return 1
    from gpuload.cache.entries import list_entries, remove_entry

    entries = list_entries(folder)
    now = time.time()
    if args.action == "ls":
        print(f"{folder}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, "
              f"{format_bytes(sum(e.bytes_on_disk for e in entries))}")
        for e in entries:
            complete = e.num_rows and e.published_rows == e.num_rows
            state = "complete" if complete else f"{e.published_rows}/{e.num_rows} rows"
            notes = "".join(f", {n}" for n in (("in use" if e.in_use else ""), e.problem) if n)
            print(f"  {e.path.name}  {e.description} [{e.kind}]  {state}  {format_bytes(e.bytes_on_disk)}  "
                  f"fingerprint {e.fingerprint}  last used {_age(now - e.last_used)}{notes}")
        return 0
    removed = freed = kept_in_use = 0
    for e in entries:
        if args.older_than is not None and now - e.last_used < args.older_than:
            continue
        if remove_entry(e):
            removed, freed = removed + 1, freed + e.bytes_on_disk
        else:
            kept_in_use += 1
            print(f"  kept {e.path.name} ({e.description}): a running process has it open or opened it meanwhile")
    print(f"{folder}: removed {removed} entr{'y' if removed == 1 else 'ies'}, freed {format_bytes(freed)}"
          + (f"; {kept_in_use} in use kept" if kept_in_use else ""))
    return 0
