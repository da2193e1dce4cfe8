"""Sphinx configuration of gpuload's documentation (Markdown pages through MyST, the API
reference from the docstrings through autodoc).

Build, strictly (a broken link or reference fails it; tests/test_docs.py runs this)::

    python -m sphinx -W --keep-going -n -b html gpuload/docs docs-html

This folder is not a Python package (no ``__init__.py``): nothing here is importable as
``gpuload.docs`` or shipped in the wheel as a module.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # autodoc documents this tree's gpuload, not an installed one

project = "gpuload"
author = "the gpuload authors"
copyright = "the gpuload authors"  # noqa: A001 (Sphinx's name)

extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links, checked like any other reference

nitpicky = True
# No network at build time, so no intersphinx inventories: names from other packages (torch,
# numpy, the standard library's typing helpers) cannot resolve and are not gpuload's to check.
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|numpy|np|collections|typing|typing_extensions|os|pathlib|concurrent|threading|"
               r"accelerate|transformers|PIL|enum|abc|dataclasses|types|io|contextlib|queue)(\..*)?"),
    (r"py:.*", r"(Any|Callable|Iterable|Iterator|Mapping|Sequence|Generator|Literal|Self|TypeVar|"
               r"Path|Tensor|Dataset|Sampler|Generic|NamedTuple|int|float|str|bool|bytes|dict|list|tuple|"
               r"object|type|None|Exception|RuntimeError|ValueError|TypeError|Warning|UserWarning|"
               r"RuntimeWarning|OSError|T|T_co|_T|Protocol)"),
    # Type aliases (a Union under a name): autodoc prints the name, which is no class to link to.
    (r"py:.*", r"(gpuload\.\w+(\.\w+)*\.)?(ArrayLike|TokenSource|MaxPixels|T|T_co|tud\.\w+)"),
]

autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_mock_imports: list[str] = []

html_theme = "furo"
html_title = "gpuload"


def _find(path: str) -> bool:
    """Whether ``path`` (``pkg.module.Name.attr``) names an object that exists."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                found = getattr(found, name)
        except AttributeError:
            return False
        return True
    return False


def _unlinked_if_it_exists(app, env, node, contnode):  # noqa: ANN001 (Sphinx's event signature)
    """A reference to one of gpuload's internal objects (a class in a signature, a helper a
    docstring names) that the API reference leaves out is shown unlinked, but only when the
    object exists: looked up as written, then in the module and class the reference is made
    from. A misspelt or removed name still fails the strict build."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    module, cls = node.get("py:module"), node.get("py:class")
    candidates = [target]
    if module:
        candidates += [f"{module}.{cls}.{target}" if cls else None, f"{module}.{target}"]
    if any(c and c.startswith("gpuload") and _find(c) for c in candidates):
        return contnode
    # A type hint of a function documented under its public name (gpuload.plan_job): the name
    # is defined in one of gpuload's modules.
    if "." not in target and any(name.startswith("gpuload") and hasattr(mod, target)
                                 for name, mod in list(sys.modules.items())):
        return contnode
    return None


def setup(app):  # noqa: ANN001
    app.connect("missing-reference", _unlinked_if_it_exists)
