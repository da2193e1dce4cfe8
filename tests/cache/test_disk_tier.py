"""The disk tier as a tier of the cache (gpuload/cache/disk_tier.py): planned after the host
tier when ``cache_dir`` is set, filled at placement for arrays, read back exactly; and the
sample cache's disk tier through the loader (batches equal torch's DataLoader's)."""

from __future__ import annotations

import collections
import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import gpuload
from gpuload.cache import TieredArrayStore
from gpuload.cache.columns import column_rows, layout, prepare
from gpuload.cache.disk import DiskCacheWarning, fingerprint_arrays
from gpuload.cache.disk_tier import DiskTier, _describe, _described, select_rows
from gpuload.cache.identity import IdentityError
from gpuload.cache.plan import make_plan
from gpuload.cache.settings import CacheSettings
from gpuload.cache.tiers import TIERS, Placing
from tests.cache.test_disk import _Listed

GiB = 2**30
N = 300


def _arrays() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (N, 3, 4, 4), dtype=torch.uint8, generator=g), torch.arange(N) * 5]


BPS = 3 * 4 * 4 + 8


def _plan(host: int, disk_room: int):
    return make_plan(BPS, N, device_free=80 * GiB, host_free=host * BPS, budget=0, reserve=0,
                     host_reserve=0, disk_room=disk_room)


def test_the_disk_tier_is_registered_and_planned_after_the_host_tier_only_with_a_folder() -> None:
    assert TIERS["disk"] is DiskTier
    without = _plan(100, 0)
    assert [t.name for t in without.tiers] == ["device", "host"] and without.source_samples == 200
    plan = _plan(100, 150 * BPS)
    assert [t.name for t in plan.tiers] == ["device", "host", "disk"]
    assert (plan.samples_in("disk"), plan.tiers[2].first, plan.source_samples) == (150, 100, 50)
    assert "disk tier:" in plan.describe() and plan.kind == "host+disk+stream"
    off = make_plan(BPS, N, 80 * GiB, 0, 0, 0, mode="off", host_reserve=0, disk_room=GiB)
    assert off.samples_in("disk") == 0


def test_settings_plan_the_disk_tier_from_cache_dir_and_disk_cache_size(tmp_path: Path) -> None:
    from gpuload.device import MemoryInfo

    memory, host = MemoryInfo(free=0, total=GiB), MemoryInfo(free=0, total=64 * GiB)
    none = CacheSettings.resolve(environ={}, cwd=tmp_path)
    assert none.disk_room() == 0
    assert none.array_plan(BPS, N, memory, host, device="cuda:0", shared=False, disk=True).samples_in("disk") == 0
    sized = CacheSettings.resolve(cache_dir=tmp_path / "not-yet" / "made", disk_cache_size=100 * BPS,
                                  environ={}, cwd=tmp_path)
    plan = sized.array_plan(BPS, N, memory, host, device="cuda:0", shared=False, disk=True)
    assert plan.samples_in("disk") == 100 and not (tmp_path / "not-yet").exists()  # planning writes nothing
    assert sized.array_plan(BPS, N, memory, host, device="cuda:0", shared=False).samples_in("disk") == 0


def _store(folder: Path, plan) -> TieredArrayStore:
    data = _arrays()
    settings = CacheSettings.resolve(cache_dir=folder, environ={}, cwd=folder.parent)
    return TieredArrayStore(data, plan, "cpu", settings=settings, identity=lambda: fingerprint_arrays(data),
                            stage_host_rows=True)


def _gather(store: TieredArrayStore, indices: torch.Tensor) -> list[torch.Tensor]:
    request = store.request(indices)
    views = [torch.empty(shape, dtype=dtype) for shape, dtype in request.staged_shapes]
    request.fill_staged(views)
    return request.assemble(request.on_device, views)


