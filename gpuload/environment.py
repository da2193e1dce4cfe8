"""gpuload's environment variables, all in one registry: name, meaning, accepted values, default.

Every ``GPULOAD_*`` variable gpuload reads is listed in :data:`VARIABLES` (a test checks that no
other name appears in the package), so the documentation lists them from here
(:func:`markdown_table`; the configuration page's table is that, checked by a test). A value
gpuload cannot use is one line naming the variable, its value and what it accepts
(:class:`~gpuload.sizes.CacheSettingError`, as for every setting): the cache
settings' variables are parsed by ``gpuload.cache.settings``; the others by the readers here,
which :func:`check_environment` runs when a loader's settings are resolved, so a bad value fails
at once rather than when (or if) the code that reads it runs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from gpuload.sizes import CacheSettingError

__all__ = [
    "DALI_STDERR", "EXCHANGE_TIMEOUT", "MAX_EXCHANGE_TIMEOUT_S", "TIMELINE", "VARIABLES", "EnvironmentVariable",
    "check_environment", "dali_stderr", "exchange_timeout_seconds", "markdown_table", "timeline_steps",
]



def _size(of: str) -> str:
    return f"a size (`40GiB`, `500MB`, bytes), a fraction of {of} (`0.8`, `80%`), `auto`, or `off`/`0`"



@dataclass(frozen=True)
class EnvironmentVariable:
    """One variable gpuload reads: what it sets, the values it accepts, and its default."""

    name: str
    meaning: str
    accepted: str
    default: str


DALI_STDERR = "GPULOAD_DALI_STDERR"
EXCHANGE_TIMEOUT = "GPULOAD_EXCHANGE_TIMEOUT"
# gloo waits until now + timeout on a nanosecond clock: past about 9.2e9 s that overflows and a
# wait fails at once. A billion seconds (31 years) is "forever" and safely inside.
MAX_EXCHANGE_TIMEOUT_S = 1e9
DEFAULT_EXCHANGE_TIMEOUT_S = 600.0
TIMELINE = "GPULOAD_TIMELINE"
DEFAULT_TIMELINE_STEPS = 1000  # steps loader.timeline keeps when on without a number
MAX_TIMELINE_STEPS = 10_000_000  # the most it keeps: 24 bytes a step, 240 MB (its totals cover every step)

VARIABLES: tuple[EnvironmentVariable, ...] = (
    EnvironmentVariable("GPULOAD_CACHE", "the cache mode (`cache=`)", "`auto`, `device`, `host`, `off`", "`auto`"),
    EnvironmentVariable("GPULOAD_CACHE_SIZE", "the device cache's budget (`cache_size=`)",
                        _size("free device memory"), "`auto`"),
    EnvironmentVariable("GPULOAD_CACHE_RESERVE", "device memory the cache never takes (`cache_reserve=`)",
                        _size("the card's total"),
                        "`auto`: max(2 GiB, 10% of the card's total)"),
    EnvironmentVariable("GPULOAD_CACHE_SCOPE",
                        "over which ranks one copy of the dataset is split (`cache_scope=`, [multi-GPU](multi-gpu.md))",
                        "`auto`, `rank`, `node`, `world`", "`auto`"),
    EnvironmentVariable("GPULOAD_CACHE_DIR", "the disk tier's folder (`cache_dir=`, [caching](caching.md))",
                        "a folder path (created if missing)", "unset: no disk tier"),
    EnvironmentVariable("GPULOAD_DISK_CACHE_SIZE", "the disk tier's budget (`disk_cache_size=`)",
                        _size("the folder's free space"), "`auto`"),
    EnvironmentVariable("GPULOAD_CONFIG", "the config file (`./gpuload.toml` is then not read)",
                        "the path of a TOML file", "`./gpuload.toml`, if there is one"),
    EnvironmentVariable("GPULOAD_JOB", "the `[jobs.NAME]` table of the config file to use (`job=`)",
                        "a job named in the config file", "unset: the file's top-level settings"),
    EnvironmentVariable(EXCHANGE_TIMEOUT,
                        "how long a rank waits for the others in a split cache's exchange ([multi-GPU](multi-gpu.md))",
                        f"seconds, a number > 0 and <= {MAX_EXCHANGE_TIMEOUT_S:.0e}",
                        f"`{DEFAULT_EXCHANGE_TIMEOUT_S:g}`"),
    EnvironmentVariable(DALI_STDERR, "where DALI's native log lines go while it decodes ([images](images.md))",
                        "`filter` (to the `gpuload.decode.dali` logger) or `keep` (left on stderr)", "`filter`"),
    EnvironmentVariable(TIMELINE, "`loader.timeline`, where the loop waits ([waiting](waiting.md); `timeline_steps=`)",
                        "`on`, `off`, or the number of recent steps kept (`0`: off)",
                        f"`off` (`on`: {DEFAULT_TIMELINE_STEPS} steps)"),
)
"""Every environment variable gpuload reads."""

_DALI_STDERR_CHOICES = ("filter", "keep")


def _source(name: str) -> str:
    return f"environment variable {name}"


def dali_stderr(environ: Mapping[str, str] | None = None) -> str:
    """``GPULOAD_DALI_STDERR``: ``"filter"`` (the default) or ``"keep"``."""
    env = os.environ if environ is None else environ
    text = env.get(DALI_STDERR, "").strip()
    if not text:
        return "filter"
    if text.lower() in _DALI_STDERR_CHOICES:
        return text.lower()
    raise CacheSettingError(DALI_STDERR, text, _source(DALI_STDERR),
                            f"is not one of {', '.join(map(repr, _DALI_STDERR_CHOICES))}; "
                            "unset it for the default 'filter'")


def exchange_timeout_seconds(environ: Mapping[str, str] | None = None) -> float:
    """``GPULOAD_EXCHANGE_TIMEOUT`` in seconds (default 600): a number in ``(0, MAX_EXCHANGE_TIMEOUT_S]``."""
    env = os.environ if environ is None else environ
    text = env.get(EXCHANGE_TIMEOUT, "").strip()
    if not text:
        return DEFAULT_EXCHANGE_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_EXCHANGE_TIMEOUT_S:
        raise CacheSettingError(
            EXCHANGE_TIMEOUT, text, _source(EXCHANGE_TIMEOUT),
            f"is not a number of seconds > 0 and <= {MAX_EXCHANGE_TIMEOUT_S:.0e} (about 31 years: the "
            "longest wait torch.distributed's gloo can time); unset it for the default "
            f"{DEFAULT_EXCHANGE_TIMEOUT_S:g} s",
        )
    return seconds


def timeline_steps(environ: Mapping[str, str] | None = None) -> int:
    """``GPULOAD_TIMELINE``: the steps ``loader.timeline`` keeps (0, the default: off; ``on``: 1000;
    at most :data:`MAX_TIMELINE_STEPS`). Off by default: it costs 0.3-1.3% (median 0.65%) of a cached
    in-memory epoch's step with no training step on a CPU, not safely under the 1% bar, and has not
    been measured on a GPU (the waiting page of the docs gives the measurements)."""
    env = os.environ if environ is None else environ
    text = env.get(TIMELINE, "").strip().lower()
    if not text or text == "off":
        return 0
    if text == "on":
        return DEFAULT_TIMELINE_STEPS
    if text.isdigit() and int(text) <= MAX_TIMELINE_STEPS:
        return int(text)
    raise CacheSettingError(TIMELINE, text, _source(TIMELINE),
                            f"is not `on`, `off` or a number of steps (0 to {MAX_TIMELINE_STEPS:,}); unset it for the "
                            "default `off`")


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Raise for a value of gpuload's own variables that the cache settings do not parse."""
    dali_stderr(environ)
    exchange_timeout_seconds(environ)
    timeline_steps(environ)


def markdown_table() -> str:
    """The registry as a Markdown table, for the documentation."""
    rows = ["| Variable | Sets | Accepted values | Default |", "| --- | --- | --- | --- |"]
    rows += [f"| `{v.name}` | {v.meaning} | {v.accepted} | {v.default} |" for v in VARIABLES]
    return "\n".join(rows)
