"""The datasets gpuload understands natively: in-memory arrays, Arrow tables, image files, token windows and
packed documents."""

from gpuload.datasets.arrays import ArrayDataset
from gpuload.datasets.arrow import ArrowTable, Parquet
from gpuload.datasets.images import ImageFiles, ImageFolder, ImageList, as_image_source, make_sample_image_folder
from gpuload.datasets.packing import PackedTokens
from gpuload.datasets.tokens import TokenWindows

#: ``ImageFiles``' public name before issue #35's vocabulary, kept.
ImageSource = ImageFiles  # vocab: keep (the public alias)

__all__ = [
    "ArrayDataset", "ArrowTable", "ImageFolder", "ImageList", "ImageFiles", "PackedTokens", "Parquet", "TokenWindows",
    "as_image_source", "make_sample_image_folder",
    "ImageSource",  # vocab: keep (the public alias)
]
