"""Encoded images in a table's column, decoded by the image path: batches equal torch's DataLoader
over a PIL-decoding ``__getitem__``, cached decoded (epoch 2 decodes nothing), bad images named
by column and row, and datasets' ``Image()`` feature recognised."""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from equivalence import assert_same, assert_same_epochs
from image_fixtures import diff_stats, encode, photo
from PIL import Image
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

import gpuload
from gpuload import transforms as T
from gpuload.augment import BatchAugmenter
from gpuload.decode import BatchDecoder, ImageDecodeError
from gpuload.sources.image_decoding import ImageReader
from gpuload.transforms import apply_transforms

pa = pytest.importorskip("pyarrow")
datasets = pytest.importorskip("datasets")
datasets.disable_progress_bars()

from gpuload.datasets import ArrowTable  # noqa: E402
from gpuload.datasets.column_images import ColumnImages  # noqa: E402
from gpuload.sources.arrow import ArrowSource  # noqa: E402
from gpuload.sources.table_images import column_fingerprint  # noqa: E402

ROWS = 14


def encoded(row: int, size: tuple[int, int] = (40, 32)) -> bytes:
    """A small real photo, turned per row, as JPEG (even rows) or PNG (odd rows)."""
    image = photo().resize(size).rotate(row * 25)
    return encode(image, "JPEG", quality=90) if row % 2 == 0 else encode(image, "PNG")


def image_table(rows: int = ROWS) -> Any:
    return pa.table({
        "image": pa.array([encoded(row) for row in range(rows)], pa.binary()),
        "label": pa.array([row % 5 for row in range(rows)], pa.int64()),
        "caption": [f"photo {row}" for row in range(rows)],
    })


def pil_decoded(data: bytes) -> torch.Tensor:
    with Image.open(io.BytesIO(data)) as image:
        return torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1).contiguous()


class PilRows(Dataset):
    """The oracle: each row of ``table``, its image decoded by PIL in ``__getitem__``."""

    def __init__(self, table: Any) -> None:
        self.rows = table.to_pylist()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.rows[index]
        return {"image": pil_decoded(row["image"]), "label": torch.tensor(row["label"]), "caption": row["caption"]}


