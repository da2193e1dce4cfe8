"""A loader state saved at another world size (an elastic restart: 8 ranks, then 4).

torch's ``DistributedSampler`` orders an epoch as a function of (seed, epoch, shuffle, dataset
length) alone and deals that order out in turn: rank r of W takes positions r, r+W, r+2W, ...
After b batches of B samples on every rank, the ranks together have taken exactly the first
b·B·W positions of the epoch's order. At W' ranks with batches of B', the ranks have taken the
first k·B'·W' positions after k batches each. So the saved point can be taken up exactly when
k = b·B·W / (B'·W') is a whole number: the rest of the epoch is then the same order from the
same position, dealt over the new ranks (only the padding at the very end follows the new world
size, as DistributedSampler pads for it). A state saved at an epoch's end loads at any world
size (the next epoch depends on seed and epoch only). Anything else raises
:class:`gpuload.resume.ResumeError` saying which world sizes and batch sizes would take it up.

A state records the split it was saved under (``distributed``: the DistributedSampler's
``num_replicas``, ``seed``, ``shuffle``, ``drop_last``; None without one); a state without it
(saved before it existed) loads as before, at the same world size only.
"""

from __future__ import annotations

from typing import Any

import torch.utils.data as tud
from torch.utils.data.distributed import DistributedSampler

from gpuload.resume import ResumeError, signature
from gpuload.sampling import DrawState

__all__ = ["distributed_layout", "for_this_world_size"]


def _distributed_sampler(loader: tud.DataLoader | DrawState) -> DistributedSampler | None:
    """The DistributedSampler that chooses ``loader``'s indices (itself, or under its batch sampler)."""
    sampler = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    for candidate in (sampler, getattr(sampler, "sampler", None)):
        if isinstance(candidate, DistributedSampler):
            return candidate
    return None


def distributed_layout(loader: tud.DataLoader | DrawState) -> dict[str, Any] | None:
    """How ``loader``'s DistributedSampler splits the data (None without one)."""
    sampler = _distributed_sampler(loader)
    if sampler is None:
        return None
    return {"num_replicas": int(sampler.num_replicas), "seed": int(sampler.seed),
            "shuffle": bool(sampler.shuffle), "drop_last": bool(sampler.drop_last)}


def for_this_world_size(draw: DrawState, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as the loader that ``draw`` draws for would have saved it at the same point of
    the epoch's order, when it was saved at another world size (see the module's docstring);
    ``state`` itself when the world size is the same or no DistributedSampler is involved.
    Raises ResumeError otherwise."""
    if not isinstance(state, dict) or not isinstance(state.get("signature"), dict):
        return state  # not a state: load_state names what is wrong with it
    saved, here = state.get("distributed"), distributed_layout(draw)
    if saved is None or here is None:
        return state
    # the seed and shuffle are in the signature (resume.signature); drop_last of the sampler is not
    differs = [f"{key}: saved {saved[key]!r}, now {here[key]!r}" for key in ("drop_last",)
               if saved.get(key) != here[key]]
    if differs:
        raise ResumeError("this loader state was saved with a DistributedSampler that orders the epoch "
                          "differently: " + "; ".join(differs))
    old_world, new_world = int(saved["num_replicas"]), here["num_replicas"]
    if old_world == new_world:
        return state
    rescaled = dict(state)
    current = signature(draw)
    rescaled["signature"] = {**state["signature"], "batches_per_epoch": current["batches_per_epoch"],
                             "batch_size": current["batch_size"]}
    rescaled["distributed"] = here
    rescaled["batch_size"] = draw.batch_size
    if state["finished"]:
        return rescaled
    if state.get("cuts"):
        raise ResumeError(
            f"this loader state was saved at world size {old_world} in an epoch whose batch size changed "
            "(set_batch_size); resume it at that world size, or from a checkpoint at an epoch's end"
        )
    size = draw.batch_size
    if size is None or type(draw.batch_sampler) is not tud.BatchSampler:
        raise ResumeError(
            f"this loader state was saved at world size {old_world}; taking it up at world size {new_world} "
            "needs torch's BatchSampler over the DistributedSampler (batch_size=..., sampler=DistributedSampler)"
        )
    batches, saved_size = int(state["batches"]), int(state.get("epoch_batch_size") or state["signature"]["batch_size"])
    taken = batches * saved_size * old_world
    if taken % (size * new_world):
        raise ResumeError(
            f"this loader state was saved at world size {old_world} after {batches} batches of {saved_size} on "
            f"every rank: the first {taken} samples of epoch {state['epoch']}'s order. At world size {new_world} "
            f"with batches of {size}, the ranks take {size * new_world} samples a step, and {taken} is not a "
            f"multiple of that, so no batch ends there. Resume it where {taken} is a multiple of world size x "
            f"batch size ({_fitting(taken, size, new_world)}), or from a checkpoint at an epoch's end "
            "(any world size)"
        )
    rescaled["batches"] = taken // (size * new_world)
    rescaled["epoch_batch_size"] = size
    return rescaled


def _fitting(taken: int, size: int, world: int) -> str:
    """Ways to take up ``taken`` samples: world sizes at this batch size, batch sizes at this world size."""
    worlds = [w for w in range(1, 257) if taken % (w * size) == 0][:8]
    sizes = [b for b in range(1, 4097) if taken % (b * world) == 0][-4:]
    ways = []
    if worlds:
        ways.append(f"at batch size {size}: world size {', '.join(map(str, worlds))}")
    if sizes:
        ways.append(f"at world size {world}: batch size {', '.join(map(str, sizes))}")
    return "; ".join(ways) or "no world size fits"

