"""One host-to-device path: every per-batch copy of host tensors made inside a batch (the sample
cache's device writes, the transforms' parameter tables, CPU-decoded images, gather indices)
goes through the staging it is handed (``gpuload.transfer.to_device``): the loader's
``Prefetcher.copy_now``, its pinned slots and its side stream; never a ``.to(device)`` from
pageable memory, which waits for everything queued on the stream.

On the CPU two stand-ins prove it: the ``meta`` device (a device that is not the CPU, whose
copies cost nothing) with ``torch.Tensor.to`` watched, for the routing; and a stream-recording
stand-in for CUDA, for what the prefetcher does with the copies it is handed.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from store_cases import columns, planned
from test_prefetch import DeviceTensor, FakeCuda, fake_cuda  # noqa: F401 - the fixture this file extends
from torch.utils.data import TensorDataset, default_collate

import gpuload.prefetch as prefetch
from gpuload import transforms as T
from gpuload.cache import CacheSettings, TieredArrayStore
from gpuload.cache.budget import BudgetLedger
from gpuload.cache.columns import ColumnStore, prepare
from gpuload.decode.batch import BatchDecoder
from gpuload.prefetch import Prefetcher
from gpuload.sources import Indices, Setup, Work
from gpuload.stats import LoaderStats
from gpuload.transfer import Staging, to_device
from gpuload.transforms import batched
from gpuload.transforms.params import sample_params

META = torch.device("meta")
THREAD_LOCAL = ("threading", "local")


class Watch:
    """``torch.Tensor.to`` watched: host tensors moved to another device outside ``staging`` are
    ``bypassed``; the tensors ``staging`` was handed are ``staged``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.staged: list[torch.Tensor] = []
        self.copies = 0
        self.bypassed: list[tuple[int, ...]] = []
        self._inside = False
        self.staging = Staging(self.copy_now)
        original = torch.Tensor.to
        watch = self

        def to(tensor, *args, **kwargs):
            moved = original(tensor, *args, **kwargs)
            if tensor.device.type == "cpu" and moved.device.type != "cpu" and not watch._inside:
                watch.bypassed.append(tuple(tensor.shape))
            return moved

        monkeypatch.setattr(torch.Tensor, "to", to)

    def copy_now(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        self.staged.extend(tensors)
        self.copies += 1
        self._inside = True
        try:
            return [t.to(META) for t in tensors]
        finally:
            self._inside = False


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> Watch:
    return Watch(monkeypatch)


def _samples(n: int) -> list[tuple[torch.Tensor, int]]:
    return [(torch.arange(6, dtype=torch.float32).view(2, 3) + i, i) for i in range(n)]


def test_the_sample_cache_writes_and_merges_device_rows_through_the_staging(watch: Watch) -> None:
    data = _samples(20)
    store = ColumnStore(1 << 20, 20, META, ledger=BudgetLedger(), staging=watch.staging)
    first = torch.tensor([3, 1, 4])
    assert store.put(first, prepare([data[k] for k in first.tolist()])) == 3  # allocates, writes
    again = torch.tensor([5, 9, 5, 2])  # a sample twice: the general write path
    assert store.put(again, prepare([data[k] for k in again.tolist()])) == 3
    batch = store.gather_rows(store.slots(torch.tensor([1, 3, 9])))
    assert [leaf.device for leaf in batch] == [META, META]
    slots = store.slots(torch.tensor([4, 7, 2, 8]))  # two cached, two read now
    merged = store.assemble(slots, prepare([data[7], data[8]]))
    assert merged is not None and merged[0].shape == (4, 2, 3)
    assert watch.bypassed == []
    # one copy per write (its positions and every column's rows), one for a gather's rows, one
    # for a merge (its positions and the rows read now)
    assert watch.copies == 2 + 1 + 1 and len(watch.staged) == 2 * 3 + 1 + 3 + 2
    store.close()


def test_per_sample_leaves_on_a_device_go_in_one_staged_copy_per_batch(watch: Watch) -> None:
    """Leaves kept per sample (variable-length tensors) reach the device in one copy per batch."""
    data = [(torch.arange(i % 3 + 1), i) for i in range(12)]
    store = ColumnStore(1 << 20, 12, META, ledger=BudgetLedger(), staging=watch.staging)
    assert store.put(torch.tensor([0, 1, 2]), prepare([data[0], data[1], data[2]])) == 3
    assert watch.bypassed == [] and [t.shape for t in watch.staged[:3]] == [(1,), (2,), (3,)]
    store.close()


def test_a_tiered_array_gather_moves_its_row_indices_through_the_staging(watch: Watch) -> None:
    """Rows on the device tier gathered by indices drawn on the host: the indices are staged, once
    per tier (not once per column), and so is the order that puts the rows back."""
    data = columns()
    store = TieredArrayStore(list(data), planned(data, [("device", 10), ("host", 10)]), "meta", ledger=BudgetLedger(),
                             staging=watch.staging)
    watch.bypassed.clear()  # placing the device tier: a one-off copy when the store is made, not per batch
    request = store.request(torch.tensor([7, 2, 15, 4]))
    staged = len(watch.staged)
    assert staged == 1  # the device tier's rows, for its three columns
    host_rows = [torch.empty(shape, dtype=dtype, device=META) for shape, dtype in request.staged_shapes]
    leaves = request.assemble(request.on_device, host_rows)
    assert [leaf.shape[0] for leaf in leaves] == [4, 4, 4] and len(watch.staged) == staged + 1  # the order back
    assert watch.bypassed == []
    store.close()


@pytest.mark.parametrize("ops", [
    [T.RandomCrop(6, padding=3), T.RandomHorizontalFlip()],  # windows of one uniform batch
    [T.RandomResizedCrop(8), T.RandomHorizontalFlip()],  # a resize per window, mirrored
    [T.Resize((16, 18)), T.RandomCrop(12, padding=3, fill=7), T.RandomHorizontalFlip()],  # a gather with fill
], ids=["windows", "resized", "gather"])
@pytest.mark.parametrize("as_list", [False, True], ids=["tensor", "list"])
def test_the_batched_transforms_stage_their_per_batch_tables(watch: Watch, ops, as_list: bool) -> None:
    """The batched torch ops build their index tables and masks on the host (from the counter
    RNG's parameters); every one reaches the device through the staging."""
    n = 6
    params = sample_params(ops, 3, 1, torch.arange(n), [(12, 14)] * n)
    images = torch.empty((n, 3, 12, 14), dtype=torch.uint8, device=META)
    out = batched.run(params, list(images) if as_list else images, staging=watch.staging)
    assert out is not None and out.device == META
    assert watch.bypassed == []
    resized_one_by_one = isinstance(ops[0], T.RandomResizedCrop)  # windows sliced one by one: no table
    assert bool(watch.staged) != resized_one_by_one


def test_cpu_decoded_images_reach_the_device_in_one_staged_copy_keeping_their_layout(watch: Watch) -> None:
    decoder = BatchDecoder(device="cpu", staging=watch.staging)
    decoder.device = META  # decoded on the CPU, bound for a device
    hwc = [torch.zeros(5, 7, 3, dtype=torch.uint8).permute(2, 0, 1),
           torch.zeros(4, 6, 3, dtype=torch.uint8).permute(2, 0, 1)]
    moved = decoder._to_device([0, 2, 3], [hwc[0], ValueError("broken file"), hwc[1]])
    assert sorted(moved) == [0, 3] and all(t.device == META for t in moved.values())
    assert [t.stride() for t in moved.values()] == [t.stride() for t in hwc]  # still channels-last
    assert watch.bypassed == [] and len(watch.staged) == 2


def test_without_a_staging_a_device_copy_still_goes_in_one_packed_copy(monkeypatch) -> None:
    """Outside a loader (a transform called by hand): one copy of one packed buffer."""
    watch = Watch(monkeypatch)
    moved = to_device([torch.arange(3), torch.ones(2, 2, dtype=torch.bool).t()], META, None)
    assert watch.bypassed == [(48,)]  # one buffer: 24 bytes and 4 bytes, each aligned to 16
    assert [t.shape for t in moved] == [(3,), (2, 2)]


def test_on_the_cpu_nothing_is_staged(watch: Watch) -> None:
    tensors = [torch.arange(3), torch.zeros(2, 2)]
    assert all(got is want for got, want in zip(to_device(tensors, torch.device("cpu"), watch.staging), tensors))
    store = ColumnStore(1 << 20, 10, ledger=BudgetLedger(), staging=watch.staging)
    data = _samples(10)
    store.put(torch.tensor([1, 2]), prepare([data[1], data[2]]))
    assert torch.equal(store.gather_rows(store.slots(torch.tensor([2, 1])))[0], default_collate([data[2], data[1]])[0])
    assert watch.staged == [] and watch.bypassed == []


# ---------------------------------------------------------------------- CUDA, stood in for


@pytest.fixture
def staged_cuda(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """test_prefetch's stand-in for CUDA, which also logs where buffers are allocated (a host
    buffer asked to be pinned, a device buffer: plain host tensors here) and host waits."""
    cuda = request.getfixturevalue("fake_cuda")
    empty, event = torch.empty, cuda.Event

    def fake_empty(*shape, pin_memory: bool = False, device=None, **kwargs):
        on_device = device is not None and torch.device(device).type == "cuda"
        if pin_memory or on_device:
            cuda.append("alloc", "pinned" if pin_memory else "device", cuda.current_stream())
        made = empty(*shape, **kwargs)
        return made.as_subclass(DeviceTensor) if on_device else made

    class Event(event):
        def synchronize(self) -> None:
            cuda.append("host waits", self)

    monkeypatch.setattr(prefetch.torch, "empty", fake_empty)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    return cuda


def test_a_source_running_ahead_copies_through_the_prefetchers_slots_on_its_side_stream(staged_cuda) -> None:
    """A batch made in the prefetcher's thread that puts host tensors on the device itself (a
    sample cache write, a transform's table): the copy is staged in a pinned slot and made on
    the side stream, whose own later work is ordered after it; none counts as batch bytes."""
    cuda = staged_cuda
    seen: list[tuple] = []

    def source():
        for i in range(3):
            (table,) = to_device([torch.full((4,), i)], torch.device("cuda", 0), prefetcher.staging)
            seen.append((threading.current_thread().name, type(table).__name__, int(table[0])))
            yield table * 2

    prefetcher = Prefetcher(source(), "cuda", depth=2)
    with cuda.stream(cuda.default):
        out = [batch for batch in prefetcher]
    assert [int(batch[0]) for batch in out] == [0, 2, 4]
    assert seen == [("gpuload-prefetch", "DeviceTensor", i) for i in range(3)]
    allocations = [entry for entry in cuda.log if entry[0] == "alloc"]
    assert {kind for _, kind, _ in allocations} == {"pinned", "device"}
    assert all(stream is cuda.side for _, _, stream in allocations)  # every copy on the side stream
    assert not any(entry[0] == "host waits" for entry in cuda.log)  # no host sync inside a batch
    assert prefetcher.stats.bytes_copied == 0  # parameters and indices are not batch bytes
    prefetcher.close()


def test_a_batch_made_in_the_loops_thread_copies_through_copy_now(staged_cuda) -> None:
    """``prefetch_depth=0``: the loader's work runs in the loop's thread, copying through its
    staging (``Prefetcher.staging``): the copy is made on the side stream without waiting for the
    loop's queued work (the step before: the copy reads only its pinned slot, so it overlaps
    the step), and the loop's stream waits for the copy's own event (no host sync) before it
    gets the batch, and protects the memory."""
    cuda = staged_cuda
    loop = FakeCuda.Stream(cuda, "loop")
    prefetcher = Prefetcher(None, "cuda", depth=2)

    def make(i: int):
        return to_device([torch.full((4,), i)], torch.device("cuda", 0), prefetcher.staging)[0]

    work = Work((make(i) for i in range(2)), lambda item: (make(100 + int(item[0])), 1))
    with cuda.stream(loop):
        made = [work.finish(item) for item in work.items]  # items and finish both staged
    assert [int(batch[0]) for batch, _ in made] == [100, 101]
    log = cuda.log
    assert not any(entry[0] == "wait_stream" for entry in log)  # the side stream is not held behind the loop's
    copies = [k for k, entry in enumerate(log) if entry == ("alloc", "device", cuda.side)]
    waits = [k for k, entry in enumerate(log) if entry[:2] == ("wait", loop)]
    assert len(copies) == len(waits) == 4  # two items, two finishes: each copy waited for by the loop's stream
    for copy, wait in zip(copies, waits):  # copy, its event on the side stream, the loop waits for that event
        assert copy < cuda.find("record", log[wait][2], cuda.side) < wait
    assert [entry[2] for entry in log if entry[0] == "protect"] == [loop] * 4
    assert not any(entry[0] == "host waits" for entry in log)
    assert prefetcher.stats.bytes_copied == 0


def test_on_a_cpu_device_an_epoch_has_no_staging() -> None:
    import gpuload

    loader = gpuload.DataLoader(torch.utils.data.TensorDataset(torch.arange(8)), batch_size=4, device="cpu")
    assert iter(loader).epoch.staging is None  # a CPU device's epoch copies nothing
    loader.close()


# ---------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_sample_cache_on_the_device_fills_and_merges_through_the_staging_with_torchs_values() -> None:
    data = _samples(40)
    prefetcher = Prefetcher(None, "cuda", depth=2)
    store = ColumnStore(1 << 20, 40, "cuda", ledger=BudgetLedger(), staging=prefetcher.staging)
    store.put(torch.arange(0, 40, 2), prepare([data[k] for k in range(0, 40, 2)]))
    index = torch.tensor([6, 3, 0, 7, 38])
    merged = store.assemble(store.slots(index), prepare([data[3], data[7]]))
    gathered = store.gather_rows(store.slots(torch.tensor([38, 0])))
    expected = default_collate([data[k] for k in index.tolist()])
    assert all(got.is_cuda for got in merged)
    assert all(torch.equal(got.cpu(), want) for got, want in zip(merged, expected))
    assert all(torch.equal(got.cpu(), want) for got, want in zip(gathered, default_collate([data[38], data[0]])))
    store.close()
    prefetcher.close()


@pytest.mark.gpu
def test_gpu_batched_transforms_inside_a_prefetchers_thread_equal_the_cpu_path() -> None:
    """Images of several sizes, padded crops with a fill and flips: every table and mask staged
    through the prefetcher's slots on its side stream; the pixels are the CPU path's."""
    ops = [T.RandomCrop(12, padding=3, fill=7), T.RandomHorizontalFlip()]
    g = torch.Generator().manual_seed(4)
    images = [torch.randint(0, 256, (3, 14 + k % 3, 15 + k % 4), dtype=torch.uint8, generator=g) for k in range(8)]
    expected = T.apply_transforms(ops, images, 5, 2, torch.arange(8), device="cpu", backend="batched")

    def source():
        yield T.apply_transforms(ops, images, 5, 2, torch.arange(8), device="cuda", backend="batched",
                                 staging=prefetcher.staging)

    prefetcher = Prefetcher(source(), "cuda", depth=2, stage=False)
    (out,) = list(prefetcher)
    assert out.is_cuda and torch.equal(out.cpu(), expected)
    assert prefetcher.stats.bytes_copied == 0  # tables and images: not counted as batch bytes
    prefetcher.close()


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [0, None], ids=["loop_thread", "ahead"])
def test_gpu_a_loader_with_transforms_gives_the_cpu_loaders_batches(depth) -> None:
    """Array batches transformed in the loop's thread (``finish``), their tables through
    ``copy_now``: the same batches as the same loader on the CPU."""
    import gpuload

    dataset = torch.utils.data.TensorDataset(torch.randint(0, 256, (64, 3, 20, 20), dtype=torch.uint8),
                                             torch.arange(64))
    ops = [T.RandomCrop(16, padding=2, fill=3), T.RandomHorizontalFlip()]  # uint8 out: exact on any backend

    def epochs(device: str) -> list:
        loader = gpuload.DataLoader(dataset, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(2),
                                    device=device, prefetch_depth=depth if device == "cuda" else None, transforms=ops)
        batches = [[t.cpu() for t in batch] for _ in range(2) for batch in loader]
        loader.close()
        return batches

    ours, cpu = epochs("cuda"), epochs("cpu")
    assert len(ours) == len(cpu) == 8
    assert all(torch.equal(a, b) for got, want in zip(ours, cpu) for a, b in zip(got, want))


def test_images_read_from_the_disk_tier_reach_the_device_through_the_staging(watch: Watch) -> None:
    from gpuload.sources.image_decoding import _DiskImagesTier

    class Disk:
        def present(self, positions: list[int]) -> list[bool]:
            return [True] * len(positions)

        def read(self, positions: list[int]) -> list[torch.Tensor]:
            return [torch.zeros(5, 7, 3, dtype=torch.uint8).permute(2, 0, 1) for _ in positions]  # HWC in memory

    tier = _DiskImagesTier(Disk(), META, watch.staging)
    found, missing = tier.lookup(torch.tensor([4, 11]))  # the chain asks for what memory lacks
    assert found is not None and found[0] is None and not missing.numel()
    got = found[1].images
    assert len(got) == 2 and all(t.device == META for t in got)
    assert all(t.stride() == (1, 21, 3) for t in got)  # still channels-last
    assert watch.bypassed == [] and len(watch.staged) == 2


def test_a_slot_is_refilled_only_after_its_previous_copy_is_done(staged_cuda) -> None:
    """Host batches staged through two pinned slots: before a slot takes its next batch, the
    host waits for the event recorded after that slot's previous copy (batch k waits for batch
    k - 2's), and batches that find a fresh slot wait for nothing."""
    cuda = staged_cuda
    prefetcher = Prefetcher([torch.full((4,), i) for i in range(5)], "cuda", depth=2)
    with cuda.stream(cuda.default):
        assert [int(batch[0]) for batch in prefetcher] == [0, 1, 2, 3, 4]
    log = cuda.log
    copies = [k for k, entry in enumerate(log) if entry[:2] == ("alloc", "device")]  # one per batch
    waits = [k for k, entry in enumerate(log) if entry[0] == "host waits"]
    assert len(copies) == 5 and len(waits) == 3

    def slot_event(batch: int):  # recorded on the side stream right after the batch's copy
        return next(entry[1] for entry in log[copies[batch]:] if entry[0] == "record")

    for batch, wait in zip([2, 3, 4], waits):
        assert copies[batch - 1] < wait < copies[batch]
        assert log[wait][1] is slot_event(batch - 2)
    prefetcher.close()


# ---------------------------------------------------------------------- one staging, handed on


class _Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.arange(3, dtype=torch.float32) + index, index


def _setup(dataset: Any, staging: Staging, tmp_path: Path, transforms: list | None = None) -> Setup:
    """A source's setup bound for META, whose loader's staging is ``staging``."""
    settings = CacheSettings.resolve(environ={}, cwd=tmp_path)
    return Setup(dataset=dataset, map_style=True, device=META, settings=settings, batched=True, batch_size=4,
                 collate_fn=default_collate, stats=LoaderStats(), owner="staged", transforms=transforms,
                 staging=staging)


@pytest.mark.parametrize("ops", [None, [T.RandomCrop(6, padding=1), T.RandomHorizontalFlip()]],
                         ids=["gathered", "transformed"])
def test_every_copy_an_array_epoch_makes_goes_through_the_staging_its_source_was_handed(
    watch: Watch, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ops: list | None,
) -> None:
    """In-memory arrays on the device (META stands in), an epoch made in the loop's thread: each
    batch's gather indices, and the transforms' windows and flip tables, reach the device
    through the staging of the source's setup (the loader's), none by another route."""
    from gpuload.device import MemoryInfo
    from gpuload.sources import arrays, placed_arrays

    monkeypatch.setattr(placed_arrays, "device_memory", lambda device: MemoryInfo(free=1 << 32, total=1 << 33))
    images = torch.randint(0, 256, (16, 3, 8, 8), dtype=torch.uint8)
    source = arrays.detect(_setup(TensorDataset(images, torch.arange(16)), watch.staging, tmp_path, ops))
    assert source is not None
    source.begin_epoch()
    watch.bypassed.clear()  # placing the arrays on the device: once, when the store is made, not per batch
    batches = [torch.tensor([5, 1, 9, 2]), torch.arange(4)]
    work = source.schedule(Indices(0, lambda: iter(batches))).start(False)
    for item in work.items:
        before = watch.copies
        made = work.finish(item)
        assert made is not None and [leaf.device for leaf in made[0]] == [META, META]
        assert watch.copies >= before + (3 if ops else 1)  # the indices; with ops, base and flip tables too
    assert watch.bypassed == []
    source.close()


def test_every_copy_a_sample_cache_on_the_device_makes_goes_through_the_staging_it_was_handed(
    watch: Watch, tmp_path: Path,
) -> None:
    """The sample cache's device tier (META stands in), filling, serving and merging cached rows
    with samples read now: every write, gather index and merged row goes through the staging
    of the source's setup (the loader's)."""
    from gpuload.cache import CacheDecision
    from gpuload.sources.sample_cache import CachedSamples

    decision = CacheDecision("device", "samples", 1 << 20, "test")
    cached = CachedSamples(_setup(_Samples(), watch.staging, tmp_path), decision)
    assert cached.store.staging is watch.staging
    for keys in ([0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3], [8, 1, 9, 4]):  # filled, filled, served, merged
        before = watch.copies
        batch = cached.batch(torch.tensor(keys), in_range=True)
        assert [leaf.device for leaf in batch] == [META, META] and watch.copies > before
    assert cached.store.stats.hits == 4 + 2 and watch.bypassed == []
    cached.close()


def test_a_loader_hands_its_one_staging_to_its_source_and_to_each_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader's copy route (``DataLoader._staging``: its prefetcher's, None on a CPU device)
    is the one its source's setup carries and each epoch holds."""
    import gpuload
    from gpuload.loader import DataLoader

    route = Staging(lambda tensors: tensors)
    monkeypatch.setattr(DataLoader, "_staging", lambda self: route)
    loader = gpuload.DataLoader(TensorDataset(torch.arange(8)), batch_size=4, device="cpu")
    assert loader._source.setup.staging is route
    first = iter(loader)
    assert first.epoch.staging is route and iter(loader).epoch.staging is route
    loader.close()


