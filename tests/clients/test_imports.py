"""``import gpuload`` (the loader, and every module it reaches) imports neither HF Accelerate nor
Transformers: they are test dependencies, reached only through ``gpuload.integrations``. A
subpackage loaded on first use that lacks a dependency says which."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import gpuload


def test_import_gpuload_imports_neither_accelerate_nor_transformers() -> None:
    code = (
        "import sys, gpuload, gpuload.loader, gpuload.elastic, gpuload.integrations\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('accelerate', 'transformers')))"
    )
    root = Path(__file__).parents[2]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert result.stdout.strip() == "[]", result.stdout


def test_a_submodule_loaded_on_first_use_names_the_dependency_it_lacks(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "needs_more.py").write_text("import gpuload_no_such_dependency\n")
    monkeypatch.setattr(gpuload, "__path__", [*gpuload.__path__, str(tmp_path)])
    with pytest.raises(ModuleNotFoundError, match="gpuload_no_such_dependency") as caught:
        gpuload.needs_more  # noqa: B018
    assert caught.value.name == "gpuload_no_such_dependency"
    with pytest.raises(AttributeError, match="module 'gpuload' has no attribute 'no_such_module'"):
        gpuload.no_such_module  # noqa: B018
