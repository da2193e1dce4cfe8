"""``gpuload plan``: every bad argument or input is one line naming it, exit 2, no traceback; and
the job plan (``--model``) from the command line."""

from __future__ import annotations

import argparse
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gpuload.cli import main
from gpuload.cli.plan import add_arguments as add_plan_arguments
from gpuload.cli.plan import run as run_plan
from gpuload.sizes import format_bytes


@pytest.fixture(autouse=True)
def clean_env(tmp_path: Path, monkeypatch) -> None:
    for name in ("GPULOAD_CACHE", "GPULOAD_CACHE_SIZE", "GPULOAD_CACHE_RESERVE", "GPULOAD_CACHE_SCOPE",
                 "GPULOAD_CONFIG", "GPULOAD_JOB"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("flag, value", [("--probe-images", "0"), ("--probe-images", "-1"), ("--device", "foo")])
def test_bad_flags_are_refused_by_the_parser(flag: str, value: str, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["plan", flag, value])
    assert exited.value.code == 2
    assert one_error(capsys).startswith(f"gpuload plan: error: argument {flag}: ")


def test_corrupt_array_files_are_named(tmp_path: Path, capsys) -> None:
    npz = tmp_path / "broken.npz"
    npz.write_bytes(b"PK\x03\x04 truncated")
    assert main(["plan", str(npz), "--device-memory", "8GiB"]) == 2
    assert one_error(capsys).startswith(f"gpuload plan: error: cannot read {npz} as .npz arrays: ")
    npy = tmp_path / "short.npy"
    np.save(npy, np.zeros((100, 4)))
    npy.write_bytes(npy.read_bytes()[:90])
    assert main(["plan", str(npy), "--device-memory", "8GiB"]) == 2
    assert f"cannot read {npy} as .npy arrays" in one_error(capsys)


def test_a_job_error_names_the_flag_not_a_keyword(capsys) -> None:
    assert main(["plan", "--job", "nosuch", "--device-memory", "8GiB"]) == 2
    line = one_error(capsys)
    assert line.startswith("gpuload plan: error: argument --job: 'nosuch' names a job but there is no config file")
    assert "keyword" not in line


def test_a_job_plan_without_a_card_asks_for_the_flag(capsys, monkeypatch) -> None:
    import gpuload.cli.plan_print as plan_print

    monkeypatch.setattr(plan_print, "cuda_available", lambda: False)
    assert main(["plan", "--model", "job_models:mlp", "--input-shape", "8", "--optimizer", "sgd"]) == 2
    line = one_error(capsys)
    assert "--device-memory" in line and "device_memory=" not in line


def test_an_image_header_claiming_a_huge_size_is_a_bad_file_not_a_crash(tmp_path: Path, capsys) -> None:
    header = struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(header)) + b"IHDR" + header + struct.pack(">I", zlib.crc32(b"IHDR" + header))
    folder = tmp_path / "images" / "cat"
    folder.mkdir(parents=True)
    (folder / "bomb.png").write_bytes(b"\x89PNG\r\n\x1a\n" + chunk)
    assert main(["plan", str(tmp_path / "images"), "--device-memory", "8GiB"]) == 2
    assert one_error(capsys).startswith(f"gpuload plan: error: cannot read image {folder / 'bomb.png'}: ")


def test_an_image_folder_is_planned_as_the_loader_reads_it(tmp_path: Path, capsys) -> None:
    from PIL import Image

    root = tmp_path / "images"
    (root / "cat").mkdir(parents=True)
    Image.new("RGB", (8, 6)).save(root / "cat" / "a.jpg")
    for name in ("b.gif", "c.tif", "d.ppm"):  # formats ImageFolder does not load
        Image.new("RGB", (8, 6)).save(root / "cat" / name)
    Image.new("RGB", (8, 6)).save(root / "top-level.jpg")  # not in a class folder
    assert main(["plan", str(root), "--device-memory", "8GiB"]) == 0
    assert "image folder " + str(root) + ": 1 images;" in capsys.readouterr().out
    assert main(["plan", str(root / "cat"), "--device-memory", "8GiB"]) == 2  # files, but no class folders
    assert "no class folders" in one_error(capsys)


