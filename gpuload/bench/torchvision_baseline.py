"""A DALI-free baseline for the images scenario: torchvision's own decoder and v2 transforms on the device.

What a torchvision user writes to decode and augment on the GPU without DALI: DataLoader workers
only read each file's bytes; the loop decodes the batch with ``torchvision.io.decode_jpeg(list,
device=device)`` (nvJPEG's batched decoder on CUDA, libjpeg on a CPU), crops and flips each image
with ``torchvision.transforms.v2`` on the device, stacks the crops and converts the batch to
float16 normalized the way gpuload's ``ToDtype(float16)`` + ``Normalize`` do (0-255 scaled to
[0, 1], arithmetic in float32, one cast to float16 at the end).

Workers: the largest of ``--torch-workers``, the CPU processes the PIL baseline gets at most, so
that the two baselines are given the same CPUs; they only read files here, overlapping the
reads with the loop's decode.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

from gpuload.bench.scenarios import BenchConfig, CountingEpochs, LoaderSpec, not_opened
from gpuload.datasets import ImageFolder

__all__ = ["EncodedFiles", "TorchvisionOnDevice", "encoded_batch", "torchvision_spec"]

JPEG_SUFFIXES = (".jpg", ".jpeg")
Batch = tuple[list[torch.Tensor], torch.Tensor]


class EncodedFiles(Dataset):
    """Each file's encoded bytes (a 1-D uint8 tensor) and its label: decoding is the loop's."""

    def __init__(self, folder: ImageFolder) -> None:
        self.samples = folder.samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        return torch.from_numpy(np.fromfile(path, dtype=np.uint8)), label


def encoded_batch(items: list[tuple[torch.Tensor, int]]) -> Batch:
    """The files' bytes stay a list (they differ in length), the labels become one int64 tensor."""
    return [data for data, _ in items], torch.tensor([label for _, label in items], dtype=torch.int64)


class TorchvisionOnDevice(CountingEpochs):
    """Epochs of (float16 images, labels) on ``device``, decoded and transformed by torchvision there.

    Counts the bytes a CUDA device receives (the files' bytes and the labels); on a CPU each
    epoch's are counted too and put in ``notes`` as the modelled copy at ``close()``.
    """

    modelled_basis = "the files' bytes and labels, decoded on the device every epoch"

    def __init__(self, loader: TorchDataLoader, device: torch.device, size: int, mean: Sequence[float],
                 std: Sequence[float], notes: dict[str, Any]) -> None:
        from torchvision.transforms import v2

        super().__init__(loader, device, notes)
        self.augment = v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()])
        self.normalize = v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(list(mean), list(std)),
                                     v2.ToDtype(torch.float16)])

    def batch(self, encoded: list[torch.Tensor], labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch: decode on the device, crop and flip each image, then normalize the stack."""
        from torchvision.io import ImageReadMode, decode_jpeg

        if self.device.type == "cuda":
            # torchvision's decoder writes into memory allocated on this stream from a stream of
            # its own, without waiting for this one: drain it, as gpuload's nvjpeg backend does
            # (gpuload/decode/_nvjpeg.py), so that no queued work still uses that memory. The
            # decode itself waits for its stream on the host and makes this stream wait for it.
            torch.cuda.current_stream(self.device).synchronize()
        images = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=self.device)
        crops = torch.stack([self.augment(image) for image in images])
        return self.normalize(crops), labels.to(self.device, non_blocking=True)

    def __call__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epoch_bytes = 0
        for encoded, labels in self.loader:
            nbytes = sum(data.numel() for data in encoded) + labels.nbytes
            epoch_bytes += nbytes
            if self.device.type == "cuda":
                self.bytes_h2d += nbytes
            yield self.batch(encoded, labels)
        self.batch_bytes_per_epoch.append(epoch_bytes)  # whole epochs only


def torchvision_spec(folder: ImageFolder, config: BenchConfig, device: torch.device, size: int,
                     mean: Sequence[float], std: Sequence[float],
                     say: Callable[[str], object]) -> list[LoaderSpec]:
    """The baseline's spec, or none (with a line to ``say``) without torchvision or on non-JPEG files."""
    if importlib.util.find_spec("torchvision") is None:
        say("  torchvision is not installed: its decode_jpeg + v2 transforms baseline is left out")
        return []
    others = [path for path, _ in folder.samples if not str(path).lower().endswith(JPEG_SUFFIXES)]
    if others:
        say(f"  {len(others)} of the folder's files are not JPEGs ({others[0]}): the torchvision "
            "decode_jpeg baseline is left out")
        return []
    spec = LoaderSpec(f"torchvision decode_jpeg + v2 transforms (on {device.type})", not_opened)
    workers = max(config.torch_workers, default=0)

    def open_torchvision():
        loader = TorchDataLoader(
            EncodedFiles(folder), batch_size=config.batch_size, shuffle=True, num_workers=workers,
            collate_fn=encoded_batch, pin_memory=device.type == "cuda", persistent_workers=workers > 0,
            generator=torch.Generator().manual_seed(config.seed),
        )
        epochs = TorchvisionOnDevice(loader, device, size, mean, std, spec.notes)
        return epochs, lambda: epochs.bytes_h2d, epochs.close

    spec.open = open_torchvision
    spec.notes["num_workers"] = workers
    return [spec]
