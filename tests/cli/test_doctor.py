"""gpuload doctor: every item on one line, OK or what is wrong and what to do; never an error for a
missing optional package; the versions it reports are those of the DALI, CuPy and torch that
load together in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpuload.cli import doctor, main

ROOT = Path(__file__).resolve().parents[2]
TOPICS = ["driver", "torch", "cupy", "dali", "torchvision", "pinned", "memory", "launcher", "cache settings"]
NO_DRIVER = dict  # a reader that finds no driver: {}


def findings(report: dict) -> dict[str, dict]:
    return {f["topic"]: f for f in report["findings"]}


def test_every_line_says_ok_or_what_is_wrong_and_what_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["doctor"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("gpuload 0.1.0 doctor: Python ")
    report_lines = [line for line in lines[1:] if not line.lstrip().startswith("->")]
    assert [line.split(None, 1)[0] for line in report_lines] == [
        line.split(None, 1)[0] for line in report_lines if line.split(None, 1)[0] in ("OK", "WARN", "FAIL")]
    for topic in TOPICS:
        assert any(line[6:].startswith(topic) for line in report_lines), topic
    for k, line in enumerate(lines[1:], start=1):  # every WARN or FAIL is followed by its fix
        if line.startswith(("WARN", "FAIL")):
            assert lines[k + 1].lstrip().startswith("-> "), line
    assert status == (1 if any(line.startswith("FAIL") for line in report_lines) else 0)


def test_json_is_the_same_report_for_a_bug_report(capsys: pytest.CaptureFixture[str]) -> None:
    main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert [f["topic"] for f in report["findings"] if f["topic"] != "memory"] == [t for t in TOPICS if t != "memory"]
    assert all(f["status"] in ("OK", "WARN", "FAIL") and (f["status"] == "OK" or f["fix"]) for f in report["findings"])
    assert report["versions"]["torch"] == torch.__version__
    assert report["ok"] == all(f["status"] != "FAIL" for f in report["findings"])


STACK = r"""
import json
import numpy as np
import nvidia.dali as dali, cupy, torch                     # one process, as a training job
from nvidia.dali import fn, pipeline_def
from cupy.cuda import nvrtc
from gpuload.cli.doctor import collect

import io
from PIL import Image

jpeg = io.BytesIO()
Image.new("RGB", (5, 3), (200, 10, 10)).save(jpeg, "JPEG", quality=95)

@pipeline_def(batch_size=1, num_threads=1, device_id=None)
def decode():
    return fn.decoders.image(fn.external_source(name="x", dtype=dali.types.UINT8, ndim=1), device="cpu")

