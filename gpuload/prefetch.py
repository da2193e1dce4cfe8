"""Delivery to the device: a ring of pinned host slots, one side stream, an event per slot.

A :class:`Prefetcher` pulls host batches from a source in a background thread, packs the
tensors of each batch into one reusable host slot (pinned when the device is CUDA), and copies
the slot to the device with one non-blocking copy on the prefetcher's own side stream. The
source itself runs on that side stream too, so device tensors it makes (e.g. a collate of
cached device rows) are ordered like the copies. Each batch carries an event recorded after
all of its work; the training loop's current stream waits for it and records every device
tensor of the batch (``record_stream``), so the loop gets tensors that are ready and protected
on its stream, while the next batches are already being assembled and copied. Tensors keep
their stored dtype (uint8 crosses PCIe as uint8) and come out contiguous.

Two ways to put a batch into a slot:

- yield a host batch (the usual case, e.g. torch's collated batches): every CPU tensor is
  copied once into the slot;
- yield a :class:`Fill`: a layout of :class:`TensorSpec` leaves and a callback that writes the
  batch straight into the slot's tensors (e.g. ``torch.index_select(cache, 0, idx, out=slot)``),
  so a host cache gather lands in pinned memory with no intermediate copy.

Without CUDA the same ring, threads and hand-offs run on plain host slots, and each batch is
delivered as a fresh copy of its slot, so CPU tests exercise the same control flow.
"""

from __future__ import annotations

import contextlib
import functools
import math
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gpuload.cache.budget import format_bytes
from gpuload.device import host_memory, new_side_stream, resolve_device
from gpuload.epoch import Epoch, EpochStoppedError, one_epoch_at_a_time
from gpuload.exit_threads import start_stoppable
from gpuload.timeline import begin_batch, end_batch, hand_over, stage
from gpuload.transfer import Staging, map_leaves

__all__ = [
    "Prefetcher",
    "PrefetchStats",
    "PrefetchError",
    "EpochStoppedError",
    "TensorSpec",
    "Fill",
    "default_depth",
    "check_ring_fits",
]

_ALIGN = 256  # bytes between packed leaves: every dtype's view stays aligned, DMA-friendly
_POLL_S = 0.1  # how often blocked threads look at the stop token
_INLINE_SLOTS = 8  # copy_now's slots: a batch may stage several small tables (transforms, cache writes)
_MiB = 2**20


@dataclass
class PrefetchStats:
    """Running totals of one prefetcher, over all its epochs.

    ``bytes_copied``: bytes staged into slots and copied to the device; ``copy_time_s``: time the
    background thread spent staging batches and issuing their copies (host time; the DMA itself
    runs asynchronously); ``wait_time_s``: time the consuming loop spent inside ``next()``;
    ``slot_allocations``: host slot (re)allocations, ``depth`` of them in a steady state.
    """

    batches: int = 0
    bytes_copied: int = 0
    copy_time_s: float = 0.0
    wait_time_s: float = 0.0
    slot_allocations: int = 0


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a tensor that a :class:`Fill` callback writes into a slot."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        if any(n < 0 for n in self.shape):
            raise ValueError(f"TensorSpec shape {self.shape} has a negative size")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Fill:
    """A batch assembled straight into a host slot.

    ``layout`` is the batch's structure with :class:`TensorSpec` leaves where tensors will be
    (other leaves, including host tensors, are treated as in a normal batch). ``fill`` is called
    in the prefetcher's thread with the same structure, each spec replaced by a host tensor of
    that shape and dtype living in the slot (pinned on CUDA); it writes the data in place, from
    host memory: the copy that follows waits for no stream but the side stream.
    """

    layout: Any
    fill: Callable[[Any], object]


class PrefetchError(RuntimeError):
    """A failure in the prefetcher's thread whose exception type could not be re-created."""


