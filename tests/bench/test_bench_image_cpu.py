"""``benchmarks/bench_image_cpu.py``: it measures every piece on real crop windows, and its
evidence on torch's uint8 resize is a difference from the reference, not a copy of it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def load_bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_image_cpu", ROOT / "benchmarks" / "bench_image_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_it_times_each_piece_and_says_how_far_uint8_resizing_is(capsys) -> None:
    bench = load_bench()
    threads = torch.get_num_threads()
    try:
        result = bench.main(["--images", "6", "--rounds", "1"])
    finally:
        torch.set_num_threads(threads)
    cpu = result["cpu_ms_per_image"]
    assert len(cpu) == 8 and all(ms > 0 for ms in cpu.values())
    difference = result["uint8_difference"]
    # fixed-point weights: some values miss the reference's rounding, none by much more than one level
    assert 0 < difference["share not the reference rounded"] < 0.5
    assert 0.5 < difference["largest |uint8 - reference|"] < 2
    assert "6 crop windows" in capsys.readouterr().out
