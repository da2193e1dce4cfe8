"""Every code block of README.md and gpuload/docs/*.md runs here, so no example can go false
unnoticed. Each test's id is the block's ``file:line``.

- ``python`` blocks are executed in a fresh namespace, in a temporary working directory, after
  the prelude below (``dataset``, ``model``, ``images_uint8``, ... of a few kilobytes), so a
  snippet can stay as short as the page wants it.
- ``console`` blocks run each ``$ command`` line (``gpuload`` in this process, ``python`` this
  interpreter in a new one) and check the output shown under it: each shown line, in order, must start a
  line of the real output (a trailing ``...`` marks a line shortened).
- ``bash``/``sh`` blocks run each line as a command, as console blocks do, without output.
- ``toml`` blocks must parse.
- ``text`` blocks are outputs shown for reading: they must be marked ``illustrative``.

A block's marker is an HTML comment on the line just above its fence, invisible on the page:
``<!-- test: gpu (why) -->``, ``<!-- test: skip (why) -->``, ``<!-- test: processes (why) -->``
(several processes: skipped here with the reason, naming the test that runs it),
``<!-- test: run-by tests/PATH.py (why) -->`` (that test runs this exact text: it must name the
page), ``<!-- test: setup=images -->`` / ``setup=tokens`` (more prelude), ``<!-- test: slow -->``,
``<!-- test: illustrative (why) -->``, ``<!-- test: with-file=gpuload.toml -->`` (the page's
toml block above, saved under that name), combined with ``;``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib
import torch

import gpuload

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "gpuload" / "docs").glob("**/*.md"))]
RUN = {"python", "console", "bash", "sh", "shell", "toml", "text"}

# What every python block may use without defining it: small, made in a second.
PRELUDE = """
import os
import torch
from torch import nn
from torch.utils.data import TensorDataset
import gpuload
from gpuload import transforms as T

torch.manual_seed(0)
images_uint8 = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8)
labels = torch.randint(0, 10, (64,))
dataset = TensorDataset(images_uint8.float().div(255), labels)
mean, std = (0.49, 0.48, 0.45), (0.25, 0.24, 0.26)
model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
epochs = 2
"""
SETUPS = {
    "images": """
from gpuload.datasets.images import make_sample_image_folder
make_sample_image_folder("data/train", num_images=8, num_classes=2, seed=0)
""",
    "tokens": """
import numpy as np
from gpuload.datasets.tokens import write_shard
os.makedirs("data", exist_ok=True)
for shard in range(2):
    write_shard(f"data/fineweb_train_{shard:03d}.bin", np.random.default_rng(shard).integers(0, 50257, 40_000))
""",
}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    text: str
    marks: dict[str, str]

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _marks(comment: str) -> dict[str, str]:
    """``<!-- test: gpu (why); setup=images -->`` -> {"gpu": "why", "setup": "images"}."""
    found = re.fullmatch(r"<!--\s*test:\s*(.*?)\s*-->", comment.strip())
    if not found:
        return {}
    marks = {}
    for part in filter(None, (p.strip() for p in found.group(1).split(";"))):
        key, value = re.match(r"([\w-]+)\s*=?\s*(.*)", part).groups()
        marks[key] = value.strip().removeprefix("(").removesuffix(")")
    return marks


def code_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks, at = [], 0
    while at < len(lines):
        fence = re.match(r"^(```+)(.*)$", lines[at])
        if not fence:
            at += 1
            continue
        end = next(i for i in range(at + 1, len(lines)) if lines[i].startswith(fence.group(1)))
        language = fence.group(2).strip().split(" ")[0]
        if not language.startswith("{"):  # a MyST directive (toctree, eval-rst) is no code block
            marks = _marks(lines[at - 1]) if at else {}
            blocks.append(Block(page, at + 1, language, "\n".join(lines[at + 1:end]) + "\n", marks))
        at = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in code_blocks(page)]


def test_every_block_says_its_language_and_every_shown_output_is_marked() -> None:
    unnamed = [b.id for b in BLOCKS if b.language not in RUN]
    assert not unnamed, f"code blocks without a language this test runs ({sorted(RUN)}): {unnamed}"
    unmarked = [b.id for b in BLOCKS if b.language == "text" and "illustrative" not in b.marks]
    assert not unmarked, f"text blocks (outputs) not marked <!-- test: illustrative (why) -->: {unmarked}"


def _commands(block: Block) -> list[tuple[str, list[str]]]:
    """(command, the output lines shown under it) of a console block; bash: each line, no output."""
    lines = block.text.splitlines()
    found: list[tuple[str, list[str]]] = []
    at = 0
    while at < len(lines):
        line = lines[at]
        if block.language == "console" and not line.startswith("$ "):
            found[-1][1].append(line) if found else None
            at += 1
            continue
        command = line.removeprefix("$ ")
        while command.rstrip().endswith("\\"):
            at += 1
            command = command.rstrip()[:-1].rstrip() + " " + lines[at].strip()
        command = re.sub(r"\s#\s.*$", "", command).strip()  # a trailing comment
        if command:
            found.append((command, []))
        at += 1
    return found


def _run_gpuload(argv: list[str], command: str) -> str:
    """``gpuload ARGV`` in this process, where torch is imported already (seconds of CPU a command
    in a new one): its exit status and stdout, as a shell would see them. tests/cli/ checks the
    command's own process (torch not imported, the exit status of each error)."""
    from gpuload.cli.main import main

    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
    assert code in (0, None), f"{command}\nexit {code}\n{printed.getvalue()[-3000:]}\n{errors.getvalue()[-3000:]}"
    return printed.getvalue()


