"""The node's ranks share one host tier in shared memory (gloo processes on the CPU): one mapping
per node, torch's batches on every rank, nothing left in /dev/shm after setup or after a rank is
SIGKILLed, a clear fallback when /dev/shm is too small, and nothing changes without a process
group."""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from gpuload.cache import CacheFallbackWarning, CacheSettings
from gpuload.distributed import shared_host
from gpuload.distributed.group import DistributedContext
from gpuload.distributed.shared_host import NodeHostTier, node_host_tier

sys.path.insert(0, str(Path(__file__).parent))
import ranks_job
import shared_host_job as job


def _launch(folder: Path, world: int, scenario: str, killed: set[int] = frozenset()) -> list[dict]:
    """Run ``scenario`` on ``world`` processes; ranks in ``killed`` are expected to die of SIGKILL."""
    context = ranks_job.fork_server()
    args = (job.run, world, str(folder / "init"), str(folder), scenario)
    processes = [context.Process(target=ranks_job.in_environment, args=(rank, dict(os.environ), *args))
                 for rank in range(world)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=240)
    codes = [process.exitcode for process in processes]
    for process in processes:
        if process.is_alive():
            process.kill()
    expected = [-signal.SIGKILL if rank in killed else 0 for rank in range(world)]
    assert codes == expected, f"exit codes {codes}, expected {expected}"
    written = [folder / f"rank{rank}.json" for rank in range(world)]
    found = [json.loads(path.read_text()) if path.exists() else {} for path in written]
    assert job.segments_in_shm(found[0]["pids"]) == []  # every process has exited: nothing left
    return found


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("one_node"), 2, "one_node", killed={1})


def test_the_ranks_of_a_node_map_one_segment_and_get_torchs_batches(one_node):
    seen = [found["shared"] for found in one_node]
    for rank, found in enumerate(seen):
        assert found["equal"], rank
        assert found["host_shared_ranks"] == 2
        assert found["device_samples"] == 10 * rank  # the device tiers differ ...
        assert found["host_samples"] == job.NUM_SAMPLES - 10 * rank  # ... the host tier holds the rest
        assert job.SEGMENT_PREFIX in found["mapping"]["path"] and found["mapping"]["path"].endswith("(deleted)")
        assert found["in_shm"] == []  # unlinked once every rank had it open
        assert not found["mapped_after_close"]
    assert seen[0]["mapping"]["inode"] == seen[1]["mapping"]["inode"]
    assert seen[0]["mapping"]["dev"] == seen[1]["mapping"]["dev"]


def test_the_host_budget_is_counted_once_per_node(one_node):
    # 40 rows of budget: one copy of rows [0, 40) (rank 0's device tier is empty), not 40 per rank
    for rank, found in enumerate(one_node):
        seen = found["budget"]
        assert seen["equal"] and seen["host_shared_ranks"] == 2
        assert seen["host_samples"] == 40 - 10 * rank


def test_too_small_dev_shm_falls_back_to_a_copy_per_rank_in_its_share(one_node):
    for found in one_node:
        seen = found["no_room"]
        assert seen["equal"] and seen["host_shared_ranks"] == 1
        assert seen["host_samples"] == 30  # the node's budget of 60 rows, halved
        assert job.SEGMENT_PREFIX not in seen["mapping"]["path"]  # the process's own memory
        assert seen["in_shm"] == []
    messages = one_node[0]["no_room"]["warnings"]
    assert len(messages) == 1
    assert "/dev/shm has 1000 B free" in messages[0] and "--shm-size" in messages[0] and "1/2" in messages[0]


def test_ranks_with_other_arrays_do_not_share(one_node):
    for found in one_node:
        seen = found["differ"]
        assert seen["equal"] and seen["host_shared_ranks"] == 1
        assert job.SEGMENT_PREFIX not in seen["mapping"]["path"]
        assert seen["host_samples"] == job.NUM_SAMPLES // 2  # its share of the node's budget
        assert any("arrays differ" in message for message in seen["warnings"])


def test_a_tier_dropped_unclosed_is_unmapped(one_node):
    for found in one_node:
        assert not found["unclosed"]["still_mapped"]


