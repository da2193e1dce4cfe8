"""Where the loop waits: per step, how long the training loop waited for its batch, and what
each stage of that batch took (``loader.timeline``).

Two halves meet here. The stages (reads, decode, transforms, cache gathers per tier, the
host-to-device copy, the exchange between ranks, waiting for a free pinned slot) time
themselves with :func:`stage`, into the record of the batch that the thread running them is
making (:func:`begin_batch` / :func:`end_batch`; with no record open a stage costs one
thread-local read). The prefetcher's thread opens one record per batch and hands it over with
the batch (:func:`hand_over`), so work done in the background is attributed to the batch it
produced; the loop's own thread opens one per step (:meth:`Timeline.ask`), which also gets
whatever is made in the loop's thread. A :class:`Timeline` keeps the last ``capacity`` steps and
running totals; :mod:`gpuload.verdict` turns them into one line a person can act on.

The wait is measured every step. On a CPU the loop appends each step's wait and clock time to a
list (:attr:`Timeline.log`, one C call: code run after the batch's work runs cold, evicted from
the CPU's caches by it, so every line the loop runs per step shows in its cost); a sampled
step's stages and an epoch's start are marked beside it. The timeline records the log in one
pass once it holds half :data:`FOLD_STEPS` steps, or when read: a pass costs 30-60 µs run cold,
mostly for its code, so passes are few, not one per sampled step or epoch. On CUDA every step goes in
full (its events).

The stages are timed on one step in ``sample_every`` (64 by default): a sampled step costs tens
of times an unsampled one, run cold. Both ends decide by the same rule, the item's
index in the stream of items the loop pulls, counted from 0 at each epoch, each
``set_batch_size`` and each resume, plus the epoch's offset (``(index + offset) % sample_every
== 0``), and the stages travel with the batch they were timed for: a sampled step never gets
another step's stages. The offset (the steps recorded before the epoch) carries the cadence
over from one epoch to the next, so that an epoch shorter than ``sample_every`` steps, or not a
multiple of it, does not have its first step sampled every time.

The exposed wait is measured where the loop uses the batch: on a CPU with the clock around
``next()``; on CUDA with timing events recorded on the loop's current stream when it asks for a
batch and once the batch is usable there, read only after they completed (``event.query()``),
never with a host sync, and by the loop only once :data:`READ_EVERY` steps wait to be read. A
stage's time is host time in the thread that ran it: asynchronous device work shows where the
host waits for it (a slot whose copy is not done, a decode that returns device memory).

Each stage is also a ``torch.profiler`` range (``gpuload.<stage>``) while a profiler runs.
"""

from __future__ import annotations

import math
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from gpuload.environment import DEFAULT_TIMELINE_STEPS, MAX_TIMELINE_STEPS, timeline_steps
from gpuload.verdict import STAGES, Verdict, verdict

__all__ = [
    "DEFAULT_SAMPLE_EVERY", "DEFAULT_STEPS", "FOLD_STEPS", "READ_EVERY", "Step", "Timeline", "begin_batch", "end_batch",
    "gather_stage", "hand_over", "resolve_steps", "stage", "timeline_of",
]

_OFF = "no timeline: it is off (turn it on with timeline_steps=1000 or GPULOAD_TIMELINE=on)"

#: Steps a timeline keeps by default (running totals cover every step).
DEFAULT_STEPS = DEFAULT_TIMELINE_STEPS

#: One step in this many has its stages timed (the wait is measured on every step). A sampled
#: step costs 15 to 30 µs on a CPU run cold: one in 16 cost 0.9% of a cached 180 µs step alone.
DEFAULT_SAMPLE_EVERY = 64

#: CUDA: the loop reads its steps' completed events once this many wait (or the ring's capacity,
#: if less), not every step; readers read them all.
READ_EVERY = 16

#: The CPU loop's log never holds this many steps: the timeline records it once it holds half as
#: many (or when read), checked at the loop's full steps (sampled ones, at least one in half as many).
FOLD_STEPS = 1024

