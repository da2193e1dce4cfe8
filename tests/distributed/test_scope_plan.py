"""The scope plan's arithmetic: hand-computed small cases, the issue's 8 x 2 H200 ImageNet case,
properties of every plan, the expectation against the exchange's own plans over many shuffles,
and against the bytes a 4-process gloo job (2 nodes x 2 ranks) receives."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from gpuload.cache import CacheSettings
from gpuload.device import MemoryInfo
from gpuload.distributed import Partition, every_rank_batches, plan_scopes, plan_step
from gpuload.distributed.scope_plan import rows_per_rank

sys.path.insert(0, str(Path(__file__).parent))
import ranks_job
import scope_plan_job

GiB = 1 << 30
HOST = MemoryInfo(free=8 * GiB, total=8 * GiB)  # host tier budget 4 GiB: a small dataset's tier fits
IMAGENET = (1_281_167, 3 * 224 * 224 + 8)
PINNED = {"environ": {}, "cwd": Path(__file__).parent}  # no GPULOAD_* variables, no gpuload.toml


@pytest.fixture
def defaults() -> CacheSettings:
    """The default cache settings, whatever this machine's environment or gpuload.toml says."""
    return CacheSettings.resolve(**PINNED)


def test_two_nodes_of_two_gpus_by_hand(defaults):
    # 8 rows of 10 bytes, 40 bytes of room per GPU: a whole copy does not fit, half of one does.
    plans = plan_scopes(8, 10, gpus_per_node=2, nodes=2, device_memory="1GiB", host_memory_per_node=HOST,
                        settings=defaults, room=40, reserve=0, host_shared=False)
    assert plans.rows_per_rank == 2  # 8 rows over 4 ranks
    rank, node, world = plans["rank"], plans["node"], plans["world"]

    # rank: rows [0, 4) on each GPU, [4, 8) in each rank's host tier; half of what it reads crosses PCIe.
    assert (rank.fits, rank.runs, rank.device_samples, rank.host_samples) == (False, True, 4, 4)
    assert rank.host_bytes_per_node == 2 * 4 * 10  # each of the node's 2 ranks pins its own copy
    assert vars(rank.later_epochs) == dict(sampled=40, local=20, pcie=20, nvlink=0, network=0, fill=0)
    assert rank.first_epoch.fill == 2 * 40 and rank.first_epoch.host_to_device == 100

    # node: 4 rows per GPU; a rank holds half of the copy: the other half comes from its neighbour.
    assert (node.fits, node.group_size, node.device_samples, node.device_bytes) == (True, 2, 4, 40)
    assert vars(node.later_epochs) == dict(sampled=40, local=20, pcie=0, nvlink=20, network=0, fill=0)
    assert node.first_epoch.fill == 80 and node.host_bytes_per_node == 0

    # world: 2 rows per GPU; a rank reads 1/4 of its rows locally, 1/4 from its neighbour, 1/2 across.
    assert (world.fits, world.group_size, world.device_samples) == (True, 4, 2)
    assert vars(world.later_epochs) == dict(sampled=40, local=10, pcie=0, nvlink=10, network=20, fill=0)
    assert world.first_epoch.fill == 40

    assert (plans.auto.scope, plans.auto.group_size) == ("node", 2)
    shared = plan_scopes(8, 10, gpus_per_node=2, nodes=2, device_memory="1GiB", host_memory_per_node=HOST,
                         settings=defaults, room=40, host_shared=True)
    assert shared["rank"].host_bytes_per_node == 4 * 10  # one host copy per node


