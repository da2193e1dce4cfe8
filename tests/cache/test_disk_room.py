"""A disk tier with no room: ``disk_cache_size="auto"`` on a file system with less free space than
the reserve gives 0 bytes. The loader says so once and creates nothing in ``cache_dir``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gpuload
from gpuload.cache.disk import DiskCacheWarning
from gpuload.sizes import SizeSpec


class _Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.full((3,), float(index)), index


ALMOST_FULL = {"free": 2**30, "total": 100 * 2**30}  # 1 GiB free of 100 GiB: under the 5 GiB reserve


def test_a_zero_byte_default_budget_is_said_and_creates_nothing(tmp_path: Path, pretend_disk_space) -> None:
    """Before: no word, and an entry folder (with its lock and users files) in cache_dir."""
    pretend_disk_space(**ALMOST_FULL)
    cache_dir = tmp_path / "spill"
    loader = gpuload.DataLoader(_Numbers(), batch_size=4, cache="host", cache_dir=cache_dir, device="cpu")
    with pytest.warns(DiskCacheWarning) as warned:
        batches = list(loader)
    said = [str(w.message) for w in warned if issubclass(w.category, DiskCacheWarning)]
    assert len(said) == 1, said
    assert said[0].startswith(f"gpuload disk cache: no room in {cache_dir}: disk_cache_size='auto' is its free "
                              "space (1.00 GiB) less the reserve (5.00 GiB): 0 B; running without a disk tier")
    assert not cache_dir.exists()  # nothing created, not even the folder
    expected = list(torch.utils.data.DataLoader(_Numbers(), batch_size=4))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, expected)) and len(batches) == 2
    loader.close()


def test_an_entry_that_exists_still_opens_when_the_disk_fills(tmp_path: Path, pretend_disk_space) -> None:
    """A full file system still serves what an entry published: only a new entry is refused."""
    from gpuload.cache.disk import ColumnSpec, DiskCache, Fingerprint

    def open_entry() -> DiskCache | None:
        return DiskCache.open(tmp_path, Fingerprint.of("arrays", "rows", {"n": 4}),
                              [ColumnSpec("x", torch.float32, (2,))], 4, SizeSpec("auto", text="auto"))

    cache = open_entry()
    assert cache is not None
    cache.write(torch.arange(4), [torch.ones(4, 2)])
    cache.close()
    pretend_disk_space(**ALMOST_FULL)
    again = open_entry()
    assert again is not None and torch.equal(again.read(torch.arange(4))[0], torch.ones(4, 2))
    again.close()
    with pytest.warns(DiskCacheWarning, match="no room in"):
        assert DiskCache.open(tmp_path / "other", Fingerprint.of("arrays", "rows", {"n": 4}),
                              [ColumnSpec("x", torch.float32, (2,))], 4, 0) is None
    assert not (tmp_path / "other").exists()
