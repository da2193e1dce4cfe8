"""ColumnStore and prepare(): batches equal torch's default_collate on every structure."""

from __future__ import annotations

import pickle
import warnings
from collections import namedtuple

import numpy as np
import pytest
import torch
from equivalence import assert_same
from torch.utils.data import default_collate

from gpuload.cache import CacheFallbackWarning
from gpuload.cache.budget import BudgetLedger
from gpuload.cache.columns import (
    Branch,
    Column,
    ColumnStore,
    Objects,
    column_rows,
    layout,
    prepare,
    rebuild,
)

Point = namedtuple("Point", ["x", "y"])


def _sample(kind: str, i: int):
    """Sample ``i`` of a dataset of one structure ``kind``."""
    x = torch.arange(4, dtype=torch.float32) + i
    if kind == "tuple":
        return x, i
    if kind == "list":
        return [x, float(i) / 3, i % 2 == 0]
    if kind == "dict":
        return {"x": x, "label": i, "name": f"s{i}", "raw": b"\x00" * (i % 3)}
    if kind == "namedtuple":
        return Point(x, np.float32(i) / 7)
    if kind == "nested":
        return {"a": (x, [np.arange(3, dtype=np.int16) * i, np.bool_(i % 3 == 0)]), "b": Point(i, {"c": x * 2})}
    if kind == "numpy":
        return np.full((2, 3), i, dtype=np.float64), np.int64(i), np.uint8(i % 256)
    if kind == "tensor":
        return x
    if kind == "bfloat16":  # a dtype numpy lacks: its rows are written with torch, not numpy records
        return x.to(torch.bfloat16), i
    if kind == "int":
        return i
    if kind == "string":
        return f"sample {i}"
    raise ValueError(kind)


KINDS = ["tuple", "list", "dict", "namedtuple", "nested", "numpy", "tensor", "bfloat16", "int", "string"]


def _store(n: int, budget: int = 1 << 30, **options) -> ColumnStore:
    return ColumnStore(budget, n, ledger=BudgetLedger(), **options)


def _put(store: ColumnStore, keys: list[int], samples: list) -> int:
    return store.put(torch.tensor(keys, dtype=torch.int64), prepare(samples))


@pytest.mark.parametrize("kind", KINDS)
def test_prepared_and_gathered_batches_equal_default_collate(kind: str) -> None:
    n = 20
    samples = [_sample(kind, i) for i in range(n)]
    assert_same(prepare(samples[:7]).batch(), default_collate(samples[:7]))
    store = _store(n)
    for start in range(0, n, 6):
        keys = list(range(start, min(start + 6, n)))
        assert _put(store, keys, [samples[k] for k in keys]) == len(keys)
    assert store.complete and not store.accepting
    order = [13, 2, 19, 2, 0, 7]
    slots = store.slots(torch.tensor(order))
    assert_same(store.gather_rows(slots), default_collate([samples[k] for k in order]))
    views = store.views(slots)
    for view, k in zip(views, order):
        assert_same(view, samples[k], f"sample {k}")


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in ("dict", "string")])
def test_columns_of_batches_of_one_layout_join_and_rebuild_as_default_collate(kind: str) -> None:
    """What a split sample cache relies on: batches of one layout, joined column by column and
    rebuilt in the template's structure, are default_collate of all their samples."""
    samples = [_sample(kind, i) for i in range(9)]
    first, second = prepare(samples[:3]), prepare(samples[3:])
    assert layout(first) is not None and layout(first) == layout(second)
    joined = [torch.cat(pair) for pair in zip(column_rows(first), column_rows(second))]
    assert_same(rebuild(prepare(samples[:1]), joined), default_collate(samples))


def test_a_layout_is_none_with_per_sample_leaves_and_differs_with_shape_or_dtype() -> None:
    assert layout(prepare([_sample("dict", i) for i in range(3)])) is None  # strings and bytes
    assert layout(prepare([_sample("string", i) for i in range(3)])) is None
    x = torch.zeros(4)
    base = layout(prepare([(x, 1)]))
    assert layout(prepare([(torch.zeros(5), 1)])) != base
    assert layout(prepare([(x.double(), 1)])) != base
    assert layout(prepare([(x, 1.0)])) != base
    assert layout(prepare([[x, 1]])) != base  # a list, not a tuple


