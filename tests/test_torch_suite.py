"""A fast subset of torch's own DataLoader tests through ``benchmarks/torch_suite/run.py``.

The whole suite takes about 20 minutes a run on a busy 2-core machine; this runs a few tests
(sequential and shuffled batches, typing, len, collections, dicts, worker shutdown) with torch
and with gpuload swapped in globally. Skipped when torch's test file is not there (it is not
part of this repository: see the README, "torch's own tests").
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parents[1] / "benchmarks" / "torch_suite" / "run.py"
SUBSET = (
    "(TestDataLoader or TestDictDataLoader) and not Persistent and not DeviceType and "
    "(test_sequential_batch or test_shuffle_batch or test_typing or test_len "
    "or test_builtin_collection_conversion or test_partial_workers)"
)


def _harness():
    spec = importlib.util.spec_from_file_location("torch_suite_run", HARNESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict[str, dict]]:
    harness = _harness()
    if not harness.DEFAULT_SUITE.is_file():
        pytest.skip(f"torch's test_dataloader.py is not at {harness.DEFAULT_SUITE} (README: torch's own tests)")
    out = tmp_path_factory.mktemp("torch_suite")
    command = [sys.executable, str(HARNESS), "--only", "torch", "gpuload", "-k", SUBSET, "--out", str(out),
               "--timeout", "900"]
    subprocess.run(command, capture_output=True, text=True, timeout=1200, check=False)
    return {mode: harness.read_report(out / f"{mode}.jsonl") for mode in ("torch", "gpuload")}


@pytest.mark.slow
def test_the_subset_passes_for_torch_itself(results: dict[str, dict[str, dict]]) -> None:
    torch_run = results["torch"]
    assert len(torch_run) >= 10, torch_run
    assert all(entry["outcome"] == "passed" for entry in torch_run.values()), torch_run
    assert set(results["gpuload"]) == set(torch_run), "the gpuload run did not run the same tests"


@pytest.mark.slow
def test_the_subset_passes_for_gpuload_swapped_in_globally(results: dict[str, dict[str, dict]]) -> None:
    lost = _harness().regressions(results["torch"], results["gpuload"])
    assert not lost, "\n".join(f"{test}: [{outcome}] {why}" for test, outcome, why in lost)
