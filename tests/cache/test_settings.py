"""CacheSettings.array_plan: the host budget is the node's, counted once over its ranks' copies."""

from __future__ import annotations

import pytest
import torch

from gpuload.cache import CacheSettings
from gpuload.cache.budget import CacheSettingError
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


def test_a_shared_plan_is_within_the_budget_and_keepable_is_free_memory_above_the_reserve():
    settings = CacheSettings.resolve(cache_size="1GiB", cache_reserve="2GiB", environ={}, cwd="/")
    device, host = MemoryInfo(free=80 * GiB, total=80 * GiB), MemoryInfo(free=100 * GiB, total=128 * GiB)
    plan = settings.array_plan(1 << 20, 1_000_000, device, host, device="cuda:7", owner="test-shared-plan")
    assert plan.device_samples == 1024  # the 1 GiB budget; no other loader of "cuda:7" holds any
    assert settings.keepable("cuda:0", MemoryInfo(free=3 * GiB, total=80 * GiB), held=GiB) == 2 * GiB
    assert settings.keepable("cuda:0", MemoryInfo(free=GiB, total=80 * GiB), held=0) == 0
    assert settings.room_check("cpu") is None and callable(settings.room_check(torch.device("cuda", 0)))
    assert str(settings.size) == f"{settings.size.value} (keyword cache_size=)"


def test_keeping_counts_torchs_unused_blocks_as_free_and_growing_does_not(monkeypatch):
    """A cache keeping what it holds counts what torch's allocator holds unused (where its own
    shrinks put their bytes); a cache filling further counts only the driver's free memory."""
    import gpuload.device as device_module

    settings = CacheSettings.resolve(cache_reserve="2GiB", environ={}, cwd="/")
    memory = MemoryInfo(free=3 * GiB, total=80 * GiB, torch_cached=3 * GiB)
    assert settings.keepable("cuda:0", memory, held=GiB) == 5 * GiB
    monkeypatch.setattr(device_module, "device_memory", lambda device: memory)
    assert settings.room_check(torch.device("cuda", 0))() == GiB


def test_a_relative_config_path_is_read_from_the_working_folder_and_jobs_must_be_tables(tmp_path):
    (tmp_path / "conf.toml").write_text('cache_dir = "cached"\n')
    settings = CacheSettings.resolve(environ={"GPULOAD_CONFIG": "conf.toml"}, cwd=tmp_path)
    assert str(settings.disk_dir.value).endswith("cached") and "conf.toml" in settings.disk_dir.source
    (tmp_path / "conf.toml").write_text('jobs = 3\n')
    with pytest.raises(CacheSettingError, match="must be tables: write \\[jobs.NAME\\] sections"):
        CacheSettings.resolve(environ={"GPULOAD_CONFIG": "conf.toml"}, cwd=tmp_path)