def test_a_rank_killed_after_setup_leaves_nothing_in_dev_shm(one_node):
    found = one_node[0]["killed"]  # rank 1 was SIGKILLed while it held the mapping
    assert found["victim_gone"]
    assert found["in_shm"] == []
    assert found["equal"] and found["host_shared_ranks"] == 2  # the survivor's mapping still serves


def test_a_rank_dying_during_setup_fails_the_others_within_the_timeout(tmp_path):
    found = _launch(tmp_path, 2, "setup_death", killed={1})[0]["setup_death"]
    assert found["error"] is not None and found["error"].startswith("ExchangeError")
    assert "shared host tier" in found["error"] and "died" in found["error"]
    assert found["seconds"] < job.EXCHANGE_TIMEOUT_S + 30
    assert found["in_shm"] == []  # the leader unlinked the segment it had created


@pytest.mark.slow
def test_two_nodes_of_two_ranks_map_one_segment_per_node(tmp_path):
    ranks = _launch(tmp_path, 4, "nodes")
    whole = [found["one_node"] for found in ranks]
    assert all(seen["equal"] and seen["host_shared_ranks"] == 4 and seen["in_shm"] == [] for seen in whole)
    assert len({seen["mapping"]["inode"] for seen in whole}) == 1
    halves = [found["two_nodes"] for found in ranks]
    assert all(seen["equal"] and seen["host_shared_ranks"] == 2 and seen["in_shm"] == [] for seen in halves)
    inodes = [seen["mapping"]["inode"] for seen in halves]
    assert inodes[0] == inodes[1] and inodes[2] == inodes[3] and inodes[0] != inodes[2]


@pytest.mark.gpu
def test_cuda_loaders_of_two_ranks_share_one_host_tier(tmp_path):
    # Both ranks on one GPU (gloo needs no GPU per rank); the tier is not pinned (the staging slots are).
    ranks = _launch(tmp_path, 2, "cuda_loader")
    for rank, found in enumerate(ranks):
        seen = found["cuda_loader"]
        assert seen["equal"], rank
        assert seen["cache"]["host_shared_ranks"] == 2 and seen["cache"]["host_samples"] == job.NUM_SAMPLES
        assert seen["warnings"] == [] and seen["in_shm"] == []


def _sampler(world: int = 2) -> BatchSampler:
    data = TensorDataset(torch.arange(10))
    return BatchSampler(DistributedSampler(data, num_replicas=world, rank=0), 4, False)


def test_the_loader_shares_only_on_cuda_with_a_distributed_sampler_and_a_host_tier():
    context = DistributedContext(rank=0, world_size=2, local_world_size=2, backend="gloo")
    cuda, auto = torch.device("cuda"), CacheSettings.resolve(environ={}, cwd="/")
    assert isinstance(node_host_tier(auto, cuda, _sampler(), context), NodeHostTier)
    host = CacheSettings.resolve(cache="host", environ={}, cwd="/")
    assert isinstance(node_host_tier(host, cuda, _sampler(), context), NodeHostTier)
    assert node_host_tier(auto, torch.device("cpu"), _sampler(), context) is None  # arrays served in place
    assert node_host_tier(CacheSettings.resolve(cache="device", environ={}, cwd="/"), cuda, _sampler(), context) is None
    assert node_host_tier(auto, cuda, BatchSampler(range(10), 4, False), context) is None  # not every rank iterates
    assert node_host_tier(auto, cuda, _sampler(world=4), context) is None
    single = DistributedContext(rank=0, world_size=1, local_world_size=1, backend="gloo")
    assert node_host_tier(auto, cuda, _sampler(world=1), single) is None


def test_without_a_process_group_nothing_is_shared():
    assert node_host_tier(CacheSettings.resolve(environ={}, cwd="/"), torch.device("cuda"), _sampler()) is None


# ---------------------------------------------------------------- one rank's setup, its leader pretended

ROWS, ROW_BYTES = 20, 16


def _source() -> list[torch.Tensor]:
    return [torch.arange(2 * ROWS, dtype=torch.int64).reshape(ROWS, 2)]


