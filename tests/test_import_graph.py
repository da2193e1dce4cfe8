"""gpuload has no import cycle, also none hidden inside a function (the design's layering: a module
never imports, even late, one that imports it). The graph is read with ``ast``: every ``import``
and ``from ... import`` of a gpuload module, at module level, in class bodies and in functions;
those under ``if TYPE_CHECKING:`` never run and are left out, as are names the lazy loader
(``gpuload/lazy.py``) imports by a table at run time."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_modules(root: Path) -> dict[str, Path]:
    """Each module of the ``gpuload`` package under ``root`` by dotted name (the docs' Sphinx
    config left out): ``gpuload/cache/__init__.py`` is ``gpuload.cache``."""
    modules = {}
    for path in sorted((root / "gpuload").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if "docs" in parts:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported(node: ast.AST, package: str) -> Iterator[str]:
    """The dotted names ``node`` imports (``from a import b`` names ``a.b``: b may be a module)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from the package, one level up per dot after the first
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        yield from (f"{base}.{alias.name}" for alias in node.names)


def _runnable(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (its ``else`` kept)."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            for other in child.orelse:
                yield other
                yield from _runnable(other)
            continue
        yield child
        yield from _runnable(child)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the gpuload modules it imports (anywhere in its source, as above)."""
    modules = package_modules(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runnable(ast.parse(path.read_text(), str(path))):
            for target in _imported(node, package):
                while target and target not in modules:  # `from a import name`: the module a
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def test_gpuload_has_no_import_cycle_even_inside_functions() -> None:
    graph = import_graph(ROOT)
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # the whole package was read
    assert cycles(graph) == [], "modules that import each other (directly or around a circle)"


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in {"gpuload/__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_cycle_through_a_function_a_package_or_a_relative_import_is_found(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "gpuload/a.py": "import gpuload.b\n",
        "gpuload/b.py": "def late():\n    from gpuload.a import name\n",
        "gpuload/p/__init__.py": "from gpuload.p.one import X\n",
        "gpuload/p/one.py": "from . import two\n",
        "gpuload/p/two.py": "from gpuload.p import X\n",
        "gpuload/t.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import gpuload.u\n",
        "gpuload/u.py": "import gpuload.t\n",
    })
    assert cycles(import_graph(root)) == [["gpuload.a", "gpuload.b"],
                                          ["gpuload.p", "gpuload.p.one", "gpuload.p.two"]]
