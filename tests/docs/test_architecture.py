"""The structural claims of ``gpuload/docs/architecture.md`` against the code: its module table
names every module of the package once, its table of who touches CUDA, DALI and CuPy says
exactly what each module's source does (read with ``ast``, imports inside functions included),
and the names its Words retired stay out of the code."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "gpuload" / "docs" / "architecture.md"

#: ``torch.cuda`` names that order work on streams; ``OutOfMemoryError`` is caught; any other
#: name (or ``torch.cuda`` itself, passed around) asks or changes the device's state.
STREAMS = {"Stream", "Event", "stream", "current_stream", "synchronize", "_sleep"}
OOM = {"OutOfMemoryError"}


def package_modules() -> list[str]:
    """Every module of the package as the page writes it, the docs' Sphinx config excluded."""
    return sorted(str(path.relative_to(ROOT)) for path in (ROOT / "gpuload").rglob("*.py")
                  if "docs" not in path.relative_to(ROOT).parts)


def table_rows(heading: str) -> list[list[str]]:
    """The cells of the table under ``## heading``, header and rule left out."""
    section = PAGE.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def _module_name(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [f"{node.module}.{alias.name}" for alias in node.names]
    if (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return [node.args[0].value]
    return []


def uses(source: str) -> set[str]:
    """What a module's source does of ``probes``, ``streams``, ``oom``, ``dali``, ``cupy``."""
    found: set[str] = set()
    tree = ast.parse(source)
    attributes = set()  # the Attribute nodes that are ``torch.cuda.<name>``'s inner ``torch.cuda``
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "cuda" and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "torch"):
            attributes.add(id(node.value))
            found.add("streams" if node.attr in STREAMS else "oom" if node.attr in OOM else "probes")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name)
                and node.value.id == "torch" and id(node) not in attributes):
            found.add("probes")  # torch.cuda itself, handed to something
        for name in _module_name(node):
            if name == "torch.cuda" or name.startswith("torch.cuda."):
                leaf = name.rpartition(".")[2]
                found.add("streams" if leaf in STREAMS else "oom" if leaf in OOM else "probes")
            elif name == "nvidia.dali" or name.startswith("nvidia.dali."):
                found.add("dali")
            elif name == "cupy" or name.startswith("cupy."):
                found.add("cupy")
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "CDLL"
                and node.args and isinstance(node.args[0], ast.Constant) and "libcuda" in str(node.args[0].value)):
            found.add("probes")
    return found


def test_the_module_table_names_every_module_once() -> None:
    listed = [row[0].strip("`") for row in table_rows("Modules")]
    assert all(job for _, job in table_rows("Modules")), "a module's job is empty"
    duplicated = sorted({module for module in listed if listed.count(module) > 1})
    actual = package_modules()
    missing = sorted(set(actual) - set(listed))
    gone = sorted(set(listed) - set(actual))
    assert (missing, gone, duplicated) == ([], [], []), (
        f"architecture.md's module table: add a row for {missing}, remove {gone}, once each {duplicated}")
    assert listed == sorted(listed), "keep the module table in path order"


def test_the_cuda_dali_cupy_table_says_what_each_module_does() -> None:
    listed = {row[0].strip("`"): {word.strip() for word in row[1].split(",")} for row in
              table_rows("Who touches CUDA, DALI and CuPy")}
    actual = {module: found for module in package_modules() if (found := uses((ROOT / module).read_text()))}
    assert listed == actual, "architecture.md's CUDA/DALI/CuPy table against the code: " + "; ".join(
        f"{module}: page says {sorted(listed.get(module, ()))}, code does {sorted(actual.get(module, ()))}"
        for module in sorted(set(listed) | set(actual)) if listed.get(module) != actual.get(module))


def test_the_page_says_device_py_is_the_loader_s_place_for_cuda_and_dali_cupy_are_lazy() -> None:
    """The claims in prose the tables back: no module imports DALI or CuPy at its top level."""
    for module in package_modules():
        tree = ast.parse((ROOT / module).read_text())
        top = [name for node in tree.body for name in _module_name(node)]
        assert not [name for name in top if name.split(".")[0] == "cupy" or name.startswith("nvidia.dali")], module