def counting_decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Images each call of the batch decoder decoded, recorded."""
    calls: list[int] = []
    decode = BatchDecoder.decode

    def counted(self: BatchDecoder, encoded: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(encoded))
        return decode(self, encoded, *args, **kwargs)

    monkeypatch.setattr(BatchDecoder, "decode", counted)
    return calls


@pytest.mark.parametrize("shuffle", [False, True])
def test_batches_equal_torchs_over_a_pil_decoding_getitem(shuffle: bool) -> None:
    table = image_table()
    ours = gpuload.DataLoader(ArrowTable(table, images=["image"]), batch_size=4, shuffle=shuffle,
                              generator=torch.Generator().manual_seed(3), device="cpu")
    theirs = TorchDataLoader(PilRows(table), batch_size=4, shuffle=shuffle, generator=torch.Generator().manual_seed(3))
    assert isinstance(ours._source, ArrowSource)
    assert_same_epochs(ours, theirs)
    assert ours.stats.extra["decode_backend"] in ("dali-cpu", "torchvision", "pil")


def test_a_sample_is_the_image_decoded_as_an_image_folder_decodes_a_file() -> None:
    table = image_table(4)
    sample = ArrowTable(table, images=["image"])[3]
    assert sample["image"].dtype == torch.uint8 and torch.equal(sample["image"], pil_decoded(encoded(3)))
    assert sample["caption"] == "photo 3" and sample["label"].item() == 3


def test_the_decoded_images_are_cached_so_epoch_two_decodes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    table = image_table()
    data = ArrowTable(table, images=["image"])
    ours = gpuload.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1),
                              device="cpu", cache="device")
    theirs = TorchDataLoader(PilRows(table), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))
    calls = counting_decodes(monkeypatch)
    assert_same_epochs(ours, theirs, epochs=1)
    assert sum(calls) == ROWS
    calls.clear()
    assert_same_epochs(ours, theirs, epochs=1)
    assert calls == []
    cache = ours.stats.extra["image_columns"]["image"]["cache"]
    assert cache["mode"] == "decoded" and cache["entries"] == ROWS and cache["complete"]


def test_transforms_apply_to_the_image_column_per_sample() -> None:
    table = image_table()
    ops = [T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.ToDtype(torch.float32)]
    g = torch.Generator().manual_seed(5)
    loader = gpuload.DataLoader(ArrowTable(table, images=["image"]), batch_size=5, shuffle=True, generator=g,
                                device="cpu", transforms=ops)
    order = TorchDataLoader(range(ROWS), batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(5))
    for epoch in range(2):
        for batch, indices in zip(loader, order, strict=True):
            decoded = [pil_decoded(encoded(i)) for i in indices.tolist()]
            expected = apply_transforms(ops, decoded, g.initial_seed(), epoch, indices)
            torch.testing.assert_close(batch["image"], expected, atol=2e-3, rtol=2e-3)
            assert batch["label"].tolist() == [i % 5 for i in indices.tolist()]
            assert batch["caption"] == [f"photo {i}" for i in indices.tolist()]
    assert loader.stats.extra["transform_backend"] == "batched"


def threads_calling(monkeypatch: pytest.MonkeyPatch, owner: type, name: str) -> list[str]:
    """The name of the thread of every call of ``owner.name`` from now on, recorded."""
    seen: list[str] = []
    method = getattr(owner, name)

    def recording(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(threading.current_thread().name)
        return method(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    return seen


@pytest.mark.parametrize("cache", ["off", "device"])
def test_with_a_prefetch_depth_a_table_s_images_are_decoded_ahead_in_the_prefetch_thread(
        monkeypatch: pytest.MonkeyPatch, cache: str) -> None:
    """As an image folder's: with ``prefetch_depth`` on a CPU device the image column is read and
    decoded in the prefetcher's thread (without it, in the loop's), and the batches are those
    made in the loop's thread, transformed, epoch after epoch."""
    table = image_table()
    ops = [T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.ToDtype(torch.float32)]
    def loader(depth: int | None) -> gpuload.DataLoader:
        return gpuload.DataLoader(ArrowTable(table, images=["image"]), batch_size=4, shuffle=True, device="cpu",
                                  generator=torch.Generator().manual_seed(2), transforms=ops, prefetch_depth=depth,
                                  cache=cache)

    seen = threads_calling(monkeypatch, ImageReader, "decode")
    inline, ahead = loader(0), loader(2)
    for epoch in range(2):
        seen.clear()
        expected = list(inline)
        assert seen == [threading.current_thread().name] * 4
        seen.clear()
        assert_same(list(ahead), expected, f"epoch {epoch}")
        assert seen == ["gpuload-prefetch"] * 4, seen
    seen.clear()
    assert len(list(loader(None))) == 4 and seen == [threading.current_thread().name] * 4
    bad = image_table().set_column(0, "image", pa.array([encoded(r)[:60] if r == 9 else encoded(r)
                                                         for r in range(ROWS)], pa.binary()))
    broken = iter(gpuload.DataLoader(ArrowTable(bad, images=["image"]), batch_size=4, device="cpu", prefetch_depth=2))
    assert len(next(broken)["label"]) == 4 and len(next(broken)["label"]) == 4  # the batches before it
    with pytest.raises(ImageDecodeError, match=r"column 'image', row 9"):
        next(broken)


