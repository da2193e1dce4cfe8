"""Without DALI (the device check's image has none), the tests that need it skip saying so, and
everything else passes. Each case runs pytest in a child process whose ``import nvidia.dali``
fails, as on a machine where it is not installed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from child_processes import Child, child_environment

ROOT = Path(__file__).resolve().parents[2]
NEEDS_DALI = [
    "tests/decode/test_batch.py::test_mixed_decoder_matches_pil_on_every_kind",
    "tests/decode/test_batch.py::test_mixed_decoder_reports_bad_files_and_keeps_the_rest",
    "tests/sources/test_images_background.py::test_on_cuda_batches_are_decoded_and_transformed_ahead_on_the_side_stream",
]
REASON = "needs nvidia.dali (DALI), which is not installed here"


def run_pytest_without_dali(args: list[str], pretend_cuda: bool, logs: Path) -> subprocess.CompletedProcess[str]:
    """pytest ``args`` in a child where DALI cannot be imported (and, with ``pretend_cuda``,
    torch says a CUDA device is there, as on the device image), forked from the suite's fork
    server (torch imported once: seconds of CPU a fresh interpreter spends on it), which has not
    imported DALI."""
    code = (
        "import sys\n"
        "assert 'nvidia.dali' not in sys.modules, 'the fork server imported DALI'\n"
        "sys.modules['nvidia.dali'] = None  # import nvidia.dali fails, find_spec says it is absent\n"
        + ("import torch\ntorch.cuda.is_available = lambda: True\n" if pretend_cuda else "")
        + "import pytest\n"
        f"sys.exit(pytest.main({['-q', '-rs', '-p', 'no:cacheprovider', *args]!r}))\n"
    )
    child = Child([], child_environment(), logs, "pytest", code=code, cwd=ROOT)
    status = child.wait(900)
    return subprocess.CompletedProcess(args, status, child.out.read_text(), child.err.read_text())


def test_on_a_gpu_without_dali_the_dali_gpu_tests_skip_saying_why(tmp_path: Path) -> None:
    result = run_pytest_without_dali(NEEDS_DALI, pretend_cuda=True, logs=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 skipped" in result.stdout and "passed" not in result.stdout, result.stdout
    assert result.stdout.count(REASON) == 3, result.stdout


@pytest.mark.slow
def test_without_dali_the_decode_tests_pass_or_skip_saying_why(tmp_path: Path) -> None:
    result = run_pytest_without_dali(["tests/decode/test_batch.py", "tests/decode/test_stderr.py",
                                      "tests/decode/test_dali.py"], pretend_cuda=False, logs=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert REASON in result.stdout and " failed" not in result.stdout, result.stdout[-3000:]
