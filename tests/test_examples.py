"""The examples in examples/ run end to end (on the CPU here, on the GPU where there is one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


# What each example prints when it did its job; an example not listed must exit 0 and print.
EXPECTED = {"train_loop.py": "epoch 1: loss", "train_images.py": "epoch 1: loss", "resume.py": "resumed exactly: True"}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py") if p.name != "plan_job.py"))
def test_example_runs(script: str) -> None:
    done = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert EXPECTED.get(script, "") in done.stdout and done.stdout.strip()


def _run_plan_example(*args: str) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLES / "plan_job.py"), *args], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "job plan for a pretended 80.00 GiB card" in done.stdout
    assert "batch size: 256 (your batch size)" in done.stdout and "(largest that fits, a multiple of 8)" in done.stdout
    assert "whole dataset cached" in done.stdout
    return done.stdout


def test_plan_job_example_with_its_own_model() -> None:
    assert "a small CNN (defined in this example)" in _run_plan_example("--small")


@pytest.mark.slow
def test_plan_job_example_with_resnet50_when_torchvision_is_installed() -> None:
    pytest.importorskip("torchvision", reason="torchvision is not installed: the example plans its own model")
    assert "torchvision ResNet-50" in _run_plan_example()