def _run_command(command: str, cwd: Path) -> str:
    argv = shlex.split(command)
    if argv[0] == "gpuload":
        return _run_gpuload(argv[1:], command)
    if argv[0] in ("python", "python3"):
        argv = [sys.executable, *argv[1:]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("GPULOAD_CONFIG", None)
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command}\nexit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _check_output(command: str, shown: list[str], printed: str) -> None:
    """Each shown line, in order, starts a printed line (``...`` at its end: shortened)."""
    out = [line.rstrip() for line in printed.splitlines()]
    at = 0
    for want in (s.rstrip() for s in shown):
        want = want.removesuffix("...").rstrip()
        if not want:
            continue
        while at < len(out) and not out[at].startswith(want):
            at += 1
        assert at < len(out), f"{command}: the shown line {want!r} is not in the output (in order):\n{printed}"
        at += 1


def _setup(block: Block, cwd: Path) -> dict[str, object]:
    namespace: dict[str, object] = {"__name__": "__docs__"}
    exec(compile(PRELUDE, "<prelude>", "exec"), namespace)
    for name in filter(None, block.marks.get("setup", "").split(",")):
        exec(compile(SETUPS[name.strip()], f"<setup {name}>", "exec"), namespace)
    return namespace


def _params() -> list[object]:
    params = []
    for block in BLOCKS:
        marks = []
        if "slow" in block.marks:
            marks.append(pytest.mark.slow)
        if "gpu" in block.marks:
            marks.append(pytest.mark.gpu)
        params.append(pytest.param(block, id=block.id, marks=marks))
    return params


@pytest.mark.parametrize("block", _params())
def test_code_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marks = block.marks
    if "skip" in marks:
        pytest.skip(f"not run: {marks['skip']}")
    if "processes" in marks:
        pytest.skip(f"several processes: {marks['processes']}")
    if "run-by" in marks:
        runner = ROOT / marks["run-by"].split()[0]
        assert runner.is_file(), f"{block.id}: run-by names {runner}, which does not exist"
        assert block.page.name in runner.read_text(), f"{runner} does not read {block.page.name}"
        pytest.skip(f"run exactly by {marks['run-by']}")
    if "gpu" in marks and not torch.cuda.is_available():
        pytest.skip(f"needs a CUDA device ({marks['gpu']}): torch.cuda.is_available() is False here")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GPULOAD_CONFIG", raising=False)
    if block.language == "toml":
        tomllib.loads(block.text)
    elif block.language == "text":
        pass  # an output shown for reading, marked illustrative (checked above)
    elif block.language == "python":
        namespace = _setup(block, tmp_path)
        try:
            exec(compile(block.text, block.id, "exec"), namespace)
        finally:
            for value in list(namespace.values()):  # loaders the block made: threads and memory back
                if isinstance(value, gpuload.DataLoader):
                    value.close()
    else:
        if "setup" in marks:
            _setup(block, tmp_path)
        if "with-file" in marks:  # the page's toml block above this one, saved under that name
            [toml] = [b for b in BLOCKS if b.page == block.page and b.language == "toml" and b.line < block.line][-1:]
            (tmp_path / marks["with-file"].split()[0]).write_text(toml.text)
        for command, shown in _commands(block):
            printed = _run_command(command, tmp_path)
            if "illustrative" not in marks:
                _check_output(command, shown, printed)



def test_the_collector_reads_markers_commands_and_checks_shown_output(tmp_path: Path) -> None:
    """The collector itself: a marker's keys, a console block's commands with their shown
    output, and an output check that fails on a line the command did not print."""
    page = tmp_path / "page.md"
    page.write_text("text\n<!-- test: gpu (a device); setup=images -->\n```python\nx = 1\n```\n\n"
                    "```console\n$ gpuload plan \\\n    --synthetic cifar   # a comment\ncache plan: ...\n```\n")
    python, console = code_blocks(page)
    assert (python.line, python.language, python.text) == (3, "python", "x = 1\n")
    assert python.marks == {"gpu": "a device", "setup": "images"} and console.marks == {}
    assert _commands(console) == [("gpuload plan --synthetic cifar", ["cache plan: ..."])]
    _check_output("c", ["cache plan: ...", "  dataset: 5"], "cache plan: device\n  dataset: 50000 samples\n")
    with pytest.raises(AssertionError, match="is not in the output"):
        _check_output("c", ["  dataset: 5", "cache plan:"], "cache plan: device\n  dataset: 50000 samples\n")
