"""One contract, every store: written once against ``gpuload.cache.store.Store`` and run against
array rows over tiers (on the CPU in place, through the loader's staging path, with a toy tier
added in one class), a map-style dataset's samples by column and one by one, and a rank's
share of arrays or decoded images split over ranks. The ``gpu`` variants run the same checks
with the device tier and the prefetcher's staging on CUDA. The keyed tier chain
(``gpuload.cache.chain.read_through``) is checked with a toy tier added in one class
(``ToyTier``), over the sample cache's own chain (memory store, disk entry, dataset), the
decoded images' (image cache, files) and the array store's tiers (device, host or a toy tier,
disk, source)."""

from __future__ import annotations

import types
import warnings
from typing import Any

import pytest
import torch
from store_cases import (
    CASES,
    Case,
    N,
    SlowHostTier,
    _arrays,
    array_case,
    columns,
    columns_case,
    planned,
    sample_cache_case,
    split_arrays_case,
)

from gpuload.cache import TieredArrayStore
from gpuload.cache.budget import BudgetLedger
from gpuload.cache.chain import NOTHING, Lookup, read_through
from gpuload.cache.sample_store import SampleStore
from gpuload.cache.store import FillingStore, Store, StreamGuard
from gpuload.cache.tiers import TIERS, HostTier, Tier, register_tier


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


@pytest.fixture(params=list(CASES))
def case(request) -> Case:
    made = CASES[request.param]()
    yield made
    made.store.close()


def test_every_store_is_a_store(case):
    assert isinstance(case.store, Store)
    assert not type(case.store).__abstractmethods__


def test_gather_returns_the_held_samples_in_order(case):
    g = torch.Generator().manual_seed(11)
    for _ in range(4):
        index = case.held[torch.randperm(case.held.numel(), generator=g)[:37]]
        assert same(case.batch(index), case.expected(index))


def test_an_index_not_held_is_an_index_error(case):
    missing = sorted(set(range(N)) - set(case.held.tolist()))
    index = torch.tensor([int(case.held[0]), missing[0] if missing else N + 5])
    with pytest.raises(IndexError):
        case.batch(index)


def test_shrink_keeps_what_is_held_correct(case):
    before = case.store.device_bytes
    freed = case.store.shrink(0)
    assert isinstance(freed, int) and 0 <= freed <= before
    assert case.store.device_bytes == before - freed  # what it freed is what it no longer holds
    still = [k for k in case.held.tolist() if _holds(case.store, k)]
    if still:
        index = torch.tensor(still[:20])
        assert same(case.batch(index), case.expected(index))


def _holds(store: Store, index: int) -> bool:
    try:
        store.gather(torch.tensor([index]))
    except IndexError:
        return False
    except RuntimeError:  # a copying store gathers only through its staging: it holds the row
        return True
    return True


def test_stats_and_close(case):
    counters = case.store.stats.as_dict()
    assert isinstance(counters, dict) and counters
    case.store.close()
    case.store.close()  # twice is fine
    with pytest.raises((RuntimeError, IndexError)):
        case.batch(case.held[:2])


def test_filling_stores_say_when_they_are_complete():
    cache = SampleStore(1 << 30, ledger=BudgetLedger(), num_samples=4)
    assert isinstance(cache, FillingStore) and not cache.complete
    cache.put(torch.arange(4), ["a", "b", "c", "d"])
    assert cache.complete and cache.gather(torch.tensor([3, 0])) == ["d", "a"]


def test_a_toy_tier_serves_its_rows_and_reports_them():
    SlowHostTier.reads = 0
    case = array_case("toy-tier")
    store = case.store
    stats = store.stats
    assert list(stats.tiers) == ["device", "slow-host", "source"]
    assert (stats.tiers["device"].samples, stats.tiers["slow-host"].samples, stats.tiers["source"].samples) == (
        50, 120, N - 170)
    index = torch.tensor([0, 60, 200, 49, 169, 170])
    assert same(store.gather(index), case.expected(index))
    assert SlowHostTier.reads == len(columns())  # one gather per column from the toy tier
    hits = store.stats.tiers
    assert (hits["device"].hits, hits["slow-host"].hits, hits["source"].hits) == (2, 2, 2)
    assert "slow-host 120" in repr(store)
    store.close()


