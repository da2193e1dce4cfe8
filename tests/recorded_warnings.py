"""Recording every warning a block raises, less those the project's pytest configuration
ignores (shared by tests): ``simplefilter("always")`` would otherwise bring back what
pyproject.toml's ``filterwarnings`` ignores, and processes a test spawns never saw those
filters (pytest applies them in its own process only)."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own TOML reader
    import tomli as tomllib

PYPROJECT = Path(__file__).parent.parent / "pyproject.toml"


def project_filters() -> list[str]:
    """pyproject.toml's ``[tool.pytest.ini_options] filterwarnings``, in its order."""
    options = tomllib.loads(PYPROJECT.read_text())["tool"]["pytest"]["ini_options"]
    return list(options.get("filterwarnings", []))


def _category(name: str) -> type[Warning]:
    module, _, attribute = name.rpartition(".")
    return getattr(importlib.import_module(module or "builtins"), attribute)


def apply_project_filters() -> None:
    """Install the project's filters in this process, with the precedence pytest gives them
    (a later entry wins)."""
    for spec in project_filters():
        action, message, category, module, *_ = [*spec.split(":", 4), "", "", "", ""]
        warnings.filterwarnings(action or "default", message=message, category=_category(category or "Warning"),
                                module=module)


@contextmanager
def recorded_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Every warning raised inside (each time, not once per place) but those the project ignores."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_project_filters()
        yield caught