def test_a_column_holds_one_exact_type_dtype_and_shape() -> None:
    part = prepare([(torch.zeros(2), 1, 1.5, True, np.float32(2))] * 3)
    assert isinstance(part, Branch) and all(isinstance(child, Column) for child in part.children)
    assert [c.rows.dtype for c in part.children] == [torch.float32, torch.int64, torch.float64, torch.bool,
                                                     torch.float32]
    mixed_numbers = prepare([1, 2.5, 3])  # default_collate infers float32 from the mix: kept per sample
    assert isinstance(mixed_numbers, Objects)
    assert isinstance(prepare([torch.zeros(2), torch.zeros(2, dtype=torch.float64)]), Objects)
    assert isinstance(prepare([torch.zeros(2), torch.zeros(3)]), Objects)
    assert isinstance(prepare([True, 1]), Objects)
    assert isinstance(prepare([{"a": 1}, {"b": 1}]), Objects)
    assert isinstance(prepare([(1, 2), (1, 2, 3)]), Objects)
    assert isinstance(prepare([torch.zeros(2, requires_grad=True)] * 2), Objects)
    for empty in ((), [], {}):
        assert isinstance(prepare([empty, empty]), Objects)
        assert_same(prepare([(1, empty), (2, empty)]).batch(), default_collate([(1, empty), (2, empty)]))


def test_a_leaf_that_changes_becomes_per_sample_and_batches_stay_exact() -> None:
    """Variable-length tensors (batches bucketed by length), then a dtype change, then a new structure."""
    def sample(i: int):
        length = 3 if i < 8 else 5
        dtype = torch.int64 if i < 12 else torch.int32
        return {"tokens": torch.arange(length) + i, "id": torch.tensor(i, dtype=dtype), "w": float(i)}

    samples = [sample(i) for i in range(16)]
    store = _store(17)
    assert _put(store, list(range(8)), samples[:8]) == 8
    assert store.describe().startswith("by column: 3 column(s)")
    assert _put(store, list(range(8, 12)), samples[8:12]) == 4
    assert _put(store, list(range(12, 16)), samples[12:16]) == 4
    assert store.describe().startswith("changed: by column: 1 column(s)")
    for order in ([0, 1, 2], [9, 10], [12, 13, 14], [3, 12]):
        slots = store.slots(torch.tensor(order))
        expected = [samples[k] for k in order]
        try:
            theirs = default_collate(expected)
        except RuntimeError as error:  # torch cannot stack different lengths: neither can we
            with pytest.raises(type(error)):
                store.gather_rows(slots)
            continue
        assert_same(store.gather_rows(slots), theirs)
    assert _put(store, [16], ["not a dict"]) == 1  # the whole tree becomes per-sample
    slots = store.slots(torch.tensor([16]))
    assert store.gather_rows(slots) == ["not a dict"]
    assert_same(store.views(store.slots(torch.tensor([4])))[0], samples[4])


def test_bytes_are_the_columns_and_the_slot_map() -> None:
    store = _store(1000)
    _put(store, [0, 1], [(torch.zeros(8, dtype=torch.int64), 1)] * 2)
    assert store.stats.bytes == 1000 * (8 * 8 + 8) + 1000 * 4  # every row up front, int32 slot map
    assert len(store) == 2


def test_a_small_budget_allocates_the_rows_that_fit_and_stops() -> None:
    row = 4 * 4
    store = _store(100, budget=100 * 4 + 10 * row + 5)
    samples = [torch.full((4,), float(i)) for i in range(20)]
    assert _put(store, list(range(8)), samples[:8]) == 8
    assert _put(store, list(range(8, 16)), samples[8:16]) == 2
    assert store.full and len(store) == 10 and store.stats.rejected == 6
    assert "rows for 10 of 100 samples" in store.describe()
    slots = store.slots(torch.tensor([3, 12, 9, 0]))
    assert slots.tolist()[1] == -1
    batch = store.assemble(slots, prepare([samples[12]]))
    assert_same(batch, default_collate([samples[k] for k in [3, 12, 9, 0]]))


