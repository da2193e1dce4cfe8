"""gpuload doctor: every item on one line, OK or what is wrong and what to do; never an error for a
missing optional package; the versions it reports are those of the DALI, CuPy and torch a training
job loads; its own process never imports torch (seconds), so it answers at once."""

from __future__ import annotations

import importlib.machinery
import io
import json
import os
import subprocess
import sys
import types
from collections.abc import Callable
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
    assert found["dali"]["status"] == "FAIL"
    assert "nvidia-dali-cuda120==2.4.0, nvidia-dali-cuda130==2.4.0" in found["dali"]["summary"]
    assert found["dali"]["fix"].startswith("pip uninstall nvidia-dali-cuda120 nvidia-dali-cuda130")
    assert found["cupy"]["status"] == "FAIL" and "pip uninstall cupy-cuda12x cupy-cuda13x" in found["cupy"]["fix"]


@pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch (the check compares its CUDA)")
def test_a_driver_older_than_torchs_cuda_is_a_failure_saying_what_to_do() -> None:
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


def test_the_launcher_line_names_the_device_local_rank_gives() -> None:
    line = doctor._check_launcher({"LOCAL_RANK": "1", "WORLD_SIZE": "2"}, 2)
    assert line == doctor.Finding("launcher", "OK", "LOCAL_RANK=1, WORLD_SIZE=2: device=None means cuda:1")
    line = doctor._check_launcher({"LOCAL_RANK": "5", "WORLD_SIZE": "8"}, 2)
    assert line.status == "FAIL" and "LOCAL_RANK='5' is not a CUDA device of this machine" in line.summary
    line = doctor._check_launcher({"WORLD_SIZE": "2"}, 2)
    assert line.status == "WARN" and "without LOCAL_RANK: device=None means cuda:0 on every rank" in line.summary
    assert doctor._check_launcher({"LOCAL_RANK": "1"}, 0).summary == "LOCAL_RANK=1: device=None means cpu"


@pytest.mark.skipif(not doctor._installed("nvidia.dali") or not doctor._installed("cupy"),
                    reason="needs DALI and CuPy installed (pip install 'gpuload[cuda12]')")
def test_dali_and_cupy_built_for_a_newer_cuda_than_the_driver_fail() -> None:
    found = findings(doctor.collect(read_driver=lambda: {"version": "470.256.02", "cuda": "11.4"},
                                    read_memlock=lambda: None))
    for topic in ("dali", "cupy"):
        assert found[topic]["status"] == "FAIL", found[topic]
        assert "the driver supports CUDA 11.4: it cannot run on this GPU" in found[topic]["summary"]
        assert "upgrade the NVIDIA driver" in found[topic]["fix"]


# --- each check's other outcomes, with the machine's readers replaced -----------------------------


def _torch(version: str, cuda: str | None) -> dict:
    """torch as the torch check reads it from its files: a version and a CUDA build."""
    return {"version": version, "cuda": cuda}


def _driver(cuda: str, devices: int = 0) -> dict:
    return {"cuda": cuda, "devices": [{"name": f"Fake GPU {i}", "total": 80 << 30} for i in range(devices)]}


def test_a_torch_older_than_the_floor_fails_with_the_upgrade() -> None:
    line = doctor._check_torch(_torch("2.3.1+cu121", "12.1"), {}, {})
    assert line == doctor.Finding("torch", "FAIL", "torch 2.3.1+cu121 is older than gpuload needs (>= 2.6)",
                                  "pip install -U 'torch>=2.6'")


def test_a_cpu_only_torch_warns_only_where_there_is_a_driver() -> None:
    versions: dict = {}
    with_driver = doctor._check_torch(_torch("2.7.0+cpu", None), {"cuda": "12.4"}, versions)
    assert with_driver.status == "WARN" and "a CPU-only build: gpuload cannot use this machine's GPU" in \
        with_driver.summary and with_driver.fix == "install a CUDA build: pip install -U torch"
    assert versions == {"torch": "2.7.0+cpu", "torch_cuda": None}
    without = doctor._check_torch(_torch("2.7.0+cpu", None), {}, {})
    assert without == doctor.Finding("torch", "OK", "torch 2.7.0+cpu, a CPU-only build (no GPU here)")


