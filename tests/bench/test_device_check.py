"""benchmarks/device_check.sh and its summary: the JSON is written whatever the steps did.

The GPU steps cannot run here; what can is checked: the summary of a folder with passed,
failed, timed-out and skipped steps and broken files, and the script itself running its cheap
steps, a step that fails (no CUDA) and a budget too small for any step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "device_check.sh"


def load_summary_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("device_check_summary",
                                                  ROOT / "benchmarks" / "device_check_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
  <testcase classname="tests.decode.test_nvjpeg" name="test_a" time="0.1"/>
  <testcase classname="tests.decode.test_nvjpeg" name="test_b" time="0.1">
    <failure message="AssertionError: mean |diff| 1.7">trace</failure></testcase>
  <testcase classname="tests.test_loader_gpu" name="test_c" time="0.1">
    <skipped type="pytest.skip" message="needs DALI">skip</skipped></testcase>
  <testcase classname="tests.test_loader_gpu" name="test_d" time="0.1">
    <error message="fixture failed">trace</error></testcase>
</testsuite></testsuites>
"""


def fake_check(out: Path) -> None:
    rows = [
        ("machine", "passed", "0", "1.0", "30"),
        ("gpu-tests", "failed", "1", "80.5", "150"),
        ("kernel-parity", "timeout", "124", "75.0", "75"),
        ("prefetch", "passed", "0", "20.0", "50"),
        ("cache-device", "passed", "0", "30.0", "55"),
        ("images", "passed", "0", "40.0", "75"),
        ("cache-partial", "skipped", "", "0", "45"),
    ]
    lines = ["step\tstatus\trc\tseconds\tlimit_s\tlog"] + ["\t".join((*r, f"{r[0]}.log")) for r in rows]
    (out / "steps.tsv").write_text("\n".join(lines) + "\n")
    (out / "machine.log").write_text('nvidia-smi ...\nMACHINE_JSON {"torch": "2.11.0", "cuda_available": true}\n')
    (out / "gpu-tests.xml").write_text(JUNIT)
    # kernel-parity timed out: no XML
    (out / "prefetch.json").write_text(json.dumps({
        "device": "cuda:0", "rows": [
            {"feed": "step alone", "wait_share": 0.0, "overhead": 0.0, "batches_per_s": 250.0},
            {"feed": "torch DataLoader(num_workers=0, pin_memory=True)", "wait_share": 0.4, "batches_per_s": 150.0},
            {"feed": "gpuload Prefetcher(depth=3) over DataLoader(num_workers=0)", "wait_share": 0.02},
        ],
        "h2d": {"pinned_peak_gbps": 50.0, "pageable_gbps": 12.5, "prefetcher_gbps": 45.0,
                "prefetcher_with_gather_gbps": 20.0},
    }))
    (out / "doctor.json").write_text(json.dumps({"ok": True, "versions": {"torch": "2.11.0"}, "findings": [
        {"topic": "torch", "status": "OK", "summary": "torch 2.11.0, built for CUDA 13.0", "fix": ""},
        {"topic": "dali", "status": "WARN", "summary": "DALI is not installed", "fix": "pip install 'gpuload[cuda13]'"},
    ]}))
    (out / "cache-device").mkdir()
    (out / "cache-device" / "bench.json").write_text("{ broken")
    (out / "images").mkdir()
    (out / "images" / "bench.json").write_text(json.dumps({
        "scenario": "images", "ceilings_gbps": {"h2d": 50.0},
        "results": [
            {"name": "torch DataLoader + PIL (num_workers=4)", "samples_per_s": 900.0, "x_baseline": 1.0},
            {"name": "gpuload DataLoader", "samples_per_s": 5400.0, "x_baseline": 6.0,
             "decode_backend": "nvjpeg", "transform_backend": "cupy"},
        ],
    }))


def test_the_summary_reads_every_part_and_reports_broken_ones(tmp_path: Path) -> None:
    fake_check(tmp_path)
    summary = load_summary_module().summarize(tmp_path)
    assert summary["steps"]["kernel-parity"]["status"] == "timeout" and summary["steps"]["kernel-parity"]["rc"] == 124
    assert summary["machine"] == {"torch": "2.11.0", "cuda_available": True}
    tests = summary["tests"]["gpu-tests"]
    assert (tests["tests"], tests["passed"], tests["failed"], tests["errors"], tests["skipped"]) == (4, 1, 1, 1, 1)
    assert tests["failing"][0] == {"test": "tests.decode.test_nvjpeg::test_b",
                                   "message": "AssertionError: mean |diff| 1.7"}
    assert tests["skip_reasons"] == {"needs DALI": 1}
    assert summary["tests"]["kernel-parity"] == {"error": "kernel-parity.xml was not written"}
    assert summary["prefetch"]["prefetcher_share_of_pinned_peak"] == pytest.approx(0.9)
    assert "JSONDecodeError" in summary["bench"]["cache-device"]["error"]
    assert summary["bench"]["images"]["loaders"][1]["samples_per_s"] == 5400.0
    assert summary["images_decode_backends"] == ["nvjpeg"]
    assert summary["doctor"]["not_ok"] == ["WARN dali: pip install 'gpuload[cuda13]'"]
    assert summary["headline"] == {
        "h2d_gbps": {"pinned": 50.0, "pageable": 12.5, "prefetcher": 45.0},
        "loop_wait_share": {
            "without prefetching": {"torch DataLoader(num_workers=0, pin_memory=True)": 0.4},
            "with gpuload's prefetcher": {"gpuload Prefetcher(depth=3) over DataLoader(num_workers=0)": 0.02},
        },
        "images_samples_per_s": {"torch_best": 900.0, "gpuload": {
            "gpuload DataLoader": {"samples_per_s": 5400.0, "x_torch": 6.0, "decode_backend": "nvjpeg"}}},
    }
    assert "cache-partial" not in summary["bench"] or "error" in summary["bench"]["cache-partial"]
    assert summary["totals"] == {
        "steps": 7, "steps_passed": 4, "steps_not_passed": ["gpu-tests", "kernel-parity", "cache-partial"],
        "tests_passed": 1, "tests_failed": 2, "tests_skipped": 1,
    }


