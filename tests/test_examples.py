"""The examples in examples/ run end to end (on the CPU here, on the GPU where there is one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_loop.py", "train_images.py"])
def test_example_runs(script: str) -> None:
    done = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "epoch 1: loss" in done.stdout
