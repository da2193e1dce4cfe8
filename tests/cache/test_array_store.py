"""TieredArrayStore: gathers across device / host / source equal a plain index_select."""

from __future__ import annotations

import gc
import threading
import warnings
import weakref

import numpy as np
import pytest
import torch

import gpuload.cache.array_store as array_store
from gpuload.cache import CacheFallbackWarning, TieredArrayStore
from gpuload.cache.budget import BudgetLedger
from gpuload.cache.plan import make_plan
from gpuload.cache.tiers import TIERS, DeviceTier, HostTier
from gpuload.prefetch import Prefetcher
from gpuload.sources.placed_arrays import staged_copier

GiB = 2**30
N = 1000
gpu = pytest.mark.gpu


def arrays(n: int = N) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "image": torch.randint(0, 256, (n, 3, 4, 4), dtype=torch.uint8, generator=g),
        "label": torch.arange(n, dtype=torch.int64),
    }


def bytes_per_sample(data) -> int:
    columns = data.values() if isinstance(data, dict) else data
    return sum(t[0].numel() * t.element_size() for t in columns)


def forced_plan(data, device_samples: int, host_samples: int, mode: str = "auto"):
    """A plan for a pretended card whose budget holds exactly ``device_samples``."""
    bps = bytes_per_sample(data)
    n = next(iter(data.values() if isinstance(data, dict) else data)).shape[0]
    host_reserve = 0
    plan = make_plan(
        bps, n, device_free=80 * GiB, host_free=host_samples * bps, budget=device_samples * bps,
        reserve=0, mode=mode, host_reserve=host_reserve,
    )
    assert plan.device_samples == device_samples and plan.host_samples == min(host_samples, n - device_samples)
    return plan


def copy_to(device):
    """A stand-in for the loader's staging: the request's host rows gathered, then moved."""

    def copy(request):
        views = [torch.empty(shape, dtype=dtype) for shape, dtype in request.staged_shapes]
        request.fill_staged(views)
        return [view.to(device) for view in views]

    return copy


def staged_by_a_prefetcher(device):
    """The loader's own copier: the request's host rows gathered into a prefetcher's pinned
    slot and copied on its side stream."""
    prefetcher = Prefetcher(None, device)
    return staged_copier(prefetcher.copy_now)


def expected(data, index: torch.Tensor):
    return {k: v.index_select(0, index) for k, v in data.items()}


@pytest.mark.parametrize("device_samples, host_samples", [(N, 0), (300, 400), (300, 0), (0, 500), (0, 0), (0, N)])
def test_gather_equals_index_select_across_tiers(device_samples, host_samples):
    data = arrays()
    store = TieredArrayStore(data, forced_plan(data, device_samples, host_samples), "cpu", ledger=BudgetLedger())
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        index = torch.randint(0, N, (64,), generator=g)
        batch = store.gather(index)
        assert set(batch) == {"image", "label"}
        for key, value in expected(data, index).items():
            assert torch.equal(batch[key], value) and batch[key].dtype == value.dtype
    stats = store.stats
    assert stats.device_hits + stats.host_hits + stats.source_hits == 5 * 64
    assert stats.device_samples == device_samples
    assert stats.host_samples == min(host_samples, N - device_samples)
    assert stats.h2d_bytes == 0  # the target is the CPU: nothing crosses PCIe


def test_batch_spanning_all_three_tiers_counts_each():
    data = arrays()
    store = TieredArrayStore(data, forced_plan(data, 100, 200), "cpu", ledger=BudgetLedger())
    index = torch.tensor([999, 0, 150, 99, 100, 299, 300, 5, -1])
    batch = store.gather(index)
    assert torch.equal(batch["label"], torch.tensor([999, 0, 150, 99, 100, 299, 300, 5, 999]))
    assert torch.equal(batch["image"], data["image"][index.remainder(N)])
    stats = store.stats
    assert (stats.device_hits, stats.host_hits, stats.source_hits) == (3, 3, 3)
    # the device tier on the CPU is a view of the source; the host tier is a separate copy
    assert store.tier("device").columns[0].data_ptr() == data["image"].data_ptr()
    assert store.tier("host").columns[0].data_ptr() != data["image"][100].data_ptr()