pipe = decode()
pipe.build()
pipe.feed_input("x", [np.frombuffer(jpeg.getvalue(), dtype=np.uint8)])
(out,) = pipe.run()
program = nvrtc.createProgram('extern "C" __global__ void k(float* x) { x[0] = 1.0f; }', "k.cu", [], [])
nvrtc.compileProgram(program, ["-arch=compute_75"])
report = collect()
print(json.dumps({
    "report": report,
    "dali_ran": list(np.asarray(out.as_tensor()).shape),
    "ptx": len(nvrtc.getPTX(program)),
    "torch_ran": int(torch.arange(4).sum()),
    "actual": {"dali": dali.__version__, "cupy": cupy.__version__, "torch": torch.__version__,
               "cupy_cuda": cupy.cuda.runtime.runtimeGetVersion(), "nvrtc": list(nvrtc.getVersion()),
               "torch_cuda": torch.version.cuda},
}))
"""


@pytest.mark.skipif(not doctor._installed("nvidia.dali") or not doctor._installed("cupy"),
                    reason="needs DALI and CuPy installed (pip install 'gpuload[cuda12]')")
def test_dali_cupy_and_torch_load_and_run_in_one_process_and_the_doctor_reports_their_versions() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", STACK], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ran = json.loads(result.stdout.strip().splitlines()[-1])
    assert ran["dali_ran"] == [1, 3, 5, 3] and ran["ptx"] > 0 and ran["torch_ran"] == 6
    versions, actual = ran["report"]["versions"], ran["actual"]
    assert versions["dali"] == actual["dali"] and versions["cupy"] == actual["cupy"]
    assert versions["torch"] == actual["torch"] and versions["torch_cuda"] == actual["torch_cuda"]
    assert versions["cupy_cuda"] == doctor._cuda_version(actual["cupy_cuda"])
    assert versions["nvrtc"] == "{}.{}".format(*actual["nvrtc"])
    # the CUDA build of DALI is the one its package names (nvidia-dali-cuda120: 12.0)
    (package,) = versions["dali_packages"]
    assert package.startswith(f"nvidia-dali-cuda{versions['dali_cuda'].replace('.', '')}==")
    report = findings(ran["report"])
    assert report["dali"]["status"] == "OK" and report["cupy"]["status"] in ("OK", "WARN")


def test_missing_optional_packages_are_lines_not_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("cupy", "nvidia.dali", "torchvision"):
        monkeypatch.setitem(sys.modules, module, None)  # import fails and find_spec says absent
    monkeypatch.setattr(doctor, "_distributions", lambda prefixes: [])
    report = doctor.collect(read_driver=NO_DRIVER, read_memlock=lambda: None)
    found = findings(report)
    assert report["ok"]
    assert found["cupy"]["status"] == "WARN" and "CuPy is not installed" in found["cupy"]["summary"]
    assert found["dali"]["status"] == "WARN" and "DALI is not installed" in found["dali"]["summary"]
    assert found["torchvision"]["status"] == "WARN" and "gpuload[torchvision]" in found["torchvision"]["fix"]
    assert "gpuload[cuda12]" in found["dali"]["fix"] and "gpuload[cuda13]" in found["cupy"]["fix"]


def test_two_dali_or_cupy_packages_are_a_failure_naming_them(monkeypatch: pytest.MonkeyPatch) -> None:
    packages = {("nvidia-dali",): ["nvidia-dali-cuda120==2.4.0", "nvidia-dali-cuda130==2.4.0"],
                ("cupy",): ["cupy-cuda12x==14.2.0", "cupy-cuda13x==14.2.0"]}
    monkeypatch.setattr(doctor, "_distributions", lambda prefixes: packages[prefixes])
    report = doctor.collect(read_driver=NO_DRIVER, read_memlock=lambda: None)
    found = findings(report)
    assert not report["ok"]
    assert found["dali"]["status"] == "FAIL" and "nvidia-dali-cuda120==2.4.0, nvidia-dali-cuda130==2.4.0" in \
        found["dali"]["summary"] and found["dali"]["fix"].startswith("pip uninstall nvidia-dali-cuda120 nvidia-dali-cuda130")
    assert found["cupy"]["status"] == "FAIL" and "pip uninstall cupy-cuda12x cupy-cuda13x" in found["cupy"]["fix"]


@pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch (the check compares its CUDA)")
def test_a_driver_older_than_torchs_cuda_is_a_failure_saying_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    older = f"{int(torch.version.cuda.split('.')[0]) - 1}.4"
    report = doctor.collect(read_driver=lambda: {"version": "535.104.05", "cuda": older}, read_memlock=lambda: None)
    found = findings(report)
    assert found["driver"] == {"topic": "driver", "status": "OK", "fix": "",
                               "summary": f"NVIDIA driver 535.104.05, supports CUDA up to {older}"}
    assert found["torch"]["status"] == "FAIL" and f"the driver supports CUDA {older}, older than" in \
        found["torch"]["summary"] and "upgrade the NVIDIA driver" in found["torch"]["fix"]
    assert not report["ok"]


def test_no_driver_is_a_cpu_machine_not_a_failure() -> None:
    found = findings(doctor.collect(read_driver=NO_DRIVER, read_memlock=lambda: None))
    assert found["driver"]["status"] == "WARN" and "gpuload runs on the CPU" in found["driver"]["summary"]
    assert found["torch"]["status"] == "OK"


def test_the_memlock_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    low = findings(doctor.collect(read_driver=NO_DRIVER, read_memlock=lambda: 64 * 1024))
    assert low["pinned"]["status"] == "WARN" and "64.00 KiB" in low["pinned"]["summary"]
    assert "ulimit -l unlimited" in low["pinned"]["fix"]
    unlimited = findings(doctor.collect(read_driver=NO_DRIVER, read_memlock=lambda: None))
    assert unlimited["pinned"]["status"] == "OK" and "unlimited" in unlimited["pinned"]["summary"]


def test_cache_settings_say_where_each_came_from_and_a_bad_one_fails(tmp_path: Path) -> None:
    (tmp_path / "gpuload.toml").write_text('cache_size = "2GiB"\n')
    found = findings(doctor.collect(environ={"GPULOAD_CACHE_RESERVE": "1GiB"}, cwd=str(tmp_path),
                                    read_driver=NO_DRIVER, read_memlock=lambda: None))
    summary = found["cache settings"]["summary"]
    assert found["cache settings"]["status"] == "OK"
    assert f"cache_size=2.00 GiB ({tmp_path / 'gpuload.toml'})" in summary
    assert "(environment variable GPULOAD_CACHE_RESERVE)" in summary and f"config file: {tmp_path}" in summary
    bad = doctor.collect(environ={"GPULOAD_CACHE_SIZE": "lots"}, cwd=str(tmp_path), read_driver=NO_DRIVER,
                         read_memlock=lambda: None)
    line = findings(bad)["cache settings"]
    assert line["status"] == "FAIL" and "GPULOAD_CACHE_SIZE" in line["summary"] and not bad["ok"]


def test_the_launcher_line_names_the_device_local_rank_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("LOCAL_RANK", "1")  # resolve_device reads the process's environment
    line = doctor._check_launcher({"LOCAL_RANK": "1", "WORLD_SIZE": "2"}, torch)
    assert line == doctor.Finding("launcher", "OK", "LOCAL_RANK=1, WORLD_SIZE=2: device=None means cuda:1")
    monkeypatch.setenv("LOCAL_RANK", "5")
    line = doctor._check_launcher({"LOCAL_RANK": "5", "WORLD_SIZE": "8"}, torch)
    assert line.status == "FAIL" and "LOCAL_RANK='5' is not a CUDA device of this machine" in line.summary
    monkeypatch.delenv("LOCAL_RANK")
    line = doctor._check_launcher({"WORLD_SIZE": "2"}, torch)
    assert line.status == "WARN" and "without LOCAL_RANK: device=None means cuda:0 on every rank" in line.summary


@pytest.mark.skipif(not doctor._installed("nvidia.dali") or not doctor._installed("cupy"),
                    reason="needs DALI and CuPy installed (pip install 'gpuload[cuda12]')")
def test_dali_and_cupy_built_for_a_newer_cuda_than_the_driver_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    found = findings(doctor.collect(read_driver=lambda: {"version": "470.256.02", "cuda": "11.4"},
                                    read_memlock=lambda: None))
    for topic in ("dali", "cupy"):
        assert found[topic]["status"] == "FAIL", found[topic]
        assert "the driver supports CUDA 11.4: it cannot run on this GPU" in found[topic]["summary"]
        assert "upgrade the NVIDIA driver" in found[topic]["fix"]
