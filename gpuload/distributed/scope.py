"""The ``cache_scope="auto"`` decision: one copy per rank, per node, per world, or today's tiers.

Pure: sizes in, a :class:`ScopeDecision` out. The room per rank comes from
``CacheSettings.device_room`` (the budget arithmetic every cache uses), taken as the smallest
over all ranks so that every rank decides the same.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuload.cache import format_bytes

__all__ = ["ScopeDecision", "decide_scope", "share_bytes"]


@dataclass(frozen=True)
class ScopeDecision:
    """``scope``: ``"rank"`` (each rank as today), ``"node"`` or ``"world"``; ``group_size``:
    the ranks one copy of the dataset is split over (1 for ``rank``); ``reason`` says why."""

    requested: str
    scope: str
    group_size: int
    reason: str

    @property
    def split(self) -> bool:
        return self.scope != "rank"


def share_bytes(num_samples: int, bytes_per_sample: int, group_size: int) -> int:
    """Bytes of the largest share when ``num_samples`` rows are split over ``group_size`` ranks."""
    return -(-num_samples // group_size) * bytes_per_sample


def decide_scope(
    requested: str,
    num_samples: int,
    bytes_per_sample: int,
    room: int | None,
    local_world_size: int,
    world_size: int,
) -> ScopeDecision:
    """The scope for a dataset of ``num_samples`` rows of ``bytes_per_sample`` bytes.

    ``room``: device bytes a cache may fill on each rank (the smallest over ranks), or None on
    a CPU device, where there is no device budget: ``auto`` keeps today's behaviour (arrays
    served in place) and an explicit scope is taken as asked. On a device, an explicit scope
    whose share does not fit the room falls back to ``rank``. ``auto`` picks ``rank`` when the
    dataset fits one device's room, else ``node`` when it fits the node's devices together,
    else ``world``, else ``rank`` (today's tiers: device, host, source).
    """
    total = format_bytes(num_samples * bytes_per_sample)
    sizes = {"rank": 1, "node": local_world_size, "world": world_size}
    if requested in ("rank", "node", "world"):
        share = share_bytes(num_samples, bytes_per_sample, sizes[requested])
        if room is None or requested == "rank" or share <= room:
            return ScopeDecision(requested, requested, sizes[requested], f"cache_scope={requested!r} was asked for")
        return ScopeDecision(
            requested, "rank", 1,
            f"cache_scope={requested!r} was asked for, but a share ({format_bytes(share)}) does not fit the "
            f"device cache room ({format_bytes(room)}): each rank caches in its own tiers (device, pinned "
            "host, source)",
        )
    if requested != "auto":
        raise ValueError(f"cache scope {requested!r} is not one of 'auto', 'rank', 'node', 'world'")
    if room is None:
        return ScopeDecision("auto", "rank", 1, "batches are used on the CPU: arrays are served in place")
    for scope in ("rank", "node", "world"):
        if scope != "rank" and sizes[scope] == 1:
            continue
        share = share_bytes(num_samples, bytes_per_sample, sizes[scope])
        if share <= room:
            return ScopeDecision(
                "auto", scope, sizes[scope],
                f"the dataset ({total}) fits {sizes[scope]} device(s) of {format_bytes(room)} room "
                f"each ({format_bytes(share)} per rank)",
            )
    return ScopeDecision(
        "auto", "rank", 1,
        f"the dataset ({total}) does not fit {world_size} devices of {format_bytes(room)} room: each "
        "rank caches in its own tiers (device, host, source)",
    )