def test_a_corrupt_image_names_its_column_and_row() -> None:
    table = image_table()
    images = table.column("image").to_pylist()
    images[9] = images[9][:60]  # a truncated JPEG
    table = table.set_column(0, "image", pa.array(images, pa.binary()))
    data = ArrowTable(table, images=["image"])
    with pytest.raises(ImageDecodeError, match=r"column 'image', row 9.*sample index 9"):
        list(gpuload.DataLoader(data, batch_size=4, device="cpu"))
    # through an index mapping the row is the table's, the index the sample's
    features = datasets.Features({"image": datasets.Image(mode="RGB"), "label": datasets.Value("int64"),
                                  "caption": datasets.Value("string")})
    hf = datasets.Dataset.from_dict({"image": [{"bytes": b, "path": None} for b in images],
                                     "label": table.column("label").to_pylist(),
                                     "caption": table.column("caption").to_pylist()}, features=features)
    loader = gpuload.DataLoader(hf.select([0, 2, 4, 9, 1]).with_format("torch"), batch_size=5, device="cpu")
    assert isinstance(loader._source, ArrowSource)
    with pytest.raises(ImageDecodeError, match=r"column 'image', row 9.*sample index 3"):
        list(loader)


def hf_images(tmp_path: Path, mode: str | None = None, gray_row: int | None = None) -> Any:
    """A datasets.Dataset of an Image() feature: PIL-encoded JPEG and PNG bytes, one row a local
    file named by path only; ``gray_row``: that row's image is greyscale."""
    rows = []
    for row in range(ROWS):
        data = encoded(row)
        if row == gray_row:
            data = encode(photo().resize((40, 32)).convert("L"), "PNG")
        rows.append({"bytes": data, "path": None})
    file = tmp_path / "row5.png"
    file.write_bytes(rows[5]["bytes"])
    rows[5] = {"bytes": None, "path": str(file)}
    features = datasets.Features({"image": datasets.Image(mode=mode), "label": datasets.Value("int64")})
    return datasets.Dataset.from_dict({"image": rows, "label": [row % 5 for row in range(ROWS)]}, features=features)


