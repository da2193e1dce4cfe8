"""The gpuload command runs end to end on the CPU, answers --help and bad arguments before importing
torch, suggests the closest option for a typo, and CI runs the README's test command."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest

from gpuload.cli import main
from gpuload.cli.main import COMMANDS, Command

cli_main = importlib.import_module("gpuload.cli.main")  # the module: gpuload.cli.main is also the function

ROOT = Path(__file__).resolve().parents[2]


def test_bench_quick_prints_table_and_writes_json_and_chart(tmp_path: Path, capsys) -> None:
    args = ["bench", "--quick", "--samples", "2048", "--epochs", "1", "--device", "cpu", "--out", str(tmp_path)]
    assert main([*args, "--step", "sleep", "--step-ms", "1"]) == 0
    printed = capsys.readouterr().out
    assert "torch (num_workers=0)" in printed and "of ideal" in printed
    # torch with 2 workers may beat 0 workers on a busy machine; the headline then names both ratios
    assert re.search(r"[\d.]+x torch's DataLoader \(num_workers=0\)(, [\d.]+x with num_workers=2)? on this machine",
                     printed)
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    document = json.loads((tmp_path / "bench.json").read_text())
    names = [r["name"] for r in document["results"]]
    assert names[0].startswith("torch DataLoader") and any(name.startswith("ideal") for name in names)
    assert any(name.startswith("gpuload DataLoader") for name in names)
    assert all(r["samples_per_s"] > 0 for r in document["results"])
    assert document["config"]["num_samples"] == 2048 and document["environment"]["device"] == "cpu"
    for r in document["results"]:
        assert r["batches_per_epoch"] == 4 and 0 <= r["wait_share"] <= 1
        assert r["h2d_bytes_per_epoch"] == 0  # nothing crosses PCIe on the CPU


def test_bench_on_user_npz(tmp_path: Path, capsys) -> None:
    import numpy as np

    path = tmp_path / "data.npz"
    np.savez(path, x=np.zeros((300, 8), dtype=np.float32), y=np.arange(300))
    assert main(["bench", "--data", str(path), "--epochs", "1", "--batch-size", "64", "--torch-workers", "0",
                 "--device", "cpu", "--out", str(tmp_path)]) == 0
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["scenario"].startswith("inmemory:") and document["results"][0]["batches_per_epoch"] == 5


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.+?)\n```", readme)
    assert len(commands) >= 2
    ci_script = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci_script.splitlines()


def test_bench_images_scenario_on_generated_photos(tmp_path: Path, capsys, monkeypatch) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    args = ["bench", "--scenario", "images", "--samples", "12", "--batch-size", "6", "--epochs", "1",
            "--image-size", "32", "--torch-workers", "0", "--device", "cpu", "--out", str(tmp_path / "out")]
    assert main(args) == 0
    assert list(scratch.iterdir()) == []  # the generated photographs were in a temporary folder, removed
    document = json.loads((tmp_path / "out" / "bench.json").read_text())
    names = [r["name"] for r in document["results"]]
    assert names == [
        "torch DataLoader + PIL (num_workers=0)",
        "torchvision decode_jpeg + v2 transforms (on cpu)",
        "gpuload DataLoader (decode + transforms)",
        "gpuload DataLoader (decoded image cache)",
    ]
    torchvision_row = document["results"][1]
    assert torchvision_row["batches_per_epoch"] == 2 and torchvision_row["num_workers"] == 0
    gpuload_row, cached_row = document["results"][2:]
    assert gpuload_row["batches_per_epoch"] == 2 and gpuload_row["decode_backend"] in ("dali-cpu", "torchvision", "pil")
    assert gpuload_row["of_ideal"] is None and "image_cache" not in gpuload_row
    assert cached_row["image_cache"] == "decoded" and cached_row["cached_images"] == 12
    torch_bytes = 12 * 3 * 32 * 32 * 2 + 12 * 8  # float16 crops and int64 labels, copied every epoch
    assert document["results"][0]["h2d_modelled"]["per_epoch"] == torch_bytes
    files = gpuload_row["h2d_modelled"]["per_epoch"]
    # torchvision's loop hands the device the files' bytes and the labels, every epoch
    assert torchvision_row["h2d_modelled"]["per_epoch"] == files + 12 * 8
    assert files > 0 and cached_row["h2d_modelled"] == {**cached_row["h2d_modelled"], "first_epoch": files,
                                                        "per_epoch": 0}


def test_plan_names_bombs_and_unreadable_files_instead_of_crashing(tmp_path: Path, capsys) -> None:
    import image_fixtures as F

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "bomb.jpg").write_bytes(F.bomb_jpeg())
    (tmp_path / "a" / "junk.png").write_bytes(b"not a png")
    (tmp_path / "a" / "ok.jpg").write_bytes(F.jpeg("grayscale"))
    assert main(["plan", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "3 images; 1 probed" in out
    assert re.search(r"bad files: 2 of the 3 probed "
                     r".*bomb.jpg: the header says 20000x20000 = 400,000,000 pixels, over the limit", out)
    assert "junk.png: not a readable image header" in out
    (tmp_path / "a" / "ok.jpg").unlink()
    (tmp_path / "a" / "junk.png").unlink()
    assert main(["plan", str(tmp_path)]) == 2
    assert "none of the 1 probed images can be loaded" in capsys.readouterr().err


# -- the command answers at once: no torch before the arguments parse ------------------------

def _run_cli(*argv: str) -> tuple[subprocess.CompletedProcess, bool]:
    """``python -m gpuload.cli ARGV`` in a fresh process; its result and whether it imported torch."""
    code = ("import sys\nfrom gpuload.cli import main\ntry:\n    code = main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    code = e.code\nprint('torch imported:', 'torch' in sys.modules, file=sys.stderr)\nsys.exit(code)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=120)
    return done, "torch imported: True" in done.stderr


@pytest.mark.parametrize("argv", [
    ["--help"], *[[command.name, "--help"] for command in COMMANDS],
    ["bench", "--quikc"], ["bench", "--epochs", "0"], ["bench", "--device-memory", "-80GiB"],
    ["bench", "--scenario", "imgaes"], ["bnech"], ["plan", "--cache-size", "lots"], ["plan", "--cache", "gpu"],
    ["plan", "--nodes", "2"], ["plan", "--model", "resnet50", "--input-shape", "3,224,224"],
    ["plan", "--gpus-per-node", "100000", "--nodes", "100000", "--device-memory", "80GiB"],
])
def test_help_and_argument_errors_do_not_import_torch(argv: list[str]) -> None:
    """torch takes 3 to 9 s to import: --help and a bad argument answer before it (< 1 s)."""
    done, imported_torch = _run_cli(*argv)
    assert done.returncode == (0 if "--help" in argv else 2), done.stderr
    assert not imported_torch, argv


def test_a_typo_gets_the_subcommands_usage_and_the_closest_option(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--quikc"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: gpuload bench ")
    assert err.splitlines()[-1] == "gpuload bench: error: unrecognized arguments: --quikc; did you mean --quick?"
    with pytest.raises(SystemExit):
        main(["plan", "--gpus-per-mode=2"])
    assert capsys.readouterr().err.splitlines()[-1].endswith("did you mean --gpus-per-node?")
    with pytest.raises(SystemExit):
        main(["bnech", "--quick"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "gpuload: error: argument COMMAND: invalid choice: 'bnech' "
        "(choose from 'bench', 'plan', 'doctor', 'cache', 'trace'); did you mean bench?")
    with pytest.raises(SystemExit):
        main(["bench", "--scenario", "imgaes"])
    assert capsys.readouterr().err.splitlines()[-1].endswith("; did you mean images?")
    with pytest.raises(SystemExit):
        main(["bench", "--xyz"])  # nothing close: no suggestion
    assert capsys.readouterr().err.splitlines()[-1] == "gpuload bench: error: unrecognized arguments: --xyz"


@pytest.mark.parametrize("argv", [["--device-memory", "-80GiB"], ["--device-memory=-80GiB"]])
@pytest.mark.parametrize("command", ["bench", "plan"])
def test_a_negative_size_is_named_as_negative_with_the_flags_own_advice(command: str, argv: list[str],
                                                                         capsys) -> None:
    """Not argparse's "expected one argument", nor advice ('auto', fractions) that the flag refuses."""
    with pytest.raises(SystemExit) as exited:
        main([command, *argv])
    assert exited.value.code == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert line == (f"gpuload {command}: error: argument --device-memory: '-80GiB' is negative; write a size with a "
                    "unit, e.g. 80GiB, 512MiB or 1.5TB (or a byte count)")
    for refused in ("auto", "0.5"):
        with pytest.raises(SystemExit):
            main([command, "--device-memory", refused])
        line = capsys.readouterr().err.splitlines()[-1]
        assert f"'{refused}' is not a size of memory" in line and "auto" not in line.split(";")[1]