def test_array_rows_past_the_host_tier_go_to_disk_and_read_back_exactly(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    plan = _plan(100, 150 * BPS)
    data = _arrays()
    order = torch.randperm(N, generator=torch.Generator().manual_seed(1))
    with _store(folder, plan) as store:
        stats = store.stats
        tiers = stats.tiers
        assert (tiers["host"].samples, tiers["disk"].samples, tiers["source"].samples) == (100, 150, 50)
        disk = store.tier("disk").disk
        assert disk.stats().rows_written == 150
        for batch in order.split(32):
            got = _gather(store, batch)
            assert torch.equal(got[0], data[0][batch]) and torch.equal(got[1], data[1][batch])
        assert store.stats.tiers["disk"].hits == 150
    with _store(folder, plan) as again:  # a later job: published rows are not written again
        assert again.tier("disk").disk.stats().rows_written == 0
        got = _gather(again, order)
        assert torch.equal(got[0], data[0][order])


def test_a_damaged_disk_block_is_named_and_its_rows_come_from_the_source(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    plan = _plan(0, N * BPS)
    data = _arrays()
    _store(folder, plan).close()
    (block,) = folder.glob("*/block-*.bin")
    raw = bytearray(block.read_bytes())
    raw[:64] = b"\xff" * 64
    block.write_bytes(bytes(raw))
    with warnings.catch_warnings(record=True) as caught, _store(folder, plan) as store:
        warnings.simplefilter("always")
        got = _gather(store, torch.arange(N))
    assert torch.equal(got[0], data[0]) and torch.equal(got[1], data[1])
    assert any(issubclass(w.category, DiskCacheWarning) and block.name in str(w.message) for w in caught)


def test_rows_of_a_block_dropped_after_placement_come_from_the_source_and_are_written_again(tmp_path: Path) -> None:
    data = _arrays()
    with _store(tmp_path / "cache", _plan(0, N * BPS)) as store:
        disk = store.tier("disk").disk
        with pytest.warns(DiskCacheWarning, match="another process found it damaged"):
            disk._drop(0, "another process found it damaged")  # as when another process drops it
        assert not bool(disk.present(torch.arange(N)).any())
        got = _gather(store, torch.arange(N))
        assert torch.equal(got[0], data[0]) and torch.equal(got[1], data[1])
        assert bool(disk.present(torch.arange(N)).all())  # written again from the source


class Pictures(torch.utils.data.Dataset):
    """Deterministic fixed-shape samples, counting dataset reads."""

    def __init__(self, n: int = 120) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.reads += 1
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, 256, (3, 6, 6), dtype=torch.uint8, generator=g), {"label": i % 7, "w": float(i) / 3}


def _epochs(loader, count: int) -> list[list]:
    return [list(loader) for _ in range(count)]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _torch_epochs(dataset, count: int) -> list[list]:
    g = torch.Generator().manual_seed(5)
    loader = torch.utils.data.DataLoader(dataset, batch_size=16, shuffle=True, generator=g)
    return [list(loader) for _ in range(count)]


def test_sample_cache_spills_to_disk_and_batches_equal_torch(tmp_path: Path) -> None:
    dataset = Pictures()
    expected = _torch_epochs(Pictures(), 3)
    loader = gpuload.DataLoader(dataset, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(5),
                                cache="host", cache_size=30 * (3 * 36 + 16), cache_dir=tmp_path / "c")
    got = [list(loader)]
    after_fill = dataset.reads
    got += _epochs(loader, 2)
    assert _same(got, expected)
    disk = loader.stats.extra["cache"]["disk"]
    assert disk["published_rows"] == 120 and disk["hits"] > 0
    assert dataset.reads == after_fill  # epochs 2 and 3: from the host tier and the disk
    assert after_fill - 120 == 24 + 1  # the determinism probe's reads and dataset[0] for the structure
    # A second loader (a later job) reads no epoch from the dataset, its first one included, no
    # probe either (the samples on disk were written by a job whose probe passed), nor dataset[0]:
    # the entry keeps the samples' structure.
    again = Pictures()
    later = gpuload.DataLoader(again, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(5),
                               cache="host", cache_size=30 * (3 * 36 + 16), cache_dir=tmp_path / "c")
    assert _same(_epochs(later, 3), expected) and again.reads == 0


def test_without_cache_dir_nothing_changes(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("GPULOAD_CACHE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    loader = gpuload.DataLoader(Pictures(), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(5),
                                cache="host", cache_size=2000)
    assert _same(_epochs(loader, 2), _torch_epochs(Pictures(), 2))
    assert "disk" not in loader.stats.extra["cache"] and list(tmp_path.iterdir()) == []


class Augmented(Pictures):
    def __getitem__(self, i: int):
        image, target = super().__getitem__(i)
        return image + torch.randint(0, 256, image.shape, dtype=torch.uint8), target  # never the same twice


def test_random_samples_are_never_written_to_disk(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="random"):
        loader = gpuload.DataLoader(Augmented(), batch_size=16, cache="host", cache_dir=tmp_path / "c")
        list(loader)
    assert "disk" not in loader.stats.extra["cache"]
    assert not list((tmp_path / "c").glob("*/block-*")) if (tmp_path / "c").exists() else True


class FlippedSymmetric(Pictures):
    """torchvision's RandomHorizontalFlip of an image that reads the same flipped: equal reads,
    but a random transform all the same (its draw moves torch's generator)."""

    def __getitem__(self, i: int):
        from torchvision.transforms import RandomHorizontalFlip

        _, target = super().__getitem__(i)
        return RandomHorizontalFlip()(torch.full((3, 6, 6), i % 256, dtype=torch.uint8)), target


def test_samples_of_a_dataset_drawing_from_a_global_generator_are_never_written_to_disk(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="draws from torch's global random generator"):
        loader = gpuload.DataLoader(FlippedSymmetric(), batch_size=16, cache="host", cache_dir=tmp_path / "c")
        list(loader)
    assert "disk" not in loader.stats.extra["cache"]
    assert not list((tmp_path / "c").glob("*/block-*"))
    loader.close()


@pytest.mark.gpu
def test_on_cuda_array_rows_past_host_memory_come_from_the_disk_tier(tmp_path: Path, pretend_host_memory) -> None:
    total = 64 * GiB
    pretend_host_memory(free=int(total * 0.10) + 60 * BPS, total=total)  # the host tier holds 60 rows
    data = _arrays()
    dataset = torch.utils.data.TensorDataset(*data)
    loader = gpuload.DataLoader(dataset, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(4),
                                device="cuda", cache_size=50 * BPS, cache_dir=tmp_path / "c")
    reference = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True,
                                            generator=torch.Generator().manual_seed(4))
    for _ in range(2):
        for (images, labels), (want_images, want_labels) in zip(loader, reference, strict=True):
            assert torch.equal(images.cpu(), want_images) and torch.equal(labels.cpu(), want_labels)
    tiers = loader.stats.extra["cache"]["tiers"]
    assert (tiers["device"]["samples"], tiers["host"]["samples"], tiers["disk"]["samples"]) == (50, 60, 190)
    assert tiers["disk"]["hits"] == 2 * 190 and tiers["source"]["samples"] == 0
    assert len(list((tmp_path / "c").glob("*/block-*.bin"))) >= 1


def test_device_images_are_written_to_the_disk_tier_once_their_host_copy_is_done() -> None:
    """The image tier's writes from a GPU wait for no copy: each batch's host copies are
    written when their event says they are done, in order, and all of them at close."""
    from gpuload.cache.disk_tier import DiskImages

    class Disk:
        accepting = True

        def __init__(self) -> None:
            self.written: list[list[int]] = []
            self.closed = False

        def write_items(self, rows: torch.Tensor, items: list[torch.Tensor]) -> int:
            self.written.append(rows.tolist())
            return len(rows)

        def close(self) -> None:
            self.closed = True

    class Copy:  # a CUDA event's query/synchronize
        def __init__(self) -> None:
            self.done = False

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            self.done = True

    disk = Disk()
    images = DiskImages(disk)
    first, second = Copy(), Copy()
    images._copying.extend([([1, 2], [], first), ([3], [], second)])
    assert images._write_copied(wait=False) == 0 and disk.written == []
    first.done = True
    assert images._write_copied(wait=False) == 2 and disk.written == [[1, 2]]
    images.close()
    assert disk.written == [[1, 2], [3]] and disk.closed


def test_the_copies_done_event_is_recorded_on_the_images_device_not_the_current_one(monkeypatch) -> None:
    """Images decoded on cuda:1 by a thread whose current device is cuda:0 (a loader on
    cuda:$LOCAL_RANK whose job never called set_device): their host copies are queued on
    cuda:1's stream, so the event that says they are done must be recorded there; one recorded
    on cuda:0 would let unfinished pinned copies be written to disk. Stand-ins for the copies,
    the streams and the event."""
    from test_prefetch import DeviceTensor

    from gpuload.cache import disk_tier
    from gpuload.cache.disk_tier import DiskImages

    recorded: list[str] = []

    class OnCuda1(DeviceTensor):
        @property
        def device(self) -> torch.device:
            return torch.device("cuda", 1)

    class Event:  # torch's: record() with no stream takes the current device's current stream
        def record(self, stream=None) -> None:
            recorded.append(stream if stream is not None else torch.cuda.current_stream())

        def query(self) -> bool:
            return False

    def current_stream(device=None) -> str:
        index = 0 if device is None else torch.device(device).index  # the current device: cuda:0
        return f"stream of cuda:{index}"

    class Disk:
        accepting = True

        def write_items(self, rows: torch.Tensor, items: list[torch.Tensor]) -> int:
            raise AssertionError("nothing is written before its copy is done")

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(disk_tier, "pinned_host_copies", lambda items: [item.clone() for item in items])
    images = DiskImages(Disk())
    image = torch.zeros(3, 4, 5, dtype=torch.uint8).as_subclass(OnCuda1)
    assert images.write([7], [image]) == 0
    assert recorded == ["stream of cuda:1"]


# ---------------------------------------------------------------- edges of the tiers


def test_an_empty_disk_tier_holds_nothing_and_refuses_to_gather(tmp_path: Path) -> None:
    data = _arrays()
    cpu = torch.device("cpu")
    empty = DiskTier.allocate(data, 10, 5, Placing(cpu))  # no folder known: empty
    assert (empty.rows, empty.first) == (0, 10)
    with pytest.raises(RuntimeError, match="this disk tier was closed"):
        empty.gather(0, torch.arange(2))
    no_folder = Placing(cpu, CacheSettings.resolve(environ={}, cwd=tmp_path), lambda: fingerprint_arrays(data))
    assert DiskTier.allocate(data, 0, 10, no_folder).rows == 0 and list(tmp_path.iterdir()) == []
    settings = CacheSettings.resolve(cache_dir=tmp_path / "c", environ={}, cwd=tmp_path)
    assert DiskTier.allocate(data, 0, 0, Placing(cpu, settings, lambda: 1 / 0)).rows == 0  # no rows: not fingerprinted


def test_a_disk_tier_gathers_into_a_new_tensor(tmp_path: Path) -> None:
    data = _arrays()
    settings = CacheSettings.resolve(cache_dir=tmp_path / "c", environ={}, cwd=tmp_path)
    tier = DiskTier.allocate(data, 100, 50, Placing(torch.device("cpu"), settings, lambda: fingerprint_arrays(data)))
    assert tier.rows == 50
    assert torch.equal(tier.gather(1, torch.tensor([0, 49])), data[1][torch.tensor([100, 149])])
    tier.disk.close()


class _Failing(Pictures):
    def __getitem__(self, i: int):
        raise OSError(f"sample {i} is unreadable")


class _Named(Pictures):
    def __getitem__(self, i: int):
        return torch.zeros(2, dtype=torch.uint8), f"sample-{i}"


class _Unpicklable(Pictures):
    def __init__(self) -> None:
        super().__init__()
        self.lock = __import__("threading").Lock()


def test_the_sample_disk_tier_names_why_a_dataset_gets_none(tmp_path: Path) -> None:
    from gpuload.cache.disk_tier import DiskRows

    settings = CacheSettings.resolve(cache_dir=tmp_path / "c", environ={}, cwd=tmp_path)
    with pytest.warns(DiskCacheWarning, match=r"reading _Failing\[0\] failed \(OSError: sample 0 is unreadable\)"):
        assert DiskRows.open(_Failing(), settings) is None
    with pytest.warns(DiskCacheWarning, match="the samples of this _Named are not fixed-shape"):
        assert DiskRows.open(_Named(), settings) is None
    with pytest.raises(IdentityError, match="cannot identify _Unpicklable: its state does not pickle"):
        DiskRows.open(_Unpicklable(), settings)
    rows = DiskRows.open(Pictures(4), settings)
    assert rows is not None and rows.accepting
    rows.close()
    assert not rows.disk.present(torch.arange(4)).any()


def test_the_image_disk_tier_keeps_only_whole_uint8_images(tmp_path: Path) -> None:
    from gpuload.cache.disk_tier import DiskImages
    from gpuload.datasets import make_sample_image_folder

    folder = make_sample_image_folder(tmp_path / "images", num_images=3, num_classes=1, seed=0)
    settings = CacheSettings.resolve(cache_dir=tmp_path / "c", environ={}, cwd=tmp_path)
    images = DiskImages.open(folder, settings, {"backend": "test"})
    assert images is not None
    assert images.write([0, 1], [torch.zeros(2, 2), torch.zeros(2, 2, 3, dtype=torch.float32)]) == 0
    assert images.present([0, 1]) == [False, False]
    images.disk.close()


def test_an_index_past_the_datasets_length_is_read_from_the_dataset_as_torch_does(tmp_path: Path) -> None:
    """torch hands every index to the dataset, also one past a ``__len__`` that underreports;
    the disk tier has rows for ``[0, len)`` only, so such an index is neither read nor written there."""
    sampler = [0, 3, 130, 5, 1, 2]
    loader = gpuload.DataLoader(Pictures(), batch_size=4, sampler=sampler, cache="host", cache_dir=tmp_path / "c")
    reference = torch.utils.data.DataLoader(Pictures(), batch_size=4, sampler=sampler)
    assert _same(_epochs(loader, 2), _epochs(reference, 2))
    assert loader.stats.extra["cache"]["disk"]["rows_written"] == 5


def test_a_dataset_gpuload_cannot_identify_is_refused_unless_the_loader_gets_a_cache_key(tmp_path: Path) -> None:
    loader = gpuload.DataLoader(_Unpicklable(), batch_size=16, cache="host", cache_dir=tmp_path / "c")
    with pytest.raises(IdentityError, match=r"cannot identify _Unpicklable: .*; pass cache_key="):
        iter(loader)  # the cache is set up, and the dataset looked at, by the first epoch
    loader.close()
    with pytest.raises(gpuload.cache.CacheSettingError, match="cache_key"):
        gpuload.DataLoader(Pictures(), batch_size=16, cache="host", cache_dir=tmp_path / "c", cache_key="")
    expected = _torch_epochs(Pictures(), 1)

    def job(key: str) -> tuple[list, dict]:
        loader = gpuload.DataLoader(_Unpicklable(), batch_size=16, shuffle=True, cache="host", cache_size=1,
                                    generator=torch.Generator().manual_seed(5), cache_dir=tmp_path / "c", cache_key=key)
        assert loader.cache_key == key and f"cache_key={key!r}" in loader.cache_settings.describe()
        got = list(loader)
        disk = loader.stats.extra["cache"]["disk"]
        loader.close()
        return got, disk

    for key, written in (("v1", 120), ("v1", 0), ("v2", 120)):  # one entry per key, read back by the same key
        got, disk = job(key)
        assert _same([got], expected) and disk["rows_written"] == written
        assert disk["hits"] == (120 if written == 0 else 0)


def test_a_file_rewritten_with_its_size_and_mtime_kept_is_never_served_from_the_old_entry(tmp_path: Path) -> None:
    files = [tmp_path / f"{k}.bin" for k in range(8)]
    for k, file in enumerate(files):
        file.write_bytes(bytes([k]) * 4)

    def epoch() -> torch.Tensor:
        loader = gpuload.DataLoader(_Listed([str(f) for f in files]), batch_size=8, cache="host", cache_size=1,
                                    cache_dir=tmp_path / "c")
        (batch,) = list(loader)
        loader.close()
        return batch

    assert torch.equal(epoch(), torch.arange(8).repeat_interleave(4).view(8, 4).to(torch.uint8))
    status = files[3].stat()
    files[3].write_bytes(b"\x63" * 4)  # cp -p: other bytes, same size, the old mtime put back
    os.utime(files[3], ns=(status.st_atime_ns, status.st_mtime_ns))
    assert epoch()[3].tolist() == [0x63] * 4


def _epoch_in_child(loader: gpuload.DataLoader, expected: list) -> None:
    got = list(loader)
    os._exit(0 if _same(got, expected) and loader.stats.extra["cache"]["disk"]["hits"] > 0 else 1)


def test_a_forked_child_iterates_a_loader_whose_disk_tier_serves(tmp_path: Path) -> None:
    import multiprocessing

    loader = gpuload.DataLoader(Pictures(), batch_size=16, cache="host", cache_size=1, cache_dir=tmp_path / "c")
    expected = list(loader)  # fills the disk tier
    assert loader.stats.extra["cache"]["disk"]["published_rows"] == 120
    child = multiprocessing.get_context("fork").Process(target=_epoch_in_child, args=(loader, expected))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0
    assert _same(list(loader), expected)  # the parent's tier is untouched
    loader.close()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.float16, torch.bfloat16, torch.int64,
                                   torch.complex64])
