"""The VRAM-aware cache: every decision about keeping a dataset's bytes, and the storage.

- ``settings``: what the user asked for (keyword > environment > gpuload.toml > default), and
  the budget arithmetic (room on the device, on the host, what a cache may keep);
- ``budget``: sizes, reserves and the process-wide ledger that loaders share;
- ``plan``: the pure placement plan of in-memory arrays over device / pinned host / source;
- ``decide``: whether and where a dataset's samples or images are kept, and why;
- ``probe``: looking at a dataset first (does it read the same twice? how large are its images?);
- ``array_store`` and ``sample_store``: the storage itself; ``oom``: telling OOM from other errors.
"""

from gpuload.cache.array_store import StoreStats, TieredArrayStore
from gpuload.cache.budget import (
    LEDGER,
    BudgetLedger,
    CacheSettingError,
    SizeSpec,
    available_budget,
    default_reserve,
    format_bytes,
    parse_size,
    resolve_budget,
    resolve_reserve,
)
from gpuload.cache.decide import CacheDecision, decide_images, decide_samples
from gpuload.cache.oom import CacheFallbackWarning
from gpuload.cache.plan import MODES, CachePlan, default_host_reserve, make_plan
from gpuload.cache.probe import estimate_image_bytes, looks_deterministic
from gpuload.cache.sample_store import SampleCache, SampleCacheStats
from gpuload.cache.settings import CacheSettings, Setting

__all__ = [
    "LEDGER",
    "MODES",
    "BudgetLedger",
    "CacheDecision",
    "CacheFallbackWarning",
    "CachePlan",
    "CacheSettingError",
    "CacheSettings",
    "SampleCache",
    "SampleCacheStats",
    "Setting",
    "SizeSpec",
    "StoreStats",
    "TieredArrayStore",
    "available_budget",
    "decide_images",
    "decide_samples",
    "default_host_reserve",
    "default_reserve",
    "estimate_image_bytes",
    "format_bytes",
    "looks_deterministic",
    "make_plan",
    "parse_size",
    "resolve_budget",
    "resolve_reserve",
]