def test_tuple_and_single_tensor_structures():
    images = torch.arange(N * 6, dtype=torch.uint8).reshape(N, 2, 3)
    labels = torch.arange(N)
    data = (images, labels)
    store = TieredArrayStore(data, forced_plan(data, 10, 20), "cpu", ledger=BudgetLedger())
    index = torch.tensor([5, 15, 25, 35])
    out = store.gather(index)
    assert isinstance(out, tuple) and torch.equal(out[0], images.index_select(0, index))
    single = TieredArrayStore(images, forced_plan((images,), 10, 0), "cpu", ledger=BudgetLedger())
    assert torch.equal(single.gather([3, 700]), images[[3, 700]])


def test_empty_and_out_of_range_indices():
    data = arrays()
    store = TieredArrayStore(data, forced_plan(data, 10, 10), "cpu", ledger=BudgetLedger())
    assert store.gather(torch.tensor([], dtype=torch.long))["image"].shape == (0, 3, 4, 4)
    with pytest.raises(IndexError, match="1000 is out of bounds"):
        store.gather(torch.tensor([1, 1000]))
    with pytest.raises(IndexError, match="-1001"):
        store.gather(torch.tensor([-1001]))


def test_plan_must_match_data():
    data = arrays()
    other = arrays(10)
    with pytest.raises(ValueError, match="make the plan from this data"):
        TieredArrayStore(data, forced_plan(other, 5, 0), "cpu")
    with pytest.raises(ValueError, match="first dimension"):
        TieredArrayStore({"a": torch.zeros(3), "b": torch.zeros(4)}, forced_plan(other, 5, 0), "cpu")
    with pytest.raises(TypeError, match="torch.from_numpy"):
        TieredArrayStore({"a": np.zeros(3)}, forced_plan(other, 5, 0), "cpu")


def test_shrink_keeps_results():
    data = arrays()
    store = TieredArrayStore(data, forced_plan(data, 600, 200), "cpu", ledger=BudgetLedger())
    bps = bytes_per_sample(data)
    store.shrink(250 * bps + 7)
    assert store.stats.device_samples == 250
    assert store.stats.source_samples == N - 250 - 200
    index = torch.randperm(N)[:300]
    assert torch.equal(store.gather(index)["image"], data["image"].index_select(0, index))
    assert store.shrink(10**12) == 0  # growing is not shrinking
    store.shrink(0)
    assert store.stats.device_samples == 0
    assert torch.equal(store.gather(index)["label"], index)


def test_close_releases_memory_and_ledger():
    ledger = BudgetLedger()
    data = arrays()
    store = TieredArrayStore(data, forced_plan(data, 100, 300), "cpu", ledger=ledger, owner="train")
    host_copy = weakref.ref(store.tier("host").columns[0])
    ledger.reserve(123, "train", device="cuda:0")  # as if its device tier were booked
    store.close()
    gc.collect()
    assert host_copy() is None
    assert ledger.owners("cuda:0") == {}
    assert store.closed and store.stats.device_samples == store.stats.host_samples == 0
    store.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        store.gather(torch.tensor([0]))


def test_a_store_closed_by_another_thread_during_a_request_says_so(monkeypatch):
    data = arrays()
    store = TieredArrayStore(data, forced_plan(data, 100, 300), "cpu", ledger=BudgetLedger(), owner="train")
    checked = store._check

    def closed_after_the_check(indices):
        flat = checked(indices)
        store.close()  # as another thread closing it between the check and the gather
        return flat

    monkeypatch.setattr(store, "_check", closed_after_the_check)
    with pytest.raises(RuntimeError, match="closed while a batch was gathered"):
        store.request(torch.tensor([0, 150]))


def test_host_oom_falls_back_to_source_with_one_warning(monkeypatch):
    def fail(cls, *args):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")

    monkeypatch.setattr(HostTier, "allocate", classmethod(fail))
    data = arrays()
    with pytest.warns(CacheFallbackWarning, match="keeping 500 samples") as caught:
        store = TieredArrayStore(data, forced_plan(data, 0, 500), "cpu", ledger=BudgetLedger())
    assert len(caught) == 1
    assert store.stats.host_samples == 0 and store.stats.fallbacks == 1
    index = torch.arange(0, N, 7)
    assert torch.equal(store.gather(index)["image"], data["image"].index_select(0, index))


def test_other_errors_are_not_swallowed(monkeypatch):
    monkeypatch.setattr(HostTier, "allocate", classmethod(lambda cls, *a: (_ for _ in ()).throw(RuntimeError("boom"))))
    data = arrays()
    with pytest.raises(RuntimeError, match="boom"):
        TieredArrayStore(data, forced_plan(data, 0, 500), "cpu", ledger=BudgetLedger())