def test_select_rows_gives_index_select_of_every_column(dtype: torch.dtype) -> None:
    """The samples a batch keeps (rows copied one by one in the calling thread, not split over
    torch's threads): exactly ``index_select`` of each column, image rows and scalars."""
    generator = torch.Generator().manual_seed(1)
    images = (torch.randn(6, 3, 4, 10, generator=generator) * 50).to(dtype)
    part = prepare([(images[k], images[k, :, :, ::3], k * 1.5, {"id": k}) for k in range(6)])
    positions = torch.tensor([4, 0, 5, 4])
    got = column_rows(select_rows(part, positions))
    expected = [rows.index_select(0, positions) for rows in column_rows(part)]
    assert len(got) == len(expected) == 4
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


Point = collections.namedtuple("Point", "x y")


@pytest.mark.parametrize("sample", [
    (torch.zeros(3, 4, 4, dtype=torch.uint8), 7),
    {"x": np.ones((2, 3), dtype=np.float32), 3: np.float32(1.5), "ok": True, "n": [np.int16(2), 0.5]},
    [torch.ones(4, dtype=torch.bfloat16), 1.5, np.bool_(True)],
])
def test_the_samples_structure_kept_in_an_entry_gives_their_layout_back(sample) -> None:
    """What a later job opens the disk tier with instead of reading ``dataset[0]``."""
    template = prepare([sample, sample])
    description = _describe(template)
    assert json.loads(json.dumps(description)) == description
    kept = _described(json.loads(json.dumps(description)))
    assert kept is not None and layout(kept) == layout(template)
    assert [rows.shape[0] for rows in column_rows(kept)] == [0] * len(column_rows(template))


@pytest.mark.parametrize("sample", [Point(torch.zeros(2), 1), {(1, 2): torch.zeros(2)}, {False: 1.0}])
def test_a_structure_not_told_by_name_is_not_kept(sample) -> None:
    """A namedtuple's class, a tuple or bool dict key: a later job reads ``dataset[0]`` instead."""
    assert _describe(prepare([sample, sample])) is None
    assert _described({"column": "tensor", "dtype": "no_such_dtype", "rows": "uint8", "shape": [2]}) is None
