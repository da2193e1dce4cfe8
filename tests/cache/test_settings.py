"""CacheSettings.array_plan: the host budget is the node's, counted once over its ranks' copies."""

from __future__ import annotations

from gpuload.cache import CacheSettings
from gpuload.cache.plan import default_host_reserve
from gpuload.device import MemoryInfo

GiB = 2**30


def test_ranks_keeping_their_own_host_copy_split_the_nodes_host_budget():
    settings = CacheSettings.resolve(cache="host", environ={}, cwd="/")
    device, host = MemoryInfo(free=80 * GiB, total=80 * GiB), MemoryInfo(free=100 * GiB, total=128 * GiB)
    node_room = 100 * GiB - default_host_reserve(128 * GiB)
    bps = 1 << 20
    one = settings.array_plan(bps, 1_000_000, device, host, device="cuda:0", shared=False)
    four = settings.array_plan(bps, 1_000_000, device, host, device="cuda:0", shared=False, host_copies=4)
    assert one.host_budget == node_room and one.host_samples == node_room // bps
    assert four.host_budget == node_room // 4 and four.host_samples == node_room // 4 // bps
    assert any("is the node's" in note and "4 ranks" in note for note in four.notes)
    assert not any("is the node's" in note for note in one.notes)
