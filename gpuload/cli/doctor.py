"""``gpuload doctor``: what this machine gives gpuload, one line per item, each OK or what is
wrong and what to do. The command a user runs first when something is off, and pastes into a
bug report (``--json``); modelled on ``python -m torch.utils.collect_env``.

It reads the NVIDIA driver and its devices, torch's build and whether it can use them, CuPy's CUDA
runtime and the NVRTC it loads, DALI and its CUDA build, torchvision's nvJPEG, the pinned-memory
limit, free device and host memory as the cache budget sees them, the launcher's variables and the
cache settings that apply. A missing optional package is a line saying what it costs and how to
install it, never an error. Exit status 1 when a line says FAIL, else 0.

It answers in about a second on a quiet machine (2.4-3.9 s beside 8 busy processes on 2 cores),
because this process never imports torch (seconds): versions come from package metadata and
installed files, the devices from the CUDA driver API (``libcuda.so.1``) and their free memory from
NVML, both through ctypes; DALI's native library is loaded (not its Python package, a second of
CPU). CuPy is imported in a child process, because only its import says which CUDA runtime and
NVRTC it picks; a child that does not answer within ``--timeout`` seconds is a line saying so.
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
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gpuload.driver import DriverError, visible_devices
from gpuload.memory import MemoryInfo, host_memory

__all__ = ["Finding", "add_arguments", "collect", "run", "PROBES", "PROBE_TIMEOUT_S"]

TORCH_FLOOR = (2, 6)  # pyproject.toml's torch>=2.6: DataLoader's in_order=
DALI_FLOOR = (1, 44)  # Pipeline.run(cuda_stream), which gpuload.decode._dali needs
INSTALL_GPU = "pip install 'gpuload[cuda13]' (or 'gpuload[cuda12]' beside a torch built for CUDA 12; never both)"
_PINNED_LOW = 1 << 30  # a memlock limit under this may cap pinned memory (and NCCL over InfiniBand)
PROBE_TIMEOUT_S = 10.0  # how long the child importing CuPy may take (under 1 s on a quiet machine)


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
    """The NVIDIA driver: its version (/proc/driver/nvidia/version), the CUDA version it supports
    (``cuDriverGetVersion``, which needs no device) and the devices this process may use (the
    driver API honours ``CUDA_VISIBLE_DEVICES``, as torch does): name, total and free bytes.
    Empty where there is no driver; ``device_error`` where the driver loads but fails."""
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
        return found
    try:
        found["devices"] = visible_devices(libcuda)
    except DriverError as error:
        found["devices"], found["device_error"] = [], str(error)
    except AttributeError:  # a libcuda without the calls (a stand-in): no devices known
        pass
    return found


def read_torch() -> dict[str, Any] | None:
    """torch's version and the CUDA it was built for, read from its installed ``version.py``
    without importing torch (seconds); None where torch is not installed."""
    folder = _package_folder("torch")
    if folder is None:
        return None
    try:
        with open(os.path.join(folder, "version.py"), encoding="utf-8") as file:
            text = file.read()
    except OSError:
        text = ""
    version = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    cuda = re.search(r"^cuda\b[^=\n]*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return {"version": version[1] if version else importlib.metadata.version("torch"),
            "cuda": cuda[1] if cuda else None}


def read_torchvision() -> dict[str, Any] | None:
    """torchvision's version, its C++ ops library, the torch it requires and the CUDA it was built
    for, from its metadata and files (an import takes seconds: it imports torch); None where it
    is not installed. The CUDA build is the version's local tag (``+cu130``), else the CUDA runtime
    its ops library links (its major only); None for a CPU-only build."""
    folder = _package_folder("torchvision")
    if folder is None:
        return None
    libraries = sorted(p for p in os.listdir(folder) if re.match(r"_C(_stable)?\.(so|pyd)$|_C(_stable)?\..*\.so$", p))
    library = os.path.join(folder, libraries[-1]) if libraries else None
    version = importlib.metadata.version("torchvision")
    tag = re.search(r"\+(cu(\d+)(\d)|cpu|rocm)", _version_text(folder) or version)
    cuda = f"{tag[2]}.{tag[3]}" if tag and tag[2] else None
    elf = False
    if library is not None:
        with open(library, "rb") as file:
            data = file.read()
        elf = data[:4] == b"\x7fELF"
        linked = re.search(rb"libcudart\.so\.(\d+)", data)
        if tag is None and linked:
            cuda = linked[1].decode()
    torch_required = next((r for r in importlib.metadata.requires("torchvision") or []
                           if re.match(r"torch\b(?![-_.\w])", r) and ";" not in r), None)
    return {"version": version, "folder": folder, "library": library, "library_is_elf": elf, "cuda": cuda,
            "torch_required": torch_required}


def _version_text(folder: str) -> str | None:
    """The ``__version__`` a package's ``version.py`` assigns, read as text."""
    try:
        with open(os.path.join(folder, "version.py"), encoding="utf-8") as file:
            match = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", file.read(), re.M)
    except OSError:
        return None
    return match[1] if match else None


