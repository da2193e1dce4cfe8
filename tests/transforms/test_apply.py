"""transform_batch's backend fallback: only compile/launch-capability failures switch the kernels
off for a device; out of memory, CUDA errors and bugs reach the caller. Failures are injected
into the kernel launch on the CPU (the kernel path is forced with a patched ``available``)."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch

from gpuload import transforms as T
from gpuload.transforms import _kernels

OPS = [T.RandomResizedCrop(8), T.RandomHorizontalFlip(), T.ToDtype(torch.float32)]


@pytest.fixture
def kernels_forced(monkeypatch):
    """The kernel path is chosen on the CPU; returns the list of devices marked unavailable."""
    monkeypatch.setattr(_kernels, "available", lambda device: (True, ""))
    marked: list[tuple[torch.device, str]] = []
    monkeypatch.setattr(_kernels, "mark_unavailable", lambda device, reason: marked.append((device, reason)))
    return marked


def _launch_raising(exc: BaseException):
    def launch(*args, **kwargs):
        raise exc

    return launch


def _batch():
    return torch.randint(0, 256, (4, 3, 12, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def _cuda_driver_error(status: int) -> Exception:
    driver = pytest.importorskip("cupy").cuda.driver

    class DriverError(driver.CUDADriverError):  # the real one asks libcuda for the error's name
        def __init__(self, status: int) -> None:
            RuntimeError.__init__(self, f"CUresult {status}")
            self.status = status

    return DriverError(status)


@pytest.mark.parametrize(
    "make_error",
    [
        lambda: torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        lambda: RuntimeError("CUDA error: an illegal memory access was encountered"),
        lambda: _cuda_driver_error(700),  # CUDA_ERROR_ILLEGAL_ADDRESS
        lambda: _cuda_driver_error(2),  # CUDA_ERROR_OUT_OF_MEMORY
        lambda: ValueError("a bug in the launcher"),
    ],
    ids=["torch_oom", "cuda_error", "driver_illegal_address", "driver_oom", "bug"],
)
def test_oom_and_cuda_errors_propagate_and_keep_the_kernels(kernels_forced, monkeypatch, make_error):
    error = make_error()
    monkeypatch.setattr(_kernels, "_launch", _launch_raising(error))
    with pytest.raises(type(error)) as raised:
        T.transform_batch(OPS, _batch(), 0, 0, torch.arange(4), backend="auto")
    assert raised.value is error
    assert kernels_forced == []  # the kernels stay on for this device


def _cupy_failing_to_build(error: BaseException):
    """A stand-in CuPy whose kernel build (NVRTC compile + module load) raises ``error``."""

    class Module:
        def __init__(self, code, options=()):
            pass

        def get_function(self, name):
            raise error

    return types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda index: contextlib.nullcontext()),
                                 RawModule=Module)


@pytest.mark.parametrize(
    "make_cupy, says",
    [
        (lambda: None, "CuPy does not import"),  # sys.modules["cupy"] = None: import fails
        (lambda: _cupy_failing_to_build(_cuda_driver_error(209)), "CUDA_ERROR_NO_BINARY_FOR_GPU"),
        (lambda: _cupy_failing_to_build(_cuda_driver_error(222)), "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"),
        (lambda: _cupy_failing_to_build(
            pytest.importorskip("cupy").cuda.compiler.CompileException("error: x", "src", "k", ())),
         "NVRTC cannot compile"),
        (lambda: _cupy_failing_to_build(pytest.importorskip("cupy").cuda.nvrtc.NVRTCError(6)), "NVRTC failed"),
        (lambda: _cupy_failing_to_build(RuntimeError("CuPy failed to load libnvrtc.so.12")),
         "a CUDA library is missing"),
    ],
    ids=["no_cupy", "no_binary", "ptx_version", "compile_error", "nvrtc_error", "missing_library"],
)
def test_capability_failures_fall_back_to_the_batched_ops_once(kernels_forced, monkeypatch, make_cupy, says):
    monkeypatch.setitem(sys.modules, "cupy", make_cupy())
    monkeypatch.setattr(_kernels, "_functions", {})
    batch, device = _batch(), torch.device("cpu", 0)  # stands for the CUDA device
    with pytest.warns(UserWarning, match=says):
        out, backend = T.transform_batch(OPS, batch, 0, 0, torch.arange(4), device, backend="auto")
    assert backend == "batched"  # the batched torch ops, bit-exact with the reference
    assert torch.equal(out, T.apply_transforms(OPS, batch, 0, 0, torch.arange(4), backend="torch"))
    assert len(kernels_forced) == 1 and says in kernels_forced[0][1]
    with pytest.raises(_kernels.KernelUnavailable, match=says):  # backend="cupy" never falls back
        T.transform_batch(OPS, batch, 0, 0, torch.arange(4), device, backend="cupy")


def test_available_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(_kernels, "_status", {})
    monkeypatch.setitem(sys.modules, "cupy", None)
    ok, reason = _kernels.available(torch.device("cuda", 0))
    assert not ok and "CuPy does not import" in reason and "pip install cupy" in reason

    def no_nvrtc():
        raise RuntimeError("CuPy failed to load libnvrtc.so.12")

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(nvrtc=types.SimpleNamespace(getVersion=no_nvrtc)))
    monkeypatch.setattr(_kernels, "_status", {})
    monkeypatch.setitem(sys.modules, "cupy", fake)
    ok, reason = _kernels.available(torch.device("cuda", 0))
    assert not ok and "NVRTC" in reason and "CUDA build of torch" in reason
    assert _kernels.available(torch.device("cuda", 0)) == (ok, reason)  # checked once per device


def test_nvrtc_loads_here_so_auto_does_not_fall_back_for_it(monkeypatch):
    """With the test extra installed, the only thing this machine lacks is the GPU."""
    pytest.importorskip("cupy")
    monkeypatch.setattr(_kernels, "_status", {})
    ok, reason = _kernels.available(torch.device("cuda", 0))
    if not torch.cuda.is_available():
        assert not ok and "NVRTC" not in reason and "CuPy does not import" not in reason, reason


def test_an_nvrtc_out_of_memory_is_not_taken_for_a_missing_capability(kernels_forced, monkeypatch):
    error = pytest.importorskip("cupy").cuda.nvrtc.NVRTCError(_kernels._NVRTC_ERROR_OUT_OF_MEMORY)
    monkeypatch.setitem(sys.modules, "cupy", _cupy_failing_to_build(error))
    monkeypatch.setattr(_kernels, "_functions", {})
    with pytest.raises(type(error)) as raised:
        T.transform_batch(OPS, _batch(), 0, 0, torch.arange(4), torch.device("cpu", 0), backend="auto")
    assert raised.value is error and kernels_forced == []


def test_available_counts_cupys_devices(monkeypatch):
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        nvrtc=types.SimpleNamespace(getVersion=lambda: (12, 4)),
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1),
    ))
    monkeypatch.setattr(_kernels, "_status", {})
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert _kernels.available(torch.device("cuda", 0)) == (True, "")
    assert _kernels.available(torch.device("cuda", 2)) == (False, "CuPy sees 1 device(s), not cuda:2")


def test_a_device_marked_unavailable_stays_so_with_its_reason(monkeypatch):
    monkeypatch.setattr(_kernels, "_status", {0: ""})
    assert _kernels.available(torch.device("cuda", 0)) == (True, "")
    _kernels.mark_unavailable(torch.device("cuda", 0), "the device cannot load the kernel")
    assert _kernels.available(torch.device("cuda", 0)) == (False, "the device cannot load the kernel")
