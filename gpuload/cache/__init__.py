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

from typing import TYPE_CHECKING

from gpuload.lazy import lazy_getattr

if TYPE_CHECKING:
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
    from gpuload.cache.sample_store import SampleStore, SampleStoreStats
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
    "SampleStore",
    "SampleStoreStats",
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

# Loaded on first use: the torch-free parts (settings, the disk tier's entry listing) then
# import without torch, so that ``gpuload cache ls`` answers at once.
_LAZY = {
    "BudgetLedger": "gpuload.cache.budget",
    "CacheDecision": "gpuload.cache.decide",
    "CacheFallbackWarning": "gpuload.cache.oom",
    "CachePlan": "gpuload.cache.plan",
    "CacheSettingError": "gpuload.cache.budget",
    "CacheSettings": "gpuload.cache.settings",
    "FillingStore": "gpuload.cache.store",
    "IdentityError": "gpuload.cache.identity",
    "LEDGER": "gpuload.cache.budget",
    "MODES": "gpuload.cache.plan",
    "SampleStore": "gpuload.cache.sample_store",
    "SampleStoreStats": "gpuload.cache.sample_store",
    "Setting": "gpuload.cache.settings",
    "SizeSpec": "gpuload.cache.budget",
    "Store": "gpuload.cache.store",
    "StoreStats": "gpuload.cache.store",
    "TIERS": "gpuload.cache.tiers",
    "Tier": "gpuload.cache.tiers",
    "TierPlan": "gpuload.cache.plan",
    "TieredArrayStore": "gpuload.cache.array_store",
    "available_budget": "gpuload.cache.budget",
    "decide_images": "gpuload.cache.decide",
    "decide_samples": "gpuload.cache.decide",
    "default_host_reserve": "gpuload.cache.plan",
    "default_reserve": "gpuload.cache.budget",
    "estimate_image_bytes": "gpuload.cache.probe",
    "format_bytes": "gpuload.cache.budget",
    "looks_deterministic": "gpuload.cache.probe",
    "make_plan": "gpuload.cache.plan",
    "parse_size": "gpuload.cache.budget",
    "register_tier": "gpuload.cache.tiers",
    "resolve_budget": "gpuload.cache.budget",
    "resolve_reserve": "gpuload.cache.budget",
}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