def test_an_image_folder_plan_names_its_disk_tier_and_writes_nothing(tmp_path: Path, capsys) -> None:
    from PIL import Image

    root = tmp_path / "images"
    (root / "cat").mkdir(parents=True)
    Image.new("RGB", (8, 6)).save(root / "cat" / "a.jpg")
    folder = tmp_path / "disk-cache"
    assert main(["plan", str(root), "--device-memory", "8GiB", "--cache-dir", str(folder)]) == 0
    assert f"  disk tier: {folder}, up to " in capsys.readouterr().out
    assert not folder.exists()
    assert main(["plan", str(root), "--device-memory", "8GiB"]) == 0
    assert "disk tier: " not in capsys.readouterr().out.split("image cache")[-1]


def test_job_plan_for_a_factory_on_a_pretended_card(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # no gpuload.toml
    data = tmp_path / "data.npz"
    np.savez(data, x=np.zeros((5000, 3, 32, 32), dtype=np.uint8), y=np.zeros(5000, dtype=np.int64))
    args = ["plan", "--model", "job_models:cnn", "--input-shape", "3,32,32", "--optimizer", "sgd",
            "--device-memory", "4GiB", "--host-memory", "64GiB", str(data)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "model: job_models:cnn, input 3x32x32 float32, optimizer sgd" in out
    assert "job plan for a pretended 4.00 GiB card" in out
    assert "(largest that fits, a multiple of 8)" in out and "whole dataset cached" in out
    assert main([*args, "--batch-size", "100"]) == 0
    assert "batch size: 100 (your batch size)" in capsys.readouterr().out


def test_plan_without_model_is_unchanged(capsys) -> None:
    assert main(["plan", "--synthetic", "cifar", "--device-memory", "16GiB", "--host-memory", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("settings:") and "cache plan:" in out and "job plan" not in out


@pytest.mark.parametrize(
    ("model", "shape", "message"),
    [
        ("no_such_module:f", "3,32,32", "cannot import 'no_such_module'"),
        ("job_models:nope", "3,32,32", "has no attribute 'nope'"),
        ("job_models", "3,32,32", "must be written pkg.module:factory"),
        ("job_models:SAMPLES", "3,32,32", "not a function"),
        ("job_models:cnn", "3,x", "positive integers separated by commas"),
        ("job_models:cnn", "3,0,4", "positive integers separated by commas"),
        ("job_models:cnn", "5,32,32", "the training step of job_models:cnn failed on a 5,32,32 input"),
    ],
)
def test_bad_model_or_shape_is_one_line_and_exit_2(model: str, shape: str, message: str, capsys) -> None:
    assert main(["plan", "--model", model, "--input-shape", shape, "--device-memory", "8GiB"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("gpuload plan: error:")


def test_model_needs_an_input_shape(capsys) -> None:
    assert main(["plan", "--model", "job_models:mlp", "--device-memory", "8GiB"]) == 2
    assert "needs both --model and --input-shape" in capsys.readouterr().err


# -- the plan printed for arrays, image folders and synthetic shapes -------------------------

GiB = 2**30
CIFAR = 3 * 32 * 32 + 8  # bytes of a CIFAR sample: uint8 image + int64 label


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return parser.parse_args(list(argv))


def test_plan_command_synthetic_cifar_default(capsys):
    assert run_plan(parse("--device-memory", "80GiB", "--host-memory", "64GiB")) == 0
    out = capsys.readouterr().out
    assert "50000 samples x 3.01 KiB (3080 bytes per sample)" in out
    assert "cache plan: device " in out
    assert "146.87 MiB without cache, 0 B with it" in out
    assert "80.00 GiB free of 80.00 GiB" in out and "64.00 GiB free" in out


def test_plan_command_imagenet_on_small_card(capsys):
    code = run_plan(parse("--synthetic", "imagenet", "--device-memory", "24GiB", "--device-free", "20GiB",
                          "--host-memory", "32GiB", "--cache-size", "10GiB"))
    assert code == 0
    out = capsys.readouterr().out
    assert "device+host+stream" in out
    assert "cache_size=10.00 GiB (keyword cache_size=)" in out
    assert "20.00 GiB free of 24.00 GiB" in out


def test_plan_command_npz_reads_headers_only(tmp_path, capsys):
    path = tmp_path / "data.npz"
    np.savez(path, images=np.zeros((100, 3, 8, 8), np.uint8), labels=np.zeros(100, np.int64))
    assert run_plan(parse(str(path), "--device-memory", "1GiB", "--host-memory", "8GiB")) == 0
    out = capsys.readouterr().out
    assert "100 samples x 200 B (200 bytes per sample)" in out


def test_plan_command_npy_and_mismatched_npz(tmp_path, capsys):
    npy = tmp_path / "x.npy"
    np.save(npy, np.zeros((10, 4), np.float32))
    assert run_plan(parse(str(npy), "--device-memory", "1GiB")) == 0
    assert "10 samples x 16 B" in capsys.readouterr().out
    bad = tmp_path / "bad.npz"
    np.savez(bad, a=np.zeros(3), b=np.zeros(4))
    assert run_plan(parse(str(bad), "--device-memory", "1GiB")) == 2
    assert "same number of rows" in capsys.readouterr().err


def test_plan_command_image_folder(tmp_path, capsys):
    folder = tmp_path / "images" / "cat"
    folder.mkdir(parents=True)
    for i, (w, h) in enumerate([(40, 30), (40, 30), (20, 10)]):
        Image.new("RGB", (w, h), (i, 0, 0)).save(folder / f"{i}.png")
    (folder / "notes.txt").write_text("not an image")
    assert run_plan(parse(str(tmp_path / "images"), "--device-memory", "1GiB", "--host-memory", "64GiB")) == 0
    out = capsys.readouterr().out
    expected = -(-(3 * 40 * 30 * 2 + 3 * 20 * 10) // 3) + 8
    assert expected == 2608
    assert f"3 samples x 2.55 KiB ({expected} bytes per sample)" in out
    assert "3 images" in out
    # A 1 GiB card leaves nothing above the 2 GiB default reserve: the files' bytes are kept.
    assert "image cache (for gpuload.DataLoader on this folder): encoded: " in out
    assert run_plan(parse(str(tmp_path / "images"), "--device-memory", "80GiB", "--host-memory", "64GiB")) == 0
    assert "image cache (for gpuload.DataLoader on this folder): decoded: " in capsys.readouterr().out
    assert run_plan(parse(str(tmp_path / "images"), "--device-memory", "80GiB", "--host-memory", "64GiB",
                          "--cache-size", "1KiB")) == 0
    assert "image cache (for gpuload.DataLoader on this folder): encoded: " in capsys.readouterr().out


def test_plan_command_job_from_file_and_errors(tmp_path, capsys):
    (tmp_path / "gpuload.toml").write_text('[jobs.small]\ncache_size = "1MiB"\n')
    assert run_plan(parse("--job", "small", "--device-memory", "80GiB")) == 0
    out = capsys.readouterr().out
    assert "cache_size=1.00 MiB (" in out and "[jobs.small]" in out
    assert f"device tier:    {2**20 // CIFAR} samples" in out
    assert run_plan(parse("--job", "big", "--device-memory", "80GiB")) == 2
    assert "small" in capsys.readouterr().err
    assert run_plan(parse("--cache-size", "100GiB", "--device-memory", "80GiB")) == 2
    assert "larger than" in capsys.readouterr().err


def test_plan_command_without_card_plans_for_cpu(capsys, monkeypatch):
    assert run_plan(parse("--device", "cpu", "--host-memory", "16GiB")) == 0
    out = capsys.readouterr().out
    assert "cache plan: cpu" in out and "nothing crosses PCIe" in out


def test_plan_command_rejects_relative_memory():
    with pytest.raises(SystemExit):
        parse("--device-memory", "0.5")


# -- the scope plan of a torch.distributed job (--gpus-per-node, --nodes) -----------------------

SCOPE_COLUMNS = ["scope", "fits", "per GPU", "host/node", "PCIe 1st", "PCIe later", "NVLink", "network"]


def scope_rows(out: str) -> dict[str, str]:
    """The scope table's header and rows, by their first word."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["scope", "fits"])
    return {line.split()[0]: line for line in lines[start:start + 4]}


def test_scope_plan_for_synthetic_cifar_on_two_nodes(capsys):
    assert main(["plan", "--synthetic", "cifar", "--gpus-per-node", "2", "--nodes", "2", "--device-memory", "16GiB",
                 "--host-memory", "64GiB"]) == 0
    out = capsys.readouterr().out
    rows = scope_rows(out)
    assert [w for w in " ".join(SCOPE_COLUMNS).split()] == rows["scope"].split()
    assert set(rows) == {"scope", "rank", "node", "world"}
    assert rows["rank"].split()[:6] == ["rank", "(1)", "yes", "146.87", "MiB", "(50000)"]
    assert rows["rank"].endswith("<- auto") and "<- auto" not in rows["node"] + rows["world"]
    assert rows["node"].split()[:6] == ["node", "(2)", "yes", "73.43", "MiB", "(25000)"]
    assert "12500 rows (DistributedSampler, shuffle=True)" in out  # 50000 rows over 4 ranks
    assert out.splitlines()[-1] == ("auto picks rank: the dataset (146.87 MiB) fits 1 device(s) of 14.00 GiB room "
                                    "each (146.87 MiB per rank)")
    assert "cache plan:" not in out  # the one-card plan is the rank row


def test_scope_plan_for_the_issues_example(capsys):
    assert main(["plan", "--gpus-per-node", "8", "--nodes", "2", "--device-memory", "141GiB",
                 "--host-memory", "2TiB", "--synthetic", "imagenet"]) == 0
    out = capsys.readouterr().out
    rows = scope_rows(out)
    assert rows["node"].endswith("78.58 GiB  0 B <- auto")
    assert rows["world"].split()[-4:] == ["39.29", "GiB", "44.90", "GiB"]
    assert "auto picks node: the dataset (179.62 GiB) fits 8 device(s)" in out


def test_scope_plan_shows_an_explicit_scope_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("GPULOAD_CACHE_SCOPE", "world")
    assert main(["plan", "--synthetic", "cifar", "--gpus-per-node", "4", "--device-memory", "16GiB",
                 "--host-memory", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "1 node(s) x 4 GPU(s) = 4 ranks" in out
    assert scope_rows(out)["world"].endswith("<- cache_scope=world")
    assert "cache_scope=world (environment variable GPULOAD_CACHE_SCOPE) runs world" in out


def test_scope_plan_beside_a_models_step(capsys):
    args = ["plan", "--model", "job_models:cnn", "--input-shape", "3,32,32", "--optimizer", "sgd", "--synthetic",
            "cifar", "--batch-size", "64", "--gpus-per-node", "2", "--device-memory", "4GiB", "--host-memory", "64GiB"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.index("job plan for a pretended 4.00 GiB card") < out.index("scope plan: 1 node(s) x 2 GPU(s)")
    assert "(beside the job plan's step at batch 64 and its prefetch slots)" in out
    assert "auto picks rank" in out
    assert main([*args[:7], *args[9:]]) == 2  # no dataset
    assert "a scope plan (--gpus-per-node) with --model needs a dataset" in one_error(capsys)


def test_scope_plan_beside_a_step_that_does_not_fit_leaves_no_cache_room(capsys):
    args = ["plan", "--model", "job_models:cnn", "--input-shape", "3,32,32", "--optimizer", "sgd", "--synthetic",
            "cifar", "--gpus-per-node", "2", "--device-memory", "4MiB", "--host-memory", "64GiB"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "no batch fits" in out and "cache room 0 B (the step at batch 1 alone does not fit)" in out
    assert "auto picks rank" in out


@pytest.mark.gpu
def test_the_cache_plan_and_the_scope_plan_are_for_this_machines_cuda_device(capsys):
    total = torch.cuda.mem_get_info()[1]
    assert main(["plan", "--synthetic", "cifar", "--host-memory", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "device: cuda" in out and "no CUDA device here" not in out
    assert main(["plan", "--synthetic", "cifar", "--host-memory", "64GiB", "--gpus-per-node", "2"]) == 0
    assert f"free of {format_bytes(total)}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus-per-node", "2", "--nodes", "0"], "argument --nodes: 0 must be at least 1"),
        (["--gpus-per-node", "0"], "argument --gpus-per-node: 0 must be at least 1"),
        (["--gpus-per-node", "two"], "argument --gpus-per-node: 'two' is not a whole number"),
    ],
)
def test_bad_scope_flags_are_refused_by_the_parser(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--device-memory", "8GiB", *argv])
    assert exited.value.code == 2
    assert one_error(capsys) == f"gpuload plan: error: {message}"


def test_scope_plan_needs_a_card_size_on_a_cpu_machine(capsys, monkeypatch):
    monkeypatch.setattr("gpuload.cli.plan_print.command_device", lambda device: torch.device("cpu"))
    assert main(["plan", "--gpus-per-node", "8", "--nodes", "2"]) == 2
    line = one_error(capsys)
    assert "this machine has none: pass --device-memory" in line and "--device-memory 141GiB" in line
    assert main(["plan", "--nodes", "2", "--device-memory", "8GiB"]) == 2
    assert one_error(capsys) == "gpuload plan: error: --nodes needs --gpus-per-node (the ranks on each node)"
    assert main(["plan", "--gpus-per-node", "2", "--cache-size", "100GiB", "--device-memory", "80GiB"]) == 2
    assert "argument --cache-size: '100GiB' is larger than a pretended 80.00 GiB card" in one_error(capsys)


def test_the_readmes_scope_plan_is_what_the_command_prints(capsys):
    readme = (Path(__file__).parents[2] / "gpuload" / "docs" / "multi-gpu.md").read_text()
    section = readme[readme.index("## Planning a multi-GPU job"):]
    block = section[section.index("```console\n$ gpuload plan") + len("```console\n"):]
    command, _, printed = block[: block.index("```")].partition("\n...\n")
    assert main(command.removeprefix("$ gpuload ").split()) == 0
    out = capsys.readouterr().out
    assert out[out.index("scope plan:"):] == printed


# -- what the README and the issues tried: install advice, --job advice, nothing allocated -------

class _NoTorchvision:
    """A meta path finder that makes torchvision look not installed."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] == "torchvision":
            raise ModuleNotFoundError(f"No module named {name.partition('.')[0]!r}", name="torchvision")
        return None


def test_a_torchvision_model_without_torchvision_says_how_to_install_it(monkeypatch, capsys) -> None:
    import sys

    for name in [name for name in sys.modules if name.partition(".")[0] == "torchvision"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_NoTorchvision, *sys.meta_path])
    argv = ["plan", "--model", "torchvision.models:resnet50", "--input-shape", "3,224,224", "--optimizer", "adamw",
            "--batch-size", "256", "--device-memory", "80GiB", "--synthetic", "imagenet"]
    assert main(argv) == 2
    line = one_error(capsys)
    assert line == ("gpuload plan: error: --model 'torchvision.models:resnet50': cannot import 'torchvision.models': "
                    "No module named 'torchvision' (pip install 'gpuload[torchvision]', or pip install torchvision)")


def test_a_job_without_a_config_file_says_what_to_do_in_the_flags_terms(capsys) -> None:
    assert main(["plan", "--synthetic", "imagenet", "--device-memory", "80GiB", "--host-memory", "256GiB",
                 "--job", "train"]) == 2
    line = one_error(capsys)
    assert line.startswith("gpuload plan: error: argument --job: 'train' names a job but there is no config file")
    assert line.endswith("create one with a [jobs.train] table, or leave --job out")


def test_the_input_is_a_fake_tensor_nothing_of_the_planned_size_is_allocated(monkeypatch, capsys) -> None:
    """3x1000000x1000000 float32 is 12 TB: a real tensor cannot be made, a fake one plans (#25)."""
    from torch._subclasses.fake_tensor import FakeTensor

    made = []
    real_empty = torch.empty

    def watched_empty(*size, **kwargs):
        tensor = real_empty(*size, **kwargs)
        real = tensor.device.type != "meta" and not isinstance(tensor, FakeTensor)
        made.append(("real" if real else "fake", tensor.numel()))
        return tensor

    monkeypatch.setattr(torch, "empty", watched_empty)
    assert main(["plan", "--model", "job_models:cnn", "--input-shape", "3,1000000,1000000", "--optimizer", "sgd",
                 "--device-memory", "80GiB", "--batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "model: job_models:cnn, input 3x1000000x1000000 float32" in out and "TiB" in out
    assert made[0] == ("fake", 3 * 10**12)  # the input
    assert max([numel for kind, numel in made if kind == "real"], default=0) < 10**6  # nothing real of its size


def test_a_scope_plan_past_any_cluster_is_refused_in_one_line_before_anything_is_made(capsys) -> None:
    assert main(["plan", "--gpus-per-node", "100000", "--nodes", "100000", "--device-memory", "80GiB"]) == 2
    assert one_error(capsys) == ("gpuload plan: error: --gpus-per-node 100000 x --nodes 100000 = 10,000,000,000 "
                                 "ranks: plan at most 131,072")
    assert main(["plan", "--gpus-per-node", "128", "--nodes", "1024", "--device-memory", "80GiB",
                 "--host-memory", "1TiB"]) == 0  # the largest allowed is planned
    assert "world (131072)" in capsys.readouterr().out


def test_the_choices_the_parser_offers_are_the_packages_own() -> None:
    from gpuload.cache import MODES
    from gpuload.cli.plan import CACHE_MODES, MAX_RANKS, SYNTHETIC_NAMES
    from gpuload.distributed.scope_plan import MAX_RANKS as PLAN_MAX_RANKS
    from gpuload.job.dataset_size import SYNTHETIC

    assert CACHE_MODES == MODES and sorted(SYNTHETIC_NAMES) == sorted(SYNTHETIC)
    assert MAX_RANKS == PLAN_MAX_RANKS


@pytest.mark.parametrize("argv, message", [
    (["--cache-size", "lots"], "argument --cache-size: 'lots' is not a size; "),
    (["--cache-reserve", "2.5"], "argument --cache-reserve: '2.5' is a number outside [0, 1]"),
    (["--device-free", "8GiB"], "--device-free needs --device-memory (the card it is part of)"),
    (["--device-memory", "8GiB", "--device-free", "9GiB"], "--device-free cannot exceed --device-memory"),
])
def test_size_settings_are_checked_when_the_arguments_parse(argv: list[str], message: str, capsys) -> None:
    try:
        code = main(["plan", *argv])
    except SystemExit as exited:
        code = exited.code
    assert code == 2 and message in one_error(capsys)


def test_the_readmes_job_plan_is_what_the_command_prints_beside_its_gpuload_toml(tmp_path, capsys) -> None:
    """The docs' `--job train` command, run beside the gpuload.toml the page shows above it."""
    readme = (Path(__file__).parents[2] / "gpuload" / "docs" / "configuration.md").read_text()
    toml = readme[readme.index("```toml\ncache_reserve") + len("```toml\n"):]
    (tmp_path / "gpuload.toml").write_text(toml[: toml.index("```")])
    block = readme[readme.index("```console\n$ gpuload plan --synthetic imagenet") + len("```console\n"):]
    command, *shown = block[: block.index("```")].splitlines()
    assert main(command.removeprefix("$ gpuload ").split()) == 0  # the test's working directory is tmp_path
    out = capsys.readouterr().out.splitlines()
    for line in shown:
        assert any(printed.startswith(line.removesuffix(" ...")) for printed in out), line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_for_without_cuda_names_the_flag(capsys) -> None:
    assert main(["plan", "--device", "cuda"]) == 2
    line = one_error(capsys)
    assert line.startswith("gpuload plan: error: argument --device: cuda was asked for but CUDA is not available")
    assert "pass --device cpu" in line and "device=" not in line


def test_the_disk_tier_is_planned_beside_the_others_with_a_cache_dir(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "spill"
    assert main(["plan", "--synthetic", "cifar", "--device-memory", "8GiB",
                 "--cache-size", "10MiB", "--host-memory", "4GiB", "--cache-dir", str(folder),
                 "--disk-cache-size", "50MiB"]) == 0
    printed = capsys.readouterr().out
    assert "cache_dir=" in printed and "disk tier:      17022 samples" in printed and "device+disk+stream" in printed
    assert not folder.exists()  # planning writes nothing
    assert main(["plan", "--synthetic", "cifar", "--device-memory", "4GiB"]) == 0
    assert "disk tier" not in capsys.readouterr().out


def test_a_glob_of_token_shards_is_planned_as_token_windows_reads_it(tmp_path: Path, capsys) -> None:
    """``gpuload plan 'train_*.bin'`` (before: "neither an image folder nor ..."), and the help names .bin."""
    from gpuload import TokenWindows
    from gpuload.datasets.tokens import write_shard

    for k in range(3):
        write_shard(tmp_path / f"train_{k:03d}.bin", np.arange(1000) % 500)
    pattern = str(tmp_path / "train_*.bin")
    assert TokenWindows(pattern, seq_len=8).num_tokens == 3000
    assert main(["plan", pattern, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"token shards {tmp_path / 'train_000.bin'} .. {tmp_path / 'train_002.bin'} (3 files): 3000 tokens" in out
    assert "3000 samples x 2 B (2 bytes per sample)" in out
    write_shard(tmp_path / "train_009.bin", np.arange(10), magic=20240801)  # uint32 beside uint16: refused by both
    assert main(["plan", pattern, "--device", "cpu"]) == 2
    assert "hold ids of different dtypes (uint16, uint32)" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "none_*.bin"), "--device", "cpu"]) == 2
    assert "no token files match this pattern" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert ".bin token shard" in " ".join(capsys.readouterr().out.split())


def test_parquet_files_and_a_save_to_disk_folder_are_planned_from_their_schema(tmp_path: Path, capsys) -> None:
    """The cache holds the fixed-width columns: 768 float32 + an int64 label + a struct of an int16
    and a bool per row; the token lists and strings are read from the table per batch."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    table = pa.table({
        "embedding": pa.array([[0.5] * 768] * 6, pa.list_(pa.float32(), 768)),
        "label": pa.array(range(6), pa.int64()),
        "meta": pa.array([{"id": 1, "keep": True}] * 6, pa.struct([("id", pa.int16()), ("keep", pa.bool_())])),
        "tokens": [[1, 2, 3]] * 6,
        "text": ["x"] * 6,
    })
    pq.write_table(table.slice(0, 4), tmp_path / "part-0.parquet")
    pq.write_table(table.slice(4), tmp_path / "part-1.parquet")
    datasets.Dataset(table).save_to_disk(tmp_path / "saved")
    per_row = 768 * 4 + 8 + 2 + 1
    for path, rows in ((str(tmp_path / "part-*.parquet"), 6), (str(tmp_path / "part-0.parquet"), 4),
                       (str(tmp_path / "saved"), 6)):
        assert main(["plan", path, "--device-memory", "80GiB"]) == 0
        out = capsys.readouterr().out
        assert f"{rows} samples x {format_bytes(per_row)} ({per_row} bytes per sample)" in out, path
        assert "label (int64) 8 B" in out and "meta (struct<id: int16, keep: bool>) 3 B" in out
        assert "read from the table per batch: tokens (list<" in out and "text (string)" in out
        assert "image cache" not in out.lower()
    assert main(["plan", str(tmp_path / "none-*.parquet"), "--device", "cpu"]) == 2
    assert "no Parquet file matches" in capsys.readouterr().err
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    for path, error in (("missing.arrow", "ArrowTable: no such file or folder"), ("broken.parquet", "Parquet")):
        assert main(["plan", str(tmp_path / path), "--device", "cpu"]) == 2
        assert error in capsys.readouterr().err
