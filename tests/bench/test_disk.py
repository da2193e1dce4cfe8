"""The disk scenario: decoded JPEGs spilled to cache_dir's disk tier, beside torch's DataLoader."""

from __future__ import annotations

import ctypes.util
import json
import re
from pathlib import Path

import pytest

from gpuload.bench.disk import anon_resident_bytes, in_a_second_process
from gpuload.cli import main
from tests.bench.stage_panel import assert_traced


def test_the_quick_variant_serves_epoch_2_and_a_second_process_from_the_disk_tier(tmp_path: Path, capsys) -> None:
    assert main(["bench", "--scenario", "disk", "--quick", "--samples", "40", "--batch-size", "8",
                 "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "gpuload epoch 2 (host tier + disk tier)" in printed and "second process" in printed
    rate = re.search(r"second process's rate / epoch 2's: (\d+\.\d\d)x \(target 0\.9x\)", printed)
    assert rate, printed  # a rate against the target, not a time ratio
    assert re.search(r"load average before / after: \d+\.\d / \d+\.\d on \d+ cores\n", printed)  # not raw floats
    document = json.loads((tmp_path / "out" / "bench.json").read_text())
    run = document["run"]
    assert run["images"] == 40 and run["decoded_bytes"] == 40 * 3 * 224 * 224
    assert run["host_tier_bytes"] <= run["host_tier_budget"] < run["decoded_bytes"]  # the host tier is forced small
    assert run["disk_bytes"] == 40 * (3 * 224 * 224 + 8)  # epoch 1 wrote every decoded image and label
    assert run["disk_hits_epoch2"] >= 40 - run["host_tier_bytes"] // (3 * 224 * 224 + 8)
    # The second process read its whole first epoch from the disk tier and wrote nothing.
    assert run["second_process_disk_hits"] == 40 and run["second_process_rows_written"] == 0
    # gpuload's own ImageFolder: every whole decoded image on disk; a new loader decoded none.
    assert "a new loader, its first epoch (disk tier)" in printed
    assert run["own_disk_rows"] == 40 and run["own_disk_bytes"] > run["own_decoded_bytes"] // 2
    assert run["own_new_loader_disk_hits"] == 40 and run["own_new_loader_rows_written"] == 0
    assert run["own_without_disk_epoch2_s"] > 0 and "epoch 2 without cache_dir" in printed
    assert not list(tmp_path.glob("**/block-*"))  # the scratch folders are gone
    # the stage panel's data: one more epoch of each disk-tier loader, traced
    ours, own = document["stages"]
    assert_traced(ours, "gpuload DataLoader (host + disk tier)")
    assert_traced(own, "gpuload ImageFolder (image cache + disk tier)")
    assert "gather.disk" in ours["stage_ms_per_step"]  # a quarter in host memory: the rest from the disk tier
    assert (tmp_path / "out" / "bench.png").read_bytes().startswith(b"\x89PNG")


def test_data_is_refused_for_the_disk_scenario(tmp_path: Path, capsys) -> None:
    assert main(["bench", "--scenario", "disk", "--data", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "the disk scenario makes its own JPEG folder" in capsys.readouterr().err


@pytest.mark.slow  # the child imports torch and torchvision
def test_a_second_process_that_fails_is_an_error_with_its_last_line(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(RuntimeError, match=r"^the second process failed \(exit 1\): FileNotFoundError: .*missing'$"):
        in_a_second_process(str(missing), 8, str(tmp_path / "cache"), 1 << 20)


def test_resident_bytes_are_read_where_the_c_library_cannot_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    """A C library that will not load (or lacks glibc's malloc_trim, as musl does): nothing is trimmed."""
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libc-gpuload-test-missing.so.6")
    assert anon_resident_bytes() > 0


def test_without_torchvision_the_disk_scenario_is_one_line_and_writes_nothing(tmp_path: Path, monkeypatch,
                                                                              capsys) -> None:
    """It reads its JPEGs with torchvision's ImageFolder (before: a raw ModuleNotFoundError, --out left empty)."""
    import sys

    monkeypatch.setitem(sys.modules, "torchvision", None)  # not installed: find_spec says so, import fails
    out = tmp_path / "out"
    assert main(["bench", "--scenario", "disk", "--quick", "--samples", "40", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "torchvision is not installed: pip install 'gpuload[torchvision]'" in err
    assert not out.exists()


def test_the_load_averages_are_printed_with_one_decimal() -> None:
    from gpuload.bench.disk import load_line

    assert load_line([0.6923828125, 12.25], 2) == "  load average before / after: 0.7 / 12.2 on 2 cores"
    assert load_line([None, 3.0], None) == "  load average before / after: ? / 3.0 on ? cores"
