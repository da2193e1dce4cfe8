"""What each rank of the multi-process tests runs (imported by name in the spawned processes).

One job per world size runs every scenario, so the processes start (and import torch) once;
each rank writes its findings to ``rank<r>.json`` for the test process to check.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils.data as tud
from torch.utils.data.distributed import DistributedSampler

import gpuload
from gpuload.distributed import ExchangeError

sys.path.insert(0, str(Path(__file__).parent.parent))
import threads
from recorded_warnings import recorded_warnings

#: World sizes the tests spawn: (ranks, LOCAL_WORLD_SIZE); four: two pretended nodes of two ranks.
JOBS = {"two": (2, None), "four": (4, 2)}  # four: two pretended nodes of two ranks (LOCAL_WORLD_SIZE)
NUM_SAMPLES = 103  # not a multiple of any world size: uneven shares, padded samplers
SEED = 7
#: How long a rank waits for the others: ranks that agree never wait this long, even at load 8
#: on 2 cores (a share read by worker processes took over 3 s there); a wait out fails the test.
EXCHANGE_TIMEOUT_S = 60
#: How long the others wait for a rank that stopped early, in the scenarios staging one.
STOPPED_PEER_TIMEOUT_S = 3


def dataset() -> tud.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (NUM_SAMPLES, 3, 5, 5), dtype=torch.uint8, generator=generator)
    features = torch.randn(NUM_SAMPLES, 7, generator=generator, dtype=torch.float64)
    labels = torch.arange(NUM_SAMPLES, dtype=torch.int64)
    flags = labels % 3 == 0
    return tud.TensorDataset(images, features, labels, flags)


def same(torch_batch: list[torch.Tensor], ours: list[torch.Tensor]) -> bool:
    return len(torch_batch) == len(ours) and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(torch_batch, ours)
    )


def compare(
    data: tud.Dataset, scope: str, shuffle: bool, drop_last: bool, batch_size: int, device: str = "cpu",
    prefetch_depth: int | None = None, compute_s: float = 0.0,
) -> dict:
    """Three epochs of torch's loader and gpuload's (on ``device``) side by side on this rank;
    ``compute_s``: the loop's pretended compute per batch, which a run-ahead exchange overlaps."""
    def sampler() -> DistributedSampler:
        return DistributedSampler(data, shuffle=shuffle, seed=SEED, drop_last=drop_last)

    theirs = tud.DataLoader(data, batch_size, sampler=sampler(), drop_last=drop_last)
    ours = gpuload.DataLoader(data, batch_size, sampler=sampler(), drop_last=drop_last, device=device,
                              cache_scope=scope, prefetch_depth=prefetch_depth)
    batches, equal = 0, True
    for epoch in range(3):
        theirs.sampler.set_epoch(epoch)
        ours.sampler.set_epoch(epoch)
        expected = list(theirs)
        got = []
        for batch in ours:
            got.append([leaf.cpu() for leaf in batch])
            time.sleep(compute_s)
        batches += len(got)
        equal = equal and len(expected) == len(got) and all(same(a, b) for a, b in zip(expected, got))
    extra = ours.stats.extra
    result = {"equal": equal, "batches": batches, "exchange": extra.get("exchange"), "path": ours.stats.path,
              "plan": extra.get("cache_plan"), "prefetch": extra.get("prefetch")}
    ours.close()
    return result


def all_stop_together(data: tud.Dataset, prefetch_depth: int, end: str) -> dict:
    """Every rank stops epoch 0 after its first batch while the exchange runs ahead (rank 0 at
    once, its thread still running ahead; the others later, theirs as far ahead as allowed), runs
    epoch 1 on the same loader (torch's batches: the ranks' exchanges stayed in step), stops
    taking batches of epoch 2 after two, then ends the loader (``end``: "del" or "close") while
    still holding that epoch's iterator. Returns what this rank saw."""
    baseline = threads.snapshot()
    theirs = tud.DataLoader(data, 4, sampler=DistributedSampler(data, seed=SEED))
    ours = gpuload.DataLoader(data, 4, sampler=DistributedSampler(data, seed=SEED), device="cpu",
                              cache_scope="world", prefetch_depth=prefetch_depth)
    with recorded_warnings() as caught:
        for _ in ours:
            if dist.get_rank() != 0:
                time.sleep(0.3)
            break
        theirs.sampler.set_epoch(1)
        ours.sampler.set_epoch(1)
        expected, got = list(theirs), list(ours)
        equal = len(expected) == len(got) and all(same(a, b) for a, b in zip(expected, got))
        ours.sampler.set_epoch(2)
        began = time.perf_counter()
        held = iter(ours)
        next(held), next(held)
        exchange = ours.stats.extra["exchange"]
        if end == "close":
            ours.close()
        del ours
        del held
        gc.collect()
        seconds = time.perf_counter() - began
    left = threads.wait_threads(baseline, deadline_s=5.0)
    return {"equal": equal, "seconds": seconds, "threads_left": sorted(t.name for t in left),
            "warnings": [str(w.message) for w in caught], "exchange": exchange}