def test_the_issues_example_eight_h200_per_node_two_nodes_imagenet(defaults):
    plans = plan_scopes(*IMAGENET, gpus_per_node=8, nodes=2, device_memory="141GiB",
                        host_memory_per_node="2TiB", settings=defaults, host_shared=False)
    n, bps = IMAGENET
    assert plans.reserve == int(141 * GiB * 0.10) and plans.room == 141 * GiB - plans.reserve
    assert plans.rows_per_rank == 80_073  # ceil(1281167 / 16)
    assert plans.auto.scope == "node"
    rank, node, world = plans["rank"], plans["node"], plans["world"]
    assert not rank.fits and rank.device_samples == plans.room // bps
    assert rank.host_bytes_per_node == 8 * (n - rank.device_samples) * bps
    assert node.device_samples == 160_146 and world.device_samples == 80_073
    assert node.later_epochs.nvlink == 80_073 * 7 * bps  # (8 - 1) / 8 of what the node reads
    assert node.later_epochs.network == 0 and node.first_epoch.fill == n * bps
    assert world.later_epochs.nvlink == 80_073 * 7 * bps / 2
    assert world.later_epochs.network == 8 * 80_073 * bps / 2
    assert plans.describe().splitlines()[1:] == [
        "  per GPU: 141.00 GiB free of 141.00 GiB, reserve 14.10 GiB; cache room 126.90 GiB (cache_size=auto, "
        "under free minus the reserve)",
        "  per node: host 2.00 TiB free of 2.00 TiB, host tier budget 1.80 TiB (each rank keeps its own host tier)",
        "  per epoch each rank reads 80073 rows (DistributedSampler, shuffle=True); bytes below are per node, "
        "expected, mean over nodes",
        "  scope (ranks per copy); per GPU: bytes (samples) of the dataset on each GPU; PCIe: host to device, 1st "
        "epoch (fill included) and later epochs; NVLink: from the node's other GPUs; network: from other nodes",
        "  scope       fits   per GPU              host/node   PCIe 1st    PCIe later  NVLink     network",
        "  rank (1)    tiers  126.90 GiB (905151)  421.73 GiB  1.02 TiB    26.36 GiB   0 B        0 B",
        "  node (8)    yes    22.45 GiB (160146)   0 B         179.62 GiB  0 B         78.58 GiB  0 B <- auto",
        "  world (16)  yes    11.23 GiB (80073)    0 B         89.81 GiB   0 B         39.29 GiB  44.90 GiB",
        "  rank: each GPU holds 905151 of 1281167 rows; 376016 in host memory",
        "auto picks node: the dataset (179.62 GiB) fits 8 device(s) of 126.90 GiB room each (22.45 GiB per rank)",
    ]


def test_smaller_cards_fall_back_and_say_so(defaults):
    plans = plan_scopes(*IMAGENET, gpus_per_node=8, nodes=2, device_memory="8GiB",
                        host_memory_per_node="512GiB", settings=defaults, host_shared=False)
    assert plans.auto.scope == "rank" and "does not fit 16 devices" in plans.auto.reason
    for scope in ("node", "world"):
        assert not plans[scope].runs and plans[scope].later_epochs is None
        assert "falls back to rank" in plans[scope].note
    assert "over its host budget" in plans["rank"].note  # 8 private host copies do not fit the node
    text = plans.describe()
    assert "auto picks rank:" in text and "rank (1)    tiers" in text and "<- auto" in text


def test_settings_are_resolved_as_the_loader_resolves_them(tmp_path):
    world = CacheSettings.resolve(environ={"GPULOAD_CACHE_SCOPE": "world"}, cwd=tmp_path)
    plans = plan_scopes(100, 1000, gpus_per_node=2, nodes=2, device_memory="4GiB", host_memory_per_node=HOST,
                        settings=world)
    assert plans.auto.scope == "rank" and plans.asked.scope == "world"
    assert "cache_scope=world (environment variable GPULOAD_CACHE_SCOPE) runs world" in plans.describe()
    sized = CacheSettings.resolve(cache_size="250KB", cache_reserve="1GiB", environ={}, cwd=tmp_path)
    plans = plan_scopes(100, 10_000, gpus_per_node=2, nodes=2, device_memory="4GiB", host_memory_per_node=HOST,
                        settings=sized)
    assert (plans.room, plans.reserve, plans.auto.scope) == (250_000, GiB, "world")  # 25 rows per GPU
    assert plans["rank"].device_samples == 25 and not plans["node"].runs
    host_only = CacheSettings.resolve(cache="host", cache_scope="node", environ={}, cwd=tmp_path)
    plans = plan_scopes(100, 1000, gpus_per_node=2, nodes=2, device_memory="4GiB", host_memory_per_node=HOST,
                        settings=host_only)
    assert plans.room == 0 and plans.auto.scope == plans.asked.scope == "rank"
    assert "keeps no device tier" in plans.asked.reason and "keeps no device tier" in plans["node"].note
    assert plans["rank"].host_samples == 100 and plans["rank"].later_epochs.pcie == plans["rank"].later_epochs.sampled


