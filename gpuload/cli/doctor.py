"""``gpuload doctor``: what this machine gives gpuload, one line per item, each OK or what is
wrong and what to do. The command a user runs first when something is off, and pastes into a
bug report (``--json``); modelled on ``python -m torch.utils.collect_env``.

It reads the NVIDIA driver, torch and whether it sees a device, CuPy's CUDA runtime and the NVRTC
it loaded, DALI and its CUDA build, torchvision's nvJPEG, the pinned-memory limit, free device and
host memory as the cache budget sees them, the launcher's variables and the cache settings that
apply. DALI, CuPy and torch are imported into this one process, as a training job would: a set
that cannot load together fails here. A missing optional package is a line saying what it costs
and how to install it, never an error. Exit status 1 when a line says FAIL, else 0.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import resource
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Finding", "add_arguments", "collect", "run"]

TORCH_FLOOR = (2, 6)  # pyproject.toml's torch>=2.6: DataLoader's in_order=
INSTALL_GPU = "pip install 'gpuload[cuda13]' (or 'gpuload[cuda12]' beside a torch built for CUDA 12; never both)"
_PINNED_LOW = 1 << 30  # a memlock limit under this may cap pinned memory (and NCCL over InfiniBand)


@dataclass(frozen=True)
class Finding:
    """One line of the report: ``status`` is ``"OK"``, ``"WARN"`` (works, with less or with a
    risk) or ``"FAIL"`` (will not work as it is); ``fix`` says what to do when not OK."""

    topic: str
    status: str
    summary: str
    fix: str = ""


def _cuda_version(number: int) -> str:
    """CUDA's integer version (12090, 13000) as "12.9", "13.0"."""
    return f"{number // 1000}.{number % 1000 // 10}"


def _major(version: str | None) -> int | None:
    match = re.match(r"(\d+)", version or "")
    return int(match[1]) if match else None


def _distributions(prefixes: tuple[str, ...]) -> list[str]:
    """Installed distributions whose normalized name starts with one of ``prefixes``, as
    ``name==version``: read from the ``.dist-info`` folder names on ``sys.path`` (parsing every
    distribution's metadata would take a second)."""
    found = set()
    for folder in dict.fromkeys(sys.path):
        try:
            entries = os.listdir(folder or ".")
        except OSError:
            continue
        for entry in entries:
            match = re.match(r"(.+?)-([^-]+)\.dist-info$", entry)
            if match:
                name = re.sub(r"[-_.]+", "-", match[1]).lower()
                if name.startswith(prefixes):
                    found.add(f"{name}=={match[2]}")
    return sorted(found)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _loaded_libraries(pattern: str) -> list[str]:
    """Paths of the shared libraries this process has mapped whose file name matches ``pattern``."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if re.search(pattern, os.path.basename(p)))


# --- probes: each returns what it read; tests replace them ------------------------------------


def read_driver() -> dict[str, Any]:
    """The NVIDIA driver: its version (/proc/driver/nvidia/version) and the CUDA version it
    supports (``cuDriverGetVersion``, which needs no device); empty where there is none."""
    found: dict[str, Any] = {}
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as text:
            match = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", text.read())
        if match:
            found["version"] = match[1]
    except OSError:
        pass
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        number = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(number)) == 0 and number.value > 0:
            found["cuda"] = _cuda_version(number.value)
    except (OSError, AttributeError):
        pass
    return found


def read_memlock() -> int | None:
    """The soft limit on locked memory (``ulimit -l``) in bytes; None for unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


# --- the checks -------------------------------------------------------------------------------


def _driver_too_old(versions: dict[str, Any], built: str, what: str) -> Finding | None:
    """A FAIL when the driver supports an older CUDA major than ``what`` was built for."""
    driver = versions.get("driver_cuda")
    if driver and (_major(driver) or 0) < (_major(built) or 0):
        return Finding(what.split()[0].lower(), "FAIL", f"{what} is built for CUDA {built}, the driver supports "
                       f"CUDA {driver}: it cannot run on this GPU",
                       f"upgrade the NVIDIA driver to one for CUDA {_major(built)}, or install the "
                       f"gpuload[cuda{_major(driver)}] extra if there is one")
    return None


