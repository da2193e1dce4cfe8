"""Rank 0 of a pretended two-rank world in this process, without a process group: the split's
setup collectives (``all_gather`` on the control group) answered for the other rank, and
stand-ins for the exchange's groups. For the failure branches a rank meets when a peer read
otherwise, disagrees or died, which the gloo jobs cannot stage at a chosen point. And
:class:`Wire`: the exchange's collective between ranks run as threads of this process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler
from torch.utils.data.distributed import DistributedSampler

from gpuload.distributed import DistributedContext, split_store
from gpuload.distributed.split_store import SplitStore

WORLD = 2
CONTEXT = DistributedContext(rank=0, world_size=WORLD, local_world_size=WORLD, backend="gloo")
GROUPS = ("control", "data")

#: What the other rank sends in one ``all_gather``: None (what this rank sent), a function of
#: this rank's tensor (a copy) giving the other rank's, or an exception the collective raises
#: (a peer gone).
Answer = Callable[[torch.Tensor], torch.Tensor] | BaseException | None


def batches(num_samples: int, batch_size: int = 4) -> BatchSampler:
    """Rank 0's batch sampler over torch's DistributedSampler of two ranks."""
    return BatchSampler(DistributedSampler(range(num_samples), num_replicas=WORLD, rank=0), batch_size, False)


class FakePeers:
    """Answers this process's ``all_gather`` calls in turn from ``answers``; past them, the other
    rank sends what this one sent (it agrees, and read its share as this one did). Its
    ``all_gather_object`` calls get the other rank's object from ``objects`` in turn; past
    them, what this rank sent. ``calls``: the collectives made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, answers: list[Answer] | None = None,
                 objects: list[Any] | None = None) -> None:
        assert not dist.is_initialized()
        self.answers = list(answers or [])
        self.objects = list(objects or [])
        self.calls = 0
        monkeypatch.setattr(split_store, "exchange_groups", lambda device, timeout: GROUPS)
        monkeypatch.setattr(dist, "all_gather", self._all_gather)
        monkeypatch.setattr(dist, "all_gather_object", self._all_gather_object)

    def _all_gather_object(self, everyone: list[Any], mine: Any, group: Any = None) -> None:
        assert group == GROUPS[0]
        self.calls += 1
        everyone[0] = mine
        everyone[1] = self.objects.pop(0) if self.objects else mine

    def _all_gather(self, everyone: list[torch.Tensor], mine: torch.Tensor, group: Any = None) -> None:
        assert group == GROUPS[0]
        self.calls += 1
        answer = self.answers.pop(0) if self.answers else None
        if isinstance(answer, BaseException):
            raise answer
        everyone[0].copy_(mine)
        everyone[1].copy_(mine if answer is None else answer(mine.clone()))


class Wire:
    """``all_to_all_single`` between the ranks of one process: each posts its outgoing bytes and
    splits, and takes its part of every other rank's once all have posted: the ranks of one
    process in threads, without a process group (the gloo jobs run the real collective)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.posted: dict[int, tuple[torch.Tensor, list[int]]] = {}
        self.barrier = threading.Barrier(world)

    def connect(self, store: SplitStore, rank: int) -> None:
        def swap(received, outgoing, recv_splits, send_splits, header) -> None:
            self.posted[rank] = (outgoing, send_splits)
            self.barrier.wait(timeout=10)
            parts = []
            for peer in range(self.world):
                data, splits = self.posted[peer]
                begin = sum(splits[:rank])
                parts.append(data[begin : begin + splits[rank]])
                assert splits[rank] == recv_splits[peer]
            received.copy_(torch.cat(parts))
            self.barrier.wait(timeout=10)

        store._swap = swap
        store._check_peers = lambda plan, header: None