def test_one_gpu_per_node_or_one_node():
    one_gpu = plan_scopes(10, 4, gpus_per_node=1, nodes=3, device_memory="1GiB", host_memory_per_node=HOST, room=20,
                          settings=CacheSettings.resolve(**PINNED))
    assert not one_gpu["node"].runs and "the same as rank" in one_gpu["node"].note
    assert one_gpu.auto.scope == "world" and one_gpu["world"].later_epochs.nvlink == 0
    one_node = plan_scopes(10, 4, gpus_per_node=4, nodes=1, device_memory="1GiB", host_memory_per_node=HOST, room=20,
                          settings=CacheSettings.resolve(**PINNED))
    assert one_node["world"].later_epochs == one_node["node"].later_epochs
    assert one_node["world"].later_epochs.network == 0


def test_a_scope_that_is_not_planned_is_named_with_the_ones_that_are():
    plans = plan_scopes(10, 4, gpus_per_node=2, nodes=1, device_memory="1GiB", host_memory_per_node=HOST, room=20,
                        settings=CacheSettings.resolve(**PINNED))
    with pytest.raises(KeyError, match="no scope 'auto'; the scopes are rank, node, world"):
        plans["auto"]


@pytest.mark.parametrize("sampler_drop_last", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("num_samples, world", [(23, 4), (24, 4), (3, 4), (100, 7)])
def test_rows_per_rank_is_what_torchs_samplers_give(num_samples, world, sampler_drop_last, drop_last):
    data = TensorDataset(torch.arange(num_samples))
    sampler = DistributedSampler(data, num_replicas=world, rank=world - 1, drop_last=sampler_drop_last)
    read = sum(len(batch) for batch in BatchSampler(sampler, 3, drop_last))
    assert rows_per_rank(num_samples, world, sampler_drop_last=sampler_drop_last, batch_size=3,
                         drop_last=drop_last) == read


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(nodes=0), "nodes must be at least 1"),
        (dict(gpus_per_node=0), "gpus_per_node must be at least 1"),
        (dict(num_samples=0), "num_samples must be at least 1"),
        (dict(room=-1), "room must be >= 0"),
        (dict(device_memory="auto"), "must be an absolute size"),
        (dict(batch_size=0), "batch_size must be at least 1"),
        (dict(gpus_per_node=100_000, nodes=100_000), "10,000,000,000 ranks: plan at most 131,072"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    arguments = dict(num_samples=10, bytes_per_sample=4, gpus_per_node=2, nodes=1, device_memory="1GiB",
                     host_memory_per_node=HOST, settings=CacheSettings.resolve(**PINNED))
    with pytest.raises(ValueError, match=message):
        plan_scopes(**{**arguments, **kwargs})


@hypothesis_settings(max_examples=150, deadline=None)
@given(
    num_samples=st.integers(1, 5000), bytes_per_sample=st.integers(1, 4096), local=st.integers(1, 9),
    nodes=st.integers(1, 5), room=st.integers(0, 10**7), host_free=st.integers(0, 16 * GiB),
    shared=st.booleans(), mode=st.sampled_from(["auto", "device", "host", "off"]),
)
def test_every_epochs_bytes_add_up(num_samples, bytes_per_sample, local, nodes, room, host_free, shared, mode):
    settings = CacheSettings.resolve(cache=mode, **PINNED)
    plans = plan_scopes(num_samples, bytes_per_sample, gpus_per_node=local, nodes=nodes, device_memory="1GiB",
                        host_memory_per_node=MemoryInfo(host_free, 16 * GiB), settings=settings, room=room,
                        host_shared=shared)
    read = local * plans.rows_per_rank * bytes_per_sample
    assert plans.rows_per_rank == math.ceil(num_samples / (local * nodes))
    for plan in plans.scopes:
        if not plan.runs:
            assert plan.scope != "rank" and plan.later_epochs is None
            continue
        for epoch in (plan.first_epoch, plan.later_epochs):
            assert epoch.sampled == read
            assert epoch.local + epoch.pcie + epoch.nvlink + epoch.network == pytest.approx(read, rel=1e-9, abs=1e-6)
            assert min(epoch.local, epoch.pcie, epoch.nvlink, epoch.network) >= 0
        assert plan.later_epochs.fill == 0 and plan.first_epoch.fill >= 0
        if plan.scope == "rank":
            assert plan.device_samples + plan.host_samples + plan.source_samples == num_samples
            assert plan.later_epochs.nvlink == plan.later_epochs.network == 0
            assert plan.host_bytes_per_node == plan.host_samples * bytes_per_sample * (1 if shared else local)
        else:
            assert plan.device_bytes <= room and plan.later_epochs.pcie == 0 and plan.host_bytes_per_node == 0
            # every node holds one copy (node) or the nodes together hold one (world)
            copies = 1 if plan.scope == "node" else 1 / nodes
            assert plan.first_epoch.fill == pytest.approx(num_samples * bytes_per_sample * copies)
        if plan.scope == "node":
            assert plan.later_epochs.network == 0
            assert plan.later_epochs.nvlink == pytest.approx(read * (local - 1) / local)
        if plan.scope == "world":
            assert plan.later_epochs.network == pytest.approx(read * (nodes - 1) / nodes)
    chosen = plans[plans.auto.scope]
    assert plans.auto.scope == "rank" or (chosen.runs and chosen.fits)
    if plans["rank"].fits and mode in ("auto", "device"):
        assert plans.auto.scope == "rank"


def _received_by_origin(num_samples: int, local: int, nodes: int, scope: str, epochs: int) -> torch.Tensor:
    """Rows each node received per epoch from the node's other ranks and from other nodes, by
    the exchange's own plan (:func:`plan_step`) for the batches torch's samplers give."""
    world = local * nodes
    partition = Partition(num_samples, world, local if scope == "node" else world)
    data = TensorDataset(torch.arange(num_samples))
    counts = torch.zeros(epochs, nodes, 2, dtype=torch.float64)
    for epoch in range(epochs):
        sampler = DistributedSampler(data, num_replicas=world, rank=0, seed=3)
        sampler.set_epoch(epoch)
        everyone = every_rank_batches(BatchSampler(sampler, 5, False))
        for me in range(world):
            for step in range(len(everyone[me])):
                recv = plan_step(me, [batches[step] for batches in everyone], partition).recv_splits
                for sender, rows in enumerate(recv):
                    counts[epoch, me // local, int(sender // local != me // local)] += rows
    return counts


@pytest.mark.parametrize("scope", ["node", "world"])
def test_expectation_matches_the_exchange_plans_over_many_shuffles(scope):
    num_samples, local, nodes, epochs = 61, 2, 2, 60
    plans = plan_scopes(num_samples, 1, gpus_per_node=local, nodes=nodes, device_memory="1GiB",
                        host_memory_per_node=HOST, room=num_samples, settings=CacheSettings.resolve(**PINNED))
    expected = plans[scope].later_epochs
    counts = _received_by_origin(num_samples, local, nodes, scope, epochs).sum(dim=1) / nodes  # mean per node
    for column, want in ((0, expected.nvlink), (1, expected.network)):
        seen = counts[:, column]
        spread = max(float(seen.std()), 1.0) / math.sqrt(epochs)
        assert abs(float(seen.mean()) - want) < 5 * spread, (scope, column, float(seen.mean()), want)


@pytest.mark.slow
def test_a_gloo_job_of_two_nodes_receives_what_the_plan_expects(tmp_path):
    job = scope_plan_job
    world, local = 4, 2
    ranks = ranks_job.findings(job.run, world, tmp_path, local)
    plans = plan_scopes(job.NUM_SAMPLES, job.ROW_BYTES, gpus_per_node=local, nodes=world // local,
                        device_memory="1GiB", host_memory_per_node=HOST, room=job.NUM_SAMPLES * job.ROW_BYTES,
                        settings=CacheSettings.resolve(**PINNED))
    rows = plans.rows_per_rank
    for scope in ("node", "world"):
        expected = plans[scope].later_epochs
        want = job.EPOCHS * (expected.nvlink + expected.network)  # per node: all a node receives
        # A rank reads `rows` distinct indices; each comes from another rank with probability p.
        p = 1 - 1 / plans[scope].group_size
        tolerance = 6 * job.ROW_BYTES * math.sqrt(job.EPOCHS * local * rows * p * (1 - p))
        for node in range(world // local):
            received = [ranks[r][scope]["bytes_received_per_epoch"] for r in range(node * local, (node + 1) * local)]
            assert all(len(epochs) == job.EPOCHS for epochs in received)
            got = sum(map(sum, received))
            assert abs(got - want) <= tolerance, (scope, node, got, want, tolerance)
