"""Dataset sources gpuload understands natively: in-memory arrays, Arrow tables, image files, token windows and
packed documents."""

from gpuload.datasets.arrays import ArrayDataset
from gpuload.datasets.arrow import ArrowTable, Parquet
from gpuload.datasets.images import ImageFiles, ImageFolder, ImageList, as_image_source, make_sample_image_folder
from gpuload.datasets.packing import PackedTokens
from gpuload.datasets.tokens import TokenWindows

__all__ = [
    "ArrayDataset", "ArrowTable", "ImageFolder", "ImageList", "ImageFiles", "PackedTokens", "Parquet", "TokenWindows",
    "as_image_source", "make_sample_image_folder",
]
