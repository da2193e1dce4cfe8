"""What each rank of the shared host tier's multi-process tests runs (imported by name in the
spawned processes). Each rank writes its findings to ``rank<r>.json`` for the test to check.

The stores here are ``TieredArrayStore``s on the CPU whose plan puts rows in the host tier (a
loader on a CPU device serves arrays in place, with no host tier), built with the same
``NodeHostTier`` maker the loader uses on CUDA.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.utils.data as tud
from torch.utils.data import BatchSampler
from torch.utils.data.distributed import DistributedSampler

import gpuload
from gpuload.cache import BudgetLedger, CacheFallbackWarning, TieredArrayStore, make_plan
from gpuload.distributed import current_context, shared_host
from gpuload.distributed.shared_host import SEGMENT_PREFIX, SHM_DIR, NodeHostTier

NUM_SAMPLES = 103
SEED = 7
EXCHANGE_TIMEOUT_S = 3
GiB = 1 << 30


def dataset(shift: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (NUM_SAMPLES, 3, 5, 5), dtype=torch.uint8, generator=generator)
    features = torch.randn(NUM_SAMPLES, 7, generator=generator, dtype=torch.float64) + shift
    labels = torch.arange(NUM_SAMPLES, dtype=torch.int64)
    return images, features, labels, labels % 3 == 0


def bytes_per_sample(data: tuple[torch.Tensor, ...]) -> int:
    return sum(t[0].numel() * t.element_size() for t in data)


def build(data: tuple[torch.Tensor, ...], device_rows: int, budget_rows: int, maker) -> TieredArrayStore:
    """A store whose first ``device_rows`` rows are its device tier and whose host budget holds
    ``budget_rows`` rows."""
    bps = bytes_per_sample(data)
    plan = make_plan(bps, NUM_SAMPLES, device_free=80 * GiB, host_free=budget_rows * bps, budget=device_rows * bps,
                     reserve=0, mode="auto", host_reserve=0)
    return TieredArrayStore(data, plan, "cpu", ledger=BudgetLedger(), host_tier=maker)


def mapping_of(pointer: int) -> dict | None:
    """The /proc/self/maps entry holding ``pointer``: its device, inode and path."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= pointer < high:
                return {"start": low, "dev": fields[3], "inode": int(fields[4]),
                        "path": fields[5].strip() if len(fields) > 5 else ""}
    return None


def segments_in_shm(pids: list[int]) -> list[str]:
    """Entries of /dev/shm that a gpuload segment of these processes would have."""
    return [name for name in os.listdir(SHM_DIR) if any(name.startswith(f"{SEGMENT_PREFIX}{pid}-") for pid in pids)]


def torchs_batches_equal(data: tuple[torch.Tensor, ...], store: TieredArrayStore) -> bool:
    """Three epochs of torch's loader with a DistributedSampler and the store's gathers, side by side."""
    dataset_ = tud.TensorDataset(*data)
    sampler = DistributedSampler(dataset_, shuffle=True, seed=SEED)
    theirs = tud.DataLoader(dataset_, 8, sampler=sampler)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = BatchSampler(sampler, 8, False)
        for expected, indices in zip(theirs, list(batches), strict=True):
            got = store.gather(torch.tensor(indices))
            if not all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(expected, got)):
                return False
    return True


def describe(store: TieredArrayStore, data, pids: list[int]) -> dict:
    stats = store.stats
    host = store.tier("host").columns  # the tier's tensors, to find their mapping
    return {
        "equal": torchs_batches_equal(data, store),
        "device_samples": stats.device_samples,
        "host_samples": stats.host_samples,
        "host_shared_ranks": stats.host_shared_ranks,
        "mapping": mapping_of(host[0].data_ptr()) if host else None,
        "pointer": host[0].data_ptr() if host else None,
        "in_shm": segments_in_shm(pids),
    }


def shared(pids: list[int], device_rows: int, budget_rows: int) -> dict:
    """Ranks with different device tiers build one node tier; report what each sees."""
    data = dataset()
    store = build(data, device_rows, budget_rows, NodeHostTier(current_context()))
    dist.barrier()  # every rank has set up
    found = describe(store, data, pids)
    inode = found["mapping"]["inode"] if found["mapping"] else None
    store.close()
    gc.collect()
    found["mapped_after_close"] = inode is not None and any(
        f" {inode} " in line and SEGMENT_PREFIX in line for line in open("/proc/self/maps")
    )
    return found


