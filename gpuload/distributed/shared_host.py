"""One host tier per node: the node's ranks map one copy of it in shared memory.

Without this, each rank of a node keeps its own copy of the arrays' host tier (8 ranks, 8
copies). :class:`NodeHostTier` is a :data:`~gpuload.cache.array_store.HostTierMaker` that every
rank calls at the same point (when its ``TieredArrayStore`` places its tiers). Over a gloo group
of its own, the ranks of each node agree on one range of rows; the node's lowest rank (its
leader) creates a file in ``/dev/shm``, every rank that needs rows opens it, the leader unlinks
it at once, sizes it (``posix_fallocate``: a full ``/dev/shm`` fails here, cleanly, instead of
with SIGBUS on a write later) and fills it; then each rank maps it through its open descriptor
(``/proc/self/fd``). The mapping is not pinned (no ``cudaHostRegister``): a batch's rows are
gathered from it into the prefetcher's pinned staging slots, which are the only host memory a
copy to the device reads. Nothing is left in
``/dev/shm`` after the first two messages of the setup, so a rank killed later (even with
SIGKILL) leaves nothing behind: the memory goes when the last rank holding it exits.

Why a file in ``/dev/shm`` mapped by ``torch.from_file`` rather than
``multiprocessing.shared_memory``: torch owns the mapping's lifetime (unmapped with the last
tensor viewing it, no "exported pointers" error at close); Python's resource tracker (before
3.13 it also tracks segments a process only attaches to, and unlinks or warns about them at
exit) is not involved; and the descriptor lets the segment be unlinked before it is filled.

The ranks of a node are those with the same node index (``rank // LOCAL_WORLD_SIZE``:
torchrun numbers ranks contiguously per node) *and* the same machine and ``/dev/shm`` (host
name, boot id, the device of ``/dev/shm``): a layout that breaks torchrun's assumption, or
containers that do not share ``/dev/shm``, share less, never wrongly.

The host budget is the node's, counted once: the shared copy holds at most the smallest
budget the node's ranks saw. When sharing is not possible (``/dev/shm`` too small, the ranks'
arrays differ, a rank cannot open the segment) each rank keeps its own copy of its rows,
in ``1/ranks`` of that budget, with one :class:`~gpuload.cache.CacheFallbackWarning`: a job
that runs today (docker's default ``/dev/shm`` is 64 MiB) keeps running.

The shared copy is written only by the leader, before any other rank maps it; afterwards no
rank writes to it (the store only reads its host tier).
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import socket
import warnings
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from gpuload.cache import CacheFallbackWarning, CacheSettings, format_bytes
from gpuload.cache.array_store import HostTier, private_host_tier
from gpuload.cache.chunked_rows import copy_rows
from gpuload.distributed.group import (
    EXCHANGE_TIMEOUT_ENV,
    DistributedContext,
    current_context,
    exchange_timeout,
    peers_answer,
    release_groups,
)

__all__ = ["SEGMENT_PREFIX", "SHM_DIR", "NodeHostTier", "node_host_tier", "shm_free_bytes"]

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "gpuload-host-"
"""Segments are named ``gpuload-host-<leader pid>-<random hex>`` while they exist (milliseconds)."""

_ALIGN = 64  # each array's block starts on a cache line (and on any element size)
_SAMPLED_ROWS = 16  # rows per array compared across ranks: catches ranks loading different data
_OK, _NO_SPACE, _FAILED = 0, 1, 2


def shm_free_bytes(directory: str = SHM_DIR) -> int:
    """Bytes free in the shared-memory file system (what a new segment may take)."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def _int63(text: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def _machine_identity() -> int:
    """Ranks with the same number share a ``/dev/shm``: host name, boot id, its device."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as handle:
            boot = handle.read().strip()
    except OSError:
        boot = b""
    return _int63(b"|".join([socket.gethostname().encode(), boot, str(os.stat(SHM_DIR).st_dev).encode()]))


def _fingerprint(source: list[torch.Tensor]) -> int:
    """A checksum of a few rows of every array, spread over the whole range."""
    n = source[0].shape[0]
    rows = torch.linspace(0, n - 1, min(n, _SAMPLED_ROWS)).long()
    crc = 0
    for column in source:
        crc = zlib.crc32(column.index_select(0, rows).contiguous().view(torch.uint8).numpy().tobytes(), crc)
        crc = zlib.crc32(repr((column.dtype, tuple(column.shape))).encode(), crc)
    return crc


def _layout(source: list[torch.Tensor], rows: int) -> tuple[list[int], int]:
    """Each array's byte offset in a segment of ``rows`` rows, and the segment's size."""
    offsets, size = [], 0
    for column in source:
        offsets.append(size)
        nbytes = rows * column[0].numel() * column.element_size()
        size += -(-nbytes // _ALIGN) * _ALIGN
    return offsets, max(size, 1)


def node_host_tier(
    settings: CacheSettings, device: torch.device, batch_sampler: Any, context: DistributedContext | None = None
) -> NodeHostTier | None:
    """The maker that shares the host tier among the node's ranks, or None (each rank as today).

    Only in a torch.distributed job of several ranks, on CUDA (on a CPU device the arrays are
    served in place, there is no host tier), with a cache that may keep a host tier
    (``"auto"``, ``"host"``), and when the loader's sampler is torch's ``DistributedSampler``
    over all ranks: that says every rank builds this loader, as the setup's messages need.
    """
    context = context or current_context()
    if context is None or context.world_size == 1 or device.type != "cuda":
        return None
    if settings.mode.value not in ("auto", "host") or not os.path.isdir(SHM_DIR):
        return None
    sampler = getattr(batch_sampler, "sampler", None)
    if not isinstance(sampler, DistributedSampler) or sampler.num_replicas != context.world_size:
        return None
    return NodeHostTier(context)


class _Setup:
    """One rank's messages of the setup, on the setup's own gloo group."""

    def __init__(self, context: DistributedContext, group: Any) -> None:
        self.context, self.group = context, group

    def gather(self, values: list[int], step: str) -> list[list[int]]:
        """Every rank's ``values`` (the same length on every rank), in rank order."""
        mine = torch.tensor(values, dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self.context.world_size)]
        with peers_answer(
            f"gpuload: rank {self.context.rank} could not set up the node's shared host tier with "
            f"the other ranks ({step}; waited up to {exchange_timeout().total_seconds():g} s, "
            f"{EXCHANGE_TIMEOUT_ENV}): a rank did not build its loader at the same point, or died."
        ):
            dist.all_gather(everyone, mine, group=self.group)
        return [row.tolist() for row in everyone]