def _package_folder(name: str) -> str | None:
    """The folder of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def read_dali() -> dict[str, Any] | None:
    """DALI's version (its metadata) and whether its native library loads (``dlopen`` of the
    extension module for this Python, which links DALI's libraries and the CUDA runtime they need:
    what fails when DALI does not import); None where it is not installed. Importing DALI would take
    a second of CPU, so it is not imported."""
    folder = _package_folder("nvidia.dali")
    if folder is None:
        return None
    packages = _dali_packages()
    facts: dict[str, Any] = {"version": packages[0].split("==")[1] if packages else None, "load_error": None}
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    library = os.path.join(folder, f"backend_impl{suffix}")
    if not os.path.exists(library):
        facts["load_error"] = f"no backend_impl{suffix} in {folder}: not built for this Python"
        return facts
    try:
        ctypes.CDLL(library)
    except OSError as error:
        facts["load_error"] = f"OSError: {error}"
    return facts


def read_memlock() -> int | None:
    """The soft limit on locked memory (``ulimit -l``) in bytes; None for unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def probe_cupy() -> dict[str, Any]:
    """What CuPy says once imported: its version, CUDA runtime and the NVRTC it loads (a child
    process of the doctor runs this; an import error is a fact like the others)."""
    try:
        import cupy
        from cupy.cuda import nvrtc, runtime

        facts: dict[str, Any] = {"version": cupy.__version__, "runtime": int(runtime.runtimeGetVersion())}
    except Exception as error:  # a broken install raises all sorts
        return {"error": f"{type(error).__name__}: {error}"}
    try:
        major, minor = nvrtc.getVersion()
    except Exception as error:
        facts["nvrtc_error"] = f"{type(error).__name__}: {error}"
        return facts
    facts["nvrtc"] = [int(major), int(minor)]
    facts["nvrtc_paths"] = _loaded_libraries(rf"^libnvrtc\.so\.{major}(\.|$)") or _loaded_libraries(r"^libnvrtc\.so")
    return facts


PROBES: dict[str, Callable[[], dict[str, Any]]] = {"cupy": probe_cupy}
_PROBE_MAIN = "import json, sys; from gpuload.cli.doctor import PROBES; print(json.dumps(PROBES[sys.argv[1]]()))"