def test_rows_limited_by_free_memory_warn_once_when_they_run_out() -> None:
    store = _store(100, room=lambda: 5 * 16)
    samples = [torch.full((4,), float(i)) for i in range(8)]
    assert _put(store, [0, 1, 2], samples[:3]) == 3
    with pytest.warns(CacheFallbackWarning, match="reached the reserve after caching 5 samples"):
        assert _put(store, [3, 4, 5], samples[3:6]) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _put(store, [6], samples[6:7]) == 0


def test_rows_that_cannot_be_allocated_are_halved_until_they_can(monkeypatch) -> None:
    real = torch.empty

    def empty(shape, **options):
        if shape and shape[0] > 30:
            raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB")
        return real(shape, **options)

    monkeypatch.setattr(torch, "empty", empty)
    store = _store(100)
    with pytest.warns(CacheFallbackWarning, match="reached the reserve after caching 25 samples"):
        assert _put(store, list(range(40)), [torch.full((2,), float(i)) for i in range(40)]) == 25
    assert "rows for 25 of 100 samples" in store.describe()


def test_assemble_with_per_sample_leaves_and_a_mismatch() -> None:
    samples = [{"x": torch.full((2,), float(i)), "name": f"n{i}"} for i in range(6)]
    store = _store(6)
    _put(store, [0, 1, 2], samples[:3])
    slots = store.slots(torch.tensor([4, 0, 5, 2]))
    batch = store.assemble(slots, prepare([samples[4], samples[5]]))
    assert_same(batch, default_collate([samples[k] for k in [4, 0, 5, 2]]))
    assert store.assemble(slots, prepare([{"x": 1, "name": "a"}, {"x": 2, "name": "b"}])) is None


def test_duplicates_out_of_range_keys_and_uncacheable_values() -> None:
    store = _store(10)
    samples = [(torch.tensor([i]), f"s{i}") for i in range(4)]
    assert _put(store, [1, 1, 2], [samples[1], samples[1], samples[2]]) == 2
    assert _put(store, [-1, 3], [samples[0], samples[3]]) == 1  # -1 is never stored
    assert store.slots(torch.tensor([-1, 11])).tolist() == [-1, -1]
    assert 1 in store and 0 not in store
    assert _put(store, [5, 6], [(torch.tensor([5]), object()), (torch.tensor([6]), "ok")]) == 1
    assert store.stats.uncacheable == 1 and 5 not in store and 6 in store
    slots = store.slots(torch.tensor([2, 1, 6]))
    assert_same(store.gather_rows(slots), default_collate([samples[2], samples[1], (torch.tensor([6]), "ok")]))


def test_stored_values_are_copies() -> None:
    x, a = torch.zeros(3), np.zeros(2)
    store = _store(2)
    _put(store, [0], [(x, a, "s")])
    x += 1
    a += 1
    gathered = store.gather_rows(store.slots(torch.tensor([0])))
    assert gathered[0].sum() == 0 and gathered[1].sum() == 0
    view = store.views(store.slots(torch.tensor([0])))[0]
    view[0].add_(5)
    assert store.gather_rows(store.slots(torch.tensor([0])))[0].sum() == 0


def test_shrink_keeps_the_first_rows_settle_and_close() -> None:
    store = _store(10)
    _put(store, list(range(6)), [torch.full((4,), float(i)) for i in range(6)])
    held = store.stats.bytes
    freed = store.shrink(10 * 4 + 3 * 16)
    assert freed == held - (10 * 4 + 3 * 16) and len(store) == 3 and store.full
    assert store.slots(torch.tensor([0, 2, 3])).tolist() == [0, 2, -1]
    assert store.gather_rows(store.slots(torch.tensor([2])))[0, 0] == 2
    store.settle()
    assert store.stats.budget == store.stats.bytes
    store.close()
    assert store.stats.bytes == 0 and len(store) == 0
    with pytest.raises(RuntimeError, match="closed"):
        store.gather(torch.tensor([0]))
    assert _put(store, [7], [torch.zeros(4)]) == 0