_clock = time.perf_counter
_profiler = torch.autograd.profiler  # its ``_is_profiler_enabled`` flag is set while a profiler runs


class _Batch:
    """The stage times of one batch, accumulated in the thread making it."""

    __slots__ = ("seconds", "started", "outer")

    def __init__(self, outer: _Batch | None) -> None:
        self.seconds: dict[str, float] = {}
        self.outer = outer  # the record this one interrupts in the same thread (restored at its end)
        self.started = _clock()


class _Here(threading.local):
    batch: _Batch | None = None
    stage: _Stage | None = None
    delivered: dict[str, float] | None = None  # the stages of the batch the prefetcher just handed over


_here = _Here()


class _Stage:
    """One timed stage: its own time (less the stages inside it) goes to the open batch record."""

    __slots__ = ("name", "batch", "started", "inner", "outer", "range")

    def __init__(self, name: str, batch: _Batch | None) -> None:
        self.name, self.batch, self.inner = name, batch, 0.0
        self.range: Any = None

    def __enter__(self) -> None:
        if _profiler._is_profiler_enabled:
            self.range = torch.autograd.profiler.record_function(f"gpuload.{self.name}")
            self.range.__enter__()
        self.outer, _here.stage = _here.stage, self
        self.started = _clock()

    def __exit__(self, *exc_info: object) -> None:
        took = _clock() - self.started
        _here.stage = self.outer
        if self.outer is not None:
            self.outer.inner += took
        if self.batch is not None:
            seconds = self.batch.seconds
            seconds[self.name] = seconds.get(self.name, 0.0) + took - self.inner
        if self.range is not None:
            self.range.__exit__(None, None, None)


class _Untimed:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        return None


_UNTIMED = _Untimed()


def stage(name: str) -> _Stage | _Untimed:
    """A context manager timing stage ``name`` (one of :data:`STAGES`) for the batch this thread
    is making; nothing is timed (or allocated) when no batch record is open and no profiler runs."""
    batch = _here.batch
    if batch is None and not _profiler._is_profiler_enabled:
        return _UNTIMED
    return _Stage(name, batch)


def gather_stage(tier: str) -> str:
    """The stage of a cache gather from the tier named ``tier``."""
    return f"gather.{tier}"


def resolve_steps(steps: int | None) -> int:
    """The steps a loader's timeline keeps: ``steps`` (the ``timeline_steps=`` keyword; 0: off),
    or for None ``GPULOAD_TIMELINE`` (default off)."""
    if steps is None:
        return timeline_steps()
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= MAX_TIMELINE_STEPS:
        raise ValueError(f"timeline_steps={steps!r} must be an int from 0 to {MAX_TIMELINE_STEPS:,} (recent steps "
                         "loader.timeline keeps, 24 bytes each; 0 turns it off; the totals cover every step), or "
                         "None for GPULOAD_TIMELINE (default off)")
    return steps


def begin_batch() -> _Batch:
    """Open the record of the batch this thread makes from now on (until :func:`end_batch`)."""
    batch = _here.batch = _Batch(_here.batch)
    return batch


def end_batch(batch: _Batch, other: bool = True) -> dict[str, float]:
    """Close ``batch``'s record: its stage seconds, with ``"other"`` the time it was open outside
    every stage unless not ``other`` (the record it interrupted, if any, is open again)."""
    _here.batch = batch.outer
    seconds = batch.seconds
    other_s = _clock() - batch.started - sum(seconds.values()) if other else 0.0
    if other_s > 0:
        seconds["other"] = seconds.get("other", 0.0) + other_s
    return seconds


def hand_over(stages: dict[str, float] | None) -> None:
    """In the loop's thread: the stages of the batch being handed to it (made in another thread);
    None for a batch whose stages were not sampled."""
    if stages is not None:
        _here.delivered = stages


