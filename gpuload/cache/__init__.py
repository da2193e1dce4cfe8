"""The VRAM-aware cache: how many bytes (budget), where each sample goes (plan), the storage (tiers).

``settings`` resolves what the user asked for (keyword > environment > gpuload.toml >
default); ``budget`` turns it into bytes for one device and books it in a process-wide
ledger; ``plan`` decides placement as plain data; ``tiers`` holds the bytes and serves
batches.
"""

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
from gpuload.cache.plan import CachePlan, default_host_reserve, make_plan
from gpuload.cache.settings import CacheSettings, Setting
from gpuload.cache.tiers import (
    CacheFallbackWarning,
    SampleCache,
    SampleCacheStats,
    StoreStats,
    TieredArrayStore,
    looks_deterministic,
)

__all__ = [
    "LEDGER",
    "BudgetLedger",
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
    "default_host_reserve",
    "default_reserve",
    "format_bytes",
    "looks_deterministic",
    "make_plan",
    "parse_size",
    "resolve_budget",
    "resolve_reserve",
]
