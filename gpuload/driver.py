"""The NVIDIA driver read without torch: the devices this process may use (``libcuda.so.1``'s
driver API, which honours ``CUDA_VISIBLE_DEVICES`` as torch does) and their free memory (NVML).

Importing torch takes seconds; these calls take milliseconds and create no CUDA context, so the
command line refuses ``--device cuda`` on a machine without one, and ``gpuload doctor`` lists
the devices, before anything imports torch.
"""

from __future__ import annotations

import ctypes
from typing import Any

__all__ = ["DriverError", "device_count", "visible_devices"]

CUDA_ERROR_NO_DEVICE = 100


class DriverError(RuntimeError):
    """A CUDA driver API call returned an error."""


def _call(libcuda: Any, name: str, *args: Any) -> None:
    status = int(getattr(libcuda, name)(*args))
    if status:
        text = ctypes.c_char_p()
        try:
            libcuda.cuGetErrorName(status, ctypes.byref(text))
        except AttributeError:
            pass
        label = text.value.decode() if text.value else "unknown"
        raise DriverError(f"{name} returned CUDA error {status} ({label})")


def _initialised_count(libcuda: Any) -> int:
    """``cuInit`` then ``cuDeviceGetCount``: 0 where the driver loads but no device is visible."""
    try:
        _call(libcuda, "cuInit", 0)
    except DriverError as error:
        if f"error {CUDA_ERROR_NO_DEVICE} " in str(error):
            return 0
        raise
    count = ctypes.c_int(0)
    _call(libcuda, "cuDeviceGetCount", ctypes.byref(count))
    return count.value


def device_count() -> int:
    """How many CUDA devices the driver shows this process; 0 when no driver loads, it sees no
    device, or it fails."""
    try:
        return _initialised_count(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError, DriverError):
        return 0


def visible_devices(libcuda: Any) -> list[dict[str, Any]]:
    """The visible devices through the driver API of a loaded ``libcuda`` (no context is created):
    name, total bytes and PCI bus id, and ``free`` bytes from NVML where it loads (found by PCI bus
    id, so the indices stay CUDA's). Raises :class:`DriverError` when the driver fails."""
    devices = []
    for index in range(_initialised_count(libcuda)):
        handle, name, bus = ctypes.c_int(0), ctypes.create_string_buffer(256), ctypes.create_string_buffer(64)
        total = ctypes.c_size_t(0)
        _call(libcuda, "cuDeviceGet", ctypes.byref(handle), index)
        _call(libcuda, "cuDeviceGetName", name, len(name), handle)
        _call(libcuda, "cuDeviceTotalMem_v2", ctypes.byref(total), handle)
        _call(libcuda, "cuDeviceGetPCIBusId", bus, len(bus), handle)
        devices.append({"name": name.value.decode(errors="replace"), "total": int(total.value),
                        "pci_bus_id": bus.value.decode(errors="replace")})
    _add_free_memory(devices)
    return devices


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _add_free_memory(devices: list[dict[str, Any]]) -> None:
    """Each device's free bytes from NVML (``free`` stays absent where NVML does not load)."""
    if not devices:
        return
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return
    except (OSError, AttributeError):
        return
    try:
        for device in devices:
            handle, memory = ctypes.c_void_p(), _NvmlMemory()
            if nvml.nvmlDeviceGetHandleByPciBusId_v2(device["pci_bus_id"].encode(), ctypes.byref(handle)) == 0 \
                    and nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) == 0:
                device["free"] = int(memory.free)
    finally:
        nvml.nvmlShutdown()
