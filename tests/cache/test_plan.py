"""The placement plan over a matrix of pretended cards."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuload.cache.plan import default_host_reserve, make_plan

GiB = 2**30
CIFAR = 3 * 32 * 32 + 8


def test_all_on_device():
    plan = make_plan(CIFAR, 50_000, 80 * GiB, 64 * GiB, 40 * GiB, 8 * GiB)
    assert plan.kind == "device"
    assert plan.device_samples == 50_000 and plan.host_samples == 0 and plan.source_samples == 0
    assert plan.h2d_bytes_per_epoch_uncached == 50_000 * CIFAR
    assert plan.h2d_bytes_per_epoch_cached == 0
    assert plan.fill_bytes == 50_000 * CIFAR


def test_first_k_on_device_rest_pinned():
    bps = 150_536
    plan = make_plan(bps, 100_000, 12 * GiB, 64 * GiB, 8 * GiB, 2 * GiB, device_total=16 * GiB, host_total=64 * GiB)
    assert plan.kind == "device+host"
    assert plan.device_samples == 8 * GiB // bps
    assert plan.host_samples == 100_000 - plan.device_samples
    assert plan.h2d_bytes_per_epoch_cached == plan.host_samples * bps
    text = plan.describe()
    assert "device+host" in text and "12.00 GiB free of 16.00 GiB" in text
    assert "without cache" in text and str(plan) == text


def test_reserve_limits_device_tier_below_budget():
    plan = make_plan(1000, 10**7, 10 * GiB, 0, 40 * GiB, 4 * GiB, mode="device")
    assert plan.device_samples == 6 * GiB // 1000
    assert plan.host_samples == 0 and plan.kind == "device+stream"
    assert any("minus the reserve" in note for note in plan.notes)


def test_host_only_and_off_and_cpu():
    host = make_plan(1000, 1000, 80 * GiB, 64 * GiB, 40 * GiB, 8 * GiB, mode="host")
    assert host.kind == "host" and host.device_samples == 0 and host.host_samples == 1000
    assert host.h2d_bytes_per_epoch_cached == host.h2d_bytes_per_epoch_uncached == 10**6
    off = make_plan(1000, 1000, 80 * GiB, 64 * GiB, 40 * GiB, 8 * GiB, mode="off")
    assert off.kind == "stream" and off.source_samples == 1000
    cpu = make_plan(1000, 1000, 0, 64 * GiB, 0, 0, target="cpu")
    assert cpu.kind == "cpu" and cpu.h2d_bytes_per_epoch_uncached == 0 and cpu.source_samples == 1000


def test_no_room_anywhere_streams():
    plan = make_plan(10**6, 1000, 1 * GiB, 2 * GiB, 1 * GiB, 2 * GiB, host_total=2 * GiB)
    assert plan.kind == "stream" and plan.source_samples == 1000


def test_zero_budget_skips_device_but_auto_uses_host():
    plan = make_plan(1000, 1000, 80 * GiB, 64 * GiB, 0, 8 * GiB)
    assert plan.device_samples == 0 and plan.host_samples == 1000
    assert any("cache_size off" in note for note in plan.notes)


def test_host_reserve_default():
    assert default_host_reserve(16 * GiB) == 4 * GiB
    assert default_host_reserve(512 * GiB) == int(51.2 * GiB)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mode="vram"), "cache mode"),
        (dict(target="tpu"), "target"),
        (dict(bytes_per_sample=0), "bytes_per_sample"),
        (dict(num_samples=-1), "num_samples must be >= 0"),
        (dict(budget=-1), "budget"),
    ],
)
def test_invalid_inputs(kwargs, match):
    args = dict(bytes_per_sample=10, num_samples=10, device_free=100, host_free=100, budget=100, reserve=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        make_plan(**args)


sizes = st.integers(min_value=0, max_value=200 * GiB)


@settings(max_examples=300, deadline=None)
@given(
    bps=st.integers(min_value=1, max_value=2**24),
    n=st.integers(min_value=0, max_value=2 * 10**6),
    device_free=sizes,
    host_free=sizes,
    budget=sizes,
    reserve=st.integers(min_value=0, max_value=20 * GiB),
    mode=st.sampled_from(["auto", "device", "host", "off"]),
)
def test_plan_invariants(bps, n, device_free, host_free, budget, reserve, mode):
    plan = make_plan(bps, n, device_free, host_free, budget, reserve, mode)
    assert plan.device_samples >= 0 and plan.host_samples >= 0 and plan.source_samples >= 0
    assert plan.device_samples + plan.host_samples + plan.source_samples == n
    assert plan.device_bytes <= budget
    assert plan.device_bytes <= max(0, device_free - reserve)
    assert plan.host_bytes <= plan.host_budget
    if mode in ("host", "off"):
        assert plan.device_samples == 0
    if mode in ("device", "off"):
        assert plan.host_samples == 0
    # greedy: a tier is left with room for one more sample only when nothing is left for it
    if mode in ("auto", "device") and plan.device_samples < n:
        assert min(budget, device_free - reserve) - plan.device_bytes < bps
    if mode in ("auto", "host") and plan.host_samples < n - plan.device_samples:
        assert plan.host_budget - plan.host_bytes < bps
    assert plan.h2d_bytes_per_epoch_cached == (n - plan.device_samples) * bps
    bigger = make_plan(bps, n, device_free, host_free, budget + bps, reserve, mode)
    assert bigger.device_samples >= plan.device_samples  # more budget never caches less
    assert plan.describe()


# -- gpuload plan ------------------------------------------------------------------------------