@gpu
def test_cuda_device_tier_gather_and_ledger():
    ledger = BudgetLedger()
    data = arrays()
    store = TieredArrayStore(data, forced_plan(data, 300, 400), "cuda", ledger=ledger, owner="t")
    bps = bytes_per_sample(data)
    assert ledger.owners("cuda:0") == {"t": 300 * bps} and ledger.used("cuda:0") == 300 * bps
    index = torch.randperm(N)[:256]
    copy = staged_by_a_prefetcher("cuda")
    batch = store.gather(index, copy=copy)
    assert batch["image"].device.type == "cuda"
    assert torch.equal(batch["image"].cpu(), data["image"].index_select(0, index))
    stats = store.stats
    assert stats.h2d_bytes == (stats.host_hits + stats.source_hits) * bps
    assert not store.tier("host").columns[0].is_pinned()  # pageable: only the staging slots are pinned
    freed = store.shrink(100 * bps)
    assert freed == 200 * bps and ledger.owners("cuda:0") == {"t": 100 * bps}
    assert torch.equal(store.gather(index, copy=copy)["label"].cpu(), index)
    store.close()
    assert ledger.owners("cuda:0") == {}


@gpu
def test_cuda_device_oom_falls_back_to_host_with_one_warning(monkeypatch):
    ledger = BudgetLedger()
    data = arrays()
    plan = forced_plan(data, 300, N)
    restore = _oom_on("cuda", monkeypatch)
    with pytest.warns(CacheFallbackWarning, match="out of memory placing 300 samples") as caught:
        store = TieredArrayStore(data, plan, "cuda", ledger=ledger)
    restore()
    assert len(caught) == 1
    assert store.stats.device_samples == 0 and store.stats.host_samples == N
    assert ledger.owners("cuda:0") == {}
    index = torch.randperm(N)[:64]
    batch = store.gather(index, copy=staged_by_a_prefetcher("cuda"))
    assert torch.equal(batch["image"].cpu(), data["image"].index_select(0, index))
    store.close()


def test_no_warning_when_everything_fits():
    data = arrays()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TieredArrayStore(data, forced_plan(data, 500, 500), "cpu", ledger=BudgetLedger()).close()


def _oom_on(device_type: str, monkeypatch):
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, torch.device) and target.type == device_type and self.dim() > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    return lambda: monkeypatch.setattr(torch.Tensor, "to", real_to)


@pytest.mark.parametrize("mode, host_after", [("auto", N), ("device", 0)])
def test_device_oom_fallback_logic_on_meta_device(monkeypatch, mode, host_after):
    """The copy-to-device path without a GPU: 'meta' tensors have shapes but no memory."""
    ledger = BudgetLedger()
    data = arrays()
    plan = forced_plan(data, 300, N if mode == "auto" else 0, mode=mode)
    restore = _oom_on("meta", monkeypatch)
    with pytest.warns(CacheFallbackWarning, match="out of memory placing 300 samples") as caught:
        store = TieredArrayStore(data, plan, "meta", ledger=ledger, owner="m")
    restore()
    assert len(caught) == 1
    assert store.stats.device_samples == 0 and store.stats.host_samples == host_after
    assert ledger.owners("meta") == {}
    batch = store.gather(torch.arange(0, N, 10), copy=copy_to("meta"))
    assert batch["image"].device.type == "meta" and batch["image"].shape == (100, 3, 4, 4)
    assert store.stats.h2d_bytes == 100 * bytes_per_sample(data)


def test_meta_device_tier_books_ledger_and_shrinks():
    ledger = BudgetLedger()
    data = arrays()
    bps = bytes_per_sample(data)
    store = TieredArrayStore(data, forced_plan(data, 300, 200), "meta", ledger=ledger, owner="m")
    assert ledger.owners("meta") == {"m": 300 * bps} and ledger.used("meta") == 300 * bps
    assert store.stats.fill_bytes == 300 * bps
    store.gather(torch.tensor([0, 1, 400, 900]), copy=copy_to("meta"))
    assert store.stats.h2d_bytes == 2 * bps  # one host-tier row, one source row
    assert store.shrink(120 * bps) == 180 * bps
    assert ledger.owners("meta") == {"m": 120 * bps}
    assert store.gather(torch.arange(N), copy=copy_to("meta"))["label"].shape == (N,)
    store.close()
    assert ledger.owners("meta") == {}