@pytest.mark.parametrize(("source", "expected"), [
    ("import torch\ntorch.cuda.mem_get_info(0)", {"probes"}),
    ("import torch\ntorch.cuda.Event().record()", {"streams"}),
    ("import torch\ntry:\n    pass\nexcept torch.cuda.OutOfMemoryError:\n    pass", {"oom"}),
    ("import torch\nf(torch.cuda)", {"probes"}),
    ("from torch.cuda import current_stream", {"streams"}),
    ("from torch import cuda", {"probes"}),
    ("def f():\n    import cupy", {"cupy"}),
    ("def f():\n    from cupy.cuda import nvrtc", {"cupy"}),
    ("import importlib\nimportlib.import_module('cupy')", {"cupy"}),
    ("def f():\n    import nvidia.dali.fn as fn", {"dali"}),
    ("from nvidia.dali import pipeline_def", {"dali"}),
    ("import ctypes\nctypes.CDLL('libcuda.so.1')", {"probes"}),
    ("import torch\nx = torch.device('cuda')\ny = x.type == 'cuda'", set()),
])
def test_the_reader_sees_each_kind_of_use(source: str, expected: set[str]) -> None:
    assert uses(source) == expected


# vocab: keep-start (the rename script leaves the old names below as they are)
#: Any name with these in it says "shard" for the split over ranks (the page's "Words": a split,
#: a rank's share; "shard" is the token files' word, and Accelerate's).
RETIRED_PATTERN = re.compile(r"sharded|shardable", re.IGNORECASE)
KEEP = "vocab: keep"


def retired_names() -> set[str]:
    """The names in the last column of the page's "Words" table."""
    section = PAGE.read_text().split("\n## Words\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    return {name for row in rows[1:] for name in re.findall(r"`([A-Za-z_]\w*)`", row.strip().strip("|").split("|")[-1])}


def retired_in(source: str, retired: set[str]) -> list[tuple[int, str]]:
    """Each (line, name) of ``source`` that is a retired name or says "sharded"/"shardable", in
    the code and in f-strings' fields, not in plain strings and comments (public strings such as
    ``"sharded-node"`` stay), and not on a line marked ``vocab: keep``."""
    lines = source.splitlines()
    found = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME:
            names = [token.string]
        elif token.type == tokenize.STRING and re.match(r"[rRbB]*[fF]", token.string):
            fields = re.findall(r"\{([^{}]*)\}", token.string)
            code = [re.sub(r"'[^']*'|\"[^\"]*\"", "", field) for field in fields]  # a key in a field is a string
            names = [name for field in code for name in re.findall(r"[A-Za-z_]\w*", field)]
        else:
            continue
        for name in names:
            if (name in retired or RETIRED_PATTERN.search(name)) and KEEP not in lines[token.start[0] - 1]:
                found.append((token.start[0], name))
    return found


def test_the_words_page_s_retired_names_stay_out_of_the_code() -> None:
    retired = retired_names()
    assert {"ShardedStore", "ImageSource", "SampleCache", "shard_bytes"} <= retired, "the Words table was not read"
    found = []
    for top in ("gpuload", "tests", "benchmarks", "examples"):
        for path in sorted((ROOT / top).rglob("*.py")):
            where = path.relative_to(ROOT)
            if RETIRED_PATTERN.search(str(where)):
                found.append(f"{where}: its name")
            found += [f"{where}:{line}: {name}" for line, name in retired_in(path.read_text(), retired)]
    assert not found, (f"{len(found)} names the page's Words retired are back (its table says the word to use): "
                       + ", ".join(found[:40]))


@pytest.mark.parametrize(("source", "expected"), [
    ("x = ShardedStore()", [(1, "ShardedStore")]),
    ("def _sharded_by(a): pass", [(1, "_sharded_by")]),
    ("y = f'{store.shard_bytes} bytes'", [(1, "shard_bytes")]),
    ("y = f\"{stats['shard_bytes'] / 2**20:.1f} MiB\"", []),
    ("z = {'shard_bytes': 1, 'path': 'sharded-node'}  # a sharded cache", []),
    ("ImageSource = ImageFiles  # vocab: keep (the public alias)", []),
    ("shards = write_shard(path)", []),
])
def test_the_words_check_reads_names_not_strings(source: str, expected: list[tuple[int, str]]) -> None:
    assert retired_in(source, {"ShardedStore", "shard_bytes", "ImageSource"}) == expected
# vocab: keep-end
