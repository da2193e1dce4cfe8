"""Argument types of the ``gpuload`` command: each bad value is one line naming it, exit 2.

argparse calls these as ``type=``; an ``ArgumentTypeError`` becomes
``gpuload bench: error: argument --epochs: ...`` before anything runs. They import nothing
heavy (no torch), so that a bad value is refused at once. ``setting_error`` words a cache
setting's error as the command line's, not as a keyword argument's; ``command_device`` checks
``--device`` against the machine, in the command line's words, and ``cuda_missing`` refuses a
``--device cuda`` on a machine without a CUDA device before torch is imported.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import TYPE_CHECKING

from gpuload import driver
from gpuload.sizes import CacheSettingError, parse_size

if TYPE_CHECKING:
    import torch

__all__ = [
    "positive_int", "non_negative_int", "non_negative_float", "device_argument", "size_argument",
    "setting_error", "command_device", "cuda_missing", "size_choice", "parse_shape",
]


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def positive_int(text: str) -> int:
    """A whole number of at least 1 (samples, epochs, batch size, threads, images)."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def non_negative_int(text: str) -> int:
    """A whole number of at least 0 (worker processes)."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be 0 or more")
    return value


def non_negative_float(text: str) -> float:
    """A finite number of at least 0 (milliseconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be a finite number, 0 or more")
    return value


def device_argument(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``; whether this machine has it is checked when the command runs."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: use cuda, cuda:N or cpu")
    return text.strip()


def size_argument(text: str) -> int:
    """An absolute size such as ``80GiB``, in bytes (a memory to pretend: no fraction, no 'auto')."""
    how = "write a size with a unit, e.g. 80GiB, 512MiB or 1.5TB (or a byte count)"
    try:
        spec = parse_size(text, setting="memory", source="command line")
    except CacheSettingError:
        spec = None
    if spec is None or spec.kind != "bytes":
        problem = "is negative" if text.strip().startswith("-") else "is not a size of memory"
        raise argparse.ArgumentTypeError(f"{text!r} {problem}; {how}")
    return int(spec.amount)


def size_choice(text: str) -> str:
    """A cache size or reserve as the loader takes it ('40GiB', 0.8, '80%', 'auto', 'off'), checked now."""
    try:
        parse_size(text, setting="size", source="command line")
    except CacheSettingError as error:
        problem = str(error).removeprefix(f"{error.setting}={error.value!r} (from {error.source}) ")
        raise argparse.ArgumentTypeError(f"{text!r} {problem}") from None
    return text


def setting_error(error: CacheSettingError) -> str:
    """The error's text, naming ``--cache-size`` rather than "keyword cache_size=" when the flag set it."""
    text = str(error)
    if error.source != f"keyword {error.setting}=":
        return text
    problem = text.removeprefix(f"{error.setting}={error.value!r} (from {error.source}) ")
    if error.setting == "job":  # the advice in the command line's words
        problem = problem.replace("or unset the job", "or leave --job out")
    return f"argument --{error.setting.replace('_', '-')}: {error.value!r} {problem}"


def cuda_missing(text: str | None, flag: str = "--device") -> str | None:
    """Why ``--device cuda[:N]`` cannot run here, when the driver already says there is no CUDA
    device (torch could not see one either), else None; the full check, with torch, is
    ``command_device``. Answers in milliseconds, where importing torch takes seconds."""
    if text is None or not text.startswith("cuda") or driver.device_count() > 0:
        return None
    return (f"argument {flag}: {text} was asked for but CUDA is not available on this machine (no CUDA device: "
            f"the NVIDIA driver, libcuda.so.1, does not load or shows none); pass {flag} cpu, or leave {flag} out "
            "to use the CPU")


def command_device(text: str | None, flag: str = "--device") -> torch.device:
    """``--device`` resolved on this machine (imports torch); ``ValueError`` in the command line's words."""
    import torch

    from gpuload.device import DeviceError, cuda_available, resolve_device

    if text is not None and text.startswith("cuda"):
        if not cuda_available():
            raise ValueError(
                f"argument {flag}: {text} was asked for but CUDA is not available on this machine (torch "
                f"{torch.__version__}, built for CUDA {torch.version.cuda}); pass {flag} cpu, or leave {flag} "
                "out to use the CPU")
        count = torch.cuda.device_count()
        index = int(text.partition(":")[2] or torch.cuda.current_device())
        if index >= count:
            raise ValueError(f"argument {flag}: {text} does not exist: this machine has {count} CUDA device(s), "
                             f"cuda:0 to cuda:{count - 1}")
    try:
        return resolve_device(text)
    except DeviceError as error:
        raise ValueError(f"argument {flag}: {error}") from None


def parse_shape(text: str) -> tuple[int, ...]:
    """``"3,224,224"`` -> ``(3, 224, 224)``; a ValueError for anything but positive integers."""
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if not shape or any(size < 1 for size in shape):
        raise ValueError(f"--input-shape {text!r} must be positive integers separated by commas, e.g. 3,224,224")
    return shape
