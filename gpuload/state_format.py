"""The shape of a saved loader state: what each key may hold, checked before anything is restored.

A state comes from a file, often from another job or another version of the code. Every key of
it is checked here for its type and for the positions it can stand for (an epoch from -1, a
count of batches from 0, a cut within the batches done, ...), so an impossible position is a
:class:`ResumeError` naming the key, never a batch served twice, an empty epoch or a bare
``TypeError``. What depends on the loader it is loaded into (batches per epoch, the generators'
kinds, a dataset with its own state) is checked by ``gpuload.resume.load_state``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["STATE_VERSION", "ResumeError", "check_format", "decoded_generator_state"]

STATE_VERSION = 1


class ResumeError(ValueError):
    """A saved loader state does not fit the loader it is loaded into."""


_REQUIRED = ("signature", "epoch", "batches", "finished", "transform_seed", "random", "dataset")


def check_format(state: Any) -> dict[str, Any]:
    """``state`` as a dict when it is a whole, possible state of this version; else the
    :class:`ResumeError` naming the first key that is missing or holds what no loader saves."""
    if not isinstance(state, Mapping):
        raise ResumeError(
            f"load_state_dict takes the dict that gpuload.DataLoader.state_dict() returned, not "
            f"{type(state).__name__}"
        )
    if state.get("version") != STATE_VERSION:
        raise ResumeError(f"loader state version {state.get('version')!r} is not {STATE_VERSION}")
    missing = [key for key in _REQUIRED if key not in state]
    missing += [f"random.{key}" for key in ("generators", "global")
                if isinstance(state.get("random"), Mapping) and key not in state["random"]]
    if missing or not isinstance(state["signature"], Mapping) or not isinstance(state["random"], Mapping):
        raise ResumeError(
            f"this loader state lacks {', '.join(missing) or 'a dict signature/random'}: it is not a whole "
            "gpuload.DataLoader.state_dict() (cut short, or made by another loader class)"
        )
    state = dict(state)
    for key, check in _CHECKS.items():
        if key in state:
            check(key, state[key])
    for key, check in _RANDOM_CHECKS.items():
        if key in state["random"]:
            check(f"random.{key}", state["random"][key])
    _check_position(state)
    return state


def _impossible(key: str, value: Any, should: str) -> ResumeError:
    return ResumeError(
        f"this loader state's {key!r} is {value!r}, which no loader saves: it {should} (the state was "
        "edited, or is not a gpuload.DataLoader.state_dict())"
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(low: int, high: int | None = None, *, none: bool = False) -> Callable[[str, Any], None]:
    def check(key: str, value: Any) -> None:
        if value is None and none:
            return
        if not _is_int(value) or value < low or (high is not None and value >= high):
            bound = f"from {low}" + (f" below {high}" if high is not None else "")
            raise _impossible(key, value, f"must be an int {bound}" + (" or None" if none else ""))
    return check


def _flag(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _impossible(key, value, "must be True or False")


def _cuts(key: str, value: Any) -> None:
    if not isinstance(value, (list, tuple)):
        raise _impossible(key, value, "must be a list of [batches done, samples done, new batch size]")
    for place, cut in enumerate(value):
        if (not isinstance(cut, (list, tuple)) or len(cut) != 3 or not all(_is_int(n) for n in cut)
                or cut[0] < 0 or cut[1] < 0 or cut[2] < 1):
            raise _impossible(f"{key}[{place}]", cut,
                              "must be [batches done >= 0, samples done >= 0, new batch size >= 1]")


def _out_of_order(key: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, Mapping) or set(value) != {"prefix", "others"}:
        raise _impossible(key, value, "must be None or a dict of 'prefix' and 'others'")
    _count(0)(f"{key}.prefix", value["prefix"])
    others = value["others"]
    if (not isinstance(others, (list, tuple)) or not all(_is_int(place) for place in others)
            or list(others) != sorted(set(others)) or any(place <= value["prefix"] for place in others)):
        raise _impossible(f"{key}.others", others, "must list places after 'prefix', ascending, each once")


def _distributed(key: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise _impossible(key, value, "must be a dict or None")
    _count(1)(f"{key}.num_replicas", value.get("num_replicas"))
    _count(-(2**63), 2**64)(f"{key}.seed", value.get("seed"))
    _flag(f"{key}.shuffle", value.get("shuffle"))
    _flag(f"{key}.drop_last", value.get("drop_last"))


def decoded_generator_state(key: str, saved: Any) -> torch.Tensor:
    """A generator's state as saved (base64 text, or a tensor or list of bytes in earlier
    states); :class:`ResumeError` naming ``key`` when it is none of these."""
    try:
        if isinstance(saved, str):
            return torch.frombuffer(bytearray(base64.b64decode(saved, validate=True)), dtype=torch.uint8)
        if isinstance(saved, (torch.Tensor, list, tuple)):
            return torch.as_tensor(saved, dtype=torch.uint8).reshape(-1)
    except (binascii.Error, ValueError, TypeError, RuntimeError, OverflowError):
        pass
    raise _impossible(key, saved if not isinstance(saved, str) else saved[:40] + "...",
                      "must be a generator's state (base64 text of torch.Generator.get_state())")


def _generators(key: str, value: Any) -> None:
    if not isinstance(value, (list, tuple)):
        raise _impossible(key, value, "must be a list of generator states")
    for place, saved in enumerate(value):
        decoded_generator_state(f"{key}[{place}]", saved)


def _global_generator(key: str, value: Any) -> None:
    state = decoded_generator_state(key, value)
    try:
        torch.Generator().set_state(state)
    except RuntimeError as error:
        raise _impossible(key, f"{state.numel()} bytes", f"must be torch's CPU generator state ({error})") from None


def _samplers(key: str, value: Any) -> None:
    if not isinstance(value, (list, tuple)):
        raise _impossible(key, value, "must be a list of the samplers' own states (None where a sampler has none)")


_CHECKS: dict[str, Callable[[str, Any], None]] = {
    "epoch": _count(-1),
    "batches": _count(0),
    "finished": _flag,
    "transform_seed": _count(-(2**63), 2**64),
    "batch_size": _count(1, none=True),
    "epoch_batch_size": _count(1, none=True),
    "cuts": _cuts,
    "sampler_started": _flag,
    "out_of_order": _out_of_order,
    "stream_ended": _flag,
    "distributed": _distributed,
    # "version", "signature", "random": checked above; "dataset" and "dataset_iterator" are the
    # dataset's and its iterator's own states, any value (checked against the dataset by
    # gpuload.resume.load_state, as "signature" is against the loader)
}
_RANDOM_CHECKS: dict[str, Callable[[str, Any], None]] = {
    "generators": _generators,
    "global": _global_generator,
    "samplers": _samplers,
    "distributed_epoch": _count(0, none=True),
    "worker_seed_drawn": _flag,
}


def _check_position(state: dict[str, Any]) -> None:
    """The keys that must agree with each other: an epoch not begun has no batches, the cuts lie
    within the batches done, the batches handed over out of order are as many as those done."""
    epoch, batches, finished = state["epoch"], state["batches"], state["finished"]
    if epoch == -1 and (not finished or batches):
        raise _impossible("epoch", epoch, f"is -1 only before the first epoch (finished=True, batches=0; "
                                          f"here finished={finished!r}, batches={batches!r})")
    if not state.get("sampler_started", True) and batches:
        raise _impossible("sampler_started", False, f"is False only before an epoch's first batch "
                                                    f"(here batches={batches})")
    if state.get("stream_ended") and finished:
        raise _impossible("stream_ended", True, "is True only inside an epoch (here finished=True)")
    cuts = state.get("cuts") or []
    done, samples, size = 0, 0, state.get("epoch_batch_size") or state.get("batch_size") or 1
    for place, (cut_batches, cut_samples, new_size) in enumerate(cuts):
        expected = samples + (cut_batches - done) * size
        if cut_batches < done or cut_batches > batches or cut_samples != expected:
            raise _impossible(f"cuts[{place}]", list(cuts[place]),
                              f"must follow the batches done before it (from batch {done}, at most {batches}) "
                              f"and count their samples ({expected} after batch {cut_batches})")
        done, samples, size = cut_batches, cut_samples, new_size
    packed = state.get("out_of_order")
    if packed is not None and not finished and packed["prefix"] + len(packed["others"]) != batches:
        raise _impossible("out_of_order", dict(packed),
                          f"must name as many places as the batches done ({batches})")