@dataclass(slots=True)
class Step:
    """One step of the loop. ``wait_s``: how long the loop (on CUDA: its stream) waited for the
    batch; ``step_s``: from the previous batch being usable to this one being usable (the loop's
    work on the previous batch plus this wait; None for an epoch's first step); ``stages``: the
    seconds each stage took for this batch, None for a step whose stages were not sampled (one in
    ``Timeline.sample_every`` is). On CUDA both times are None until the events completed."""

    wait_s: float | None
    step_s: float | None
    stages: dict[str, float] | None = field(default_factory=dict)


def _known(seconds: float) -> float | None:
    return None if seconds != seconds else seconds  # NaN: not known


class _Ring:
    """The last ``capacity`` steps as plain floats (NaN: unknown) and their stages (None: not
    sampled); ``written`` steps so far, step n at slot n % capacity."""

    __slots__ = ("capacity", "waits", "times", "stages", "written")

    def __init__(self, capacity: int, newest_of: _Ring | None = None) -> None:
        self.capacity = capacity
        self.waits = array("d", [math.nan]) * capacity
        self.times = array("d", [math.nan]) * capacity
        self.stages: list[dict[str, float] | None] = [None] * capacity
        self.written = 0
        if newest_of is not None:
            for step in newest_of.steps()[-capacity:] if capacity else ():
                self.put(self.written, math.nan if step.wait_s is None else step.wait_s,
                         math.nan if step.step_s is None else step.step_s, step.stages)

    def put(self, index: int, wait_s: float, step_s: float, stages: dict[str, float] | None) -> None:
        slot = index % self.capacity
        self.waits[slot], self.times[slot], self.stages[slot] = wait_s, step_s, stages
        self.written = max(self.written, index + 1)

    def extend(self, waits: list[float], times: list[float]) -> None:
        """Unsampled steps (no stages) from step ``written`` on; only the last ``capacity`` are kept."""
        capacity, count = self.capacity, len(waits)
        first = count - min(count, capacity)  # the first of them kept
        index, end = self.written + first, self.written + count
        while index < end:
            slot = index % capacity
            run = min(capacity - slot, end - index)  # up to the ring's end
            taken = slice(index - self.written, index - self.written + run)
            self.waits[slot:slot + run] = array("d", waits[taken])
            self.times[slot:slot + run] = array("d", times[taken])
            self.stages[slot:slot + run] = [None] * run
            index += run
        self.written = end

    def steps(self) -> list[Step]:
        """The kept steps, oldest first, as :class:`Step` objects (made now)."""
        capacity = self.capacity
        return [Step(_known(self.waits[slot]), _known(self.times[slot]), self.stages[slot])
                for slot in (index % capacity for index in range(max(0, self.written - capacity), self.written))]


_TOTALS = ("step_count", "sampled_count", "wait_s", "step_s", "starts", "start_wait_s")


def _checked(capacity: int) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or not 0 <= capacity <= MAX_TIMELINE_STEPS:
        raise ValueError(f"timeline capacity={capacity!r} must be an int from 0 to {MAX_TIMELINE_STEPS:,} (steps "
                         "kept, 24 bytes each; the totals cover every step)")
    return capacity


def _checked_every(every: int) -> int:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"timeline sample_every={every!r} must be an int >= 1 (one step in this many has its "
                         "stages timed; 1: every step)")
    return every


