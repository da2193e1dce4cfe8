"""One contract, every store: written once against ``gpuload.cache.store.Store`` and run against
array rows over tiers (on the CPU in place, through the loader's staging path, with a toy tier
added in one class), a map-style dataset's samples by column and one by one, and a rank's
share of arrays or decoded images split over ranks. The ``gpu`` variants run the same checks
with the device tier and the prefetcher's staging on CUDA."""

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
    sharded_arrays_case,
)

from gpuload.cache import TieredArrayStore
from gpuload.cache.budget import BudgetLedger
from gpuload.cache.sample_store import SampleCache
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
    cache = SampleCache(1 << 30, ledger=BudgetLedger(), num_samples=4)
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
    case = sharded_arrays_case("cuda")
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