def _check_driver(driver: dict[str, Any]) -> Finding:
    if not driver.get("cuda"):
        where = f"driver {driver['version']} is installed but libcuda.so.1 does not load" if driver.get("version") \
            else "no NVIDIA driver found (libcuda.so.1 does not load)"
        return Finding("driver", "WARN", f"{where}: gpuload runs on the CPU",
                       "to use a GPU, install the NVIDIA driver (in a container: run it with --gpus all)")
    version = driver.get("version", "version unknown")
    return Finding("driver", "OK", f"NVIDIA driver {version}, supports CUDA up to {driver['cuda']}")


def _check_torch(torch: Any, driver: dict[str, Any], versions: dict[str, Any]) -> Finding:
    version = torch.__version__
    versions["torch"], versions["torch_cuda"] = version, torch.version.cuda
    numbers = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    if numbers < TORCH_FLOOR:
        return Finding("torch", "FAIL", f"torch {version} is older than gpuload needs (>= 2.6)",
                       "pip install -U 'torch>=2.6'")
    built = torch.version.cuda
    if built is None:
        if driver.get("cuda"):
            return Finding("torch", "WARN", f"torch {version} is a CPU-only build: gpuload cannot use this "
                           "machine's GPU", "install a CUDA build: pip install -U torch")
        return Finding("torch", "OK", f"torch {version}, a CPU-only build (no GPU here)")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    versions["cuda_devices"] = count
    if count:
        names = ", ".join(f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(count))
        return Finding("torch", "OK", f"torch {version}, built for CUDA {built}; {count} device(s): {names}")
    summary = f"torch {version}, built for CUDA {built}, sees no CUDA device"
    if not driver.get("cuda"):
        return Finding("torch", "OK", f"{summary} (no driver): gpuload runs on the CPU")
    driver_major = _major(driver["cuda"])
    if driver_major is not None and driver_major < (_major(built) or 0):
        return Finding("torch", "FAIL", f"{summary}: the driver supports CUDA {driver['cuda']}, older than "
                       f"torch's CUDA {built}",
                       f"upgrade the NVIDIA driver to one for CUDA {_major(built)}, or install torch for "
                       f"CUDA {_major(driver['cuda'])} (pip install torch --index-url "
                       f"https://download.pytorch.org/whl/cu{_major(driver['cuda'])}x, see pytorch.org)")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hint = f"CUDA_VISIBLE_DEVICES={visible!r} hides them" if visible is not None else "no device is visible"
    return Finding("torch", "FAIL", f"{summary} although the driver is there ({hint})",
                   "check CUDA_VISIBLE_DEVICES, and in a container that it runs with --gpus")


def _several(check: str, label: str, packages: list[str], why: str) -> Finding:
    """The failure for more than one build of a package in one environment (one CUDA major each)."""
    return Finding(check, "FAIL", f"{len(packages)} {label} packages are installed ({', '.join(packages)}): {why}",
                   f"pip uninstall {' '.join(p.split('==')[0] for p in packages)}, then {INSTALL_GPU}")


