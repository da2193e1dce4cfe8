"""``import gpuload`` (the loader, and every module it reaches) imports neither HF Accelerate nor
Transformers: they are test dependencies, reached only through ``gpuload.integrations``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_import_gpuload_imports_neither_accelerate_nor_transformers() -> None:
    code = (
        "import sys, gpuload, gpuload.loader, gpuload.elastic, gpuload.integrations\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('accelerate', 'transformers')))"
    )
    root = Path(__file__).parents[2]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert result.stdout.strip() == "[]", result.stdout