@pytest.mark.parametrize("mapping", ["none", "shuffle"])
@pytest.mark.parametrize("mode", [None, "RGB"])
def test_a_datasets_image_feature_is_decoded_by_the_image_path(tmp_path: Path, mode: str | None,
                                                               mapping: str) -> None:
    hf = hf_images(tmp_path, mode)
    hf = (hf.shuffle(seed=2) if mapping == "shuffle" else hf).with_format("torch")
    ours = gpuload.DataLoader(hf, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0),
                              device="cpu")
    theirs = TorchDataLoader(hf, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
    assert isinstance(ours._source, ArrowSource)
    assert_same_epochs(ours, theirs)


def test_only_the_image_columns_the_format_serves_are_decoded(tmp_path: Path) -> None:
    images = [{"bytes": encoded(row), "path": None} for row in range(ROWS)]
    features = datasets.Features({"image": datasets.Image(), "other": datasets.Image(),
                                  "label": datasets.Value("int64")})
    hf = datasets.Dataset.from_dict({"image": images, "other": images[::-1], "label": list(range(ROWS))},
                                    features=features).with_format("torch", columns=["image", "label"])
    ops = [T.RandomResizedCrop(8), T.ToDtype(torch.float32)]
    loader = gpuload.DataLoader(hf, batch_size=7, device="cpu", transforms=ops)  # one image column served
    assert isinstance(loader._source, ArrowSource) and list(loader._source.images) == ["image"]
    assert [batch["image"].shape for batch in loader] == [(7, 3, 8, 8)] * 2


def test_an_image_datasets_gives_in_other_channels_is_refused_naming_the_cast(tmp_path: Path) -> None:
    hf = hf_images(tmp_path, None, gray_row=7).with_format("torch")
    loader = gpuload.DataLoader(hf, batch_size=4, device="cpu")
    assert isinstance(loader._source, ArrowSource)
    with pytest.raises(ImageDecodeError, match=r"row 7.*is L.*cast_column\('image', datasets.Image\(mode='RGB'\)\)"):
        list(loader)
    # cast to RGB, datasets converts it as gpuload's decoders do
    rgb = hf_images(tmp_path, None, gray_row=7).cast_column("image", datasets.Image(mode="RGB")).with_format("torch")
    assert_same_epochs(gpuload.DataLoader(rgb, batch_size=4, device="cpu"), TorchDataLoader(rgb, batch_size=4),
                       epochs=1)


@pytest.mark.parametrize("mode", [None, "RGB"])
def test_a_datasets_image_feature_in_format_numpy_is_decoded_as_datasets_arrays(tmp_path: Path,
                                                                                 mode: str | None) -> None:
    """Format "numpy" gives each image as an (H, W, C) uint8 array, which torch's collate stacks:
    gpuload decodes the column and gives the same (B, H, W, C) batches."""
    hf = hf_images(tmp_path, mode).shuffle(seed=4).with_format("numpy")
    ours = gpuload.DataLoader(hf, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0),
                              device="cpu")
    theirs = TorchDataLoader(hf, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
    assert isinstance(ours._source, ArrowSource) and list(ours._source.images) == ["image"]
    assert_same_epochs(ours, theirs)
    assert next(iter(ours))["image"].shape == (4, 32, 40, 3)
    gray = hf_images(tmp_path, None, gray_row=7).with_format("numpy")
    with pytest.raises(ImageDecodeError, match=r"row 7.*is L.*cast_column\('image', datasets.Image\(mode='RGB'\)\)"):
        list(gpuload.DataLoader(gray, batch_size=4, device="cpu"))


@pytest.mark.parametrize("format", [None, "numpy"])
def test_transforms_decode_a_datasets_image_feature_in_formats_none_and_numpy(tmp_path: Path,
                                                                              format: str | None) -> None:
    """With transforms=, an Image() column in format None (PIL images) or "numpy" is decoded by
    gpuload's image path and transformed as in format "torch": (B, C, h, w)."""
    hf = hf_images(tmp_path, "RGB").with_format(format)
    ops = [T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.ToDtype(torch.float32)]
    g = torch.Generator().manual_seed(5)
    loader = gpuload.DataLoader(hf, batch_size=5, shuffle=True, generator=g, device="cpu", transforms=ops)
    assert isinstance(loader._source, ArrowSource)
    order = TorchDataLoader(range(ROWS), batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(5))
    for batch, indices in zip(loader, order, strict=True):
        decoded = [pil_decoded(encoded(i)) for i in indices.tolist()]
        expected = apply_transforms(ops, decoded, g.initial_seed(), 0, indices)
        torch.testing.assert_close(batch["image"], expected, atol=2e-3, rtol=2e-3)
        assert torch.equal(batch["label"], torch.tensor([i % 5 for i in indices.tolist()]))


def test_a_datasets_image_feature_in_format_none_fails_as_torchs_collate_does(tmp_path: Path) -> None:
    """Format None gives PIL images, which torch's collate cannot batch: without transforms= gpuload
    raises torch's TypeError, as torch's DataLoader does."""
    hf = hf_images(tmp_path, "RGB")
    with pytest.raises(TypeError, match="default_collate: batch must contain tensors.*PIL") as theirs:
        next(iter(TorchDataLoader(hf, batch_size=4)))
    with pytest.raises(TypeError, match="default_collate: batch must contain tensors.*PIL") as ours:
        next(iter(gpuload.DataLoader(hf, batch_size=4, device="cpu")))
    assert str(ours.value) == str(theirs.value)


def test_image_columns_asked_for_wrongly_fail_clearly() -> None:
    table = image_table(4)
    with pytest.raises(KeyError, match=r"images= names 'picture'.*it has image, label, caption"):
        ArrowTable(table, images=["picture"])
    with pytest.raises(TypeError, match=r"column 'caption' cannot hold encoded images: it is string"):
        ArrowTable(table, images=["caption"])
    with pytest.raises(TypeError, match=r"list of column names, not the string 'image'"):
        ArrowTable(table, images="image")
    with pytest.raises(ValueError, match=r"on_error='skip' cannot skip an image of a table's column \(image\)"):
        gpuload.DataLoader(ArrowTable(table, images=["image"]), batch_size=2, device="cpu", on_error="skip")


def test_without_images_asked_for_a_binary_column_stays_bytes() -> None:
    table = image_table(4)
    batch = next(iter(gpuload.DataLoader(ArrowTable(table), batch_size=4, device="cpu")))
    assert batch["image"] == table.column("image").to_pylist()


@pytest.mark.gpu
def test_on_cuda_the_image_column_is_decoded_on_the_device_close_to_pil_and_cached() -> None:
    table = image_table()
    ours = gpuload.DataLoader(ArrowTable(table, images=["image"]), batch_size=4, device="cuda")
    theirs = TorchDataLoader(PilRows(table), batch_size=4)
    for epoch in range(2):
        for a, b in zip(list(ours), list(theirs), strict=True):
            assert a["image"].is_cuda and a["label"].is_cuda and a["caption"] == b["caption"]
            mean, _ = diff_stats(a["image"], b["image"])
            assert mean < 2.0 and torch.equal(a["label"].cpu(), b["label"]), f"epoch {epoch}"
    assert ours.stats.extra["image_columns"]["image"]["cache"]["mode"] == "decoded"


@pytest.mark.gpu
def test_on_cuda_a_table_s_images_are_decoded_and_transformed_in_the_prefetch_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the image column is decoded and transformed ahead, in the prefetcher's thread on
    its side stream (ordered by its event, protected by record_stream): the batches equal those
    made in the loop's thread (``prefetch_depth=0``)."""
    table = image_table()
    ops = [T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.ToDtype(torch.float32)]
    def loader(depth: int | None) -> gpuload.DataLoader:
        return gpuload.DataLoader(ArrowTable(table, images=["image"]), batch_size=4, shuffle=True, device="cuda",
                                  generator=torch.Generator().manual_seed(2), transforms=ops, prefetch_depth=depth)

    seen = threads_calling(monkeypatch, BatchAugmenter, "apply_list")
    inline, ahead = loader(0), loader(None)
    for epoch in range(2):
        seen.clear()
        expected = list(inline)
        assert seen == [threading.current_thread().name] * 4
        seen.clear()
        got = list(ahead)
        assert seen == ["gpuload-prefetch"] * 4, seen
        for a, b in zip(got, expected, strict=True):
            assert a["image"].is_cuda and torch.equal(a["image"], b["image"]), f"epoch {epoch}"
            assert torch.equal(a["label"], b["label"]) and a["caption"] == b["caption"]


# -- the disk tier (cache_dir=) ----------------------------------------------------------------


def disk_loader(dataset: Any, **keywords: Any) -> gpuload.DataLoader:
    """A loader whose image cache holds none of the images (they differ in size: one per batch)."""
    return gpuload.DataLoader(dataset, batch_size=1, shuffle=True, generator=torch.Generator().manual_seed(4),
                              device="cpu", **keywords)


def column_disk(loader: gpuload.DataLoader, column: str = "image") -> dict[str, Any]:
    return loader.stats.extra["image_columns"][column]["cache"]["disk"]


@pytest.mark.parametrize("kind", ["arrow files", "parquet", "datasets"])
def test_decoded_column_images_go_to_the_disk_tier_and_a_second_job_decodes_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """The first job decodes each image once and writes it to cache_dir; a second job (new
    dataset objects over the same files) reads its first epoch from disk; batches equal a run
    without cache_dir."""
    datasets.Dataset(image_table()).save_to_disk(tmp_path / "saved")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(image_table(), tmp_path / "table.parquet")

    def dataset() -> Any:
        if kind == "arrow files":
            return ArrowTable(tmp_path / "saved", images=["image"])
        if kind == "parquet":
            return gpuload.datasets.Parquet(tmp_path / "table.parquet", images=["image"])
        features = datasets.Features({"image": datasets.Image(mode="RGB"), "label": datasets.Value("int64"),
                                      "caption": datasets.Value("string")})
        loaded = datasets.load_from_disk(str(tmp_path / "saved")).cast(features)
        return loaded.shuffle(seed=1).with_format("torch")

    plain = disk_loader(dataset(), cache="off")
    reference = [list(plain) for _ in range(2)]
    calls = counting_decodes(monkeypatch)
    first = disk_loader(dataset(), cache_dir=tmp_path / "c", cache_size=1)
    calls.clear()  # building the loader checked its leading rows' batch against torch's
    filled = [list(first) for _ in range(2)]
    assert sum(calls) == ROWS  # epoch 2 read every image from disk
    assert column_disk(first)["published_rows"] == ROWS
    first.close()
    second = disk_loader(dataset(), cache_dir=tmp_path / "c", cache_size=1)
    calls.clear()
    again = [list(second) for _ in range(2)]
    assert calls == [] and column_disk(second)["rows_written"] == 0
    for epoch_a, epoch_b in zip([*filled, *again], [*reference, *reference], strict=True):
        for a, b in zip(epoch_a, epoch_b, strict=True):
            assert_same(a, b, exact=True)


def test_a_columns_batch_paths_and_labels_are_each_rows() -> None:
    images = ColumnImages("image", image_table(6).column("image"), rows=torch.tensor([5, 3, 1]))
    assert images.paths([2, 0]) == [images.path(2), images.path(0)] == ["column 'image', row 1",
                                                                       "column 'image', row 5"]
    assert images.labels([2, 0]) == [images.label(2), images.label(0)] == [0, 0]


def test_the_column_fingerprint_follows_the_files_the_rows_and_the_bytes(tmp_path: Path) -> None:
    def digest(images: ColumnImages, origin: Any = None, key: str | None = None) -> str:
        return column_fingerprint(images, origin, {"decoded": {}}, key).digest

    table = image_table(6)
    column = table.column("image")
    base = digest(ColumnImages("image", column))
    assert digest(ColumnImages("image", pa.chunked_array(column.chunks))) == base  # the same bytes
    sliced = pa.chunked_array([pa.concat_arrays([pa.array([b"x"]), column.chunk(0)]).slice(1)])
    assert digest(ColumnImages("image", sliced)) == base  # a slice of a larger buffer: its own bytes only
    other = pa.chunked_array([pa.array([encoded(1), *column.to_pylist()[1:]], pa.binary())])
    assert digest(ColumnImages("image", other)) != base  # one image changed
    assert digest(ColumnImages("image", column, torch.tensor([5, 4, 3, 2, 1, 0]))) != base  # other rows
    assert digest(ColumnImages("image", column, rgb_only=True)) != base
    assert digest(ColumnImages("image", column), key="v1") != base != digest(ColumnImages("image", column), key="v2")
    # a table read from files: their identities, not the bytes
    file = tmp_path / "t.arrow"
    file.write_bytes(b"first")
    origin = {"files": [str(file)]}
    read = digest(ColumnImages("image", column), origin)
    assert read != base and digest(ColumnImages("image", column), origin) == read
    file.write_bytes(b"other")
    assert digest(ColumnImages("image", column), origin) != read
    # a row named by path only: its file's identity
    linked = tmp_path / "row.png"
    linked.write_bytes(encoded(1))
    struct = pa.chunked_array([pa.array([{"bytes": encoded(0), "path": None}, {"bytes": None, "path": str(linked)}])])
    before = digest(ColumnImages("image", struct))
    linked.write_bytes(encoded(3))
    assert digest(ColumnImages("image", struct)) != before