class Timeline:
    """The last ``capacity`` steps of a loader, and running totals over every step measured.

    ``capacity=0`` records nothing (``loader.timeline`` of a loader built with
    ``timeline_steps=0``, or with neither ``timeline_steps`` nor ``GPULOAD_TIMELINE=on``). Steps are
    recorded in the loop's thread (those it logged by whichever thread reads first); :meth:`steps`,
    :meth:`as_dict`, :meth:`summary` and :meth:`scalars` may be read anywhere. Every step's wait is
    measured; its stages on one step in ``sample_every`` (from the loader's next epoch), and the
    stage means are over those steps.
    The running totals (``step_count``, ``wait_s``, ...) are read-only and include the steps the
    loop logged but did not record yet.
    """

    def __init__(self, capacity: int = DEFAULT_STEPS, device: torch.device | str = "cpu",
                 sample_every: int = DEFAULT_SAMPLE_EVERY) -> None:
        self.capacity = _checked(capacity)
        self._sample_every = _checked_every(sample_every)
        self._every = sample_every if capacity else 0  # the epoch's sampling (0: none), fixed at new_epoch
        self._offset = 0  # the epoch's first item is its step _offset of the cadence (fixed at new_epoch)
        self._asked: Any = None  # CUDA: the event recorded when the loop asked for the current batch
        self._stream: Any = None  # CUDA: the loop's stream when it asked (its batch is usable there)
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        # The kept steps, a ring of plain floats (NaN: unknown) written in place: recording a step
        # allocates nothing; steps() builds Step objects when read. Step n is at slot n % capacity.
        self._ring = _Ring(capacity)
        self._pending: deque[tuple[int, Any, Any, Any]] = deque()  # CUDA: steps whose events may not be done
        self._spare: list[Any] = []  # CUDA: events no step reads any more, recorded again (_event)
        self._reading = threading.Lock()  # _read_events runs in the loop's thread and in readers'
        self._last_ready: Any = None  # the previous step's "usable" event (CUDA) or clock time; None: epoch start
        #: CPU: ``(wait, ready)`` clock times of the steps the loop logged, not recorded yet (the
        #: loop appends; recording under ``_reading`` takes them). One list for the timeline's life.
        self.log: list[tuple[float, float]] = []
        self._folded = 0  # CPU: steps taken from the log so far (log[0] is step _folded of it)
        # CPU: (step of the log, whether an epoch starts there, its stages if sampled), in order;
        # made under _reading by the loop, for a logged step or the next one it logs
        self._marks: deque[tuple[int, bool, dict[str, float] | None]] = deque()
        self.reset_totals()
        # the loader (a weak reference: a cycle would keep its cache memory until the garbage
        # collector runs), for the verdict's suggestions; set by loader.timeline
        self.about: Callable[[], Any] | None = None
        self.ranks: Any = None  # every rank's waits, as last gathered (gpuload.distributed.rank_waits)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    @property
    def sample_every(self) -> int:
        """One step in this many has its stages timed (from the loader's next epoch); 1: every step."""
        return self._sample_every

    @sample_every.setter
    def sample_every(self, every: int) -> None:
        self._sample_every = _checked_every(every)

    @property
    def sampling(self) -> tuple[int, int]:
        """This epoch's sampling, for the thread making its batches, as ``(every, offset)``: an item
        whose index in the epoch's stream (from 0 at each start, ``set_batch_size`` and resume)
        plus ``offset`` is a multiple of ``every`` has its stages timed; ``every`` 0: none is."""
        return self._every, self._offset

    def resize(self, capacity: int) -> None:
        """Keep the last ``capacity`` steps (0: off) from the loader's next epoch on, e.g. on for
        one epoch to see where it waits, at no cost in the others. The running totals stay, and
        the steps kept so far up to ``capacity`` (the newest)."""
        self._settle()  # under the old capacity
        self.capacity = _checked(capacity)
        old = self._ring
        self._ring = _Ring(capacity, old)
        if not capacity:
            self._pending.clear()  # off: their events are never read
        moved = old.written - self._ring.written  # a pending step's index in the new ring is this much lower
        self._pending = deque((index - moved, *events) for index, *events in self._pending
                              if index - moved >= self._ring.written - capacity)

    def reset_totals(self) -> None:
        """Forget every step measured so far."""
        with self._reading:
            self._folded += len(self.log)
            self.log.clear()
            while self._marks and self._marks[0][0] < self._folded:  # an epoch's start to come stays
                self._marks.popleft()
        self._ring = _Ring(self.capacity)
        self._step_count = 0
        self._sampled_count = 0
        self._wait_s = 0.0
        self._step_s = 0.0
        self._starts = 0
        self._start_wait_s = 0.0
        self.stage_s: dict[str, float] = {}  # each stage's seconds over the sampled steps
        self._pending.clear()

    @property
    def step_count(self) -> int:
        """Steps measured, over the loader's life (since :meth:`reset_totals`)."""
        self._settle()
        return self._step_count

    @property
    def sampled_count(self) -> int:
        """Those of them whose stages were timed (``stage_s`` covers them; both counted when timed)."""
        return self._sampled_count

    @property
    def wait_s(self) -> float:
        """Their waits, where the step time is known too."""
        self._settle()
        return self._wait_s

    @property
    def step_s(self) -> float:
        """Their step times."""
        self._settle()
        return self._step_s

    @property
    def starts(self) -> int:
        """Epochs' first steps measured. An epoch's first step has no step time: its wait (the
        epoch's start, also a scheduler stall after the work of iter(), or workers starting) is
        kept apart from the share."""
        self._settle()
        return self._starts

    @property
    def start_wait_s(self) -> float:
        """Their waits."""
        self._settle()
        return self._start_wait_s

    # -- recording, in the loop's thread ---------------------------------------------------------

    def new_epoch(self) -> None:
        """The next step is an epoch's first: the time since the last one is not a step. Fixes the
        epoch's sampling (``sample_every``, or none when off), going on from the steps recorded
        before it."""
        with self._reading:
            if self._cuda:
                self._last_ready = None
            elif self.capacity:  # the steps still logged follow the last epoch's last ready
                self._mark(self._folded + len(self.log), start=True)
            counted = self._step_count + len(self.log)
        self._every = self._sample_every if self.capacity else 0
        self._offset = counted % self._every if self._every else 0

    def full_from(self, index: int) -> int:
        """The first item index from ``index`` on whose step the loop passes to :meth:`ask` and
        :meth:`got` rather than appending it to :attr:`log` itself: every step on CUDA (its
        events), else the next sampled one, at most half :data:`FOLD_STEPS` on (to record the log)."""
        if self._cuda:
            return index
        every, latest = self._every, index + (FOLD_STEPS + 1) // 2 - 1
        return min(index + -(index + self._offset) % every, latest) if every else latest

    def ask(self, index: int) -> _Batch | None:
        """The loop asks for the item ``index`` of the epoch's stream (counted from 0 at each start,
        ``set_batch_size`` and resume, as the thread making them counts): the step's record when
        its stages are sampled (by :attr:`sampling`), else None."""
        if self._cuda and self.capacity:
            self._asked = self._event()
            self._stream = torch.cuda.current_stream(self.device)
            self._asked.record(self._stream)
        every = self._every
        if every and (index + self._offset) % every == 0:
            _here.delivered = None  # only this step's batch hands its stages over from now on
            return begin_batch()
        return None

    def got(self, asking: _Batch | None, delivered: bool, asked_at: float, ready_at: float) -> None:
        """The loop's batch is usable on its stream (``delivered``), or none came (the epoch ended,
        or raised): then the step is not recorded. ``asking``: the step's record, if sampled;
        ``asked_at`` and ``ready_at``: the clock when the loop asked and when it had the batch. On
        a CPU the step joins the log (its stages counted now, marked for its place in the ring),
        recorded with it once it holds half :data:`FOLD_STEPS` steps."""
        stages = self._stages_of(asking) if asking is not None else None
        recorded = delivered and self.capacity > 0
        if self._cuda:
            if recorded:
                self._got_on_stream(stages)
            return
        with self._reading:
            log = self.log
            if recorded:
                if stages is not None:
                    self._add_stages(stages)
                    self._mark(self._folded + len(log), stages=stages)
                log.append((ready_at - asked_at, ready_at))
            if 2 * len(log) >= FOLD_STEPS or not self.capacity:  # also once turned off mid-epoch (dropped)
                self._record_log()

    def _mark(self, step: int, start: bool = False, stages: dict[str, float] | None = None) -> None:
        """Mark the log's ``step`` as an epoch's start, or sampled (under ``_reading``)."""
        marks = self._marks
        if marks and marks[-1][0] == step:  # an epoch's first step, sampled
            _, started, timed = marks.pop()
            start, stages = start or started, stages or timed
        marks.append((step, start, stages))

    def _record(self, wait: float, ready_at: float, stages: dict[str, float] | None) -> None:
        """One CPU step into the ring and the totals (``capacity`` > 0; under ``_reading``); its
        stages, if sampled, were counted when it was timed."""
        ring = self._ring
        slot = ring.written % self.capacity
        ring.written += 1
        self._step_count += 1
        ring.waits[slot] = wait
        last, self._last_ready = self._last_ready, ready_at
        if last is None:
            ring.times[slot] = math.nan
            self._starts += 1
            self._start_wait_s += wait
        else:
            ring.times[slot] = step = ready_at - last
            self._wait_s += wait
            self._step_s += step
        ring.stages[slot] = stages

    def _record_log(self) -> None:
        """Record the steps the loop logged, oldest first, runs of unmarked steps in whole lists
        (dropped when off; under ``_reading``)."""
        log = self.log
        count = len(log)
        if not count:
            return
        logged = log[:count]
        del log[:count]  # the loop may append meanwhile: after these
        first = self._folded
        self._folded += count
        marks = self._marks
        done = 0
        while marks and marks[0][0] < first + count:
            step, start, stages = marks.popleft()
            if self.capacity:
                at = step - first
                self._record_run(logged[done:at])
                if start:
                    self._last_ready = None
                self._record(*logged[at], stages)
                done = at + 1
        if self.capacity:
            self._record_run(logged[done:])

    def _record_run(self, logged: list[tuple[float, float]]) -> None:
        """Steps of one epoch, none sampled, into the ring and the totals (under ``_reading``)."""
        if not logged:
            return
        if self._last_ready is None:  # an epoch's first step: its wait is the epoch's start
            self._record(*logged.pop(0), None)
        if not logged:
            return
        # in whole lists rather than one _record each: this runs in the loop's thread
        waits = [wait for wait, _ in logged]
        readies = [ready_at for _, ready_at in logged]
        times = [ready_at - before for before, ready_at in zip([self._last_ready, *readies], readies)]
        self._last_ready = readies[-1]
        self._step_count += len(logged)
        self._wait_s += sum(waits)
        self._step_s += sum(times)
        self._ring.extend(waits, times)

    def _settle(self) -> None:
        """Bring the ring and totals up to date: the logged steps, the CUDA steps whose events completed."""
        if self.log:
            with self._reading:
                self._record_log()
        if self._pending:
            self._read_events()

    def _stages_of(self, asking: _Batch) -> dict[str, float]:
        """A sampled step's stages: those of its record in the loop's thread, and those of the
        batch handed over to it (made in the prefetcher's thread)."""
        made = _here.delivered
        _here.delivered = None
        # Handed over by the prefetcher: the loop's thread only waited, outside its stages.
        stages = end_batch(asking, other=made is None)
        if made:
            for name, seconds in made.items():
                stages[name] = stages.get(name, 0.0) + seconds
        return stages

    def _add_stages(self, stages: dict[str, float]) -> None:
        self._sampled_count += 1
        totals = self.stage_s
        for name, seconds in stages.items():
            totals[name] = totals.get(name, 0.0) + seconds

    def _event(self) -> Any:
        """A timing event to record: one no step reads any more (:meth:`_read_events`), or a new one."""
        return self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)

    def _got_on_stream(self, stages: dict[str, float] | None) -> None:
        """CUDA: the step's times come from its events once they completed (read without a sync)."""
        asked, self._asked = self._asked, None
        stream, self._stream = self._stream, None
        if asked is None:  # asked while the timeline was off: nothing to measure from
            return
        ready = self._event()
        ready.record(stream)
        ring = self._ring
        index = ring.written
        ring.put(index, math.nan, math.nan, stages)
        self._step_count += 1
        if stages is not None:
            self._add_stages(stages)
        with self._reading:  # with the step, its previous "ready" passes to it (read, then reused, with it)
            self._pending.append((index, asked, self._last_ready, ready))
            self._last_ready = ready
            while len(self._pending) > self.capacity:  # never waited for: its times stay unknown
                self._pending.popleft()
            waiting = len(self._pending)
        if waiting >= min(READ_EVERY, self.capacity):
            self._read_events()

    def _read_events(self) -> None:
        """Fill in the times of the CUDA steps whose events completed, oldest first (no sync); also
        from a thread reading the timeline while the loop records.

        A step's events are recorded again for later steps (:meth:`_event`) once nothing reads
        them: its ``asked`` event when the step is read, its ``previous`` (the step before's
        ``ready``, read when that step was) when this one is, and only once completed. The
        events of a step dropped unread are freed, not reused."""
        with self._reading:
            ring = self._ring
            while self._pending:
                index, asked, previous, ready = self._pending[0]
                if not ready.query():
                    return
                self._pending.popleft()
                wait = asked.elapsed_time(ready) / 1000
                self._spare.append(asked)
                step = math.nan
                if previous is None:
                    self._starts += 1
                    self._start_wait_s += wait
                elif previous.query():  # done before ready, unless streams changed
                    step = previous.elapsed_time(ready) / 1000
                    self._wait_s += wait
                    self._step_s += step
                    self._spare.append(previous)
                if index >= ring.written - ring.capacity:  # still kept
                    slot = index % ring.capacity
                    ring.waits[slot], ring.times[slot] = wait, step

    # -- reading ---------------------------------------------------------------------------------

    def steps(self) -> list[Step]:
        """The last ``capacity`` steps, oldest first."""
        self._settle()
        return self._ring.steps()

    def wait_fraction(self) -> float | None:
        """The share of step time the loop waited, over every step with both times (None: none yet)."""
        self._settle()
        return self._wait_s / self._step_s if self._step_s > 0 else None

    def stage_seconds(self, steps: Iterable[Step] | None = None) -> dict[str, float]:
        """Mean seconds per step of each stage, largest first: over the sampled ones of ``steps``,
        else of every step."""
        if steps is None:
            totals, count = dict(self.stage_s), self.sampled_count  # a copy: the loop may add a stage meanwhile
        else:
            sampled = [step.stages for step in steps if step.stages is not None]
            totals, count = {}, len(sampled)
            for stages in sampled:
                for name, seconds in stages.items():
                    totals[name] = totals.get(name, 0.0) + seconds
        if not count:
            return {}
        return dict(sorted(((name, s / count) for name, s in totals.items()), key=lambda kv: -kv[1]))

    def table(self) -> str:
        """The stages as a table: mean ms per step and share of the loader's time, largest first."""
        means = self.stage_seconds()
        total = sum(means.values())
        rows = [f"{'stage':<42} {'ms/step':>9} {'share':>6}"]
        rows += [f"{STAGES.get(name, name):<42} {1e3 * s:>9.3f} {100 * s / total:>5.1f}%"
                 for name, s in means.items() if total > 0]
        return "\n".join(rows)

    def recent(self) -> tuple[float | None, dict[str, float]]:
        """Over the kept steps: the share of step time the loop waited (None: no step with both
        times yet), and each stage's mean seconds per step."""
        steps = self.steps()
        timed = [(step.wait_s, step.step_s) for step in steps if step.wait_s is not None and step.step_s is not None]
        step_s = sum(s for _, s in timed if s is not None)
        fraction = sum(w for w, _ in timed if w is not None) / step_s if step_s > 0 else None
        return fraction, self.stage_seconds(steps)

    def verdict(self) -> Verdict:
        """Data-bound or compute-bound over the kept steps, the top stage and what would help it
        (:func:`gpuload.verdict.verdict`)."""
        if not self.enabled:
            return Verdict("unknown", None, None, (), _OFF)
        return verdict(*self.recent(), self.about() if self.about is not None else None)

    def summary(self) -> str:
        """One line: data-bound or compute-bound, the stage most of the loader's time goes to, and
        the setting that would help; how many of the kept steps had their stages timed; under
        torch.distributed, once gathered, the slowest rank."""
        line = self.verdict().line
        steps = self.steps()
        if steps:
            sampled = sum(1 for step in steps if step.stages is not None)
            line += f"; stages timed on {sampled} of {len(steps)} steps (1 in {self._sample_every})"
        return line if self.ranks is None else f"{line}; {self.ranks.line()}"

    def scalars(self, prefix: str = "gpuload/") -> dict[str, float]:
        """A flat dict for a logger (TensorBoard's ``add_scalars``, Lightning's ``log_dict``):
        the wait share in percent, each epoch's start (its first step's wait, outside the share)
        in mean ms, and each stage's mean ms per step."""
        fraction = self.wait_fraction()
        out = {f"{prefix}wait_percent": math.nan if fraction is None else 100 * fraction,
               f"{prefix}start_wait_ms": 1e3 * self.start_wait_s / self.starts if self.starts else math.nan,
               f"{prefix}steps": float(self.step_count), f"{prefix}sampled_steps": float(self.sampled_count)}
        for name, seconds in self.stage_seconds().items():
            out[f"{prefix}stage_ms/{name}"] = 1e3 * seconds
        return out

    def as_dict(self) -> dict[str, Any]:
        """The running totals as plain data (for logging, JSON, or gathering over ranks)."""
        fraction = self.wait_fraction()
        return {"steps": self.step_count, "sampled_steps": self.sampled_count, "sample_every": self._sample_every,
                "wait_s": self.wait_s, "step_s": self.step_s, "wait_fraction": fraction, "starts": self.starts,
                "start_wait_s": self.start_wait_s, "stage_s": dict(self.stage_s)}

    def __getstate__(self) -> dict[str, Any]:
        self._settle()
        state = dict(self.__dict__)
        state.update(_pending=deque(), _spare=[], _last_ready=None, _asked=None, _stream=None, about=None, ranks=None,
                     log=[], _folded=0, _marks=deque())
        del state["_reading"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for total in _TOTALS:  # pickled when the totals were attributes
            if total in state:
                state[f"_{total}"] = state.pop(total)
        # pickled before these: their defaults
        self.__dict__.update({"_offset": 0, "_spare": [], "log": [], "_folded": 0, "_marks": deque(), "_stream": None,
                              **state})
        self._reading = threading.Lock()

    def __repr__(self) -> str:
        return f"<gpuload Timeline: {self.step_count} steps; {self.summary()}>"



def timeline_of(loader: Any) -> Timeline | None:
    """The timeline of a gpuload loader, also one inside a wrapper (Accelerate's shard and
    Lightning's combined loader hold it as ``base_dataloader``, or among ``iterables`` /
    ``flattened``); None when no gpuload loader is found."""
    timeline = getattr(loader, "timeline", None)
    if isinstance(timeline, Timeline):
        return timeline
    for name in ("base_dataloader", "flattened"):
        inner = getattr(loader, name, None)
        if inner is not None and inner is not loader:
            return timeline_of(inner)
    if isinstance(loader, dict):
        loader = list(loader.values())
    if isinstance(loader, (list, tuple)):
        return next((found for item in loader if (found := timeline_of(item)) is not None), None)
    return None
