"""One JSON of what ``benchmarks/device_check.sh`` found: steps, test counts, the truth checks'
verdicts, benchmark numbers.

Reads the folder the check wrote (``steps.tsv``, junit XML of the test steps, ``truth/*.json`` of
``benchmarks/device_truth.py``, the benchmarks' JSON, ``machine.log``, ``doctor.json``) and writes
``summary.json`` beside them. Every part is read on its own: a missing or broken file becomes an
``"error"`` entry in its section, never a missing summary.

Usage: python benchmarks/device_check_summary.py OUT_DIR
"""

from __future__ import annotations

import csv
import json
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

TEST_STEPS = ("gpu-tests", "kernel-parity")
BENCH_STEPS = ("cache-device", "cache-partial", "images")
_FAILING_LISTED = 30
CUDA_ONLY_LINES = "benchmarks/cuda_only_lines.md"  # what only a driver runs, and which step or gpu test runs it


def read_steps(out: Path) -> list[dict[str, Any]]:
    """The rows of steps.tsv: name, status (passed/failed/timeout/skipped), rc, seconds."""
    with open(out / "steps.tsv", encoding="utf-8", newline="") as table:
        rows = list(csv.DictReader(table, delimiter="\t"))
    for row in rows:
        row["rc"] = int(row["rc"]) if row.get("rc") else None
        row["seconds"] = float(row["seconds"] or 0)
        row["limit_s"] = int(row["limit_s"] or 0)
    return rows


def junit_counts(path: Path) -> dict[str, Any]:
    """Test counts of a junit XML file, the failing tests' ids and the skip reasons."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failing: list[dict[str, str]] = []
    skip_reasons: dict[str, int] = {}
    for suite in suites:
        for case in suite.iter("testcase"):
            counts["tests"] += 1
            test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
            outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
            if outcome is None:
                counts["passed"] += 1
            elif outcome.tag == "skipped":
                counts["skipped"] += 1
                reason = (outcome.get("message") or "").strip()[:200]
                skip_reasons[reason] = skip_reasons.get(reason, 0) + 1
            else:
                counts["failed" if outcome.tag == "failure" else "errors"] += 1
                if len(failing) < _FAILING_LISTED:
                    failing.append({"test": test_id, "message": (outcome.get("message") or "")[:300]})
    return {**counts, "failing": failing, "skip_reasons": skip_reasons}


def truth_verdicts(folder: Path) -> dict[str, Any]:
    """Each ``device_truth.py`` check's verdict: passed, the defects it proves, what failed, its
    measured details and seconds (by check name)."""
    checks = sorted(folder.glob("*.json"))
    if not checks:
        raise ValueError(f"no check wrote its JSON into {folder.name}/")
    verdicts = {}
    for path in checks:
        result = json.loads(path.read_text(encoding="utf-8"))
        details = {k: v for k, v in result.get("details", {}).items() if k not in ("traceback", "output_tail")}
        verdicts[result.get("check", path.stem)] = {
            "passed": bool(result.get("passed")), "defects": result.get("defects", []),
            "problems": result.get("problems", []), "details": details, "seconds": result.get("seconds"),
        }
    return verdicts


def bench_numbers(path: Path) -> dict[str, Any]:
    """Per loader of a ``gpuload bench`` JSON: samples/s, x torch, backends, H2D, device memory."""
    document = json.loads(path.read_text(encoding="utf-8"))
    keys = ("samples_per_s", "x_baseline", "median_epoch_s", "first_epoch_s", "wait_share", "h2d_gbps",
            "loader_device_peak_bytes", "decode_backend", "transform_backend", "path")
    loaders = [
        {"name": row.get("name"), **{k: row[k] for k in keys if row.get(k) is not None}}
        for row in document.get("results", [])
        if isinstance(row, dict)
    ]
    return {"scenario": document.get("scenario"), "ceilings_gbps": document.get("ceilings_gbps"), "loaders": loaders}


def prefetch_numbers(path: Path) -> dict[str, Any]:
    """bench_prefetch.py's JSON: each feed's wait share and overhead, and the H2D bandwidths."""
    document = json.loads(path.read_text(encoding="utf-8"))
    numbers: dict[str, Any] = {
        "feeds": [
            {k: row.get(k) for k in ("feed", "wait_share", "overhead", "batches_per_s")}
            for row in document.get("rows", [])
        ]
    }
    h2d = document.get("h2d")
    if h2d:
        numbers["h2d"] = h2d
        peak = h2d.get("pinned_peak_gbps") or 0
        if peak:
            numbers["prefetcher_share_of_pinned_peak"] = h2d.get("prefetcher_gbps", 0) / peak
    return numbers


def timeline_numbers(path: Path) -> dict[str, Any]:
    """bench_timeline.py's JSON: the timeline's cost per step, on and off, and as a share."""
    document = json.loads(path.read_text(encoding="utf-8"))
    keys = ("device", "path", "pairs", "off_us_per_step", "on_us_per_step", "paired_difference_us_per_step",
            "overhead_percent")
    return {key: document.get(key) for key in keys}


def machine_info(path: Path) -> dict[str, Any]:
    """The versions line machine_info() printed (``MACHINE_JSON {...}``)."""
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("MACHINE_JSON "):
            return json.loads(line.removeprefix("MACHINE_JSON "))
    raise ValueError("no MACHINE_JSON line")


def doctor_findings(path: Path) -> dict[str, Any]:
    """``gpuload doctor --json``: each topic's status and line, and what was not OK."""
    document = json.loads(path.read_text(encoding="utf-8"))
    findings = document.get("findings", [])
    return {
        "ok": document.get("ok"),
        "lines": [f"{f['status']} {f['topic']}: {f['summary']}" for f in findings],
        "not_ok": [f"{f['status']} {f['topic']}: {f['fix']}" for f in findings if f.get("status") != "OK"],
        "versions": document.get("versions", {}),
    }