def run_probes(names: Sequence[str], timeout: float) -> dict[str, dict[str, Any]]:
    """Each named probe's facts, from child processes run side by side; ``{"timeout": timeout}``
    for one that did not answer in time (it is killed), ``{"error": ...}`` for one that died."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    children = {name: subprocess.Popen([sys.executable, "-c", _PROBE_MAIN, name], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env=env) for name in names}
    deadline = time.monotonic() + timeout
    facts: dict[str, dict[str, Any]] = {}
    try:
        for name, child in children.items():
            try:
                out, err = child.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                facts[name] = {"timeout": timeout}
                continue
            try:
                facts[name] = json.loads(out.strip().splitlines()[-1])
            except (IndexError, ValueError):
                facts[name] = {"error": f"its check's process exited with status {child.returncode}: "
                               f"{err.strip()[-300:] or 'no output'}"}
    finally:  # a child that did not answer (or a Ctrl-C meanwhile) is not left running
        for child in children.values():
            if child.poll() is None:
                child.kill()
                child.communicate()
    return facts


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


def _check_torch(torch: Mapping[str, Any] | None, driver: dict[str, Any], versions: dict[str, Any]) -> Finding:
    """torch's version and CUDA build (``torch``: what :func:`read_torch` read), and the devices it
    can use: those the driver lists, where the driver's CUDA major is at least torch's."""
    if torch is None:
        versions["torch"] = versions["torch_cuda"] = None
        return Finding("torch", "FAIL", "torch is not installed: gpuload needs it", "pip install -U 'torch>=2.6'")
    version, built = torch["version"], torch["cuda"]
    versions["torch"], versions["torch_cuda"] = version, built
    numbers = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    if numbers < TORCH_FLOOR:
        return Finding("torch", "FAIL", f"torch {version} is older than gpuload needs (>= 2.6)",
                       "pip install -U 'torch>=2.6'")
    if built is None:
        if driver.get("cuda"):
            return Finding("torch", "WARN", f"torch {version} is a CPU-only build: gpuload cannot use this "
                           "machine's GPU", "install a CUDA build: pip install -U torch")
        return Finding("torch", "OK", f"torch {version}, a CPU-only build (no GPU here)")
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
    devices = driver.get("devices") or []
    versions["cuda_devices"] = len(devices)
    if devices:
        names = ", ".join(f"cuda:{i} {d['name']}" for i, d in enumerate(devices))
        return Finding("torch", "OK", f"torch {version}, built for CUDA {built}; {len(devices)} device(s): {names}")
    if driver.get("device_error"):
        return Finding("torch", "FAIL", f"{summary}: the driver fails ({driver['device_error']})",
                       "check the driver with nvidia-smi; reboot or reinstall it if nvidia-smi fails too")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hint = f"CUDA_VISIBLE_DEVICES={visible!r} hides them" if visible is not None else "no device is visible"
    return Finding("torch", "FAIL", f"{summary} although the driver is there ({hint})",
                   "check CUDA_VISIBLE_DEVICES, and in a container that it runs with --gpus")


def _several(check: str, label: str, packages: list[str], why: str) -> Finding:
    """The failure for more than one build of a package in one environment (one CUDA major each)."""
    return Finding(check, "FAIL", f"{len(packages)} {label} packages are installed ({', '.join(packages)}): {why}",
                   f"pip uninstall {' '.join(p.split('==')[0] for p in packages)}, then {INSTALL_GPU}")


def _cupy_packages() -> list[str]:
    return [p for p in _distributions(("cupy",)) if p.startswith(("cupy==", "cupy-cuda", "cupy-rocm"))]


def _dali_packages() -> list[str]:
    return [p for p in _distributions(("nvidia-dali",)) if re.match(r"nvidia-dali(-nightly|-weekly)?-cuda\d+==", p)]


def _probes_needed() -> list[str]:
    """The packages whose check imports them: CuPy, installed once (two builds fail without an import)."""
    return ["cupy"] if len(_cupy_packages()) <= 1 and _installed("cupy") else []


def _timed_out(check: str, what: str, facts: Mapping[str, Any]) -> Finding:
    return Finding(check, "WARN", f"{what} is installed, but importing it did not finish in {facts['timeout']:g} s "
                   "(a busy machine?): not checked", "run it again with more time: gpuload doctor --timeout 60")


def _check_cupy(versions: dict[str, Any], torch_cuda: str | None, facts: Mapping[str, Any] | None) -> Finding:
    """CuPy from its packages and ``facts``, what :func:`probe_cupy` said in a child process."""
    packages = _cupy_packages()
    versions["cupy_packages"] = packages
    if len(packages) > 1:
        return _several("cupy", "CuPy", packages, "they overwrite each other's files")
    if not _installed("cupy") or facts is None:
        return Finding("cupy", "WARN", "CuPy is not installed: transforms run as torch ops, slower on a GPU",
                       INSTALL_GPU)
    if "timeout" in facts:
        return _timed_out("cupy", "CuPy", facts)
    if "error" in facts:
        return Finding("cupy", "FAIL", f"CuPy does not import ({facts['error']})", f"reinstall it: {INSTALL_GPU}")
    version = facts["version"]
    versions["cupy"] = version
    runtime_version = _cuda_version(int(facts["runtime"]))
    versions["cupy_cuda"] = runtime_version
    summary = f"CuPy {version}, CUDA runtime {runtime_version}"
    too_old = _driver_too_old(versions, runtime_version, f"CuPy {version}")
    if too_old is not None:
        return too_old
    if "nvrtc" not in facts:
        return Finding("cupy", "WARN", f"{summary}; NVRTC does not load ({facts.get('nvrtc_error')}): the "
                       "transforms fall back to torch ops",
                       "install a CUDA build of torch (its wheels bring NVRTC) or the CUDA toolkit")
    major, minor = facts["nvrtc"]
    paths = facts.get("nvrtc_paths") or []
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


def _check_dali(versions: dict[str, Any], torch_cuda: str | None, facts: Mapping[str, Any] | None) -> Finding:
    """DALI from its packages and ``facts``, what :func:`read_dali` read."""
    packages = _dali_packages()
    versions["dali_packages"] = packages
    if len(packages) > 1:
        return _several("dali", "DALI", packages, "they write the same nvidia/dali folder")
    if facts is None:
        return Finding("dali", "WARN", "DALI is not installed: images decode with torchvision's nvJPEG on a GPU "
                       "(JPEGs only), else on the CPU", INSTALL_GPU)
    version = facts["version"] or "(version unknown)"
    if facts["load_error"]:
        return Finding("dali", "FAIL", f"DALI {version} does not load ({facts['load_error']})",
                       f"reinstall it: {INSTALL_GPU}; or decode with backend='torchvision' or backend='pil'")
    if facts["version"] and _release(version) < DALI_FLOOR:
        return Finding("dali", "FAIL", f"DALI {version} is too old: gpuload binds each run to torch's stream "
                       "(Pipeline.run(cuda_stream)), which DALI has since 1.44",
                       "pip install -U 'gpuload[cuda13]' (or [cuda12]), or decode with backend='nvjpeg', "
                       "'torchvision' or 'pil'")
    build = re.search(r"-cuda(\d+)(\d)==", packages[0]) if packages else None
    cuda = f"{build[1]}.{build[2]}" if build else "unknown"
    versions["dali"], versions["dali_cuda"] = version, cuda
    summary = f"DALI {version}, built for CUDA {cuda} ({packages[0].split('==')[0] if packages else '?'})"
    too_old = _driver_too_old(versions, cuda, f"DALI {version}") if build else None
    if too_old is not None:
        return too_old
    if torch_cuda and build and _major(cuda) != _major(torch_cuda):
        summary += (f"; beside torch's CUDA {torch_cuda} it uses its own CUDA {build[1]} libraries (fine on a "
                    f"driver for CUDA {max(int(build[1]), _major(torch_cuda) or 0)}; gpuload[cuda{_major(torch_cuda)}] "
                    "makes it one major)")
    return Finding("dali", "OK", summary)


def _release(version: str) -> tuple[int, ...]:
    """A version's release numbers: ``2.14.1+cu130`` -> (2, 14, 1)."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(n) for n in match[0].split(".")) if match else ()


