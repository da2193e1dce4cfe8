"""gpuload: a drop-in replacement for torch's DataLoader that keeps data on the GPU."""

from gpuload.loader import DataLoader
from gpuload.datasets.arrays import ArrayDataset

__all__ = ["DataLoader", "ArrayDataset", "__version__"]
__version__ = "0.1.0"
