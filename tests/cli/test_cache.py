"""``gpuload cache ls`` and ``gpuload cache clear``: the disk tier's entries, listed and removed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from gpuload.cache.disk import ColumnSpec, DiskCache, Fingerprint
from gpuload.cli import main


def _entry(folder: Path, name: str, rows: int = 20, fill: int = 20) -> DiskCache:
    cache = DiskCache.open(folder, Fingerprint.of("arrays", f"{name}(rows)", {"name": name}),
                           [ColumnSpec("x", torch.float32, (4,))], rows, 1 << 20, block_bytes=64)
    assert cache is not None
    cache.write(torch.arange(fill), [torch.ones(fill, 4)])
    return cache


def _age(cache: DiskCache, days: float) -> None:
    then = time.time() - days * 86400
    for name in ("users", "manifest.json"):
        os.utime(cache.root / name, (then, then))


def test_ls_shows_entries_rows_sizes_fingerprints_and_last_use(tmp_path: Path, capsys) -> None:
    full, partial = _entry(tmp_path, "full"), _entry(tmp_path, "partial", rows=40, fill=12)
    full.close()
    _age(full, 3)
    (tmp_path / "notes.txt").write_text("not gpuload's")
    assert main(["cache", "ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines[0].startswith(f"{tmp_path}: 2 entries")
    assert partial.root.name in lines[1] and "partial(rows) [arrays]" in lines[1] and "12/40 rows" in lines[1]
    assert "in use" in lines[1] and partial.fingerprint.digest in lines[1] and "last used" in lines[1]
    assert full.root.name in lines[2] and "complete" in lines[2] and "3.0d ago" in lines[2] and "in use" not in lines[2]
    assert "notes.txt" not in out
    partial.close()


def test_ls_takes_the_folder_from_the_settings_or_says_what_is_missing(tmp_path: Path, monkeypatch, capsys) -> None:
    _entry(tmp_path, "one").close()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GPULOAD_CONFIG", raising=False)
    monkeypatch.setenv("GPULOAD_CACHE_DIR", str(tmp_path))
    assert main(["cache", "ls"]) == 0
    assert "1 entry" in capsys.readouterr().out
    monkeypatch.delenv("GPULOAD_CACHE_DIR")
    assert main(["cache", "ls"]) == 1
    assert "no cache folder: give DIR, or set GPULOAD_CACHE_DIR" in capsys.readouterr().err
    assert main(["cache", "ls", str(tmp_path / "missing")]) == 1
    assert "is not a folder" in capsys.readouterr().err
    monkeypatch.setenv("GPULOAD_CACHE_SIZE", "lots")
    assert main(["cache", "ls"]) == 1
    assert capsys.readouterr().err.startswith("gpuload cache: cache_size='lots' (from environment variable")


def test_clear_older_than_removes_only_old_unused_entries(tmp_path: Path, capsys) -> None:
    old, recent, busy = _entry(tmp_path, "old"), _entry(tmp_path, "recent"), _entry(tmp_path, "busy")
    old.close()
    recent.close()
    _age(old, 10)
    _age(busy, 10)  # old, but a process has it open
    (tmp_path / "keep.bin").write_bytes(b"user data")
    assert main(["cache", "clear", str(tmp_path), "--older-than", "7d"]) == 0
    out = capsys.readouterr().out
    assert "removed 1 entry" in out and "1 in use kept" in out and "busy(rows)" in out
    assert not old.root.exists() and recent.root.exists() and busy.root.exists()
    assert busy.present(torch.arange(20)).all()  # still readable by the process that has it
    busy.close()
    assert main(["cache", "clear", str(tmp_path)]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.bin"]


def test_clear_rejects_a_bad_age(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["cache", "clear", str(tmp_path), "--older-than", "a week"])
    assert exit_info.value.code == 2
    assert "'a week' is not an age" in capsys.readouterr().err
