"""Image-file datasets: a class-per-folder tree, a list of (path, label), or a torchvision one.

gpuload reads these as encoded bytes (:meth:`ImageFiles.read_encoded`) and decodes whole
batches itself (``gpuload.decode``, DALI on the GPU). As map-style torch Datasets they also
decode one sample at a time on the CPU, to what ``torchvision.io.decode_image`` gives (uint8
RGB (3, H, W), EXIF-upright), so a plain ``torch.utils.data.DataLoader`` works on them too.

Depending on ``gpuload.decode`` from a dataset is deliberate: ``__getitem__`` must decode to be
a torch Dataset, and the decode package does not import the sources back.
"""

from __future__ import annotations

import io
import os
import random
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from gpuload.decode import ImageDecodeError, check_pixels, cpu

__all__ = [
    "IMG_EXTENSIONS",
    "ImageFiles",
    "ImageFolder",
    "ImageList",
    "ImageSource",  # vocab: keep (the public alias)
    "as_image_source",
    "SAMPLE_PHOTOS",
    "make_sample_image_folder",
]


def _supported_extensions() -> tuple[str, ...]:
    from PIL import features

    extensions = [".jpg", ".jpeg", ".png", ".bmp"]
    if features.check("webp"):
        extensions.append(".webp")
    return tuple(extensions)


IMG_EXTENSIONS: tuple[str, ...] = _supported_extensions()
"""File endings (lower case) that ImageFolder picks up; .webp only where PIL can decode it."""


def _folder_identity(path: str) -> tuple[int, int] | None:
    """What makes a folder the same folder through any path: its device and inode."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino


class ImageFiles(Dataset):
    """Samples that are encoded image files with integer labels.

    Subclasses fill ``samples`` (a list of ``(path, label)``); ``classes`` and ``class_to_idx``
    are filled where the labels have names.
    """

    samples: list[tuple[str, int]]
    classes: list[str]
    class_to_idx: dict[str, int]

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def targets(self) -> list[int]:
        """The label of every sample, in order (torchvision's name for it)."""
        return [label for _, label in self.samples]

    def path(self, index: int) -> str:
        """The file behind sample ``index``."""
        return self.samples[index][0]

    def label(self, index: int) -> int:
        """The label of sample ``index``, without reading its file."""
        return self.samples[index][1]

    def paths(self, indices: Sequence[int]) -> list[str]:
        """:meth:`path` of each of a batch's ``indices`` (a subclass overriding one overrides both)."""
        samples = self.samples
        return [samples[index][0] for index in indices]

    def labels(self, indices: Sequence[int]) -> list[int]:
        """:meth:`label` of each of a batch's ``indices`` (a subclass overriding one overrides both)."""
        samples = self.samples
        return [samples[index][1] for index in indices]

    def read_encoded(self, index: int) -> tuple[bytes, int]:
        """The file's bytes, undecoded, and the label; ImageDecodeError if it cannot be read."""
        path, label = self.samples[index]
        try:
            with open(path, "rb") as file:
                return file.read(), label
        except OSError as error:
            raise ImageDecodeError(index, path, "read", f"{type(error).__name__}: {error}") from error

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """The decoded image and label; ImageDecodeError for a bad file or one over the pixel
        limit (``gpuload.decode.default_max_pixels()``, checked from the header first)."""
        data, label = self.read_encoded(index)
        backend = "torchvision" if cpu.torchvision_available() else "pil"
        try:
            check_pixels(data)
            image = cpu.cpu_decoder(backend)(data, None)
        except Exception as error:
            reason = "the file is empty (0 bytes)" if not data else cpu.describe_error(error)
            raise ImageDecodeError(index, self.path(index), backend, reason) from error
        return image, label

    def __repr__(self) -> str:
        classes = f", {len(self.classes)} classes" if getattr(self, "classes", None) else ""
        return f"{type(self).__name__}({len(self)} images{classes})"


#: ``ImageFiles``' public name before issue #35's vocabulary (a source is a ``gpuload.sources.Source``),
#: kept so that code and pickles naming it go on working.
ImageSource = ImageFiles  # vocab: keep (the public alias)


class ImageFolder(ImageFiles):
    """``root/<class>/**/<image>``, indexed exactly like ``torchvision.datasets.ImageFolder``.

    Classes are the sorted sub-folder names of ``root`` (label = position); files are walked
    per class in sorted order, following links, and kept when their ending (any case) is in
    ``extensions``.
    """

    def __init__(self, root: str | os.PathLike[str], extensions: Iterable[str] | None = None) -> None:
        self.root = os.fspath(root)
        self.extensions = tuple(e.lower() for e in (extensions or IMG_EXTENSIONS))
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"ImageFolder root {self.root!r} is not a directory")
        self.classes = sorted(entry.name for entry in os.scandir(self.root) if entry.is_dir())
        if not self.classes:
            raise FileNotFoundError(
                f"ImageFolder found no class folders in {self.root!r}; it expects "
                "root/<class name>/<image files>"
            )
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.samples = []
        empty = []
        for name in self.classes:
            before = len(self.samples)
            folder = os.path.join(self.root, name)
            seen: dict[tuple[int, int], str] = {}  # (device, inode) -> first path to the folder
            again: list[str] = []
            first_of_again = ""  # the first path to the folder again[0] reaches
            for parent, _, files in sorted(os.walk(folder, followlinks=True)):
                key = _folder_identity(parent)
                if key is not None and seen.setdefault(key, parent) != parent:
                    again.append(parent)
                    first_of_again = first_of_again or seen[key]
                for file in sorted(files):
                    if file.lower().endswith(self.extensions):
                        self.samples.append((os.path.join(parent, file), self.class_to_idx[name]))
            if again:
                warnings.warn(
                    f"ImageFolder: class {name!r} reaches {len(again)} folder(s) a second time through "
                    f"symbolic links (a link loop?), e.g. {again[0]!r} is {first_of_again!r}; "
                    "their files are listed once per path, as torchvision does: remove the link to "
                    "count each image once",
                    stacklevel=2,
                )
            if len(self.samples) == before:
                empty.append(name)
        if empty:
            raise FileNotFoundError(
                f"ImageFolder found no {'/'.join(self.extensions)} files for the class(es) "
                f"{', '.join(empty)} under {self.root!r}"
            )


