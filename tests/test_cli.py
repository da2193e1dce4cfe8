"""The gpuload command runs end to end on the CPU, and CI runs the README's test command."""

from __future__ import annotations

import json
import re
from pathlib import Path

from gpuload.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_bench_quick_prints_table_and_writes_json(tmp_path: Path, capsys) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--samples", "2048", "--epochs", "1", "--device", "cpu", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "torch DataLoader (num_workers=0)" in printed and "% of ideal" in printed
    document = json.loads(out.read_text())
    names = [r["name"] for r in document["results"]]
    assert names[0].startswith("torch DataLoader") and names[-1].startswith("ideal")
    assert any(name.startswith("gpuload DataLoader") for name in names)
    assert all(r["samples_per_s"] > 0 for r in document["results"])
    assert document["config"]["num_samples"] == 2048 and document["environment"]["device"] == "cpu"


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.+?)\n```", readme)
    assert len(commands) >= 2
    ci_script = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci_script.splitlines()
