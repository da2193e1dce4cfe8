"""What each ``cache_scope`` would hold and move on a pretended cluster: a pure plan, no processes.

For a dataset of ``num_samples`` rows of ``bytes_per_sample`` bytes on ``nodes`` nodes of
``gpus_per_node`` GPUs, :func:`plan_scopes` says for ``rank``, ``node`` and ``world`` whether
the scope fits the per-GPU cache room (resolved from the cache settings as a loader resolves
it, or given: the room beside a training step), each GPU's share, the host memory per
node, and the bytes one node moves per epoch: over PCIe (host to device), between the node's
GPUs (NVLink) and between nodes (network). It marks what ``auto`` picks
(:func:`~gpuload.distributed.scope.decide_scope`, the loader's own decision).

The traffic is the exact expectation under torch's ``DistributedSampler`` with
``shuffle=True``: every position of a rank's epoch holds a uniformly random index (the padding
repeats the permutation's first indices, uniform too), so a rank reads ``R * s_o / N`` rows
from the rank ``o`` holding a block of ``s_o`` rows, where ``R`` is the rows a rank reads per
epoch. Figures are per node, the mean over nodes (blocks differ by one row at most).

Host memory: ``rank`` keeps each rank's own tiers (device, host, source), as
:meth:`~gpuload.cache.CacheSettings.array_plan` places them on each rank; ``node`` and
``world`` keep the whole dataset on the devices and keep nothing in host memory. Each rank's host tier is its
own copy (``host_shared=False``, what the README's multi-GPU section says today), so a node
pins ``gpus_per_node`` copies; ``host_shared=True`` counts one copy per node, as a host tier
shared by the node's ranks would. The source arrays every process holds are not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from gpuload.cache import CachePlan, CacheSettings, format_bytes, make_plan, parse_size
from gpuload.device import MemoryInfo, host_memory
from gpuload.distributed.partition import Partition
from gpuload.distributed.scope import ScopeDecision, decide_scope

__all__ = ["HOST_TIER_SHARED", "MAX_RANKS", "EpochBytes", "ScopePlan", "ScopePlans", "plan_scopes", "rows_per_rank"]

HOST_TIER_SHARED = True
"""Whether a node's ranks share one host tier (the default of ``plan_scopes``)."""

MAX_RANKS = 1 << 17
"""The most ranks a plan takes: past today's largest clusters; a plan keeps a few numbers per rank."""

_SCOPES = ("rank", "node", "world")


@dataclass(frozen=True)
class EpochBytes:
    """Expected bytes one node moves in one epoch.

    ``sampled``: the rows its ranks' batches hold; each comes from the rank's own device
    (``local``), over PCIe from host memory (``pcie``), from another GPU of the node
    (``nvlink``) or from another node (``network``), so ``sampled`` is their sum. ``fill``:
    host-to-device bytes that build the device caches (the first epoch only).
    """

    sampled: float
    local: float
    pcie: float
    nvlink: float
    network: float
    fill: float = 0.0

    @property
    def host_to_device(self) -> float:
        """All bytes over PCIe in this epoch: the fill and the rows read from host memory."""
        return self.fill + self.pcie


@dataclass(frozen=True)
class ScopePlan:
    """One scope on the cluster.

    ``group_size``: ranks one copy is split over. ``fits``: the whole dataset lives on the
    devices (for ``rank``: a whole copy on every GPU; when it does not, ``rank`` still runs on
    its tiers, the others fall back to ``rank``). ``device_samples``: rows on each GPU (the
    largest share); ``host_samples``: rows in each rank's host tier; ``source_samples``: rows
    each rank reads from the source every epoch; ``host_bytes_per_node``: host memory a
    node takes. ``first_epoch`` / ``later_epochs``: the traffic, None for a scope that does not
    run as itself. ``note``: why not, or what to watch.
    """

    scope: str
    group_size: int
    fits: bool
    runs: bool
    device_samples: int
    device_bytes: int
    host_samples: int
    host_bytes_per_node: int
    source_samples: int
    first_epoch: EpochBytes | None
    later_epochs: EpochBytes | None
    note: str = ""


