"""Exact mid-epoch resume: what a loader's position is, and how an epoch is taken up again.

A position is (epoch, batches handed to the loop, finished or not) plus the random states the
epoch's index order was drawn from, as they stood when the epoch began: the generators of the
loader and of its samplers, and torch's global generator. Resuming sets the explicit
generators back to those states, draws the epoch's index batches again (the global generator
only inside ``fork_rng``, so the training's own random stream is left as the user restored it)
and drops the batches already delivered: nothing is read, decoded or transformed for them.
Transforms need only (seed, epoch, sample index), which the state carries.

After ``set_batch_size`` the position is kept in samples too: the epoch's flat sample order is
drawn from the same states, and the batches after each change are the rest of that order cut
at the new size. The state records each change (batches done, samples done, new size), so a
resumed epoch lands on the same sample with the same batches.

What cannot be restored is said, never passed over: a sampler that keeps a random generator
of its own that gpuload cannot read (any attribute but ``generator``, without
``state_dict``/``load_state_dict``) gets one warning naming it and what to do; a state that
does not fit the loader (another dataset, arguments, DistributedSampler seed, generators)
raises :class:`ResumeError` at ``load_state_dict``.

The state is a plain dict of Python scalars, strings and lists, the generators' states as base64
text (a few kilobytes: never the data, never an index list that can be drawn again), so it
goes through JSON when the samplers' and dataset's own states do, and loads on another
machine and on another device type.
"""

from __future__ import annotations

import base64
import itertools
import random
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.utils.data as tud
from torch.utils.data.distributed import DistributedSampler

from gpuload.sampling import DrawState, begin_drawing, cut_order, draw_epoch, draw_order, epoch_order
from gpuload.state_format import STATE_VERSION, ResumeError, check_format, decoded_generator_state

__all__ = [
    "STATE_VERSION",
    "LoadedState",
    "Position",
    "RandomStates",
    "ResumeError",
    "begin_epoch",
    "load_state",
    "remaining_batches",
    "save_state",
    "signature",
    "stateful",
    "stream_ended",
    "stream_of",
    "take_up_iterable",
    "unrestorable",
]

T = TypeVar("T")