def test_a_prepared_batch_pickles_for_worker_processes() -> None:
    samples = [_sample("nested", i) for i in range(5)]
    part = pickle.loads(pickle.dumps(prepare(samples)))
    assert_same(part.batch(), default_collate(samples))


def test_default_collate_errors_are_torchs() -> None:
    for samples in ([None, None], [object(), object()], [2**70, 1]):
        with pytest.raises(Exception) as theirs:
            default_collate(samples)
        with pytest.raises(type(theirs.value)):
            prepare(samples).batch()


@pytest.mark.gpu
def test_device_columns_are_one_allocation_per_leaf() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    ledger = BudgetLedger()
    store = ColumnStore(1 << 30, 100, "cuda", ledger=ledger, owner="columns")
    samples = [{"x": torch.full((8,), i), "y": i, "name": f"{i}"} for i in range(100)]
    allocations = torch.cuda.memory_stats()["allocation.all.current"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.put(torch.arange(50), prepare(samples[:50])) == 50
    assert torch.cuda.memory_stats()["allocation.all.current"] - allocations == 2  # one per column
    names = sum(len(f"{i}") for i in range(50))
    assert store.stats.bytes == 100 * (8 * 8 + 8) + names  # all rows up front; the index map is on the host
    assert ledger.used("cuda:0") == store.stats.bytes
    store.put(torch.arange(50, 100), prepare(samples[50:]))
    order = torch.tensor([5, 99, 0, 42])
    batch = store.gather_rows(store.slots(order))
    assert batch["x"].is_cuda and batch["y"].is_cuda
    assert_same(batch, default_collate([samples[k] for k in order.tolist()]))
    store.close()
    assert ledger.owners("cuda:0") == {}


def test_numpy_text_arrays_are_kept_per_sample_not_as_a_column() -> None:
    part = prepare([np.array(["a", "b"]), np.array(["c", "d"])])
    assert isinstance(part, Objects) and layout(part) is None


def test_a_closed_or_empty_store_finds_nothing_and_has_nothing_to_shrink() -> None:
    store = _store(10)
    assert store.shrink(0) == 0  # nothing stored yet
    assert store.slots(torch.tensor([], dtype=torch.int64)).numel() == 0
    assert _put(store, [1, 2], [_sample("tuple", 1), _sample("tuple", 2)]) == 2
    assert store.shrink(1 << 30) == 0  # already within the bytes asked for
    store.close()
    assert store.slots(torch.tensor([1, 2])).tolist() == [-1, -1]


def test_out_of_memory_while_writing_stops_filling_with_one_warning_and_other_errors_surface(monkeypatch) -> None:
    store = _store(10)
    assert _put(store, [0], [_sample("tuple", 0)]) == 1
    message = iter(["a bad write", "CUDA out of memory. Tried to allocate 2.00 GiB"])

    def failing(keys, write):
        raise RuntimeError(next(message))

    monkeypatch.setattr(store, "_write", failing)
    with pytest.raises(RuntimeError, match="a bad write"):
        _put(store, [1], [_sample("tuple", 1)])
    with pytest.warns(CacheFallbackWarning, match="out of memory on cpu"):
        assert _put(store, [2], [_sample("tuple", 2)]) == 0
    assert not store.accepting and 2 not in store


def test_tensors_off_the_host_are_kept_per_sample() -> None:
    meta = torch.zeros(2, device="meta")
    assert isinstance(prepare([meta, meta]), Objects)


def test_a_batch_of_another_structure_is_not_assembled_with_the_stored_one() -> None:
    samples = [{"x": torch.full((2,), float(i)), "name": f"n{i}"} for i in range(4)]
    store = _store(4)
    _put(store, [0, 1], samples[:2])
    slots = store.slots(torch.tensor([2, 0]))
    assert store.assemble(slots, prepare([(torch.zeros(2), "a")])) is None


def test_per_sample_values_stop_at_the_free_memory_room_with_one_warning() -> None:
    store = _store(100, room=lambda: 3 * 9 + 5)
    samples = [f"sample {i:02d}" for i in range(8)]  # 9 bytes each, kept per sample
    with pytest.warns(CacheFallbackWarning, match="reached the reserve after caching 3 samples"):
        assert _put(store, list(range(8)), samples) == 3
    assert not store.accepting and store.views(store.slots(torch.arange(3))) == samples[:3]


def test_per_sample_values_larger_than_the_first_batchs_stop_at_the_free_memory_room() -> None:
    store = _store(10, room=lambda: 20)  # the free memory left after the first batch: short values
    assert _put(store, [0, 1], ["a", "b"]) == 2
    longer = [f"sample {i:02d}" for i in range(2, 10)]
    with pytest.warns(CacheFallbackWarning, match="reached the reserve after caching 4 samples"):
        assert _put(store, list(range(2, 10)), longer) == 2
    assert not store.accepting and store.views(store.slots(torch.arange(4))) == ["a", "b", *longer[:2]]


def test_a_per_sample_leaf_that_becomes_a_container_is_kept_per_sample() -> None:
    store = _store(4)
    first = [{"x": torch.zeros(2), "meta": "a"}, {"x": torch.ones(2), "meta": "b"}]
    later = [{"x": torch.full((2,), float(i)), "meta": {"w": torch.tensor(i / 2)}} for i in (2, 3)]
    assert _put(store, [0, 1], first) == 2 and _put(store, [2, 3], later) == 2
    assert_same(store.views(store.slots(torch.arange(4))), first + later)


def test_rows_that_cannot_be_allocated_at_all_stop_filling_with_one_warning(monkeypatch) -> None:
    def empty(shape, **options):
        raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB")

    monkeypatch.setattr(torch, "empty", empty)
    store = _store(4)
    with pytest.warns(CacheFallbackWarning, match="out of memory on cpu"):
        assert _put(store, [0, 1], [torch.zeros(2), torch.ones(2)]) == 0
    assert not store.accepting


def test_per_sample_tensors_read_into_a_device_batch_are_moved_to_the_device() -> None:
    """The META device stands in for CUDA: read samples' per-sample tensors go to the device."""
    meta = torch.device("meta")
    # a tensor that requires grad is kept per sample (a column would drop its autograd flag)
    samples = [{"x": torch.full((2,), float(i)), "w": torch.full((3,), float(i), requires_grad=True)} for i in range(4)]
    store = ColumnStore(1 << 20, 4, meta, ledger=BudgetLedger())
    assert store.put(torch.tensor([0, 2]), prepare([samples[0], samples[2]])) == 2
    batch = store.assemble(store.slots(torch.tensor([1, 0, 3])), prepare([samples[1], samples[3]]))
    assert batch["x"].device == meta and batch["x"].shape == (3, 2)
    assert batch["w"].device == meta and batch["w"].shape == (3, 3)
    store.close()


def test_a_worker_stacking_sparse_tensors_raises_torchs_own_error() -> None:
    from gpuload.cache.columns import _stack_as_in_worker

    sparse = torch.eye(2).to_sparse()
    with pytest.raises(RuntimeError, match="Batches of sparse tensors are not currently supported"):
        _stack_as_in_worker([sparse, sparse])
    assert torch.equal(_stack_as_in_worker([torch.ones(2), torch.zeros(2)]), torch.tensor([[1.0, 1], [0, 0]]))


def _two_columns(i: int):
    return torch.arange(3, dtype=torch.float32) + 10 * i + 0.5, i


def _failing_column_write(monkeypatch, error: Exception, at_call: int) -> None:
    """Host columns' writes (one per column and batch) with call ``at_call`` raising ``error``:
    the columns before it in that batch are written, the rest are not."""
    from gpuload.cache.columns import _StoredColumn

    real, calls = _StoredColumn.write, iter(range(1, 1 << 30))

    def write(self, where, source):
        if next(calls) == at_call:
            raise error
        return real(self, where, source)

    monkeypatch.setattr(_StoredColumn, "write", write)


def _assert_serves_the_dataset(store: ColumnStore, samples: list) -> None:
    """Every sample, in a shuffled order, from the store where held and from ``samples`` where not,
    as a loader's batch is built: equal to default_collate of the samples themselves."""
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(0))
    slots = store.slots(order)
    read = [samples[k] for k, slot in zip(order.tolist(), slots.tolist()) if slot < 0]
    batch = store.assemble(slots, prepare(read)) if read else store.gather_rows(slots)
    assert_same(batch, default_collate([samples[k] for k in order.tolist()]))
    held = slots[slots >= 0]
    assert_same(store.views(held), [samples[k] for k in order[slots >= 0].tolist()])


