"""Image-file datasets: ImageFolder indexing, ImageList, torchvision-style datasets, the sample folder."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from types import SimpleNamespace

import image_fixtures as F
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader as TorchDataLoader

from gpuload.datasets.images import (
    IMG_EXTENSIONS,
    SAMPLE_PHOTOS,
    ImageFiles,
    ImageFolder,
    ImageList,
    as_image_source,
    make_sample_image_folder,
)
from gpuload.decode import ImageDecodeError


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """root/{dog,cat,bird}/..., with nested folders, mixed-case endings and files to ignore."""
    root = tmp_path_factory.mktemp("folder")
    files = {
        "dog/b.jpg": F.jpeg("baseline-420"),
        "dog/a.JPEG": F.jpeg("progressive-444"),
        "dog/notes.txt": b"not an image",
        "dog/puppies/c.png": F.png("RGBA"),
        "cat/z.png": F.png("L"),
        "cat/m.jpg": F.jpeg_with_orientation(6),
        "bird/only.jpeg": F.jpeg("grayscale"),
        "bird/.hidden/skip.gif": F.encode(F.photo(), "GIF"),
    }
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (root / "README.md").write_bytes(b"a file beside the class folders is not a class")
    return root


def test_image_folder_indexes_like_torchvision(tree: Path) -> None:
    ds = ImageFolder(tree)
    assert ds.classes == ["bird", "cat", "dog"]
    assert ds.class_to_idx == {"bird": 0, "cat": 1, "dog": 2}
    expected = [
        ("bird/only.jpeg", 0),
        ("cat/m.jpg", 1),
        ("cat/z.png", 1),
        ("dog/a.JPEG", 2),
        ("dog/b.jpg", 2),
        ("dog/puppies/c.png", 2),
    ]
    assert ds.samples == [(os.path.join(tree, p), label) for p, label in expected]
    assert ds.targets == [0, 1, 1, 2, 2, 2]
    assert len(ds) == 6 and ds.path(5).endswith("c.png")
    assert "6 images, 3 classes" in repr(ds)


def test_a_folder_removed_while_it_is_listed_is_listed_as_the_walk_found_it(tree: Path, monkeypatch) -> None:
    """The walk found ``dog/puppies`` and its file; the folder is gone when asked which folder it is
    (another process removed it): nothing to tell apart from a link loop, its file stays listed."""
    stat = os.stat
    removed = os.path.join(tree, "dog", "puppies")

    def gone(path, *args, **kwargs):
        if os.fspath(path) == removed:
            raise FileNotFoundError(2, "No such file or directory", removed)
        return stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", gone)
    ds = ImageFolder(tree)
    assert ds.samples[-1] == (os.path.join(removed, "c.png"), 2) and len(ds) == 6


def test_image_folder_extensions_can_be_narrowed(tree: Path) -> None:
    ds = ImageFolder(tree, extensions=[".PNG", ".jpeg"])
    assert [os.path.basename(p) for p, _ in ds.samples] == ["only.jpeg", "z.png", "a.JPEG", "c.png"]
    assert {".jpg", ".jpeg", ".png", ".bmp"} <= set(IMG_EXTENSIONS)


def test_image_folder_errors_say_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        ImageFolder(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no class folders"):
        ImageFolder(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "x.jpg").write_bytes(F.jpeg("grayscale"))
    (tmp_path / "b" / "x.txt").write_bytes(b"text")
    with pytest.raises(FileNotFoundError, match="for the class\\(es\\) b under"):
        ImageFolder(tmp_path)


def test_read_encoded_returns_the_file_bytes_and_label(tree: Path) -> None:
    ds = ImageFolder(tree)
    for i in range(len(ds)):
        data, label = ds.read_encoded(i)
        assert data == Path(ds.path(i)).read_bytes() and label == ds.targets[i]


def test_a_batchs_paths_and_labels_are_each_samples(tree: Path) -> None:
    ds = ImageFolder(tree)
    batch = [len(ds) - 1, 0, 1, 0]
    assert ds.paths(batch) == [ds.path(i) for i in batch] and ds.labels(batch) == [ds.label(i) for i in batch]
    assert ds.paths([]) == [] and ds.labels([]) == []


def test_getitem_decodes_like_torchvision_io(tree: Path) -> None:
    ds = ImageFolder(tree)
    for i in range(len(ds)):
        image, label = ds[i]
        assert isinstance(image, torch.Tensor) and image.dtype == torch.uint8 and image.shape[0] == 3
        assert label == ds.targets[i]
        reference = F.pil_reference(Path(ds.path(i)).read_bytes())
        assert F.diff_stats(image, reference)[1] <= 4
    rotated, _ = ds[ds.samples.index((os.path.join(tree, "cat/m.jpg"), 1))]
    assert rotated.shape == (3, F.WIDTH, F.HEIGHT)  # EXIF orientation 6 turns it on its side


def test_plain_torch_dataloader_reads_it(tree: Path) -> None:
    ds = ImageFolder(tree)
    seen = [(tuple(image.shape), label) for image, label in TorchDataLoader(ds, batch_size=None)]
    assert [label for _, label in seen] == ds.targets
    assert all(shape[0] == 3 for shape, _ in seen)


def test_plain_torch_dataloader_with_a_worker(tree: Path) -> None:
    ds = ImageFolder(tree, extensions=[".png", ".jpeg"])
    loader = TorchDataLoader(ds, batch_size=None, num_workers=1)
    assert [label for _, label in loader] == ds.targets


def test_image_list_with_root_and_labels(tree: Path) -> None:
    ds = ImageList([("dog/b.jpg", 4), (Path("cat/z.png"), torch.tensor(7))], root=tree,
                   classes=[f"c{i}" for i in range(8)])
    assert ds.samples == [(os.path.join(tree, "dog/b.jpg"), 4), (os.path.join(tree, "cat/z.png"), 7)]
    assert isinstance(ds, ImageFiles) and ds[1][1] == 7 and ds[1][0].shape == (3, F.HEIGHT, F.WIDTH)
    assert ds.read_encoded(0)[0] == (tree / "dog/b.jpg").read_bytes()


# vocab: keep-start (the rename script leaves the public alias's name below as it is)
def test_image_source_is_still_the_public_name_of_image_files(tree: Path) -> None:
    """``ImageSource`` (the name before the vocabulary of issue #35) imports, subclasses and
    unpickles as ``ImageFiles``, from both public modules."""
    import gpuload.datasets
    from gpuload.datasets import images

    assert gpuload.datasets.ImageSource is images.ImageSource is ImageFiles  # vocab: keep (the alias)
    assert "ImageSource" in gpuload.datasets.__all__ and "ImageSource" in images.__all__
    assert pickle.loads(b"cgpuload.datasets.images\nImageSource\n.") is ImageFiles  # a pickle made before
    assert isinstance(ImageFolder(tree, extensions=[".png", ".jpeg"]), gpuload.datasets.ImageSource)  # vocab: keep
# vocab: keep-end


def test_image_list_rejects_bad_entries() -> None:
    with pytest.raises(ValueError, match="entry 1 is 'lonely.jpg'; each entry is"):
        ImageList([("a.jpg", 0), "lonely.jpg"])
    with pytest.raises(TypeError, match="entry 0 \\('a.jpg'\\) has label 'cat' of type str"):
        ImageList([("a.jpg", "cat")])


def test_torchvision_style_dataset_is_read_through_its_samples(tree: Path) -> None:
    folder = ImageFolder(tree)
    standin = SimpleNamespace(
        samples=list(folder.samples), classes=list(folder.classes), transform=None, target_transform=None
    )
    source = as_image_source(standin)
    assert isinstance(source, ImageList)
    assert source.samples == folder.samples and source.classes == folder.classes
    assert source.class_to_idx == folder.class_to_idx
    assert torch.equal(source[3][0], folder[3][0])
    assert as_image_source(folder) is folder


def test_torchvision_style_dataset_with_a_transform_is_refused_unless_asked(tree: Path) -> None:
    standin = SimpleNamespace(samples=ImageFolder(tree).samples, classes=["bird", "cat", "dog"], transform=abs)
    with pytest.raises(ValueError, match="has a transform .* would not run"):
        as_image_source(standin)
    assert len(as_image_source(standin, ignore_transforms=True)) == 6


def test_torchvision_style_dataset_with_a_custom_loader_is_refused(tree: Path) -> None:
    def default_loader(path: str) -> None: ...

    def load_npy(path: str) -> None: ...

    samples = ImageFolder(tree).samples
    assert len(as_image_source(SimpleNamespace(samples=samples, loader=default_loader))) == 6
    with pytest.raises(ValueError, match="custom loader"):
        as_image_source(SimpleNamespace(samples=samples, loader=load_npy), ignore_transforms=True)


def test_non_image_datasets_are_not_image_sources() -> None:
    assert as_image_source(torch.utils.data.TensorDataset(torch.zeros(3))) is None
    assert as_image_source(SimpleNamespace(samples=[(1, 2), (3, 4)])) is None
    assert as_image_source(SimpleNamespace(samples="abc")) is None


def test_missing_and_corrupt_files_raise_naming_file_and_index(tmp_path: Path) -> None:
    (tmp_path / "broken.jpg").write_bytes(F.corrupt_inputs()["truncated.jpg"])
    (tmp_path / "empty.png").write_bytes(b"")
    ds = ImageList([(tmp_path / "gone.jpg", 0), (tmp_path / "broken.jpg", 1), (tmp_path / "empty.png", 2)])
    with pytest.raises(ImageDecodeError, match=r"could not read image .*gone.jpg'?, sample index 0: FileNotFoundError"):
        ds.read_encoded(0)
    with pytest.raises(ImageDecodeError, match=r"broken.jpg'?, sample index 1: .*truncated") as caught:
        ds[1]
    assert caught.value.index == 1 and caught.value.name.endswith("broken.jpg")
    with pytest.raises(ImageDecodeError, match=r"sample index 2: the file is empty"):
        ds[2]


def test_sample_image_folder_is_real_photos_sized_like_imagenet(tmp_path: Path) -> None:
    ds = make_sample_image_folder(tmp_path / "a", num_images=12, num_classes=3, seed=5)
    assert isinstance(ds, ImageFolder) and len(ds) == 12
    assert ds.classes == ["class_000", "class_001", "class_002"] and ds.targets.count(0) == 4
    for path, _ in ds.samples:
        with Image.open(path) as image:
            assert image.format == "JPEG" and image.mode == "RGB"
            width, height = sorted(image.size)
            assert 250 <= width <= 500 and 330 <= height <= 600, image.size
    sizes = {Image.open(p).size for p, _ in ds.samples}
    assert len(sizes) > 6  # varied, not one size
    # Real photographs: far from uniform noise, and compressible like photos.
    image, _ = ds[0]
    assert image.float().std() > 20
    assert all(os.path.getsize(p) < 3 * 500 * 600 / 4 for p, _ in ds.samples)


def test_sample_image_folder_is_deterministic(tmp_path: Path) -> None:
    a = make_sample_image_folder(tmp_path / "a", num_images=4, num_classes=2, seed=1)
    b = make_sample_image_folder(tmp_path / "b", num_images=4, num_classes=2, seed=1)
    c = make_sample_image_folder(tmp_path / "c", num_images=4, num_classes=2, seed=2)
    read = lambda ds: [ds.read_encoded(i)[0] for i in range(len(ds))]  # noqa: E731
    assert read(a) == read(b) and read(a) != read(c)


def test_sample_image_folder_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="would leave empty classes"):
        make_sample_image_folder(tmp_path, num_images=2, num_classes=3)
    with pytest.raises(ValueError, match="num_images >= 1"):
        make_sample_image_folder(tmp_path, num_images=0)
    assert SAMPLE_PHOTOS[0] == "grace_hopper.jpg"


def test_a_decompression_bomb_is_refused_from_its_header_on_every_path(tmp_path: Path) -> None:
    import gpuload

    (tmp_path / "bomb.jpg").write_bytes(F.bomb_jpeg())  # 725 bytes claiming 20000x20000
    (tmp_path / "ok.jpg").write_bytes(F.jpeg("grayscale"))
    ds = ImageList([(tmp_path / "ok.jpg", 0), (tmp_path / "bomb.jpg", 1)])
    with pytest.raises(ImageDecodeError, match=r"bomb.jpg'?, sample index 1: PixelLimitError: .*20000x20000"):
        ds[1]  # a plain torch Dataset
    with pytest.raises(ImageDecodeError, match="bomb.jpg"):
        list(TorchDataLoader(ds, batch_size=2))
    loader = gpuload.DataLoader(ds, batch_size=2, device="cpu", on_error="skip")
    (images, labels), = list(loader)  # gpuload's batch path: skipped, named, counted
    assert labels.tolist() == [0] and loader.stats.extra["skipped"] == 1
