"""The documentation site (gpuload/docs/) builds in Sphinx's strict mode: any warning, a broken
link or a reference to a name that does not exist, fails the build; no network is used."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sphinx", reason="sphinx is not installed (pip install -e '.[docs]')")
pytest.importorskip("myst_parser", reason="myst-parser is not installed (pip install -e '.[docs]')")

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "gpuload" / "docs"


def _sphinx_build(source: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """``sphinx-build -E -W --keep-going -n`` (fresh, warnings are errors, nitpicky) into ``out``,
    with gpuload's own conf.py whatever the pages."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-n", "-q", "-b", "html",
                           "-c", str(DOCS), "-d", str(out / ".doctrees"), str(source), str(out / "html")],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)


def test_the_docs_build_strictly(tmp_path: Path) -> None:
    done = _sphinx_build(DOCS, tmp_path)
    assert done.returncode == 0, done.stderr[-5000:]
    html = tmp_path / "html"
    pages = {p.stem for p in DOCS.glob("*.md")}
    assert pages <= {p.stem for p in html.glob("*.html")}
    api = (html / "api.html").read_text()
    assert "set_batch_size" in api and "plan_job" in api  # the reference comes from the docstrings
    assert not (DOCS / "_build").exists()  # nothing written into the source tree


def test_a_broken_link_or_reference_fails_the_build(tmp_path: Path) -> None:
    """One build of a page with each kind of fault: each is a warning, and -W makes any warning
    fail the build (a build starts Sphinx and imports gpuload: seconds each)."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "index.md").write_text("# Index\n\nSee [the cache](caching.md).\n\n```{eval-rst}\n"
                                     ".. autofunction:: gpuload.plan_job\n\n"
                                     "See :class:`gpuload.NoSuchLoader`, :class:`gpuload_no_such_package.Loader` "
                                     "and :ref:`no-such-label`.\n```\n")
    done = _sphinx_build(source, tmp_path / "out")
    assert done.returncode != 0, done.stderr[-3000:]
    warned = [line for line in done.stderr.splitlines() if "WARNING" in line]
    for name in ("caching.md", "gpuload.NoSuchLoader", "gpuload_no_such_package.Loader", "no-such-label"):
        assert any(name in line for line in warned), (name, done.stderr[-3000:])  # a warning each, so each fails


def test_the_docs_folder_is_no_python_package() -> None:
    """gpuload/docs/ holds pages and Sphinx's conf.py: no ``__init__.py`` (pkgutil, which
    tests/conftest.py walks gpuload with, does not enter it) and excluded from the wheel's packages
    (setuptools' pyproject discovery takes namespace folders too)."""
    import pkgutil

    import tomllib
    from setuptools import find_namespace_packages

    import gpuload

    assert not (DOCS / "__init__.py").exists()
    # pyproject's packages.find, as setuptools applies it (namespaces=true: folders without __init__.py too)
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    shipped = find_namespace_packages(str(ROOT), include=found["include"], exclude=found.get("exclude", ()))
    assert "gpuload" in shipped and "gpuload.cli" in shipped
    assert not any(name.startswith("gpuload.docs") for name in shipped), shipped
    assert not any(info.name.startswith("gpuload.docs") for info in pkgutil.walk_packages(gpuload.__path__, "gpuload."))


def test_every_environment_variable_gpuload_reads_is_in_the_configuration_page() -> None:
    """Each ``"GPULOAD_..."`` string in gpuload's code is a variable it reads (or, for
    GPULOAD_OPTIONS, the name of a Python constant in ``__all__``): each has a row there."""
    import re

    names = set()
    for path in (ROOT / "gpuload").rglob("*.py"):
        names |= set(re.findall(r"[\"'](GPULOAD_[A-Z0-9_]+)[\"']", path.read_text()))
    names.discard("GPULOAD_OPTIONS")  # gpuload.integrations.accelerate.GPULOAD_OPTIONS, a tuple of option names
    page = (DOCS / "configuration.md").read_text()
    rows = set(re.findall(r"^\| `(GPULOAD_[A-Z0-9_]+)` \|", page, flags=re.MULTILINE))
    assert names and names == rows, f"read but not documented: {names - rows}; documented but not read: {rows - names}"
