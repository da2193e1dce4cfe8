"""gpuload: a drop-in replacement for torch's DataLoader that keeps data on the GPU."""

from typing import TYPE_CHECKING

from gpuload.lazy import lazy_getattr

if TYPE_CHECKING:
    from gpuload.datasets.arrays import ArrayDataset
    from gpuload.datasets.packing import PackedTokens
    from gpuload.datasets.tokens import TokenWindows
    from gpuload.job.plan import JobPlan, plan_job
    from gpuload.loader import DataLoader

__all__ = ["DataLoader", "ArrayDataset", "TokenWindows", "PackedTokens", "JobPlan", "plan_job", "__version__"]
__version__ = "0.1.0"

# Loaded on first use, so that ``import gpuload`` (and the ``gpuload`` command's --help) does
# not import torch.
_LAZY = {"DataLoader": "gpuload.loader", "ArrayDataset": "gpuload.datasets.arrays",
         "TokenWindows": "gpuload.datasets.tokens",
         "PackedTokens": "gpuload.datasets.packing", "plan_job": "gpuload.job.plan", "JobPlan": "gpuload.job.plan"}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
