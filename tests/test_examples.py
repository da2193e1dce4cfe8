"""The examples in examples/ run end to end (on the CPU here, on the GPU where there is one)."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from child_processes import start_script

import gpuload

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
HANG_S = 1200  # an example takes seconds quiet, minutes at load 10: past this it hangs


# What each example prints when it did its job; an example not listed must exit 0 and print.
# The GPT examples, run as documented, stop in the middle of epoch 1 (a preemption) and resume.
STOPPED_MID_EPOCH_1 = r"stopped after step \d+ \(epoch 1, batch [1-9]\d*\)"
EXPECTED = {"train_loop.py": ["epoch 1: loss"], "train_images.py": ["epoch 1: loss"],
            "resume.py": ["resumed exactly: True"],
            "ddp_train.py": ["epoch 1: loss"],  # ddp_train.py without torchrun: a job of one process
            "train_gpt_tokens.py": [STOPPED_MID_EPOCH_1, "resumed with the same losses: True"],
            "train_gpt_packed.py": [STOPPED_MID_EPOCH_1, "resumed with the same losses: True",
                                    "a document's logits ignore the other documents of its row: True"],
            "train_hf_dataset.py": [r"same batches as torch's DataLoader: True \(gpuload's path: device-gather"]}


def run_example(script: str, *args: str, env: dict[str, str] | None = None,
                out_dir: Path) -> subprocess.CompletedProcess[str]:
    """``python examples/SCRIPT ARGS``, as a process forked from the suite's fork server, which
    imported torch and gpuload once (seconds of CPU an example); its output kept in ``out_dir``."""
    out, err = out_dir / f"{script}.out", out_dir / f"{script}.err"
    process = start_script(EXAMPLES / script, list(args), dict(env or os.environ), out, err)
    process.join(HANG_S)
    if process.exitcode is None:
        process.kill()
        pytest.fail(f"{script} {' '.join(args)} did not end in {HANG_S} s")
    return subprocess.CompletedProcess([script, *args], process.exitcode, out.read_text(), err.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py") if p.name != "plan_job.py"))
def test_example_runs_and_leaves_nothing_in_the_temporary_folder(script: str, tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = run_example(script, env={**os.environ, "TMPDIR": str(scratch)}, out_dir=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip()
    for expected in EXPECTED.get(script, []):
        assert re.search(expected, done.stdout), (expected, done.stdout[-2000:])
    # torch.optim's import makes torch's own compile cache folder (torchinductor_<user>), examples or not
    assert [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")] == []


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_each_example_says_what_it_shows_how_to_run_it_and_how_long_it_takes(script: str) -> None:
    docstring = ast.get_docstring(ast.parse((EXAMPLES / script).read_text()))
    assert docstring and len(docstring.splitlines()[0]) > 20, script
    assert "python examples/" in docstring or "examples/" + script in docstring, script
    assert re.search(r"\b(about|under) \d+(\.\d+)? (s|seconds|minutes?)\b", docstring, re.IGNORECASE), script


def test_train_gpt_packed_keeps_each_documents_logits_to_itself(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    example = importlib.import_module("train_gpt_packed")
    shard = example.documents_to_shard(40, tmp_path)
    packed = gpuload.PackedTokens(shard, 64, eot_id=example.EOT, strategy="best_fit")
    batch = packed.collate([packed[i] for i in range(len(packed))])
    torch.manual_seed(0)
    model = example.PackedGPT(64).eval()
    assert example.logits_ignore_other_documents(model, batch)
    unmasked = example.PackedGPT(64).eval()
    unmasked.forward = lambda x, positions: example.TinyGPT.forward(unmasked, x)  # causal over the whole row
    assert not example.logits_ignore_other_documents(unmasked, batch)


def _run_plan_example(out_dir: Path, *args: str) -> str:
    done = run_example("plan_job.py", *args, out_dir=out_dir)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "job plan for a pretended 80.00 GiB card" in done.stdout
    assert "batch size: 256 (your batch size)" in done.stdout and "(largest that fits, a multiple of 8)" in done.stdout
    assert "whole dataset cached" in done.stdout
    return done.stdout


def test_plan_job_example_with_its_own_model(tmp_path: Path) -> None:
    assert "a small CNN (defined in this example)" in _run_plan_example(tmp_path, "--small")


@pytest.mark.slow
def test_plan_job_example_with_resnet50_when_torchvision_is_installed(tmp_path: Path) -> None:
    pytest.importorskip("torchvision", reason="torchvision is not installed: the example plans its own model")
    assert "torchvision ResNet-50" in _run_plan_example(tmp_path)


def _torchrun_ddp_train(*args: str) -> str:
    """``torchrun --standalone --nproc-per-node 2 examples/ddp_train.py ARGS``: rank 0's output."""
    env = {name: value for name, value in os.environ.items()
           if name not in {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EXAMPLES.parent), os.environ.get("PYTHONPATH")]))
    env["PYTHONFAULTHANDLER"] = "1"  # a rank that aborts prints its Python threads' stacks
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(EXAMPLES / "ddp_train.py"), "--samples", "2048", "--batch-size", "64", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-8000:]
    return done.stdout


@pytest.mark.slow
def test_ddp_train_under_torchrun_stops_every_rank_together_and_resumes_where_it_stopped(tmp_path: Path) -> None:
    """2 ranks, one copy of the data split over them: an agreed stop after the first batch saves
    each rank's checkpoint; the resumed job trains the epoch's other 15 batches, then a whole one."""
    stopped = _torchrun_ddp_train("--epochs", "2", "--stop-after-seconds", "0", "--checkpoint", str(tmp_path))
    assert "epoch 0: loss" in stopped and "(mean over 2 rank(s), 1 batches each, stopped)" in stopped, stopped
    assert "each rank holds 3.0 of the dataset's 6.0 MiB" in stopped  # cache_scope="node": half each
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.pt", "rank1.pt"]
    resumed = _torchrun_ddp_train("--epochs", "2", "--checkpoint", str(tmp_path), "--resume")
    assert "resumed at epoch 0" in resumed
    batches = [int(n) for n in re.findall(r"epoch \d: loss [\d.]+ \(mean over 2 rank\(s\), (\d+) batches", resumed)]
    assert batches == [15, 16], resumed  # 2048 samples / 2 ranks / batch 64 = 16 per epoch
