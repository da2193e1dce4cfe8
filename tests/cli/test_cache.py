"""``gpuload cache ls`` and ``gpuload cache clear``: the disk tier's entries, listed and removed."""

from __future__ import annotations

import json
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


def test_ls_names_an_entry_of_an_older_format_as_never_read(tmp_path: Path, capsys) -> None:
    """An entry an older gpuload wrote (format 2: no stripe checksums) sits under another key and
    is never read; the listing says so and how to free its room."""
    old, current = _entry(tmp_path, "old"), _entry(tmp_path, "current")
    old.close()
    current.close()
    description = json.loads((old.root / "entry.json").read_bytes())
    (old.root / "entry.json").write_text(json.dumps(dict(description, format=2)))
    assert main(["cache", "ls", str(tmp_path)]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.strip().splitlines()[1:]}
    said = ", format 2, an older gpuload's: never read (`gpuload cache clear` removes it)"
    assert lines[old.root.name].endswith(said)
    assert "format" not in lines[current.root.name].split("last used")[1]


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


def test_ls_leaves_out_files_and_entries_removed_while_it_reads(tmp_path: Path, monkeypatch, capsys) -> None:
    """Another process fills (renaming parts, replacing the manifest) or clears the folder while
    ``ls`` reads it: a file gone before its stat, an entry gone before its scan, are left out."""
    from gpuload.cache import entries

    kept, gone = _entry(tmp_path, "kept"), _entry(tmp_path, "gone")
    kept.close()
    gone.close()
    (kept.root / "block-000009.part").write_bytes(b"x" * 4096)
    real_scandir = os.scandir

    def racing_scandir(path):
        listed = list(real_scandir(path))
        if Path(path) == tmp_path:  # the entry is removed after the folder is listed
            for name in os.listdir(gone.root):
                os.unlink(gone.root / name)
            os.rmdir(gone.root)
        if Path(path) == kept.root:  # the part is renamed after the entry is listed
            os.unlink(kept.root / "block-000009.part")
        return iter(listed)

    monkeypatch.setattr(entries.os, "scandir", racing_scandir)
    assert main(["cache", "ls", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith(f"{tmp_path}: 1 entry") and len(lines) == 2
    assert kept.root.name in lines[1] and "complete" in lines[1]


def test_clear_leaves_an_entry_opened_meanwhile_to_its_user(tmp_path: Path, monkeypatch, capsys) -> None:
    """A job opens the entry while ``clear`` deletes it: clear says so in one line and the job
    keeps a working entry (before: ``OSError: Directory not empty``)."""
    _entry(tmp_path, "raced").close()
    opened: list[DiskCache] = []
    real_rmdir = os.rmdir

    def opening_rmdir(path, *args, **kwargs):
        if not opened and Path(path).parent == tmp_path:  # clear has emptied the folder, a job opens it
            opened.append(_entry(tmp_path, "raced"))
        return real_rmdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", opening_rmdir)
    assert main(["cache", "clear", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "removed 0 entries" in out and "1 in use kept" in out
    assert sum("kept" in line and "raced(rows)" in line for line in out.splitlines()) == 1
    cache = opened[0]
    assert cache.root.is_dir() and cache.present(torch.arange(20)).all()
    assert torch.equal(cache.read(torch.arange(20))[0], torch.ones(20, 4))
    cache.close()
    monkeypatch.undo()
    assert main(["cache", "clear", str(tmp_path)]) == 0
    assert "removed 1 entry" in capsys.readouterr().out and not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [["ls", "DIR"], ["ls"], ["clear", "DIR"]])
def test_cache_commands_do_not_import_torch(tmp_path: Path, argv: list[str]) -> None:
    """Listing a folder needs no torch (3 to 8 s to import): ``ls`` and ``clear`` answer at once,
    with the folder given or taken from the settings."""
    import subprocess
    import sys

    _entry(tmp_path, "one").close()
    root = Path(__file__).resolve().parents[2]
    code = ("import sys\nfrom gpuload.cli import main\ncode = main(sys.argv[1:])\n"
            "print('torch imported:', 'torch' in sys.modules, 'numpy' in sys.modules)\nsys.exit(code)")
    env = {**os.environ, "GPULOAD_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    env.pop("GPULOAD_CONFIG", None)
    done = subprocess.run([sys.executable, "-c", code, "cache", *[str(tmp_path) if a == "DIR" else a for a in argv]],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "1 entr" in done.stdout and "torch imported: False False" in done.stdout


def test_clear_leaves_an_entry_to_a_job_that_opened_it_while_its_files_were_removed(tmp_path: Path,
                                                                                   monkeypatch, capsys) -> None:
    """The job arrives after clear took the entry's lock and removed its files: it waits on the
    lock, clear sees its new files and leaves the entry (and its lock file) to it."""
    import threading

    from gpuload.cache import entries

    first = _entry(tmp_path, "late")
    first.close()
    root = first.root
    real_listdir = os.listdir
    calls: list[int] = []
    opened: list[DiskCache] = []
    job = threading.Thread(target=lambda: opened.append(_entry(tmp_path, "late")), daemon=True)

    def listdir_then_a_job_opens(path):
        if Path(path) == root:
            calls.append(1)
            if len(calls) == 2:  # clear has removed the files and looks again
                job.start()
                deadline = time.monotonic() + 60
                while not (root / "lock").exists() and time.monotonic() < deadline:
                    time.sleep(0.01)  # the job has made its lock file and waits for clear's lock
        return real_listdir(path)

    monkeypatch.setattr(entries.os, "listdir", listdir_then_a_job_opens)
    assert main(["cache", "clear", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "removed 0 entries" in out and "kept" in out and "1 in use kept" in out
    job.join(timeout=60)
    assert not job.is_alive() and opened
    cache = opened[0]
    assert cache.root == root and cache.present(torch.arange(20)).all()
    assert torch.equal(cache.read(torch.arange(20))[0], torch.ones(20, 4))
    (listed,) = entries.list_entries(tmp_path)
    assert listed.in_use  # its lock is on the entry's users file, not on one clear unlinked
    cache.close()
