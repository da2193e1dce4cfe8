"""What each rank of tests/distributed/test_split_arrow.py runs: tables over 2 gloo processes, each
scope beside torch's loader, the findings written to ``rank<r>.json``: a datasets.Dataset of
fixed-width, token and text columns, then tables with an image column (an ArrowTable, a Parquet
file, a datasets.Dataset with an ``Image()`` feature), each rank counting the images it decodes."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.utils.data as tud
from PIL import Image
from torch.utils.data.distributed import DistributedSampler

import gpuload
from gpuload import transforms as T
from gpuload.decode import BatchDecoder

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
import ranks_job
from equivalence import assert_same

NUM_SAMPLES = 103  # uneven shares, padded samplers
NUM_IMAGES = 37  # uneven shares of the image tables too
IMAGE_BATCH = 4
BAD = 30  # the row whose image is cut short in the corrupt table (rank 1's share)
OPS = [T.RandomResizedCrop(12), T.RandomHorizontalFlip(), T.ToDtype(torch.float32)]


def dataset() -> datasets.Dataset:
    rows = range(NUM_SAMPLES)
    return datasets.Dataset.from_dict({
        "embedding": pa.array([[i / 2, -i, 1.0] for i in rows], pa.list_(pa.float32(), 3)),
        "label": pa.array(rows, pa.int16()),
        "tokens": [[i, i + 1] for i in rows],
        "text": [f"row {i}" for i in rows],
    }).shuffle(seed=1).with_format("torch")


def compare(data: datasets.Dataset, scope: str) -> dict:
    theirs = tud.DataLoader(data, 8, sampler=DistributedSampler(data, seed=ranks_job.SEED))
    ours = gpuload.DataLoader(data, 8, sampler=DistributedSampler(data, seed=ranks_job.SEED), device="cpu",
                              cache_scope=scope)
    equal, batches = True, 0
    for epoch in range(2):
        theirs.sampler.set_epoch(epoch)
        ours.sampler.set_epoch(epoch)
        expected, got = list(theirs), list(ours)
        batches += len(got)
        try:
            assert len(expected) == len(got)
            for a, b in zip(got, expected):
                assert_same(a, b)
        except AssertionError:
            equal = False
    exchange = ours.stats.extra.get("exchange")
    result = {"equal": equal, "batches": batches, "path": ours.stats.path,
              "shard_bytes": exchange["shard_bytes"] if exchange else None}
    ours.close()
    return result


def png(index: int) -> bytes:
    """A 16x16 RGB image of its own pixels (PNG: every decoder gives the same pixels)."""
    pixels = torch.arange(16 * 16 * 3, dtype=torch.int64).add(index * 7).remainder(256).to(torch.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels.view(16, 16, 3).numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


def image_table() -> pa.Table:
    rows = range(NUM_IMAGES)
    return pa.table({"image": pa.array([png(i) for i in rows], pa.binary()),
                     "embedding": pa.array([[i, -i / 4] for i in rows], pa.list_(pa.float32(), 2)),
                     "label": pa.array(rows, pa.int64())})


def image_datasets(folder: Path) -> dict[str, Any]:
    """The three kinds of table with an image column, over the same rows."""
    table = image_table()
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    hf = datasets.Dataset.from_dict({"image": [{"bytes": png(i), "path": None} for i in range(NUM_IMAGES)],
                                     "label": list(range(NUM_IMAGES))}, features=features)
    return {"arrow": gpuload.datasets.ArrowTable(table, images=["image"]),
            "parquet": gpuload.datasets.Parquet(str(folder / "images.parquet"), images=["image"]),
            "datasets": hf.with_format("torch")}


@contextmanager
def counted_decodes() -> Iterator[list[int]]:
    """The dataset positions of every image decoded in this process meanwhile."""
    decoded: list[int] = []
    decode = BatchDecoder.decode

    def counted(self: BatchDecoder, encoded: Any, names: Any, positions: Any, *args: Any, **kwargs: Any) -> Any:
        decoded.extend(positions)
        return decode(self, encoded, names, positions, *args, **kwargs)

    BatchDecoder.decode = counted  # type: ignore[method-assign]
    try:
        yield decoded
    finally:
        BatchDecoder.decode = decode  # type: ignore[method-assign]


def image_epochs(data: Any, scope: str, epochs: int = 2, **options: Any) -> dict[str, Any]:
    """gpuload's epochs with ``scope``: its batches, the images it decoded once built, what its
    image column reports, the warnings."""
    with ranks_job.recorded_warnings() as caught:
        ours = gpuload.DataLoader(data, IMAGE_BATCH, sampler=DistributedSampler(data, seed=ranks_job.SEED),
                                  device="cpu", cache_scope=scope, **options)
        batches = []
        with counted_decodes() as decoded:
            for epoch in range(epochs):
                ours.sampler.set_epoch(epoch)
                batches.append(list(ours))
    column = ours.stats.extra["image_columns"]["image"]
    result = {"batches": batches, "decoded": decoded, "path": ours.stats.path, "cache": column.get("cache"),
              "exchange": ours.stats.extra.get("exchange"), "warnings": [str(w.message) for w in caught]}
    ours.close()
    return result


def same_epochs(ours: list[list[Any]], theirs: list[list[Any]]) -> bool:
    try:
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                assert_same(x, y)
    except AssertionError:
        return False
    return True


def image_tables(folder: Path) -> dict[str, Any]:
    """Each kind of image table split over the ranks against torch's loader; the ArrowTable also
    with transforms against the unsplit path, and with ``cache_dir`` filled then read back."""
    found: dict[str, Any] = {}
    for kind, data in image_datasets(folder).items():
        theirs = tud.DataLoader(data, IMAGE_BATCH, sampler=DistributedSampler(data, seed=ranks_job.SEED))
        expected = []
        for epoch in range(2):
            theirs.sampler.set_epoch(epoch)
            expected.append(list(theirs))
        split = image_epochs(data, "node")
        found[kind] = {"equal": same_epochs(split.pop("batches"), expected), **split}
        if kind == "arrow":
            expected_arrow = expected
            # 4 KiB of room: no rank's share of the images fits; the arrays stay split
            too_big = image_epochs(data, "node", epochs=1, cache_size="4KiB")
            found["too_big"] = {"equal": same_epochs(too_big.pop("batches"), expected[:1]), **too_big}
            unsplit = image_epochs(data, "rank", transforms=OPS)
            transformed = image_epochs(data, "world", transforms=OPS)
            found["transforms"] = {"equal": same_epochs(transformed.pop("batches"), unsplit.pop("batches")),
                                   "unsplit_path": unsplit["path"], **transformed}
    cache_dir = str(folder / "images-cache")
    parquet = image_datasets(folder)["parquet"]
    budget = {"cache_dir": cache_dir, "disk_cache_size": "4GiB"}  # a rank reads the real disk's free space
    filled = image_epochs(parquet, "node", epochs=1, **budget)
    dist.barrier()
    again = image_epochs(parquet, "node", epochs=1, **budget)
    found["disk"] = {"equal": same_epochs(again.pop("batches"), filled.pop("batches")),
                     "filled": filled, "again": again}
    found["bad"] = bad_image()
    found["resume"] = resume(image_datasets(folder)["arrow"], expected_arrow)
    return found


def resume(data: Any, expected: list[list[Any]]) -> dict[str, Any]:
    """Every rank stops epoch 0 of a split image table after two batches and saves its state; a
    new loader resumes from it: the epoch is torch's, whole."""
    def loader() -> gpuload.DataLoader:
        return gpuload.DataLoader(data, IMAGE_BATCH, sampler=DistributedSampler(data, seed=ranks_job.SEED),
                                  device="cpu", cache_scope="world")

    got, second = ranks_job.stopped_and_resumed(loader, 2)
    path = second.stats.path
    second.close()
    return {"equal": same_epochs([got], expected[:1]), "batches": len(got), "path": path}


