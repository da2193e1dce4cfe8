"""The sample cache split over 2 and 4 gloo processes on the CPU: each rank reads and holds
about 1/N of a map-style dataset's samples, gets exactly torch's batches (structure and dtypes
included), fails clearly when a rank stops early, and keeps today's per-rank cache, with a
warning, wherever the samples cannot be split."""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler
from torch.utils.data.distributed import DistributedSampler

from gpuload.cache import CacheSettings
from gpuload.cache.columns import prepare
from gpuload.distributed import DistributedContext, ExchangeError
from gpuload.distributed.sample_shares import _read_block, split_samples
from gpuload.sources.torch_fetch import read_prepared

sys.path.insert(0, str(Path(__file__).parent))
import fake_peers
import ranks_job
import samples_job


@pytest.fixture(scope="module", params=["two", pytest.param("four", marks=pytest.mark.slow)])
def job(request, tmp_path_factory):
    """Every rank's findings, the world size and the node size (one spawn per world size)."""
    world, local = ranks_job.JOBS[request.param]
    ranks = ranks_job.findings(samples_job.run, world, tmp_path_factory.mktemp(f"samples{world}"), local)
    return ranks, world, local or world


def test_every_rank_gets_torchs_batches_for_every_scope(job):
    ranks, _, _ = job
    for rank, found in enumerate(ranks):
        for key, result in found["compare"].items():
            assert result["equal"], f"rank {rank}, {key}: batches differ from torch's"
            assert result["batches"] > 0 and result["warnings"] == [], (rank, key)


def test_node_and_world_hold_a_share_and_exchange(job):
    ranks, world, node = job
    shares = {"node": node, "world": world}
    total = ranks[0]["total_bytes"]
    held = dict.fromkeys(shares, 0)
    for found in ranks:
        for key, result in found["compare"].items():
            scope = key.split("/")[0]
            if scope not in shares:  # rank, and auto on a CPU device: each rank as today
                assert result["exchange"] is None and not result["path"].startswith("sharded"), key
                continue
            exchange = result["exchange"]
            assert result["path"] == f"sharded-{scope}", key
            assert exchange["ranks_per_copy"] == shares[scope], key
            assert abs(exchange["shard_bytes"] - total / shares[scope]) <= samples_job.ROW_BYTES, key
            assert len(exchange["bytes_received_per_epoch"]) == 3
            assert all(b > 0 for b in exchange["bytes_received_per_epoch"]), key
            if key.endswith("shuffle=True/drop_last=False"):
                held[scope] += exchange["shard_bytes"]
    for scope, group in shares.items():
        assert held[scope] == total * world // group  # one whole copy per group of ranks


def test_dicts_tuples_and_dtypes_come_back_as_torch_collates_them(job):
    for found in job[0]:
        records = found["records"]
        assert records["equal"] and records["path"] == "sharded-world"
        assert records["exchange"]["shard_bytes"] > 0


def test_share_is_read_by_workers_or_warm(job):
    for found in job[0]:
        assert found["workers"]["equal"] and found["workers"]["path"] == "sharded-node"
        warm = found["warm"]
        assert warm["equal"] and warm["warmed"] == "sharded-world", warm
        assert "holds rows" in warm["decision"]


def test_all_ranks_stopping_at_one_batch_then_resuming_gives_torchs_batches(job):
    ranks, world, _ = job
    for rank, found in enumerate(ranks):
        assert found["resume"]["equal"], rank
        assert found["resume"]["exchange"]["ranks_per_copy"] == world


@pytest.mark.parametrize("scenario, says", [
    ("random", "it looks randomly augmented"),
    ("strings", "do not collate to fixed-shape tensors"),
    ("odd_one", "differs from the probed ones"),
    ("broken", "could not read a sample of its share"),
    ("collate_fn", "custom collate_fn"),
    ("host", "cache='host' keeps no device tier"),
    ("other_sampler", "not torch's DistributedSampler"),
])
def test_what_cannot_be_split_stays_per_rank_and_says_why(job, scenario, says):
    for rank, found in enumerate(job[0]):
        seen = found[scenario]
        assert seen["exchange"] is None, (rank, scenario)
        assert any(says in w and "is not used" in w for w in seen["warnings"]), seen["warnings"]
        if scenario != "random":  # random samples differ from torch's by design
            assert seen["equal"], (rank, scenario)
    if scenario == "broken":  # the rank whose read raised says what it was
        assert any("KeyError" in w and "row 5 is missing" in w for w in job[0][0]["broken"]["warnings"])


def test_a_rank_alone_finding_its_samples_random_makes_every_rank_decline_at_once(job):
    """Before, the other ranks waited for it in the exchange until the timeout."""
    ranks, world, _ = job
    for rank, found in enumerate(ranks):
        seen = found["random_on_one"]
        assert seen["path"] != "sharded-world" and len(seen["warnings"]) == 1, (rank, seen)
        assert "it looks randomly augmented" in seen["warnings"][0], (rank, seen["warnings"])
        if rank != world - 1:
            assert f"on rank {world - 1}, " in seen["warnings"][0] and seen["equal"], (rank, seen)


def test_rank_that_stops_early_makes_the_others_fail_within_the_timeout(job):
    ranks, _, _ = job
    ranks_job.others_failed_within_the_timeout(ranks, "stop_early")