@pytest.mark.parametrize("keys", [[4, 5, 6, 7], [4, 5, 5, 6]], ids=["distinct", "drawn-twice"])
def test_out_of_memory_halfway_through_a_batchs_columns_leaves_no_key_on_unwritten_rows(monkeypatch, keys) -> None:
    """Issue #34, defect 4: the second column's copy runs out of memory after the first was
    written. The batch's keys stay unstored (read from the dataset), the counts stay those of the
    samples held, and filling stops with the one warning."""
    samples = [_two_columns(i) for i in range(12)]
    store = _store(12)
    assert _put(store, [0, 1, 2, 3], samples[:4]) == 4
    held = store.stats.bytes
    _failing_column_write(monkeypatch, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), 2)
    with pytest.warns(CacheFallbackWarning, match="out of memory on cpu after caching 4 samples"):
        assert _put(store, keys, [samples[k] for k in keys]) == 0
    assert store.slots(torch.arange(12)).tolist() == [0, 1, 2, 3] + [-1] * 8
    stats = store.stats
    assert (len(store), stats.entries, stats.bytes, stats.full) == (4, 4, held, True)
    assert not store.accepting
    _assert_serves_the_dataset(store, samples)


@pytest.mark.parametrize("keys", [[4, 5, 6, 7], [4, 5, 5, 6]], ids=["distinct", "drawn-twice"])
def test_another_error_halfway_through_a_batchs_columns_surfaces_and_the_batch_is_stored_again(
        monkeypatch, keys) -> None:
    """Not an out of memory: raised as it is, filling goes on, and the batch put again is stored
    whole (its keys did not stay claimed by rows half written)."""
    samples = [_two_columns(i) for i in range(12)]
    store = _store(12)
    assert _put(store, [0, 1, 2, 3], samples[:4]) == 4
    _failing_column_write(monkeypatch, RuntimeError("a bad copy"), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="a bad copy"):
            _put(store, keys, [samples[k] for k in keys])
    assert store.accepting and len(store) == 4 and store.slots(torch.tensor(keys)).tolist() == [-1] * 4
    assert _put(store, keys, [samples[k] for k in keys]) == len(set(keys))
    _assert_serves_the_dataset(store, samples)