def test_the_summary_survives_a_folder_with_nothing_in_it(tmp_path: Path) -> None:
    module = load_summary_module()
    assert module.main([str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "steps_error" in summary and summary["totals"]["steps"] == 0


def test_the_summary_names_the_list_of_cuda_only_lines_and_every_listed_range_exists(tmp_path: Path) -> None:
    module = load_summary_module()
    assert module.main([str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["cuda_only_lines"].startswith("benchmarks/cuda_only_lines.md: the lines only a CUDA driver runs")
    listed = re.findall(r"^\| `(gpuload/[\w/]+\.py):(\d+)(?:-(\d+))?`(?: \(`([\w.]+)`\))?",
                        (ROOT / module.CUDA_ONLY_LINES).read_text(), flags=re.MULTILINE)
    assert len(listed) >= 10
    for path, first, last, function in listed:
        lines = (ROOT / path).read_text().splitlines()
        span = lines[int(first) - 1 : int(last or first)]
        assert len(span) == int(last or first) - int(first) + 1, f"{path}:{first}-{last} is past the end"
        assert all(line.strip() for line in span[:1] + span[-1:]), f"{path}:{first}-{last} starts or ends blank"
        if function:  # the range lies in the function named (a moved line shows here)
            defs = [(len(d[1]), d[2]) for d in (re.match(r"(\s*)def (\w+)", line) for line in lines[: int(first)]) if d]
            named = [k for k, (_, name) in enumerate(defs) if name == function.split(".")[-1]]
            assert named, f"{path}: no {function} before line {first}"
            indent = defs[named[-1]][0]
            assert all(i > indent for i, _ in defs[named[-1] + 1 :]), f"{path}:{first} is not in {function}"


def run_check(out: Path, steps: str, budget: int = 320) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPULOAD_CHECK_STEPS": steps, "GPULOAD_CHECK_PYTHON": sys.executable,
           "GPULOAD_CHECK_BUDGET_S": str(budget)}
    return subprocess.run(["bash", str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_the_script_writes_the_summary_when_a_step_fails(tmp_path: Path) -> None:
    done = run_check(tmp_path, "machine prefetch")  # prefetch asks for CUDA: fails here
    assert done.returncode == 1, done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs.tar.gz", "steps.tsv", "summary.json"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"]["machine"]["status"] == "passed"
    assert summary["machine"]["cuda_available"] is False
    assert {line.split(":")[0] for line in summary["doctor"]["lines"]} >= {"OK torch", "OK launcher"}
    assert summary["steps"]["prefetch"]["status"] == "failed"
    assert "error" in summary["prefetch"]
    assert summary["totals"]["steps_not_passed"] == ["prefetch"]


def test_the_script_skips_what_no_longer_fits_and_still_writes_the_summary(tmp_path: Path) -> None:
    done = run_check(tmp_path, "machine gpu-tests images", budget=5)
    assert done.returncode == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {name: s["status"] for name, s in summary["steps"].items()} == {
        "machine": "skipped", "gpu-tests": "skipped", "images": "skipped"
    }


def test_the_whole_check_fits_six_minutes_so_a_rerun_fits_the_lease() -> None:
    script = SCRIPT.read_text()
    budget = int(re.search(r'budget_s="\$\{GPULOAD_CHECK_BUDGET_S:-(\d+)\}"', script)[1])
    summary_limit = re.search(r"timeout -k (\d+) (\d+) \"\$python\" benchmarks/device_check_summary.py", script)
    # every step ends within the budget (limits are cut to what is left), then the summary and packing
    assert budget + int(summary_limit[1]) + int(summary_limit[2]) + 10 <= 6 * 60


@pytest.mark.slow
def test_the_dry_run_of_the_machine_step_passes_here(tmp_path: Path) -> None:
    done = run_check(tmp_path, "machine")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["totals"]["steps_not_passed"] == [] and summary["doctor"]["versions"]["torch"]