@gpu
def test_cuda_host_rows_copied_on_the_side_stream_arrive_in_order():
    data = arrays()
    store = TieredArrayStore(data, forced_plan(data, N // 3, N // 3), "cuda", ledger=BudgetLedger())
    copy = staged_by_a_prefetcher("cuda")
    for _ in range(5):
        torch.cuda._sleep(50_000_000)  # keep the loop's stream busy while the copies run beside it
        index = torch.randperm(N)[:200]
        batch = store.gather(index, copy=copy)
        expected = data["image"].index_select(0, index)
        assert torch.equal(batch["image"].cpu(), expected)
    store.close()


def test_a_host_tier_maker_may_hold_other_rows_than_asked():
    """A node's shared tier starts at the smallest device tier of its ranks: the store serves from
    it only the rows past its own device tier, and calls the maker (and its release) once."""
    data = arrays()
    calls = []

    def maker(source, first, rows, budget):
        calls.append((first, rows, budget))
        return array_store.HostTier(100, [column[100:600].clone() for column in source], shared_by=3,
                                    release=lambda: calls.append("released"))

    store = TieredArrayStore(data, forced_plan(data, 300, 400), "cpu", ledger=BudgetLedger(), host_tier=maker)
    assert calls == [(300, 400, 400 * bytes_per_sample(data))]
    stats = store.stats
    assert (stats.device_samples, stats.host_samples, stats.source_samples) == (300, 300, 400)
    assert stats.host_shared_ranks == 3
    index = torch.tensor([0, 99, 100, 299, 300, 599, 600, 999])
    batch = store.gather(index)
    for key, value in expected(data, index).items():
        assert torch.equal(batch[key], value)
    assert (store.stats.device_hits, store.stats.host_hits, store.stats.source_hits) == (4, 2, 2)
    store.close()
    store.close()
    assert calls[1:] == ["released"]


def test_the_default_host_tier_is_the_stores_own_copy():
    data = arrays()
    store = TieredArrayStore(data, forced_plan(data, 0, 500), "cpu", ledger=BudgetLedger())
    assert store.stats.host_shared_ranks == 1
    assert TieredArrayStore(data, forced_plan(data, N, 0), "cpu", ledger=BudgetLedger()).stats.host_shared_ranks == 0


def _no_room_for_a_second_copy_on_meta(monkeypatch):
    """clone() of a meta tensor fails as a full device does; cpu() of one gives host rows of its
    shape (meta tensors have no bytes to copy out)."""
    real_clone, real_cpu = torch.Tensor.clone, torch.Tensor.cpu

    def clone(self, *args, **kwargs):
        if self.device.type == "meta":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return real_clone(self, *args, **kwargs)

    def cpu(self, *args, **kwargs):
        if self.device.type == "meta":
            return torch.zeros(self.shape, dtype=self.dtype)
        return real_cpu(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", clone)
    monkeypatch.setattr(torch.Tensor, "cpu", cpu)


def test_shrinking_without_room_for_both_copies_stages_the_kept_rows_on_the_host(monkeypatch):
    ledger = BudgetLedger()
    data = arrays()
    bps = bytes_per_sample(data)
    store = TieredArrayStore(data, forced_plan(data, 300, 200), "meta", ledger=ledger, owner="m")
    _no_room_for_a_second_copy_on_meta(monkeypatch)
    assert store.shrink(120 * bps) == 180 * bps
    assert ledger.owners("meta") == {"m": 120 * bps} and store.stats.device_samples == 120
    monkeypatch.undo()  # the batch's own allocation (a cat of meta rows clones) is not the shrink's second copy
    assert store.gather(torch.arange(N), copy=copy_to("meta"))["label"].shape == (N,)
    _no_room_for_a_second_copy_on_meta(monkeypatch)
    _oom_on("meta", monkeypatch)  # and no room for the smaller copy either
    with pytest.warns(CacheFallbackWarning,
                      match="out of memory while shrinking the device tier on meta; it is now empty"):
        assert store.shrink(50 * bps) == 120 * bps
    assert ledger.owners("meta") == {"m": 0}
    assert store.stats.device_samples == 0
    store.close()


def test_rows_a_shrink_staged_on_the_host_are_served_from_the_device_again(monkeypatch):
    """A shrink with no room for both copies empties the device tier, then copies the kept rows
    back: a batch gathers them there again (the index maps once stayed on the source: those rows
    crossed from host memory every batch while the stats said 120 were on the device)."""
    data = arrays()
    bps = bytes_per_sample(data)
    store = TieredArrayStore(data, forced_plan(data, 300, 200), "meta", ledger=BudgetLedger(), owner="m")
    _no_room_for_a_second_copy_on_meta(monkeypatch)
    assert store.shrink(120 * bps) == 180 * bps
    monkeypatch.undo()
    request = store.request(torch.arange(N))
    assert [leaf.shape[0] for leaf in request.on_device] == [120, 120]  # gathered on the device
    assert request.staged_shapes[0][0][0] == N - 120
    stats = store.stats
    assert (stats.device_samples, stats.device_hits, stats.host_hits, stats.source_hits) == (120, 120, 200, 680)
    assert stats.h2d_bytes == (N - 120) * bps
    store.close()


def test_a_shrink_between_a_gathers_maps_and_its_rows_leaves_the_gather_on_the_rows_its_maps_name():
    """A deterministic interleaving of the prefetch thread and the loop: the thread's gather
    has read the index maps (300 device rows) and waits inside the device tier while the loop
    shrinks the tier to 100 rows. Its slots (up to 250) must index the rows they were read
    with, not the 100 left: on CUDA that is an out-of-bounds device assert, or wrong rows."""
    entered, proceed = threading.Event(), threading.Event()
    reads: list[int] = []  # rows of the storage each column's gather read

    class GatedDeviceTier(DeviceTier):
        def gather(self, column, slots, out=None):
            if not proceed.is_set():
                entered.set()
                assert proceed.wait(30)
            reads.append(self.rows)
            return super().gather(column, slots, out)

    data = arrays()
    bps = bytes_per_sample(data)
    store = TieredArrayStore(data, forced_plan(data, 300, 0), "meta", ledger=BudgetLedger(), owner="m",
                             tiers={**TIERS, "device": GatedDeviceTier})
    index = torch.tensor([250, 3, 120, 299])  # all on the device tier
    gathered: list = []
    thread = threading.Thread(target=lambda: gathered.append(store.gather(index, copy=copy_to("meta"))))
    thread.start()
    try:
        assert entered.wait(30)
        assert store.shrink(100 * bps) == 200 * bps
    finally:
        proceed.set()
        thread.join(30)
    assert not thread.is_alive() and len(gathered) == 1
    assert reads == [300, 300]  # both columns from the rows the maps were read with
    assert gathered[0]["image"].shape == (4, 3, 4, 4)
    assert store.stats.device_samples == 100  # later batches see the shrunk tier
    store.gather(index, copy=copy_to("meta"))
    assert reads[2:] == [100, 100]  # row 3 is still on the device tier, gathered from its 100 rows
    store.close()


def test_other_errors_while_shrinking_are_not_swallowed(monkeypatch):
    data = arrays()
    store = TieredArrayStore(data, forced_plan(data, 300, 200), "meta", ledger=BudgetLedger(), owner="m")
    monkeypatch.setattr(torch.Tensor, "clone", lambda self, *a, **k: (_ for _ in ()).throw(RuntimeError("bad clone")))
    with pytest.raises(RuntimeError, match="bad clone"):
        store.shrink(0 + bytes_per_sample(data))
    monkeypatch.undo()
    _no_room_for_a_second_copy_on_meta(monkeypatch)  # staged on the host; copying them back fails otherwise
    real_to = torch.Tensor.to

    def bad_copy(self, *args, **kwargs):
        if args and isinstance(args[0], torch.device) and args[0].type == "meta":
            raise RuntimeError("bad copy")
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", bad_copy)
    with pytest.raises(RuntimeError, match="bad copy"):
        store.shrink(100 * bytes_per_sample(data))
    monkeypatch.undo()
    store.close()
    assert store.shrink(0) == 0  # closed: nothing to give back


def test_arrays_need_one_row_per_sample():
    with pytest.raises(ValueError, match=r"every array needs one row per sample .* got shape \(\)"):
        TieredArrayStore({"a": torch.tensor(3.0)}, forced_plan(arrays(), 5, 0), "cpu")


def test_a_store_says_how_many_samples_it_serves_and_whether_rows_cross_to_the_device():
    data = arrays()
    on_host = TieredArrayStore(data, forced_plan(data, 10, 10), "cpu", ledger=BudgetLedger())
    on_meta = TieredArrayStore(data, forced_plan(data, 10, 10), "meta", ledger=BudgetLedger(), owner="m")
    assert on_host.num_samples == on_meta.num_samples == N
    assert not on_host.copies and on_meta.copies
    on_host.close()
    on_meta.close()