def _torch_pin_broken(required: str | None, torch_version: str | None) -> str | None:
    """The torch requirement torchvision's metadata names, where the installed torch misses it."""
    if not required or not torch_version:
        return None
    have = _release(torch_version)
    for operator, wanted in re.findall(r"(==|>=|<=|<|>|~=|!=)\s*([\w.*+]+)", required):
        pinned = _release(wanted.replace(".*", ""))
        ok = {"==": have[:len(pinned)] == pinned, ">=": have >= pinned, "<=": have <= pinned, "<": have < pinned,
              ">": have > pinned, "~=": have >= pinned, "!=": have[:len(pinned)] != pinned}[operator]
        if not ok:
            return re.sub(r"\s+", "", required.replace("(", "").replace(")", ""))
    return None


def _check_torchvision(versions: dict[str, Any], torch_cuda: str | None, facts: Mapping[str, Any] | None) -> Finding:
    """torchvision from what :func:`read_torchvision` read: its ops library is there, it was built
    for the torch installed (its metadata's pin), and for torch's CUDA major."""
    if facts is None:
        return Finding("torchvision", "WARN", "torchvision is not installed: no nvJPEG decoder where DALI is "
                       "missing, and PIL decodes on the CPU", "pip install 'gpuload[torchvision]'")
    version, fix = facts["version"], "install the pair built together: pip install -U torch torchvision"
    if facts["library"] is None:
        return Finding("torchvision", "FAIL", f"torchvision {version}'s C++ ops are missing (no _C library in "
                       f"{facts['folder']})", fix)
    if not facts["library_is_elf"] and sys.platform.startswith("linux"):
        return Finding("torchvision", "FAIL", f"torchvision {version}'s C++ ops do not load: "
                       f"{facts['library']} is not a shared library", fix)
    broken = _torch_pin_broken(facts["torch_required"], versions.get("torch"))
    if broken:
        return Finding("torchvision", "FAIL", f"torchvision {version} requires {broken}, torch "
                       f"{versions.get('torch')} is installed: its C++ ops do not load into it", fix)
    cuda = facts["cuda"]
    versions["torchvision"], versions["torchvision_cuda"] = version, cuda
    if cuda is None:
        return Finding("torchvision", "OK" if torch_cuda is None else "WARN",
                       f"torchvision {version}, a CPU-only build: no nvJPEG decoder",
                       "" if torch_cuda is None
                       else "install the CUDA build that matches torch: pip install -U torchvision")
    if torch_cuda and _major(cuda) != _major(torch_cuda):
        return Finding("torchvision", "FAIL", f"torchvision {version} is built for CUDA {cuda}, torch for CUDA "
                       f"{torch_cuda}", fix)
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