@dataclass(frozen=True)
class ScopePlans:
    """Every scope for one dataset on ``nodes`` x ``gpus_per_node`` GPUs, and what ``auto`` picks.

    ``room``: device bytes a cache may fill on each GPU; ``room_note`` says where it came from.
    ``asked``: the decision for the settings' ``cache_scope`` (``auto`` unless set).
    """

    num_samples: int
    bytes_per_sample: int
    gpus_per_node: int
    nodes: int
    device: MemoryInfo
    reserve: int
    room: int
    room_note: str
    host: MemoryInfo
    host_budget: int
    host_shared: bool
    rows_per_rank: int
    settings: CacheSettings
    scopes: tuple[ScopePlan, ...]
    auto: ScopeDecision
    asked: ScopeDecision

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def total_bytes(self) -> int:
        return self.num_samples * self.bytes_per_sample

    def __getitem__(self, scope: str) -> ScopePlan:
        for plan in self.scopes:
            if plan.scope == scope:
                return plan
        raise KeyError(f"no scope {scope!r}; the scopes are {', '.join(_SCOPES)}")

    def describe(self) -> str:
        """The table a person reads: one row per scope, per GPU and per node, then ``auto``'s pick."""
        n, bps = self.num_samples, self.bytes_per_sample
        header = ("scope", "fits", "per GPU", "host/node", "PCIe 1st", "PCIe later", "NVLink", "network")
        rows = [header]
        for plan in self.scopes:
            mark = " <- auto" if plan.scope == self.auto.scope else ""
            if self.asked.requested != "auto" and plan.scope == self.asked.scope:
                mark += f" <- cache_scope={self.asked.requested}"
            first, later = plan.first_epoch, plan.later_epochs
            rows.append((
                f"{plan.scope} ({plan.group_size})",
                "yes" if plan.fits else ("tiers" if plan.runs else "no"),
                f"{format_bytes(plan.device_bytes)} ({plan.device_samples})",
                format_bytes(plan.host_bytes_per_node) if plan.runs else "-",
                _amount(first.host_to_device if first else None),
                _amount(later.host_to_device if later else None),
                _amount(later.nvlink if later else None),
                _amount(later.network if later else None) + mark,
            ))
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        table = ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
        copies = "one host tier per node, shared by its ranks" if self.host_shared else (
            "each rank keeps its own host tier")
        lines = [
            f"scope plan: {self.nodes} node(s) x {self.gpus_per_node} GPU(s) = {self.world_size} ranks; "
            f"{n} samples x {format_bytes(bps)} = {format_bytes(self.total_bytes)}",
            f"  per GPU: {format_bytes(self.device.free)} free of {format_bytes(self.device.total)}, reserve "
            f"{format_bytes(self.reserve)}; cache room {format_bytes(self.room)} ({self.room_note})",
            f"  per node: host {format_bytes(self.host.free)} free of {format_bytes(self.host.total)}, host "
            f"tier budget {format_bytes(self.host_budget)} ({copies})",
            f"  per epoch each rank reads {self.rows_per_rank} rows (DistributedSampler, shuffle=True); "
            "bytes below are per node, expected, mean over nodes",
            "  scope (ranks per copy); per GPU: bytes (samples) of the dataset on each GPU; PCIe: host to "
            "device, 1st epoch (fill included) and later epochs; NVLink: from the node's other GPUs; "
            "network: from other nodes",
            *table,
            *(f"  {plan.scope}: {plan.note}" for plan in self.scopes if plan.note),
            f"auto picks {self.auto.scope}: {self.auto.reason}",
        ]
        if self.asked.requested != "auto":
            lines.append(f"cache_scope={self.asked.requested} ({self.settings.scope.source}) runs "
                         f"{self.asked.scope}: {self.asked.reason}")
        return "\n".join(lines)

    __str__ = describe


def _amount(value: float | None) -> str:
    return "-" if value is None else format_bytes(round(value))


def rows_per_rank(
    num_samples: int, world_size: int, *, sampler_drop_last: bool = False, batch_size: int | None = None,
    drop_last: bool = False,
) -> int:
    """Rows one rank reads per epoch: ``len(DistributedSampler)`` (padded, or cut with its
    ``drop_last``), less the last partial batch when the loader drops it."""
    if sampler_drop_last and num_samples % world_size:
        rows = math.ceil((num_samples - world_size) / world_size)
    else:
        rows = math.ceil(num_samples / world_size)
    if batch_size is not None and drop_last:
        rows -= rows % batch_size
    return rows


def _memory(value: MemoryInfo | int | str, what: str) -> MemoryInfo:
    if isinstance(value, MemoryInfo):
        return value
    spec = parse_size(value, setting=what, source="keyword")
    if spec.kind != "bytes":
        raise ValueError(f"{what}={value!r} must be an absolute size such as '141GiB'")
    return MemoryInfo(free=int(spec.amount), total=int(spec.amount))