def _rate(loader: dict[str, Any]) -> float | None:
    rate = loader.get("samples_per_s")
    return float(rate) if isinstance(rate, (int, float)) else None


def headline(summary: dict[str, Any]) -> dict[str, Any]:
    """The numbers a reader wants first: host-to-device GB/s pinned against pageable, the loop's
    wait with and without prefetching, the timeline's cost in percent of a cached step, each truth
    check's verdict, and gpuload's samples/s against torch's best DataLoader per scenario and, where
    the scenario has it (images), against torchvision decoding and transforming on the device."""
    numbers: dict[str, Any] = {}
    prefetch = summary.get("prefetch") or {}
    h2d = prefetch.get("h2d") or {}
    if h2d:
        numbers["h2d_gbps"] = {"pinned": h2d.get("pinned_peak_gbps"), "pageable": h2d.get("pageable_gbps"),
                               "prefetcher": h2d.get("prefetcher_gbps")}
    waits = {row["feed"]: row.get("wait_share") for row in prefetch.get("feeds", []) if row.get("feed")}
    if waits:
        numbers["loop_wait_share"] = {
            "without prefetching": {k: v for k, v in waits.items() if k.startswith("torch DataLoader")},
            "with gpuload's prefetcher": {k: v for k, v in waits.items() if k.startswith("gpuload Prefetcher")},
        }
    timeline = summary.get("timeline") or {}
    if timeline.get("overhead_percent") is not None:
        numbers["timeline_overhead_percent"] = timeline["overhead_percent"]
    truth = summary.get("truth")
    if isinstance(truth, dict) and "error" not in truth:
        numbers["truth"] = {name: "passed" if verdict["passed"] else "FAILED: " + "; ".join(verdict["problems"])[:300]
                            for name, verdict in truth.items()}
    for name, bench in (summary.get("bench") or {}).items():
        loaders = bench.get("loaders", []) if isinstance(bench, dict) else []
        torch_rates = [r for r in (_rate(row) for row in loaders
                                   if str(row.get("name", "")).startswith("torch DataLoader")) if r]
        best = max(torch_rates) if torch_rates else None
        on_device = next((_rate(row) for row in loaders if str(row.get("name", "")).startswith("torchvision ")), None)
        rows = {}
        for row in loaders:
            rate = _rate(row)
            if str(row.get("name", "")).startswith("gpuload") and rate is not None:
                rows[row["name"]] = {"samples_per_s": rate, "x_torch": rate / best if best else None,
                                     **({"x_torchvision_on_device": rate / on_device} if on_device else {}),
                                     **({"decode_backend": row["decode_backend"]} if row.get("decode_backend") else {})}
        if rows or best:
            numbers[f"{name}_samples_per_s"] = {
                "torch_best": best, **({"torchvision_on_device": on_device} if on_device else {}), "gpuload": rows}
    return numbers