def test_a_plan_naming_an_unknown_tier_is_a_clear_error():
    data = columns()
    with pytest.raises(ValueError, match="'nvme' that no class is registered"):
        _arrays(data, planned(data, [("device", 10), ("nvme", 20)]))


def test_registered_tiers_are_classes_with_a_name():
    assert {"device", "host"} <= set(TIERS)
    assert all(issubclass(kind, Tier) and kind.name == name for name, kind in TIERS.items())


def test_a_tier_without_a_name_is_not_registered():
    class Unnamed(HostTier):
        name = ""

    with pytest.raises(ValueError, match="Unnamed needs a name to be registered as a tier"):
        register_tier(Unnamed)
    assert Unnamed not in TIERS.values()


def test_a_copying_store_never_copies_by_itself():
    """Host rows reach a device only through the loader's staging: without it, a clear error."""
    data = columns()
    store = TieredArrayStore(list(data), planned(data, [("device", 10), ("host", 10)]), "meta",
                             ledger=BudgetLedger())
    with pytest.raises(RuntimeError, match="through the loader's staging"):
        store.gather(torch.tensor([0, 15]))
    assert store.gather(torch.tensor([0, 5]))[1].device.type == "meta"  # device rows only: no copy
    store.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["staged", "columns", "samples"])
def test_the_contract_on_cuda(kind):
    case = array_case("staged", "cuda") if kind == "staged" else (
        columns_case("cuda") if kind == "columns" else sample_cache_case("cuda"))
    index = case.held[torch.randperm(case.held.numel())[:50]]
    assert same(case.batch(index), case.expected(index))
    held = case.store.device_bytes
    assert held > 0
    assert case.store.shrink(0) == held and case.store.device_bytes == 0
    case.store.close()


@pytest.mark.gpu
def test_a_share_split_over_ranks_on_cuda_is_held_whole_and_given_back_on_close():
    case = split_arrays_case("cuda")
    index = case.held[torch.randperm(case.held.numel())[:50]]
    assert same(case.batch(index), case.expected(index))
    held = case.store.device_bytes
    assert held == case.held.numel() * sum(c[0].numel() * c.element_size() for c in columns())
    with pytest.warns(UserWarning, match="cannot shrink on one rank"):
        assert case.store.shrink(0) == 0
    assert case.store.device_bytes == held
    case.store.close()
    assert case.store.device_bytes == 0


class _Stream:
    """A stand-in CUDA stream: ``cuda_stream`` is its handle (one per name), as torch's has."""

    device_index = 0

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log
        self.cuda_stream = sum(ord(c) << (8 * k) for k, c in enumerate(name))

    def wait_event(self, event) -> None:
        self.log.append((self.name, "waits for event", event.name))

    def wait_stream(self, stream) -> None:
        self.log.append((self.name, "waits for stream", stream.name))


class _Tensor:
    is_cuda = True

    def __init__(self, log: list) -> None:
        self.log = log

    def record_stream(self, stream) -> None:
        self.log.append(("old rows", "reserved on", stream.name))


def test_the_stream_guard_orders_a_replacement_after_every_use_and_protects_what_it_replaced(monkeypatch):
    """A stand-in for CUDA records what the guard asks of the streams: the copy that replaces a
    store's device rows waits for every stream that used them, the old rows stay reserved on
    those streams, and a later use on another stream waits for the new rows."""
    log: list = []
    side, loop = _Stream("side", log), _Stream("loop", log)
    current = {"stream": side}
    events = []

    class Event:
        def __init__(self) -> None:
            self.name = f"e{len(events) + 1}"
            events.append(self)

        def record(self, stream) -> None:
            log.append((stream.name, "records", self.name))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current["stream"])
    monkeypatch.setattr(torch.cuda, "Event", Event)
    guard = StreamGuard(torch.device("cuda"))
    guard.use()  # a gather ahead, on the side stream
    current["stream"] = loop
    guard.use()  # one in the loop
    guard.before_replacing()  # the loop shrinks the store
    guard.replaced([_Tensor(log)])
    current["stream"] = side
    guard.use()
    assert log == [
        ("loop", "waits for stream", "side"),
        ("loop", "records", "e1"),
        ("old rows", "reserved on", "side"), ("old rows", "reserved on", "loop"),
        ("side", "waits for event", "e1"),
    ]


