"""gpuload.prefetch: order, structure, errors, cleanup, depth, data safety; overlap on GPU."""

from __future__ import annotations

import collections
import contextlib
import gc
import sys
import threading
import time
import warnings

import pytest
import torch
from threads import next_in_thread, snapshot, wait_threads

from gpuload.prefetch import (
    EpochStoppedError,
    Fill,
    Prefetcher,
    PrefetchError,
    PrefetchStats,
    TensorSpec,
    default_depth,
)

Pair = collections.namedtuple("Pair", ["image", "label"])


def batches(n: int, size: int = 4) -> list[torch.Tensor]:
    return [torch.full((size, 3), i, dtype=torch.int64) for i in range(n)]


class RecordingSource:
    """Yields batch i on the i-th pull and records how many pulls have started."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pulled = 0

    def __iter__(self):
        for i in range(self.n):
            self.pulled += 1
            yield torch.full((2,), i)


# ---------------------------------------------------------------------- order and structure


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_order_and_values_preserved(depth):
    source = batches(23)
    out = list(Prefetcher(source, "cpu", depth=depth))
    assert len(out) == 23
    for got, want in zip(out, source):
        assert torch.equal(got, want)


def test_batches_is_the_first_argument_and_source_its_former_keyword_still_taken():
    data = batches(3)
    for prefetcher in (Prefetcher(batches=data, device="cpu"), Prefetcher(source=data, device="cpu")):
        assert prefetcher.batches is data
        assert [got.tolist() for got in prefetcher] == [want.tolist() for want in data]
    with pytest.raises(TypeError, match="batches or source="):
        Prefetcher(data, "cpu", source=data)


def test_nested_structures_dtypes_and_non_tensor_leaves_pass_through():
    image = torch.randint(0, 255, (2, 3, 4, 5), dtype=torch.uint8)
    batch = {
        "pair": Pair(image, torch.tensor([1, 2])),
        "list": [torch.tensor([True, False]), torch.tensor(3.5, dtype=torch.float16)],
        "tuple": (torch.empty(0, 7), "name", None, 7),
        "strided": torch.arange(12.0).view(3, 4).t(),
        "bf16": torch.randn(3, dtype=torch.bfloat16),
    }
    (got,) = list(Prefetcher([batch], "cpu"))
    assert isinstance(got["pair"], Pair) and isinstance(got["list"], list)
    assert isinstance(got["tuple"], tuple) and got["tuple"][1:] == ("name", None, 7)
    assert got["pair"].image.dtype == torch.uint8  # stored dtype, never widened
    for key in ("strided", "bf16"):
        assert torch.equal(got[key], batch[key]) and got[key].dtype == batch[key].dtype
    assert torch.equal(got["pair"].image, image)
    assert torch.equal(got["pair"].label, batch["pair"].label)
    assert torch.equal(got["list"][0], batch["list"][0]) and got["list"][1].shape == ()
    assert got["list"][1].item() == 3.5 and got["tuple"][0].shape == (0, 7)
    assert got["strided"].is_contiguous()


def test_stats_count_batches_and_bytes():
    stats = PrefetchStats()
    source = [(torch.zeros(10, dtype=torch.uint8), torch.zeros(3, dtype=torch.float32))] * 5
    list(Prefetcher(source, "cpu", depth=2, stats=stats))
    assert stats.batches == 5
    assert stats.bytes_copied == 5 * (10 + 12)
    assert stats.copy_time_s > 0 and stats.wait_time_s > 0


# ---------------------------------------------------------------------- errors


def failing_source(fail_at: int, exc: BaseException):
    for i in range(10):
        if i == fail_at:
            raise exc
        yield torch.tensor([i])


def test_source_exception_reraised_after_earlier_batches_with_batch_index():
    original = ValueError("bad sample")
    it = iter(Prefetcher(failing_source(3, original), "cpu", depth=2))
    assert [next(it).item() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match=r"batch 3 .*source.*bad sample") as info:
        next(it)
    assert info.value.__cause__ is original
    assert info.value.batch_index == 3 and info.value.stage == "source"
    with pytest.raises(StopIteration):
        next(it)


def test_sample_index_carried_by_the_exception_is_reported():
    original = KeyError("missing")
    original.sample_index = 41
    with pytest.raises(KeyError, match=r"batch 0 \(sample 41\)") as info:
        list(Prefetcher(failing_source(0, original), "cpu"))
    assert info.value.sample_index == 41 and info.value.__cause__ is original


def test_exception_that_cannot_be_recreated_becomes_prefetch_error():
    original = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    with pytest.raises(PrefetchError, match="batch 2") as info:
        list(Prefetcher(failing_source(2, original), "cpu"))
    assert info.value.__cause__ is original


def test_an_exception_recreated_with_other_arguments_becomes_prefetch_error():
    class Coded(Exception):
        def __init__(self, message: str) -> None:
            super().__init__(404, message)  # its args are not the message alone

    original = Coded("not found")
    with pytest.raises(PrefetchError, match=r"batch 1 failed .*Coded") as info:
        list(Prefetcher(failing_source(1, original), "cpu"))
    assert info.value.__cause__ is original and info.value.batch_index == 1


def test_the_file_an_exception_names_is_reported():
    original = FileNotFoundError(2, "No such file or directory", "/data/train/00042.jpg")
    with pytest.raises(FileNotFoundError, match=r"batch 2 \(file /data/train/00042.jpg\)") as info:
        list(Prefetcher(failing_source(2, original), "cpu"))
    assert info.value.__cause__ is original


class ClosingSource:
    """Yields ``n`` batches; its ``close()`` (called by the prefetcher's thread at the end)
    raises ``error``."""

    def __init__(self, n: int, error: BaseException) -> None:
        self.batches = iter(batches(n))
        self.error = error

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        return next(self.batches)

    def close(self) -> None:
        raise self.error


def test_a_source_whose_cleanup_fails_reports_it_after_its_batches():
    original = OSError("cannot close the shard")
    it = iter(Prefetcher(ClosingSource(3, original), "cpu", depth=2))
    assert [int(next(it)[0, 0]) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(OSError, match=r"batch 3 failed in the prefetcher's source stage.*cannot close") as info:
        next(it)
    assert info.value.__cause__ is original and info.value.stage == "source"


def test_a_failed_cleanup_does_not_hide_the_sources_own_error():
    class FailingThenClosing(ClosingSource):
        def __next__(self) -> torch.Tensor:
            raise ValueError("bad record")

    with pytest.raises(ValueError, match="bad record"):
        list(Prefetcher(FailingThenClosing(0, OSError("cannot close")), "cpu"))


def test_fill_exception_reported_as_fill_stage():
    def fill(slot):
        raise RuntimeError("gather failed")

    source = [Fill(TensorSpec((2,), torch.float32), lambda s: s.fill_(1))] * 2
    source.append(Fill(TensorSpec((2,), torch.float32), fill))
    with pytest.raises(RuntimeError, match=r"batch 2 .*fill.*gather failed") as info:
        list(Prefetcher(source, "cpu"))
    assert info.value.stage == "fill"


def test_error_in_iter_source_raises_in_caller():
    class Broken:
        def __iter__(self):
            raise OSError("cannot open")

    with pytest.raises(OSError, match="cannot open"):
        iter(Prefetcher(Broken(), "cpu"))


def test_timeout_names_the_batch_and_stops_the_thread():
    baseline = snapshot()

    def slow():
        yield torch.zeros(1)
        time.sleep(0.6)
        yield torch.zeros(1)

    it = iter(Prefetcher(slow(), "cpu", timeout=0.2, join_timeout=2.0))
    next(it)
    with pytest.raises(TimeoutError, match="batch 1"):
        next(it)
    assert not wait_threads(baseline)


def test_invalid_arguments_name_the_value():
    with pytest.raises(ValueError, match="depth=0"):
        Prefetcher([], "cpu", depth=0)
    with pytest.raises(ValueError, match="timeout=-1"):
        Prefetcher([], "cpu", timeout=-1)
    with pytest.raises(TypeError, match="epoch"):
        iter(Prefetcher(None, "cpu"))


# ---------------------------------------------------------------------- cleanup and leaks


def test_early_break_closes_the_generator_and_the_thread():
    baseline = snapshot()
    closed = threading.Event()

    def endless():
        try:
            i = 0
            while True:
                yield torch.tensor([i])
                i += 1
        finally:
            closed.set()

    prefetcher = Prefetcher(endless(), "cpu", depth=3)
    for batch in prefetcher:
        if batch.item() == 4:
            break
    assert closed.wait(5) and not wait_threads(baseline)


def test_dropping_a_started_iterator_stops_its_thread():
    baseline = snapshot()
    prefetcher = Prefetcher(batches(100), "cpu", depth=2)
    it = iter(prefetcher)
    next(it)
    time.sleep(0.05)  # the producer fills the queue and blocks on the depth bound
    del it
    gc.collect()
    assert not wait_threads(baseline)


def test_close_and_context_manager_stop_a_running_epoch():
    baseline = snapshot()
    with Prefetcher(batches(100), "cpu") as prefetcher:
        it = iter(prefetcher)
        next(it)
    assert not wait_threads(baseline)
    with pytest.raises(RuntimeError, match=r"Prefetcher.close\(\)"):
        next(it)  # closing stopped it; say so rather than end silently
    assert [b[0, 0].item() for b in prefetcher] == list(range(100))  # usable again


def test_hundreds_of_epochs_leave_no_threads_and_reuse_the_slots():
    baseline = snapshot()
    stats = PrefetchStats()
    # The last batch is smaller: it must fit the slot it finds, not allocate another.
    source = batches(5, size=8) + [torch.zeros(3, 3, dtype=torch.int64)]
    prefetcher = Prefetcher(source, "cpu", depth=3, stats=stats)
    for epoch in range(300):
        got = list(prefetcher)
        assert len(got) == 6
        if epoch % 3 == 0:
            for _batch in prefetcher:
                break  # early exits too
    assert stats.slot_allocations == 3
    assert not wait_threads(baseline)


def test_a_bigger_batch_grows_only_its_slot():
    stats = PrefetchStats()
    source = [torch.zeros(4), torch.zeros(4), torch.zeros(4000), torch.zeros(4)]
    list(Prefetcher(source, "cpu", depth=2, stats=stats))
    assert stats.slot_allocations == 3


def test_new_epoch_supersedes_the_previous_iterator():
    prefetcher = Prefetcher(batches(10), "cpu")
    first = iter(prefetcher)
    next(first)
    second = iter(prefetcher)
    with pytest.raises(RuntimeError, match="newer epoch"):
        next(first)
    assert len(list(second)) == 10


class CancellableSource:
    """Yields batch 0, then waits (as a collective exchange waits for its peers) until the
    prefetcher cancels it, and ends."""

    def __init__(self) -> None:
        self.waiting = threading.Event()
        self.cancelled = threading.Event()
        self.pulled = 0

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        self.pulled += 1
        if self.pulled == 1:
            return torch.zeros(2)
        self.waiting.set()
        self.cancelled.wait(5)
        raise StopIteration

    def cancel(self) -> None:
        self.cancelled.set()


def test_a_consumer_waiting_in_another_thread_when_a_new_epoch_starts_is_told_so():
    """The loop's thread waits for batch 1 of a source that is waiting too; another thread
    starts a new epoch, which cancels the source and ends the old epoch's thread. The waiting
    consumer gets EpochStoppedError naming the newer epoch, not the end of its epoch."""
    baseline = snapshot()
    source = CancellableSource()
    prefetcher = Prefetcher(source, "cpu", depth=1)
    it = iter(prefetcher)
    next(it)
    consumer, raised = next_in_thread(it)
    assert source.waiting.wait(5)
    assert len(list(prefetcher.epoch(batches(2)))) == 2
    consumer.join(5)
    assert len(raised) == 1 and isinstance(raised[0], EpochStoppedError), raised
    assert "batch 1" in str(raised[0]) and "newer epoch" in str(raised[0])
    assert not wait_threads(baseline)


def test_dropping_an_iterator_whose_thread_will_not_stop_raises_nothing(monkeypatch):
    """With warnings as errors, the warning that the thread did not stop cannot be shown from
    ``__del__``: dropping the iterator still raises nothing (no unraisable exception)."""
    unraisable: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    inside, release = threading.Event(), threading.Event()

    def stuck():
        yield torch.zeros(1)
        inside.set()
        release.wait(5)
        yield torch.zeros(1)

    prefetcher = Prefetcher(stuck(), "cpu", depth=1, join_timeout=0.05)
    it = iter(prefetcher)
    next(it)
    thread = it.thread
    assert inside.wait(5)  # the thread is inside its source: it cannot stop now
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match="did not stop"):
            it.close()  # what __del__ meets
        del it
        gc.collect()
    release.set()
    thread.join(5)
    assert unraisable == [] and not thread.is_alive()


def test_consumer_stopping_while_producer_waits_does_not_hang():
    baseline = snapshot()

    def endless():
        while True:
            yield torch.zeros(1000)

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "the prefetch thread did not stop within 60 s"
        for _ in range(20):
            it = iter(Prefetcher(endless(), "cpu", depth=1, join_timeout=60))
            next(it)
            it.close()
    assert not wait_threads(baseline)


# ---------------------------------------------------------------------- depth


@pytest.mark.parametrize("depth", [1, 3])
def test_producer_is_never_more_than_depth_ahead(depth):
    source = RecordingSource(30)
    ahead = []
    for consumed, batch in enumerate(Prefetcher(source, "cpu", depth=depth), start=1):
        assert batch[0].item() == consumed - 1
        time.sleep(0.005)  # a slow step: the producer runs as far ahead as it may
        ahead.append(source.pulled - consumed)
    assert max(ahead) <= depth
    assert max(ahead) == depth  # and it really does run ahead


# ---------------------------------------------------------------------- data safety


def test_batches_held_and_modified_in_place_stay_intact():
    source = batches(12)
    held = []
    for batch in Prefetcher(source, "cpu", depth=2):
        batch.mul_(-1)  # the loop owns its batch: must not touch the next ones
        held.append(batch)
    for i, batch in enumerate(held):
        assert torch.equal(batch, -source[i])
    assert torch.equal(source[3], torch.full((4, 3), 3))  # the source is never written
    pointers = {batch.data_ptr() for batch in held}
    assert len(pointers) == len(held)  # fresh memory each batch, never the slot's


def test_fill_writes_straight_into_the_slot():
    cache = torch.arange(100, dtype=torch.uint8).view(50, 2)
    seen = []

    def gather(indices):
        def fill(slot):
            seen.append(slot["x"].data_ptr())
            torch.index_select(cache, 0, indices, out=slot["x"])

        return Fill({"x": TensorSpec((len(indices), 2), torch.uint8), "idx": indices}, fill)

    plans = [torch.tensor([3, 1, 4]), torch.tensor([1, 5, 9]), torch.tensor([2, 6, 5])] * 3
    plans.append(torch.tensor([7]))
    stats = PrefetchStats()
    out = list(Prefetcher((gather(i) for i in plans), "cpu", depth=2, stats=stats))
    for got, indices in zip(out, plans):
        assert torch.equal(got["x"], cache[indices]) and torch.equal(got["idx"], indices)
        assert got["x"].dtype == torch.uint8
    assert stats.slot_allocations == 2 and len(set(seen)) == 2  # two slots, reused


# ---------------------------------------------------------------------- default depth


def test_default_depth_follows_batch_size_and_host_limit():
    gib = 2**30
    assert default_depth(1 << 20, host_limit_bytes=gib) == 4
    assert default_depth(32 << 20, host_limit_bytes=gib) == 3
    assert default_depth(256 << 20, host_limit_bytes=gib) == 2
    assert default_depth(400 << 20, host_limit_bytes=gib) == 2
    assert default_depth(600 << 20, host_limit_bytes=gib) == 1  # one slot, never zero
    assert default_depth(0, host_limit_bytes=0) == 4
    assert 1 <= default_depth(1 << 20) <= 4
    with pytest.raises(ValueError, match="batch_bytes=-1"):
        default_depth(-1)
    with pytest.raises(ValueError, match="max_depth=0"):
        default_depth(1 << 20, host_limit_bytes=gib, max_depth=0)
    with pytest.raises(ValueError, match="host_limit_bytes=-1"):
        default_depth(1 << 20, host_limit_bytes=-1)


def test_a_tensor_spec_of_negative_size_is_refused():
    assert TensorSpec([2, 3.0], torch.float16).shape == (2, 3)
    with pytest.raises(ValueError, match=r"shape \(2, -1\) has a negative size"):
        TensorSpec((2, -1), torch.float32)


# ---------------------------------------------------------------------- CUDA ordering, faked


class FakeCuda:
    """The CUDA calls the prefetcher makes, recorded in one log; current streams are per thread
    (as in torch), so the log shows which stream each piece of work was queued on."""

    class Stream:
        def __init__(self, cuda: FakeCuda, name: str) -> None:
            self.cuda, self.name = cuda, name

        def wait_event(self, event) -> None:
            self.cuda.append("wait", self, event)

        def wait_stream(self, stream) -> None:
            self.cuda.append("wait_stream", self, stream)

        def __repr__(self) -> str:
            return f"<stream {self.name}>"

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self._lock = threading.Lock()
        self._current = threading.local()
        self.default = FakeCuda.Stream(self, "default")
        self.side = FakeCuda.Stream(self, "side")
        cuda = self

        class Event:
            def record(self, stream) -> None:
                cuda.append("record", self, stream)

        self.Event = Event

    def append(self, *entry) -> int:
        with self._lock:
            self.log.append(entry)
            return len(self.log) - 1

    def current_stream(self, device=None):
        return getattr(self._current, "stream", self.default)

    @contextlib.contextmanager
    def stream(self, stream):
        previous = self.current_stream()
        self._current.stream = stream
        try:
            yield
        finally:
            self._current.stream = previous

    def find(self, *entry) -> int:
        return next(i for i, logged in enumerate(self.log) if logged[: len(entry)] == entry)


class DeviceTensor(torch.Tensor):
    """A CPU tensor that the prefetcher takes for a tensor on cuda:0 (its record_stream logs)."""

    cuda: FakeCuda

    @property
    def is_cuda(self) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)

    def record_stream(self, stream) -> None:
        self.cuda.append("protect", int(self[0]), stream)


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCuda:
    import gpuload.prefetch as prefetch

    cuda = FakeCuda()
    monkeypatch.setattr(prefetch, "resolve_device", lambda device: torch.device("cuda", 0))
    monkeypatch.setattr(prefetch, "new_side_stream", lambda device: cuda.side)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "stream", cuda.stream)
    monkeypatch.setattr(torch.cuda, "current_stream", cuda.current_stream)
    monkeypatch.setattr(torch.cuda, "Event", cuda.Event)
    monkeypatch.setattr(DeviceTensor, "cuda", cuda, raising=False)
    return cuda


@pytest.mark.parametrize("stage", [True, False], ids=["staged", "pass_through"])
def test_device_batches_are_ordered_and_protected_on_the_consumers_stream(fake_cuda, stage):
    """Batches whose tensors the source made on the device (no host bytes staged): each is
    produced on the side stream, an event is recorded after it there, and the consumer's current
    stream waits for that event and records every device tensor before the batch is returned."""
    cuda = fake_cuda

    def source():
        for i in range(5):
            cuda.append("produce", i, cuda.current_stream())
            x = torch.full((3,), i).as_subclass(DeviceTensor)
            yield {"x": x, "pair": (x[1:], "label")}

    consumer = FakeCuda.Stream(cuda, "loop")
    with cuda.stream(consumer):
        for i, batch in enumerate(Prefetcher(source(), "cuda", depth=2, stage=stage)):
            # what the loop queued before the epoch (e.g. a cache fill) precedes the source's work
            assert cuda.find("wait_stream", cuda.side, consumer) < cuda.find("produce", 0)
            returned = len(cuda.log)
            produced = cuda.find("produce", i)
            assert cuda.log[produced][2] is cuda.side  # the source ran on the side stream
            record = next(k for k in range(produced, len(cuda.log)) if cuda.log[k][0] == "record")
            event = cuda.log[record][1]
            assert cuda.log[record][2] is cuda.side
            assert record < cuda.find("wait", consumer, event) < returned
            protected = [k for k, entry in enumerate(cuda.log) if entry == ("protect", i, consumer)]
            assert len(protected) == 2 and all(k < returned for k in protected)  # x and its view
            assert int(batch["x"][0]) == i and batch["pair"][1] == "label"
    assert not any(entry[0] == "wait" and entry[1] is not consumer for entry in cuda.log)


def test_the_copies_side_stream_is_exposed(fake_cuda):
    assert Prefetcher(None, "cuda").stream is fake_cuda.side


def test_no_side_stream_on_the_cpu():
    assert Prefetcher(None, "cpu").stream is None


def test_a_thread_that_cannot_select_the_device_tells_the_consumer(fake_cuda, monkeypatch):
    """The thread selects the device before anything else; when that fails the consumer gets
    the error (stage "copy", batch 0) instead of waiting forever."""

    def no_device(device) -> None:
        raise RuntimeError("CUDA error: all CUDA-capable devices are busy or unavailable")

    monkeypatch.setattr(torch.cuda, "set_device", no_device)
    with pytest.raises(RuntimeError, match=r"batch 0 failed in the prefetcher's copy stage.*busy") as info:
        next(iter(Prefetcher(batches(3), "cuda", depth=2)))
    assert info.value.stage == "copy" and info.value.batch_index == 0


# ---------------------------------------------------------------------- GPU


def _cuda_sleep_cycles(seconds: float) -> int:
    probe = 50_000_000
    torch.cuda.synchronize()
    started = time.perf_counter()
    torch.cuda._sleep(probe)
    torch.cuda.synchronize()
    return int(probe / (time.perf_counter() - started) * seconds)


@pytest.mark.gpu
def test_gpu_batches_arrive_on_the_device_in_their_dtype_from_pinned_slots():
    device = torch.device("cuda", torch.cuda.current_device())
    source = [Pair(torch.randint(0, 255, (8, 3, 16, 16), dtype=torch.uint8), torch.arange(8))] * 4
    seen_pinned = []

    def fill(slot):
        seen_pinned.append(slot.is_pinned())
        slot.fill_(7)

    prefetcher = Prefetcher(source + [Fill(TensorSpec((3,), torch.int32), fill)], device)
    out = list(prefetcher)
    for got, want in zip(out[:4], source):
        assert got.image.device == device and got.image.dtype == torch.uint8
        assert torch.equal(got.image.cpu(), want.image) and torch.equal(got.label.cpu(), want.label)
    assert seen_pinned == [True] and out[4].tolist() == [7, 7, 7]
    assert prefetcher.stream is not None


@pytest.mark.gpu
def test_gpu_copy_of_next_batch_overlaps_consumer_work():
    device = torch.device("cuda", torch.cuda.current_device())
    nbytes = 64 << 20
    n = 12

    def source():
        for _ in range(n):
            yield Fill(TensorSpec((nbytes,), torch.uint8), lambda slot: None)

    def run(step_cycles: int | None) -> float:
        prefetcher = Prefetcher(source(), device, depth=2)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _batch in prefetcher:
            if step_cycles:
                torch.cuda._sleep(step_cycles)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    run(None)  # warm up: slots, allocator
    copy_only = run(None)
    cycles = _cuda_sleep_cycles(copy_only / n)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(n):
        torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    compute_only = time.perf_counter() - started
    both = run(cycles)
    # Serial would be copy_only + compute_only; overlapped is close to the larger of the two.
    assert both < 0.8 * (copy_only + compute_only), (copy_only, compute_only, both)


@pytest.mark.gpu
def test_gpu_batches_kept_and_modified_across_steps_stay_intact_on_any_stream():
    device = torch.device("cuda", torch.cuda.current_device())
    source = [torch.full((1 << 20,), i, dtype=torch.int32) for i in range(16)]
    cycles = _cuda_sleep_cycles(0.002)
    consumer = torch.cuda.Stream(device)
    held = []
    with torch.cuda.stream(consumer):
        for batch in Prefetcher(source, device, depth=2):
            torch.cuda._sleep(cycles)  # slow step: later copies race ahead of this stream
            batch.add_(1000)
            held.append(batch)
            if len(held) > 3:
                held.pop(0)  # freed while later work is queued: record_stream keeps it safe
                torch.cuda.empty_cache()
        consumer.synchronize()
    assert [int(b[0]) for b in held] == [1012, 1013, 1014, 1015]
    assert all(bool((b == b[0]).all()) for b in held)


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [True, False], ids=["staged", "pass_through"])
def test_gpu_batches_made_on_the_device_in_the_thread_are_ordered_and_protected(stage):
    """A source that makes its batches on the GPU (slow work queued first): a loop on its own
    stream reads each batch only after it is written, and memory it freed while its reads were
    still queued is not handed to the next batches early (record_stream)."""
    device = torch.device("cuda", torch.cuda.current_device())
    slow = _cuda_sleep_cycles(0.01)
    n, size = 8, 1 << 20

    def source():
        for i in range(n):
            torch.cuda._sleep(slow)  # the batch's device work is still queued when it is yielded
            x = torch.full((size,), i, dtype=torch.int32, device=device)
            yield {"x": x, "host": torch.full((2,), i)} if stage else {"x": x}

    consumer = torch.cuda.Stream(device)
    copies = []
    with torch.cuda.stream(consumer):
        for batch in Prefetcher(source(), device, depth=2, stage=stage):
            torch.cuda._sleep(slow)  # the loop's stream is busy before it reads the batch
            copies.append(batch["x"].clone())
            del batch  # freed while the clone is queued: the producer must not reuse it yet
        consumer.synchronize()
    assert [int(c[0]) for c in copies] == list(range(n))
    assert all(bool((c == i).all()) for i, c in enumerate(copies))


def test_copy_now_raises_a_fills_own_error_as_it_was_raised() -> None:
    """A batch copied in the loop's thread (``copy_now``): the Fill callback's exception reaches
    the caller as it was raised, not wrapped in the prefetcher's internals."""
    from gpuload.prefetch import Fill, Prefetcher, TensorSpec

    def broken(slot):
        raise IndexError("index 99 is out of bounds for dimension 0 with size 4")

    prefetcher = Prefetcher(None, "cpu")
    with pytest.raises(IndexError, match="index 99"):
        prefetcher.copy_now(Fill([TensorSpec((2,), torch.int64)], broken))
    batch = prefetcher.copy_now(Fill([TensorSpec((3,), torch.int64)], lambda slot: slot[0].copy_(torch.arange(3))))
    assert torch.equal(batch[0], torch.arange(3)) and prefetcher.stats.bytes_copied == 24