def default_depth(
    batch_bytes: int, host_limit_bytes: int | None = None, max_depth: int = 4
) -> int:
    """Slots in the ring for batches of ``batch_bytes`` bytes.

    Small batches get more slots (4 up to 8 MiB, 3 up to 64 MiB, else 2): their per-batch costs
    (Python collation, thread hand-offs) jitter, and extra slack hides that cheaply; large
    batches need only double buffering, one slot copying while the next is filled. The ring is
    capped at ``host_limit_bytes`` of host memory (default: 1/16 of the RAM available now),
    but never fewer than one slot.
    """
    if not isinstance(batch_bytes, int) or batch_bytes < 0:
        raise ValueError(f"batch_bytes={batch_bytes!r} must be a non-negative int (bytes)")
    if max_depth < 1:
        raise ValueError(f"max_depth={max_depth!r} must be at least 1")
    if host_limit_bytes is None:
        host_limit_bytes = host_memory().free // 16
    if host_limit_bytes < 0:
        raise ValueError(f"host_limit_bytes={host_limit_bytes!r} must be non-negative")
    wanted = 4 if batch_bytes <= 8 * _MiB else 3 if batch_bytes <= 64 * _MiB else 2
    fits = host_limit_bytes // batch_bytes if batch_bytes else wanted
    return max(1, min(wanted, max_depth, fits))


def check_ring_fits(depth: int, slot_bytes: int) -> None:
    """Raise if ``depth`` slots of ``slot_bytes`` would take more than half the host memory
    available now. Double buffering (2 slots) is always allowed: it is the least that overlaps."""
    if depth <= 2 or slot_bytes <= 0:
        return
    available = host_memory().free
    limit = available // 2
    if depth * slot_bytes > limit:
        raise ValueError(
            f"prefetch_depth={depth} needs {depth} host slots of {format_bytes(slot_bytes)} (one batch "
            f"each), {format_bytes(depth * slot_bytes)} in all: more than the limit of "
            f"{format_bytes(limit)}, half the host memory available now ({format_bytes(available)}); "
            f"use prefetch_depth <= {max(2, limit // slot_bytes)}, or leave it unset to choose from the batch size"
        )


# ---------------------------------------------------------------------- nested batches


def _map_leaves(data: Any, fn: Callable[[Any], Any]) -> Any:
    """``data`` with ``fn`` applied to every tensor and TensorSpec; containers keep their types."""
    return map_leaves(data, fn, is_leaf=lambda leaf: isinstance(leaf, TensorSpec))


