"""Which rank the job waits on: every rank's wait share and top stage (``loader.timeline``),
gathered over torch.distributed, so a straggler's disk or decode shows on every rank.

In data-parallel training every rank's step waits for the slowest rank's gradients, so one
rank's slow reads slow them all, while the other ranks' own timelines look compute-bound.
:func:`gather_waits` is a collective (every rank of the group calls it, at the same step): call it
every N steps, never per step. The Lightning callback does (``every_n_steps``). The result is also
kept on the timeline (``timeline.ranks``), and its summary names the slowest rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

from gpuload.timeline import Timeline
from gpuload.verdict import STAGES

__all__ = ["RankWait", "RankWaits", "gather_waits"]


@dataclass(frozen=True)
class RankWait:
    """One rank's share of step time spent waiting (None: not measured yet), over its recent
    steps, and the stage most of its loader's time went to."""

    rank: int
    wait_fraction: float | None
    stage: str | None
    steps: int


@dataclass(frozen=True)
class RankWaits:
    """Every rank's :class:`RankWait`, in rank order."""

    ranks: tuple[RankWait, ...]

    @property
    def slowest(self) -> RankWait | None:
        """The rank that waited the largest share of its step time (None: none measured yet)."""
        measured = [wait for wait in self.ranks if wait.wait_fraction is not None]
        return max(measured, key=lambda wait: wait.wait_fraction or 0.0) if measured else None

    def line(self) -> str:
        """``slowest rank 1 of 2: 45% of step time waiting, mostly dataset reads``."""
        slowest = self.slowest
        if slowest is None or slowest.wait_fraction is None:
            return f"no rank of {len(self.ranks)} measured a step yet"
        share = f"{100 * slowest.wait_fraction:.0f}%"
        line = f"slowest rank {slowest.rank} of {len(self.ranks)}: {share} of step time waiting"
        if slowest.stage is not None:
            line += f", mostly {STAGES.get(slowest.stage, slowest.stage)}"
        return line


def gather_waits(timeline: Timeline, group: Any = None) -> RankWaits:
    """Every rank's wait share and top stage: a collective over ``group`` (default the world;
    without torch.distributed, this process alone). One small ``all_gather_object``: call it every
    N steps, never per step. Also kept as ``timeline.ranks``."""
    fraction, means = timeline.recent()
    top = max(means, key=means.__getitem__) if means else None
    joined = dist.is_available() and dist.is_initialized()
    mine = RankWait(dist.get_rank(group) if joined else 0, fraction, top, timeline.step_count)
    if not joined or dist.get_world_size(group) == 1:
        found = RankWaits((mine,))
    else:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, asdict(mine), group=group)
        found = RankWaits(tuple(RankWait(**wait) for wait in gathered))
    timeline.ranks = found
    return found