def stateful(obj: Any) -> bool:
    """Whether ``obj`` saves and restores its own state (``state_dict``/``load_state_dict``)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _samplers(draw: DrawState) -> list[Any]:
    """The index sampler and the samplers it draws from (``.sampler``, or ``.batch_sampler`` for
    a batch sampler that wraps another, as Accelerate's shard does), outermost first."""
    chain: list[Any] = []
    sampler: Any = draw.index_sampler
    while sampler is not None and all(sampler is not seen for seen in chain):
        chain.append(sampler)
        inner = getattr(sampler, "sampler", None)
        sampler = inner if inner is not None else getattr(sampler, "batch_sampler", None)
    return chain


def _generators(draw: DrawState) -> list[torch.Generator]:
    """The explicit generators an epoch's index order draws from, in a fixed order, each once."""
    found: list[torch.Generator] = []
    candidates = [draw.generator, *(getattr(sampler, "generator", None) for sampler in _samplers(draw))]
    for generator in candidates:
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


@dataclass
class RandomStates:
    """The random states an epoch's index order depends on, captured at one moment."""

    generators: list[torch.Tensor]
    global_state: torch.Tensor
    samplers: list[Any] = field(default_factory=list)  # each sampler's own state_dict(), or None
    distributed_epoch: int | None = None
    worker_seed_drawn: bool = False  # persistent workers' base seed already drawn (drawn once)

    @classmethod
    def capture(cls, draw: DrawState) -> RandomStates:
        chain = _samplers(draw)
        distributed = next((s for s in chain if isinstance(s, DistributedSampler)), None)
        return cls(
            generators=[g.get_state() for g in _generators(draw)],
            global_state=torch.get_rng_state(),
            samplers=[sampler.state_dict() if stateful(sampler) else None for sampler in chain],
            distributed_epoch=distributed.epoch if distributed is not None else None,
            worker_seed_drawn=draw.seed_drawn,
        )

    def check_fits(self, draw: DrawState) -> None:
        """Raise :class:`ResumeError` when the loader (``draw``) has another number of generators (loader
        and samplers) than the state saved: their states would set the wrong ones."""
        generators = _generators(draw)
        if len(generators) != len(self.generators):
            raise ResumeError(
                f"the saved state has {len(self.generators)} random generator(s) (loader and samplers) "
                f"but this loader has {len(generators)}; build it with the same generator/sampler arguments "
                "(a generator= passed or not, to the loader and to its sampler)"
            )
        for place, (generator, state) in enumerate(zip(generators, self.generators)):
            try:
                torch.Generator(device=generator.device).set_state(state)
            except RuntimeError as error:
                raise ResumeError(
                    f"this loader state's 'random.generators[{place}]' is not a state of this loader's "
                    f"{generator.device.type} generator there ({error})"
                ) from None

    def restore_explicit(self, draw: DrawState) -> None:
        """Set the loader's and samplers' own generators (and stateful samplers) back; the
        global generator is left alone (see :meth:`draw_with_global`)."""
        self.check_fits(draw)
        for generator, state in zip(_generators(draw), self.generators):
            generator.set_state(state)
        draw.seed_drawn = self.worker_seed_drawn
        chain = _samplers(draw)
        for sampler, state in zip(chain, self.samplers):
            if state is not None:
                sampler.load_state_dict(state)
        if self.distributed_epoch is not None:
            for sampler in chain:
                if isinstance(sampler, DistributedSampler):
                    sampler.set_epoch(self.distributed_epoch)
                    break

    def draw_with_global(self, draw: Callable[[], Iterator[Any]]) -> list[Any]:
        """The whole of ``draw()``, made with torch's global generator as it was captured; the
        live global generator is left as it was (the training's stream is the user's)."""
        return self.with_global(lambda: list(draw()))

    def with_global(self, make: Callable[[], T]) -> T:
        """``make()`` run with torch's global generator as it was captured (see
        :meth:`draw_with_global`)."""
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.global_state)
            return make()

    def as_dict(self) -> dict[str, Any]:
        return {
            "generators": [_encoded(state) for state in self.generators],
            "global": _encoded(self.global_state),
            "samplers": list(self.samplers),
            "distributed_epoch": self.distributed_epoch,
            "worker_seed_drawn": self.worker_seed_drawn,
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> RandomStates:
        return cls(
            generators=[decoded_generator_state(f"random.generators[{place}]", saved)
                        for place, saved in enumerate(state["generators"])],
            global_state=decoded_generator_state("random.global", state["global"]),
            samplers=list(state.get("samplers", [state.get("sampler")])),
            distributed_epoch=state.get("distributed_epoch"),
            worker_seed_drawn=bool(state.get("worker_seed_drawn", False)),
        )


def _encoded(generator_state: torch.Tensor) -> str:
    """A generator's state as base64 text: the state stays JSON-safe (as torchdata's) and small."""
    return base64.b64encode(generator_state.numpy().tobytes()).decode("ascii")


# (batches done, samples of the epoch's order done, new batch size) at one ``set_batch_size``
Cut = tuple[int, int, int]


@dataclass
class Position:
    """How far the loop got in one epoch: its number, the index batches done (handed to the
    loop, or dropped because every file in them was skipped), whether it ended, and the random
    states it began from (the ones after it, once it ended); ``batch_size``: the size its
    batches began with, and ``cuts``: each batch-size change made during it.
    ``sampler_started``: the sampler had begun drawing the epoch's order (False between
    ``iter()`` and the first batch of an epoch drawn in the loop: its draws from torch's global
    generator come after that point, and a resumed epoch makes them from the live one).
    ``delivered``: the places (among the epoch's index batches) of the batches done, when
    workers handed them over as they finished (``in_order=False``): then they need not be the
    first ones. ``dataset_state``, ``stream_state``: a
    resumed iterable dataset's own state and its iterator's, loaded by :func:`take_up_iterable`;
    ``stream_ended``: its stream had ended inside the epoch (torch's fetcher met its end filling
    the last, shorter batch), so the rest of the epoch is empty whatever the dataset's state says."""

    number: int
    states: RandomStates
    batches: int = 0
    finished: bool = False
    skipped: int = 0  # batches of a resumed epoch not made again
    end_states: RandomStates | None = field(default=None, repr=False)
    batch_size: int | None = None
    cuts: list[Cut] = field(default_factory=list)
    sampler_started: bool = True
    delivered: set[int] | None = None  # places of the batches done, when handed over out of order
    places: list[int] | None = None  # a resumed epoch's: each remaining batch's place in the epoch
    untracked: bool = False  # a batch was handed over out of order at a place not told
    dataset_state: Any = None  # a resumed iterable dataset's own state (take_up_iterable)
    stream_state: Any = None  # the state of the iterator its __iter__ returned, when it has one
    stream_ended: bool = False  # torch's fetcher had run the stream to its end (a partial last batch)

    def samples_done(self) -> int:
        """Positions of the epoch's flat sample order done (past its end once the last, shorter
        batch is done: the rest of the order is then empty)."""
        batches, samples, size = self.cuts[-1] if self.cuts else (0, 0, self.batch_size or 1)
        return samples + (self.batches - batches) * size

    def after_cut(self) -> Cut | None:
        """``(batches done, samples done, batch size)`` after a batch-size change (the rest of
        the epoch is its order from there cut at that size), else None."""
        return (self.batches, self.samples_done(), self.cuts[-1][2]) if self.cuts else None

    def hand_over(self, place: int | None) -> None:
        """Note that the batch at ``place`` of the epoch's index batches was handed to the loop
        (out of order: the first ones done before, in order, are those a resume skipped); None:
        its place could not be told, and a state of this epoch cannot be exact."""
        if self.delivered is None:
            self.delivered = set(range(self.skipped))
        if place is None:
            self.untracked = True
        else:
            self.delivered.add(place)

    def cut(self, batch_size: int) -> None:
        """Note a change to ``batch_size`` here: the batches after it are the rest of the order
        cut at that size."""
        self.cuts.append((self.batches, self.samples_done(), batch_size))


def _notes_first_pull(inner: Iterator[Any], position: Position) -> Iterator[Any]:
    """``inner``, noting on ``position`` when the sampler begins to draw (its first pull)."""
    position.sampler_started = False
    return itertools.chain(_note_started(position), inner)  # after the first pull, inner's own pace


def _note_started(position: Position) -> Iterator[Any]:
    """Nothing, noting ``position.sampler_started`` when asked for its (absent) first item."""
    position.sampler_started = True
    yield from ()


def begin_epoch(
    draw: DrawState, number: int, resume: Position | None
) -> tuple[Position, Callable[[], Iterator[Any]], Callable[[], int] | None]:
    """An epoch's position, its index draw, and its length when that is not the index
    sampler's: a new epoch ``number`` drawn as torch draws it, or ``resume`` taken up where it
    was saved (the batches done dropped, nothing of them read; after a batch-size change, in
    the epoch or before the save, the rest of its sample order cut at the new size)."""
    if resume is None:
        position = Position(number, RandomStates.capture(draw), batch_size=draw.batch_size)
        return position, lambda: _notes_first_pull(draw_epoch(draw), position), None
    if not draw.map_style:
        return resume, lambda: draw_epoch(draw), None  # an iterable dataset continues from its own state
    if resume.cuts:
        remaining = remaining_batches(draw, resume)
    else:
        resume.states.restore_explicit(draw)
        if not resume.sampler_started:
            # Saved before the sampler drew: what ``iter()`` drew (the workers' base seed) comes
            # from the saved global state, the sampler's own draws from the live generator, as
            # in the uninterrupted run, which made them after the save.
            drawn = resume.states.with_global(lambda: draw_epoch(draw))
            return resume, lambda: _notes_first_pull(drawn, resume), None
        epoch_draws = resume.states.draw_with_global(lambda: draw_epoch(draw))
        if resume.delivered is None:
            resume.places = list(range(resume.batches, len(epoch_draws)))
        else:  # handed over out of order: the ones not done, wherever they are
            resume.places = [place for place in range(len(epoch_draws)) if place not in resume.delivered]
        remaining = [epoch_draws[place] for place in resume.places]
    done = resume.batches
    return resume, lambda: iter(remaining), lambda: done + len(remaining)


def stream_of(torch_iterator: Any) -> Any:
    """The iterator that ``iter(dataset)`` gave torch's single-process iterator of an iterable
    dataset (None for workers: theirs live in the worker processes)."""
    return getattr(getattr(torch_iterator, "_dataset_fetcher", None), "dataset_iter", None)


def stream_ended(torch_iterator: Any) -> bool:
    """Whether torch's single-process iterator of an iterable dataset has met the end of the
    stream (filling a last, shorter batch: the loop has not seen the epoch end yet)."""
    return bool(getattr(getattr(torch_iterator, "_dataset_fetcher", None), "ended", False))


def take_up_iterable(draw: DrawState, position: Position, make_iterator: Callable[[], Iterator[T]]) -> Iterator[T]:
    """torch's iterator (``make_iterator()``) for a resumed epoch of an iterable dataset, made
    from the random states the epoch began with (the loader's generator, and the global one
    inside ``fork_rng``), as the uninterrupted run made it.

    A dataset's own state is loaded as ``StatefulDataLoader`` loads it: into the dataset before
    ``__iter__`` (which may take a loaded position up), and into the iterator ``__iter__``
    returned when that one has ``state_dict`` (the dataset itself, whose ``__iter__`` may have
    reset it, or an iterator of its own, whose state was saved beside). A dataset without one
    (or read by workers, which hold its state) is replayed: the batches done are read again and
    dropped, the global generator inside ``fork_rng`` going through the draws made for them."""
    position.states.restore_explicit(draw)
    dataset_state, stream_state = position.dataset_state, position.stream_state
    if dataset_state is not None or stream_state is not None:
        if dataset_state is not None:
            draw.dataset.load_state_dict(dataset_state)
        iterator = position.states.with_global(make_iterator)
        stream = stream_of(iterator)
        if stream is draw.dataset and dataset_state is not None:
            draw.dataset.load_state_dict(dataset_state)
        elif stream_state is not None and stateful(stream):
            stream.load_state_dict(stream_state)
        if position.stream_ended:  # the saved states are those after the end: the rest is empty
            iterator._dataset_fetcher.ended = True  # type: ignore[attr-defined]  # torch's iterator has it; its stub does not
        return iterator

    def replayed() -> Iterator[T]:
        iterator = make_iterator()
        for done in range(position.batches):
            try:
                next(iterator)
            except StopIteration:
                raise ResumeError(
                    f"this {type(draw.dataset).__name__} ended after {done} batches while its saved epoch "
                    f"had given {position.batches}: replaying it does not give the saved stream (its data "
                    "changed, or it draws random numbers the state does not capture)"
                ) from None
        return iterator

    return position.states.with_global(replayed)


def remaining_batches(draw: DrawState, position: Position) -> list[Any]:
    """The epoch's sample order drawn again from the states it began with (the generators
    then stand where a whole epoch leaves them), after the samples done, cut at the last
    batch size set."""
    position.states.restore_explicit(draw)
    if position.sampler_started:
        order = position.states.with_global(lambda: draw_order(draw))
    else:  # the sampler draws now, from the live global generator (see begin_epoch)
        position.states.with_global(lambda: begin_drawing(draw))
        order, position.sampler_started = epoch_order(draw.batch_sampler.sampler), True
    return cut_order(order[position.samples_done() :], position.cuts[-1][2], draw.drop_last)


def _length(obj: Any) -> int | None:
    try:
        return len(obj)
    except TypeError:
        return None


# Signature entries added after STATE_VERSION 1 first shipped: a state without them still loads.
_ADDED_LATER = ("sampler_seed", "sampler_shuffle")


def signature(draw: DrawState) -> dict[str, Any]:
    """What must be the same between the loader that saved a state and the one loading it."""
    sampler = draw.index_sampler
    inner = getattr(sampler, "sampler", None)
    built = draw.built_batch_size
    batches = _length(sampler)
    inner_length = _length(inner)
    if type(sampler) is tud.BatchSampler and built is not None and built != draw.batch_size \
            and inner_length is not None:
        whole, rest = divmod(inner_length, built)  # what it was before set_batch_size changed it
        batches = whole + (1 if rest and not draw.drop_last else 0)
    distributed = next((s for s in _samplers(draw) if isinstance(s, DistributedSampler)), None)
    return {
        "dataset": type(draw.dataset).__name__,
        "dataset_length": _length(draw.dataset),
        "batch_size": built,
        "drop_last": draw.drop_last,
        "sampler": type(sampler).__name__ + (f"({type(inner).__name__})" if inner is not None else ""),
        "batches_per_epoch": batches,
        "transforms": repr(draw.transforms),
        # a DistributedSampler's order is its seed's (and the epoch's): another seed, other samples
        "sampler_seed": distributed.seed if distributed is not None else None,
        "sampler_shuffle": distributed.shuffle if distributed is not None else None,
    }


def check_signature(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise :class:`ResumeError` naming every argument that differs."""
    differs = [
        f"{key}: saved {saved.get(key)!r}, now {current.get(key)!r}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key) and (key in saved or key not in _ADDED_LATER)
    ]
    if differs:
        raise ResumeError(
            "this loader state was saved by a loader with other arguments or another dataset, so its "
            "position would mean other samples here: " + "; ".join(differs)
        )


# torch's samplers whose randomness the state captures (their ``generator``, a
# DistributedSampler's seed and epoch); any other sampler is looked into for generators of its own.
_KNOWN_SAMPLERS = (tud.BatchSampler, tud.SequentialSampler, tud.RandomSampler, tud.SubsetRandomSampler,
                   tud.WeightedRandomSampler, DistributedSampler)


def _is_rng(value: Any) -> bool:
    return isinstance(value, (torch.Generator, random.Random)) or (
        type(value).__module__.startswith("numpy.random") and type(value).__name__ in ("Generator", "RandomState"))


def unrestorable(draw: DrawState) -> str | None:
    """Why a resumed epoch of ``draw``'s loader could draw another order than the saved one, or None:
    a sampler without ``state_dict``/``load_state_dict`` that keeps a random generator the state
    does not capture (one under another name than ``generator``, NumPy's or Python's)."""
    for sampler in _samplers(draw):
        if type(sampler) in _KNOWN_SAMPLERS or stateful(sampler):
            continue
        attributes = getattr(sampler, "__dict__", {})
        kept = [name for name, value in attributes.items()
                if _is_rng(value) and not (name == "generator" and isinstance(value, torch.Generator))]
        if kept:
            name = type(sampler).__name__
            return (
                f"{name} keeps a random generator of its own ({', '.join(kept)}) that gpuload cannot save, "
                f"so a resumed epoch would draw another order than the saved one: give {name} "
                "state_dict()/load_state_dict() methods that save and restore it (gpuload calls them), "
                "or let it draw from a torch.Generator in its `generator` attribute"
            )
    return None


_warned: weakref.WeakSet[DrawState] = weakref.WeakSet()  # loaders (their draw states) warned by warn_unrestorable


def warn_unrestorable(draw: DrawState) -> None:
    """Warn once per loader when its resume cannot be exact (see :func:`unrestorable`)."""
    reason = unrestorable(draw)
    if reason is not None and draw not in _warned:
        _warned.add(draw)
        warnings.warn(f"gpuload: resume is not exact: {reason}", RuntimeWarning, stacklevel=3)


def save_state(draw: DrawState, progress: Position | None, epoch: int, transform_seed: int,
               stream: Any = None, ended: bool = False) -> dict[str, Any]:
    """The state dict of ``draw``'s loader at ``progress`` (None: no epoch begun; ``epoch`` is then
    the epoch counter as it stands); ``stream``: the iterator an iterable dataset's ``__iter__``
    gave the epoch in progress (:func:`stream_of`), saved when it has its own state; ``ended``:
    torch's iterator of that epoch had met the stream's end (:func:`stream_ended`)."""
    warn_unrestorable(draw)
    epoch_batch_size, cuts, started, delivered = draw.batch_size, [], True, None
    if progress is None:
        number, batches, finished, states = epoch, 0, True, RandomStates.capture(draw)
    else:
        number, batches, finished = progress.number, progress.batches, progress.finished
        states = progress.end_states if finished and progress.end_states is not None else progress.states
        if not finished:
            epoch_batch_size, cuts = progress.batch_size, [list(cut) for cut in progress.cuts]
            started = progress.sampler_started
            delivered = _packed(progress.delivered)
            if progress.untracked:
                _warn_once(draw, "gpuload: resume is not exact: torch's iterator did not tell which batches its "
                                   "workers handed over (in_order=False); the state assumes the first ones")
                delivered = None
            if batches and _replays_out_of_order(draw):
                _warn_once(draw, _REPLAY_OUT_OF_ORDER)
    return {
        "version": STATE_VERSION,
        "signature": signature(draw),
        "epoch": number,
        "batches": batches,
        "finished": finished,
        "transform_seed": transform_seed,
        "random": states.as_dict(),
        "batch_size": draw.batch_size,  # in force now (set_batch_size); the signature's is the built one
        "epoch_batch_size": epoch_batch_size,
        "cuts": cuts,
        "sampler_started": started,
        "out_of_order": delivered,
        "dataset": _dataset_state(draw, progress),
        "dataset_iterator": _stream_state(draw, progress, stream),
        "stream_ended": progress is not None and not progress.finished and (progress.stream_ended or ended),
    }


def _stream_state(draw: DrawState, progress: Position | None, stream: Any) -> Any:
    """The own state of the iterator an iterable dataset's ``__iter__`` returned (not the dataset
    itself, saved already), read in this process; a loaded one not taken up yet is that one."""
    if progress is None or progress.finished or draw.num_workers > 0:
        return None
    if progress.stream_state is not None:
        return progress.stream_state
    return stream.state_dict() if stream is not None and stream is not draw.dataset and stateful(stream) else None


def _dataset_state(draw: DrawState, progress: Position | None) -> Any:
    """The dataset's own ``state_dict()`` where it is the loop's position: a map-style dataset,
    or an iterable one read in this process (read by workers, its state lives in their copies:
    the main process's copy never iterated). A state loaded and not taken up yet is that one."""
    if not stateful(draw.dataset):
        return None
    if not draw.map_style:
        if draw.num_workers > 0:
            return None
        if progress is not None and progress.dataset_state is not None:
            return progress.dataset_state
    return draw.dataset.state_dict()


_REPLAY_OUT_OF_ORDER = (
    "gpuload: resume is not exact for an iterable dataset read by workers with in_order=False: it is "
    "replayed, and the batches the replay drops are the first its workers hand over, which depends on "
    "their timing; use in_order=True for an exact resume"
)
_warned_replay: weakref.WeakSet[DrawState] = weakref.WeakSet()  # loaders warned of an out-of-order replay


def _replays_out_of_order(draw: DrawState) -> bool:
    return not draw.map_style and draw.num_workers > 0 and not draw.in_order


def _warn_once(draw: DrawState, message: str) -> None:
    if draw not in _warned_replay:
        _warned_replay.add(draw)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def _packed(delivered: set[int] | None) -> dict[str, Any] | None:
    """The places of the batches done, handed over out of order, as the first ``prefix`` of the
    epoch and the ``others`` after it (a few, however long the epoch); None: in order."""
    if delivered is None:
        return None
    prefix = 0
    while prefix in delivered:
        prefix += 1
    return {"prefix": prefix, "others": sorted(place for place in delivered if place > prefix)}


def _unpacked(packed: Any) -> set[int] | None:
    if packed is None:
        return None
    return set(range(int(packed["prefix"]))) | {int(place) for place in packed["others"]}




@dataclass(frozen=True)
class LoadedState:
    """A checked state: the epoch it was in, the position to take up (None: that epoch had
    ended, and the next ``iter()`` simply starts the one after), the transforms' seed, and the
    batch size in force when it was saved."""

    epoch: int
    resume: Position | None
    transform_seed: int
    batch_size: int | None = None


def _check_own_states(draw: DrawState, state: dict[str, Any]) -> None:
    """ResumeError naming the key of ``state`` that holds an own state no part of the loader (``draw``) takes:
    a dataset's without ``state_dict``, a sampler's without one, an iterator's or a stream's end
    for a map-style dataset."""
    if state["dataset"] is not None and not stateful(draw.dataset):
        raise ResumeError(f"this loader state holds a 'dataset' state, but this {type(draw.dataset).__name__} has "
                          "no state_dict()/load_state_dict() to take it: build the loader over the dataset that "
                          "saved it")
    for key in ("dataset_iterator", "stream_ended"):
        if state.get(key) and draw.map_style:
            raise ResumeError(f"this loader state's {key!r} is {state[key]!r}, which only an iterable dataset's "
                              f"epoch saves, but this loader's {type(draw.dataset).__name__} is map-style")
    chain = _samplers(draw)
    for place, own in enumerate(state["random"].get("samplers", [])):
        if own is not None and (place >= len(chain) or not stateful(chain[place])):
            raise ResumeError(f"this loader state's 'random.samplers[{place}]' is a sampler's own state, but this "
                              "loader has no sampler with state_dict()/load_state_dict() there")


def _check_batches_fit(draw: DrawState, position: Position) -> None:
    """ResumeError when ``position`` has more batches (or samples, after a batch-size change)
    done than its epoch has: taken up, it would be an empty epoch or other samples."""
    if not draw.map_style:
        return  # a stream's length is known only at its end
    batch_sampler = draw.batch_sampler
    samples = _length(batch_sampler.sampler) if type(batch_sampler) is tud.BatchSampler else None
    if samples is not None:
        done, samples_done, size = position.cuts[-1] if position.cuts else (0, 0, position.batch_size or 1)
        if samples_done > samples:
            raise ResumeError(f"this loader state's 'cuts' put {samples_done} samples done in an epoch of {samples}")
        rest = samples - samples_done
        most: int | None = done + (rest // size if draw.drop_last else -(-rest // size))
    elif position.cuts:
        raise ResumeError("this loader state's 'cuts' change the batch size, but this loader's batches are not "
                          "cut by torch's BatchSampler (batch_size=None or batch_sampler=)")
    else:
        most = _length(draw.index_sampler)
    if most is not None and position.batches > most:
        raise ResumeError(f"this loader state's 'batches' is {position.batches}, but epoch {position.number} of this "
                          f"loader has {most} batches: the state was edited, or saved by another loader")


def load_state(draw: DrawState, state: dict[str, Any]) -> LoadedState:
    """Check ``state`` against ``draw``'s loader and restore what is restored at once: the dataset's own
    state and, when the saved epoch had ended, the generators. A position inside an epoch is
    returned for the next ``iter()`` to take up."""
    state = check_format(state)
    check_signature(state["signature"], signature(draw))
    states = RandomStates.from_dict(state["random"])
    states.check_fits(draw)
    _check_own_states(draw, state)
    warn_unrestorable(draw)
    iterable = not draw.map_style
    # an iterable dataset's own state, saved without workers, is loaded into the dataset only
    # once the resumed epoch's iterator has called its __iter__ (take_up_iterable)
    dataset_state = state["dataset"] if not iterable or draw.num_workers == 0 else None
    stream_state = state.get("dataset_iterator") if iterable and draw.num_workers == 0 else None
    deferred = iterable and not state["finished"]
    batch_size = state.get("batch_size", state["signature"].get("batch_size"))
    progress = None
    if not state["finished"]:
        done = state["batches"]
        cuts = [(int(b), int(n), int(size)) for b, n, size in state.get("cuts", [])] if done else []
        progress = Position(state["epoch"], states, batches=done, skipped=done,
                            batch_size=state.get("epoch_batch_size", batch_size), cuts=cuts,
                            sampler_started=bool(state.get("sampler_started", True)) or done > 0,
                            dataset_state=dataset_state if deferred else None, stream_state=stream_state,
                            delivered=_unpacked(state.get("out_of_order")) if done else None,
                            stream_ended=bool(state.get("stream_ended", False)))
        _check_batches_fit(draw, progress)
    if dataset_state is not None and not deferred:
        draw.dataset.load_state_dict(dataset_state)
    if progress is None:
        states.restore_explicit(draw)
        return LoadedState(state["epoch"], None, state["transform_seed"], batch_size)
    if progress.batches and _replays_out_of_order(draw):
        _warn_once(draw, _REPLAY_OUT_OF_ORDER)
    return LoadedState(state["epoch"], progress, state["transform_seed"], batch_size)
