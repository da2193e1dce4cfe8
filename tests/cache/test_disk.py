"""The disk tier (gpuload/cache/disk/): settings, identity, round trips, and its faults.

Fault tests run the process that fills or reads the cache as a new process (killed with
SIGKILL, on a full or read-only file system, with a chosen umask), so each starts with nothing
in memory: what it reads, it reads from the folder. Each is forked from the suite's fork server
(torch and gpuload imported once), or is a fresh interpreter where it runs inside a mount
namespace (``unshare``).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from child_processes import Child, results_of

import gpuload
from gpuload.cache.budget import CacheSettingError, SizeSpec
from gpuload.cache.disk import (
    RAGGED,
    ColumnSpec,
    DiskCache,
    DiskCacheWarning,
    Fingerprint,
    default_disk_reserve,
    disk_budget,
    fingerprint_for,
)
from gpuload.cache.disk.files import checksum, stripe_sums, trailer_bytes
from gpuload.cache.identity import IdentityError
from gpuload.cache.settings import CacheSettings

ROOT = Path(__file__).resolve().parents[2]
SHAPE = (16, 16, 3)
RECORD = 16 * 16 * 3 + 8  # image bytes, then an int64 label (aligned to 8)
BLOCK_ROWS = 8
HANG_S = 600  # a child takes seconds quiet, a minute at load 10: past this it hangs

# What every child process shares: the dataset (seeded), its fingerprint, the columns.
CHILD = textwrap.dedent(
    f"""
    import json, os, sys, time, warnings
    import numpy as np, torch
    from gpuload.cache.disk import ColumnSpec, DiskCache, DiskCacheWarning, Fingerprint
    warnings.simplefilter("always")
    FOLDER, N = sys.argv[1], int(sys.argv[2])
    images = torch.randint(0, 256, (N, *{SHAPE}), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(N) * 7
    FP = Fingerprint.of("arrays", "test rows", {{"seed": 0, "rows": N}})
    COLUMNS = [ColumnSpec("image", torch.uint8, {SHAPE}), ColumnSpec("label", torch.int64, ())]

    def open_cache(budget=1 << 30):
        return DiskCache.open(FOLDER, FP, COLUMNS, N, budget, block_bytes={BLOCK_ROWS * RECORD})

    def epoch(cache, order, batch=8):
        '''One epoch as the loader would run it: rows from the disk where published, the rest
        from the source (and written); True if every batch equals the source's.'''
        same = True
        for start in range(0, len(order), batch):
            rows = torch.as_tensor(order[start:start + batch])
            got_images, got_labels = images[rows].clone(), labels[rows].clone()
            hit = cache.present(rows)
            if hit.any():
                got_images[hit], got_labels[hit] = cache.read(rows[hit])
            cache.write(rows[~hit], [images[rows[~hit]], labels[rows[~hit]]])
            same &= torch.equal(got_images, images[rows]) and torch.equal(got_labels, labels[rows])
        return same
    """
)


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.randint(0, 256, (n, *SHAPE), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    return images, torch.arange(n) * 7


def _open(folder: Path, n: int, budget: int = 1 << 30) -> DiskCache:
    cache = DiskCache.open(
        folder, Fingerprint.of("arrays", "test rows", {"seed": 0, "rows": n}),
        [ColumnSpec("image", torch.uint8, SHAPE), ColumnSpec("label", torch.int64, ())], n, budget,
        block_bytes=BLOCK_ROWS * RECORD,
    )
    assert cache is not None
    return cache


def _environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """What a child's environment is: this one, this checkout on ``PYTHONPATH``, and ``env``."""
    return {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}


def _start(script: str, folder: Path, n: int, *, cwd: Path | None = None,
           env: dict[str, str] | None = None) -> Child:
    """CHILD + ``script`` on ``folder`` and ``n`` rows, as ``python -c`` runs it, started now as a
    new process forked from the suite's fork server (nothing of an earlier child in memory); its
    code, stdout and stderr kept in a folder beside ``folder``."""
    return Child([str(folder), str(n)], _environment(env), folder.parent / f"{folder.name}-children", "child",
                 code=CHILD + textwrap.dedent(script), cwd=cwd)


def _child(script: str, folder: Path, n: int, *, cwd: Path | None = None, env: dict[str, str] | None = None) -> Any:
    """What :func:`_start`'s child printed as JSON on its last stdout line, once it ended with status 0."""
    return _start(script, folder, n, cwd=cwd, env=env).result(HANG_S)


def _entry(folder: Path) -> Path:
    (entry,) = [p for p in folder.iterdir() if p.is_dir()]
    return entry


def forge_block(path: Path, data: bytes) -> list[int]:
    """Replace a block file with ``data`` and the trailer of stripe checksums a writer would give
    it: every checksum passes. Its manifest entry (block number and the new size and checksum)."""
    trailer = stripe_sums(np.frombuffer(data, dtype=np.uint8)).tobytes()
    path.write_bytes(data + trailer)
    return [int(path.name[6:12]), len(data), checksum(trailer)]


def _block_rows(block: int) -> list[int]:
    return list(range(block * BLOCK_ROWS, (block + 1) * BLOCK_ROWS))


# ---------------------------------------------------------------- settings


def test_cache_dir_and_disk_size_resolve_keyword_then_environment_then_file(tmp_path: Path) -> None:
    (tmp_path / "gpuload.toml").write_text('cache_dir = "spill"\ndisk_cache_size = "20GiB"\n')
    from_file = CacheSettings.resolve(environ={}, cwd=tmp_path)
    assert from_file.disk_dir.value == tmp_path / "spill"  # relative to the file's folder
    assert from_file.disk_dir.source == str(tmp_path / "gpuload.toml")
    assert from_file.disk_size.value == SizeSpec("bytes", 20 * 2**30, "20GiB")
    env = {"GPULOAD_CACHE_DIR": "/scratch/a", "GPULOAD_DISK_CACHE_SIZE": "1TB"}
    from_env = CacheSettings.resolve(environ=env, cwd=tmp_path)
    assert from_env.disk_dir.value == Path("/scratch/a")
    assert from_env.disk_size.source == "environment variable GPULOAD_DISK_CACHE_SIZE"
    keyword = CacheSettings.resolve(cache_dir=tmp_path / "k", disk_cache_size="off", environ=env, cwd=tmp_path)
    assert keyword.disk_dir.value == tmp_path / "k" and keyword.disk_dir.source == "keyword cache_dir="
    assert keyword.disk_size.value.kind == "off"
    assert "cache_dir=" in keyword.describe() and "disk_cache_size=" in keyword.describe()
    default = CacheSettings.resolve(environ={}, cwd="/")
    assert default.disk_dir.value is None and default.disk_size.value.kind == "auto"
    assert "cache_dir" not in default.describe()  # no folder: no disk tier, nothing new to print


def test_cache_dir_and_disk_size_errors_name_their_source(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(CacheSettingError, match=r"cache_dir=.*environment variable GPULOAD_CACHE_DIR.*is a file"):
        CacheSettings.resolve(environ={"GPULOAD_CACHE_DIR": str(tmp_path / "a-file")}, cwd=tmp_path)
    with pytest.raises(CacheSettingError, match=r"disk_cache_size='lots' \(from environment variable GPULOAD_DISK"):
        CacheSettings.resolve(environ={"GPULOAD_DISK_CACHE_SIZE": "lots"}, cwd=tmp_path)
    with pytest.raises(CacheSettingError, match=r"cache_dir=3 \(from keyword cache_dir=\) is a int"):
        CacheSettings.resolve(cache_dir=3, environ={}, cwd=tmp_path)
    (tmp_path / "gpuload.toml").write_text('disk_cache_size = "12 parsecs"\n')
    with pytest.raises(CacheSettingError, match=r"disk_cache_size=.*gpuload.toml\) has an unknown unit"):
        CacheSettings.resolve(environ={}, cwd=tmp_path)


def test_the_loader_keeps_the_disk_settings_and_checks_them(tmp_path: Path, monkeypatch) -> None:
    dataset = gpuload.datasets.ArrayDataset(torch.zeros(4, 2))
    loader = gpuload.DataLoader(dataset, cache_dir=tmp_path, disk_cache_size="1GiB", device="cpu")
    assert loader.cache_dir == tmp_path and loader.disk_cache_size == "1GiB"
    assert loader._cache_settings.disk_dir.value == tmp_path
    monkeypatch.setenv("GPULOAD_DISK_CACHE_SIZE", "-1")
    with pytest.raises(CacheSettingError, match="GPULOAD_DISK_CACHE_SIZE"):
        gpuload.DataLoader(dataset, device="cpu")


def test_default_budget_is_the_free_space_less_a_reserve(tmp_path: Path, pretend_disk_space) -> None:
    pretend_disk_space(free=50 * 2**30, total=400 * 2**30)
    assert default_disk_reserve(400 * 2**30) == 8 * 2**30  # 5% of 400 GiB, at most 8 GiB
    assert disk_budget(tmp_path, SizeSpec("auto")) == 42 * 2**30
    assert disk_budget(tmp_path, SizeSpec("fraction", 0.5)) == 25 * 2**30
    assert disk_budget(tmp_path, SizeSpec("bytes", 123)) == 123 and disk_budget(tmp_path, SizeSpec("off")) == 0


# ---------------------------------------------------------------- storing and reading


def test_rows_written_in_shuffled_batches_read_back_exactly(tmp_path: Path) -> None:
    columns = [ColumnSpec("x", torch.bfloat16, (3,)), ColumnSpec("flag", torch.bool, ()),
               ColumnSpec("y", torch.float64, (2, 2)), ColumnSpec("id", torch.int16, ())]
    n = 301
    x = torch.randn(n, 3).to(torch.bfloat16)
    flag, y = torch.arange(n) % 3 == 0, torch.randn(n, 2, 2, dtype=torch.float64)
    ids = torch.arange(n, dtype=torch.int16)
    cache = DiskCache.open(tmp_path, Fingerprint.of("arrays", "mixed", {"n": n}), columns, n, 1 << 20, block_bytes=1000)
    assert cache is not None and cache.record_bytes % 8 == 0 and cache.offsets[2] % 8 == 0
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    for start in range(0, n, 64):
        rows = order[start:start + 64]
        assert not cache.present(rows).any()
        assert cache.write(rows, [x[rows], flag[rows], y[rows], ids[rows]]) == len(rows)
    assert cache.complete and cache.stats().published_rows == n and cache.stats().rows_written == n
    assert cache.write(order[:10], [x[order[:10]], flag[order[:10]], y[order[:10]], ids[order[:10]]]) == 0
    for rows in (torch.arange(n), order, torch.tensor([300, 0, 5, 6, 7, 7, 299]), torch.tensor([], dtype=torch.long)):
        got = cache.read(rows)
        for value, want in zip(got, (x, flag, y, ids)):
            assert value.dtype == want.dtype and torch.equal(value, want[rows])
    assert not (tmp_path / cache.root.name / "block-000000.part").exists()
    cache.close()
    again = _open_like(tmp_path, columns, n)
    assert again.present(torch.arange(n)).all() and torch.equal(again.read(order)[2], y[order])
    again.close()


def _open_like(folder: Path, columns: list[ColumnSpec], n: int) -> DiskCache:
    cache = DiskCache.open(folder, Fingerprint.of("arrays", "mixed", {"n": n}), columns, n, 1 << 20, block_bytes=1000)
    assert cache is not None
    return cache


def test_bad_rows_and_columns_get_clear_errors(tmp_path: Path) -> None:
    images, labels = _data(20)
    cache = _open(tmp_path, 20)
    with pytest.raises(ValueError,
                       match=r"column 'image': write needs a tensor of shape \(2, 16, 16, 3\) and dtype torch.uint8"):
        cache.write(torch.tensor([0, 1]), [images[:2].float(), labels[:2]])
    with pytest.raises(ValueError, match="write got 1 columns, the disk cache has 2"):
        cache.write(torch.tensor([0]), [images[:1]])
    with pytest.raises(IndexError, match="row 20 is outside the disk cache's 20 rows"):
        cache.present(torch.tensor([20]))
    with pytest.raises(LookupError, match="row 3 is not in the disk cache"):
        cache.read(torch.tensor([3]))
    with pytest.raises(ValueError, match="rows repeat|column names repeat"):
        DiskCache.open(tmp_path, Fingerprint.of("arrays", "x", {}), [ColumnSpec("a", torch.uint8, ()),
                                                                       ColumnSpec("a", torch.uint8, ())], 3)
    cache.close()


def test_the_budget_bounds_what_is_stored_without_a_warning(tmp_path: Path) -> None:
    images, labels = _data(80)
    cache = _open(tmp_path, 80, budget=3 * BLOCK_ROWS * RECORD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for start in range(0, 80, 8):
            rows = torch.arange(start, start + 8)
            cache.write(rows, [images[rows], labels[rows]])
    stats = cache.stats()
    assert stats.published_rows == 3 * BLOCK_ROWS and stats.full and not stats.stopped
    assert cache.present(torch.arange(80)).sum() == 24
    assert torch.equal(cache.read(torch.arange(24))[0], images[:24])
    cache.close()


def test_from_settings_opens_the_folder_the_settings_name(tmp_path: Path) -> None:
    fingerprint, columns = Fingerprint.of("arrays", "x", {}), [ColumnSpec("x", torch.int32, (2,))]
    none = CacheSettings.resolve(environ={}, cwd=tmp_path)
    assert DiskCache.from_settings(none, fingerprint, columns, 10) is None
    off = CacheSettings.resolve(cache_dir=tmp_path / "c", disk_cache_size="off", environ={}, cwd=tmp_path)
    assert DiskCache.from_settings(off, fingerprint, columns, 10) is None and not (tmp_path / "c").exists()
    sized = CacheSettings.resolve(environ={"GPULOAD_CACHE_DIR": str(tmp_path / "c"), "GPULOAD_DISK_CACHE_SIZE": "1MiB"},
                                  cwd=tmp_path)
    cache = DiskCache.from_settings(sized, fingerprint, columns, 10)
    assert cache is not None and cache.budget == 2**20 and cache.root.parent == tmp_path / "c"
    cache.close()


# ---------------------------------------------------------------- identity


def test_a_different_fingerprint_never_reads_old_bytes(tmp_path: Path) -> None:
    images, labels = _data(16)
    columns = [ColumnSpec("image", torch.uint8, SHAPE), ColumnSpec("label", torch.int64, ())]
    old = DiskCache.open(tmp_path, fingerprint_for((images, labels)), columns, 16, 1 << 20)
    old.write(torch.arange(16), [images, labels])
    assert old.complete
    changed = images.clone()
    changed[5, 0, 0, 0] ^= 1
    new = DiskCache.open(tmp_path, fingerprint_for((changed, labels)), columns, 16, 1 << 20)
    assert new.root != old.root and not new.present(torch.arange(16)).any()
    other_columns = DiskCache.open(tmp_path, fingerprint_for((images, labels)), columns[:1], 16, 1 << 20)
    assert other_columns.root != old.root and not other_columns.present(torch.arange(16)).any()
    other_blocks = DiskCache.open(tmp_path, fingerprint_for((images, labels)), columns, 16, 1 << 20, block_bytes=4096)
    assert other_blocks.root != old.root and not other_blocks.present(torch.arange(16)).any()
    for cache in (old, new, other_columns, other_blocks):
        cache.close()


def test_array_fingerprints_follow_contents_dtypes_and_settings() -> None:
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    base = fingerprint_for(a)
    assert base.kind == "arrays" and fingerprint_for(a.copy()) == base
    assert fingerprint_for(a.astype(np.float64)).digest != base.digest
    b = a.copy()
    b[3, 2] += 1
    assert fingerprint_for(b).digest != base.digest
    assert fingerprint_for(a, {"normalize": False}).digest != base.digest
    assert fingerprint_for({"x": a, "y": a[:, 0]}).digest != fingerprint_for({"x": a, "z": a[:, 0]}).digest
    with pytest.raises(ValueError, match="repr changes from run to run"):
        fingerprint_for(a, {"transform": object()})


def _photos(folder: Path, count: int = 4) -> None:
    from PIL import Image

    for i in range(count):
        (folder / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((8, 8, 3), i * 40, np.uint8)).save(folder / f"c{i % 2}" / f"{i}.jpg")


def test_image_folder_fingerprints_follow_files_sizes_mtimes_and_decode_settings(tmp_path: Path) -> None:
    from gpuload.datasets import ImageFolder

    _photos(tmp_path / "data")
    folder = ImageFolder(tmp_path / "data")
    base = fingerprint_for(folder, {"size": [224, 224]})
    assert base.kind == "images" and base == fingerprint_for(ImageFolder(tmp_path / "data"), {"size": [224, 224]})
    assert fingerprint_for(folder, {"size": [256, 256]}).digest != base.digest
    path = Path(folder.path(0))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    touched = fingerprint_for(ImageFolder(tmp_path / "data"), {"size": [224, 224]})
    assert touched.digest != base.digest
    path.write_bytes(path.read_bytes() + b"\0")
    resized = fingerprint_for(ImageFolder(tmp_path / "data"), {"size": [224, 224]})
    assert resized.digest not in (base.digest, touched.digest)
    listed = gpuload.datasets.ImageList([(folder.path(i), folder.label(i)) for i in range(len(folder))])
    assert fingerprint_for(listed).kind == "images" and fingerprint_for(listed).digest != fingerprint_for(folder).digest
    torchvision = pytest.importorskip("torchvision")
    tv = torchvision.datasets.ImageFolder(str(tmp_path / "data"))
    before = fingerprint_for(tv)
    assert before.kind == "images" and "ImageFolder(4 images)" == before.description
    _photos(tmp_path / "data", count=5)  # one more file
    assert fingerprint_for(torchvision.datasets.ImageFolder(str(tmp_path / "data"))).digest != before.digest


class _Samples(torch.utils.data.Dataset):
    def __init__(self, path: str, scale: float) -> None:
        self.path, self.scale = path, scale

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((2,), index * self.scale)


def test_generic_dataset_fingerprints_follow_attributes_and_the_files_they_name(tmp_path: Path) -> None:
    data = tmp_path / "table.csv"
    data.write_text("1,2\n")
    base = fingerprint_for(_Samples(str(data), 1.0))
    assert base.kind == "dataset" and base == fingerprint_for(_Samples(str(data), 1.0))
    assert fingerprint_for(_Samples(str(data), 2.0)).digest != base.digest
    with_array = _Samples(str(data), 1.0)
    with_array.table = np.zeros(5)
    changed = _Samples(str(data), 1.0)
    changed.table = np.ones(5)
    assert fingerprint_for(with_array).digest != fingerprint_for(changed).digest != base.digest
    data.write_text("1,2,3\n")
    assert fingerprint_for(_Samples(str(data), 1.0)).digest != base.digest
    unpicklable = _Samples(str(data), 1.0)
    unpicklable.handle = threading.Lock()
    with pytest.raises(IdentityError, match=r"cannot identify _Samples: its state does not pickle \(TypeError: "
                                            r".*lock.*\); pass cache_key="):
        fingerprint_for(unpicklable)
    assert fingerprint_for(unpicklable, key="v1").digest != fingerprint_for(unpicklable, key="v2").digest
    with pytest.raises(ValueError, match="cache_key='' must be a non-empty string"):
        fingerprint_for(unpicklable, key="")


# ---------------------------------------------------------------- identity: what a dataset names or holds


def _rewritten_in_place(path: Path, data: bytes) -> None:
    """``cp -p`` / ``rsync -t`` onto ``path``: other bytes of the same size, the old mtime put back."""
    status = path.stat()
    assert len(data) == status.st_size and data != path.read_bytes()
    path.write_bytes(data)
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))


class _Listed(torch.utils.data.Dataset):
    """Reads the files of a list attribute (top-level strings are not the only paths)."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.frombuffer(bytearray(Path(self.paths[index]).read_bytes()), dtype=torch.uint8)


class _InFolder(torch.utils.data.Dataset):
    """Names only its folder; reads the files in it."""

    def __init__(self, root: str) -> None:
        self.root = root

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.frombuffer(bytearray((Path(self.root) / "part" / f"{index}.bin").read_bytes()), dtype=torch.uint8)


class _Slotted(torch.utils.data.Dataset):
    __slots__ = ("scale",)

    def __init__(self, scale: int) -> None:
        self.scale = scale

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((2,), index * self.scale)


def _closed_over(scale: int) -> torch.utils.data.Dataset:
    class Scaled(torch.utils.data.Dataset):  # its samples depend on ``scale``, held by a closure only
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.full((2,), index * scale)

    return Scaled()


class _NpyRows(torch.utils.data.Dataset):
    def __init__(self, path: str) -> None:
        self.path = path

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> np.ndarray:
        return np.load(self.path)[index]


def test_a_file_in_a_list_attribute_rewritten_changes_the_fingerprint(tmp_path: Path) -> None:
    files = [tmp_path / f"{k}.bin" for k in range(3)]
    for k, file in enumerate(files):
        file.write_bytes(bytes([k]) * 4)
    before = fingerprint_for(_Listed([str(f) for f in files]))
    assert fingerprint_for(_Listed([str(f) for f in files])) == before
    files[1].write_bytes(b"\7" * 5)
    assert fingerprint_for(_Listed([str(f) for f in files])).digest != before.digest


def test_a_subset_of_a_dataset_whose_file_changed_changes_the_fingerprint(tmp_path: Path) -> None:
    files = [tmp_path / f"{k}.bin" for k in range(4)]
    for k, file in enumerate(files):
        file.write_bytes(bytes([k]) * 4)
    generator = torch.Generator().manual_seed(0)
    train, _ = torch.utils.data.random_split(_Listed([str(f) for f in files]), [2, 2], generator=generator)
    before = fingerprint_for(train)
    files[int(train.indices[0])].write_bytes(b"\7" * 6)
    assert fingerprint_for(train).digest != before.digest
    other = torch.utils.data.Subset(train.dataset, [i for i in range(4) if i not in train.indices])
    assert fingerprint_for(other).digest != fingerprint_for(train).digest  # another split, another entry


def test_a_file_under_a_folder_the_dataset_names_changes_the_fingerprint(tmp_path: Path) -> None:
    root = tmp_path / "data"
    (root / "part").mkdir(parents=True)
    for index in range(2):
        (root / "part" / f"{index}.bin").write_bytes(bytes([index]) * 4)
    before = fingerprint_for(_InFolder(str(root)))
    assert fingerprint_for(_InFolder(str(root))) == before
    (root / "part" / "1.bin").write_bytes(b"\7" * 5)  # the folders' own mtimes stay
    changed = fingerprint_for(_InFolder(str(root)))
    assert changed.digest != before.digest
    (root / "part" / "new.bin").write_bytes(b"")
    assert fingerprint_for(_InFolder(str(root))).digest not in (before.digest, changed.digest)
    cache = root / "cache"  # a cache_dir inside the folder: its files are not the dataset's
    cache.mkdir()
    keyed = fingerprint_for(_InFolder(str(root)), skip=[cache])
    (cache / "entry").write_bytes(b"filling")
    assert fingerprint_for(_InFolder(str(root)), skip=[cache]) == keyed


class _FolderAndFiles(torch.utils.data.Dataset):
    """Names its folder and, in a list, each file under it (as torchvision's ImageFolder does):
    ``files_first`` puts the list before the folder in its state."""

    def __init__(self, root: Path, files_first: bool) -> None:
        paths = [str(path) for path in sorted(root.rglob("*.bin"))]
        if files_first:
            self.paths = paths
        self.root = str(root)
        self.samples = [(path, 0) for path in paths]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.frombuffer(bytearray(Path(self.samples[index][0]).read_bytes()), dtype=torch.uint8)


@pytest.mark.parametrize("files_first", [False, True])
def test_a_file_both_listed_and_named_is_stated_once_per_fingerprint_and_keys_as_before(
        tmp_path: Path, monkeypatch, files_first: bool) -> None:
    """Issue #40: a dataset naming its folder and each file in it had every file stat'ed twice
    by each fingerprint (a second job's start). Once now, in the same pass, so the identity is
    as fresh as it was: the files named keep their own entries (the digest an entry was keyed
    by is unchanged) and a file rewritten between two fingerprints changes the second."""
    from gpuload.cache import identity

    root = tmp_path / "data"
    for index in range(4):
        (root / f"class_{index % 2}").mkdir(parents=True, exist_ok=True)
        (root / f"class_{index % 2}" / f"{index}.bin").write_bytes(bytes([index]) * 4)
    dataset = _FolderAndFiles(root, files_first)
    files = sorted(root.rglob("*.bin"))
    expected = {str(root): ["folder", *[[str(f.relative_to(root)), *identity.file_identity(str(f))] for f in files]],
                **{str(f): identity.file_identity(str(f)) for f in files}}
    stats: collections.Counter[str] = collections.Counter()
    stat = os.stat
    monkeypatch.setattr(identity.os, "stat", lambda path, *a, **k: stats.update([os.fspath(path)]) or stat(
        path, *a, **k))
    assert identity.hash_state(dataset, hashlib.blake2b()) == dict(sorted(expected.items()))
    assert {str(f): stats[str(f)] for f in files} == {str(f): 1 for f in files}
    monkeypatch.undo()
    before = fingerprint_for(dataset)
    _rewritten_in_place(files[2], b"\7" * 4)
    assert fingerprint_for(dataset).digest != before.digest


def test_a_folder_too_large_to_list_is_refused_naming_it(tmp_path: Path, monkeypatch) -> None:
    from gpuload.cache import identity

    monkeypatch.setattr(identity, "FOLDER_FILES", 2)
    (tmp_path / "data").mkdir()
    for index in range(3):
        (tmp_path / "data" / f"{index}.bin").write_bytes(b"x")
    with pytest.raises(IdentityError, match=f"it names the folder {tmp_path / 'data'}, which holds more than 2 files"):
        fingerprint_for(_InFolder(str(tmp_path / "data")))


def test_slot_state_changes_the_fingerprint() -> None:
    assert fingerprint_for(_Slotted(1)) == fingerprint_for(_Slotted(1))
    assert fingerprint_for(_Slotted(1)).digest != fingerprint_for(_Slotted(2)).digest


def test_closure_state_changes_the_fingerprint() -> None:
    assert fingerprint_for(_closed_over(1)) == fingerprint_for(_closed_over(1))
    assert fingerprint_for(_closed_over(1)).digest != fingerprint_for(_closed_over(2)).digest
    with_transform = _Samples("x", 1.0)
    with_transform.transform = functools.partial(lambda x, k: x * k, k=2)
    other = _Samples("x", 1.0)
    other.transform = functools.partial(lambda x, k: x * k, k=3)
    assert fingerprint_for(with_transform).digest != fingerprint_for(other).digest


def test_a_named_file_rewritten_with_its_size_and_mtime_kept_changes_the_fingerprint(tmp_path: Path) -> None:
    data = tmp_path / "table.csv"
    data.write_text("1,2\n")
    before = fingerprint_for(_Samples(str(data), 1.0))
    _rewritten_in_place(data, b"3,4\n")
    assert fingerprint_for(_Samples(str(data), 1.0)).digest != before.digest


def test_an_npy_file_rewritten_with_its_size_and_mtime_kept_changes_the_fingerprint(tmp_path: Path) -> None:
    path = tmp_path / "rows.npy"
    np.save(path, np.arange(8).reshape(4, 2))
    before = fingerprint_for(_NpyRows(str(path)))
    replacement = tmp_path / "new.npy"
    np.save(replacement, np.arange(8).reshape(4, 2) * 10)
    _rewritten_in_place(path, replacement.read_bytes())
    assert fingerprint_for(_NpyRows(str(path))).digest != before.digest


def test_an_image_rewritten_with_its_size_and_mtime_kept_changes_the_image_fingerprint(tmp_path: Path) -> None:
    from gpuload.datasets import ImageFolder

    _photos(tmp_path / "data")
    before = fingerprint_for(ImageFolder(tmp_path / "data"), {"size": [8, 8]})
    path = Path(ImageFolder(tmp_path / "data").path(0))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # same size: a changed byte of its pixel data
    _rewritten_in_place(path, bytes(data))
    assert fingerprint_for(ImageFolder(tmp_path / "data"), {"size": [8, 8]}).digest != before.digest


# ---------------------------------------------------------------- faults, each in a new process


def test_killed_mid_fill_leaves_nothing_read_as_valid(tmp_path: Path) -> None:
    n = 200
    child = _start(
        """
        cache = open_cache()
        for start in range(0, N, 5):  # 5 rows a batch, 8 a block: a block is always half written
            rows = torch.arange(start, min(N, start + 5))
            cache.write(rows, [images[rows], labels[rows]])
            time.sleep(0.03)
        print("finished")
        """,
        tmp_path, n,
    )
    deadline = time.monotonic() + 60
    published = 0
    try:
        while time.monotonic() < deadline and child.process.exitcode is None:
            entries = [p for p in tmp_path.iterdir() if p.is_dir()]
            if entries and (entries[0] / "manifest.json").exists():
                try:
                    published = len(json.loads((entries[0] / "manifest.json").read_bytes())["blocks"])
                except ValueError:
                    published = 0
                if published >= 3 and any(p.suffix == ".part" for p in entries[0].iterdir()):
                    break
            time.sleep(0.005)
    finally:
        child.kill()
    assert child.process.exitcode == -signal.SIGKILL and published >= 3, child.err.read_text()
    entry = _entry(tmp_path)
    assert any(p.suffix == ".part" for p in entry.iterdir())  # killed halfway through a block
    result = _child(
        """
        cache = open_cache()
        present = cache.present(torch.arange(N)).numpy()
        parts = sorted(p for p in os.listdir(cache.root) if p.endswith(".part"))
        same = epoch(cache, list(range(N)))
        print(json.dumps({"present": present.tolist(), "parts": parts, "same": same, "complete": cache.complete,
                          "again": epoch(cache, np.random.default_rng(0).permutation(N).tolist())}))
        """,
        tmp_path, n,
    )
    present = np.array(result["present"])
    manifest_blocks = [b for b, _, _ in json.loads((entry / "manifest.json").read_bytes())["blocks"]]
    assert present.sum() > 0 and not present.all()
    assert present.sum() % BLOCK_ROWS == 0 and all(present[_block_rows(b)].all() for b in range(present.sum() // 8))
    assert result["parts"] == [] and result["same"] and result["again"] and result["complete"]
    assert sorted(manifest_blocks) == list(range(n // BLOCK_ROWS))


def test_killed_between_rename_and_manifest_the_block_is_not_read(tmp_path: Path) -> None:
    n = 64
    crashed = _start(
        """
        import signal
        from gpuload.cache import disk
        calls = []
        real = disk.DiskCache._write_manifest
        def crash_on_third(self):
            calls.append(1)
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGKILL)  # block 2 is renamed to .bin, not listed yet
            real(self)
        disk.DiskCache._write_manifest = crash_on_third
        cache = open_cache()
        cache.write(torch.arange(N), [images, labels])
        """,
        tmp_path, n,
    )
    assert crashed.wait(HANG_S) == -signal.SIGKILL, crashed.err.read_text()
    entry = _entry(tmp_path)
    assert (entry / "block-000002.bin").exists()
    result = _child(
        """
        cache = open_cache()
        present = cache.present(torch.arange(N)).numpy()
        left = os.path.exists(os.path.join(cache.root, "block-000002.bin"))
        print(json.dumps({"present": int(present.sum()), "first": bool(present[:16].all()), "left": left,
                          "same": epoch(cache, list(range(N))), "complete": cache.complete}))
        """,
        tmp_path, n,
    )
    assert result == {"present": 16, "first": True, "left": False, "same": True, "complete": True}


def test_truncated_or_garbage_blocks_are_detected_refilled_and_named(tmp_path: Path) -> None:
    n = 64
    assert _child("cache = open_cache(); cache.write(torch.arange(N), [images, labels]); "
                  "print(json.dumps(cache.complete))", tmp_path, n) is True
    entry = _entry(tmp_path)
    with open(entry / "block-000003.bin", "r+b") as file:
        file.truncate(100)
    data = bytearray((entry / "block-000005.bin").read_bytes())
    data[10:20] = b"garbage!!!"
    (entry / "block-000005.bin").write_bytes(bytes(data))
    check = """
        with warnings.catch_warnings(record=True) as caught:
            cache = open_cache()
            present = cache.present(torch.arange(N)).numpy()
            same = epoch(cache, list(range(N)))
        print(json.dumps({"warnings": [str(w.message) for w in caught if w.category is DiskCacheWarning],
                          "missing": np.flatnonzero(~present).tolist(), "same": same, "complete": cache.complete,
                          "dropped": cache.stats().blocks_dropped}))
        """
    first = _child(check, tmp_path, n)
    assert first["missing"] == _block_rows(3) + _block_rows(5) and first["same"] and first["complete"]
    assert first["dropped"] == 2 and len(first["warnings"]) == 2
    assert "block-000003.bin is 100 bytes" in first["warnings"][0]
    assert "block-000005.bin fails its checksum" in first["warnings"][1]
    second = _child(check, tmp_path, n)  # refilled: a clean read, no warning
    assert second == {"warnings": [], "missing": [], "same": True, "complete": True, "dropped": 0}


def test_a_damaged_manifest_is_named_and_its_rows_filled_again(tmp_path: Path) -> None:
    n = 32
    _child("cache = open_cache(); cache.write(torch.arange(N), [images, labels]); print(1)", tmp_path, n)
    (_entry(tmp_path) / "manifest.json").write_bytes(b'{"format": 1, "blocks": [[0, 1')
    result = _child(
        """
        with warnings.catch_warnings(record=True) as caught:
            cache = open_cache()
            present = int(cache.present(torch.arange(N)).sum())
            same = epoch(cache, list(range(N)))
        print(json.dumps({"warnings": [str(w.message) for w in caught], "present": present, "same": same,
                          "complete": cache.complete}))
        """,
        tmp_path, n,
    )
    assert result["present"] == 0 and result["same"] and result["complete"]
    assert len(result["warnings"]) == 1 and "manifest.json is damaged" in result["warnings"][0]


def test_nothing_is_written_outside_the_folder_and_the_umask_is_kept(tmp_path: Path) -> None:
    cache_dir, elsewhere = tmp_path / "deep" / "cache", tmp_path / "cwd"
    elsewhere.mkdir()
    result = _child(
        """
        os.umask(0o077)
        cache = open_cache()
        epoch(cache, np.random.default_rng(0).permutation(N).tolist())
        modes = {name: os.stat(os.path.join(cache.root, name)).st_mode & 0o777 for name in os.listdir(cache.root)}
        modes["<entry>"] = os.stat(cache.root).st_mode & 0o777
        modes["<folder>"] = os.stat(FOLDER).st_mode & 0o777
        print(json.dumps(modes))
        """,
        cache_dir, 40, cwd=elsewhere, env={"TMPDIR": str(elsewhere), "HOME": str(elsewhere)},
    )
    assert list(elsewhere.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "deep"]
    assert all(mode & 0o077 == 0 for mode in result.values()), result  # the umask, not 0o777/0o666
    assert result["<entry>"] == 0o700 and result["block-000000.bin"] == 0o600


def test_two_processes_starting_at_once_make_one_copy_and_both_read_correct_rows(tmp_path: Path) -> None:
    n = 240
    start = time.time() + 2.0
    script = f"""
        seed = int(os.environ["SEED"])
        while time.time() < {start}:
            time.sleep(0.001)
        cache = open_cache()
        order = np.random.default_rng(seed).permutation(N).tolist()
        same = epoch(cache, order)
        deadline = time.time() + 60
        while not cache.complete and time.time() < deadline:
            time.sleep(0.01)
        read = cache.read(torch.as_tensor(order))
        same &= torch.equal(read[0], images[order]) and torch.equal(read[1], labels[order])
        print(json.dumps({{"same": same, "written": cache.stats().rows_written, "complete": cache.complete}}))
    """
    results = results_of([_start(script, tmp_path, n, env={"SEED": str(seed)}) for seed in (1, 2)], HANG_S)
    assert all(r["same"] and r["complete"] for r in results)
    assert sum(r["written"] for r in results) == n  # each row written once, by one of them
    entry = _entry(tmp_path)
    blocks = sorted(p.name for p in entry.iterdir() if p.name.startswith("block-"))
    assert blocks == [f"block-{b:06d}.bin" for b in range(n // BLOCK_ROWS)]  # no second copy, no .part left
    assert sum((entry / b).stat().st_size - trailer_bytes(BLOCK_ROWS * RECORD) for b in blocks) == n * RECORD


def test_full_disk_injected_the_tier_stops_growing_with_one_warning(tmp_path: Path) -> None:
    result = _child(
        """
        import errno
        real, calls = os.posix_fallocate, []
        def fill_up(fd, offset, length):
            calls.append(1)
            if len(calls) > 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            real(fd, offset, length)
        os.posix_fallocate = fill_up
        with warnings.catch_warnings(record=True) as caught:
            cache = open_cache()
            first = epoch(cache, list(range(N)))
            second = epoch(cache, np.random.default_rng(0).permutation(N).tolist())
        stats = cache.stats()
        print(json.dumps({"warnings": [str(w.message) for w in caught], "first": first, "second": second,
                          "published": stats.published_rows, "stopped": stats.stopped, "full": stats.full,
                          "hits": stats.hits, "parts": [p for p in os.listdir(cache.root) if p.endswith(".part")]}))
        """,
        tmp_path, 64,
    )
    assert result["first"] and result["second"] and result["published"] == 3 * BLOCK_ROWS
    assert len(result["warnings"]) == 1 and "the disk is full" in result["warnings"][0]
    assert "block-000003.part" in result["warnings"][0] and "stops growing" in result["warnings"][0]
    assert result["full"] and result["hits"] == 3 * BLOCK_ROWS and result["parts"] == []


def _namespace() -> list[str]:
    """A private mount namespace (``unshare -rm``) where this user may mount a tmpfs."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs `unshare -rm` (a user and mount namespace) to mount a small tmpfs")
    return [unshare, "-rm", "sh", "-c"]


def test_full_tmpfs_the_tier_stops_growing_and_the_epoch_completes(tmp_path: Path) -> None:
    prefix = _namespace()
    script = """
        with warnings.catch_warnings(record=True) as caught:
            cache = open_cache()
            first = epoch(cache, list(range(N)))
            second = epoch(cache, list(range(N)))
        stats = cache.stats()
        print(json.dumps({"warnings": [str(w.message) for w in caught], "first": first, "second": second,
                          "published": stats.published_rows, "hits": stats.hits, "full": stats.full}))
    """
    environment = _environment()
    command = (f'mount -t tmpfs -o size=64k tmpfs "$0" && exec {sys.executable} -c "$1" "$0" 200')
    done = subprocess.run([*prefix, command, str(tmp_path), CHILD + textwrap.dedent(script)],
                          capture_output=True, text=True, env=environment, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["first"] and result["second"] and result["full"]
    assert 0 < result["published"] < 200 and result["hits"] == result["published"]
    assert len(result["warnings"]) == 1 and "the disk is full" in result["warnings"][0]


def test_read_only_folder_one_warning_and_no_disk_tier(tmp_path: Path) -> None:
    prefix = _namespace()
    script = """
        with warnings.catch_warnings(record=True) as caught:
            cache = open_cache()
        print(json.dumps({"none": cache is None, "warnings": [str(w.message) for w in caught]}))
    """
    fill = "cache = open_cache(); epoch(cache, list(range(N))); print(json.dumps(cache.complete))"
    environment = _environment()
    command = (f'mount -t tmpfs tmpfs "$0" && {sys.executable} -c "$2" "$0" 16 && mount -o remount,ro "$0" && '
               f'exec {sys.executable} -c "$1" "$0" 16')
    done = subprocess.run([*prefix, command, str(tmp_path), CHILD + textwrap.dedent(script), CHILD + fill],
                          capture_output=True, text=True, env=environment, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "true"
    result = json.loads(lines[-1])
    assert result["none"] and len(result["warnings"]) == 1
    assert "cannot use" in result["warnings"][0] and "Read-only file system" in result["warnings"][0]
    assert "without a disk tier" in result["warnings"][0]


def test_unwritable_folder_one_warning_and_no_disk_tier(tmp_path: Path) -> None:
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        result = _child(
            """
            if os.geteuid() == 0:  # root writes anywhere: be nobody here
                os.setgid(65534); os.setuid(65534)
            with warnings.catch_warnings(record=True) as caught:
                cache = open_cache()
            print(json.dumps({"none": cache is None, "warnings": [str(w.message) for w in caught]}))
            """,
            folder, 8,
        )
    finally:
        folder.chmod(0o755)
    assert result["none"] and len(result["warnings"]) == 1 and "Permission denied" in result["warnings"][0]
    assert list(folder.iterdir()) == []


# ---------------------------------------------------------------- ragged rows (images of their own sizes)

RAGGED_ROW = 3 * 20 * 20  # the typical row the blocks are sized for: 4 rows a block


def _images(n: int) -> list[torch.Tensor]:
    """uint8 images of their own sizes, every third one laid out channels-last (an HWC view)."""
    generator = torch.Generator().manual_seed(1)
    images = []
    for k in range(n):
        image = torch.randint(0, 256, (3, 12 + k % 7, 15 + k % 5), dtype=torch.uint8, generator=generator)
        images.append(image.permute(1, 2, 0).contiguous().permute(2, 0, 1) if k % 3 == 0 else image)
    return images


def _open_ragged(folder: Path, n: int, budget: int = 1 << 30) -> DiskCache:
    cache = DiskCache.open(folder, Fingerprint.of("images", "ragged", {"rows": n}),
                           [ColumnSpec("image", torch.uint8, (RAGGED, RAGGED, RAGGED))], n, budget,
                           block_bytes=4 * RAGGED_ROW, row_bytes=RAGGED_ROW)
    assert cache is not None
    return cache


def test_ragged_rows_written_shuffled_read_back_exactly_with_their_layout(tmp_path: Path) -> None:
    n, images = 22, _images(22)
    cache = _open_ragged(tmp_path, n)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    for start in range(0, n, 5):
        rows = order[start:start + 5]
        assert cache.write_items(rows, [images[r] for r in rows]) == len(rows)
    assert cache.complete and cache.block_rows == 4 and cache.stats().blocks_published == 6
    cache.close()
    again = _open_ragged(tmp_path, n)  # read by a later open, from the published blocks
    back = again.read_items(torch.arange(n).flip(0))
    for image, original in zip(back, reversed(images)):
        assert torch.equal(image, original) and image.stride() == original.stride()
    assert again.write_items(torch.arange(n), images) == 0  # stored once


def test_ragged_entries_check_their_calls(tmp_path: Path) -> None:
    spec = [ColumnSpec("image", torch.uint8, (RAGGED, RAGGED, RAGGED))]
    fingerprint = Fingerprint.of("images", "ragged", {})
    with pytest.raises(ValueError, match="row_bytes"):
        DiskCache.open(tmp_path, fingerprint, spec, 4)
    with pytest.raises(ValueError, match="only column"):
        DiskCache.open(tmp_path, fingerprint, [*spec, ColumnSpec("label", torch.int64, ())], 4, row_bytes=10)
    cache = _open_ragged(tmp_path, 4)
    with pytest.raises(TypeError, match="read_items"):
        cache.read(torch.arange(1))
    with pytest.raises(TypeError, match="write_items"):
        cache.write(torch.arange(1), [torch.zeros(1, 3, 2, 2, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="shape"):
        cache.write_items(torch.arange(1), [torch.zeros(3, 2, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="items for"):
        cache.write_items(torch.arange(2), [torch.zeros(3, 2, 2, dtype=torch.uint8)])
    with pytest.raises(LookupError, match="row 0"):
        cache.read_items(torch.arange(1))
    with pytest.raises(TypeError, match="fixed-size rows"):
        _open(tmp_path / "fixed", 8).write_items(torch.arange(1), [])


def test_a_ragged_fill_left_unfinished_is_discarded_by_the_next_open(tmp_path: Path) -> None:
    n, images = 8, _images(8)
    cache = _open_ragged(tmp_path, n)
    cache.write_items(torch.tensor([1, 2, 5]), [images[1], images[2], images[5]])  # no block complete
    cache.close()
    assert {p.name for p in _entry(tmp_path).glob("block-*")} == {"block-000000.part", "block-000001.part"}
    again = _open_ragged(tmp_path, n)
    names = {p.name for p in _entry(tmp_path).iterdir()}
    assert not any(name.startswith("block-") for name in names) and not again.present(torch.arange(n)).any()
    again.write_items(torch.arange(n).flip(0), list(reversed(images)))  # offsets differ from the first fill
    assert all(torch.equal(a, b) for a, b in zip(again.read_items(torch.arange(n)), images))


def test_a_damaged_ragged_block_or_row_table_is_named_and_refilled(tmp_path: Path) -> None:
    n, images = 12, _images(12)
    cache = _open_ragged(tmp_path, n)
    cache.write_items(torch.arange(n), images)
    cache.close()
    entry = _entry(tmp_path)
    with open(entry / "block-000000.bin", "r+b") as file:
        file.truncate(50)
    manifest = json.loads((entry / "manifest.json").read_bytes())
    size = {b: size for b, size, _ in manifest["blocks"]}[2]
    table = bytearray((entry / "block-000002.bin").read_bytes()[:size])
    table[-8 * 7 * 2:-8 * 7 * 2 + 8] = (10 ** 9).to_bytes(8, "little")  # a row's offset, past the data
    forged = forge_block(entry / "block-000002.bin", bytes(table))
    manifest["blocks"] = [forged if b == 2 else [b, size, crc]
                          for b, size, crc in manifest["blocks"]]  # its checksums pass: the table is checked
    (entry / "manifest.json").write_text(json.dumps(manifest))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = _open_ragged(tmp_path, n)
        present = again.present(torch.arange(n))
    named = [str(w.message) for w in caught if issubclass(w.category, DiskCacheWarning)]
    assert present.tolist() == [False] * 4 + [True] * 4 + [False] * 4
    assert len(named) == 2 and "block-000000.bin is 50 bytes" in named[0]
    assert "block-000002.bin has a damaged row table" in named[1]
    again.write_items(torch.arange(n), images)
    assert again.complete and all(torch.equal(a, b) for a, b in zip(again.read_items(torch.arange(n)), images))


def test_two_users_of_one_ragged_entry_share_its_blocks(tmp_path: Path) -> None:
    # Two opens hold two open file descriptions: their flocks exclude each other as two processes' do.
    n, images = 16, _images(16)
    one, two = _open_ragged(tmp_path, n), _open_ragged(tmp_path, n)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(3))
    for start in range(0, n, 3):
        rows = order[start:start + 3]
        writer = one if start % 2 else two
        writer.write_items(rows, [images[r] for r in rows])
        (two if writer is one else one).write_items(rows[:1], [images[rows[0]]])  # already written: skipped
    assert one.complete and two.complete
    assert one.stats().rows_written + two.stats().rows_written == n
    third = _open_ragged(tmp_path, n)
    assert all(torch.equal(a, b) for a, b in zip(third.read_items(torch.arange(n)), images))
    assert len(list(_entry(tmp_path).glob("block-*.bin"))) == 4 and not list(_entry(tmp_path).glob("*.part"))


# ---------------------------------------------------------------- argument and entry errors


def test_fingerprint_settings_take_sets_paths_and_dtypes_and_name_what_they_refuse(tmp_path: Path) -> None:
    from gpuload.cache.disk import fingerprint_arrays, fingerprint_dataset, fingerprint_images

    a = np.arange(6, dtype=np.int32)
    settings = {"s": {3, 1}, "p": tmp_path, "d": torch.float16, "n": np.dtype("int8"), "c": torch.device("cpu"),
                "slice": slice(0, 2)}
    assert fingerprint_for(a, settings) == fingerprint_for(a, dict(settings))
    assert fingerprint_for(a, {**settings, "s": {1, 2}}).digest != fingerprint_for(a, settings).digest
    assert fingerprint_for(a, {**settings, "slice": slice(0, 3)}).digest != fingerprint_for(a, settings).digest
    with pytest.raises(TypeError, match="fingerprint_arrays takes tensors or numpy arrays .*not list"):
        fingerprint_arrays([a, "not an array"])
    with pytest.raises(TypeError, match="fingerprint_images needs a dataset with a samples list"):
        fingerprint_images(object())
    with pytest.raises(TypeError, match="stores map-style datasets with a length; object has none"):
        fingerprint_dataset(object())


def test_an_unreadable_image_file_changes_the_fingerprint_when_it_appears(tmp_path: Path) -> None:
    from gpuload.cache.disk import fingerprint_images

    class Listed:
        samples = [(str(tmp_path / "missing.jpg"), 0)]

    missing = fingerprint_images(Listed())
    (tmp_path / "missing.jpg").write_bytes(b"x")
    assert fingerprint_images(Listed()).digest != missing.digest


def test_column_specs_are_checked_and_a_dict_is_accepted(tmp_path: Path) -> None:
    fingerprint = Fingerprint.of("arrays", "x", {})
    cache = DiskCache.open(tmp_path, fingerprint, {"x": ((2,), torch.int32)}, 4, 1 << 20)
    assert cache.columns == (ColumnSpec("x", torch.int32, (2,)),)
    cache.close()
    with pytest.raises(TypeError, match=r"columns must be ColumnSpec\(name, dtype, shape\)s"):
        DiskCache.open(tmp_path, fingerprint, [], 4)
    with pytest.raises(TypeError, match="column 'x': dtype 'int32' is not a torch.dtype"):
        DiskCache.open(tmp_path, fingerprint, [ColumnSpec("x", "int32", (2,))], 4)
    with pytest.raises(ValueError, match=r"column 'x': shape \(-2,\) must be non-negative ints"):
        DiskCache.open(tmp_path, fingerprint, [ColumnSpec("x", torch.int32, (-2,))], 4)
    with pytest.raises(ValueError, match="num_rows=True must be a non-negative int"):
        DiskCache.open(tmp_path, fingerprint, [ColumnSpec("x", torch.int32, (2,))], True)
    with pytest.raises(ValueError, match="block_bytes=0 must be a positive int"):
        DiskCache.open(tmp_path, fingerprint, [ColumnSpec("x", torch.int32, (2,))], 4, block_bytes=0)


def test_a_file_where_the_folder_should_be_one_warning_and_no_disk_tier(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.warns(DiskCacheWarning, match="not a folder"):
        cache = DiskCache.open(tmp_path / "file", Fingerprint.of("arrays", "x", {}), {"x": ((), torch.int32)}, 4)
    assert cache is None


@pytest.mark.parametrize("below", ["", "jobs/a"])
def test_a_symlink_to_a_missing_folder_is_named_as_such_in_the_one_warning(tmp_path: Path, below: str) -> None:
    (tmp_path / "link").symlink_to(tmp_path / "gone")  # e.g. a scratch disk not mounted yet
    folder = tmp_path / "link" / below if below else tmp_path / "link"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = DiskCache.open(folder, Fingerprint.of("arrays", "x", {}), {"x": ((), torch.int32)}, 4)
    assert cache is None
    (warning,) = [str(w.message) for w in caught if issubclass(w.category, DiskCacheWarning)]
    assert f"cannot use {folder}: {tmp_path / 'link'} is a symbolic link to {tmp_path / 'gone'}, which does " \
           "not exist" in warning and "File exists" not in warning and "without a disk tier" in warning
    assert not (tmp_path / "gone").exists()  # nothing is created through the link


def test_a_closed_cache_has_no_rows_and_its_repr_says_what_it_holds(tmp_path: Path) -> None:
    images, labels = _data(16)
    with _open(tmp_path, 16) as cache:
        cache.write(torch.arange(8), [images[:8], labels[:8]])
        assert f"DiskCache({cache.root}, 8/16 rows published" in repr(cache)
        with pytest.raises(TypeError, match="holds fixed-size rows: read them with read"):
            cache.read_items(torch.arange(2))
    assert not cache.present(torch.arange(8)).any()


def _filled(folder: Path, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write every row of an n-row entry under ``folder`` and close it; the rows written."""
    images, labels = _data(n)
    cache = _open(folder, n)
    cache.write(torch.arange(n), [images, labels])
    cache.close()
    return images, labels


def test_a_manifest_for_other_columns_or_with_a_block_out_of_range_is_named(tmp_path: Path) -> None:
    _filled(tmp_path, 16)
    manifest = _entry(tmp_path) / "manifest.json"
    good = json.loads(manifest.read_bytes())
    for change, message in [({"block_rows": 3}, "manifest.json is for another block_rows"),
                            ({"blocks": [[9, 1, 1]]}, "block number is out of range")]:
        manifest.write_text(json.dumps({**good, **change}))
        with pytest.warns(DiskCacheWarning, match=message):
            cache = _open(tmp_path, 16)
        assert not cache.present(torch.arange(16)).any()
        cache.close()


def test_cache_ls_names_damaged_entries_and_rm_refuses_other_folders(tmp_path: Path) -> None:
    from gpuload.cache.disk import list_entries, remove_entry

    _filled(tmp_path, 16)
    entry = _entry(tmp_path)
    (entry / "entry.json").write_bytes(b"{")
    (entry / "manifest.json").write_bytes(b"[")
    bare = tmp_path / ("0" * 32)
    bare.mkdir()
    found = {e.path: e for e in list_entries(tmp_path)}
    assert found[entry].problem == "no readable entry.json (JSONDecodeError)"
    assert found[bare].problem == "no readable entry.json (FileNotFoundError)" and not found[bare].in_use
    (bare / "entry.json").write_text(json.dumps(
        {"fingerprint": {"description": "d", "digest": "g", "kind": "k"}, "num_rows": 4, "block_rows": 2}))
    assert {e.path: e for e in list_entries(tmp_path)}[bare].problem == ""  # no manifest: nothing published yet
    (bare / "manifest.json").write_text(json.dumps({"blocks": "x"}))
    assert {e.path: e for e in list_entries(tmp_path)}[bare].problem == "damaged manifest (ValueError)"
    with pytest.raises(ValueError, match="is not a gpuload disk cache entry"):
        remove_entry(tmp_path)
    assert remove_entry(bare) and not bare.exists()  # no users file: nobody can have it open


def test_a_file_system_without_fallocate_still_gets_whole_blocks(tmp_path: Path, monkeypatch) -> None:
    import errno

    def unsupported(fd, offset, size):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    images, labels = _data(16)
    cache = _open(tmp_path, 16)
    cache.write(torch.arange(16), [images, labels])
    assert cache.complete and torch.equal(cache.read(torch.arange(16))[0], images)
    cache.close()


def no_room_for_the_manifest(monkeypatch) -> None:
    """Make every rename onto ``manifest.json`` fail as on a full disk (ENOSPC)."""
    import errno

    rename = os.rename

    def failing(source, target):
        if str(target).endswith("manifest.json"):
            raise OSError(errno.ENOSPC, "No space left on device", str(target))
        return rename(source, target)

    monkeypatch.setattr(os, "rename", failing)


def test_a_manifest_that_cannot_be_written_unpublishes_its_block_with_one_warning(tmp_path: Path, monkeypatch) -> None:
    images, labels = _data(16)
    cache = _open(tmp_path, 16)
    no_room_for_the_manifest(monkeypatch)
    with pytest.warns(DiskCacheWarning, match="the disk is full") as caught:
        cache.write(torch.arange(8), [images[:8], labels[:8]])
        cache.write(torch.arange(8, 16), [images[8:], labels[8:]])  # stopped: nothing more, no second warning
    assert len(caught) == 1
    assert not cache.present(torch.arange(16)).any() and cache.stats().stopped
    entry = cache.root
    assert not list(entry.glob("block-*.bin")) and not list(entry.glob("*.tmp-*"))  # nothing half-published
    cache.close()


def test_maps_and_open_parts_beyond_their_limits_are_closed_oldest_first(tmp_path: Path, monkeypatch) -> None:
    import gpuload.cache.disk.reading as reading
    import gpuload.cache.disk.writing as writing

    monkeypatch.setattr(reading, "_OPEN_MAPS", 2)
    monkeypatch.setattr(writing, "_OPEN_PARTS", 2)
    images, labels = _data(40)
    cache = _open(tmp_path, 40)
    firsts = torch.arange(0, 40, BLOCK_ROWS)  # the first row of each of the 5 blocks: 5 parts open at once
    cache.write(firsts, [images[firsts], labels[firsts]])
    cache.write(torch.arange(40), [images, labels])
    assert cache.complete
    for block in range(5):
        rows = torch.tensor(_block_rows(block))
        assert torch.equal(cache.read(rows)[0], images[rows])  # 5 blocks read through 2 maps
    assert len(cache._maps) == 2 and not cache._parts
    cache.close()


def test_a_deleted_block_is_named_and_its_rows_filled_again(tmp_path: Path) -> None:
    images, labels = _filled(tmp_path, 16)
    (_entry(tmp_path) / "block-000001.bin").unlink()
    cache = _open(tmp_path, 16)
    with pytest.warns(DiskCacheWarning, match=r"block-000001.bin cannot be read \(No such file or directory\)"):
        present = cache.present(torch.arange(16))
    assert present.tolist() == [True] * 8 + [False] * 8
    cache.write(torch.arange(8, 16), [images[8:], labels[8:]])
    assert torch.equal(cache.read(torch.arange(16))[0], images)
    cache.close()


def test_an_entry_whose_files_cannot_be_opened_closes_what_it_opened_and_warns(tmp_path: Path) -> None:
    cache = _open(tmp_path, 16)
    root = cache.root
    cache.close()
    (root / "rows.fill").unlink()
    (root / "rows.fill").mkdir()  # a folder where the row flags should be
    before = len(os.listdir("/proc/self/fd"))
    with pytest.warns(DiskCacheWarning,
                      match=r"cannot use .*rows.fill \(Is a directory\); running without a disk tier"):
        assert DiskCache.open(tmp_path, Fingerprint.of("arrays", "test rows", {"seed": 0, "rows": 16}),
                              [ColumnSpec("image", torch.uint8, SHAPE), ColumnSpec("label", torch.int64, ())], 16,
                              1 << 30, block_bytes=BLOCK_ROWS * RECORD) is None
    assert len(os.listdir("/proc/self/fd")) == before  # the lock and users files it opened are closed


def test_a_process_opening_the_entry_while_another_probes_the_folder_leaves_both_usable(tmp_path: Path,
                                                                                         monkeypatch) -> None:
    """The first user of an entry discards stale ``.probe-*`` files: another process's probe,
    deleted between its creation and its removal, must not make that process run without the
    disk tier (it did: the probe's unlink raised FileNotFoundError)."""
    import builtins
    import threading

    import gpuload.cache.disk.cache as opening

    _open(tmp_path, 16).close()  # the entry exists, nobody has it open
    others: list[DiskCache | None] = []

    def probe_then_another_opens(path, *args, **kwargs):
        handle = builtins.open(path, *args, **kwargs)
        if Path(path).name.startswith(".probe-") and not others:
            others.append(None)  # once: the other opening probes too
            # another thread (a probe of its own name), the only user: it recovers the entry
            opener = threading.Thread(target=lambda: others.__setitem__(0, _open(tmp_path, 16)))
            opener.start()
            opener.join()
        return handle

    monkeypatch.setattr(opening, "open", probe_then_another_opens, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache = _open(tmp_path, 16)
    assert others[0] is not None and cache.root == others[0].root
    cache.close()
    others[0].close()


def test_the_first_user_recovering_an_entry_tolerates_a_probe_its_process_removed_meanwhile(tmp_path: Path,
                                                                                           monkeypatch) -> None:
    root = _open(tmp_path, 16)
    entry = root.root
    root.close()
    probe = entry / ".probe-1-2"  # another process's probe, listed as stale, then removed by that process
    probe.write_bytes(b"")
    scandir = os.scandir

    def listed_then_removed(path):
        entries = list(scandir(path))
        if Path(path) == entry:
            probe.unlink(missing_ok=True)
        return iter(entries)

    monkeypatch.setattr(os, "scandir", listed_then_removed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache = _open(tmp_path, 16)
    monkeypatch.undo()
    assert cache.root == entry and not probe.exists()
    cache.close()


def _class_with(scale: int, lookup: object) -> torch.utils.data.Dataset:
    def later() -> int:
        return missing  # a cell not filled when the class is fingerprinted

    class Scaled(torch.utils.data.Dataset):
        table = lookup  # a class attribute neither plain data nor a function: by its type

        @classmethod
        def factor(cls) -> int:
            return scale

        @staticmethod
        def offset() -> int:
            return later()

        @property
        def size(self) -> int:
            return 4

        def __len__(self) -> int:
            return self.size

        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.full((2,), index * self.factor())

    missing = None  # noqa: F841 - read by later(), assigned after the class: an empty cell until here
    return Scaled()


def test_a_local_class_is_fingerprinted_by_its_methods_properties_and_their_closures() -> None:
    base = fingerprint_for(_class_with(1, threading.Lock()))
    assert fingerprint_for(_class_with(1, threading.Lock())) == base  # a lock in the class body: its type only
    assert fingerprint_for(_class_with(2, threading.Lock())).digest != base.digest  # a classmethod's closure


def test_a_dangling_link_in_a_named_folder_is_part_of_the_fingerprint_until_its_target_appears(tmp_path: Path) -> None:
    root = tmp_path / "data"
    (root / "part").mkdir(parents=True)
    (root / "part" / "0.bin").symlink_to(tmp_path / "elsewhere.bin")
    dangling = fingerprint_for(_InFolder(str(root)))
    (tmp_path / "elsewhere.bin").write_bytes(b"now")
    assert fingerprint_for(_InFolder(str(root))).digest != dangling.digest


def test_a_set_attribute_is_fingerprinted_in_one_order_and_its_paths_are_seen(tmp_path: Path) -> None:
    files = [tmp_path / f"{k}.bin" for k in range(3)]
    for file in files:
        file.write_bytes(b"abc")
    one, other = _Samples("x", 1.0), _Samples("x", 1.0)
    one.paths, other.paths = {str(f) for f in files}, {str(f) for f in reversed(files)}
    before = fingerprint_for(one)
    assert fingerprint_for(other) == before
    files[1].write_bytes(b"xyz!")
    assert fingerprint_for(one).digest != before.digest