def stopped_and_resumed(make: Callable[[], gpuload.DataLoader], batches: int) -> tuple[list[Any], gpuload.DataLoader]:
    """``batches`` batches of epoch 0 from a loader ``make`` gives, its state saved and loaded
    into a second one, and the rest of the epoch from that: every batch, and the second loader."""
    first, got = make(), []
    for batch in first:
        got.append(batch)
        if len(got) == batches:
            break
    state = first.state_dict()
    first.close()
    second = make()
    second.load_state_dict(state)
    got += list(second)
    return got, second


def stop_together_and_resume(data: tud.Dataset) -> dict:
    """Every rank stops at the same batch and saves its state; a new loader resumes from it,
    then runs the next epoch: the documented way to stop early, and torch's batches throughout."""
    def ours() -> gpuload.DataLoader:
        return gpuload.DataLoader(data, 4, sampler=DistributedSampler(data, seed=SEED), device="cpu",
                                  cache_scope="world")

    theirs = tud.DataLoader(data, 4, sampler=DistributedSampler(data, seed=SEED))
    got, second = stopped_and_resumed(ours, 3)
    equal = len(got) == len(theirs) and all(same(a, b) for a, b in zip(theirs, got))
    theirs.sampler.set_epoch(1)
    second.sampler.set_epoch(1)
    equal = equal and all(same(a, b) for a, b in zip(theirs, second))
    return {"equal": equal, "exchange": second.stats.extra["exchange"]}


def other_sampler(data: tud.Dataset) -> dict:
    """A sampler that is not a DistributedSampler: an explicit scope warns, batches stay torch's."""
    theirs = tud.DataLoader(data, 8, shuffle=True, generator=torch.Generator().manual_seed(SEED))
    with recorded_warnings() as caught:
        ours = gpuload.DataLoader(data, 8, shuffle=True, generator=torch.Generator().manual_seed(SEED),
                                  device="cpu", cache_scope="node")
        equal = all(same(a, b) for a, b in zip(theirs, ours))
    return {"equal": equal, "warnings": [str(w.message) for w in caught], "exchange": ours.stats.extra.get("exchange")}


def close_while_waiting(data: tud.Dataset) -> dict:
    """Rank 0 starts an epoch whose exchange runs ahead; the other ranks only place their share
    (``warm``), so rank 0's first collective never completes. Closing rank 0's loader abandons it
    at once (not after the exchange timeout) and its thread ends."""
    baseline = threads.snapshot()
    loader = gpuload.DataLoader(data, 4, sampler=DistributedSampler(data, seed=SEED), device="cpu",
                                cache_scope="world", prefetch_depth=2)
    seconds, error, left = 0.0, None, []
    if dist.get_rank() == 0:
        iterator = iter(loader)
        time.sleep(0.3)  # its thread now waits for the other ranks
        began = time.perf_counter()
        loader.close()
        seconds = time.perf_counter() - began
        left = sorted(t.name for t in threads.wait_threads(baseline, deadline_s=10.0))  # a stuck one: 60 s
        try:
            next(iterator)
        except Exception as caught:  # noqa: BLE001 - what the loop sees is the finding
            error = f"{type(caught).__name__}: {caught}"
    else:
        loader.warm(progress=False)
    dist.barrier()
    loader.close()
    return {"seconds": seconds, "threads_left": left, "error": error}