def test_quiet_says_what_it_prints(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--quiet print two lines only: the result in words, then where bench.json and bench.png are" in help_text


def test_a_command_is_a_row_of_the_table_and_its_module_loads_only_when_named(monkeypatch, capsys) -> None:
    """How another command registers: a Command row naming a module with add_arguments and run."""
    import types

    module = types.ModuleType("gpuload_test_hello")
    module.add_arguments = lambda parser: parser.add_argument("--name", default="world")
    module.run = lambda args: print(f"hello {args.name}") or 0
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(cli_main, "COMMANDS", (*cli_main.COMMANDS, Command("hello", "say hello", module.__name__)))
    assert main(["hello", "--name", "gpuload"]) == 0
    assert capsys.readouterr().out == "hello gpuload\n"
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "hello" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "gpuload.cli.bench", None)  # importing it would fail
    assert main(["hello"]) == 0  # only the named command's module is imported


@pytest.mark.parametrize("command",
                         [["bench", "--device", "cuda"], ["plan", "--device", "cuda:1", "--synthetic", "cifar"]])
def test_cuda_without_a_driver_device_is_refused_before_torch_is_imported(command: list[str]) -> None:
    """The driver says there is no CUDA device: the error comes before torch (seconds) loads;
    here torch cannot even be imported, so reaching it would be a traceback, not exit 2."""
    from gpuload.driver import device_count

    if device_count() > 0:
        pytest.skip("this machine's driver shows a CUDA device: --device cuda is valid here")
    code = ("import sys; sys.modules['torch'] = None\n"
            "from gpuload.cli.main import main\n"
            f"sys.exit(main({command!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"gpuload {command[0]}: error: argument --device: {command[2]} was asked for but CUDA is "
                           "not available") and line.endswith("pass --device cpu, or leave --device out to use the CPU")