def test_a_stream_used_for_every_batch_is_noted_once_though_each_call_returns_a_new_object(monkeypatch):
    """``torch.cuda.current_stream()`` returns a new Python object at each call: 10,000 uses of
    one stream keep one entry, so a shrink waits for it once and reserves the old rows once."""
    log: list = []
    current = {"name": "side"}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(current["name"], log))
    monkeypatch.setattr(torch.cuda, "Event", lambda: types.SimpleNamespace(record=lambda stream: None))
    guard = StreamGuard(torch.device("cuda"))
    for _ in range(10_000):
        guard.use()
    assert len(guard._streams) == 1
    current["name"] = "loop"
    guard.before_replacing()
    guard.replaced([_Tensor(log)])
    assert log == [("loop", "waits for stream", "side"), ("old rows", "reserved on", "side")]


class _CachingAllocator:
    """torch's caching allocator on a pretended card: what the model and the store hold is
    allocated; blocks freed stay reserved in torch's pool (never handed back to the driver)."""

    def __init__(self, monkeypatch, total: int, model: int, store: TieredArrayStore) -> None:
        self.total, self.model, self.store = total, model, store
        self.reserved = self.allocated()
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.total - self.reserved, self.total))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated())

    def allocated(self) -> int:
        return self.model + self.store.device_bytes


def test_the_epoch_start_shrink_gives_back_once_not_every_epoch(monkeypatch):
    """The model has grown into the reserve: the first epoch start shrinks the device tier. The
    bytes it frees stay in torch's pool (the driver's free memory does not rise), and the later
    epoch starts count them as free: the cache keeps what it has, with one warning, instead of
    draining epoch by epoch."""
    from gpuload.cache import CacheSettings

    data = columns()
    bps = sum(column[0].numel() * column.element_size() for column in data)
    store = TieredArrayStore(data, planned(data, [("device", 200)]), "meta", ledger=BudgetLedger(), owner="m")
    monkeypatch.setattr(store, "device", torch.device("cuda", 0))
    allocator = _CachingAllocator(monkeypatch, total=100 * 1024, model=70 * 1024, store=store)
    settings = CacheSettings.resolve(cache_reserve=20 * 1024, environ={}, cwd="/")
    first_keep = (allocator.total - allocator.reserved + store.device_bytes - 20 * 1024) // bps
    assert 0 < first_keep < 200
    held = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            store.shrink_to_reserve(settings.keepable, refill="they are read from the source")
            held.append(store.device_bytes)
    assert held == [first_keep * bps] * 5
    assert allocator.reserved == 70 * 1024 + 200 * bps  # the freed bytes are torch's, not the driver's
    assert [str(w.message).count("fell below the reserve") for w in caught] == [1]
    store.close()


def test_the_column_store_shrinks_through_its_guard(monkeypatch):
    case = columns_case()
    store = case.store
    calls: list = []
    monkeypatch.setattr(store._streams, "before_replacing", lambda: calls.append("before"))
    monkeypatch.setattr(store._streams, "replaced", lambda old: calls.append(("replaced", len(old))))
    monkeypatch.setattr(store._streams, "use", lambda: calls.append("use"))
    store.gather(case.held[:3])
    assert store.shrink(0) > 0
    assert calls == ["use", "before", ("replaced", 3)]  # the old rows of its three columns
    store.close()