def _check_cupy(versions: dict[str, Any], torch_cuda: str | None) -> Finding:
    packages = [p for p in _distributions(("cupy",)) if p.startswith(("cupy==", "cupy-cuda", "cupy-rocm"))]
    versions["cupy_packages"] = packages
    if len(packages) > 1:
        return _several("cupy", "CuPy", packages, "they overwrite each other's files")
    if not _installed("cupy"):
        return Finding("cupy", "WARN", "CuPy is not installed: transforms run as torch ops, slower on a GPU",
                       INSTALL_GPU)
    try:
        import cupy
        from cupy.cuda import nvrtc, runtime

        versions["cupy"] = cupy.__version__
        runtime_version = _cuda_version(int(runtime.runtimeGetVersion()))
        versions["cupy_cuda"] = runtime_version
    except Exception as error:  # a broken install raises all sorts
        return Finding("cupy", "FAIL", f"CuPy does not import ({type(error).__name__}: {error})",
                       f"reinstall it: {INSTALL_GPU}")
    summary = f"CuPy {cupy.__version__}, CUDA runtime {runtime_version}"
    too_old = _driver_too_old(versions, runtime_version, f"CuPy {cupy.__version__}")
    if too_old is not None:
        return too_old
    try:
        major, minor = nvrtc.getVersion()
    except Exception as error:
        return Finding("cupy", "WARN", f"{summary}; NVRTC does not load ({type(error).__name__}: {error}): the "
                       "transforms fall back to torch ops",
                       "install a CUDA build of torch (its wheels bring NVRTC) or the CUDA toolkit")
    paths = _loaded_libraries(rf"^libnvrtc\.so\.{major}(\.|$)") or _loaded_libraries(r"^libnvrtc\.so")
    versions["nvrtc"], versions["nvrtc_path"] = f"{major}.{minor}", paths[0] if paths else None
    summary += f"; compiles with NVRTC {major}.{minor}" + (f" ({paths[0]})" if paths else "")
    if major != _major(runtime_version):
        return Finding("cupy", "WARN", f"{summary}: two CUDA majors in one process (CuPy's runtime "
                       f"{_major(runtime_version)}, NVRTC {major}); kernels are compiled by the newer one",
                       f"for one CUDA major, take the extra that matches torch (CUDA {torch_cuda}): pip uninstall "
                       f"the CUDA {_major(runtime_version)} CuPy and DALI "
                       f"({packages[0].split('==')[0] if packages else 'cupy'}, nvidia-dali-cuda"
                       f"{_major(runtime_version)}0), then pip install 'gpuload[cuda{major}]'")
    return Finding("cupy", "OK", summary)


def _check_dali(versions: dict[str, Any], torch_cuda: str | None) -> Finding:
    packages = _distributions(("nvidia-dali",))
    packages = [p for p in packages if re.match(r"nvidia-dali(-nightly|-weekly)?-cuda\d+==", p)]
    versions["dali_packages"] = packages
    if len(packages) > 1:
        return _several("dali", "DALI", packages, "they write the same nvidia/dali folder")
    if not _installed("nvidia.dali"):
        return Finding("dali", "WARN", "DALI is not installed: images decode with torchvision's nvJPEG on a GPU "
                       "(JPEGs only), else on the CPU", INSTALL_GPU)
    from gpuload.decode._dali import DaliUnavailable, _import_dali

    try:
        _import_dali()
        import nvidia.dali as dali
    except DaliUnavailable as error:
        return Finding("dali", "FAIL", str(error).split("; ")[0], str(error).split("; ", 1)[-1])
    build = re.search(r"-cuda(\d+)(\d)==", packages[0]) if packages else None
    cuda = f"{build[1]}.{build[2]}" if build else "unknown"
    versions["dali"], versions["dali_cuda"] = dali.__version__, cuda
    summary = f"DALI {dali.__version__}, built for CUDA {cuda} ({packages[0].split('==')[0] if packages else '?'})"
    too_old = _driver_too_old(versions, cuda, f"DALI {dali.__version__}") if build else None
    if too_old is not None:
        return too_old
    if torch_cuda and build and _major(cuda) != _major(torch_cuda):
        summary += (f"; beside torch's CUDA {torch_cuda} it uses its own CUDA {build[1]} libraries (fine on a "
                    f"driver for CUDA {max(int(build[1]), _major(torch_cuda) or 0)}; gpuload[cuda{_major(torch_cuda)}] "
                    "makes it one major)")
    return Finding("dali", "OK", summary)


