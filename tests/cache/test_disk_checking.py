"""Published blocks checked a stripe at a time as reads touch them (gpuload/cache/disk/checking.py):
a job opening a filled entry checks only the stripes of the rows it looks at, each once; a damaged
stripe is named with its rows, its block dropped and its rows read from the source; an entry of
an older format is refused, named, and filled again."""

from __future__ import annotations

import json
import multiprocessing
import threading
import warnings
from pathlib import Path

import pytest
import torch

import gpuload
import gpuload.cache.disk.checking as checking
from gpuload.cache.disk import ColumnSpec, DiskCache, DiskCacheWarning, Fingerprint
from gpuload.cache.disk.files import STRIPE_BYTES
from tests.cache.test_disk import _data, _open
from tests.cache.test_disk_tier import Pictures, _same, _torch_epochs

ROW = 40 << 10  # a row spans one or two stripes
ROWS = 50  # two blocks of 25 rows: 1,000,000 bytes, 16 stripes each


def _rows(n: int = ROWS) -> torch.Tensor:
    return torch.randint(0, 256, (n, ROW), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))


def _open_wide(folder: Path) -> DiskCache:
    cache = DiskCache.open(folder, Fingerprint.of("arrays", "wide rows", {"rows": ROWS}),
                           [ColumnSpec("x", torch.uint8, (ROW,))], ROWS, 1 << 30, block_bytes=25 * ROW)
    assert cache is not None
    return cache


def _filled_wide(folder: Path) -> torch.Tensor:
    rows = _rows()
    with _open_wide(folder) as cache:
        cache.write(torch.arange(ROWS), [rows])
    return rows


def _counted(monkeypatch) -> list[int]:
    """Record the size of every stripe checked (the reader's checksums, not the writer's)."""
    sizes: list[int] = []
    real = checking.checksum

    def counted(data):
        sizes.append(len(data))
        return real(data)

    monkeypatch.setattr(checking, "checksum", counted)
    return sizes


def test_a_later_open_checks_only_the_stripes_its_reads_touch_each_once(tmp_path: Path, monkeypatch) -> None:
    rows = _filled_wide(tmp_path)
    checked = _counted(monkeypatch)
    with _open_wide(tmp_path) as cache:
        assert checked == []  # the open checks nothing
        assert torch.equal(cache.read(torch.tensor([3]))[0], rows[3:4])
        assert checked == [STRIPE_BYTES] * 2  # row 3 is bytes 122880-163839: stripes 1 and 2 of block 0
        assert torch.equal(cache.read(torch.tensor([2, 3]))[0], rows[[2, 3]])  # row 2 lies in stripe 1
        assert len(checked) == 2
        assert torch.equal(cache.read(torch.arange(ROWS).flip(0))[0], rows.flip(0))
        stripes = -(-25 * ROW // STRIPE_BYTES)
        assert len(checked) == 2 * stripes  # every stripe of both blocks, each once
        assert cache._verified == {0, 1} and not cache._stripes
        cache.read(torch.arange(ROWS))
        assert len(checked) == 2 * stripes


def test_a_damaged_stripe_is_named_with_its_rows_while_the_other_stripes_are_served(tmp_path: Path) -> None:
    """A second job reads the block's other rows from disk before it reaches the damaged stripe;
    that stripe fails when a read first touches it: the file, its bytes and its rows are named,
    the block dropped, its intact rows written back and only the damaged rows (read from the
    source) written again."""
    rows = _filled_wide(tmp_path)
    (block,) = tmp_path.glob("*/block-000000.bin")
    raw = bytearray(block.read_bytes())
    raw[10 * STRIPE_BYTES + 5] ^= 1  # stripe 10 of block 0: bytes 655360-720895, rows 16-17
    block.write_bytes(bytes(raw))
    with _open_wide(tmp_path) as cache:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DiskCacheWarning)
            served = [0, 1, 2, 5, 15, 18, 24, 30, 49]
            assert bool(cache.present(torch.tensor(served)).all())
            assert torch.equal(cache.read(torch.tensor(served))[0], rows[served])
        with pytest.warns(DiskCacheWarning, match=r"block-000000\.bin fails its checksum in bytes 655360-720895 "
                                                  r"\(rows 16-17;"):
            assert cache.present(torch.tensor([17, 30])).tolist() == [False, True]
        assert cache.stats().blocks_dropped == 1 and not cache.present(torch.arange(25)).any()
        # The rows of its intact stripes were written back into the block's new part at the drop:
        # only the damaged stripe's rows 16 and 17 come from the source.
        assert cache.write(torch.arange(25), [rows[:25]]) == 2
        assert torch.equal(cache.read(torch.arange(ROWS))[0], rows)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DiskCacheWarning)
        with _open_wide(tmp_path) as again:  # the block written again passes every check
            assert torch.equal(again.read(torch.arange(ROWS))[0], rows)


def _read_everything_in_a_forked_child(cache: DiskCache, out) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        present = cache.present(torch.arange(ROWS)).tolist()
        later = cache.read(torch.arange(25, ROWS))[0].numpy().tobytes()  # a tensor would go by shared memory
    out.put((present, later, [str(w.message) for w in caught if issubclass(w.category, DiskCacheWarning)]))


