"""The VRAM-aware cache: every decision about keeping a dataset's bytes, and the storage.

- ``settings``: what the user asked for (keyword > environment > gpuload.toml > default), and
  the budget arithmetic (room on the device, on the host, what a cache may keep);
- ``budget``: sizes, reserves and the process-wide ledger that loaders share;
- ``plan``: the pure placement plan of in-memory arrays: an ordered tuple of tier plans
  (device, host), the rest read from the source;
- ``decide``: whether and where a dataset's samples or images are kept, and why;
- ``probe``: looking at a dataset first (does it read the same twice? how large are its images?);
- ``store``: the one interface of every store (``Store``: gather, shrink, stats, close; a
  ``FillingStore`` also takes ``put``);
- ``tiers``: the tiers of the array store, one class each, registered by name;
- the stores: ``array_store`` (array rows over the tiers), ``sample_store`` (samples one by one,
  and what the sample caches share), ``columns`` (a dataset's samples by column);
- ``oom``: telling OOM from other errors.
"""

from gpuload.cache.array_store import TieredArrayStore
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
from gpuload.cache.identity import IdentityError
from gpuload.cache.oom import CacheFallbackWarning
from gpuload.cache.plan import MODES, CachePlan, TierPlan, default_host_reserve, make_plan
from gpuload.cache.probe import estimate_image_bytes, looks_deterministic
from gpuload.cache.sample_store import SampleCache, SampleCacheStats
from gpuload.cache.settings import CacheSettings, Setting
from gpuload.cache.store import FillingStore, Store, StoreStats
from gpuload.cache.tiers import TIERS, Tier, register_tier

__all__ = [
    "LEDGER",
    "MODES",
    "BudgetLedger",
    "CacheDecision",
    "CacheFallbackWarning",
    "CachePlan",
    "CacheSettingError",
    "CacheSettings",
    "FillingStore",
    "IdentityError",
    "SampleCache",
    "SampleCacheStats",
    "Setting",
    "SizeSpec",
    "Store",
    "StoreStats",
    "TIERS",
    "Tier",
    "TierPlan",
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
    "register_tier",
    "resolve_budget",
    "resolve_reserve",
]