def _byte_view(
    buffer: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """A contiguous tensor of ``shape``/``dtype`` over ``buffer`` (uint8) from ``offset``."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return buffer[offset : offset + nbytes].view(dtype).view(shape)


# ---------------------------------------------------------------------- the ring


class _StageFailure(Exception):
    """Carries an exception raised by a Fill callback, so it is reported as the producer's."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.exc = exc


@dataclass
class _Delivery:
    index: int
    batch: Any
    event: Any  # torch.cuda.Event recorded after all of the batch's work, or None on the CPU
    device_tensors: list[torch.Tensor]  # the batch's CUDA tensors: record on the consumer's stream
    stages: dict[str, float] | None = None  # the seconds each stage took for it (gpuload.timeline)


def _delivery(index: int, batch: Any, stream: Any) -> _Delivery:
    """Batch ``index``, ready once ``stream`` (the side stream, None on the CPU) reaches this point.

    The event is recorded after everything queued for the batch on the side stream (the source's
    own device work, e.g. a collate of device tensors, and the copy of staged bytes), whether or
    not any host bytes were staged; every CUDA tensor of the batch is listed for the consumer's
    ``record_stream``, since the consumer's stream uses memory allocated on the side stream.
    """
    if stream is None:
        return _Delivery(index, batch, None, [])
    tensors: list[torch.Tensor] = []
    map_leaves(batch, lambda leaf: tensors.append(leaf) if leaf.is_cuda else None)
    event = torch.cuda.Event()
    event.record(stream)
    return _Delivery(index, batch, event, tensors)


class _Slot:
    __slots__ = ("buffer", "event")

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.event: Any = None


class _Ring:
    """``depth`` host slots, allocated on first use and grown only when a batch does not fit."""

    def __init__(self, depth: int, device: torch.device, stream: Any, stats: PrefetchStats):
        self.slots = [_Slot() for _ in range(depth)]
        self.device = device
        self.stream = stream
        self.stats = stats
        self.cuda = device.type == "cuda"

    def _reserve(self, slot: _Slot, nbytes: int) -> torch.Tensor:
        if slot.event is not None:
            with stage("slot_wait"):
                slot.event.synchronize()  # the slot's previous copy must finish before reuse
        if slot.buffer is None or slot.buffer.numel() < nbytes:
            check_ring_fits(len(self.slots), nbytes)
            slot.buffer = None  # give the old buffer back before taking a bigger one
            slot.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
            self.stats.slot_allocations += 1
        return slot.buffer

    def transfer(self, index: int, item: Any, counted: bool = True) -> _Delivery:
        """Stage batch ``index`` into its slot and start its copy to the device; ``counted``:
        its bytes are batch data (``PrefetchStats.bytes_copied``), not indices or parameters."""
        started = time.perf_counter()
        layout, fill = (item.layout, item.fill) if isinstance(item, Fill) else (item, None)
        offsets: dict[int, int] = {}  # leaf position -> byte offset in the slot
        leaves: list[Any] = []
        total = staged_bytes = 0

        def plan(leaf: Any) -> Any:
            nonlocal total, staged_bytes
            if isinstance(leaf, TensorSpec) or leaf.device.type == "cpu":
                nbytes = _nbytes(leaf)
                offsets[len(leaves)] = total
                total += -(-nbytes // _ALIGN) * _ALIGN
                staged_bytes += nbytes
            leaves.append(leaf)
            return leaf

        _map_leaves(layout, plan)
        slot = self.slots[index % len(self.slots)]
        buffer = (
            self._reserve(slot, total) if total else torch.empty(0, dtype=torch.uint8)
        )

        staged: list[Any] = []
        for position, leaf in enumerate(leaves):
            if position not in offsets:
                staged.append(leaf)
                continue
            view = _byte_view(buffer, offsets[position], tuple(leaf.shape), leaf.dtype)
            if isinstance(leaf, torch.Tensor):
                view.copy_(leaf.detach())
            staged.append(view)
        if fill is not None:
            views = iter(staged)
            try:
                fill(_map_leaves(layout, lambda leaf: next(views)))
            except BaseException as exc:
                raise _StageFailure(exc) from exc

        target = buffer  # the device copy or the clone below whenever bytes were staged (total > 0)
        if total:
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    target = torch.empty(total, dtype=torch.uint8, device=self.device)
                    target.copy_(buffer[:total], non_blocking=True)
                    if slot.event is None:
                        slot.event = torch.cuda.Event()
                    slot.event.record(self.stream)  # guards the host slot's reuse (_reserve)
            else:
                target = buffer[:total].clone()  # fresh memory: the slot is reused next round
            if counted:
                self.stats.bytes_copied += staged_bytes
        outputs = iter(
            _byte_view(target, offsets[position], tuple(leaf.shape), leaf.dtype)
            if position in offsets
            else self._move(leaf)
            for position, leaf in enumerate(leaves)
        )
        batch = _map_leaves(layout, lambda leaf: next(outputs))
        self.stats.copy_time_s += time.perf_counter() - started
        return _delivery(index, batch, self.stream if self.cuda else None)

    def _move(self, leaf: torch.Tensor) -> torch.Tensor:
        """A tensor already on a device: kept when it is the target device, else copied there."""
        return leaf if leaf.device == self.device else leaf.to(self.device)


class _PassThrough:
    """Stands in for the ring when batches are made on the device by the source itself.

    Nothing is staged or copied: on CUDA the source runs on the prefetcher's side stream (as
    every source does) and an event recorded after each batch tells the consumer's stream when
    it is ready.
    """

    def __init__(self, device: torch.device, stream: Any) -> None:
        self.device = device
        self.stream = stream
        self.cuda = device.type == "cuda"

    def transfer(self, index: int, item: Any) -> _Delivery:
        return _delivery(index, item, self.stream if self.cuda else None)


def _nbytes(leaf: torch.Tensor | TensorSpec) -> int:
    return leaf.nbytes if isinstance(leaf, TensorSpec) else leaf.numel() * leaf.element_size()


# ---------------------------------------------------------------------- the background thread


_END = object()


@dataclass
class _Failure:
    index: int
    stage: str  # "source", "fill" or "copy"
    exc: BaseException

    def exception(self, as_raised: bool = False) -> BaseException:
        """The exception to raise in the loop: the original type, message naming the batch
        (or, ``as_raised``, the original exception itself)."""
        if as_raised:
            return self.exc
        sample = getattr(self.exc, "sample_index", None)
        where = f"batch {self.index}" + (f" (sample {sample})" if sample is not None else "")
        filename = getattr(self.exc, "filename", None)
        if filename:
            where += f" (file {filename})"
        message = (
            f"{where} failed in the prefetcher's {self.stage} stage: "
            f"{type(self.exc).__name__}: {self.exc}"
        )
        raised: Any  # the stage's own exception type where it takes the message, with the batch's attributes
        try:
            raised = type(self.exc)(message)
            if not isinstance(raised, BaseException) or raised.args != (message,):
                raise TypeError
        except Exception:
            raised = PrefetchError(message)
        raised.batch_index = self.index
        raised.sample_index = sample
        raised.stage = self.stage
        for note in getattr(self.exc, "__notes__", ()):  # e.g. the dataset index gpuload noted
            raised.add_note(note)
        return raised


def _work(
    owner: Prefetcher,
    batches: Iterator[Any],
    ring: _Ring | _PassThrough,
    out: queue.Queue,
    tokens: threading.Semaphore,
    epoch: Epoch,
    sampling: tuple[int, int],
) -> None:
    """Pull, stage and copy batches until the source ends, fails, or ``epoch`` is stopped; the
    stages of batch ``index`` are timed (``gpuload.timeline``) when ``every`` divides it plus
    ``offset`` (``sampling``: ``(every, offset)``; every 0: none).

    Holds no reference to the consuming iterator, so dropping that iterator stops this thread.
    A token is taken before each pull: the thread is never more than ``depth`` batches ahead.
    It works ``inside`` the epoch throughout, so a ``close()`` waits for it, or leaves what it
    uses to be closed when it leaves.
    On CUDA the side stream is this thread's current stream throughout, so whatever device work
    the source does (and its cleanup) is ordered before the event each delivery carries; the
    host tensors it puts on the device itself go through the staging it was built with (the
    loader's: ``Setup.staging``, which its calls of ``gpuload.transfer.to_device`` name).
    """
    with epoch.inside():  # the last of the epoch's threads to leave closes what close() left to it
        outcome: Any = _END
        index = 0
        every, offset = sampling
        on_side_stream = contextlib.ExitStack()
        try:
            if ring.cuda:
                torch.cuda.set_device(ring.device)
                on_side_stream.enter_context(torch.cuda.stream(ring.stream))
            while not epoch.stopped.is_set():
                if not tokens.acquire(timeout=_POLL_S):
                    continue
                if epoch.stopped.is_set():
                    break
                made = begin_batch() if every and (index + offset) % every == 0 else None
                try:
                    item = next(batches)
                except StopIteration:
                    break
                except BaseException as exc:
                    outcome = _Failure(index, "source", exc)
                    break
                if epoch.stopped.is_set():
                    break
                try:
                    with stage("copy"):
                        delivery = ring.transfer(index, item)
                except _StageFailure as failure:
                    outcome = _Failure(index, "fill", failure.exc)
                    break
                except BaseException as exc:
                    outcome = _Failure(index, "copy", exc)
                    break
                del item
                if made is not None:
                    delivery.stages = end_batch(made)
                out.put(delivery)
                del delivery
                index += 1
        except BaseException as exc:  # e.g. set_device failing: still tell the consumer
            outcome = _Failure(index, "copy", exc)
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                try:
                    close()  # runs a generator's cleanup in the thread that ran it
                except BaseException as exc:
                    if outcome is _END:
                        outcome = _Failure(index, "source", exc)
            del batches
            on_side_stream.close()
            out.put(outcome)
            del outcome  # a failure's traceback holds this frame: no reference cycle through it


def _stop_at_exit(
    epoch: Epoch, cancel_source: Callable[[], None] | None, tokens: threading.Semaphore, depth: int,
) -> None:
    """Stop a prefetch thread the interpreter's exit found running (``gpuload.exit_threads``);
    holds nothing of the consuming iterator, which the thread must not keep alive."""
    epoch.stop("the interpreter is exiting")
    if cancel_source is not None:
        cancel_source()
    tokens.release(depth + 1)


class _Handoff(Iterator[Any]):
    """One pass over a source: the consuming side of the hand-off, asking ``epoch`` (the stop
    token it shares with its thread, and with the loader's iterator over it)."""

    def __init__(self, owner: Prefetcher, batches: Iterator[Any], ring: _Ring | _PassThrough, epoch: Epoch) -> None:
        self._owner = owner  # keeps the prefetcher (its stream, its ring) alive while iterating
        self._device = owner.device
        self._stats = owner.stats
        self._timeout = owner.timeout
        self._join_timeout = owner.join_timeout
        self._depth = owner.depth
        # Unbounded, yet never more than depth + 1 items: a batch is put only with a token
        # (depth of them, one given back per batch taken) and the outcome once, so a put never waits.
        self._queue: queue.Queue = queue.Queue()
        self._tokens = threading.Semaphore(owner.depth)
        self._epoch = epoch
        self._finished = False  # closed: no more batches come from this iterator
        self._abandoned: str | None = None  # why it stopped without waiting for the thread (see _abandon)
        self._next_index = 0
        # A source that may wait for the consumer (a collective exchange running ahead) is told
        # when the consumer stops, from the consumer's thread.
        self._cancel_source = getattr(batches, "cancel", None)
        self._thread = start_stoppable(
            _work, (owner, batches, ring, self._queue, self._tokens, epoch, owner.timeline), "gpuload-prefetch",
            functools.partial(_stop_at_exit, epoch, self._cancel_source, self._tokens, owner.depth),
            owner.join_timeout,
        )

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def __iter__(self) -> _Handoff:
        return self

    def __next__(self) -> Any:
        self._epoch.raise_if_stopped(self._next_index)
        if self._abandoned is not None:
            raise EpochStoppedError.at(self._next_index, self._abandoned)
        if self._finished:
            raise StopIteration
        started = time.perf_counter()
        try:
            try:
                item = self._get()
            except BaseException as error:
                # A worker's death (torch raises it in the main thread), KeyboardInterrupt, a
                # timeout: tell the loop now; the thread ends when its source call returns.
                stopped_before = self._epoch.cause is not None
                self._abandon(f"{type(error).__name__} was raised while it waited for batch {self._next_index}")
                if stopped_before:
                    self._epoch.raise_if_stopped(self._next_index)
                raise
            if item is _END or isinstance(item, _Failure):
                self._epoch.end()
            # whatever arrived, an epoch stopped first did not end here: never end it short
            self._epoch.raise_if_stopped(self._next_index)
            if item is _END:
                self.close()
                raise StopIteration
            if isinstance(item, _Failure):
                self.close()
                if self._owner.stage:
                    raise item.exception() from item.exc
                raise item.exception(as_raised=True)
            if item.event is not None:
                stream = torch.cuda.current_stream(self._device)
                stream.wait_event(item.event)  # ordered: the batch's work is done first
                for tensor in item.device_tensors:
                    tensor.record_stream(stream)  # protected: not reused while the loop uses it
            if item.stages is not None:  # a sampled batch (gpuload.timeline)
                hand_over(item.stages)
            self._tokens.release()
        finally:
            self._stats.wait_time_s += time.perf_counter() - started
        self._stats.batches += 1
        self._next_index += 1
        return item.batch

    def _get(self) -> Any:
        waited = 0.0
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                waited += _POLL_S
            if not self._thread.is_alive() and self._queue.empty():
                raise PrefetchError(
                    f"the prefetch thread ended without delivering batch {self._next_index}"
                )
            if self._timeout is not None and waited >= self._timeout:
                raise TimeoutError(
                    f"batch {self._next_index} did not arrive within timeout={self._timeout} s; "
                    "the source is slower than that (raise timeout=, or None to wait forever)"
                )

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def _signal_stop(self) -> None:
        self._finished = True
        self._epoch.stopped.set()
        if self._cancel_source is not None:
            self._cancel_source()
        self._tokens.release(self._depth + 1)  # wake the thread if it waits for a free slot
        self._drain()

    def _abandon(self, cause: str) -> None:
        """Stop without waiting: the thread may be inside its source (a torch iterator whose
        worker died waits up to 5 s to notice) and exits when that call returns. The next
        epoch waits for it (``Prefetcher.stop_epoch``); nothing else needs it gone. A later
        ``next()`` raises EpochStoppedError naming ``cause``: the epoch did not end. The error
        itself reaches the loop as raised (the epoch is not stopped for it: ``cause`` is this
        iterator's own)."""
        self._abandoned = cause
        self._signal_stop()

    def close(self) -> bool:
        """Stop the background thread and drop undelivered batches; idempotent. Whether it
        waited (up to ``join_timeout``) for the thread to end."""
        if self._abandoned is not None or (self._finished and not self._thread.is_alive()):
            self._drain()
            return False
        self._signal_stop()
        if threading.current_thread() is not self._thread:
            self._thread.join(self._join_timeout)
        self._drain()
        if self._thread.is_alive():
            warnings.warn(
                f"the prefetch thread did not stop within {self._join_timeout} s (its source "
                "is still producing a batch); it will exit when that batch is done",
                RuntimeWarning,
                stacklevel=2,
            )
        return True

    def stop(self, cause: str) -> bool:
        """Stop this epoch for ``cause``; its consumer, in whatever thread, gets an
        :class:`EpochStoppedError` naming it at its next ``next()`` (or the one it waits in)
        unless it was already handed the epoch's end. Whether it waited for the thread."""
        self._epoch.stop(cause)
        return self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class Prefetcher:
    """Iterate ``batches`` with their tensors delivered on ``device``, ``depth`` ahead.

    Each ``iter()`` is one epoch: ``iter(batches)`` is called in the caller's thread, then a
    background thread pulls batches (running their source on the prefetcher's side stream on
    CUDA), packs each into one of ``depth`` reusable host slots (pinned on CUDA), and copies it
    to the device on that stream. Batches keep
    their structure (tensors in tuples, lists, namedtuples, dicts; other leaves pass through),
    order and dtypes; tensors arrive contiguous. Device tensors are safe to use on the stream
    that is current when ``next()`` returns them, and stay valid however long they are kept.

    An exception in the source, a :class:`Fill` callback or the copy is raised from ``next()``
    after the batches before it, with the same type where possible (else :class:`PrefetchError`),
    a message naming the batch (and the sample, if the exception has ``sample_index``), the
    attributes ``batch_index``, ``sample_index``, ``stage``, and the original as ``__cause__``.

    ``timeout`` (seconds, or None) bounds the wait for one batch; ``join_timeout`` bounds how
    long ``close()`` waits for a source that is in the middle of producing a batch.

    ``stage=False`` is for sources that make their batches on ``device`` themselves (decoding
    and transforming images): the background thread only runs the source ahead of the loop,
    on the side stream on CUDA, nothing is staged or copied, and a source's exception is
    re-raised as it was raised (such sources name the failing sample themselves).
    ``source=`` is the former name of ``batches``, still taken.
    Starting a new epoch stops the previous one: its iterator raises :class:`EpochStoppedError`
    at its next ``next()``, in whatever thread it runs, rather than end short. ``close()`` (or
    leaving a ``with`` block, or dropping the object) stops the thread and frees the slots; a
    later epoch allocates them again.
    """

    #: The most batches in flight: each holds a whole batch in host memory, and a few already
    #: absorb the jitter of the batches' costs (``check_ring_fits`` bounds it by memory too).
    MAX_DEPTH = 1024
    #: Its thread times the stages of each epoch's batches whose index plus K is a multiple of N
    #: (``(N, K)``: gpuload.timeline's sampling, read when an epoch starts); N 0: none.
    timeline: tuple[int, int] = (0, 0)

    def __init__(
        self,
        batches: Iterable[Any] | None = None,
        device: str | int | torch.device | None = None,
        depth: int = 2,
        stats: PrefetchStats | None = None,
        *,
        timeout: float | None = None,
        join_timeout: float = 5.0,
        stage: bool = True,
        source: Iterable[Any] | None = None,
    ) -> None:
        if source is not None:
            if batches is not None:
                raise TypeError("Prefetcher takes batches or source= (its former name), not both")
            batches = source
        if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= self.MAX_DEPTH:
            raise ValueError(
                f"depth={depth!r} must be an int from 1 to {self.MAX_DEPTH} (the number of batches "
                "staged ahead); see gpuload.prefetch.default_depth"
            )
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout={timeout!r} must be positive seconds, or None")
        self.batches = batches
        self.device = resolve_device(device)
        self.depth = depth
        self.stats = stats if stats is not None else PrefetchStats()
        self.timeout = timeout
        self.join_timeout = join_timeout
        self.stage = stage
        self._stream = new_side_stream(self.device)
        self._ring: _Ring | None = None
        self._inline_ring: _Ring | None = None  # copy_now's slots, never shared with a thread's
        self._inline_count = 0
        self._inline_lock = threading.Lock()  # copy_now may be called from the loop's and this thread
        self._ring_thread: threading.Thread | None = None  # the latest epoch's
        self._active: weakref.ref[_Handoff] | None = None

    @property
    def stream(self) -> Any:
        """The side CUDA stream the copies run on (None on the CPU)."""
        return self._stream

    @property
    def staging(self) -> Staging:
        """This prefetcher's copy route for host tensors a batch needs on the way: :meth:`copy_now`
        through its own slots and side stream, the bytes not counted as batch data."""
        return Staging(functools.partial(self.copy_now, counted=False))

    def copy_now(self, item: Any, counted: bool = True) -> Any:
        """One batch (a host batch or a :class:`Fill`) staged and copied in the caller's thread,
        through this prefetcher's own slots and side stream: for work that runs in the loop's
        thread (``prefetch_depth=0``), that must be copied after its epoch was planned, or that
        a source does in the middle of its batch (``gpuload.transfer.to_device``). The caller's
        current stream waits for the copy (no host sync) and the batch's device tensors are
        protected on it (``record_stream``). The copy itself does not wait for the caller's
        stream, so it overlaps the step queued there: it reads only the pinned slot (written by
        the host, a Fill's callback included) and writes memory allocated on the side stream,
        which the allocator hands out only once every stream it was recorded on is done with it.
        Safe from any thread. ``counted``: the bytes are batch data, counted in
        ``stats.bytes_copied`` (indices and parameters are not)."""
        with self._inline_lock:
            if self._inline_ring is None:
                depth = max(self.depth, _INLINE_SLOTS)
                self._inline_ring = _Ring(depth, self.device, self._stream, self.stats)
            ring = self._inline_ring
            try:
                if not ring.cuda:
                    with stage("copy"):
                        return ring.transfer(0, item, counted).batch
                assert self._stream is not None  # a CUDA ring copies on the loader's side stream
                current = torch.cuda.current_stream(self.device)
                with torch.cuda.stream(self._stream), stage("copy"):
                    delivery = ring.transfer(self._inline_count, item, counted)
            except _StageFailure as failure:  # a Fill's own error, raised as it was raised
                raise failure.exc from None
            self._inline_count += 1
        if current != self._stream:
            current.wait_event(delivery.event)
            for tensor in delivery.device_tensors:
                tensor.record_stream(current)
        return delivery.batch

    def __iter__(self) -> Iterator[Any]:
        if self.batches is None:
            raise TypeError(
                "this Prefetcher was made without batches; call prefetcher.epoch(batches)"
            )
        return self.epoch(self.batches)

    def epoch(self, batches: Iterable[Any], epoch: Epoch | None = None) -> Iterator[Any]:
        """One pass over ``batches`` (for callers that make a new iterator of them each epoch),
        stopped by ``epoch`` (the loader's stop token for it; a new one if not given)."""
        self.stop_epoch("a newer epoch on the same Prefetcher")
        if self._ring is None or (self._ring_thread is not None and self._ring_thread.is_alive()):
            # A thread that would not stop may still write its slots: never share them.
            self._ring = _Ring(self.depth, self.device, self._stream, self.stats)
        iterator = iter(batches)
        if self._stream is not None:
            # The source may read device memory the caller wrote (a cache filled, a dataset
            # placed): the side stream starts after everything the caller has queued so far.
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        ring = self._ring if self.stage else _PassThrough(self.device, self._stream)
        current = _Handoff(self, iterator, ring, epoch if epoch is not None else Epoch())
        self._ring_thread = current.thread
        self._active = weakref.ref(current)
        return current

    def stop_epoch(self, reason: str) -> None:
        """Stop the epoch in progress, if any, before its source is reused elsewhere.

        ``reason`` names what starts (e.g. "a newer epoch of this DataLoader"); the stopped
        iterator's consumer gets an :class:`EpochStoppedError` saying so. Waits (up to
        ``join_timeout``) for a thread left running by an abandoned epoch, since the source
        it is inside may be reused now.
        """
        waited = self._stop_active(one_epoch_at_a_time(reason))
        thread = self._ring_thread
        if not waited and thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(self.join_timeout)

    def _stop_active(self, cause: str) -> bool:
        """Stop the epoch in progress for ``cause``; whether that waited for its thread."""
        active = self._active() if self._active is not None else None
        self._active = None
        return active.stop(cause) if active is not None else False

    def close(self) -> None:
        """Stop the running epoch, if any, and free the host slots; idempotent."""
        self._stop_active("the loader was closed (Prefetcher.close()); iterate it again for a new epoch")
        self._ring = self._inline_ring = None

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
