"""Where each sample's bytes live: a pure placement decision, printable, testable on any card size.

``make_plan`` takes sizes and free memory as plain numbers and returns a :class:`CachePlan`
whose ``tiers`` are an ordered tuple of :class:`TierPlan`: samples ``[0, k)`` in the first tier
(the device), the next ``h`` in the second (host memory), and so on; the rest are read from the
source each epoch. Nothing here allocates or asks a device anything. A tier is named here and
built by the class registered under that name (``gpuload.cache.tiers``).

Host reserve: the host tier leaves ``max(4 GiB, 10% of host RAM)`` available: the process still
needs host memory for the interpreter, loader workers, checkpoints and the source data itself;
running the host out of memory kills the job, which is worse than streaming.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuload.cache.budget import format_bytes

__all__ = ["MODES", "CachePlan", "TierPlan", "make_plan", "default_host_reserve", "HOST_RESERVE_MIN_BYTES",
           "HOST_RESERVE_FRACTION"]

HOST_RESERVE_MIN_BYTES = 4 << 30
HOST_RESERVE_FRACTION = 0.10
MODES = ("auto", "device", "host", "off")
"""The cache modes, everywhere a mode is checked."""


def default_host_reserve(host_total: int) -> int:
    """Host bytes the host tier leaves available: max(4 GiB, 10% of host RAM)."""
    return max(HOST_RESERVE_MIN_BYTES, int(host_total * HOST_RESERVE_FRACTION))


TIER_LABELS = {"device": "device tier", "host": "host tier", "disk": "disk tier"}
"""How ``describe`` names a tier; a tier not listed is shown by its name."""


@dataclass(frozen=True)
class TierPlan:
    """``samples`` consecutive samples from ``first`` kept in the tier called ``name``;
    ``room``: the samples it may hold when an earlier tier cannot take its share (out of
    memory), at least ``samples`` (None: just ``samples``)."""

    name: str
    first: int
    samples: int
    bytes_per_sample: int
    room: int | None = None

    @property
    def most(self) -> int:
        """The samples this tier may hold at most (``room``, else ``samples``)."""
        return self.samples if self.room is None else max(self.samples, self.room)

    @property
    def bytes(self) -> int:
        return self.samples * self.bytes_per_sample


@dataclass(frozen=True)
class CachePlan:
    """Placement of ``num_samples`` samples of ``bytes_per_sample`` bytes each.

    ``tiers`` in order, each holding the samples after the previous one's (fastest first: the
    device, then host memory); the remaining ``source_samples`` are read from the source every
    epoch. ``target`` is the device type batches are delivered to; on ``"cpu"`` nothing crosses
    PCIe and the source itself serves every sample.
    """

    mode: str
    target: str
    bytes_per_sample: int
    num_samples: int
    tiers: tuple[TierPlan, ...]
    budget: int
    reserve: int
    host_reserve: int
    device_free: int
    device_total: int | None
    host_free: int
    host_total: int | None
    notes: tuple[str, ...] = field(default=())

    def samples_in(self, name: str) -> int:
        """Samples the tier called ``name`` holds (0 when the plan has no such tier)."""
        return sum(tier.samples for tier in self.tiers if tier.name == name)

    @property
    def device_samples(self) -> int:
        return self.samples_in("device")

    @property
    def host_samples(self) -> int:
        return self.samples_in("host")

    @property
    def source_samples(self) -> int:
        return self.num_samples - sum(tier.samples for tier in self.tiers)

    @property
    def device_bytes(self) -> int:
        return self.device_samples * self.bytes_per_sample

    @property
    def host_bytes(self) -> int:
        return self.host_samples * self.bytes_per_sample

    @property
    def total_bytes(self) -> int:
        return self.num_samples * self.bytes_per_sample

    @property
    def host_budget(self) -> int:
        """Host bytes the host tier may take: free host memory minus the host reserve."""
        return max(0, self.host_free - self.host_reserve)

    @property
    def h2d_bytes_per_epoch_uncached(self) -> int:
        """Host-to-device bytes of one epoch with no cache: every sample, every epoch."""
        return 0 if self.target == "cpu" else self.total_bytes

    @property
    def h2d_bytes_per_epoch_cached(self) -> int:
        """Host-to-device bytes of each epoch once the device tier is filled."""
        return 0 if self.target == "cpu" else self.total_bytes - self.device_bytes

    @property
    def fill_bytes(self) -> int:
        """One-time host-to-device bytes to fill the device tier."""
        return 0 if self.target == "cpu" else self.device_bytes

    @property
    def kind(self) -> str:
        """``"device"``, ``"host"``, ``"stream"``, ``"cpu"``, or tiers joined by ``+``."""
        if self.target == "cpu":
            return "cpu"
        parts = [tier.name for tier in self.tiers if tier.samples]
        if self.source_samples:
            parts.append("stream")
        return "+".join(parts) if parts else "stream"

    def describe(self) -> str:
        """A readable account of the decision and the memory it saw."""
        n, bps = self.num_samples, self.bytes_per_sample

        def share(count: int) -> str:
            return f"{count} samples ({100 * count / n:.1f}%, {format_bytes(count * bps)})" if n else "0 samples"

        seen_device = (
            f"{format_bytes(self.device_free)} free"
            + (f" of {format_bytes(self.device_total)}" if self.device_total is not None else "")
        )
        seen_host = (
            f"{format_bytes(self.host_free)} free"
            + (f" of {format_bytes(self.host_total)}" if self.host_total is not None else "")
        )
        lines = [
            f"cache plan: {self.kind} (mode={self.mode}, target={self.target})",
            f"  dataset:        {n} samples x {format_bytes(bps)} = {format_bytes(self.total_bytes)}",
        ]
        if self.target != "cpu":
            lines.append(
                f"  device memory:  {seen_device}; reserve {format_bytes(self.reserve)} for the model; "
                f"budget {format_bytes(self.budget)}"
            )
        lines.append(f"  host memory:    {seen_host}; reserve {format_bytes(self.host_reserve)}")
        if self.target == "cpu":
            lines.append(f"  source (host):  {share(n)}, served in place, nothing crosses PCIe")
        else:
            lines += [f"  {TIER_LABELS.get(tier.name, tier.name) + ':':<15} {share(tier.samples)}"
                      for tier in self.tiers]
            lines += [
                f"  from source:    {share(self.source_samples)}",
                f"  host-to-device per epoch: {format_bytes(self.h2d_bytes_per_epoch_uncached)} "
                f"without cache, {format_bytes(self.h2d_bytes_per_epoch_cached)} with it "
                f"(after a one-time fill of {format_bytes(self.fill_bytes)})",
            ]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    __str__ = describe


def make_plan(
    bytes_per_sample: int,
    num_samples: int,
    device_free: int,
    host_free: int,
    budget: int,
    reserve: int,
    mode: str = "auto",
    *,
    device_total: int | None = None,
    host_total: int | None = None,
    host_reserve: int | None = None,
    target: str = "cuda",
    disk_room: int = 0,
) -> CachePlan:
    """Decide how many samples go on the device, in host memory, and from the source.

    The device tier takes at most ``min(budget, device_free - reserve)`` bytes (modes ``auto``
    and ``device``); the host tier at most ``host_free - host_reserve`` (modes ``auto`` and
    ``host``). Whole samples only. ``target="cpu"`` means batches are used on the host: the
    source serves every sample and no tier is built. ``disk_room``: bytes of the disk tier
    (``cache_dir``; 0: none), which takes the samples after the host tier's (modes ``auto``
    and ``host``).
    """
    if mode not in MODES:
        raise ValueError(f"cache mode {mode!r} is not one of {', '.join(MODES)}")
    if target not in ("cuda", "cpu"):
        raise ValueError(f"target {target!r} must be 'cuda' or 'cpu'")
    if bytes_per_sample <= 0:
        raise ValueError(f"bytes_per_sample must be positive, got {bytes_per_sample}")
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    for name, value in (("device_free", device_free), ("host_free", host_free), ("budget", budget),
                        ("reserve", reserve)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 bytes, got {value}")
    if host_reserve is None:
        host_reserve = default_host_reserve(host_total if host_total is not None else host_free)
    notes: list[str] = []
    device_samples = host_samples = host_room = 0
    total = bytes_per_sample * num_samples
    if target == "cpu":
        notes.append("batches are used on the CPU: the source already serves as the device tier")
    elif mode == "off":
        notes.append("cache is off: every sample is read from the source and copied every epoch")
    else:
        if mode in ("auto", "device"):
            room = max(0, device_free - reserve)
            device_cap = min(budget, room)
            device_samples = min(num_samples, device_cap // bytes_per_sample)
            if budget == 0:
                notes.append("the device budget is 0 (cache_size off): no device tier")
            elif device_samples < num_samples:
                limiter = (
                    f"the budget ({format_bytes(budget)})" if budget < room
                    else f"free device memory minus the reserve ({format_bytes(room)})"
                )
                notes.append(f"{limiter} holds {device_samples} of {num_samples} samples")
        if mode in ("auto", "host"):
            host_cap = max(0, host_free - host_reserve)
            left = num_samples - device_samples
            host_samples = min(left, host_cap // bytes_per_sample)
            host_room = min(num_samples, host_cap // bytes_per_sample)  # if the device tier falls back
            if host_samples < left:
                notes.append(
                    f"host memory ({format_bytes(host_cap)} after the host reserve) holds "
                    f"{host_samples} of the {left} samples left"
                )
        if total and device_samples == num_samples:
            notes.append("the whole dataset fits on the device: epochs after the fill copy nothing")
    tiers: tuple[TierPlan, ...] = (TierPlan("device", 0, device_samples, bytes_per_sample),
             TierPlan("host", device_samples, host_samples, bytes_per_sample, room=host_room))
    if disk_room > 0 and target != "cpu" and mode in ("auto", "host"):
        left = num_samples - device_samples - host_samples
        disk_samples = min(left, disk_room // bytes_per_sample)
        if disk_samples < left:
            notes.append(f"the disk tier ({format_bytes(disk_room)}) holds {disk_samples} of the {left} samples left")
        tiers += (TierPlan("disk", device_samples + host_samples, disk_samples, bytes_per_sample,
                           room=min(num_samples, disk_room // bytes_per_sample)),)
    return CachePlan(
        mode=mode,
        target=target,
        bytes_per_sample=bytes_per_sample,
        num_samples=num_samples,
        tiers=tiers,
        budget=budget,
        reserve=reserve,
        host_reserve=host_reserve,
        device_free=device_free,
        device_total=device_total,
        host_free=host_free,
        host_total=host_total,
        notes=tuple(notes),
    )