def test_cuda_missing_asks_the_driver_and_leaves_the_rest_to_torch(monkeypatch) -> None:
    from gpuload.cli import arguments

    monkeypatch.setattr(arguments.driver, "device_count", lambda: 0)
    assert "pass --device cpu" in arguments.cuda_missing("cuda:0")
    assert arguments.cuda_missing("cpu") is None and arguments.cuda_missing(None) is None
    monkeypatch.setattr(arguments.driver, "device_count", lambda: 2)
    assert arguments.cuda_missing("cuda:5") is None  # which devices exist: command_device asks torch


def test_the_driver_count_reads_libcuda_and_is_zero_when_it_fails(monkeypatch) -> None:
    from gpuload import driver

    def library(init: int, count: int):  # type: ignore[no-untyped-def]
        def get_count(reference) -> int:  # type: ignore[no-untyped-def]
            reference._obj.value = count
            return 0

        return lambda name: types.SimpleNamespace(cuInit=lambda flags: init, cuDeviceGetCount=get_count)

    monkeypatch.setattr(driver.ctypes, "CDLL", library(0, 3))
    assert driver.device_count() == 3
    monkeypatch.setattr(driver.ctypes, "CDLL", library(100, 3))  # CUDA_ERROR_NO_DEVICE
    assert driver.device_count() == 0
    monkeypatch.setattr(driver.ctypes, "CDLL", library(999, 3))  # any other failure of the driver
    assert driver.device_count() == 0


def test_command_device_names_the_flag_and_what_exists(monkeypatch) -> None:
    import torch

    from gpuload.cli.arguments import command_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^argument --device: cuda:1 was asked for but CUDA is not available on this "
                       r"machine \(torch .*\); pass --device cpu, or leave --device out to use the CPU$"):
        command_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(ValueError,
                       match=r"^argument --gpu: cuda:5 does not exist: this machine has 2 CUDA device\(s\), "
                       r"cuda:0 to cuda:1$"):
        command_device("cuda:5", flag="--gpu")
    assert command_device("cuda:1") == torch.device("cuda", 1) and command_device("cuda") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"^argument --device: device='tpu' is not a device"):
        command_device("tpu")


def test_number_flags_and_setting_errors_in_the_command_lines_words() -> None:
    import argparse

    from gpuload.cache.budget import CacheSettingError
    from gpuload.cli.arguments import non_negative_float, setting_error

    with pytest.raises(argparse.ArgumentTypeError, match=r"^'soon' is not a number$"):
        non_negative_float("soon")
    from_env = CacheSettingError("cache_size", "lots", "environment variable GPULOAD_CACHE_SIZE", "is not a size")
    assert setting_error(from_env) == str(from_env)  # not from a flag: said as it is
