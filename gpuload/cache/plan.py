"""Where each sample's bytes live: a pure placement decision, printable, testable on any card size.

``make_plan`` takes sizes and free memory as plain numbers and returns a :class:`CachePlan`:
samples ``[0, k)`` on the device, the next ``h`` in pinned host memory, the rest read from the
source each epoch. Nothing here allocates or asks a device anything.

Host reserve: the pinned host tier leaves ``max(4 GiB, 10% of host RAM)`` available. Pinned
pages cannot be swapped out, and the process still needs host memory for the interpreter,
loader workers, checkpoints and the source data itself; running the host out of memory kills
the job, which is worse than streaming.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuload.cache.budget import format_bytes

__all__ = ["MODES", "CachePlan", "make_plan", "default_host_reserve", "HOST_RESERVE_MIN_BYTES", "HOST_RESERVE_FRACTION"]

HOST_RESERVE_MIN_BYTES = 4 << 30
HOST_RESERVE_FRACTION = 0.10
MODES = ("auto", "device", "host", "off")
"""The cache modes, everywhere a mode is checked."""


def default_host_reserve(host_total: int) -> int:
    """Host bytes the pinned tier leaves available: max(4 GiB, 10% of host RAM)."""
    return max(HOST_RESERVE_MIN_BYTES, int(host_total * HOST_RESERVE_FRACTION))


@dataclass(frozen=True)
class CachePlan:
    """Placement of ``num_samples`` samples of ``bytes_per_sample`` bytes each.

    Samples ``[0, device_samples)`` live on the device, the next ``host_samples`` in pinned
    host memory, and the remaining ``source_samples`` are read from the source every epoch.
    ``target`` is the device type batches are delivered to; on ``"cpu"`` nothing crosses PCIe
    and the source itself serves every sample.
    """

    mode: str
    target: str
    bytes_per_sample: int
    num_samples: int
    device_samples: int
    host_samples: int
    budget: int
    reserve: int
    host_reserve: int
    device_free: int
    device_total: int | None
    host_free: int
    host_total: int | None
    notes: tuple[str, ...] = field(default=())

    @property
    def source_samples(self) -> int:
        return self.num_samples - self.device_samples - self.host_samples

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
        """Host bytes the pinned tier may take: free host memory minus the host reserve."""
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
        parts = [
            name
            for name, count in (("device", self.device_samples), ("host", self.host_samples),
                                ("stream", self.source_samples))
            if count
        ]
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
            lines += [
                f"  device tier:    {share(self.device_samples)}",
                f"  pinned host:    {share(self.host_samples)}",
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
) -> CachePlan:
    """Decide how many samples go on the device, in pinned host memory, and from the source.

    The device tier takes at most ``min(budget, device_free - reserve)`` bytes (modes ``auto``
    and ``device``); the pinned tier at most ``host_free - host_reserve`` (modes ``auto`` and
    ``host``). Whole samples only. ``target="cpu"`` means batches are used on the host: the
    source serves every sample and no tier is built.
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
    device_samples = host_samples = 0
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
            if host_samples < left:
                notes.append(
                    f"pinned host memory ({format_bytes(host_cap)} after the host reserve) holds "
                    f"{host_samples} of the {left} samples left"
                )
        if total and device_samples == num_samples:
            notes.append("the whole dataset fits on the device: epochs after the fill copy nothing")
    return CachePlan(
        mode=mode,
        target=target,
        bytes_per_sample=bytes_per_sample,
        num_samples=num_samples,
        device_samples=device_samples,
        host_samples=host_samples,
        budget=budget,
        reserve=reserve,
        host_reserve=host_reserve,
        device_free=device_free,
        device_total=device_total,
        host_free=host_free,
        host_total=host_total,
        notes=tuple(notes),
    )