def caught(function) -> tuple[dict, list[str]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = function()
    return result, [str(w.message) for w in seen if issubclass(w.category, CacheFallbackWarning)]


def no_room(pids: list[int]) -> dict:
    """/dev/shm reports 1000 bytes free: each rank keeps its own copy, in its share of the budget."""
    real = shared_host.shm_free_bytes
    shared_host.shm_free_bytes = lambda directory=SHM_DIR: 1000
    try:
        data = dataset()
        store, messages = caught(lambda: build(data, 0, 60, NodeHostTier(current_context())))
    finally:
        shared_host.shm_free_bytes = real
    found = describe(store, data, pids)
    store.close()
    return {**found, "warnings": messages}


def arrays_differ(pids: list[int]) -> dict:
    """Each rank loads other values: no sharing, each serves its own."""
    rank = dist.get_rank()
    data = dataset(shift=rank)
    store, messages = caught(lambda: build(data, 0, NUM_SAMPLES, NodeHostTier(current_context())))
    found = describe(store, data, pids)
    store.close()
    return {**found, "warnings": messages}


def unclosed(pids: list[int]) -> dict:
    """A store dropped without ``close``: its mapping goes when the tier is collected."""
    store = build(dataset(), 0, NUM_SAMPLES, NodeHostTier(current_context()))
    pointer = mapping_of(store.tier("host").columns[0].data_ptr())["start"]
    del store
    gc.collect()
    mapped = any(f"{pointer:x}-" in line and SEGMENT_PREFIX in line for line in open("/proc/self/maps"))
    return {"pointer": pointer, "still_mapped": mapped}


def killed_after_setup(pids: list[int]) -> dict:
    """The last rank is SIGKILLed after setup; the others keep serving, and /dev/shm stays clean."""
    data = dataset()
    store = build(data, 0, NUM_SAMPLES, NodeHostTier(current_context()))
    dist.barrier()
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    victim = pids[world - 1]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(victim):
        time.sleep(0.05)
    return {"victim_gone": not _alive(victim), "equal": torchs_batches_equal(data, store),
            "in_shm": segments_in_shm(pids), "host_shared_ranks": store.stats.host_shared_ranks}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def killed_during_setup(pids: list[int]) -> dict:
    """The last rank dies after the leader created the segment, before the others opened it."""
    world = dist.get_world_size()
    if dist.get_rank() == world - 1:
        real = shared_host._Setup.gather

        def die_before_opening(self, values, step):
            if step == "opening the segment":
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, values, step)

        shared_host._Setup.gather = die_before_opening
    began = time.perf_counter()
    error = None
    try:
        build(dataset(), 0, NUM_SAMPLES, NodeHostTier(current_context()))
    except Exception as failure:  # noqa: BLE001 - the test checks its type and message
        error = f"{type(failure).__name__}: {failure}"
    return {"error": error, "seconds": time.perf_counter() - began, "in_shm": segments_in_shm(pids)}


def cuda_loader(pids: list[int]) -> dict:
    """gpuload.DataLoader with cache="host" on cuda:0, against torch's DataLoader, three epochs."""
    data = tud.TensorDataset(*dataset())

    def loader(cls, **options):
        return cls(data, 8, sampler=DistributedSampler(data, shuffle=True, seed=SEED), **options)

    theirs = loader(tud.DataLoader)
    ours, messages = caught(lambda: loader(gpuload.DataLoader, device="cuda:0", cache="host"))
    equal = True
    for epoch in range(3):
        theirs.sampler.set_epoch(epoch)
        ours.sampler.set_epoch(epoch)
        got = [[leaf.cpu() for leaf in batch] for batch in ours]
        equal = equal and all(
            all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(x, y))
            for x, y in zip(theirs, got, strict=True)
        )
    dist.barrier()
    found = {"equal": equal, "cache": ours.stats.extra.get("cache"), "warnings": messages,
             "in_shm": segments_in_shm(pids)}
    ours.close()
    return found


def run(rank: int, world: int, init_file: str, out_dir: str, scenario: str) -> None:
    os.environ["GPULOAD_EXCHANGE_TIMEOUT"] = str(EXCHANGE_TIMEOUT_S)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    pids = [torch.empty(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(pids, torch.tensor([os.getpid()]))
    pids = [int(p) for p in pids]
    found: dict = {"pids": pids, "pid": os.getpid(), "bytes_per_sample": bytes_per_sample(dataset())}
    ended = False
    try:
        if scenario == "one_node":
            os.environ["LOCAL_WORLD_SIZE"] = str(world)
            local = rank
            found["shared"] = shared(pids, device_rows=10 * local, budget_rows=NUM_SAMPLES)
            found["budget"] = shared(pids, device_rows=10 * local, budget_rows=40)
            found["no_room"] = no_room(pids)
            found["differ"] = arrays_differ(pids)
            found["unclosed"] = unclosed(pids)
            Path(out_dir, f"rank{rank}.json").write_text(json.dumps(found))
            found["killed"] = killed_after_setup(pids)
            ended = True  # a peer is gone: do not wait for it at shutdown
        elif scenario == "nodes":
            os.environ["LOCAL_WORLD_SIZE"] = str(world)
            found["one_node"] = shared(pids, device_rows=0, budget_rows=NUM_SAMPLES)
            os.environ["LOCAL_WORLD_SIZE"] = "2"
            found["two_nodes"] = shared(pids, device_rows=5 * (rank % 2), budget_rows=NUM_SAMPLES)
        elif scenario == "cuda_loader":
            os.environ["LOCAL_WORLD_SIZE"] = str(world)
            found["cuda_loader"] = cuda_loader(pids)
        elif scenario == "setup_death":
            os.environ["LOCAL_WORLD_SIZE"] = str(world)
            found["setup_death"] = killed_during_setup(pids)
            ended = True
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(found))
    finally:
        if not ended:
            dist.destroy_process_group()
