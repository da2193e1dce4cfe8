"""Dataset sources gpuload understands natively: in-memory arrays, image files, token windows and packed documents."""

from gpuload.datasets.arrays import ArrayDataset
from gpuload.datasets.images import ImageFolder, ImageList, ImageSource, as_image_source, make_sample_image_folder
from gpuload.datasets.packing import PackedTokens
from gpuload.datasets.tokens import TokenWindows

__all__ = [
    "ArrayDataset", "ImageFolder", "ImageList", "ImageSource", "PackedTokens", "TokenWindows", "as_image_source",
    "make_sample_image_folder",
]
