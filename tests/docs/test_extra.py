"""The ``docs`` extra installs everything the API reference imports: autodoc imports each module
``api.md`` documents, and a module whose package the extra lacks fails the README's docs build."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - python 3.10 only
    import tomli as tomllib

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]

# Imports every module api.md documents (the longest importable prefix of each name, as autodoc
# does) with every top-level package the docs extra does not bring hidden (a module that only
# tries one, as torch tries dill, imports without it), and prints the hidden packages an import
# failed on.
_IMPORT_DOCUMENTED = """
import importlib, json, sys
hidden = set(json.loads(sys.argv[2]))
sys.modules.update(dict.fromkeys(hidden))  # None: import fails, importlib.util.find_spec says absent
failed = set()
for name in json.loads(sys.argv[1]):
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            importlib.import_module(".".join(parts[:cut]))
            break
        except ImportError as error:
            if getattr(error, "name", None) in hidden:
                failed.add(error.name)
                break
            if cut == 1:
                raise
print(json.dumps(sorted(failed)))
"""


def _documented() -> list[str]:
    text = (ROOT / "gpuload" / "docs" / "api.md").read_text()
    return re.findall(r"^\.\. auto(?:module|class|function|data|exception)::\s*(\S+)", text, re.MULTILINE)


def _installed_by(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` bring, with their own requirements (as installed here)."""
    environment = {**default_environment(), "extra": ""}
    wanted = [Requirement(r) for r in requirements]
    found: set[str] = set()
    while wanted:
        requirement = wanted.pop()
        name = canonicalize_name(requirement.name)
        if name in found or (requirement.marker and not requirement.marker.evaluate(environment)):
            continue
        found.add(name)
        try:
            wanted.extend(Requirement(r) for r in metadata.requires(requirement.name) or [])
        except metadata.PackageNotFoundError:
            continue
    return found


def test_the_docs_extra_brings_every_package_the_api_reference_imports() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    brought = _installed_by([*project["dependencies"], *project["optional-dependencies"]["docs"]])
    documented = _documented()
    assert "gpuload.integrations.accelerate" in documented  # the parse found api.md's directives
    packages = metadata.packages_distributions()
    not_brought = sorted(module for module, distributions in packages.items()
                         if module not in sys.stdlib_module_names and module != "gpuload"
                         and not {canonicalize_name(d) for d in distributions} & brought)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _IMPORT_DOCUMENTED, json.dumps(documented), json.dumps(not_brought)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    missing = {module: packages[module] for module in json.loads(done.stdout.splitlines()[-1])}
    assert not missing, f"api.md's modules import packages the docs extra does not install: {missing}"