def _check_memory(devices: Sequence[Mapping[str, Any]], settings: Any, versions: dict[str, Any]) -> list[Finding]:
    """Host memory, and each usable device's (``devices``: what :func:`read_driver` listed)."""
    from gpuload.cache.budget import format_bytes

    host = host_memory()
    room = settings.host_room(host) if settings is not None else None
    versions["host_memory"] = {"free": host.free, "total": host.total, "cache_room": room}
    text = f"host: {format_bytes(host.free)} free of {format_bytes(host.total)}"
    if room is not None:
        text += f"; a host cache may take {format_bytes(room)} (free less the host reserve)"
    findings = [Finding("memory", "OK", text)]
    for index, found in enumerate(devices[:versions.get("cuda_devices", 0)]):
        device = f"cuda:{index}"
        if found.get("free") is None:
            versions.setdefault("device_memory", {})[device] = {"free": None, "total": found["total"]}
            findings.append(Finding("memory", "OK", f"{device}: {format_bytes(found['total'])}; free memory unknown "
                                    "here (libnvidia-ml.so.1 does not load): the cache reads it when it starts"))
            continue
        memory = MemoryInfo(free=found["free"], total=found["total"])
        cache = settings.device_room(device, memory) if settings is not None else None
        versions.setdefault("device_memory", {})[device] = {
            "free": memory.free, "total": memory.total, "torch_cached": memory.torch_cached, "cache_room": cache}
        line = f"{device}: {format_bytes(memory.free)} free of {format_bytes(memory.total)}"
        if cache is not None:
            line += f"; the device cache may take {format_bytes(cache)} (budget, less cache_reserve)"
        status, fix = ("OK", "") if cache is None or cache > 0 else (
            "WARN", "the device cache gets nothing: free memory is under the reserve; lower cache_reserve or "
                    "free device memory")
        findings.append(Finding("memory", status, line, fix))
    return findings


