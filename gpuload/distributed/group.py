"""The process group as gpuload sees it: rank, world and node size, the exchange's own groups.

The exchange runs on groups of its own, made once per split store by every rank together:
a gloo group for the small per-step header (checked on the host, so a GPU stream is never
synchronized for it) and, on CUDA, an NCCL group for the rows. Both carry the exchange timeout
(``GPULOAD_EXCHANGE_TIMEOUT`` seconds, default 600), so a rank whose peers stopped iterating
gets an :class:`ExchangeError` instead of waiting forever, and the exchange never interleaves
with the training job's own collectives (DDP's all-reduce).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gpuload.environment import DEFAULT_EXCHANGE_TIMEOUT_S, EXCHANGE_TIMEOUT, exchange_timeout_seconds

__all__ = [
    "DEFAULT_EXCHANGE_TIMEOUT_S",
    "EXCHANGE_TIMEOUT_ENV",
    "DistributedContext",
    "ExchangeError",
    "agree_on_scope",
    "loader_identity",
    "peers_answer",
    "current_context",
    "exchange_groups",
    "exchange_timeout",
    "release_groups",
]

EXCHANGE_TIMEOUT_ENV = EXCHANGE_TIMEOUT


class ExchangeError(RuntimeError):
    """The batch exchange between ranks failed: a rank stopped early, died, or disagrees."""


@contextmanager
def peers_answer(failure: str) -> Iterator[None]:
    """Around a collective of the ranks: the ``RuntimeError`` torch.distributed raises when a
    peer stopped or died (gloo's timeout, a closed connection) becomes an :class:`ExchangeError`
    saying ``failure`` (what this rank was doing, and who did not answer) and its cause."""
    try:
        yield
    except RuntimeError as error:
        raise ExchangeError(f"{failure} Cause: {error}") from error


@dataclass(frozen=True)
class DistributedContext:
    """This process's place in an initialized process group; ``local_world_size``: ranks per node."""

    rank: int
    world_size: int
    local_world_size: int
    backend: str


def current_context(local_world_size: int | None = None) -> DistributedContext | None:
    """The initialized default process group, or None (then every scope means ``rank``).

    The node size is ``local_world_size`` if given, else ``LOCAL_WORLD_SIZE`` (set by
    torchrun), else the whole world (one node).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    if local_world_size is None:
        text = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
        local_world_size = int(text) if text.isdigit() and int(text) > 0 else world
    return DistributedContext(dist.get_rank(), world, local_world_size, str(dist.get_backend()))


def exchange_timeout() -> timedelta:
    """The exchange's timeout: ``GPULOAD_EXCHANGE_TIMEOUT`` seconds, else 600 s (NCCL's own
    default: long enough for a rank that checkpoints or validates between epochs)."""
    return timedelta(seconds=exchange_timeout_seconds())


_SCOPE_POLL_S = 0.02
_scope_decisions: dict[tuple[int, str], int] = {}  # (default group, loader) -> scope decisions made


def loader_identity(num_samples: int, batch_sampler: Any) -> str:
    """What tells one loader from another the same way on every rank: the dataset's length and
    the batch sampler's kind, batch size and (a DistributedSampler's) seed and shuffle."""
    sampler = getattr(batch_sampler, "sampler", batch_sampler)
    return ":".join(str(part) for part in (
        num_samples, type(batch_sampler).__name__, getattr(batch_sampler, "batch_size", None),
        type(sampler).__name__, getattr(sampler, "seed", None), getattr(sampler, "shuffle", None),
    ))


def agree_on_scope(scope: str, source: str, splits: bool, context: DistributedContext, loader: str) -> None:
    """Check that every rank asks for the same ``cache_scope`` for this loader, before any group
    is made (``new_group`` would wait the whole exchange timeout for a rank that never calls it).

    Every rank publishes its setting in the default group's store, under ``loader`` (see
    :func:`loader_identity`) and how many times it decided a scope for such a loader. A rank
    that keeps its own copy (``splits`` False) goes on; a rank that would split the dataset
    waits for every rank's setting (up to the exchange timeout) and raises
    :class:`ExchangeError` naming each rank's setting as soon as one differs.
    """
    counted = (id(dist.group.WORLD), loader)
    number = _scope_decisions.get(counted, 0)
    _scope_decisions[counted] = number + 1
    store = dist.distributed_c10d._get_default_store()
    prefix = f"gpuload/cache_scope/{loader}/{number}/"
    store.set(f"{prefix}{context.rank}", f"{scope}\n{source}")
    if not splits:
        return
    timeout = exchange_timeout_seconds()
    deadline = time.monotonic() + timeout
    seen: dict[int, list[str]] = {}
    while True:
        for rank in range(context.world_size):
            if rank not in seen and store.check([f"{prefix}{rank}"]):
                seen[rank] = store.get(f"{prefix}{rank}").decode().split("\n", 1)
        disagree = any(theirs != scope for theirs, _ in seen.values())
        if disagree or len(seen) == context.world_size:
            break
        if time.monotonic() > deadline:
            missing = [rank for rank in range(context.world_size) if rank not in seen]
            raise ExchangeError(
                f"gpuload: rank {context.rank} waited {timeout:g} s ({EXCHANGE_TIMEOUT_ENV}) for rank(s) "
                f"{missing} to build this loader (cache_scope={scope!r}); every rank must build it"
            )
        time.sleep(_SCOPE_POLL_S)
    if disagree:
        settings = ", ".join(
            f"rank {rank}: {seen[rank][0]!r} ({seen[rank][1]})" if rank in seen else f"rank {rank}: not known yet"
            for rank in range(context.world_size)
        )
        raise ExchangeError(
            f"gpuload: ranks disagree on cache_scope ({settings}); every rank must build this loader "
            "with the same cache_scope"
        )


def exchange_groups(device: torch.device, timeout: timedelta) -> tuple[Any, Any]:
    """``(control, data)`` groups over all ranks; every rank must call this at the same point.

    ``control`` is gloo (host tensors); ``data`` is NCCL for a CUDA device, else ``control``.
    """
    control = dist.new_group(backend="gloo", timeout=timeout)
    data = dist.new_group(backend="nccl", timeout=timeout) if device.type == "cuda" else control
    return control, data


def release_groups(groups: tuple[Any, Any]) -> None:
    """Destroy the exchange's groups (once each; ``data`` may be ``control``), if torch.distributed
    is still up. A peer still waiting on them then fails at once instead of at the timeout."""
    if dist.is_initialized():
        for group in {id(g): g for g in groups}.values():
            dist.destroy_process_group(group)