def test_out_of_memory_copying_a_batch_to_device_columns_leaves_its_keys_unstored(monkeypatch) -> None:
    """The device path (META stands in for CUDA): the batch's one copy to the device runs out of
    memory; none of its keys is stored and the bytes are the columns allocated for the first."""
    from gpuload.cache import columns

    real, calls = columns.to_device, iter(range(1, 1 << 30))

    def to_device(tensors, device, staging, keep_layout=False):
        if next(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(tensors, device, staging, keep_layout)

    monkeypatch.setattr(columns, "to_device", to_device)
    samples = [_two_columns(i) for i in range(8)]
    store = ColumnStore(1 << 20, 8, "meta", ledger=BudgetLedger())
    assert store.put(torch.arange(4), prepare(samples[:4])) == 4
    held = store.stats.bytes
    assert held == 8 * (3 * 4 + 8)
    with pytest.warns(CacheFallbackWarning, match="out of memory on meta after caching 4 samples"):
        assert store.put(torch.arange(4, 8), prepare(samples[4:])) == 0
    assert store.slots(torch.arange(8)).tolist() == [0, 1, 2, 3, -1, -1, -1, -1]
    assert (len(store), store.stats.bytes, store.accepting) == (4, held, False)
    store.close()


def _failing_clone(monkeypatch, error: Exception, at_call: int) -> None:
    """``Tensor.clone`` with call ``at_call`` (and every later one) raising ``error``."""
    real, calls = torch.Tensor.clone, iter(range(1, 1 << 30))

    def clone(self, *args, **kwargs):
        if next(calls) >= at_call:
            raise error
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", clone)


def _three_leaves(i: int):
    """Two columns and a leaf kept per sample."""
    return torch.arange(3, dtype=torch.float32) + 10 * i + 0.5, i, f"sample {i}"


def _held_bytes(store: ColumnStore) -> int:
    """What the store really holds: its columns' storage, its per-sample values, its slot map."""
    from gpuload.cache.columns import _columns_of, _objects_of
    from gpuload.cache.sample_store import copy_value

    columns = _columns_of(store._root)
    assert len({column.rows.shape[0] for column in columns}) == 1  # every column shrunk alike
    objects = sum(copy_value(value, torch.device("cpu"))[1]
                  for node in _objects_of(store._root) for value in node.values if value is not None)
    return (sum(column.rows.untyped_storage().nbytes() for column in columns) + objects
            + store._slot_of.numel() * store._slot_of.element_size())


def test_shrink_without_room_for_the_second_columns_copy_stages_the_kept_rows_through_the_host(monkeypatch) -> None:
    """Issue #34, defect 5: the smaller copy of the second column runs out of memory beside the old
    rows. Every column is then shrunk through host memory (none left as it was), the counts
    equal what is held, and every sample is served right."""
    samples = [_three_leaves(i) for i in range(12)]
    store = _store(12)
    assert _put(store, list(range(8)), samples[:8]) == 8
    before = store.stats.bytes
    assert before == _held_bytes(store)
    _failing_clone(monkeypatch, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), 2)
    row = 3 * 4 + 8 + len("sample 0")
    freed = store.shrink(12 * 4 + 5 * row)
    monkeypatch.undo()
    assert len(store) == 5 and store.slots(torch.arange(12)).tolist() == [0, 1, 2, 3, 4] + [-1] * 7
    assert store.stats.bytes == _held_bytes(store) == 12 * 4 + 5 * row and freed == before - store.stats.bytes
    assert store.full and not store.accepting
    _assert_serves_the_dataset(store, samples)


