"""Every kind of store, built small on the CPU, with what it must gather: the cases of the
store contract (``tests/cache/test_store.py``) and of the sources' cache questions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import default_collate

from gpuload.cache import TieredArrayStore
from gpuload.cache.budget import BudgetLedger
from gpuload.cache.columns import ColumnStore, prepare
from gpuload.cache.plan import CachePlan, TierPlan, make_plan
from gpuload.cache.sample_store import SampleStore
from gpuload.cache.store import Store
from gpuload.cache.tiers import TIERS, HostTier
from gpuload.distributed.image_shares import image_share
from gpuload.distributed.partition import Partition
from gpuload.distributed.scope import ScopeDecision
from gpuload.distributed.split_store import SplitPlan, split_array_store
from gpuload.prefetch import Prefetcher
from gpuload.sources.placed_arrays import staged_copier

N = 240
GiB = 2**30


def columns() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (N, 3, 5, 5), dtype=torch.uint8, generator=g),  # 75 bytes a row: the
            torch.arange(N, dtype=torch.int64), torch.rand(N, 2, generator=g)]  # next column is unaligned


def bytes_per_sample(data: list[torch.Tensor]) -> int:
    return sum(column[0].numel() * column.element_size() for column in data)


class SlowHostTier(HostTier):
    """A toy tier, added in one class: rows in host memory, each gather counted (as a disk
    tier's reads would be). Used only in tests; never registered globally."""

    name = "slow-host"
    reads = 0

    def gather(self, column: int, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        SlowHostTier.reads += 1
        return super().gather(column, slots, out)


def planned(data: list[torch.Tensor], tiers: list[tuple[str, int]]) -> CachePlan:
    """A plan whose tiers hold the given counts of samples, in order."""
    bps = bytes_per_sample(data)
    base = make_plan(bps, N, device_free=80 * GiB, host_free=0, budget=0, reserve=0, host_reserve=0)
    first, plans = 0, []
    for name, samples in tiers:
        plans.append(TierPlan(name, first, samples, bps))
        first += samples
    return CachePlan(**{**base.__dict__, "tiers": tuple(plans)})


@dataclass
class Case:
    """A store holding ``held`` dataset indices, the batch it must gather for any of them, and
    how to make a batch from it (``gather``: the loader's way for that store)."""

    store: Store
    held: torch.Tensor
    expected: Any
    gather: Any = None

    def batch(self, indices: torch.Tensor) -> Any:
        return (self.gather or self.store.gather)(indices)


def _arrays(data, plan, **options) -> TieredArrayStore:
    return TieredArrayStore(list(data), plan, "cpu", ledger=BudgetLedger(), **options)


def array_case(kind: str, device: str = "cpu") -> Case:
    data = columns()
    expected = lambda index: [column.index_select(0, index) for column in data]  # noqa: E731
    everything = torch.arange(N)
    if kind == "tiered":
        return Case(_arrays(data, planned(data, [("device", 60), ("host", 100)])), everything, expected)
    if kind == "toy-tier":
        store = _arrays(data, planned(data, [("device", 50), ("slow-host", 120)]),
                        tiers={**TIERS, "slow-host": SlowHostTier})
        return Case(store, everything, expected)
    # the loader's path: host rows gathered straight into a prefetcher's slot, then copied
    prefetcher = Prefetcher(None, device)
    copy = staged_copier(prefetcher.copy_now)
    plan = planned(data, [("device", 70), ("host", 90)])
    store = TieredArrayStore(list(data), plan, device, ledger=BudgetLedger(),
                             stage_host_rows=True if device == "cpu" else None)
    return Case(store, everything, expected, gather=lambda index: store.gather(index, copy=copy))


def samples() -> list[tuple[torch.Tensor, int, dict[str, float]]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.rand(3, generator=g), k, {"w": float(k) / 2}) for k in range(N)]


def columns_case(device: str = "cpu") -> Case:
    data = samples()
    store = ColumnStore(1 << 30, N, device, ledger=BudgetLedger())
    held = torch.arange(0, N, 2)
    store.put(held, prepare([data[k] for k in held.tolist()]))
    return Case(store, held, lambda index: default_collate([data[k] for k in index.tolist()]))


def sample_cache_case(device: str = "cpu") -> Case:
    data = samples()
    cache = SampleStore(1 << 30, device, ledger=BudgetLedger(), num_samples=N)
    held = torch.arange(1, N, 3)
    assert cache.put(held, [data[k] for k in held.tolist()]) == held.numel()
    return Case(cache, held, lambda index: [data[k] for k in index.tolist()])


def _share_plan(data_bytes: int) -> SplitPlan:
    decision = ScopeDecision("world", "world", 2, "a test's share")
    return SplitPlan(decision, Partition(N, 2, 2), 1, data_bytes, "cpu")


def split_arrays_case(device: str = "cpu") -> Case:
    data = columns()
    plan = _share_plan(bytes_per_sample(data))
    start, stop = plan.partition.rows_of(1)
    block = [column[start:stop].clone() for column in data]
    store = split_array_store(block, plan, torch.device(device), (None, None), owner="share", ledger=BudgetLedger())
    return Case(store, torch.arange(start, stop), lambda index: [column.index_select(0, index) for column in data])


def split_images_case() -> Case:
    g = torch.Generator().manual_seed(9)
    images = [torch.randint(0, 256, (3, 4 + k % 3, 5), dtype=torch.uint8, generator=g) for k in range(N)]
    plan = _share_plan(60)
    start, stop = plan.partition.rows_of(1)
    mine = [images[k] for k in range(start, stop)]
    chunk = torch.cat([image.reshape(-1) for image in mine])
    views, offset = [], 0
    for image in mine:
        views.append(chunk[offset : offset + image.numel()])
        offset += image.numel()
    table = torch.tensor([[0, *image.shape, 0] for image in images], dtype=torch.int64)
    store = image_share([chunk], views, table, {}, plan, torch.device("cpu"), (None, None), on_error="raise",
                        name=str, failure=RuntimeError, owner="share", ledger=BudgetLedger())
    return Case(store, torch.arange(start, stop), lambda index: [images[k] for k in index.tolist()])


CASES = {
    "arrays-tiered": lambda: array_case("tiered"),
    "arrays-staged": lambda: array_case("staged"),
    "arrays-toy-tier": lambda: array_case("toy-tier"),
    "sample-columns": columns_case,
    "samples": sample_cache_case,
    "sharded-arrays": split_arrays_case,
    "sharded-images": split_images_case,
}