def _guarded(read: Callable[[Path], Any], path: Path) -> Any:
    if not path.exists():
        return {"error": f"{path.name} was not written"}
    try:
        return read(path)
    except Exception as error:  # a broken file is reported, the rest of the summary stands
        return {"error": f"{path.name}: {type(error).__name__}: {error}"}


def summarize(out: Path) -> dict[str, Any]:
    """The whole summary of a device check folder."""
    summary: dict[str, Any] = {
        "folder": str(out),
        "cuda_only_lines": f"{CUDA_ONLY_LINES}: the lines only a CUDA driver runs (the CPU suite runs the rest), "
                           "each with the step or gpu test of this check that runs it",
    }
    try:
        steps = read_steps(out)
    except Exception as error:
        steps = []
        summary["steps_error"] = f"steps.tsv: {type(error).__name__}: {error}"
    summary["steps"] = {row["step"]: {k: v for k, v in row.items() if k != "step"} for row in steps}
    summary["machine"] = _guarded(machine_info, out / "machine.log")
    ran_machine = any(row["step"] == "machine" for row in steps)
    summary["doctor"] = _guarded(doctor_findings, out / "doctor.json") if ran_machine else None
    ran = {row["step"] for row in steps}
    summary["tests"] = {name: _guarded(junit_counts, out / f"{name}.xml") for name in TEST_STEPS if name in ran}
    summary["truth"] = _guarded(truth_verdicts, out / "truth") if "truth" in ran else None
    summary["prefetch"] = _guarded(prefetch_numbers, out / "prefetch.json") if "prefetch" in ran else None
    summary["timeline"] = _guarded(timeline_numbers, out / "timeline.json") if "timeline" in ran else None
    summary["bench"] = {
        name: _guarded(bench_numbers, out / name / "bench.json") for name in BENCH_STEPS if name in ran
    }
    images = summary["bench"].get("images", {})
    backends = sorted({row.get("decode_backend") for row in images.get("loaders", []) if row.get("decode_backend")})
    summary["images_decode_backends"] = backends
    summary["headline"] = headline(summary)
    tests = [counts for counts in summary["tests"].values() if "tests" in counts]
    truth = summary["truth"] if isinstance(summary["truth"], dict) and "error" not in summary["truth"] else {}
    summary["totals"] = {
        "steps": len(steps),
        "steps_passed": sum(row["status"] == "passed" for row in steps),
        "steps_not_passed": [row["step"] for row in steps if row["status"] != "passed"],
        "tests_passed": sum(c["passed"] for c in tests),
        "tests_failed": sum(c["failed"] + c["errors"] for c in tests),
        "tests_skipped": sum(c["skipped"] for c in tests),
        "truth_passed": sorted(name for name, verdict in truth.items() if verdict["passed"]),
        "truth_failed": sorted(name for name, verdict in truth.items() if not verdict["passed"]),
    }
    return summary


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    out = Path(args[0])
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
    print(json.dumps(summary["totals"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