def test_shrink_to_reserve_gives_back_what_free_memory_no_longer_allows_on_cuda_only(monkeypatch):
    """A host store relabelled as on CUDA, with a fake memory reader: the shrink runs only on a
    CUDA device, only when the store holds device bytes, and warns with where samples come from."""
    import gpuload.cache.store as store_module
    from gpuload.device import MemoryInfo

    case = columns_case()
    store = case.store
    seen: list = []

    def keepable(device, memory, held):
        seen.append((device.type, memory.free, held))
        return 0

    assert store.shrink_to_reserve(keepable) == 0 and seen == []  # not on CUDA: nothing to give back
    monkeypatch.setattr(store_module, "device_memory", lambda device: MemoryInfo(free=123, total=1 << 30))
    monkeypatch.setattr(store, "device", torch.device("cuda"))
    held = store.device_bytes
    assert held > 0
    with pytest.warns(UserWarning, match=r"free memory on cuda fell below the reserve; .* read from the dataset"):
        assert store.shrink_to_reserve(keepable, refill="they are read from the dataset") > 0
    assert seen == [("cuda", 123, held)]
    empty = columns_case().store
    monkeypatch.setattr(empty, "device", torch.device("cuda"))
    empty.close()
    assert empty.shrink_to_reserve(keepable) == 0 and len(seen) == 1  # holds nothing: not asked
    store.close()


# ---------------------------------------------------------------- the keyed tier chain


class ToyTier:
    """A keyed tier added in one class: values by key in a dict, at most ``room`` of them (its
    budget). Values are lists, one value per key; ``asked`` records every lookup's keys."""

    def __init__(self, name: str, room: int = 1 << 30) -> None:
        self.name, self.room = name, room
        self.held: dict[int, Any] = {}
        self.asked: list[list[int]] = []

    def lookup(self, keys: torch.Tensor) -> Lookup:
        asked = keys.tolist()
        self.asked.append(asked)
        found = [p for p, key in enumerate(asked) if key in self.held]
        missing = torch.tensor([p for p, key in enumerate(asked) if key not in self.held], dtype=torch.int64)
        if not found:
            return None, missing
        return (torch.tensor(found), [self.held[asked[p]] for p in found]), missing

    def keep(self, keys: torch.Tensor, values: Any) -> int:
        kept = 0
        for key, value in zip(keys.tolist(), values):
            if key not in self.held and len(self.held) < self.room:
                self.held[key] = value
                kept += 1
        return kept


class _Squares(ToyTier):
    """A source: every key's value is its square."""

    def lookup(self, keys: torch.Tensor) -> Lookup:
        self.asked.append(keys.tolist())
        return (None, [key * key for key in keys.tolist()]), NOTHING


def _values(keys: torch.Tensor, hits: list) -> list[Any]:
    """The values of a read, in the order of ``keys``."""
    out: list[Any] = [None] * keys.numel()
    for _, positions, values in hits:
        for p, value in zip(range(keys.numel()) if positions is None else positions.tolist(), values):
            out[p] = value
    return out


def test_read_through_asks_each_tier_only_for_what_the_ones_before_lack_and_keeps_it_above():
    memory, disk, source = ToyTier("memory"), ToyTier("disk"), _Squares("source")
    disk.held = {3: 9, 4: 16}
    keys = torch.tensor([4, 7, 3, 2])
    hits, missing = read_through((memory, disk), keys, source)
    assert _values(keys, hits) == [16, 49, 9, 4] and not missing.numel()
    assert [(depth, positions.tolist()) for depth, positions, _ in hits] == [(1, [0, 2]), (2, [1, 3])]
    assert (memory.asked, disk.asked, source.asked) == ([[4, 7, 3, 2]], [[4, 7, 3, 2]], [[7, 2]])
    assert memory.held == {4: 16, 3: 9, 7: 49, 2: 4} and disk.held == {3: 9, 4: 16, 7: 49, 2: 4}
    hits, _ = read_through((memory, disk), keys, source)  # now all in memory: nothing else asked
    assert [(depth, positions.tolist()) for depth, positions, _ in hits] == [(0, [0, 1, 2, 3])]
    assert _values(keys, hits) == [16, 49, 9, 4] and len(disk.asked) == len(source.asked) == 1