def bad_image() -> dict[str, Any]:
    """Epoch 0 of a split table whose image ``BAD`` is cut short: the batches received before
    this rank stopped, and what it raised."""
    table = image_table()
    images = table.column("image").to_pylist()
    images[BAD] = images[BAD][:40]
    data = gpuload.datasets.ArrowTable(table.set_column(0, "image", pa.array(images, pa.binary())), images=["image"])
    ours = gpuload.DataLoader(data, IMAGE_BATCH, sampler=DistributedSampler(data, seed=ranks_job.SEED), device="cpu",
                              cache_scope="node")
    received, error = 0, None
    try:
        for _ in ours:
            received += 1
    except Exception as raised:  # noqa: BLE001 - the finding
        error = [type(raised).__name__, str(raised)]
    path = ours.stats.path
    ours.close()
    return {"received": received, "error": error, "path": path}


def run(rank: int, world: int, init_file: str, out_dir: str) -> None:
    datasets.disable_progress_bars()
    with ranks_job.gloo_job(rank, world, init_file, None):
        data = dataset()
        found: dict[str, Any] = {"columns": {scope: compare(data, scope) for scope in ("rank", "world")}}
        folder = Path(out_dir)
        if rank == 0:
            pq.write_table(image_table(), folder / "images.parquet")
        dist.barrier()
        found["images"] = image_tables(folder)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(found))


def whole_bytes() -> int:
    """The fixed-width columns' bytes: what the ranks' shares add up to."""
    return NUM_SAMPLES * (3 * 4 + 2)