def _check_torchvision(versions: dict[str, Any], torch_cuda: str | None) -> Finding:
    """torchvision's version and CUDA build, read as torchvision itself does (its C++ ops library
    loaded into torch, ``torchvision::_cuda_version``) without importing torchvision, which
    would take seconds (it imports torch._dynamo)."""
    spec = importlib.util.find_spec("torchvision") if _installed("torchvision") else None
    if spec is None or not spec.submodule_search_locations:
        return Finding("torchvision", "WARN", "torchvision is not installed: no nvJPEG decoder where DALI is "
                       "missing, and PIL decodes on the CPU", "pip install 'gpuload[torchvision]'")
    import torch

    version = importlib.metadata.version("torchvision")
    folder = list(spec.submodule_search_locations)[0]
    libraries = sorted(p for p in os.listdir(folder) if re.match(r"_C(_stable)?\.(so|pyd)$|_C(_stable)?\..*\.so$", p))
    try:
        if not libraries:
            raise OSError(f"no _C library in {folder}")
        torch.ops.load_library(os.path.join(folder, libraries[-1]))
        number = int(torch.ops.torchvision._cuda_version())
    except Exception as error:  # a library built for another torch fails to load with all sorts
        return Finding("torchvision", "FAIL", f"torchvision {version}'s C++ ops do not load into torch "
                       f"{torch.__version__} ({type(error).__name__}: {str(error)[:200]})",
                       "install the pair built together: pip install -U torch torchvision")
    cuda = _cuda_version(number) if number > 0 else None
    versions["torchvision"], versions["torchvision_cuda"] = version, cuda
    if cuda is None:
        return Finding("torchvision", "OK" if torch_cuda is None else "WARN",
                       f"torchvision {version}, a CPU-only build: no nvJPEG decoder",
                       "" if torch_cuda is None
                       else "install the CUDA build that matches torch: pip install -U torchvision")
    if torch_cuda and _major(cuda) != _major(torch_cuda):
        return Finding("torchvision", "FAIL", f"torchvision {version} is built for CUDA {cuda}, torch for CUDA "
                       f"{torch_cuda}", "install the pair built together: pip install -U torch torchvision")
    return Finding("torchvision", "OK", f"torchvision {version}, CUDA {cuda}: the nvJPEG decoder (backend='nvjpeg') "
                   "is there for a GPU")


def _check_pinned(memlock: int | None, versions: dict[str, Any]) -> Finding:
    from gpuload.cache.budget import format_bytes

    versions["memlock"] = "unlimited" if memlock is None else memlock
    if memlock is None:
        return Finding("pinned", "OK", "locked-memory limit (ulimit -l): unlimited")
    if memlock < _PINNED_LOW:
        return Finding("pinned", "WARN", f"locked-memory limit (ulimit -l) is {format_bytes(memlock)}: it can cap "
                       "pinned host memory and NCCL over InfiniBand",
                       "raise it: ulimit -l unlimited (docker run --ulimit memlock=-1, or limits.conf)")
    return Finding("pinned", "OK", f"locked-memory limit (ulimit -l): {format_bytes(memlock)}")


def _check_memory(torch: Any, settings: Any, versions: dict[str, Any]) -> list[Finding]:
    from gpuload.cache.budget import format_bytes
    from gpuload.device import device_memory, host_memory

    host = host_memory()
    room = settings.host_room(host) if settings is not None else None
    versions["host_memory"] = {"free": host.free, "total": host.total, "cache_room": room}
    text = f"host: {format_bytes(host.free)} free of {format_bytes(host.total)}"
    if room is not None:
        text += f"; a host cache may take {format_bytes(room)} (free less the host reserve)"
    findings = [Finding("memory", "OK", text)]
    count = versions.get("cuda_devices", 0)
    for index in range(count):
        device = torch.device("cuda", index)
        memory = device_memory(device)
        cache = settings.device_room(device, memory) if settings is not None else None
        versions.setdefault("device_memory", {})[str(device)] = {
            "free": memory.free, "total": memory.total, "torch_cached": memory.torch_cached, "cache_room": cache}
        line = f"{device}: {format_bytes(memory.free)} free of {format_bytes(memory.total)}"
        if cache is not None:
            line += f"; the device cache may take {format_bytes(cache)} (budget, less cache_reserve)"
        status, fix = ("OK", "") if cache is None or cache > 0 else (
            "WARN", "the device cache gets nothing: free memory is under the reserve; lower cache_reserve or "
                    "free device memory")
        findings.append(Finding("memory", status, line, fix))
    return findings


