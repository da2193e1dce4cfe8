"""benchmarks/device_check.sh and its summary: the JSON is written whatever the steps did.

The GPU steps cannot run here; what can is checked: the summary of a folder with passed,
failed, timed-out and skipped steps and broken files, and the script itself running its cheap
steps, a step that fails (no CUDA) and a budget too small for any step.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
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
        ("truth", "failed", "1", "52.0", "100"),
        ("gpu-tests", "failed", "1", "80.5", "150"),
        ("kernel-parity", "timeout", "124", "75.0", "75"),
        ("prefetch", "passed", "0", "20.0", "50"),
        ("timeline", "passed", "0", "9.0", "25"),
        ("cache-device", "passed", "0", "30.0", "55"),
        ("images", "passed", "0", "40.0", "75"),
        ("cache-partial", "skipped", "", "0", "45"),
    ]
    lines = ["step\tstatus\trc\tseconds\tlimit_s\tlog"] + ["\t".join((*r, f"{r[0]}.log")) for r in rows]
    (out / "steps.tsv").write_text("\n".join(lines) + "\n")
    (out / "machine.log").write_text('nvidia-smi ...\nMACHINE_JSON {"torch": "2.11.0", "cuda_available": true}\n')
    (out / "gpu-tests.xml").write_text(JUNIT)
    # kernel-parity timed out: no XML
    (out / "truth").mkdir()
    (out / "truth" / "array-shrink.json").write_text(json.dumps({
        "check": "array-shrink", "defects": [2], "device": "cuda", "passed": True, "problems": [],
        "details": {"shrinks": 1024}, "seconds": 6.5}))
    (out / "truth" / "epoch-shrink.json").write_text(json.dumps({
        "check": "epoch-shrink", "defects": [6], "device": "cuda", "passed": False,
        "problems": ["the cache drains epoch by epoch: held [268566528, 134217728, 0, 0, 0] bytes"],
        "details": {"held_per_epoch": [268566528, 134217728, 0, 0, 0], "traceback": "..."}, "seconds": 9.0}))
    (out / "prefetch.json").write_text(json.dumps({
        "device": "cuda:0", "rows": [
            {"feed": "step alone", "wait_share": 0.0, "overhead": 0.0, "batches_per_s": 250.0},
            {"feed": "torch DataLoader(num_workers=0, pin_memory=True)", "wait_share": 0.4, "batches_per_s": 150.0},
            {"feed": "gpuload Prefetcher(depth=3) over DataLoader(num_workers=0)", "wait_share": 0.02},
        ],
        "h2d": {"pinned_peak_gbps": 50.0, "pageable_gbps": 12.5, "prefetcher_gbps": 45.0,
                "prefetcher_with_gather_gbps": 20.0},
    }))
    (out / "timeline.json").write_text(json.dumps({
        "device": "cuda", "path": "device-gather", "pairs": 400, "steps_per_epoch": 20, "off_us_per_step": 80.0,
        "on_us_per_step": 86.0, "paired_difference_us_per_step": 6.0, "overhead_percent": 7.5}))
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
            {"name": "torchvision decode_jpeg + v2 transforms (on cuda)", "samples_per_s": 2700.0,
             "x_baseline": 3.0},
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
    assert summary["truth"]["array-shrink"] == {"passed": True, "defects": [2], "problems": [],
                                                "details": {"shrinks": 1024}, "seconds": 6.5}
    assert summary["truth"]["epoch-shrink"]["details"] == {"held_per_epoch": [268566528, 134217728, 0, 0, 0]}
    assert summary["prefetch"]["prefetcher_share_of_pinned_peak"] == pytest.approx(0.9)
    assert summary["timeline"]["on_us_per_step"] == 86.0 and summary["timeline"]["path"] == "device-gather"
    assert "JSONDecodeError" in summary["bench"]["cache-device"]["error"]
    assert summary["bench"]["images"]["loaders"][2]["samples_per_s"] == 5400.0
    assert summary["images_decode_backends"] == ["nvjpeg"]
    assert summary["doctor"]["not_ok"] == ["WARN dali: pip install 'gpuload[cuda13]'"]
    assert summary["headline"] == {
        "h2d_gbps": {"pinned": 50.0, "pageable": 12.5, "prefetcher": 45.0},
        "loop_wait_share": {
            "without prefetching": {"torch DataLoader(num_workers=0, pin_memory=True)": 0.4},
            "with gpuload's prefetcher": {"gpuload Prefetcher(depth=3) over DataLoader(num_workers=0)": 0.02},
        },
        "timeline_overhead_percent": 7.5,
        "truth": {"array-shrink": "passed",
                  "epoch-shrink":
                      "FAILED: the cache drains epoch by epoch: held [268566528, 134217728, 0, 0, 0] bytes"},
        "images_samples_per_s": {"torch_best": 900.0, "torchvision_on_device": 2700.0, "gpuload": {
            "gpuload DataLoader": {"samples_per_s": 5400.0, "x_torch": 6.0, "x_torchvision_on_device": 2.0,
                                   "decode_backend": "nvjpeg"}}},
    }
    assert "cache-partial" not in summary["bench"] or "error" in summary["bench"]["cache-partial"]
    assert summary["totals"] == {
        "steps": 9, "steps_passed": 5, "steps_not_passed": ["truth", "gpu-tests", "kernel-parity", "cache-partial"],
        "tests_passed": 1, "tests_failed": 2, "tests_skipped": 1,
        "truth_passed": ["array-shrink"], "truth_failed": ["epoch-shrink"],
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
    assert range_problems_in_files((ROOT / module.CUDA_ONLY_LINES).read_text()) == []


def test_a_range_that_no_longer_starts_at_the_line_it_names_is_caught() -> None:
    text = (ROOT / "benchmarks" / "cuda_only_lines.md").read_text()
    shifted = text.replace("`gpuload/cli/bench.py:448`", "`gpuload/cli/bench.py:447`", 1)
    assert shifted != text
    assert any("gpuload/cli/bench.py:447" in problem and "not at line 447" in problem
               for problem in range_problems_in_files(shifted))


LISTED_RANGE = re.compile(r"^\| `(gpuload/[\w/]+\.py):(\d+)(?:-(\d+))?`"
                          r" \((?:`([\w.]+)`, )?at `([^`]+)`\)", flags=re.MULTILINE)


def range_problems_in_files(text: str) -> list[str]:
    """Ranges of cuda_only_lines.md that are not where they say: past the end of the file, starting
    or ending on a blank line, outside the function they name, or whose first line no longer holds
    the text quoted after "at" (code moved: find the text and give its new line)."""
    listed, problems = LISTED_RANGE.findall(text), []
    entries = len(re.findall(r"^\| `gpuload/", text, flags=re.MULTILINE))
    if len(listed) != entries or len(listed) < 10:
        problems.append(f"{entries - len(listed)} of {entries} entries lack the form"
                        " `path:lines` (`function`, at `text`)")
    for path, first, last, function, anchor in listed:
        lines = (ROOT / path).read_text().splitlines()
        span = lines[int(first) - 1 : int(last or first)]
        where = f"{path}:{first}" + (f"-{last}" if last else "")
        if len(span) != int(last or first) - int(first) + 1:
            problems.append(f"{where} is past the end")
            continue
        if not all(line.strip() for line in span[:1] + span[-1:]):
            problems.append(f"{where} starts or ends blank")
        if anchor not in span[0]:
            moved = [number for number, line in enumerate(lines, 1) if anchor in line]
            problems.append(f"{where}: {anchor!r} is not at line {first} (found at {moved})")
        if function:  # the range lies in the function named
            defs = [(len(d[1]), d[2]) for d in (re.match(r"(\s*)def (\w+)", line) for line in lines[: int(first)]) if d]
            named = [k for k, (_, name) in enumerate(defs) if name == function.split(".")[-1]]
            if not named:
                problems.append(f"{where}: no {function} before line {first}")
            elif not all(i > defs[named[-1]][0] for i, _ in defs[named[-1] + 1 :]):
                problems.append(f"{where} is not in {function}")
    return problems


def run_check(out: Path, steps: str, budget: int = 320, **env: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPULOAD_CHECK_STEPS": steps, "GPULOAD_CHECK_PYTHON": sys.executable,
           "GPULOAD_CHECK_BUDGET_S": str(budget), **env}
    return subprocess.run(["bash", str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=480)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict]:
    """One dry run of the steps that pass here, the machine's and the truth checks' (on the CPU),
    for the tests that read it: each step costs tens of seconds on a busy 2-core machine. Its
    budget leaves the truth step its whole CPU limit (3 x 100 s) after a slow machine step."""
    out = tmp_path_factory.mktemp("device_check")
    done = run_check(out, "machine truth", budget=400, GPULOAD_CHECK_DEVICE="cpu")
    return done, {**json.loads((out / "summary.json").read_text()), "out": out}


@pytest.mark.slow
def test_the_script_writes_the_summary_when_a_step_fails(tmp_path: Path) -> None:
    # prefetch asks for CUDA: fails here; under the CPU dry run's limits (105 s, not 35), which a
    # busy machine's start of the step does not reach (it did at load 14: 'timeout', not 'failed')
    done = run_check(tmp_path, "prefetch", GPULOAD_CHECK_DEVICE="cpu")
    assert done.returncode == 1, done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs.tar.gz", "steps.tsv", "summary.json"]
    summary = json.loads((tmp_path / "summary.json").read_text())
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


def test_the_whole_check_fits_five_minutes_so_a_rerun_fits_the_lease() -> None:
    script = SCRIPT.read_text()
    budget = int(re.search(r'budget_s="\$\{GPULOAD_CHECK_BUDGET_S:-(\d+)\}"', script)[1])
    summary_limit = re.search(r"timeout -k (\d+) (\d+) \"\$python\" benchmarks/device_check_summary.py", script)
    # every step ends within the budget (limits are cut to what is left), then the summary and packing
    assert budget + int(summary_limit[1]) + int(summary_limit[2]) + 10 <= 5 * 60
    # the estimates written beside the steps fit the budget too
    estimates = [int(s) for s in re.findall(r"^#   [\w-]+ +\(~(\d+) s\)", script, flags=re.MULTILINE)]
    assert len(estimates) == len(re.findall(r"^step [\w-]+ \d+ ", script, flags=re.MULTILINE))
    assert sum(estimates) <= budget


@pytest.mark.slow
def test_the_dry_run_of_the_machine_step_passes_here(dry_run: tuple[subprocess.CompletedProcess[str], dict]) -> None:
    done, summary = dry_run
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary["steps"]["machine"]["status"] == "passed"
    assert summary["machine"]["cuda_available"] is False
    assert {line.split(":")[0] for line in summary["doctor"]["lines"]} >= {"OK torch", "OK launcher"}
    assert summary["totals"]["steps_not_passed"] == [] and summary["doctor"]["versions"]["torch"]


@pytest.mark.slow
def test_the_dry_run_of_the_truth_step_runs_every_check_on_the_cpu(
        dry_run: tuple[subprocess.CompletedProcess[str], dict]) -> None:
    done, summary = dry_run
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary["steps"]["truth"]["status"] == "passed"
    assert summary["totals"]["truth_failed"] == []
    assert summary["totals"]["truth_passed"] == ["array-shrink", "column-oom", "epoch-shrink", "nvjpeg-stall",
                                                 "stream-guard"]
    assert {verdict["details"].get("decode_backend") for verdict in summary["truth"].values()} >= {"nvjpeg"}
    # What each check wrote, run by device_truth.py each in its own process (test_device_truth.py
    # checks the verdicts on data a defect would give): passed on the CPU, naming its defects.
    defects = {"nvjpeg-stall": [1], "stream-guard": [3], "array-shrink": [2], "column-oom": [4, 5], "epoch-shrink": [6]}
    with tarfile.open(summary["out"] / "logs.tar.gz") as logs:  # where the script packs truth/
        written = {Path(member.name).stem: json.load(logs.extractfile(member)) for member in logs.getmembers()
                   if member.name.startswith("truth/") and member.name.endswith(".json")}
    assert sorted(written) == sorted(defects)
    for name, verdict in written.items():
        assert verdict["passed"] and verdict["defects"] == defects[name] and verdict["device"] == "cpu", verdict
        assert (verdict["details"]["cuda_only"] if name != "nvjpeg-stall"
                else verdict["details"]["decode_backend"] == "nvjpeg"), verdict


# -------------------------------------------------- cuda_only_lines.md: what runs each range on the device check

NOT_ON_THE_CHECK = "**not on the device check**"
# How a test says it will not run on the device check's image (one GPU, no DALI): its skip marks,
# an importorskip, or the helper the NCCL tests call for two GPUs.
_NEEDS = {
    "DALI": re.compile(r"dali", re.IGNORECASE),
    "several GPUs": re.compile(r"nccl_world\(|device_count\(\)\s*<\s*2|count\s*<\s*2|2 (?:CUDA devices|GPUs)"),
}


def check_steps() -> set[str]:
    """The steps device_check.sh runs."""
    return set(re.findall(r"^step ([\w-]+) ", SCRIPT.read_text(), flags=re.MULTILINE))


def listed_runs(text: str) -> list[tuple[str, list[str], list[tuple[str, str]]]]:
    """Per range of cuda_only_lines.md: (the range, the device-check steps that run it, the tests
    it names) from its last column; no steps when it is marked not on the device check."""
    rows, previous = [], ([], [])
    for line in text.splitlines():
        if not line.startswith("| `gpuload/"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        where, runner = cells[0].split("`")[1], cells[-1]
        if runner.startswith("as above"):
            steps, tests = previous
        elif runner.startswith(NOT_ON_THE_CHECK):
            steps, tests = [], []
        else:
            head = re.match(r"steps? ((?:`[\w-]+`(?:, )?)+)", runner)
            steps = re.findall(r"`([\w-]+)`", head[1]) if head else ["<no step named>"]
            tests, module = [], ""
            for path, name, relative in re.findall(r"`(?:(tests/[\w/]+\.py)::(\w+)|::(\w+))`", runner):
                module = path or module
                tests.append((module, name or relative))
        previous = (steps, tests)
        rows.append((where, steps, tests))
    return rows


def device_image_skip(path: str, name: str) -> str | None:
    """Why test ``path::name`` does not run in the gpu-tests or kernel-parity step on the device
    image (one GPU, no DALI), or None when it runs there."""
    source = (ROOT / path).read_text()
    module = ast.parse(source)
    found = [(node, None) for node in module.body if isinstance(node, ast.FunctionDef) and node.name == name]
    found += [(node, cls) for cls in module.body if isinstance(cls, ast.ClassDef)
              for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == name]
    if not found:
        return "no such test"
    function, cls = found[0]
    aliases = {target.id: ast.get_source_segment(source, statement) or "" for statement in module.body
               if isinstance(statement, ast.Assign) for target in statement.targets if isinstance(target, ast.Name)}
    decorators = list(function.decorator_list) + (list(cls.decorator_list) if cls is not None else [])
    marks = []
    for decorator in decorators:  # a mark, or a name for one defined in the module (gpu = pytest.mark.gpu)
        text = ast.get_source_segment(source, decorator) or ""
        marks += [text] + [aliases[name] for name in re.findall(r"\w+", text) if name in aliases]
    scopes = [module.body] + ([cls.body] if cls is not None else [])
    for scope in scopes:  # pytestmark and importorskip at module and class level
        for statement in scope:
            text = ast.get_source_segment(source, statement) or ""
            if isinstance(statement, (ast.Assign, ast.Expr)) and ("pytestmark" in text or "importorskip" in text):
                marks.append(text)
    if not any("mark.gpu" in mark for mark in marks):
        return "not gpu-marked: the gpu-tests step (pytest -m gpu) does not run it"
    body = ast.get_source_segment(source, function) or ""
    skips = "\n".join(marks) + "\n" + "\n".join(line for line in body.splitlines()
                                                 if "skip" in line or "nccl_world(" in line or "count" in line)
    for need, pattern in _NEEDS.items():
        if pattern.search(skips):
            return f"needs {need}: skips on the device check's image (one GPU, no DALI)"
    return None


def range_problems(text: str) -> list[str]:
    """Ranges of cuda_only_lines.md whose last column names no device-check step, a step the
    check does not have, or a test that does not run on its image (or in another step)."""
    problems, known = [], check_steps()
    for where, steps, tests in listed_runs(text):
        unknown = [step for step in steps if step not in known]
        if unknown:
            problems.append(f"{where}: names {unknown}, not a step of device_check.sh (nor {NOT_ON_THE_CHECK!r})")
        for path, name in tests if steps else []:
            step = "kernel-parity" if path.startswith("tests/transforms/") else "gpu-tests"
            why = device_image_skip(path, name)
            if why is not None:
                problems.append(f"{where}: {path}::{name} {why}; mark the range {NOT_ON_THE_CHECK!r}")
            elif step not in steps:
                problems.append(f"{where}: {path}::{name} runs in step {step!r}, which the range does not name")
    return problems


def test_every_listed_range_names_the_device_check_step_that_runs_it() -> None:
    text = (ROOT / "benchmarks" / "cuda_only_lines.md").read_text()
    assert range_problems(text) == []
    runs = listed_runs(text)
    assert sum(bool(steps) for _, steps, _ in runs) >= 30 and any(not steps for _, steps, _ in runs)


def test_a_range_run_by_a_test_that_skips_on_the_device_image_is_named() -> None:
    dali = ("tests/sources/test_images_background.py::"
            "test_on_cuda_batches_are_decoded_and_transformed_ahead_on_the_side_stream")
    two_gpus = "tests/distributed/test_image_shares.py::test_nccl_ranks_get_the_per_rank_caches_batches"
    runs_there = "tests/test_sampling.py::test_indices_on_the_gpu_come_back_on_the_host_in_range"
    not_gpu = "tests/sources/test_images.py::test_batches_are_decoded_then_transformed_per_sample"
    table = "\n".join([
        f"| `gpuload/a.py:1` (`f`) | why | step `gpu-tests`: `{dali}` |",
        f"| `gpuload/b.py:2` (`g`) | why | step `gpu-tests`: `{two_gpus}` |",
        "| `gpuload/c.py:3` (`h`) | why | as above |",
        f"| `gpuload/d.py:4` (`i`) | why | step `gpu-tests`: `{runs_there}` |",
        f"| `gpuload/e.py:5` (`j`) | why | step `images`: `{runs_there}` |",
        f"| `gpuload/f.py:6` (`k`) | why | step `gpu-tests`: `{not_gpu}` |",
        f"| `gpuload/g.py:7` (`l`) | why | {NOT_ON_THE_CHECK}: `{dali}` where DALI is installed |",
        f"| `gpuload/h.py:8` (`m`) | why | `{runs_there}` |",
        "| `gpuload/i.py:9` (`n`) | why | step `truths` |",
    ])
    problems = range_problems(table)
    assert [p.split(":")[0] for p in problems] == ["gpuload/a.py", "gpuload/b.py", "gpuload/c.py", "gpuload/e.py",
                                                   "gpuload/f.py", "gpuload/h.py", "gpuload/h.py", "gpuload/i.py"]
    assert "needs DALI" in problems[0] and "needs several GPUs" in problems[1] and "needs several GPUs" in problems[2]
    assert "runs in step 'gpu-tests'" in problems[3] and "not gpu-marked" in problems[4]
    assert "<no step named>" in problems[5] and "runs in step 'gpu-tests'" in problems[6] and "'truths'" in problems[7]
