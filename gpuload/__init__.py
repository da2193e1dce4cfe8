"""gpuload: a drop-in replacement for torch's DataLoader that keeps data on the GPU."""

from typing import Any

from gpuload.loader import DataLoader
from gpuload.datasets.arrays import ArrayDataset
from gpuload.datasets.tokens import TokenWindows

__all__ = ["DataLoader", "ArrayDataset", "TokenWindows", "JobPlan", "plan_job", "__version__"]
__version__ = "0.1.0"

_LAZY = {"plan_job": "gpuload.job.plan", "JobPlan": "gpuload.job.plan"}


def __getattr__(name: str) -> Any:
    """``plan_job`` and ``JobPlan`` load on first use: ``import gpuload`` stays fast."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gpuload' has no attribute {name!r}")