def test_a_toy_tier_between_memory_and_the_source_serves_and_fills_within_its_budget():
    memory, toy, source = ToyTier("memory", room=1), ToyTier("toy", room=3), _Squares("source")
    keys = torch.tensor([1, 2, 3, 4, 5])
    read_through((memory, toy), keys, source)
    assert len(memory.held) == 1 and len(toy.held) == 3  # each within its budget
    hits, _ = read_through((memory, toy), keys, source)
    assert _values(keys, hits) == [1, 4, 9, 16, 25]
    assert [depth for depth, _, _ in hits] == [0, 1, 2] and source.asked[-1] == [4, 5]


def test_what_no_tier_nor_the_source_has_is_returned_missing():
    class Skips(ToyTier):  # e.g. files that cannot be read
        def lookup(self, keys: torch.Tensor) -> Lookup:
            return (torch.tensor([0]), ["first"]), torch.arange(1, keys.numel())

    memory = ToyTier("memory")
    keys = torch.tensor([10, 11, 12])
    hits, missing = read_through((memory,), keys, Skips("source"))
    assert missing.tolist() == [1, 2] and _values(keys, hits) == ["first", None, None]
    assert memory.held == {10: "first"}


def _sample_chain(tmp_path, **options) -> tuple[Any, list[Any]]:
    """A sample cache (memory store, disk entry in ``tmp_path``) of the contract's samples."""
    from torch.utils.data import default_collate

    from gpuload.cache import CacheDecision, CacheSettings
    from gpuload.sources import Setup
    from gpuload.sources.sample_cache import CachedSamples
    from gpuload.stats import LoaderStats

    data = [(torch.full((3,), float(k)), k) for k in range(N)]
    settings = CacheSettings.resolve(cache="host", cache_dir=tmp_path / "c", environ={}, cwd=tmp_path)
    setup = Setup(dataset=data, map_style=True, device=torch.device("cpu"), settings=settings, batched=True,
                  batch_size=8, collate_fn=default_collate, stats=LoaderStats(), owner=("chain", id(data)))
    return CachedSamples(setup, CacheDecision("host", "samples", options.get("budget", 1 << 30), "test")), data


def test_the_sample_cache_is_a_chain_whose_tiers_serve_what_they_hold(tmp_path):
    from torch.utils.data import default_collate

    cached, data = _sample_chain(tmp_path)
    assert [tier.name for tier in cached.tiers] == ["memory", "disk"]
    memory, disk = cached.tiers
    keys = torch.tensor([5, 1, 9, 1])
    found, missing = memory.lookup(keys)
    assert found is None and missing.tolist() == [0, 1, 2, 3]
    assert same(cached.batch(keys, in_range=True), default_collate([data[k] for k in keys.tolist()]))
    found, missing = memory.lookup(keys)  # the dataset's samples were kept: memory has them all
    assert found is not None and found[0] is None and not missing.numel()
    cached.batch(torch.arange(N), in_range=True)  # every sample: each block of the disk entry complete
    cached.close()  # the disk entry's blocks published, as at a job's end
    again, later = _sample_chain(tmp_path)  # a later job: its memory is empty, its disk tier holds them
    found, missing = again.tiers[1].lookup(keys)
    assert found is not None and not missing.numel()
    later.clear()  # nothing may be read from the dataset now
    assert same(again.batch(keys, in_range=True), default_collate([data[k] for k in keys.tolist()]))
    assert again.stats()["disk"]["hits"] == 8  # the lookup above and the batch's
    assert again.tiers[0].lookup(keys)[0] is not None  # kept in memory as it was read from disk
    again.close()