def test_a_forked_child_checks_the_stripes_its_parent_had_not_and_names_a_damaged_one(tmp_path: Path) -> None:
    """The parent checked block 0's first stripes before the fork; the child checks the rest
    itself (its own mutex and descriptors, no thread of the parent's to wait for), names the
    damaged stripe and drops the block; the parent names it too when it reaches that stripe."""
    rows = _filled_wide(tmp_path)
    (block,) = tmp_path.glob("*/block-000000.bin")
    raw = bytearray(block.read_bytes())
    raw[10 * STRIPE_BYTES + 5] ^= 1  # stripe 10 of block 0: rows 16-17
    block.write_bytes(bytes(raw))
    threads = set(threading.enumerate())
    with _open_wide(tmp_path) as cache:
        assert torch.equal(cache.read(torch.tensor([0, 1]))[0], rows[:2])  # stripes 0-1 checked here
        context = multiprocessing.get_context("fork")
        out = context.Queue()
        child = context.Process(target=_read_everything_in_a_forked_child, args=(cache, out))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork while other tests' threads run
            child.start()
        present, later, named = out.get(timeout=60)
        child.join(60)
        assert child.exitcode == 0
        assert present == [False] * 25 + [True] * 25 and later == rows[25:].numpy().tobytes()
        assert len(named) == 1 and "block-000000.bin fails its checksum in bytes 655360-720895 (rows 16-17;" in named[0]
        with pytest.warns(DiskCacheWarning, match="block-000000.bin fails its checksum"):  # met here too
            assert not cache.present(torch.arange(25)).any()
        assert torch.equal(cache.read(torch.arange(25, ROWS))[0], rows[25:])
        assert set(threading.enumerate()) == threads  # reading and checking started no thread


def test_a_block_damaged_before_the_open_is_named_at_its_first_read_and_refilled(tmp_path: Path) -> None:
    images, labels = _data(16)
    with _open(tmp_path, 16) as cache:
        cache.write(torch.arange(16), [images, labels])
    (block,) = tmp_path.glob("*/block-000001.bin")
    raw = bytearray(block.read_bytes())
    raw[5] ^= 1
    block.write_bytes(bytes(raw))
    with _open(tmp_path, 16) as cache:
        with pytest.warns(DiskCacheWarning, match="block-000001.bin fails its checksum"):
            assert cache.present(torch.arange(16)).tolist() == [True] * 8 + [False] * 8
        assert cache.write(torch.arange(8, 16), [images[8:], labels[8:]]) == 8
        assert torch.equal(cache.read(torch.arange(16))[0], images)
        assert cache.stats().blocks_dropped == 1


def test_damaged_stripe_checksums_are_named_and_the_block_refilled(tmp_path: Path) -> None:
    rows = _filled_wide(tmp_path)
    (block,) = tmp_path.glob("*/block-000001.bin")
    raw = bytearray(block.read_bytes())
    raw[-3] ^= 1  # in the trailer: the last stripe's checksum
    block.write_bytes(bytes(raw))
    with _open_wide(tmp_path) as cache:
        with pytest.warns(DiskCacheWarning, match="block-000001.bin fails its checksum .its stripe checksums"):
            assert cache.present(torch.tensor([0, 25])).tolist() == [True, False]
        cache.write(torch.arange(25, ROWS), [rows[25:]])
        assert torch.equal(cache.read(torch.arange(ROWS))[0], rows)


def test_an_entry_of_the_previous_format_is_refused_with_one_line_and_filled_again(tmp_path: Path) -> None:
    """Blocks of format 2 (no stripe checksums, the manifest holding each block's CRC-32) are never
    read as format 3's: the manifest is named as another format and the rows written again. (Their
    fingerprints differ too, so a real older entry sits under another key.)"""
    rows = _filled_wide(tmp_path)
    (entry,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    manifest = json.loads((entry / "manifest.json").read_bytes())
    manifest["format"] = 2
    del manifest["stripe_bytes"]
    for b, size, _ in manifest["blocks"]:
        path = entry / f"block-{b:06d}.bin"
        path.write_bytes(path.read_bytes()[:size])  # the block as format 2 wrote it
    (entry / "manifest.json").write_text(json.dumps(manifest))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _open_wide(tmp_path) as cache:
            assert not cache.present(torch.arange(ROWS)).any()
            assert cache.write(torch.arange(ROWS), [rows]) == ROWS
            assert torch.equal(cache.read(torch.arange(ROWS))[0], rows)
    named = [str(w.message) for w in caught if issubclass(w.category, DiskCacheWarning)]
    assert len(named) == 1 and "manifest.json is for another format (2, not 3)" in named[0]


def test_a_block_damaged_between_two_jobs_is_named_and_its_batches_still_equal_torch(tmp_path: Path) -> None:
    """A later job finds the damage mid-epoch: the block is named once, its samples come from
    the dataset and every batch is torch's."""
    expected = _torch_epochs(Pictures(), 2)

    def loader(dataset: Pictures) -> gpuload.DataLoader:
        return gpuload.DataLoader(dataset, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(5),
                                  cache="host", cache_size=30 * (3 * 36 + 16), cache_dir=tmp_path / "c")

    first = loader(Pictures())
    list(first)
    first.close()
    blocks = sorted((tmp_path / "c").glob("*/block-*.bin"))
    assert blocks
    raw = bytearray(blocks[-1].read_bytes())
    raw[len(raw) // 2] ^= 0x10
    blocks[-1].write_bytes(bytes(raw))
    again = Pictures()
    later = loader(again)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [list(later) for _ in range(2)]
    named = [str(w.message) for w in caught if issubclass(w.category, DiskCacheWarning)]
    assert _same(got, expected)
    assert len(named) == 1 and blocks[-1].name in named[0] and "checksum" in named[0]
    assert again.reads > 1  # the damaged block's samples came from the dataset
    later.close()

