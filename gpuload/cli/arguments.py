"""Argument types of the ``gpuload`` command: each bad value is one line naming it, exit 2.

argparse calls these as ``type=``; an ``ArgumentTypeError`` becomes
``gpuload bench: error: argument --epochs: ...`` before anything runs. ``setting_error``
words a cache setting's error as the command line's, not as a keyword argument's.
"""

from __future__ import annotations

import argparse
import math
import re

from gpuload.cache.budget import CacheSettingError, parse_size

__all__ = [
    "positive_int", "non_negative_int", "non_negative_float", "device_argument", "size_argument",
    "setting_error",
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
    """An absolute size such as ``80GiB``, in bytes."""
    try:
        spec = parse_size(text, setting="memory", source="command line")
    except CacheSettingError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if spec.kind != "bytes":
        raise argparse.ArgumentTypeError(f"{text!r}: give an absolute size such as 80GiB")
    return int(spec.amount)


def setting_error(error: CacheSettingError) -> str:
    """The error's text, naming ``--cache-size`` rather than "keyword cache_size=" when the flag set it."""
    text = str(error)
    if error.source != f"keyword {error.setting}=":
        return text
    problem = text.removeprefix(f"{error.setting}={error.value!r} (from {error.source}) ")
    return f"argument --{error.setting.replace('_', '-')}: {error.value!r} {problem}"