def _settings(scope: str, cache: str = "auto") -> CacheSettings:
    return CacheSettings.resolve(cache=cache, cache_scope=scope, environ={})


def test_without_a_process_group_nothing_is_split():
    data = samples_job.Pairs()
    batches = BatchSampler(DistributedSampler(data, num_replicas=2, rank=0), 8, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = split_samples(data, _settings("world"), torch.device("cpu"), batches, "t",
                              default_collate=True, read=None, chunk_size=8)
    assert found is None


def test_a_random_dataset_declines_the_split_on_every_rank_with_its_reason(monkeypatch):
    """Found from what this rank read (the probe), so said to the others: they decline with it."""
    found, said, calls = _split(monkeypatch, [], data=samples_job.Random())
    assert found is None and calls == 2  # the agreement, then why
    assert len(said) == 1 and "it looks randomly augmented; each rank caches the whole dataset" in said[0]


def test_a_rank_that_declines_alone_makes_every_rank_decline_with_its_reason_not_wait(monkeypatch):
    """Rank 1's probe found its samples random (a dataset random on that rank only, or a read
    that failed there): rank 0 reads nothing, waits for nothing, and says why."""
    why = "two reads of dataset[51] differ (tensor values): it looks randomly augmented"

    def declined(mine: torch.Tensor) -> torch.Tensor:
        mine[3], mine[-1] = 0, 1  # a rank that declined knows no sample size
        return mine

    def no_read(chunks):
        raise AssertionError("a declined split reads nothing")

    found, said, calls = _split(monkeypatch, [declined], objects=[why], read=no_read)
    assert found is None and calls == 2
    assert said == [f"gpuload: cache_scope='world' (keyword cache_scope=) is not used: on rank 1, {why}; "
                    "each rank caches the whole dataset"]


@pytest.mark.gpu
def test_nccl_ranks_get_torchs_batches_from_device_shares(tmp_path):
    world = ranks_job.nccl_world()
    for rank, found in enumerate(ranks_job.findings(samples_job.run_nccl, world, tmp_path)):
        for scope, result in found.items():
            assert result["equal"] and result["path"] == f"sharded-{scope}", (rank, scope)
            assert result["exchange"]["shard_bytes"] > 0


class _Empty(samples_job.Pairs):
    def __len__(self) -> int:
        return 0


class _Unreadable(samples_job.Pairs):
    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        raise KeyError(f"row {index} is not there")


@pytest.mark.parametrize("data, settings, says", [
    (samples_job.Pairs(), dict(cache_size="0"), "cache_size='0' (keyword cache_size=) turns it off"),
    (_Empty(), {}, "the dataset is empty"),
    (_Unreadable(), {}, "reading its samples for the determinism probe failed (KeyError: 'row 0 is not there')"),
])
def test_what_this_rank_finds_declines_the_split_on_every_rank_and_says_why(monkeypatch, data, settings, says):
    """Told to the other ranks (one agreement, then the reasons) so that they decline with it."""
    found, said, calls = _split(monkeypatch, [], data=data,
                                settings=CacheSettings.resolve(cache_scope="world", environ={}, **settings))
    assert found is None and calls == 2
    assert said == [
        f"gpuload: cache_scope='world' (keyword cache_scope=) is not used: {says}; each rank caches the whole dataset"]


def _split(monkeypatch, answers, scope: str = "world", local_world_size: int = 2, *, data: Any = None,
           settings: CacheSettings | None = None, objects: list[Any] | None = None,
           read: Any = None) -> tuple[object, list[str], int]:
    """``split_samples`` of ``data`` (default Pairs) on rank 0 of two (``fake_peers``): what it
    returned, the warnings, the collectives it made."""
    data = samples_job.Pairs() if data is None else data
    peers = fake_peers.FakePeers(monkeypatch, answers, objects)
    context = DistributedContext(rank=0, world_size=2, local_world_size=local_world_size, backend="gloo")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = split_samples(data, settings or _settings(scope), torch.device("cpu"),
                              fake_peers.batches(len(data), 8), "t", default_collate=True,
                              read=read or (lambda chunks: read_prepared(data, chunks, 0, {})),
                              chunk_size=8, context=context)
    return found, [str(w.message) for w in caught], peers.calls


def test_node_scope_on_nodes_of_one_rank_keeps_the_nodes_copy_whole_on_it(monkeypatch):
    """One copy per node is the whole dataset on each rank: nothing to split, nothing to warn of
    (the scope asked for is the one taken), once the ranks agreed."""
    found, said, calls = _split(monkeypatch, [], scope="node", local_world_size=1)
    assert found is None and said == [] and calls == 1


def test_a_peer_that_died_before_reporting_its_read_is_an_exchange_error(monkeypatch):
    with pytest.raises(ExchangeError, match=r"rank 0 read its share of the samples but another rank did not report "
                                            r"its own \(it stopped or died\)\. Cause: Connection closed by peer"):
        _split(monkeypatch, [None, RuntimeError("Connection closed by peer")])


def test_a_read_that_yields_fewer_chunks_than_asked_is_an_error_not_a_block_of_empty_rows():
    data = samples_job.Pairs()
    template = prepare([data[i] for i in range(3)])

    @contextlib.contextmanager
    def first_chunk_only(chunks):
        yield iter([prepare([data[i] for i in chunks[0]])])

    with pytest.raises(ValueError, match="zip"):
        _read_block(template, [[0, 1], [2, 3]], first_chunk_only)