@contextmanager
def stopped_peer_timeout() -> Iterator[None]:
    """Loaders made and started inside wait :data:`STOPPED_PEER_TIMEOUT_S` for the other ranks
    (a scenario where one rank stops early and the others must give up on it)."""
    os.environ["GPULOAD_EXCHANGE_TIMEOUT"] = str(STOPPED_PEER_TIMEOUT_S)
    try:
        yield
    finally:
        os.environ["GPULOAD_EXCHANGE_TIMEOUT"] = str(EXCHANGE_TIMEOUT_S)


def stop_early(data: tud.Dataset, then_next_epoch: bool, prefetch_depth: int | None = None) -> dict:
    """Rank 0 breaks after two batches of epoch 0; the others go on. Returns what each saw."""
    with stopped_peer_timeout():
        return _stop_early(data, then_next_epoch, prefetch_depth)


def _stop_early(data: tud.Dataset, then_next_epoch: bool, prefetch_depth: int | None) -> dict:
    loader = gpuload.DataLoader(data, 4, sampler=DistributedSampler(data, seed=SEED), device="cpu",
                                cache_scope="world", prefetch_depth=prefetch_depth)
    began = time.perf_counter()
    error = None
    try:
        for step, _ in enumerate(loader):
            if dist.get_rank() == 0 and step == 1:
                break
        if dist.get_rank() == 0 and then_next_epoch:
            loader.sampler.set_epoch(1)
            for _ in loader:
                pass
    except ExchangeError as caught:
        error = str(caught)
    seconds = time.perf_counter() - began
    dist.barrier()  # rank 0 (when it saw nothing wrong) waits here until the others gave up
    return {"error": error, "seconds": seconds}


@contextmanager
def gloo_job(rank: int, world: int, init_file: str, local_world_size: int | None) -> Iterator[None]:
    """This process as ``rank`` of a gloo group of ``world`` (exchange timeout
    :data:`EXCHANGE_TIMEOUT_S`; nodes of
    ``local_world_size`` ranks when given), the group ended on leaving."""
    os.environ["GPULOAD_EXCHANGE_TIMEOUT"] = str(EXCHANGE_TIMEOUT_S)
    if local_world_size is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def run(rank: int, world: int, init_file: str, out_dir: str, local_world_size: int | None) -> None:
    with gloo_job(rank, world, init_file, local_world_size):
        data = dataset()
        found: dict = {"compare": {}, "total_bytes": sum(t.numel() * t.element_size() for t in data.tensors)}
        for scope in ("rank", "node", "world", "auto"):
            for shuffle in (True, False):
                for drop_last in (False, True):
                    key = f"{scope}/shuffle={shuffle}/drop_last={drop_last}"
                    found["compare"][key] = compare(data, scope, shuffle, drop_last, batch_size=8)
        for depth in (0, 2, 4):
            found["compare"][f"world/ahead={depth}"] = compare(data, "world", True, False, batch_size=8,
                                                               prefetch_depth=depth, compute_s=0.005)
        found["resume"] = stop_together_and_resume(data)
        found["other_sampler"] = other_sampler(data)
        found["stop_then_wait"] = stop_early(data, then_next_epoch=False)
        found["stop_then_next_epoch"] = stop_early(data, then_next_epoch=True)
        found["stop_then_wait_depth4"] = stop_early(data, then_next_epoch=False, prefetch_depth=4)
        found["close_while_waiting"] = close_while_waiting(data)
        found["all_stop"] = {f"{depth}/{end}": all_stop_together(data, depth, end)
                             for depth, end in ((2, "del"), (4, "close"))}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(found))


def nccl_world() -> int:
    """The CUDA devices here, one NCCL rank each; skips the calling test below two."""
    world = torch.cuda.device_count()
    if world < 2:
        pytest.skip(f"needs 2 CUDA devices for NCCL between ranks; this machine has {world}")
    return world