def _check_launcher(environ: Mapping[str, str], torch: Any) -> Finding:
    from gpuload.device import DeviceError, resolve_device

    names = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    present = ", ".join(f"{n}={environ[n]}" for n in names if n in environ)
    try:
        device = resolve_device(None)
    except DeviceError as error:
        return Finding("launcher", "FAIL", f"{present}: {error}", "fix LOCAL_RANK, or pass device= to the loader")
    if not present:
        return Finding("launcher", "OK", f"no launcher variables (LOCAL_RANK, WORLD_SIZE): device=None means {device}")
    if "WORLD_SIZE" in environ and "LOCAL_RANK" not in environ and device.type == "cuda":
        return Finding("launcher", "WARN", f"{present} without LOCAL_RANK: device=None means {device} on every rank",
                       "launch with torchrun (it sets LOCAL_RANK), or pass device='cuda:N' per rank")
    return Finding("launcher", "OK", f"{present}: device=None means {device}")


def _check_settings(environ: Mapping[str, str], cwd: str | None) -> tuple[Finding, Any]:
    from gpuload.cache.budget import CacheSettingError
    from gpuload.cache.settings import CacheSettings

    try:
        settings = CacheSettings.resolve(environ=environ, cwd=cwd)
    except CacheSettingError as error:
        return Finding("cache settings", "FAIL", str(error), "fix the setting named (keyword > environment > "
                       "gpuload.toml)"), None
    lines = settings.describe().splitlines()
    where = "" if settings.config_path is not None else "; no gpuload.toml here and GPULOAD_CONFIG unset"
    return Finding("cache settings", "OK", "; ".join(lines) + where), settings


def collect(environ: Mapping[str, str] | None = None, cwd: str | None = None,
            read_driver: Callable[[], dict[str, Any]] | None = None,
            read_memlock: Callable[[], int | None] | None = None) -> dict[str, Any]:
    """Every finding and the versions read, as plain data (what ``--json`` prints).

    ``environ`` and ``cwd`` default to the process's; the readers to the machine's (tests pass
    their own).
    """
    environ = os.environ if environ is None else environ
    driver = (read_driver or globals()["read_driver"])()
    versions: dict[str, Any] = {
        "gpuload": _gpuload_version(), "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "driver": driver.get("version"), "driver_cuda": driver.get("cuda"),
    }
    findings = [_check_driver(driver)]
    import torch

    findings.append(_check_torch(torch, driver, versions))
    torch_cuda = torch.version.cuda
    for check in (_check_cupy, _check_dali, _check_torchvision):
        findings.append(check(versions, torch_cuda))
    findings.append(_check_pinned((read_memlock or globals()["read_memlock"])(), versions))
    setting, settings = _check_settings(environ, cwd)
    findings.extend(_check_memory(torch, settings, versions))
    findings.append(_check_launcher(environ, torch))
    findings.append(setting)
    return {
        "ok": all(f.status != "FAIL" for f in findings),
        "findings": [asdict(f) for f in findings],
        "versions": versions,
    }


def _gpuload_version() -> str:
    from gpuload import __version__

    return __version__


def render(report: Mapping[str, Any]) -> str:
    """The report as text: one line per finding, the fix indented under it."""
    versions = report["versions"]
    lines = [f"gpuload {versions['gpuload']} doctor: Python {versions['python']}, {versions['platform']}"]
    for finding in report["findings"]:
        lines.append(f"{finding['status']:<5} {finding['topic']:<15} {finding['summary']}")
        if finding["fix"]:
            lines.append(f"{'':<5} {'':<15} -> {finding['fix']}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON (for a bug report)")


def run(args: argparse.Namespace) -> int:
    """``gpuload doctor [--json]``: print the report; exit 1 when a line says FAIL."""
    report = collect()
    print(json.dumps(report, indent=2, default=str) if args.json else render(report))
    sys.stdout.flush()
    return 0 if report["ok"] else 1