def test_every_copy_in_gpuload_names_its_staging_and_no_thread_holds_one() -> None:
    """A reader of any ``to_device``/``move_staged`` call sees the staging it copies through: an
    argument that is not a literal None (the route outside a loader is chosen by the caller that
    holds None, never found); and no module keeps a copy route in a thread-local."""
    import ast

    import gpuload

    root = Path(gpuload.__file__).parent
    calls, unnamed, thread_locals = 0, [], []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        assert "staging_through" not in text and "_in_force" not in text, path
        for node in ast.walk(ast.parse(text)):
            local = isinstance(node, ast.Attribute) and (getattr(node.value, "id", None), node.attr) == THREAD_LOCAL
            if local:
                thread_locals.append(path.relative_to(root).as_posix())
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name not in ("to_device", "move_staged"):
                continue
            calls += 1
            staging = node.args[2] if len(node.args) > 2 else next(
                (keyword.value for keyword in node.keywords if keyword.arg == "staging"), None)
            if staging is None or (isinstance(staging, ast.Constant) and staging.value is None):
                unnamed.append(f"{path.relative_to(root).as_posix()}:{node.lineno}")
    assert calls >= 30  # every call site was seen: the transforms, caches, sources, decoder, exchange
    assert unnamed == []
    assert thread_locals == ["timeline.py"]  # the timeline's stage clock, which copies nothing


@pytest.mark.gpu
def test_gpu_an_epoch_holds_the_staging_its_source_copies_through() -> None:
    import gpuload

    loader = gpuload.DataLoader(TensorDataset(torch.arange(8)), batch_size=4, device="cuda")
    epoch = iter(loader).epoch
    assert epoch.staging is not None and epoch.staging is loader._source.setup.staging
    loader.close()