class ImageList(ImageFiles):
    """Samples from a list of ``(path, label)`` pairs; relative paths are taken under ``root``."""

    def __init__(
        self,
        pairs: Iterable[tuple[str | os.PathLike[str], int]],
        root: str | os.PathLike[str] | None = None,
        classes: Sequence[str] | None = None,
    ) -> None:
        self.samples = []
        for position, pair in enumerate(pairs):
            try:
                path, label = pair
            except (TypeError, ValueError):
                raise ValueError(
                    f"ImageList entry {position} is {pair!r}; each entry is (path, integer label)"
                ) from None
            if isinstance(label, torch.Tensor | np.integer):
                label = int(label)
            if not isinstance(label, int) or isinstance(label, bool):
                raise TypeError(
                    f"ImageList entry {position} ({os.fspath(path)!r}) has label {label!r} of "
                    f"type {type(label).__name__}; labels must be integers"
                )
            full = os.path.join(os.fspath(root), os.fspath(path)) if root else os.fspath(path)
            self.samples.append((full, label))
        self.classes = list(classes) if classes is not None else []
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}


# torchvision's own loaders, which read a file as a PIL image: gpuload's decoders do the same.
_IMAGE_LOADERS = ("default_loader", "pil_loader", "accimage_loader")


def as_image_source(dataset: Any, ignore_transforms: bool = False) -> ImageFiles | None:
    """The :class:`ImageFiles` to read ``dataset`` from, or None if it is not image files.

    gpuload's image datasets come back as they are; anything else with a torchvision-style
    ``samples`` list of ``(path, label)`` (torchvision's ImageFolder / DatasetFolder) becomes an
    :class:`ImageList` with its ``classes``. Its own ``transform`` would be bypassed, so one
    that has a ``transform`` or ``target_transform`` raises ValueError unless
    ``ignore_transforms=True``; one with a custom ``loader`` (files that are not plain images)
    always does.
    """
    if isinstance(dataset, ImageFiles):
        return dataset
    samples = getattr(dataset, "samples", None)
    if not isinstance(samples, Sequence) or isinstance(samples, str | bytes):
        return None
    if samples and not all(
        isinstance(s, Sequence) and len(s) == 2 and isinstance(s[0], str | os.PathLike) for s in samples[:16]
    ):
        return None
    loader = getattr(dataset, "loader", None)
    if loader is not None and getattr(loader, "__name__", "") not in _IMAGE_LOADERS:
        raise ValueError(
            f"{type(dataset).__name__} reads its files with a custom loader ({loader!r}); gpuload "
            "decodes files as images itself, so it cannot honour that loader. Use a dataset whose "
            "files are plain images (JPEG, PNG, ...), or keep torch's DataLoader for this one"
        )
    if not ignore_transforms:
        for attribute in ("transform", "target_transform"):
            if getattr(dataset, attribute, None) is not None:
                raise ValueError(
                    f"{type(dataset).__name__} has a {attribute} ({getattr(dataset, attribute)!r}); "
                    "gpuload reads its files directly and decodes and augments on the device, so "
                    "that transform would not run. Set it to None and pass gpuload transforms=, "
                    "or pass ignore_transforms=True"
                )
    return ImageList(samples, classes=getattr(dataset, "classes", None))


