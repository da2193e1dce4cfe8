"""What each rank of the batch-size tests runs (imported by name in the spawned processes):
``set_batch_size`` with the data split over ranks, made on every rank together, on some only,
through ``OOMRetry``; and ``shrink_cache`` on a split cache. One job runs every scenario, so the
processes start once; each rank writes its findings to ``rank<r>.json``.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import ranks_job
import samples_job
import torch
import torch.distributed as dist
import torch.utils.data as tud
from torch.utils.data.distributed import DistributedSampler

import gpuload
from gpuload.distributed import ExchangeError
from gpuload.job import OOMRetry

SEED = ranks_job.SEED
BATCH = 8
# After batch k of epoch e, set_batch_size(n) for each n listed (two at once: the second replaces
# the first's rest before a batch of it arrived).
CHANGES = {(0, 2): (5,), (1, 1): (4, 11)}
# Set after the last batch of epoch 1: nothing of the epoch left to cut, or with drop_last the
# samples a batch of 11 left out, now cut at 7; then epoch 2's size.
LAST = 7


def datasets() -> dict[str, tud.Dataset]:
    """Arrays (gathered from the tensors) and a map-style dataset (the sample cache's columns)."""
    return {"arrays": ranks_job.dataset(), "samples": samples_job.Pairs()}


def expected_indices(data: tud.Dataset, epoch: int, shuffle: bool, drop_last: bool, size: int,
                     changes: dict[tuple[int, int], tuple[int, ...]]) -> list[list[int]]:
    """This rank's batches of ``epoch``: its DistributedSampler order cut at ``size``, then, after
    each change, the rest of the order cut at the new size (torch's drop_last rule)."""
    sampler = DistributedSampler(data, shuffle=shuffle, seed=SEED, drop_last=drop_last)
    sampler.set_epoch(epoch)
    order, batches, at = list(sampler), [], 0
    while at < len(order) and not (drop_last and len(order) - at < size):
        batches.append(order[at : at + size])
        at += len(batches[-1])
        size = changes.get((epoch, len(batches) - 1), (size,))[-1]
    return batches


def torch_batches(data: tud.Dataset, indices: list[list[int]]) -> list[Any]:
    """torch's DataLoader's batches of exactly ``indices`` (its fetch and default collate)."""
    return list(tud.DataLoader(data, batch_sampler=indices))


def same_batches(expected: list[Any], got: list[Any]) -> bool:
    return len(got) == len(expected) and all(samples_job.same(a, b) for a, b in zip(expected, got))


def loader(data: tud.Dataset, scope: str, shuffle: bool = True, drop_last: bool = False,
           **options: Any) -> gpuload.DataLoader:
    sampler = DistributedSampler(data, shuffle=shuffle, seed=SEED, drop_last=drop_last)
    return gpuload.DataLoader(data, BATCH, sampler=sampler, drop_last=drop_last, cache_scope=scope,
                              **{"device": "cpu", **options})


def on_cpu(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.cpu()
    return type(batch)(on_cpu(leaf) for leaf in batch) if isinstance(batch, (list, tuple)) else batch


def change_on_every_rank(data: tud.Dataset, scope: str, shuffle: bool, drop_last: bool,
                         prefetch_depth: int | None, lag_s: float = 0.0, device: str = "cpu") -> dict:
    """Three epochs with every rank calling set_batch_size at the same batches (CHANGES, and
    LAST after epoch 1's last batch); ranks other than 0 wait ``lag_s`` before each change in
    CHANGES (rank 0's exchange ahead waits for them)."""
    ours = loader(data, scope, shuffle, drop_last, prefetch_depth=prefetch_depth, device=device)
    equal, sizes, lengths, changes = True, [], [], dict(CHANGES)
    with ranks_job.recorded_warnings() as caught:
        for epoch, first_size in enumerate((BATCH, 5, LAST)):
            ours.sampler.set_epoch(epoch)
            got, batches = [], iter(ours)
            for k, batch in enumerate(batches):
                got.append(on_cpu(batch))
                if (epoch, k) in CHANGES and dist.get_rank() != 0:
                    time.sleep(lag_s)
                for size in CHANGES.get((epoch, k), ()):
                    ours.set_batch_size(size)
                if epoch == 1 and k == len(batches) - 1 and ours.batch_size != LAST:
                    ours.set_batch_size(LAST)
                    changes[(epoch, k)] = (LAST,)
            lengths.append(len(batches))
            indices = expected_indices(data, epoch, shuffle, drop_last, first_size, changes)
            sizes.append([len(i) for i in indices])
            expected = torch_batches(data, indices)
            equal = equal and same_batches(expected, got)
    result = {"equal": equal, "sizes": sizes, "lengths": lengths, "path": ours.stats.path,
              "split": ours.cache_split_over_ranks, "exchange": ours.stats.extra.get("exchange"),
              "warnings": [str(w.message) for w in caught]}
    ours.close()
    return result


def change_then_resume(data: tud.Dataset, scope: str, prefetch_depth: int | None, device: str = "cpu") -> dict:
    """Every rank changes the size after batch 1 and saves its state after batch 2 (the first at
    the new size); a new loader resumes from it: the rest of the epoch and the next one as
    without the stop."""
    first = loader(data, scope, prefetch_depth=prefetch_depth, device=device)
    got = []
    for k, batch in enumerate(first):
        got.append(on_cpu(batch))
        if k == 1:
            first.set_batch_size(5)
        if k == 2:
            break
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    first.close()
    second = loader(data, scope, prefetch_depth=prefetch_depth, device=device)
    second.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
    got += [on_cpu(batch) for batch in second]
    second.sampler.set_epoch(1)
    got += [on_cpu(batch) for batch in second]
    changes = {(0, 1): (5,)}
    expected = torch_batches(data, expected_indices(data, 0, True, False, BATCH, changes)
                             + expected_indices(data, 1, True, False, 5, changes))
    equal = same_batches(expected, got)
    result = {"equal": equal, "split": second.cache_split_over_ranks, "batch_size": second.batch_size}
    second.close()
    return result


def disagree(data: tud.Dataset, sizes: tuple[int | None, ...], at: int | None, prefetch_depth: int | None) -> dict:
    """Rank r calls set_batch_size(sizes[r]) after batch ``at`` of epoch 0 (None: after the epoch;
    a size None: it does not), then every rank goes on to epoch 1: what it raised, how soon, and
    how many batches it got."""
    ours = loader(data, "world", prefetch_depth=prefetch_depth)
    began, error, received = time.perf_counter(), None, 0
    size = sizes[dist.get_rank()]
    try:
        for epoch in range(2):
            ours.sampler.set_epoch(epoch)
            for k, _ in enumerate(ours):
                received += 1
                if epoch == 0 and k == at and size is not None:
                    ours.set_batch_size(size)
            if epoch == 0 and at is None and size is not None:
                ours.set_batch_size(size)
    except ExchangeError as caught:
        error = str(caught)
    seconds = time.perf_counter() - began
    ours.close()
    dist.barrier()
    return {"error": error, "seconds": seconds, "received": received}


def restart_same_epoch(data: tud.Dataset) -> dict:
    """Rank 0 stops after two batches and iterates again without set_epoch (the same sampler
    epoch, the same size); the others go on: what each raised (not a batch-size error)."""
    with ranks_job.stopped_peer_timeout():
        return _restart_same_epoch(data)


def _restart_same_epoch(data: tud.Dataset) -> dict:
    ours = loader(data, "world", prefetch_depth=0)
    error = None
    try:
        for k, _ in enumerate(ours):
            if dist.get_rank() == 0 and k == 1:
                break
        if dist.get_rank() == 0:
            for _ in ours:
                pass
    except ExchangeError as caught:
        error = str(caught)
    ours.close()
    dist.barrier()
    return {"error": error}


class RankRunsOut:
    """A step that runs out of device memory above ``limit`` samples on rank 0 only."""

    def __init__(self, limit: int) -> None:
        self.limit, self.sizes, self.seen = limit, [], []

    def __call__(self, batch: list[torch.Tensor]) -> int:
        if dist.get_rank() == 0 and len(batch[2]) > self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (pretended)")
        self.sizes.append(len(batch[2]))
        self.seen += batch[2].tolist()
        return len(batch[2])


def oom_retry(data: tud.Dataset) -> dict:
    """OOMRetry with a loader split over ranks: rank 0 runs out of memory; the loaders keep the
    size on every rank (the epochs complete in step), rank 0 splits its batches and says why."""
    ours = loader(data, "world")
    step = RankRunsOut(limit=5)
    retry = OOMRetry(step, loader=ours)
    with ranks_job.recorded_warnings() as caught:
        error = None
        try:
            for epoch in range(2):
                ours.sampler.set_epoch(epoch)
                for batch in ours:
                    retry(batch)
        except ExchangeError as raised:
            error = str(raised)
    expected = []
    for epoch in range(2):
        expected += [i for batch in expected_indices(data, epoch, True, False, BATCH, {}) for i in batch]
    result = {"error": error, "seen_in_order": step.seen == expected, "sizes": sorted(set(step.sizes)),
              "loader_batch_size": ours.batch_size, "retry_batch_size": retry.batch_size,
              "warnings": [str(w.message) for w in caught]}
    ours.close()
    return result


def shrink(data: tud.Dataset) -> dict:
    """shrink_cache on a split cache frees nothing, says why, and the batches stay torch's."""
    ours = loader(data, "world")
    list(ours)
    with ranks_job.recorded_warnings() as caught:
        freed = ours.shrink_cache(0)
    ours.sampler.set_epoch(1)
    got = [on_cpu(batch) for batch in ours]
    expected = torch_batches(data, expected_indices(data, 1, True, False, BATCH, {}))
    equal = same_batches(expected, got)
    ours.close()
    return {"freed": freed, "equal": equal, "warnings": [str(w.message) for w in caught]}


def run(rank: int, world: int, init_file: str, out_dir: str, local_world_size: int | None) -> None:
    with ranks_job.gloo_job(rank, world, init_file, local_world_size):
        found: dict = {"every_rank": {}, "resume": {}}
        for kind, data in datasets().items():
            for scope in ("node", "world"):
                for depth in (None, 0):
                    key = f"{kind}/{scope}/depth={depth}"
                    found["every_rank"][key] = change_on_every_rank(data, scope, True, False, depth)
                    found["resume"][key] = change_then_resume(data, scope, depth)
            for shuffle, drop_last in ((False, True), (True, True)):
                found["every_rank"][f"{kind}/world/shuffle={shuffle}/drop_last={drop_last}"] = (
                    change_on_every_rank(data, "world", shuffle, drop_last, None))
            found[f"shrink/{kind}"] = shrink(data)
        found["every_rank"]["arrays/world/lagging"] = change_on_every_rank(
            datasets()["arrays"], "world", True, False, None, lag_s=0.3)
        arrays = datasets()["arrays"]
        one_rank, different = (5, *[None] * (world - 1)), (5, *[6] * (world - 1))
        found["disagree"] = {
            f"{name}/at={at}/depth={depth}": disagree(arrays, sizes, at, depth)
            for name, sizes in (("one_rank", one_rank), ("different", different))
            for at, depth in ((0, None), (0, 0), (2, None))
        }
        found["disagree"]["samples/one_rank/at=0"] = disagree(datasets()["samples"], one_rank, 0, None)
        found["disagree"]["one_rank/between_epochs"] = disagree(arrays, one_rank, None, None)
        found["restart_same_epoch"] = restart_same_epoch(arrays)
        found["oom_retry"] = oom_retry(arrays)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(found))


def run_nccl(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Every rank changing the size together over NCCL, one GPU per rank, the exchange issued
    from the loop's thread whatever ``prefetch_depth`` (SplitStore.runs_ahead)."""
    with ranks_job.nccl_job(rank, world, init_file):
        device = f"cuda:{rank}"
        found: dict = {"every_rank": {}, "resume": {}}
        for kind, data in datasets().items():
            for depth in (None, 0):
                key = f"{kind}/world/depth={depth}"
                found["every_rank"][key] = change_on_every_rank(data, "world", True, False, depth, device=device)
                found["resume"][key] = change_then_resume(data, "world", depth, device=device)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(found))