def test_shrink_without_room_for_the_kept_rows_at_all_empties_the_store_with_a_warning(monkeypatch) -> None:
    """META stands in for a full device: no room for the smaller copy, nor for the staged rows'
    way back once the old rows are let go. The store holds nothing and books nothing."""
    ledger = BudgetLedger()
    store = ColumnStore(1 << 20, 8, "meta", ledger=ledger, owner="m")
    assert store.put(torch.arange(6), prepare([_three_leaves(i) for i in range(6)])) == 6
    assert ledger.used("meta") == store.stats.bytes > 0
    out_of_memory = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    _failing_clone(monkeypatch, out_of_memory, 1)
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        target = torch.device(args[0] if args else kwargs["device"])
        if self.device.type == "meta" and target.type == "cpu":  # meta tensors have no bytes to copy out
            return torch.zeros(self.shape, dtype=self.dtype)
        if target.type == "meta":
            raise out_of_memory
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    held = store.stats.bytes
    with pytest.warns(CacheFallbackWarning,
                      match="out of memory while shrinking the sample cache on meta; it is now empty"):
        assert store.shrink(held // 2) == held
    monkeypatch.undo()
    # device store: host map not counted
    assert store.stats.bytes == _held_bytes(store) - store._slot_of.numel() * 4 == 0
    assert len(store) == 0 and ledger.used("meta") == 0 and store.slots(torch.arange(8)).tolist() == [-1] * 8
    store.close()


def test_shrink_raises_another_error_with_every_column_as_it_was(monkeypatch) -> None:
    samples = [_three_leaves(i) for i in range(8)]
    store = _store(8)
    assert _put(store, list(range(8)), samples) == 8
    before = store.stats.bytes
    _failing_clone(monkeypatch, RuntimeError("a bad copy"), 2)
    with pytest.raises(RuntimeError, match="a bad copy"):
        store.shrink(before // 2)
    monkeypatch.undo()
    assert len(store) == 8 and store.stats.bytes == before == _held_bytes(store)
    _assert_serves_the_dataset(store, samples)


def test_shrink_keeps_the_per_sample_device_tensors_it_lets_go_reserved_for_the_streams_that_used_them(
        monkeypatch) -> None:
    """Per-sample tensors let go by a shrink go through the stream guard as the old rows do (on
    CUDA: ``record_stream`` on every stream that read them), not straight back to the allocator."""
    samples = [{"x": torch.full((2,), float(i)), "w": torch.full((3,), float(i), requires_grad=True)} for i in range(6)]
    store = ColumnStore(1 << 20, 6, "meta", ledger=BudgetLedger())
    assert store.put(torch.arange(6), prepare(samples)) == 6
    let_go: list = []
    monkeypatch.setattr(store._streams, "replaced", lambda old: let_go.append(list(old)))
    assert store.shrink(2 * (2 * 4 + 3 * 4)) > 0 and len(store) == 2
    assert [len(old) for old in let_go] == [1, 4]  # the column's old rows, then the 4 per-sample tensors
    assert all(t.device.type == "meta" and t.shape == (3,) for t in let_go[1])
    store.close()


def test_a_views_only_stores_number_columns_stay_on_the_host_through_a_staged_shrink(monkeypatch) -> None:
    samples = [_three_leaves(i) for i in range(6)]
    store = ColumnStore(1 << 20, 6, "meta", ledger=BudgetLedger(), views_only=True)
    assert store.put(torch.arange(6), prepare(samples)) == 6
    _failing_clone(monkeypatch, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), 1)
    real_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *args, **kwargs: torch.zeros(self.shape, dtype=self.dtype)
                        if self.is_meta and torch.device(args[0]).type == "cpu" else real_to(self, *args, **kwargs))
    assert store.shrink(3 * (3 * 4 + 8 + len("sample 0"))) > 0
    monkeypatch.undo()
    views = store.views(store.slots(torch.arange(3)))
    assert [(view[0].device.type, view[0].shape, view[1], view[2]) for view in views] == [
        ("meta", (3,), i, f"sample {i}") for i in range(3)]
    store.close()