@contextmanager
def nccl_job(rank: int, world: int, init_file: str) -> Iterator[None]:
    """This process as ``rank`` of an NCCL group of ``world``, on GPU ``rank``; ended on leaving."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        yield
    finally:
        dist.destroy_process_group()


def others_failed_within_the_timeout(ranks: list[dict], scenario: str) -> list[dict]:
    """Check ``scenario`` where rank 0 stopped an epoch early: it raised nothing, and every other
    rank raised the early-stop error within the exchange timeout; their findings, for more checks."""
    assert ranks[0][scenario]["error"] is None  # it broke out; nothing more to exchange
    others = [found[scenario] for found in ranks[1:]]
    for seen in others:
        assert seen["error"] is not None and "stopped this epoch early" in seen["error"]
        assert seen["seconds"] < EXCHANGE_TIMEOUT_S  # gave up, long before the default 600 s
    return others


#: What the suite's fork server imports once, so a rank starts without importing torch (about 2 s
#: of CPU a rank, most of a small job's time on 2 cores), nor DCP and DDP (about 1 s more, in each
#: rank of test_dcp.py's two jobs), nor gpuload's loader and disk tier (about 0.5 s at load 9).
PRELOADED = ["torch", "torch.distributed", "torch.utils.data", "gpuload", "pytest",
             "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict", "torch.nn.parallel",
             "gpuload.loader", "gpuload.cache.disk_tier"]
#: And torchvision's datasets and transforms (about 1.3 s at load 9 in each child that reads images:
#: test_disk_tier_faults.py's 11, a disk_shares_job rank), which the suite's fork server alone
#: imports, not the server a rank starts for its DataLoader workers (:func:`in_environment`).
SERVER_PRELOADED = [*PRELOADED, "torchvision.datasets", "torchvision.transforms"]


def fork_server() -> ForkServerContext:
    """The multiprocessing context whose processes fork from the suite's one server (a fresh
    interpreter that imported :data:`SERVER_PRELOADED`, no CUDA and no threads of the tests); a process
    started from it runs :func:`in_environment` to take the test's environment."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(SERVER_PRELOADED)
    return context


def findings(run: Callable[..., None], world: int, out_dir: Path, *args: Any) -> list[dict]:
    """Every rank's findings from ``run(rank, world, init_file, out_dir, *args)`` started as
    ``world`` processes, each writing ``rank<r>.json`` into ``out_dir``.

    The ranks are forked from a server process that imported torch and gpuload once for the whole
    session (``forkserver``: a fresh interpreter, no CUDA and no threads of the tests), and each
    takes this process's environment as it is now (the server's is the one it started with)."""
    fork_server()
    mp.start_processes(in_environment, args=(dict(os.environ), run, world, str(out_dir / "init"), str(out_dir), *args),
                       nprocs=world, start_method="forkserver")
    return [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(world)]


def spawned(run: Callable[..., None], world: int, out_dir: Path, deadline_s: float) -> list[dict]:
    """Every rank's findings from ``run(rank, world, port, out_dir)`` started as ``world``
    processes that set up their group themselves (Accelerate, from ``MASTER_PORT``: a free port),
    each writing ``rank<r>.json``; a job not done in ``deadline_s`` is killed and fails the test.
    The ranks fork from the suite's fork server, as :func:`findings`' do (torch imported once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    fork_server()
    ranks = mp.start_processes(in_environment, args=(dict(os.environ), run, world, port, str(out_dir)),
                               nprocs=world, join=False, start_method="forkserver")
    deadline = time.monotonic() + deadline_s
    while not ranks.join(timeout=2):
        if time.monotonic() > deadline:  # a rank waits in a collective the other never joins
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"the {world} ranks did not finish in {deadline_s} s: one waits for another")
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world)]


def in_environment(rank: int, environ: dict[str, str], run: Callable[..., None], *args: Any) -> None:
    """``run(rank, *args)`` with ``environ`` as the process's environment. A process forked from
    the server starts its own (DataLoader workers) from a fork server of its own: that one
    imports :data:`PRELOADED` once too, not each worker (18 of a 2-rank samples job's 25 s at load 5)."""
    os.environ.clear()
    os.environ.update(environ)
    multiprocessing.set_forkserver_preload(PRELOADED)
    run(rank, *args)


def run_nccl(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """The split scopes over NCCL, one GPU per rank."""
    with nccl_job(rank, world, init_file):
        data = dataset()
        found = {key: compare(data, scope, True, drop_last, batch_size=8, device=f"cuda:{rank}")
                 for scope in ("world", "node") for drop_last in (False, True)
                 for key in [f"{scope}/drop_last={drop_last}"]}
        for depth in (0, 4):  # in the loop's thread, on its stream, whatever the depth
            found[f"world/ahead={depth}"] = compare(data, "world", True, False, batch_size=8, device=f"cuda:{rank}",
                                                    prefetch_depth=depth, compute_s=0.002)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(found))
