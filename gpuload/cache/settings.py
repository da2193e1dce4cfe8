"""Cache settings from four places, in order: keyword > environment > ``gpuload.toml`` > default.

Each resolved value remembers where it came from, so an error or ``gpuload plan`` can say
"cache_size='200GiB' (from environment variable GPULOAD_CACHE_SIZE)".

The file is ``$GPULOAD_CONFIG`` or ``gpuload.toml`` in the working directory::

    cache_size = "auto"          # defaults for every job
    cache_reserve = "4GiB"

    [jobs.train]                 # chosen with job="train" or GPULOAD_JOB=train
    cache_size = "40GiB"
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpuload.cache.budget import (
    CacheSettingError,
    SizeSpec,
    SizeValue,
    available_budget,
    disk_budget,
    format_bytes,
    parse_size,
    resolve_budget,
    resolve_reserve,
)
from gpuload.cache.plan import MODES, CachePlan, default_host_reserve, make_plan
from gpuload.environment import check_environment

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on python 3.10 only
    import tomli as tomllib

__all__ = ["CacheSettings", "Setting", "MODES", "SCOPES", "ENV_VARS", "CONFIG_FILE_NAME"]

CONFIG_FILE_NAME = "gpuload.toml"
ENV_VARS = {
    "cache": "GPULOAD_CACHE",
    "cache_size": "GPULOAD_CACHE_SIZE",
    "cache_reserve": "GPULOAD_CACHE_RESERVE",
    "cache_scope": "GPULOAD_CACHE_SCOPE",
    "cache_dir": "GPULOAD_CACHE_DIR",
    "disk_cache_size": "GPULOAD_DISK_CACHE_SIZE",
}
SCOPES = ("auto", "rank", "node", "world")
"""Where a torch.distributed job keeps the dataset: each rank its own copy (``rank``), one copy
per node split over its ranks (``node``), one copy split over all ranks (``world``), or decided
from the sizes (``auto``). Without an initialized process group every scope means ``rank``."""
ENV_CONFIG = "GPULOAD_CONFIG"
ENV_JOB = "GPULOAD_JOB"
_FILE_KEYS = tuple(ENV_VARS)
_DEFAULTS: dict[str, Any] = {
    "cache": "auto", "cache_size": "auto", "cache_reserve": "auto", "cache_scope": "auto",
    "cache_dir": None, "disk_cache_size": "auto",
}


@dataclass(frozen=True)
class Setting:
    """One resolved value and where it came from (``"keyword"``, ``"environment variable
    GPULOAD_CACHE_SIZE"``, ``"/path/gpuload.toml [jobs.train]"`` or ``"default"``)."""

    value: Any
    source: str
    raw: Any = None

    def __str__(self) -> str:
        return f"{self.value} ({self.source})"


@dataclass(frozen=True)
class CacheSettings:
    """The cache mode, size, reserve and scope one loader uses, each with its source.

    ``mode``: ``"auto"`` (device tier, then host memory, then the source), ``"device"`` (device
    tier only), ``"host"`` (host tier only) or ``"off"``. ``size`` bounds the device
    tier; ``reserve`` is device memory the cache never takes; ``scope`` (one of ``SCOPES``)
    says over which ranks of a torch.distributed job one copy of the dataset is split.
    ``disk_dir``: the disk tier's folder (a ``Path``, or None: no disk tier); ``disk_size``:
    its :class:`SizeSpec` (``auto``: the file system's free space less a reserve); ``disk_key``:
    the ``cache_key=`` keyword (a string the user changes whenever the data does, keying the disk
    tier's entry instead of gpuload's look at the dataset), or None.
    """

    mode: Setting
    size: Setting
    reserve: Setting
    job: str | None = None
    config_path: Path | None = None
    scope: Setting = Setting("auto", "default", "auto")
    disk_dir: Setting = Setting(None, "default", None)
    disk_size: Setting = Setting(SizeSpec("auto", text="auto"), "default", "auto")
    disk_key: str | None = None

    @property
    def size_spec(self) -> SizeSpec:
        return self.size.value

    @property
    def reserve_spec(self) -> SizeSpec:
        return self.reserve.value

    @classmethod
    def resolve(
        cls,
        *,
        cache: str | bool | None = None,
        cache_size: SizeValue = None,
        cache_reserve: SizeValue = None,
        job: str | None = None,
        cache_scope: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        disk_cache_size: SizeValue = None,
        cache_key: str | None = None,
        environ: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> CacheSettings:
        """Resolve each setting; a keyword left at ``None`` means "not given here".

        ``environ`` and ``cwd`` default to the process's; tests pass their own. ``cache_key`` is
        a keyword only: it names one dataset's data, not a job's defaults.
        """
        env = os.environ if environ is None else environ
        check_environment(env)  # gpuload's other variables: a bad value fails here, not mid-epoch
        job_source = "keyword job="
        if job is None and env.get(ENV_JOB):
            job, job_source = env[ENV_JOB], f"environment variable {ENV_JOB}"
        path = _config_path(env, Path(cwd) if cwd is not None else Path.cwd())
        file_values = _file_values(path, job, job_source) if path is not None else {}
        if path is None and job is not None:
            raise CacheSettingError(
                "job", job, job_source,
                f"names a job but there is no config file: no {CONFIG_FILE_NAME} in "
                f"{Path(cwd) if cwd is not None else Path.cwd()} and {ENV_CONFIG} is not set; "
                f"create one with a [jobs.{job}] table, or unset the job",
            )
        keywords = {
            "cache": cache, "cache_size": cache_size, "cache_reserve": cache_reserve, "cache_scope": cache_scope,
            "cache_dir": cache_dir, "disk_cache_size": disk_cache_size,
        }
        chosen: dict[str, tuple[Any, str]] = {}
        for key in _FILE_KEYS:
            if keywords[key] is not None:
                chosen[key] = (keywords[key], f"keyword {key}=")
            elif env.get(ENV_VARS[key], "").strip():
                chosen[key] = (env[ENV_VARS[key]], f"environment variable {ENV_VARS[key]}")
            elif key in file_values:
                chosen[key] = file_values[key]
            else:
                chosen[key] = (_DEFAULTS[key], "default")
        mode_raw, mode_source = chosen["cache"]
        size_raw, size_source = chosen["cache_size"]
        reserve_raw, reserve_source = chosen["cache_reserve"]
        scope_raw, scope_source = chosen["cache_scope"]
        dir_raw, dir_source = chosen["cache_dir"]
        disk_raw, disk_source = chosen["disk_cache_size"]
        base = path.parent if path is not None and dir_source.startswith(str(path)) else Path(cwd or Path.cwd())
        return cls(
            mode=Setting(_parse_mode(mode_raw, mode_source), mode_source, mode_raw),
            size=Setting(parse_size(size_raw, setting="cache_size", source=size_source), size_source, size_raw),
            reserve=Setting(
                parse_size(reserve_raw, setting="cache_reserve", source=reserve_source),
                reserve_source,
                reserve_raw,
            ),
            job=job,
            config_path=path,
            scope=Setting(_parse_scope(scope_raw, scope_source), scope_source, scope_raw),
            disk_dir=Setting(_parse_folder(dir_raw, dir_source, base), dir_source, dir_raw),
            disk_size=Setting(
                parse_size(disk_raw, setting="disk_cache_size", source=disk_source), disk_source, disk_raw
            ),
            disk_key=_parse_key(cache_key),
        )

    def off_reason(self) -> str | None:
        """Why these settings turn caching off (``cache="off"`` or a zero size), else None."""
        if self.mode.value == "off":
            return "cache='off'"
        if self.size_spec.kind == "off":
            return f"cache_size={self.size.raw!r} ({self.size.source}) turns it off"
        return None

    def _reserve_on(self, device: Any, memory: Any) -> int:
        """The reserve's bytes on ``device`` (of ``memory``'s card)."""
        return resolve_reserve(self.reserve_spec, memory, source=self.reserve.source, device_name=str(device))

    def device_room(self, device: Any, memory: Any, owner: Any = None) -> int:
        """Device bytes a new cache may fill now: the budget left to it, under free - reserve."""
        reserve = self._reserve_on(device, memory)
        budget = available_budget(self.size_spec, reserve, memory, device=device, owner=owner, source=self.size.source)
        return min(budget, max(0, memory.free - reserve))

    def array_plan(
        self,
        bytes_per_sample: int,
        num_samples: int,
        memory: Any,
        host: Any,
        *,
        device: Any,
        owner: Any = None,
        shared: bool = True,
        host_copies: int = 1,
        disk: bool = False,
    ) -> CachePlan:
        """Where in-memory arrays go on ``device`` (a CUDA device, or a pretended card's name):
        the reserve, the budget, then :func:`~gpuload.cache.plan.make_plan`.

        ``shared``: the budget is what other loaders of this process left (the ledger); a
        pretended card (``gpuload plan``, the bench's modelled rows) has no other loaders.
        ``host_copies``: how many processes of this node each keep their own host tier of
        these arrays (a torch.distributed job whose ranks do not share one). The host budget
        (free host memory minus the host reserve) is the node's and is counted once: each copy
        gets ``1/host_copies`` of it. ``disk``: plan the disk tier too when ``cache_dir`` is set
        (:meth:`disk_room`).
        """
        name = str(device)
        reserve = self._reserve_on(device, memory)
        if shared:
            budget = available_budget(self.size_spec, reserve, memory, device=device, owner=owner,
                                      source=self.size.source)
        else:
            budget = resolve_budget(self.size_spec, memory, reserve, source=self.size.source, device_name=name)
        host_reserve = default_host_reserve(host.total)
        node_room = max(0, host.free - host_reserve)
        if host_copies > 1:  # the other copies' shares count as reserved here
            host_reserve = host.free - node_room // host_copies
        plan = make_plan(
            bytes_per_sample, num_samples, memory.free, host.free, budget, reserve, self.mode.value,
            device_total=memory.total, host_total=host.total, host_reserve=host_reserve, target="cuda",
            disk_room=self.disk_room() if disk else 0,
        )
        if host_copies > 1:
            note = (
                f"the host budget ({format_bytes(node_room)}) is the node's: each of its {host_copies} "
                f"ranks keeps its own host copy in 1/{host_copies} of it (the reserve shown includes the "
                "other ranks' shares)"
            )
            plan = replace(plan, notes=(*plan.notes, note))
        return plan

    def disk_room(self) -> int:
        """Bytes the disk tier may hold (``disk_cache_size``, by default the free space of the
        folder's file system less a reserve); 0 without ``cache_dir``."""
        folder = self.disk_dir.value
        if folder is None:
            return 0
        existing = Path(folder).expanduser().absolute()
        while not existing.exists() and existing != existing.parent:  # the folder is made when first used
            existing = existing.parent
        return disk_budget(existing, self.disk_size.value)

    def keepable(self, device: Any, memory: Any, held: int) -> int:
        """Device bytes a cache now holding ``held`` may keep with free memory above the reserve
        (called at each epoch start: the model may have grown into the reserve).

        Free here is what torch can allocate now (``MemoryInfo.free_to_torch``): the bytes a
        shrink gives back stay in torch's caching allocator, not the driver's free memory, so
        counting the driver's alone would find the reserve short again at every epoch start and
        drain the cache epoch by epoch. Keeping needs no more room than the last step had with
        the cache this size; growing does (:meth:`room_check`, :meth:`device_room`)."""
        return max(0, memory.free_to_torch + held - self._reserve_on(device, memory))

    def room_check(self, device: Any) -> Any:
        """For a cache filling ``device`` bit by bit: a function giving the bytes it may still
        add now (the driver's free memory above the reserve: torch's unused blocks are mostly
        the next step's activations), or None off CUDA."""
        from gpuload.device import device_memory

        if getattr(device, "type", None) != "cuda":
            return None

        def room() -> int:
            memory = device_memory(device)
            return max(0, memory.free - self._reserve_on(device, memory))

        return room

    def host_room(self, memory: Any, *, sized: bool = True) -> int:
        """Host bytes a host-memory cache may fill: free minus the host reserve, or less if
        ``cache_size`` names an amount (``sized``: the size applies to this host tier)."""
        host_reserve = default_host_reserve(memory.total)
        room = max(0, memory.free - host_reserve)
        if not sized or self.size_spec.kind == "auto":
            return room
        asked = resolve_budget(self.size_spec, memory, host_reserve, source=self.size.source, device_name="host memory")
        return min(asked, room)

    def describe(self) -> str:
        """One line per setting, with its source."""
        lines = [
            f"cache={self.mode.value} ({self.mode.source})",
            f"cache_size={self.size.value} ({self.size.source})",
            f"cache_reserve={self.reserve.value} ({self.reserve.source})",
            f"cache_scope={self.scope.value} ({self.scope.source})",
        ]
        if self.disk_dir.value is not None:
            lines.append(f"cache_dir={self.disk_dir.value} ({self.disk_dir.source})")
            lines.append(f"disk_cache_size={self.disk_size.value} ({self.disk_size.source})")
            if self.disk_key is not None:
                lines.append(f"cache_key={self.disk_key!r} (keyword cache_key=)")
        if self.job is not None:
            lines.append(f"job={self.job}")
        if self.config_path is not None:
            lines.append(f"config file: {self.config_path}")
        return "\n".join(lines)

    __str__ = describe


def _parse_mode(value: Any, source: str) -> str:
    if value is True:
        return "auto"
    if value is False:
        return "off"
    if isinstance(value, str) and value.strip().lower() in MODES:
        return value.strip().lower()
    raise CacheSettingError(
        "cache", value, source, f"is not a cache mode; use one of {', '.join(repr(m) for m in MODES)}"
    )


def _parse_scope(value: Any, source: str) -> str:
    if isinstance(value, str) and value.strip().lower() in SCOPES:
        return value.strip().lower()
    raise CacheSettingError(
        "cache_scope", value, source,
        f"is not a cache scope; use one of {', '.join(repr(s) for s in SCOPES)}",
    )


def _parse_key(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value.strip()):
        return value
    raise CacheSettingError(
        "cache_key", value, "keyword cache_key=",
        "is not a non-empty string; give one you change whenever the dataset's samples change (e.g. 'v3')",
    )


def _parse_folder(value: Any, source: str, base: Path) -> Path | None:
    """The disk tier's folder: None or "" for none; a relative path is taken from ``base`` (the
    working directory, or the config file's folder for a path written there)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise CacheSettingError(
            "cache_dir", value, source,
            f"is a {type(value).__name__}, not a folder path; give a path such as '/scratch/gpuload'"
        )
    path = Path(os.fspath(value)).expanduser()
    path = path if path.is_absolute() else base / path
    if path.exists() and not path.is_dir():
        raise CacheSettingError(
            "cache_dir", value, source, "is a file, not a folder; point it at a folder (created if missing)"
        )
    return path


def _config_path(env: Mapping[str, str], cwd: Path) -> Path | None:
    explicit = env.get(ENV_CONFIG, "").strip()
    if explicit:
        path = Path(explicit)
        if not path.is_absolute():
            path = cwd / path
        if not path.is_file():
            raise CacheSettingError(
                ENV_CONFIG, explicit, f"environment variable {ENV_CONFIG}",
                "is not a file; point it at a gpuload.toml or unset it",
            )
        return path
    candidate = cwd / CONFIG_FILE_NAME
    return candidate if candidate.is_file() else None


def _check_keys(table: Mapping[str, Any], allowed: tuple[str, ...], where: str, path: Path) -> None:
    unknown = [k for k in table if k not in allowed]
    if unknown:
        raise CacheSettingError(
            unknown[0], table[unknown[0]], f"{path} {where}".strip(),
            f"is not a gpuload setting; the keys allowed there are {', '.join(allowed)}",
        )


def _file_values(path: Path, job: str | None, job_source: str) -> dict[str, tuple[Any, str]]:
    try:
        with open(path, "rb") as handle:
            document = tomllib.load(handle)
    except tomllib.TOMLDecodeError as error:
        raise CacheSettingError("config file", str(path), "gpuload", f"is not valid TOML: {error}") from None
    except UnicodeDecodeError as error:
        raise CacheSettingError(
            "config file", str(path), "gpuload", f"is not UTF-8 text, as TOML must be ({error})"
        ) from None
    except OSError as error:
        raise CacheSettingError(
            "config file", str(path), "gpuload",
            f"cannot be read ({type(error).__name__}: {error.strerror or error}); fix its permissions, "
            f"or point {ENV_CONFIG} at another file",
        ) from None
    _check_keys(document, (*_FILE_KEYS, "jobs"), "(top level)", path)
    jobs = document.get("jobs", {})
    if not isinstance(jobs, dict) or any(not isinstance(t, dict) for t in jobs.values()):
        raise CacheSettingError(
            "jobs", jobs, str(path), "must be tables: write [jobs.NAME] sections with cache settings"
        )
    values = {key: (document[key], str(path)) for key in _FILE_KEYS if key in document}
    if job is not None:
        if job not in jobs:
            known = ", ".join(sorted(jobs)) if jobs else "none"
            raise CacheSettingError(
                "job", job, job_source,
                f"is not a job in {path}; the jobs there are: {known}",
            )
        _check_keys(jobs[job], _FILE_KEYS, f"[jobs.{job}]", path)
        values.update({k: (v, f"{path} [jobs.{job}]") for k, v in jobs[job].items()})
    else:
        for name, table in jobs.items():
            _check_keys(table, _FILE_KEYS, f"[jobs.{name}]", path)
    return values
