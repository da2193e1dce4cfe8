"""``benchmarks/unlisted_misses.py``: a coverage run's missed lines against the CUDA-only list."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "unlisted_misses.py"


def report(missing: dict[str, list[int]]) -> dict:
    return {"files": {path: {"missing_lines": lines} for path, lines in missing.items()},
            "totals": {"num_statements": 100, "missing_lines": sum(map(len, missing.values())),
                       "percent_covered": 97.0}}


def run(tmp_path: Path, missing: dict[str, list[int]]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "coverage.json"
    path.write_text(json.dumps(report(missing)))
    return subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, timeout=60,
                          check=False)


def test_misses_inside_listed_ranges_pass_and_one_outside_is_named(tmp_path: Path) -> None:
    # gpuload/bench/ceilings.py:10-20 is listed (`_copy_gbps`); line 5 of it is not.
    inside = run(tmp_path, {"gpuload/bench/ceilings.py": [10, 15, 20]})
    assert inside.returncode == 0, inside.stdout + inside.stderr
    assert "missed outside cuda_only_lines.md: 0" in inside.stdout
    outside = run(tmp_path, {"gpuload/bench/ceilings.py": [5, 10], "gpuload/loader.py": [1]})
    assert outside.returncode == 1
    assert "missed outside cuda_only_lines.md: 2" in outside.stdout
    assert "gpuload/bench/ceilings.py: 5" in outside.stdout and "gpuload/loader.py: 1" in outside.stdout


def test_a_wrong_call_says_how_to_call_it() -> None:
    called = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60, check=False)
    assert called.returncode == 2 and "usage" in called.stderr
