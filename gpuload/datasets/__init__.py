"""Dataset sources gpuload understands natively."""

from gpuload.datasets.arrays import ArrayDataset

__all__ = ["ArrayDataset"]