class _Leader:
    """The setup's messages as rank 1 of a node of two sees them. Rank 0, the leader, wants
    every row from the host tier (its device tier is empty), with the same budget and data;
    it answers ``created`` for the segment it made, and every rank but this one opened it."""

    def __init__(self, created: list[int]) -> None:
        self.created = created

    def gather(self, values: list[int], step: str) -> list[list[int]]:
        if step == "agreeing on the rows":  # its pid and random name part, rows [0, ROWS)
            return [[*values[:2], 4242, 0xABC, *values[4:6], 0, ROWS, *values[8:]], values]
        if step == "creating the segment":
            return [self.created, values]
        return [[1] if step == "opening the segment" else [shared_host._OK, 0], values]


def _rank_one(created: list[int], first: int) -> tuple[Any, list[str]]:
    """Rank 1's host tier for rows ``[first, ROWS)`` with a node budget of every row; the warnings."""
    context = DistributedContext(rank=1, world_size=2, local_world_size=2, backend="gloo")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tier = NodeHostTier(context)._build(_Leader(created), _source(), first, ROWS - first, ROWS * ROW_BYTES)
    return tier, [str(w.message) for w in caught if issubclass(w.category, CacheFallbackWarning)]


def test_a_rank_that_cannot_open_the_leaders_segment_keeps_its_own_copy_in_its_share_of_the_budget():
    """The leader's segment is not in this rank's /dev/shm (here: no such file): the node falls back."""
    tier, said = _rank_one([shared_host._OK, 1 << 30], first=5)
    assert said == ["gpuload cache: the node's 2 ranks do not share one host tier: a rank could not open the shared "
                    "segment in /dev/shm; each keeps its own copy of at most 10 samples (160 B, 1/2 of the node's "
                    "host budget of 320 B)"]
    assert tier.shared_by == 1 and tier.first == 5 and torch.equal(tier.columns[0], _source()[0][5:15])


def test_a_rank_whose_device_tier_holds_its_rows_maps_nothing_and_the_node_shares():
    tier, said = _rank_one([shared_host._OK, 1 << 30], first=ROWS)
    assert said == [] and tier.shared_by == 2 and tier.rows == 0


def test_a_segment_the_leader_could_not_create_is_named_with_the_systems_reason():
    tier, said = _rank_one([shared_host._FAILED, errno.EMFILE], first=5)
    assert len(said) == 1 and "creating the segment in /dev/shm failed (Too many open files)" in said[0]
    assert tier.shared_by == 1 and tier.rows == 10


def test_creating_a_segment_that_exists_is_the_systems_error_not_an_exception(tmp_path):
    taken = tmp_path / "segment"
    taken.write_bytes(b"")
    assert shared_host._create(str(taken), 1) == ([shared_host._FAILED, errno.EEXIST], -1)


def test_sizing_the_segment_says_whether_dev_shm_ran_out_or_the_call_failed(tmp_path):
    """/dev/shm filled since its free space was read (the room asked for is more than it has);
    a descriptor that cannot be sized (read only)."""
    path = os.path.join(shared_host.SHM_DIR, f"{shared_host.SEGMENT_PREFIX}test-{os.getpid()}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.unlink(path)
    try:
        status, free = shared_host._fill(fd, shared_host.shm_free_bytes() + (1 << 30), _source(), [0], 0, ROWS)
    finally:
        os.close(fd)
    assert status == shared_host._NO_SPACE and free > 0
    (tmp_path / "read-only").write_bytes(b"")
    fd = os.open(tmp_path / "read-only", os.O_RDONLY)
    try:
        assert shared_host._fill(fd, 64, _source(), [0], 0, ROWS) == [shared_host._FAILED, errno.EBADF]
    finally:
        os.close(fd)


def test_a_machine_without_a_boot_id_still_has_one_identity(monkeypatch):
    def no_proc(path, mode="r"):
        raise FileNotFoundError(path)

    with_boot_id = shared_host._machine_identity()
    monkeypatch.setattr(shared_host, "open", no_proc, raising=False)
    assert shared_host._machine_identity() == shared_host._machine_identity() != with_boot_id
