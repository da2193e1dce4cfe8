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

The state is a plain dict of Python scalars, lists and CPU tensors (a few kilobytes: never the
data, never an index list that can be drawn again), so it loads on another machine and on
another device type.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.utils.data as tud
from torch.utils.data.distributed import DistributedSampler

__all__ = ["EpochProgress", "LoadedState", "RandomStates", "ResumeError", "STATE_VERSION", "built_batch_size", "load_state", "save_state", "signature", "stateful"]

STATE_VERSION = 1

T = TypeVar("T")


class ResumeError(ValueError):
    """A saved loader state does not fit the loader it is loaded into."""


def stateful(obj: Any) -> bool:
    """Whether ``obj`` saves and restores its own state (``state_dict``/``load_state_dict``)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _generators(loader: tud.DataLoader) -> list[torch.Generator]:
    """The explicit generators an epoch's index order draws from, in a fixed order, each once."""
    found: list[torch.Generator] = []
    sampler: Any = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    candidates = [loader.generator]
    while sampler is not None:
        candidates.append(getattr(sampler, "generator", None))
        inner = getattr(sampler, "sampler", None)  # a batch sampler that wraps another (Accelerate's shard)
        sampler = inner if inner is not None else getattr(sampler, "batch_sampler", None)
    for generator in candidates:
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def _index_sampler(loader: tud.DataLoader) -> Any:
    return loader.batch_sampler if loader.batch_sampler is not None else loader.sampler


@dataclass
class RandomStates:
    """The random states an epoch's index order depends on, captured at one moment."""

    generators: list[torch.Tensor]
    global_state: torch.Tensor
    sampler: Any = None  # the index sampler's own state_dict(), when it has one
    distributed_epoch: int | None = None
    worker_seed_drawn: bool = False  # persistent workers' base seed already drawn (drawn once)

    @classmethod
    def capture(cls, loader: tud.DataLoader) -> RandomStates:
        sampler = _index_sampler(loader)
        inner = getattr(sampler, "sampler", None)
        distributed = sampler if isinstance(sampler, DistributedSampler) else inner
        return cls(
            generators=[g.get_state() for g in _generators(loader)],
            global_state=torch.get_rng_state(),
            sampler=sampler.state_dict() if stateful(sampler) else None,
            distributed_epoch=distributed.epoch if isinstance(distributed, DistributedSampler) else None,
            worker_seed_drawn=getattr(loader, "_persistent_seed_drawn", False),
        )

    def restore_explicit(self, loader: tud.DataLoader) -> None:
        """Set the loader's and samplers' own generators (and stateful samplers) back; the
        global generator is left alone (see :meth:`draw_with_global`)."""
        generators = _generators(loader)
        if len(generators) != len(self.generators):
            raise ResumeError(
                f"the saved state has {len(self.generators)} random generator(s) (loader and samplers) "
                f"but this loader has {len(generators)}; build it with the same generator/sampler arguments"
            )
        for generator, state in zip(generators, self.generators):
            generator.set_state(state)
        if hasattr(loader, "_persistent_seed_drawn"):
            loader._persistent_seed_drawn = self.worker_seed_drawn
        sampler = _index_sampler(loader)
        if self.sampler is not None:
            sampler.load_state_dict(self.sampler)
        if self.distributed_epoch is not None:
            target = sampler if isinstance(sampler, DistributedSampler) else getattr(sampler, "sampler", None)
            if isinstance(target, DistributedSampler):
                target.set_epoch(self.distributed_epoch)

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
            "generators": list(self.generators),
            "global": self.global_state,
            "sampler": self.sampler,
            "distributed_epoch": self.distributed_epoch,
            "worker_seed_drawn": self.worker_seed_drawn,
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> RandomStates:
        return cls(
            generators=[torch.as_tensor(s, dtype=torch.uint8) for s in state["generators"]],
            global_state=torch.as_tensor(state["global"], dtype=torch.uint8),
            sampler=state.get("sampler"),
            distributed_epoch=state.get("distributed_epoch"),
            worker_seed_drawn=bool(state.get("worker_seed_drawn", False)),
        )


# (batches done, samples of the epoch's order done, new batch size) at one ``set_batch_size``
Cut = tuple[int, int, int]


@dataclass
class EpochProgress:
    """How far the loop got in one epoch: its number, the index batches done (handed to the
    loop, or dropped because every file in them was skipped), whether it ended, and the random
    states it began from (the ones after it, once it ended); ``batch_size``: the size its
    batches began with, and ``cuts``: each batch-size change made during it."""

    number: int
    states: RandomStates
    batches: int = 0
    finished: bool = False
    skipped: int = 0  # batches of a resumed epoch not made again
    end_states: RandomStates | None = field(default=None, repr=False)
    batch_size: int | None = None
    cuts: list[Cut] = field(default_factory=list)

    def samples_done(self) -> int:
        """Positions of the epoch's flat sample order done (past its end once the last, shorter
        batch is done: the rest of the order is then empty)."""
        batches, samples, size = self.cuts[-1] if self.cuts else (0, 0, self.batch_size or 1)
        return samples + (self.batches - batches) * size

    def position(self) -> Cut | None:
        """``(batches done, samples done, batch size)`` after a batch-size change (the rest of
        the epoch is its order from there cut at that size), else None."""
        return (self.batches, self.samples_done(), self.cuts[-1][2]) if self.cuts else None

    def cut(self, batch_size: int) -> None:
        """Note a change to ``batch_size`` here: the batches after it are the rest of the order
        cut at that size."""
        self.cuts.append((self.batches, self.samples_done(), batch_size))