def test_the_torch_line_names_every_visible_device() -> None:
    versions: dict = {}
    line = doctor._check_torch(_torch("2.7.0+cu126", "12.6"), _driver("12.8", devices=2), versions)
    assert line == doctor.Finding("torch", "OK", "torch 2.7.0+cu126, built for CUDA 12.6; 2 device(s): "
                                  "cuda:0 Fake GPU 0, cuda:1 Fake GPU 1")
    assert versions["cuda_devices"] == 2


def test_a_driver_that_sees_no_device_names_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    line = doctor._check_torch(_torch("2.7.0+cu126", "12.6"), _driver("12.8"), {})
    assert line.status == "FAIL" and "although the driver is there (CUDA_VISIBLE_DEVICES='' hides them)" in \
        line.summary and "check CUDA_VISIBLE_DEVICES" in line.fix
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    line = doctor._check_torch(_torch("2.7.0+cu126", "12.6"), _driver("12.8"), {})
    assert line.summary.endswith("although the driver is there (no device is visible)")


def test_the_driver_reader_parses_the_kernel_module_and_asks_libcuda(monkeypatch: pytest.MonkeyPatch) -> None:
    proc = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
    real_open = open

    def fake_open(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        return io.StringIO(proc) if path == "/proc/driver/nvidia/version" else real_open(path, *args, **kwargs)

    def cu_driver_get_version(reference) -> int:  # type: ignore[no-untyped-def]
        reference._obj.value = 12020
        return 0

    monkeypatch.setattr(doctor, "open", fake_open, raising=False)
    monkeypatch.setattr(doctor.ctypes, "CDLL", lambda name: types.SimpleNamespace(
        cuDriverGetVersion=cu_driver_get_version))
    assert doctor.read_driver() == {"version": "535.104.05", "cuda": "12.2"}

    def no_file(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise FileNotFoundError(path)

    def no_library(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(doctor, "open", no_file, raising=False)
    monkeypatch.setattr(doctor.ctypes, "CDLL", no_library)
    assert doctor.read_driver() == {}
    assert doctor._loaded_libraries("libnvrtc") == []  # no /proc/self/maps: nothing known loaded


class _FakeLibcuda:
    """libcuda.so.1's driver API as the doctor calls it through ctypes: two devices, or cuInit's error."""

    def __init__(self, init_status: int = 0) -> None:
        self.init_status = init_status

    def cuDriverGetVersion(self, reference) -> int:  # type: ignore[no-untyped-def]  # noqa: N802
        reference._obj.value = 12080
        return 0

    def cuInit(self, flags: int) -> int:  # noqa: N802
        return self.init_status

    def cuGetErrorName(self, status: int, reference) -> int:  # type: ignore[no-untyped-def]  # noqa: N802
        reference._obj.value = b"CUDA_ERROR_UNKNOWN"
        return 0

    def cuDeviceGetCount(self, reference) -> int:  # type: ignore[no-untyped-def]  # noqa: N802
        reference._obj.value = 2
        return 0

    def cuDeviceGet(self, reference, index: int) -> int:  # type: ignore[no-untyped-def]  # noqa: N802
        reference._obj.value = 10 + index
        return 0

    def cuDeviceGetName(self, buffer, size: int, handle) -> int:  # type: ignore[no-untyped-def]  # noqa: N802
        buffer.value = f"Fake H100 #{handle.value}".encode()
        return 0

    def cuDeviceTotalMem_v2(self, reference, handle) -> int:  # type: ignore[no-untyped-def]  # noqa: N802
        reference._obj.value = (80 + handle.value - 10) << 30
        return 0

    def cuDeviceGetPCIBusId(self, buffer, size: int, handle) -> int:  # type: ignore[no-untyped-def]  # noqa: N802
        buffer.value = f"0000:{handle.value:02x}:00.0".encode()
        return 0


class _FakeNvml:
    """libnvidia-ml.so.1: free memory by PCI bus id (the bus number in GiB)."""

    def nvmlInit_v2(self) -> int:  # noqa: N802
        return 0

    def nvmlShutdown(self) -> int:  # noqa: N802
        return 0

    def nvmlDeviceGetHandleByPciBusId_v2(self, bus: bytes, reference) -> int:  # type: ignore[no-untyped-def]  # noqa: N802
        reference._obj.value = int(bus.split(b":")[1], 16)
        return 0

    def nvmlDeviceGetMemoryInfo(self, handle, reference) -> int:  # type: ignore[no-untyped-def]  # noqa: N802
        reference._obj.free = handle.value << 30
        return 0


def test_the_driver_reader_lists_the_devices_through_the_driver_api(monkeypatch: pytest.MonkeyPatch) -> None:
    libraries = {"libcuda.so.1": _FakeLibcuda(), "libnvidia-ml.so.1": _FakeNvml()}

    def load(name: str) -> object:
        if name not in libraries:
            raise OSError(f"{name}: cannot open shared object file")
        return libraries[name]

    monkeypatch.setattr(doctor.ctypes, "CDLL", load)
    driver = doctor.read_driver()
    assert driver["cuda"] == "12.8"
    assert driver["devices"] == [
        {"name": "Fake H100 #10", "total": 80 << 30, "pci_bus_id": "0000:0a:00.0", "free": 10 << 30},
        {"name": "Fake H100 #11", "total": 81 << 30, "pci_bus_id": "0000:0b:00.0", "free": 11 << 30}]
    found = findings(doctor.collect(read_driver=lambda: driver, read_memlock=lambda: None, probes=lambda n, t: {}))
    if torch.version.cuda is not None and int(torch.version.cuda.split(".")[0]) <= 12:
        assert "2 device(s): cuda:0 Fake H100 #10, cuda:1 Fake H100 #11" in found["torch"]["summary"]
    libraries["libcuda.so.1"] = _FakeLibcuda(init_status=100)  # CUDA_ERROR_NO_DEVICE: none visible
    assert doctor.read_driver()["devices"] == []
    libraries["libcuda.so.1"] = _FakeLibcuda(init_status=999)
    broken = doctor.read_driver()
    assert broken["devices"] == [] and broken["device_error"] == "cuInit returned CUDA error 999 (CUDA_ERROR_UNKNOWN)"
    line = doctor._check_torch({"version": "2.9.0+cu128", "cuda": "12.8"}, broken, {})
    assert line.status == "FAIL" and "the driver fails (cuInit returned CUDA error 999" in line.summary
    del libraries["libnvidia-ml.so.1"]  # no NVML: free memory unknown, the line says so
    libraries["libcuda.so.1"] = _FakeLibcuda()
    devices = doctor.read_driver()["devices"]
    assert [d.get("free") for d in devices] == [None, None]
    _, second = doctor._check_memory(devices, None, {"cuda_devices": 1})
    assert second == doctor.Finding("memory", "OK", "cuda:0: 80.00 GiB; free memory unknown here "
                                    "(libnvidia-ml.so.1 does not load): the cache reads it when it starts")


def test_a_module_that_cannot_be_looked_up_counts_as_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = types.ModuleType("gpuload_test_broken")
    broken.__spec__ = None  # find_spec raises ValueError for such a module
    monkeypatch.setitem(sys.modules, "gpuload_test_broken", broken)
    assert doctor._installed("gpuload_test_broken") is False
    assert doctor._installed("json") is True


def _fake_cupy(monkeypatch: pytest.MonkeyPatch, runtime: int, nvrtc: Callable[[], tuple[int, int]]) -> None:
    cupy = types.ModuleType("cupy")
    cupy.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    cupy.__version__ = "14.0.0"
    cuda = types.ModuleType("cupy.cuda")
    cuda.runtime = types.SimpleNamespace(runtimeGetVersion=lambda: runtime)
    cuda.nvrtc = types.SimpleNamespace(getVersion=nvrtc)
    cupy.cuda = cuda
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setattr(doctor, "_distributions", lambda prefixes: ["cupy-cuda12x==14.0.0"])


def test_the_cupy_line_for_a_broken_install_a_missing_nvrtc_and_one_cuda_major(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cupy = types.ModuleType("cupy")
    cupy.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", None)  # importing cupy.cuda fails
    monkeypatch.setattr(doctor, "_distributions", lambda prefixes: [])
    line = doctor._check_cupy({}, "12.6", doctor.probe_cupy())
    assert line.status == "FAIL" and line.summary.startswith("CuPy does not import (ModuleNotFoundError: ")
    assert line.fix.startswith("reinstall it: pip install 'gpuload[cuda13]'")

    def no_nvrtc() -> tuple[int, int]:
        raise RuntimeError("libnvrtc.so.12: cannot open shared object file")

    _fake_cupy(monkeypatch, 12090, no_nvrtc)
    line = doctor._check_cupy({}, "12.6", doctor.probe_cupy())
    assert line.status == "WARN" and line.summary == (
        "CuPy 14.0.0, CUDA runtime 12.9; NVRTC does not load (RuntimeError: libnvrtc.so.12: cannot open shared "
        "object file): the transforms fall back to torch ops")
    _fake_cupy(monkeypatch, 12090, lambda: (12, 9))
    monkeypatch.setattr(doctor, "_loaded_libraries", lambda pattern: ["/usr/lib/libnvrtc.so.12"])
    versions: dict = {}
    line = doctor._check_cupy(versions, "12.6", doctor.probe_cupy())
    assert line == doctor.Finding("cupy", "OK", "CuPy 14.0.0, CUDA runtime 12.9; compiles with NVRTC 12.9 "
                                  "(/usr/lib/libnvrtc.so.12)")
    assert versions["nvrtc"] == "12.9" and versions["nvrtc_path"] == "/usr/lib/libnvrtc.so.12"


@pytest.mark.skipif(not doctor._installed("nvidia.dali"), reason="needs DALI installed (its library is loaded)")
def test_a_dali_whose_library_does_not_load_fails_with_its_reason_and_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    real = doctor.read_dali()
    assert real is not None and real["load_error"] is None  # the installed DALI's library loads
    real_cdll = doctor.ctypes.CDLL

    def missing_runtime(name: str) -> object:
        if "backend_impl" in name:
            raise OSError("libcudart.so.12: cannot open shared object file: No such file or directory")
        return real_cdll(name)

    monkeypatch.setattr(doctor.ctypes, "CDLL", missing_runtime)
    line = doctor._check_dali({}, "13.0", doctor.read_dali())
    assert line.status == "FAIL" and line.summary == (
        f"DALI {real['version']} does not load (OSError: libcudart.so.12: cannot open shared object file: No such "
        "file or directory)")
    assert line.fix.startswith("reinstall it: pip install 'gpuload[cuda13]'")


def test_a_dali_older_than_gpuload_needs_fails() -> None:
    line = doctor._check_dali({}, "13.0", {"version": "1.40.0", "load_error": None})
    assert line.status == "FAIL" and line.summary.startswith("DALI 1.40.0 is too old") and "1.44" in line.summary


def test_a_torchvision_whose_ops_do_not_load_fails_naming_why(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    if not doctor._installed("torchvision"):
        pytest.skip("needs torchvision installed (its version is read from its metadata)")
    package = tmp_path / "torchvision"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        monkeypatch.delitem(sys.modules, name)
    line = doctor._check_torchvision({}, "13.0", doctor.read_torchvision())
    assert line.status == "FAIL" and f"C++ ops are missing (no _C library in {package})" in line.summary
    assert line.fix == "install the pair built together: pip install -U torch torchvision"
    (package / "_C.so").write_bytes(b"not a shared library")
    line = doctor._check_torchvision({}, "13.0", doctor.read_torchvision())
    assert line.status == "FAIL" and "C++ ops do not load" in line.summary and "_C.so" in line.summary


@pytest.mark.parametrize(("cuda", "torch_cuda", "status", "says"), [
    (None, None, "OK", "a CPU-only build: no nvJPEG decoder"),
    (None, "13.0", "WARN", "a CPU-only build: no nvJPEG decoder"),
    ("12.6", "13.0", "FAIL", "is built for CUDA 12.6, torch for CUDA 13.0"),
    ("13.0", "13.0", "OK", "CUDA 13.0: the nvJPEG decoder (backend='nvjpeg') is there for a GPU"),
])
def test_the_torchvision_line_compares_its_cuda_with_torchs(cuda: str | None, torch_cuda: str | None, status: str,
                                                           says: str) -> None:
    facts = {"version": "0.29.1", "folder": "/tv", "library": "/tv/_C.so", "library_is_elf": True, "cuda": cuda,
             "torch_required": "torch (>=2.14.0)"}
    line = doctor._check_torchvision({"torch": "2.14.1+cu130"}, torch_cuda, facts)
    assert line.status == status and says in line.summary, line
    assert bool(line.fix) == (status != "OK")


def test_a_torchvision_built_for_another_torch_fails_by_its_metadata_pin() -> None:
    facts = {"version": "0.22.0", "folder": "/tv", "library": "/tv/_C.so", "library_is_elf": True, "cuda": "12.6",
             "torch_required": "torch ==2.7.0"}
    line = doctor._check_torchvision({"torch": "2.14.1+cu130"}, "13.0", facts)
    assert line == doctor.Finding("torchvision", "FAIL", "torchvision 0.22.0 requires torch==2.7.0, torch 2.14.1+cu130 "
                                  "is installed: its C++ ops do not load into it",
                                  "install the pair built together: pip install -U torch torchvision")
    assert doctor._check_torchvision({"torch": "2.7.0+cu126"}, "12.6", facts).status == "OK"


def test_torch_and_torchvision_are_read_from_their_files_as_their_imports_say() -> None:
    assert doctor.read_torch() == {"version": torch.__version__, "cuda": torch.version.cuda}
    facts = doctor.read_torchvision()
    if facts is None:
        pytest.skip("needs torchvision installed")
    torch.ops.load_library(facts["library"])  # what torchvision's import does, and its answer
    number = int(torch.ops.torchvision._cuda_version())
    assert facts["cuda"] == (doctor._cuda_version(number) if number > 0 else None)
    assert facts["library_is_elf"] and facts["version"] == importlib.metadata.version("torchvision")


def test_the_doctors_process_never_imports_torch_and_cache_ls_neither(tmp_path: Path) -> None:
    """Importing torch takes seconds (over 3 on a busy machine): the doctor reads versions from
    files and the devices from the driver, loads DALI's library and imports CuPy in a child."""
    script = ("import sys; from gpuload.cli import main; status = main(sys.argv[1:]); "
              "print('IMPORTED', sorted(m for m in ('torch', 'numpy', 'cupy', 'nvidia.dali') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for argv in (["doctor", "--json"], ["cache", "ls", str(tmp_path)]):
        result = subprocess.run([sys.executable, "-c", script, *argv], cwd=tmp_path, env=env, capture_output=True,
                                text=True, timeout=300)
        assert result.stdout.strip().splitlines()[-1] == "IMPORTED []", (argv, result.stdout[-2000:],
                                                                         result.stderr[-2000:])


def test_a_check_whose_import_does_not_finish_in_time_says_so() -> None:
    if not doctor._installed("cupy"):
        pytest.skip("needs CuPy installed (the child imports it)")
    facts = doctor.run_probes(["cupy"], timeout=0.001)  # no interpreter starts that fast: killed
    assert facts == {"cupy": {"timeout": 0.001}}
    line = doctor._check_cupy({}, "13.0", facts["cupy"])
    assert line.status == "WARN" and "importing it did not finish in 0.001 s (a busy machine?): not checked" in \
        line.summary and line.fix == "run it again with more time: gpuload doctor --timeout 60"


def test_a_check_whose_process_dies_says_how(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "_PROBE_MAIN", "import sys; sys.stderr.write('Segmentation fault'); sys.exit(139)")
    facts = doctor.run_probes(["cupy"], timeout=60)
    assert facts == {"cupy": {"error": "its check's process exited with status 139: Segmentation fault"}}


def test_a_memlock_limit_of_a_gibibyte_or_more_is_ok() -> None:
    versions: dict = {}
    line = doctor._check_pinned(8 << 30, versions)
    assert line == doctor.Finding("pinned", "OK", "locked-memory limit (ulimit -l): 8.00 GiB")
    assert versions["memlock"] == 8 << 30


def test_the_memory_lines_give_each_devices_cache_room(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    devices = [{"name": "A", "total": 80 << 30, "free": 60 << 30},
               {"name": "B", "total": 80 << 30, "free": 1 << 30}]  # cuda:1 has less free than the reserve
    _, settings = doctor._check_settings({"GPULOAD_CACHE_RESERVE": "4GiB"}, str(tmp_path))
    versions = {"cuda_devices": 2}
    host, first, second = doctor._check_memory(devices, settings, versions)
    assert host.status == "OK" and host.summary.startswith("host: ")
    assert first == doctor.Finding("memory", "OK", "cuda:0: 60.00 GiB free of 80.00 GiB; the device cache may "
                                   "take 56.00 GiB (budget, less cache_reserve)")
    assert second.status == "WARN" and second.summary.startswith("cuda:1: 1.00 GiB free of 80.00 GiB; the device "
                                                                  "cache may take 0 B")
    assert "free memory is under the reserve" in second.fix
    assert versions["device_memory"]["cuda:0"] == {"free": 60 << 30, "total": 80 << 30, "torch_cached": 0,
                                                   "cache_room": 56 << 30}


def _readme_install_packages() -> tuple[str, list[str]]:
    """The CUDA extra the README's install command takes, and the packages pyproject lists for it."""
    import re

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - python 3.10 only
        import tomli as tomllib

    command = re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())[0]
    (extra,) = [e for e in re.search(r"install -e '\.\[([\w,]+)\]'", command)[1].split(",") if e.startswith("cuda")]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return extra, [re.match(r"[\w-]+", requirement)[0] for requirement in extras[extra]]


def _torch_wheel_cuda() -> str | None:
    """The CUDA of the torch wheel pip installs by default: its cuda-toolkit pin, else the build's."""
    import importlib.metadata
    import re

    for requirement in importlib.metadata.requires("torch") or []:
        pinned = re.match(r"cuda-toolkit\S*==(\d+\.\d+)", requirement)
        if pinned:
            return pinned[1]
    return torch.version.cuda


@pytest.mark.skipif(_torch_wheel_cuda() is None, reason="needs torch's CUDA wheel (the README's install)")
def test_the_readmes_install_gets_no_warning_from_the_doctor(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the README's install loads, fed to the doctor's checks: the extra's CuPy and DALI
    (their CUDA major read from their package names) beside torch's default wheel, whose NVRTC
    CuPy picks up (torch loads it first). Before: the cuda12 extra, 'two CUDA majors in one
    process', and a fix telling the user to undo the README's install."""
    extra, packages = _readme_install_packages()
    torch_cuda = _torch_wheel_cuda()
    torch_major = int(torch_cuda.split(".")[0])
    (cupy_package,) = [p for p in packages if p.startswith("cupy-cuda")]
    (dali_package,) = [p for p in packages if p.startswith("nvidia-dali-cuda")]
    cupy_major = int(cupy_package.removeprefix("cupy-cuda").rstrip("x"))
    installed = {("cupy",): [f"{cupy_package}==14.2.0"], ("nvidia-dali",): [f"{dali_package}==2.4.0"]}
    _fake_cupy(monkeypatch, cupy_major * 1000, lambda: (torch_major, 0))
    monkeypatch.setattr(doctor, "_distributions", lambda prefixes: installed[prefixes])
    monkeypatch.setattr(doctor, "_loaded_libraries", lambda pattern: [f"/venv/nvidia/cu{torch_major}/lib/libnvrtc.so"])
    versions = {"driver_cuda": torch_cuda}  # a driver for torch's CUDA
    found = [doctor._check_cupy(versions, torch_cuda, doctor.probe_cupy()),
             doctor._check_dali(versions, torch_cuda, {"version": "2.4.0", "load_error": None})]
    assert [line.status for line in found] == ["OK", "OK"], (extra, found)
    assert f"CUDA runtime {cupy_major}.0; compiles with NVRTC {torch_major}.0" in found[0].summary
    assert "beside torch's" not in found[1].summary, found[1]  # one CUDA major: no note on a second