def _card_room(settings: CacheSettings, bps: int, num_samples: int, memory: MemoryInfo,
               host: MemoryInfo) -> tuple[int, int]:
    """``(room, reserve)`` on one pretended card, as the loader resolves its cache settings."""
    card = f"a pretended {format_bytes(memory.total)} card"
    plan = settings.array_plan(bps, num_samples, memory, host, device=card, shared=False)
    room = min(plan.budget, max(0, plan.device_free - plan.reserve))
    return (room if settings.mode.value in ("auto", "device") else 0), plan.reserve


def plan_scopes(
    num_samples: int,
    bytes_per_sample: int,
    *,
    gpus_per_node: int,
    nodes: int = 1,
    device_memory: MemoryInfo | int | str,
    host_memory_per_node: MemoryInfo | int | str | None = None,
    settings: CacheSettings | None = None,
    room: int | None = None,
    room_note: str | None = None,
    reserve: int | None = None,
    batch_size: int | None = None,
    drop_last: bool = False,
    sampler_drop_last: bool = False,
    host_shared: bool | None = None,
) -> ScopePlans:
    """Plan every ``cache_scope`` for a dataset on ``nodes`` x ``gpus_per_node`` GPUs.

    ``device_memory``: one GPU (``"141GiB"``, bytes, all free, or a MemoryInfo);
    ``host_memory_per_node``: default this machine's. ``settings``: the cache settings
    (default: resolved as a loader would); the per-GPU ``room`` comes from them, unless given
    (with its ``reserve``; e.g. what a training step leaves, from :func:`gpuload.plan_job`).
    ``batch_size``, ``drop_last`` (the loader's) and ``sampler_drop_last`` (the
    ``DistributedSampler``'s) set the rows a rank reads per epoch. ``host_shared``: one pinned
    tier per node instead of one per rank (default ``HOST_TIER_SHARED``, True).
    """
    for name, value in (("num_samples", num_samples), ("bytes_per_sample", bytes_per_sample),
                        ("gpus_per_node", gpus_per_node), ("nodes", nodes)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if gpus_per_node * nodes > MAX_RANKS:
        raise ValueError(f"gpus_per_node={gpus_per_node} x nodes={nodes} = {gpus_per_node * nodes:,} ranks: "
                         f"plan at most {MAX_RANKS:,}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    settings = settings or CacheSettings.resolve()
    device = _memory(device_memory, "device_memory")
    host = _memory(host_memory_per_node, "host_memory_per_node") if host_memory_per_node is not None else host_memory()
    shared = HOST_TIER_SHARED if host_shared is None else host_shared
    mode = settings.mode.value
    if room is None:
        room, reserve = _card_room(settings, bytes_per_sample, num_samples, device, host)
        room_note = room_note or (f"cache={mode} keeps no device tier" if mode not in ("auto", "device") else
                                  f"cache_size={settings.size.value}, under free minus the reserve")
    elif room < 0:
        raise ValueError(f"room must be >= 0 bytes, got {room}")
    reserve = 0 if reserve is None else reserve
    # Each rank's own tiers, as the loader places them (whole samples, device then host).
    tiers = make_plan(bytes_per_sample, num_samples, room, host.free, room, 0, mode,
                      device_total=device.total, host_total=host.total)
    rows = rows_per_rank(num_samples, gpus_per_node * nodes, sampler_drop_last=sampler_drop_last,
                         batch_size=batch_size, drop_last=drop_last)
    scopes = (
        _rank_scope(tiers, gpus_per_node, rows, shared),
        *(_split_scope(scope, tiers, gpus_per_node, nodes, rows, room, mode) for scope in ("node", "world")),
    )
    auto, asked = (_decision(requested, num_samples, bytes_per_sample, room, gpus_per_node, nodes, mode)
                   for requested in ("auto", settings.scope.value))
    return ScopePlans(
        num_samples=num_samples, bytes_per_sample=bytes_per_sample, gpus_per_node=gpus_per_node, nodes=nodes,
        device=device, reserve=reserve, room=room, room_note=room_note or "given", host=host,
        host_budget=tiers.host_budget, host_shared=shared, rows_per_rank=rows, settings=settings,
        scopes=scopes, auto=auto, asked=asked,
    )


def _decision(requested: str, n: int, bps: int, room: int, local: int, nodes: int, mode: str) -> ScopeDecision:
    """The loader's decision: :func:`decide_scope`, after ``split_arrays``' own refusal of a
    cache without a device tier."""
    if mode not in ("auto", "device") and requested != "rank":
        return ScopeDecision(requested, "rank", 1, f"cache={mode!r} keeps no device tier to split: each rank "
                             "caches in its own tiers")
    return decide_scope(requested, n, bps, room, local, local * nodes)


def _rank_scope(tiers: CachePlan, local: int, rows: int, shared: bool) -> ScopePlan:
    """Every rank its own tiers: device rows ``[0, k)``, then host memory, then the source."""
    n, bps = tiers.num_samples, tiers.bytes_per_sample
    k = tiers.device_samples
    sampled = local * rows * bps
    local_bytes = sampled * k / n
    later = EpochBytes(sampled=sampled, local=local_bytes, pcie=sampled - local_bytes, nvlink=0.0, network=0.0)
    first = replace(later, fill=local * k * bps)
    host_per_rank = tiers.host_bytes
    host_per_node = host_per_rank if shared else local * host_per_rank
    notes = []
    if k < n:
        where = f"{tiers.host_samples} in host memory" if tiers.host_samples else ""
        source = f"{tiers.source_samples} read from the source every epoch" if tiers.source_samples else ""
        notes.append(f"each GPU holds {k} of {n} rows; " + ", ".join(filter(None, (where, source))))
    if not shared and local > 1 and host_per_node > tiers.host_budget:
        notes.append(
            f"{local} ranks each pin {format_bytes(host_per_rank)}: {format_bytes(host_per_node)} on the node, "
            f"over its host budget of {format_bytes(tiers.host_budget)} (a tier shared by the node's ranks "
            f"would pin {format_bytes(host_per_rank)})"
        )
    return ScopePlan(
        scope="rank", group_size=1, fits=k == n, runs=True, device_samples=k, device_bytes=k * bps,
        host_samples=tiers.host_samples, host_bytes_per_node=host_per_node, source_samples=tiers.source_samples,
        first_epoch=first, later_epochs=later, note="; ".join(notes),
    )


def _split_scope(scope: str, tiers: CachePlan, local: int, nodes: int, rows: int, room: int, mode: str) -> ScopePlan:
    """One copy split over ``local`` (node) or all (world) ranks, each block on its rank's GPU."""
    n, bps = tiers.num_samples, tiers.bytes_per_sample
    world = local * nodes
    group = local if scope == "node" else world
    partition = Partition(n, world, group)
    bounds = partition.bounds.tolist()
    blocks = [stop - start for start, stop in zip(bounds, bounds[1:])]
    largest = max(blocks)
    fits = largest * bps <= room and mode in ("auto", "device")
    if group == 1 or not fits:
        if group == 1:
            note = f"{'one GPU per node' if scope == 'node' else 'one GPU'}: the same as rank"
        elif mode not in ("auto", "device"):
            note = f"cache={mode!r} keeps no device tier to split; the loader runs rank"
        else:
            note = (f"a share of {format_bytes(largest * bps)} does not fit the {format_bytes(room)} room; "
                    f"cache_scope={scope!r} falls back to rank (with a warning)")
        return ScopePlan(scope=scope, group_size=group, fits=False, runs=False, device_samples=largest,
                         device_bytes=largest * bps, host_samples=0, host_bytes_per_node=0, source_samples=0,
                         first_epoch=None, later_epochs=None, note=note)
    # Node m's ranks hold blocks (for world) or the whole copy (for node): S_m rows of the copy.
    # A reader gets R * s_o / N rows from the holder o of a block of s_o rows, in expectation.
    if scope == "node":
        held = [n] * nodes
    else:
        held = [sum(blocks[m * local:(m + 1) * local]) for m in range(nodes)]
    mean = [sum(values) / nodes for values in zip(*(
        (rows * s / n, rows * (local - 1) * s / n, local * rows * (n - s) / n) for s in held))]
    local_rows, nvlink_rows, network_rows = mean
    later = EpochBytes(sampled=local * rows * bps, local=local_rows * bps, pcie=0.0,
                       nvlink=nvlink_rows * bps, network=network_rows * bps)
    first = replace(later, fill=sum(held) / nodes * bps)
    return ScopePlan(scope=scope, group_size=group, fits=True, runs=True, device_samples=largest,
                     device_bytes=largest * bps, host_samples=0, host_bytes_per_node=0, source_samples=0,
                     first_epoch=first, later_epochs=later)
