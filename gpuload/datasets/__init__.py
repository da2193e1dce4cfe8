"""Dataset sources gpuload understands natively: in-memory arrays, image files and token windows."""

from gpuload.datasets.arrays import ArrayDataset
from gpuload.datasets.images import ImageFolder, ImageList, ImageSource, as_image_source, make_sample_image_folder
from gpuload.datasets.tokens import TokenWindows

__all__ = [
    "ArrayDataset", "ImageFolder", "ImageList", "ImageSource", "TokenWindows", "as_image_source",
    "make_sample_image_folder",
]
