"""Which lines a coverage run missed that ``cuda_only_lines.md`` does not list.

The CPU suite is meant to run every line of gpuload but the CUDA-only ones listed in
``benchmarks/cuda_only_lines.md``. After a coverage run (every process counted, see the docs'
"How it is built" page) and ``coverage json``::

    python benchmarks/unlisted_misses.py coverage.json

prints the totals and each missed line that no listed range holds; exit status 1 if there is one.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

LIST = Path(__file__).resolve().parent / "cuda_only_lines.md"
_RANGE = re.compile(r"`(gpuload/[\w/]+\.py):(\d+)(?:-(\d+))?`")


def listed_lines(text: str) -> dict[str, set[int]]:
    """File -> the line numbers of every range the list names."""
    lines: dict[str, set[int]] = {}
    for path, first, last in _RANGE.findall(text):
        lines.setdefault(path, set()).update(range(int(first), int(last or first) + 1))
    return lines


def unlisted(report: dict, listed: dict[str, set[int]]) -> dict[str, list[int]]:
    """File -> missed lines of a ``coverage json`` report outside the listed ranges."""
    found = {}
    for path, data in sorted(report["files"].items()):
        missed = [n for n in data["missing_lines"] if n not in listed.get(path, set())]
        if missed:
            found[path] = missed
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python benchmarks/unlisted_misses.py COVERAGE_JSON", file=sys.stderr)
        return 2
    report = json.loads(Path(argv[0]).read_text())
    totals = report["totals"]
    found = unlisted(report, listed_lines(LIST.read_text()))
    print(f"{totals['num_statements']} statements, {totals['missing_lines']} missed "
          f"({totals['percent_covered']:.2f}% covered); missed outside {LIST.name}: "
          f"{sum(map(len, found.values()))}")
    for path, missed in found.items():
        print(f"  {path}: {', '.join(map(str, missed))}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