def test_decoded_images_are_a_chain_served_from_memory_once_read_and_a_toy_tier_serves_between(tmp_path):
    """The image source's chain: the decoded-image cache, then the files decoded (kept whole in
    the cache); a toy tier put between them in one class serves what it holds, no file read."""
    from image_fixtures import CountingList

    import gpuload
    from gpuload import transforms as T
    from gpuload.datasets import make_sample_image_folder
    from gpuload.sources.image_decoding import ImageRows, _Files, _MemoryImages

    folder = make_sample_image_folder(tmp_path / "images", num_images=6, num_classes=2, seed=3)
    files = CountingList(list(folder.samples))
    loader = gpuload.DataLoader(files, batch_size=3, device="cpu", cache="device", transforms=[T.RandomResizedCrop(8)])
    list(loader)  # the first epoch fills the decoded-image cache
    source = loader._source
    assert files.reads == 6 and source.keeps == "decoded"
    memory = _MemoryImages(source.cache)
    keys = torch.tensor([4, 0, 2])
    hits, missing = read_through((memory,), keys, _Files(source.reader, epoch=1, filling=False))
    assert [(depth, positions) for depth, positions, _ in hits] == [(0, None)] and not missing.numel()
    assert files.reads == 6 and [image.shape[0] for image in hits[0][2].images] == [3, 3, 3]  # whole, no file read

    class ImagesToy(ToyTier):  # values: ImageRows, kept per key
        def lookup(self, keys: torch.Tensor) -> Lookup:
            found, rows = super().lookup(keys)
            return (None if found is None else (found[0], ImageRows(found[1]))), rows

        def keep(self, keys: torch.Tensor, values: Any) -> int:
            return super().keep(keys, values.images)

    toy = ImagesToy("toy")
    empty = _MemoryImages(source.cache)
    source.cache.close()  # memory gives nothing now: the files, then the toy tier, serve
    hits, _ = read_through((empty, toy), keys, _Files(source.reader, epoch=1, filling=True))
    assert files.reads == 9 and sorted(toy.held) == [0, 2, 4]
    again, _ = read_through((empty, toy), keys, _Files(source.reader, epoch=1, filling=True))
    assert files.reads == 9 and [depth for depth, _, _ in again] == [1]
    assert all(torch.equal(a, b) for a, b in zip(hits[0][2].images, again[0][2].images))
    loader.close()


def _array_values(keys: torch.Tensor, hits: list, columns_count: int) -> list[torch.Tensor]:
    """A read of array rows put back in the order of ``keys``, per column."""
    out = []
    for column in range(columns_count):
        pieces = [(torch.arange(keys.numel()) if at is None else at, rows[column]) for _, at, rows in hits]
        order = torch.cat([at for at, _ in pieces])
        out.append(torch.cat([rows for _, rows in pieces]).index_select(0, torch.argsort(order)))
    return out


@pytest.mark.parametrize("kind", ["tiered", "toy-tier", "disk"])
def test_array_tiers_answer_the_chain_each_for_its_own_rows(kind, tmp_path):
    """The array store's tiers (device, host or a toy tier, disk, the source) read through the
    one chain give the rows its own gather gives, each tier asked only for what those before it lack."""
    from gpuload.cache.disk import fingerprint_arrays
    from gpuload.cache.settings import CacheSettings

    if kind == "disk":
        data = columns()
        settings = CacheSettings.resolve(cache_dir=tmp_path / "c", environ={}, cwd=tmp_path)
        store = _arrays(data, planned(data, [("device", 40), ("host", 30), ("disk", 100)]), settings=settings,
                        identity=lambda: fingerprint_arrays(data))
        case = Case(store, torch.arange(N), lambda index: [column.index_select(0, index) for column in data])
    else:
        case = array_case(kind)
    keyed = case.store.keyed_tiers()
    names = [tier.name for tier in keyed]
    assert names[-1] == "source" and names[0] == "device"
    index = torch.tensor([0, 239, 45, 100, 169, 171, 39, 230, 60])
    hits, missing = read_through(keyed[:-1], index, keyed[-1])
    assert not missing.numel()
    assert same(_array_values(index, hits, len(columns())), case.expected(index))
    assert same(_array_values(index, hits, len(columns())), case.batch(index))
    served = {names[depth]: (index.numel() if at is None else at.numel()) for depth, at, _ in hits}
    rows = {name: counts.samples for name, counts in case.store.stats.tiers.items()}
    first = 0
    for name in names:  # each row from the tier whose range holds it
        expected = int(((index >= first) & (index < first + rows[name])).sum())
        assert served.get(name, 0) == expected, (name, served)
        first += rows[name]
    case.store.close()