def _check_launcher(environ: Mapping[str, str], device_count: int) -> Finding:
    """What ``device=None`` means here: the launcher's ``LOCAL_RANK`` among ``device_count`` devices."""
    from gpuload.launcher import DeviceError, default_cuda_index

    names = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    present = ", ".join(f"{n}={environ[n]}" for n in names if n in environ)
    try:
        device = f"cuda:{default_cuda_index(None, 0, device_count, environ.get('LOCAL_RANK'))}" if device_count \
            else "cpu"
    except DeviceError as error:
        return Finding("launcher", "FAIL", f"{present}: {error}", "fix LOCAL_RANK, or pass device= to the loader")
    if not present:
        return Finding("launcher", "OK", f"no launcher variables (LOCAL_RANK, WORLD_SIZE): device=None means {device}")
    if "WORLD_SIZE" in environ and "LOCAL_RANK" not in environ and device_count:
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
            read_memlock: Callable[[], int | None] | None = None,
            probes: Callable[[Sequence[str], float], dict[str, dict[str, Any]]] | None = None,
            timeout: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """Every finding and the versions read, as plain data (what ``--json`` prints).

    ``environ`` and ``cwd`` default to the process's; the readers to the machine's, ``probes`` to
    :func:`run_probes`, each child given ``timeout`` seconds (tests pass their own).
    """
    environ = os.environ if environ is None else environ
    needed = _probes_needed()
    pending = (probes or run_probes) if needed else None
    driver = (read_driver or globals()["read_driver"])()
    versions: dict[str, Any] = {
        "gpuload": _gpuload_version(), "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "driver": driver.get("version"), "driver_cuda": driver.get("cuda"),
    }
    findings = [_check_driver(driver), _check_torch(read_torch(), driver, versions)]
    torch_cuda = versions["torch_cuda"]
    facts = pending(needed, timeout) if pending is not None else {}
    findings.append(_check_cupy(versions, torch_cuda, facts.get("cupy")))
    findings.append(_check_dali(versions, torch_cuda, read_dali()))
    findings.append(_check_torchvision(versions, torch_cuda, read_torchvision()))
    findings.append(_check_pinned((read_memlock or globals()["read_memlock"])(), versions))
    setting, settings = _check_settings(environ, cwd)
    findings.extend(_check_memory(driver.get("devices") or [], settings, versions))
    findings.append(_check_launcher(environ, versions.get("cuda_devices", 0)))
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


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON (for a bug report)")
    parser.add_argument("--timeout", type=_seconds, default=PROBE_TIMEOUT_S, metavar="SECONDS",
                        help=f"how long importing CuPy may take, in a child process "
                             f"(default {PROBE_TIMEOUT_S:g})")


def run(args: argparse.Namespace) -> int:
    """``gpuload doctor [--json] [--timeout SECONDS]``: print the report; exit 1 when a line says FAIL."""
    report = collect(timeout=args.timeout)
    print(json.dumps(report, indent=2, default=str) if args.json else render(report))
    sys.stdout.flush()
    return 0 if report["ok"] else 1
