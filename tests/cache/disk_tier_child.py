"""One run of tests/cache/test_disk_tier_faults.py's loader: ``python disk_tier_child.py IMAGES
CACHE MODE`` reads the JPEG folder IMAGES through gpuload's sample cache (a 3-sample host tier,
``cache_dir=CACHE``, blocks of 4 samples) and torch's DataLoader, and prints one JSON line: whether
the batches were equal, the disk tier's stats, its warnings. MODE: ``fill`` (shuffled), ``slow``
(0.15 s a sample: time to kill it mid-fill), ``enospc`` (the disk fills after two blocks' files),
``rank0``/``rank1`` (a rank's share of 2, both ranks holding the entry open until both are done).
The test runs it forked from the suite's fork server (torch imported), or under ``python -c``."""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

import torch
from torchvision import datasets, transforms

import gpuload
import gpuload.cache.disk_tier as disk_tier
from gpuload.cache.disk import DiskCacheWarning

IMAGES, CACHE, MODE = sys.argv[1], sys.argv[2], sys.argv[3]
ROW = 3 * 32 * 32 + 8  # a decoded image and its label
disk_tier.BLOCK_BYTES = 4 * ROW


class Folder(datasets.ImageFolder):
    delay = 0.0

    def __getitem__(self, index):
        time.sleep(self.delay)
        return super().__getitem__(index)


def dataset(delay=0.0):
    folder = Folder(IMAGES, transform=transforms.Compose(
        [transforms.Resize(32), transforms.CenterCrop(32), transforms.PILToTensor()]))
    Folder.delay = delay  # the class's: an instance attribute is the dataset's state, part of its fingerprint
    return folder


def batches(loader, epochs):
    got = []
    for epoch in range(epochs):
        if loader.sampler is not None and hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        got.append([(images.clone(), labels.clone()) for images, labels in loader])
    return got


def order(data):
    # A rank's share (rank0, rank1: torch's DistributedSampler of 2), else shuffled.
    if MODE.startswith("rank"):
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=int(MODE[4]), seed=0)
        return {"sampler": sampler}
    return {"shuffle": True, "generator": torch.Generator().manual_seed(2)}


def same(a, b):
    return len(a) == len(b) and all(
        len(x) == len(y) and all(torch.equal(images, other_images) and torch.equal(labels, other_labels)
                                 for (images, labels), (other_images, other_labels) in zip(x, y))
        for x, y in zip(a, b))


def run(epochs=2, delay=0.0):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = dataset(delay)
        loader = gpuload.DataLoader(data, batch_size=5, cache="host", cache_size=3 * ROW, cache_dir=CACHE,
                                    **order(data))
        got = batches(loader, epochs)
        if MODE.startswith("rank"):  # both ranks keep the entry open until both are done, as a job's do
            done = os.path.join(os.path.dirname(CACHE), "done-")
            open(done + MODE, "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(done + ("rank1" if MODE == "rank0" else "rank0")):
                assert time.monotonic() < deadline, "the other rank never finished"
                time.sleep(0.05)
    reference = torch.utils.data.DataLoader(dataset(), batch_size=5, **order(data))
    return {"equal": same(got, batches(reference, epochs)), "disk": loader.stats.extra["cache"].get("disk"),
            "warnings": [str(w.message) for w in caught if issubclass(w.category, DiskCacheWarning)]}


if MODE == "enospc":  # the disk fills after two blocks' files (tests/ is on sys.path: forked from the suite)
    from full_disk import filling_up

    os.posix_fallocate = filling_up(os.posix_fallocate, calls_allowed=2)

print(json.dumps(run(epochs=3 if MODE.startswith("rank") else 2, delay=0.15 if MODE == "slow" else 0.0)))
