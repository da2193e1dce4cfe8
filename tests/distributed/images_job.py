"""What each rank of the image-cache tests runs (imported by name in the spawned processes).

The dataset is an ``ImageList`` of small JPEGs of differing sizes whose label is the sample's
index, so that a batch's labels say which samples it holds. One job per world size runs every
scenario; each rank writes its findings to ``rank<r>.json``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import ranks_job
import torch
import torch.distributed as dist
import torch.utils.data as tud
from PIL import Image
from torch.utils.data.distributed import DistributedSampler

import gpuload
from gpuload import transforms as T
from gpuload.datasets import ImageList
from gpuload.decode import ImageDecodeError
from gpuload.distributed import ExchangeError

NUM_IMAGES = 23  # not a multiple of any world size: uneven shares, padded samplers
SEED = ranks_job.SEED
BATCH = 4
OPS = [T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.ToDtype(torch.float32), T.Normalize([0.5] * 3, [0.25] * 3)]
BAD = 5  # the sample whose file is cut short in the corrupt dataset
MISSING = 9  # the sample whose file is missing in the broken dataset


def write_images(folder: Path) -> dict[str, Any]:
    """The JPEGs (sizes 20-59 px, some portrait), a copy of the list with sample BAD cut short
    (``corrupt``), one with sample MISSING missing too (``broken``), one with only that
    (``missing``), and the decoded bytes of the whole set."""
    rng = np.random.default_rng(0)
    samples, total = [], 0
    for index in range(NUM_IMAGES):
        height, width = (int(v) for v in rng.integers(20, 60, size=2))
        pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
        path = folder / f"image{index:03d}.jpg"
        Image.fromarray(pixels).save(path, quality=90)
        samples.append((str(path), index))
        total += height * width * 3
    broken = folder / "broken.jpg"
    broken.write_bytes(Path(samples[BAD][0]).read_bytes()[:200])
    corrupt = list(samples)
    corrupt[BAD] = (str(broken), BAD)
    broken, missing = list(corrupt), list(samples)
    broken[MISSING] = missing[MISSING] = (str(folder / "missing.jpg"), MISSING)
    return {"samples": samples, "corrupt": corrupt, "broken": broken, "missing": missing, "total_bytes": total}


def sampler(data: Any) -> DistributedSampler:
    return DistributedSampler(data, shuffle=True, seed=SEED)


def loader(samples: list, scope: str, batch_size: int = BATCH, device: str = "cpu",
           **options: Any) -> gpuload.DataLoader:
    data = ImageList([tuple(s) for s in samples])
    return gpuload.DataLoader(data, batch_size, sampler=sampler(data), device=device, transforms=OPS,
                              cache_scope=scope, **options)


def outcomes(ours: gpuload.DataLoader) -> list[Any]:
    """Each batch (images, labels), or what it raised: (type name, message); stops at an error."""
    found = []
    try:
        for images, labels in ours:
            found.append((images.cpu(), labels.cpu()))
    except (ImageDecodeError, ExchangeError) as error:
        found.append((type(error).__name__, str(error)))
    return found


def same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] if isinstance(x[0], str) else (torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]))
        for x, y in zip(a, b)
    )


def compare(samples: list, scope: str, epochs: int = 3, warm: bool = False, **options: Any) -> dict:
    """Epochs of gpuload's loader with ``scope`` against the same loader with
    ``cache_scope="rank"`` and a decoded cache (whole images, as a share holds them: bit-exact),
    and its labels against torch's DataLoader order (the label is the sample's index); ``warm``:
    gpuload's loader is warmed first (its share decoded before the first epoch)."""
    order = tud.DataLoader(range(len(samples)), BATCH, sampler=sampler(range(len(samples))))
    reference = loader(samples, "rank", cache="device", **options)
    with ranks_job.recorded_warnings() as caught:
        ours = loader(samples, scope, **options)
        warmed = ours.warm(progress=False).extra.get("cache") if warm else None
        equal = in_order = True
        seconds = []
        for epoch in range(epochs):
            for each in (order, reference, ours):
                each.sampler.set_epoch(epoch)
            began = time.perf_counter()
            got = outcomes(ours)
            seconds.append(time.perf_counter() - began)
            expected = outcomes(reference)
            if isinstance(got[-1][0], str) or isinstance(expected[-1][0], str):  # an error: compare up to it
                ok = [batch for batch in got if not isinstance(batch[0], str)]
                equal = equal and same(ok, expected[: len(ok)])
            else:
                equal = equal and same(got, expected)
            labels = [batch[1].tolist() for batch in got if not isinstance(batch[0], str)]
            skipped = {i for i in (BAD, MISSING) if options.get("on_error") == "skip"
                       and not Path(samples[i][0]).name.startswith("image")}
            torchs = [[i for i in b.tolist() if i not in skipped] for b in order]
            in_order = in_order and labels == torchs[: len(labels)]
    extra = ours.stats.extra
    result = {"equal": equal, "in_order": in_order, "path": ours.stats.path, "cache": extra.get("cache"),
              "exchange": extra.get("exchange"), "decision": extra.get("image_cache_decision"),
              "warnings": [str(w.message) for w in caught], "epoch_s": seconds, "warmed": warmed,
              "skipped": extra.get("skipped"), "reference_skipped": reference.stats.extra.get("skipped"),
              "skipped_files": extra.get("skipped_files"),
              "reference_skipped_files": reference.stats.extra.get("skipped_files"),
              "error": got[-1] if isinstance(got[-1][0], str) else None,
              "reference_error": expected[-1] if isinstance(expected[-1][0], str) else None,
              "batches": sum(not isinstance(batch[0], str) for batch in got)}
    ours.close()
    reference.close()
    return result