def test_out_of_memory_turning_the_second_leaf_per_sample_keeps_the_first_turned_and_counted(monkeypatch) -> None:
    """A batch whose two leaves both stop fitting their columns: the first is turned into
    per-sample storage, the second's turn runs out of memory. The first stays turned (its
    column let go, its values counted), the second stays a column, and every sample is served."""
    from gpuload.cache.columns import _StoredColumn

    stored = [{"x": torch.full((2,), i + 0.5), "y": i} for i in range(4)]
    store = _store(8)
    assert _put(store, [0, 1, 2, 3], stored) == 4
    real, calls = _StoredColumn.views, iter(range(1, 1 << 30))

    def views(self, slots, where):
        if next(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, slots, where)

    monkeypatch.setattr(_StoredColumn, "views", views)
    later = [{"x": torch.full((2,), i, dtype=torch.int64), "y": i / 2} for i in (4, 5)]
    with pytest.warns(CacheFallbackWarning, match="out of memory on cpu after caching 4 samples"):
        assert _put(store, [4, 5], later) == 0
    monkeypatch.undo()
    assert store.stats.bytes == _held_bytes(store)
    assert store.describe().startswith("changed: by column: 1 column(s) [int64[]]")
    assert store.slots(torch.arange(8)).tolist() == [0, 1, 2, 3, -1, -1, -1, -1]
    _assert_serves_the_dataset(store, stored)