def _length(obj: Any) -> int | None:
    try:
        return len(obj)
    except TypeError:
        return None


def signature(loader: tud.DataLoader) -> dict[str, Any]:
    """What must be the same between the loader that saved a state and the one loading it."""
    sampler = _index_sampler(loader)
    inner = getattr(sampler, "sampler", None)
    built = built_batch_size(loader)
    batches = _length(sampler)
    if type(sampler) is tud.BatchSampler and built != loader.batch_size and _length(inner) is not None:
        whole, rest = divmod(len(inner), built)  # what it was before set_batch_size changed it
        batches = whole + (1 if rest and not loader.drop_last else 0)
    return {
        "dataset": type(loader.dataset).__name__,
        "dataset_length": _length(loader.dataset),
        "batch_size": built,
        "drop_last": loader.drop_last,
        "sampler": type(sampler).__name__ + (f"({type(inner).__name__})" if inner is not None else ""),
        "batches_per_epoch": batches,
        "transforms": repr(getattr(loader, "transforms", None)),
    }


def built_batch_size(loader: tud.DataLoader) -> int | None:
    """The batch size ``loader`` was built with (``set_batch_size`` changes the one in force)."""
    return getattr(loader, "_built_batch_size", loader.batch_size)


def check_signature(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise :class:`ResumeError` naming every argument that differs."""
    differs = [
        f"{key}: saved {saved.get(key)!r}, now {current.get(key)!r}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    ]
    if differs:
        raise ResumeError(
            "this loader state was saved by a loader with other arguments or another dataset, so its "
            "position would mean other samples here: " + "; ".join(differs)
        )


def save_state(loader: tud.DataLoader, progress: EpochProgress | None, epoch: int, transform_seed: int) -> dict[str, Any]:
    """The state dict of ``loader`` at ``progress`` (None: no epoch begun; ``epoch`` is then
    the epoch counter as it stands)."""
    epoch_batch_size, cuts = loader.batch_size, []
    if progress is None:
        number, batches, finished, states = epoch, 0, True, RandomStates.capture(loader)
    else:
        number, batches, finished = progress.number, progress.batches, progress.finished
        states = progress.end_states if finished and progress.end_states is not None else progress.states
        if not finished:
            epoch_batch_size, cuts = progress.batch_size, [list(cut) for cut in progress.cuts]
    return {
        "version": STATE_VERSION,
        "signature": signature(loader),
        "epoch": number,
        "batches": batches,
        "finished": finished,
        "transform_seed": transform_seed,
        "random": states.as_dict(),
        "batch_size": loader.batch_size,  # in force now (set_batch_size); the signature's is the built one
        "epoch_batch_size": epoch_batch_size,
        "cuts": cuts,
        "dataset": loader.dataset.state_dict() if stateful(loader.dataset) else None,
    }


@dataclass(frozen=True)
class LoadedState:
    """A checked state: the epoch it was in, the position to take up (None: that epoch had
    ended, and the next ``iter()`` simply starts the one after), the transforms' seed, and the
    batch size in force when it was saved."""

    epoch: int
    resume: EpochProgress | None
    transform_seed: int
    batch_size: int | None = None


def load_state(loader: tud.DataLoader, state: dict[str, Any], *, iterable: bool) -> LoadedState:
    """Check ``state`` against ``loader`` and restore what is restored at once: the dataset's own
    state and, when the saved epoch had ended, the generators. A position inside an epoch is
    returned for the next ``iter()`` to take up."""
    if state.get("version") != STATE_VERSION:
        raise ResumeError(f"loader state version {state.get('version')!r} is not {STATE_VERSION}")
    check_signature(state["signature"], signature(loader))
    if state["dataset"] is not None:
        loader.dataset.load_state_dict(state["dataset"])
    states = RandomStates.from_dict(state["random"])
    batch_size = state.get("batch_size", state["signature"]["batch_size"])
    if state["finished"]:
        states.restore_explicit(loader)
        return LoadedState(state["epoch"], None, state["transform_seed"], batch_size)
    done = state["batches"]
    if iterable and (state["dataset"] is None or loader.num_workers > 0):
        warnings.warn(
            f"gpuload: this {type(loader.dataset).__name__} was saved mid-epoch, but an iterable dataset "
            "resumes only from its own state_dict() read without workers; the loader starts that "
            "epoch again from its beginning",
            stacklevel=3,
        )
        done = 0
    cuts = [(int(b), int(n), int(size)) for b, n, size in state.get("cuts", [])] if done else []
    progress = EpochProgress(state["epoch"], states, batches=done, skipped=done,
                             batch_size=state.get("epoch_batch_size", batch_size), cuts=cuts)
    return LoadedState(state["epoch"], progress, state["transform_seed"], batch_size)