def stop_early(samples: list) -> dict:
    """Rank 0 breaks after one batch of epoch 0, more than the run-ahead bound before its end;
    the others go on and must fail, not hang."""
    with ranks_job.stopped_peer_timeout():
        return _stop_early(samples)


def _stop_early(samples: list) -> dict:
    ours = loader(samples, "world", batch_size=1)
    began, error = time.perf_counter(), None
    try:
        for step, _ in enumerate(ours):
            if dist.get_rank() == 0 and step == 0:
                break
    except ExchangeError as caught:
        error = str(caught)
    seconds = time.perf_counter() - began
    dist.barrier()
    ours.close()
    return {"error": error, "seconds": seconds}


def resume(samples: list) -> dict:
    """Every rank stops epoch 0 after two batches (the exchange running ahead) and saves its
    state; a new loader resumes from it: the epoch is the per-rank cache's, whole."""
    reference = outcomes(loader(samples, "rank", batch_size=2, cache="device"))
    first = loader(samples, "world", batch_size=2)
    got = []
    for images, labels in first:
        got.append((images.clone(), labels.clone()))
        if len(got) == 2:
            break
    state = first.state_dict()
    first.close()
    second = loader(samples, "world", batch_size=2)
    second.load_state_dict(state)
    got += outcomes(second)
    result = {"equal": same(got, reference), "batches": len(got), "exchange": second.stats.extra.get("exchange")}
    second.close()
    return result


def resized(samples: list, at: int = 2, size: int = 3) -> dict:
    """Every rank calls ``set_batch_size(size)`` after batch ``at`` of epoch 0: the rest of the
    epoch and the next one against the per-rank cache making the same change, and the labels
    against torch's DistributedSampler order cut at the new size."""
    ours, reference = loader(samples, "world"), loader(samples, "rank", cache="device")
    equal, orders = True, []
    for epoch in range(2):
        got, expected = [], []
        for each, found in ((ours, got), (reference, expected)):
            each.sampler.set_epoch(epoch)
            for images, labels in each:
                found.append((images.cpu(), labels.cpu()))
                if epoch == 0 and len(found) == at:
                    each.set_batch_size(size)
        equal = equal and same(got, expected)
        orders.append([batch[1].tolist() for batch in got])
    torchs = []
    for epoch in range(2):
        order = sampler(range(len(samples)))
        order.set_epoch(epoch)
        indices = list(order)
        head = [indices[i : i + BATCH] for i in range(0, at * BATCH, BATCH)] if epoch == 0 else []
        rest = indices[len(head) * BATCH :]
        torchs.append(head + [rest[i : i + size] for i in range(0, len(rest), size)])
    result = {"equal": equal, "in_order": orders == torchs, "path": ours.stats.path}
    ours.close()
    reference.close()
    return result


def run(rank: int, world: int, init_file: str, out_dir: str, local_world_size: int | None) -> None:
    files = json.loads(Path(out_dir, "files.json").read_text())
    samples, corrupt = files["samples"], files["corrupt"]
    with ranks_job.gloo_job(rank, world, init_file, local_world_size):
        found: dict = {"compare": {}}
        for scope in ("node", "world"):
            found["compare"][scope] = compare(samples, scope)
        found["ahead0"] = compare(samples, "world", epochs=2, prefetch_depth=0)
        found["warm"] = compare(samples, "world", epochs=1, warm=True)
        found["skip"] = compare(files["broken"], "world", epochs=2, on_error="skip")
        found["raise"] = compare(corrupt, "world", epochs=1)
        found["raise_missing"] = compare(files["missing"], "world", epochs=1)
        found["too_big"] = compare(samples, "world", epochs=1, cache_size="4KiB")
        found["resume"] = resume(samples)
        found["resized"] = resized(samples)
        found["stop_early"] = stop_early(samples)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(found))




def run_nccl(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """The split image cache over NCCL, one GPU per rank, decoded and exchanged on the devices,
    from the loop's thread whatever ``prefetch_depth`` (SplitStore.runs_ahead)."""
    files = json.loads(Path(out_dir, "files.json").read_text())
    with ranks_job.nccl_job(rank, world, init_file):
        found = {f"{scope}/depth={depth}": compare(files["samples"], scope, device=f"cuda:{rank}", prefetch_depth=depth)
                 for scope in ("world", "node") for depth in (0, 2)}
        found["skip"] = compare(files["corrupt"], "world", epochs=2, device=f"cuda:{rank}", on_error="skip")
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(found))
