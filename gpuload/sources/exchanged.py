"""The split over ranks as a wrapper source: :class:`Exchanged` serves any source whose store is split over
ranks, so that no source knows it is split.

A store split over ranks (:class:`~gpuload.distributed.split_store.SplitStore`, made where a
source decides its cache, from ``cache_scope``) holds this rank's share and owns the exchange:
each batch's rows come from every rank's share, in collectives every rank makes in step. The
wrapper runs that exchange for the epoch's batch indices (the rest of a resumed epoch cut as the
loader cut it), tells the exchange of each batch the loop received (how far it may run ahead),
and hands each batch's gathered rows to the source it wraps, which makes its batch of them as
of rows gathered anywhere (:meth:`Source.from_rows`). Everything else (placing, stats, memory)
is the source's; the wrapper adds the exchange's counters to its stats.

The loader asks :func:`serving` after each ``begin_epoch``, the point where a source decides
its store, which source serves the epoch: the source, or the source wrapped.
"""

from __future__ import annotations

from typing import Any

import torch

from gpuload.cache import Store
from gpuload.distributed.split_store import SplitStore
from gpuload.sources import Indices, Schedule, Source, Work

__all__ = ["Exchanged", "serving"]


class Exchanged(Source):
    """``inner``'s batches made from rows every rank's share gives (see the module docstring).

    Each step is a collective made on the device itself (not staged); over gloo the steps may
    run ahead of the loop, in the prefetcher's thread (on a CPU device too: each step waits for
    the other ranks), where ``inner`` allows it (``Source.rows_ahead``)."""

    def __init__(self, inner: Source) -> None:
        super().__init__(inner.setup)
        self.inner = inner

    @property
    def path(self) -> str:  # type: ignore[override]  # the inner source's, as it changes
        return self.inner.path

    @property
    def h2d_bytes(self) -> int:  # type: ignore[override]  # the inner source's running total
        return self.inner.h2d_bytes

    def share(self) -> SplitStore:
        """The store split over ranks the wrapped source holds now."""
        store = self.inner.cache_store()
        if not isinstance(store, SplitStore):
            raise RuntimeError(f"{type(self.inner).__name__} holds no store split over ranks to exchange "
                               f"(its store: {type(store).__name__})")
        return store

    def begin_epoch(self) -> None:
        self.inner.begin_epoch()

    def schedule(self, indices: Indices) -> Schedule:
        """The exchange's steps for this epoch, each item made into a batch by the wrapped source."""
        store, inner, setup = self.share(), self.inner, self.setup

        def start(ahead: bool) -> Work:
            drawn = [torch.as_tensor(index, dtype=torch.long).reshape(-1) for index in indices.batches(ahead)]
            cut = indices.rest.cut if indices.rest is not None else None
            steps = store.epoch(setup.batch_sampler, drawn, position=cut, ahead=ahead,
                                loop_wait_s=setup.stats.wait_time_s if inner.rows_ahead else 0.0,
                                number=indices.number)
            rows = inner.from_rows(indices.number, ahead)

            def finish(item: Any) -> tuple[Any, int] | None:
                steps.handed_over()  # every step counts, one whose batch holds nothing too
                return rows.finish(item)

            return Work(steps.map(rows.made) if rows.made is not None else steps, finish)

        # Double buffering: the exchange of the next batch while the loop computes this one.
        return Schedule(start, ahead=inner.rows_ahead and store.runs_ahead, ahead_on_cpu=True, staged=False)

    def warm(self, progress: bool) -> None:
        self.inner.warm(progress)

    def stats(self) -> dict[str, Any]:
        """The wrapped source's entries, and ``"exchange"``: the exchange's counters once it ran."""
        entries = self.inner.stats()
        store = self.inner.cache_store()
        if isinstance(store, SplitStore) and store.exchange_stats.wait_s_per_epoch:
            loop_wait_s = self.setup.stats.wait_time_s if self.inner.rows_ahead else None
            entries["exchange"] = store.describe_exchange(loop_wait_s=loop_wait_s)
        return entries

    def cache_store(self) -> Store | None:
        return self.inner.cache_store()

    def close(self) -> None:
        self.inner.close()


def serving(source: Source) -> Source:
    """The source that serves the next epoch, asked after its ``begin_epoch``: ``source``
    wrapped in :class:`Exchanged` when its store is split over ranks, else ``source`` itself
    (unwrapped, when a source decided its store again and kept it whole)."""
    inner = source.inner if isinstance(source, Exchanged) else source
    if not isinstance(inner.cache_store(), SplitStore):
        return inner
    return source if isinstance(source, Exchanged) else Exchanged(inner)