class NodeHostTier:
    """Builds a host tier shared by the ranks of this node (see the module's docstring).

    Call it on every rank of the process group at the same point.
    """

    def __init__(self, context: DistributedContext) -> None:
        self.context = context

    def __call__(self, source: list[torch.Tensor], first: int, rows: int, budget: int) -> HostTier:
        group = dist.new_group(backend="gloo", timeout=exchange_timeout())
        try:
            return self._build(_Setup(self.context, group), source, first, rows, budget)
        finally:
            release_groups((group, group))

    def _build(self, setup: _Setup, source: list[torch.Tensor], first: int, rows: int, budget: int) -> HostTier:
        context, rank = self.context, self.context.rank
        n = source[0].shape[0]
        bps = sum(column[0].numel() * column.element_size() for column in source)
        node_index = rank // max(1, context.local_world_size)
        mine = [_machine_identity(), node_index, os.getpid(), secrets.randbits(62), n, bps, first, rows,
                budget, _fingerprint(source)]
        wishes = setup.gather(mine, "agreeing on the rows")
        members = [r for r, wish in enumerate(wishes) if wish[:2] == mine[:2]]
        leader = wishes[members[0]]
        start = min(wishes[m][6] for m in members)
        stop = min(n, max(wishes[m][6] + wishes[m][7] for m in members))
        node_budget = min(wishes[m][8] for m in members)
        node_rows = max(0, min(stop - start, node_budget // bps))
        same_data = all(wishes[m][4:6] + wishes[m][9:] == leader[4:6] + leader[9:] for m in members)
        is_leader = rank == members[0]
        wants = node_rows > 0 and first < start + node_rows  # rows past this rank's device tier
        offsets, size = _layout(source, node_rows)
        path = os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{leader[2]}-{leader[3]:x}")
        sharing = len(members) > 1 and same_data and node_rows > 0

        def private(reason: str | None) -> HostTier:
            """Each rank its own copy of its rows, in its share of the node's budget."""
            copies = len(members)
            fit = min(rows, (node_budget // copies) // bps) if copies > 1 else rows
            if reason is not None:
                warnings.warn(
                    f"gpuload cache: the node's {copies} ranks do not share one host tier: {reason}; each "
                    f"keeps its own copy of at most {fit} samples ({format_bytes(fit * bps)}, 1/{copies} "
                    f"of the node's host budget of {format_bytes(node_budget)})",
                    CacheFallbackWarning, stacklevel=5,
                )
            return private_host_tier(source, first, fit)

        fd, linked = -1, False
        try:
            status = [_OK, 0]
            if sharing and is_leader:
                status, fd = _create(path, size)
                linked = fd >= 0
            created = setup.gather(status, "creating the segment")[members[0]]
            if sharing and created[0] == _OK and wants and not is_leader:
                try:
                    fd = os.open(path, os.O_RDWR)
                except OSError:
                    fd = -1
            opened = setup.gather([int(fd >= 0 or not wants)], "opening the segment")
            if linked:
                os.unlink(path)  # every rank that maps it holds a descriptor now
                linked = False
            all_opened = all(opened[m][0] for m in members)
            filled = [_OK, 0]
            if sharing and created[0] == _OK and all_opened and is_leader:
                filled = _fill(fd, size, source, offsets, start, node_rows)
            done = setup.gather(filled, "filling the segment")[members[0]]
            if not sharing:
                return private(None if same_data else "their arrays differ (another dataset, or other "
                               "values) though they use one DistributedSampler")
            if created[0] != _OK or done[0] != _OK:
                return private(_no_room_reason(created if created[0] != _OK else done, size))
            if not all_opened:
                return private(f"a rank could not open the shared segment in {SHM_DIR}")
            if not wants:
                return HostTier(start, [], shared_by=len(members))
            return self._map(fd, size, source, offsets, start, node_rows, len(members))
        finally:
            if fd >= 0:
                os.close(fd)
            if linked:  # failed between creating the segment and the others opening it
                os.unlink(path)

    def _map(self, fd: int, size: int, source: list[torch.Tensor], offsets: list[int], start: int,
             rows: int, shared_by: int) -> HostTier:
        segment = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size, dtype=torch.uint8)
        return HostTier(start, _views(segment, source, offsets, rows), shared_by=shared_by)


def _create(path: str, size: int) -> tuple[list[int], int]:
    """The leader's segment, still empty: ``([status, bytes free in /dev/shm], descriptor or -1)``."""
    free = shm_free_bytes()
    if free < size:
        return [_NO_SPACE, free], -1
    try:
        return [_OK, free], os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as error:
        return [_FAILED, error.errno or 0], -1


def _fill(fd: int, size: int, source: list[torch.Tensor], offsets: list[int], start: int, rows: int) -> list[int]:
    """The leader sizes the (unlinked) segment and copies the rows in: ``[status, detail]``."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno == errno.ENOSPC:
            return [_NO_SPACE, shm_free_bytes()]
        return [_FAILED, error.errno or 0]
    segment = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size, dtype=torch.uint8)
    for column, view in zip(source, _views(segment, source, offsets, rows)):
        copy_rows(view, column[start : start + rows])  # a table column's chunks: a piece at a time
    return [_OK, 0]


def _no_room_reason(failed: list[int], size: int) -> str:
    if failed[0] == _NO_SPACE:
        return (
            f"{SHM_DIR} has {format_bytes(failed[1])} free and the shared copy needs {format_bytes(size)}; "
            f"give {SHM_DIR} more room (docker run --shm-size=..., or a larger tmpfs) to keep one copy "
            "per node"
        )
    return f"creating the segment in {SHM_DIR} failed ({os.strerror(failed[1])})"


def _views(segment: torch.Tensor, source: list[torch.Tensor], offsets: list[int], rows: int) -> list[torch.Tensor]:
    """Each array's rows as a tensor viewing its block of ``segment``."""
    views = []
    for column, offset in zip(source, offsets):
        nbytes = rows * column[0].numel() * column.element_size()
        views.append(segment[offset : offset + nbytes].view(column.dtype).view(rows, *column.shape[1:]))
    return views

