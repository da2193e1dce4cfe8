"""``gpuload bench``: bad arguments fail first and in one line, ``--data`` is only read, output fits logs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gpuload.cli import main

TINY = ["--samples", "1024", "--epochs", "1", "--torch-workers", "0", "--device", "cpu"]
IMAGES = ["--scenario", "images", "--samples", "12", "--batch-size", "6", "--epochs", "1", "--image-size", "32",
          "--torch-workers", "0", "--device", "cpu"]


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "error" in line.lower()]


@pytest.mark.parametrize("flag, value", [
    ("--samples", "0"), ("--samples", "-5"), ("--epochs", "0"), ("--epochs", "-1"), ("--batch-size", "0"),
    ("--device", "foo"), ("--device", "3.5"), ("--torch-workers", "-1"), ("--step-ms", "-1"), ("--step-ms", "nan"),
    ("--threads", "0"), ("--image-size", "0"), ("--samples", "ten"), ("--contention", "-1"),
])
def test_a_bad_argument_is_one_line_naming_it_and_exit_2(flag: str, value: str, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", flag, value, "--out", str(tmp_path / "out")])
    assert exited.value.code == 2
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and errors[0].startswith(f"gpuload bench: error: argument {flag}: ")
    assert not (tmp_path / "out").exists()


def run_failing(args: list[str], capsys) -> str:
    """Run a bench that must refuse its arguments before measuring; its one error line."""
    assert main(["bench", *args]) == 2
    captured = capsys.readouterr()
    assert "measured" not in captured.err and captured.out == ""
    errors = error_lines(captured.err)
    assert len(errors) == 1, captured.err
    return errors[0]


def test_data_is_never_written_a_missing_or_empty_folder_is_an_error(tmp_path: Path, capsys) -> None:
    out = ["--out", str(tmp_path / "out")]
    typo = tmp_path / "typo"
    line = run_failing([*IMAGES, "--data", str(typo), *out], capsys)
    assert line.startswith("gpuload bench: error: argument --data: ") and "no such folder" in line
    assert not typo.exists()
    line = run_failing(["--data", str(typo), *TINY, *out], capsys)  # no --scenario: not guessed as a folder
    assert "argument --data" in line and "no such file or folder" in line and not typo.exists()
    empty = tmp_path / "mount-point"
    empty.mkdir()
    assert "argument --data" in run_failing([*IMAGES, "--data", str(empty), *out], capsys)
    assert list(empty.iterdir()) == []
    (empty / "cat").mkdir()
    assert "found no .jpg" in run_failing([*IMAGES, "--data", str(empty), *out], capsys)
    assert [p.name for p in empty.rglob("*")] == ["cat"]
    assert not (tmp_path / "out" / "bench.json").exists()


def test_bad_array_files_and_devices_are_one_line(tmp_path: Path, capsys) -> None:
    out = ["--out", str(tmp_path / "out")]
    corrupt = tmp_path / "data.npz"
    corrupt.write_bytes(b"PK\x03\x04 not really a zip")
    line = run_failing(["--data", str(corrupt), *TINY, *out], capsys)
    assert line.startswith(f"gpuload bench: error: argument --data: cannot read {corrupt} as .npz arrays: ")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_for_without_cuda_names_the_flag_not_the_keyword(tmp_path: Path, capsys) -> None:
    line = run_failing([*TINY, "--device", "cuda", "--out", str(tmp_path / "out")], capsys)
    assert line.startswith("gpuload bench: error: argument --device: cuda was asked for but CUDA is not available")
    assert line.endswith("pass --device cpu, or leave --device out to use the CPU") and "device=" not in line
    assert not (tmp_path / "out").exists()


def _zero_rows(path: Path) -> None:
    np.save(path, np.zeros((0, 3), dtype=np.float32))


def _mixed_rows(path: Path) -> None:
    np.savez(path, images=np.zeros((4, 3), dtype=np.uint8), labels=np.zeros(5, dtype=np.int64))


def _text(path: Path) -> None:
    path.write_text("hello, not an array\n")


def _objects(path: Path) -> None:
    np.save(path, np.array([{}, 1], dtype=object), allow_pickle=True)


def _scalar(path: Path) -> None:
    np.save(path, np.float32(3.0))


def _strings(path: Path) -> None:
    np.save(path, np.array(["abc"] * 5))


def _empty_folder(path: Path) -> None:
    path.mkdir()


@pytest.mark.parametrize("name, make, says", [
    ("zero.npy", _zero_rows, "zero.npy holds 0 rows: each row is a sample and there must be at least one"),
    ("mixed.npz", _mixed_rows, "must have the same number of rows (one per sample); got images: 4, labels: 5"),
    ("fake.npy", _text, "fake.npy as .npy arrays: the file is not a NumPy array (it does not start with NumPy's"),
    ("objects.npy", _objects, "holds Python objects (dtype object); give numeric arrays"),
    ("scalar.npy", _scalar, "is 0-dimensional; each array needs one row per sample"),
    ("strings.npy", _strings, ("strings.npy as .npy/.npz arrays: ArrayDataset column #0 has numpy dtype <U3, "
                               "which torch cannot hold")),
    ("emptydir", _empty_folder, "emptydir holds no class subfolders; the images scenario reads root/<class>/<images>"),
])
@pytest.mark.parametrize("scenario", [[], ["--scenario", "partial"], ["--scenario", "augment"]])
def test_unusable_data_is_one_line_naming_it_and_leaves_no_output(
    name: str, make, says: str, scenario: list[str], tmp_path: Path, capsys
) -> None:
    """A zero-row .npy (once a ZeroDivisionError), a mixed .npz, a text file named .npy (once NumPy's
    pickle message), objects, a 0-d array, an empty folder: one line, exit 2, no --out folder."""
    data = tmp_path / name
    make(data)
    if name == "emptydir" and scenario:
        says = f"emptydir is a folder; --scenario {scenario[1]} reads an .npy/.npz file"
    line = run_failing([*TINY, *scenario, "--data", str(data), "--out", str(tmp_path / "out")], capsys)
    assert line.startswith("gpuload bench: error: argument --data: ") and says in line, line
    assert "Traceback" not in line and "pickle" not in line
    assert not (tmp_path / "out").exists()


def test_an_unwritable_out_is_found_before_the_benchmark(tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = run_failing([*TINY, "--out", str(blocker / "results")], capsys)
    assert line.startswith(f"gpuload bench: error: argument --out: cannot write in {blocker / 'results'}")


def test_an_out_in_a_folder_without_write_permission_is_refused_before_the_benchmark(
        tmp_path: Path, monkeypatch, capsys) -> None:
    import os

    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    access = os.access  # root may write anywhere: the check is asked as an ordinary user would find it
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == locked else access(path, mode))
    line = run_failing([*TINY, "--out", str(locked / "results")], capsys)
    assert line == (f"gpuload bench: error: argument --out: cannot write in {locked / 'results'}: "
                    f"permission denied in {locked}")
    assert list(locked.iterdir()) == []


def test_generated_images_are_kept_only_where_asked(tmp_path: Path, capsys) -> None:
    keep = tmp_path / "photos"
    assert main(["bench", *IMAGES, "--save-images", str(keep), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    assert len(list(keep.rglob("*.jpg"))) == 12
    capsys.readouterr()
    line = run_failing([*IMAGES, "--save-images", str(keep), "--out", str(tmp_path / "out")], capsys)
    assert "argument --save-images" in line and "not an empty folder" in line
    assert main(["bench", *IMAGES, "--data", str(keep), "--out", str(tmp_path / "again"), "--quiet"]) == 0
    assert len(list(keep.rglob("*"))) == 22  # 10 class folders, 12 files: nothing added
    document = json.loads((tmp_path / "again" / "bench.json").read_text())
    assert document["scenario"] == f"images:{keep}"


def test_a_log_gets_one_progress_line_per_loader_and_quiet_only_the_headline(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert main(["bench", *TINY, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err
    progress = [line for line in captured.err.splitlines() if line.startswith("  measured ")]
    assert progress[0] == progress[0].split(":")[0] + ": 2 epochs in " + progress[0].split(" in ")[1]
    assert len(progress) == len(json.loads((out / "bench.json").read_text())["results"])
    assert all(len(line) <= 100 for line in captured.out.splitlines()[1:-2])  # the tables and notes
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (out / "bench.json").unlink()
    (out / "bench.json").symlink_to(victim)
    assert main(["bench", *TINY, "--out", str(out), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    headline, where = captured.out.splitlines()
    assert "x torch's DataLoader (num_workers=0) on this machine; after the first epoch" in headline
    assert where == f"results: {out / 'bench.json'}; chart: {out / 'bench.png'}"
    assert victim.read_text() == "keep me" and not (out / "bench.json").is_symlink()


def test_arrays_given_as_npy_run(tmp_path: Path, capsys) -> None:
    path = tmp_path / "x.npy"
    np.save(path, np.zeros((256, 4), dtype=np.float32))
    assert main(["bench", "--data", str(path), *TINY[2:], "--batch-size", "64", "--out", str(tmp_path), "--quiet"]) == 0
    assert json.loads((tmp_path / "bench.json").read_text())["results"][0]["batches_per_epoch"] == 4


def test_two_cores_or_fewer_default_to_one_torch_thread_and_the_run_restores_it(tmp_path, monkeypatch, capsys) -> None:
    import os

    from gpuload.cli.bench import default_threads

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))  # a busy machine: the run says so
    assert default_threads() == 1
    before = torch.get_num_threads()
    assert main(["bench", *TINY, "--out", str(tmp_path)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "1 torch thread(s) (the default on 2 cores or fewer" in printed
    assert "note: the machine was busy (load average 9.0 on 2 cores): the rates are noisy" in printed
    assert json.loads((tmp_path / "bench.json").read_text())["environment"]["torch_threads"] == 1
    assert torch.get_num_threads() == before
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert default_threads() is None


def test_the_pretended_card_sets_every_scenarios_modelled_bytes(tmp_path: Path, capsys) -> None:
    assert main(["bench", *TINY, "--device-memory", "1GiB", "--out", str(tmp_path), "--quiet"]) == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "bench.json").read_text())["results"]}
    cached = rows["gpuload DataLoader (device cache)"]["h2d_modelled"]
    everything = 1024 * (3 * 32 * 32 + 8)
    # 1 GiB is all reserve for the model: nothing is cached on the device, every epoch copies it all.
    assert cached["card"] == "a pretended 1 GiB card" and cached["per_epoch"] == everything
    assert rows["torch DataLoader (num_workers=0)"]["h2d_modelled"]["per_epoch"] == everything
    assert "modelled for a pretended 1 GiB card" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "says"), [
    (["--scenario", "samples", "--data", "x.npy"],
     "argument --data: the samples scenario makes its own dataset (--samples N)"),
    (["--scenario", "tokens", "--data", "x.npy"],
     "argument --data: the tokens scenario makes its own 100M-token shard"),
    (["--scenario", "packing", "--data", "x.npy"],
     "argument --data: the packing scenario makes its own corpus of documents"),
    (["--save-images", "kept"], "argument --save-images: only applies to --scenario images"),
    (["--scenario", "images", "--save-images", "kept", "--data", "photos"],
     "argument --save-images: it writes generated images; with --data your own are used"),
])
def test_flags_that_do_not_apply_to_the_scenario_are_refused(args: list[str], says: str, tmp_path: Path,
                                                             capsys) -> None:
    line = run_failing([*args, "--out", str(tmp_path / "out")], capsys)
    assert line.endswith(says), line
    assert not (tmp_path / "out").exists() and not (tmp_path / "kept").exists()


def test_an_out_under_a_file_is_refused_naming_why(tmp_path: Path) -> None:
    from gpuload.cli.bench import UsageError, writable_out

    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match=f"^argument --out: cannot write in {tmp_path / 'file' / 'out'}: "):
        writable_out(str(tmp_path / "file" / "out"))
    assert writable_out(str(tmp_path / "new")).is_dir()


def test_the_progress_bars_close_when_each_loader_is_done(capsys) -> None:
    from gpuload.cli.bench import _tqdm_progress

    progress = _tqdm_progress()
    progress("torch DataLoader", 1, 2)
    progress("torch DataLoader", 2, 2)
    progress("gpuload", 1, 1)
    err = capsys.readouterr().err
    assert "torch DataLoader" in err and "2/2" in err and "1/1" in err


def test_the_samples_scenario_from_the_command_line(tmp_path: Path, monkeypatch, capsys) -> None:
    from gpuload.bench import samples

    monkeypatch.setattr(samples, "scenario_runs", lambda quick, count: [(count, 0)])  # no worker start-up here
    assert main(["bench", "--scenario", "samples", "--samples", "2000", "--quick", "--device", "cpu",
                 "--out", str(tmp_path), "--quiet"]) == 0
    assert json.loads((tmp_path / "bench.json").read_text())["runs"][0]["num_samples"] == 2000
    assert capsys.readouterr().out.endswith(f"results: {tmp_path / 'bench.json'}; chart: {tmp_path / 'bench.png'}\n")


def test_contention_runs_busy_neighbours_only_while_timing(tmp_path: Path, capsys, monkeypatch) -> None:
    """--contention N: N spinning processes during the timed loaders, all stopped after; the
    JSON says how many and the load."""
    import gpuload.bench.contention as contention

    started = []
    real = contention.busy_neighbours

    def watched(count: int):
        manager = real(count)
        class Watch:
            def __enter__(self):
                processes = manager.__enter__()
                started.extend(processes)
                assert all(p.poll() is None for p in processes)
                return processes
            def __exit__(self, *exc):
                return manager.__exit__(*exc)
        return Watch()

    monkeypatch.setattr(contention, "busy_neighbours", watched)
    assert main(["bench", *TINY, "--contention", "2", "--quiet", "--out", str(tmp_path / "out")]) == 0
    assert len(started) == 2 and all(p.poll() is not None for p in started)
    document = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert document["contention"]["busy_neighbours"] == 2 and document["contention"]["load_after_run"] is not None


def test_a_neighbour_that_ignores_sigterm_is_killed(tmp_path: Path, monkeypatch) -> None:
    import signal
    import time

    from gpuload.bench import contention

    ready = tmp_path / "ignoring"
    monkeypatch.setattr(contention, "_SPIN", "import pathlib, signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                        f"pathlib.Path({str(ready)!r}).touch()\nwhile True:\n    pass\n")
    monkeypatch.setattr(contention, "_STOP_WAIT_S", 0.2)
    with contention.busy_neighbours(1) as [neighbour]:
        deadline = time.monotonic() + 10
        while not ready.exists():  # SIGTERM is ignored from here on
            assert time.monotonic() < deadline and neighbour.poll() is None
            time.sleep(0.01)
    assert neighbour.returncode == -signal.SIGKILL


@pytest.mark.gpu
def test_a_pretended_card_is_refused_on_a_gpu_before_measuring(tmp_path: Path, capsys) -> None:
    line = run_failing([*TINY[:-2], "--device", "cuda", "--device-memory", "1GiB", "--out", str(tmp_path / "out")],
                       capsys)
    assert line.startswith("gpuload bench: error: argument --device-memory: it models the bytes on a CPU")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("scenario, interrupted", [("inmemory", "gpuload.bench.run.run_loaders"),
                                                  ("disk", "gpuload.bench.disk.run_disk")])
@pytest.mark.parametrize("out_existed", [False, True])
def test_ctrl_c_is_one_line_exit_130_and_leaves_nothing_behind(scenario: str, interrupted: str, out_existed: bool,
                                                               tmp_path: Path, monkeypatch, capsys) -> None:
    """Before: a 30-line KeyboardInterrupt traceback and an empty --out folder."""
    import importlib

    module, name = interrupted.rsplit(".", 1)

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(module), name, ctrl_c)
    out = tmp_path / "results" / "out"
    if out_existed:
        out.mkdir(parents=True)
        (out / "bench.json").write_text("{}")
    assert main(["bench", "--scenario", scenario, "--quick", "--samples", "64", "--epochs", "1",
                 "--torch-workers", "0", "--device", "cpu", "--out", str(out)]) == 130
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("gpuload bench: interrupted"), err
    if out_existed:
        assert [p.name for p in out.iterdir()] == ["bench.json"] and (out / "bench.json").read_text() == "{}"
    else:
        assert not (tmp_path / "results").exists()  # nor the parent folder the run made