SAMPLE_PHOTOS: tuple[str, ...] = (
    "grace_hopper.jpg",  # photograph, 512x600 RGB
    "Minduka_Present_Blue_Pack.png",  # photo-like illustration, 128x128 RGBA
    "jacksboro_fault_dem.npz",  # real elevation model, 344x403, rendered with a colormap
    "s1045.ima.gz",  # real MRI slice, 256x256 16-bit grey
)
"""matplotlib's ``mpl-data/sample_data`` files that make_sample_image_folder draws from."""


def _sample_data_dir() -> Path:
    import matplotlib

    return Path(matplotlib.get_data_path()) / "sample_data"


def _load_sample_photos() -> list[Any]:
    """The SAMPLE_PHOTOS as RGB PIL images."""
    import gzip

    from matplotlib import colormaps
    from PIL import Image

    folder = _sample_data_dir()
    photos = [Image.open(folder / "grace_hopper.jpg").convert("RGB")]
    with Image.open(folder / "Minduka_Present_Blue_Pack.png") as present:
        white = Image.new("RGBA", present.size, (255, 255, 255, 255))
        photos.append(Image.alpha_composite(white, present.convert("RGBA")).convert("RGB"))
    with np.load(folder / "jacksboro_fault_dem.npz") as dem:
        elevation = dem["elevation"].astype(np.float32)
    scaled = (elevation - elevation.min()) / max(float(np.ptp(elevation)), 1.0)
    photos.append(Image.fromarray((colormaps["gist_earth"](scaled)[..., :3] * 255).astype(np.uint8)))
    with gzip.open(folder / "s1045.ima.gz") as mri:
        slice16 = np.frombuffer(mri.read(), dtype=np.uint16).reshape(256, 256).astype(np.float32)
    grey = (255 * slice16 / max(float(slice16.max()), 1.0)).astype(np.uint8)
    photos.append(Image.fromarray(grey).convert("RGB"))
    return photos


def make_sample_image_folder(
    root: str | os.PathLike[str], num_images: int = 1000, num_classes: int = 10, seed: int = 0
) -> ImageFolder:
    """Write an ImageNet-like folder of ``num_images`` JPEGs in ``num_classes`` classes.

    Each image is a random crop of one of :data:`SAMPLE_PHOTOS` (real photographs and real
    measured data shipped with matplotlib, not noise, so JPEG sizes and decode costs are those
    of real pictures), resized to around 500x375 (landscape or portrait, +-20%), maybe
    mirrored, brightness-jittered and saved at quality 85-95 with 4:2:0 chroma. Labels are
    assigned round-robin (``class_000``, ...). The same seed writes the same files.
    """
    from PIL import Image, ImageEnhance

    if num_images < 1 or num_classes < 1:
        raise ValueError(f"need num_images >= 1 and num_classes >= 1, got {num_images}, {num_classes}")
    if num_classes > num_images:
        raise ValueError(
            f"num_classes={num_classes} > num_images={num_images} would leave empty classes, "
            "which ImageFolder rejects"
        )
    rng = random.Random(seed)
    photos = _load_sample_photos()
    root = Path(root)
    for c in range(num_classes):
        (root / f"class_{c:03d}").mkdir(parents=True, exist_ok=True)
    for i in range(num_images):
        # The photograph carries most of the set, as photos do in ImageNet.
        photo = photos[0] if rng.random() < 0.7 else photos[rng.randrange(1, len(photos))]
        width = int(500 * rng.uniform(0.8, 1.2))
        height = int(width * 0.75 * rng.uniform(0.9, 1.1))
        if rng.random() < 0.25:
            width, height = height, width
        pw, ph = photo.size
        scale = rng.uniform(0.35, 1.0)
        aspect = width / height
        cw = max(16, min(pw, int(round((scale * pw * ph * aspect) ** 0.5))))
        ch = max(16, min(ph, int(round(cw / aspect))))
        x0, y0 = rng.randint(0, pw - cw), rng.randint(0, ph - ch)
        image = photo.crop((x0, y0, x0 + cw, y0 + ch)).resize((width, height), Image.BICUBIC)
        if rng.random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        image = ImageEnhance.Brightness(image).enhance(rng.uniform(0.8, 1.2))
        path = root / f"class_{i % num_classes:03d}" / f"img_{i:06d}.jpg"
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=rng.randint(85, 95), subsampling=2)
        path.write_bytes(buffer.getvalue())
    return ImageFolder(root)
