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
@pytest.mark.parametrize("script", sorted(path.name for path in EXAMPLES.glob("*.py")))
def test_example_runs(script: str) -> None:
    done = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert EXPECTED.get(script, "") in done.stdout and done.stdout.strip()
