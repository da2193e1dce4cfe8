"""The loader's use of ``transforms=``: which tensor of a batch is the image, and with what seed.

The transform list runs on the batch's uint8 N,C,H,W image tensor after it reaches the device
(CuPy kernels there, batched torch ops on a CPU). Each sample's random parameters depend
only on (seed, epoch, sample index), so batch composition, prefetch depth and device do not
change what a sample looks like.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from gpuload.cpu_threads import own_cpu_threads
from gpuload.transfer import Staging
from gpuload.transforms import transform_batch, validate_pipeline
from gpuload.transforms.windows import Window, decode_windows, starts_with_crop

__all__ = ["BatchAugmenter", "image_column"]


def image_column(columns: Sequence[torch.Tensor]) -> int:
    """Position of the array the transforms apply to: the first uint8 N,C,H,W array, C 1 or 3."""
    for position, column in enumerate(columns):
        if column.dtype == torch.uint8 and column.dim() == 4 and column.shape[1] in (1, 3):
            return position
    shapes = ", ".join(f"{tuple(c.shape)} {str(c.dtype).removeprefix('torch.')}" for c in columns)
    raise ValueError(
        f"transforms= needs uint8 images shaped N,C,H,W (C = 1 or 3) among the dataset's arrays, "
        f"got {shapes}; "
        "an N,H,W,C array can be passed as array.permute(0, 3, 1, 2) (torch) or "
        "np.transpose(array, (0, 3, 1, 2)) (numpy)"
    )


class BatchAugmenter:
    """Applies a validated transform list to one leaf of each batch, recording the backend;
    host images and per-batch tables reach ``device`` through ``staging`` (the loader's)."""

    def __init__(self, ops: Sequence[Any], seed: int, device: torch.device, leaf: int,
                 staging: Staging | None) -> None:
        self.ops = validate_pipeline(ops)
        self.staging = staging
        self.seed = seed
        self.device = device
        self.leaf = leaf
        self.backend = ""
        self.reads_windows = starts_with_crop(self.ops)

    def __call__(self, batch: Any, indices: torch.Tensor, epoch: int, batched: bool) -> Any:
        leaves, spec = tree_flatten(batch)
        images = leaves[self.leaf] if batched else leaves[self.leaf].unsqueeze(0)
        with own_cpu_threads(self.device):  # no more threads than the free CPUs (gpuload.cpu_threads)
            out, self.backend = transform_batch(
                self.ops, images, self.seed, epoch, indices.view(-1), device=self.device, staging=self.staging,
            )
        leaves[self.leaf] = out if batched else out[0]
        return tree_unflatten(leaves, spec)

    def windows(self, indices: torch.Tensor, image_sizes: list[tuple[int, int]], epoch: int) -> list[Window]:
        """The window of each whole image (upright ``image_sizes``) that the list reads, so
        that only it need be decoded; only when ``reads_windows``."""
        return decode_windows(self.ops, self.seed, epoch, indices, image_sizes)

    def apply_list(
        self,
        images: list[torch.Tensor],
        indices: torch.Tensor,
        epoch: int,
        windows: list[Window] | None = None,
        image_sizes: list[tuple[int, int]] | None = None,
    ) -> torch.Tensor:
        """Transform decoded images of any sizes into one N,C,H,W batch.

        With ``windows``, ``images[k]`` is that window of a whole image of ``image_sizes[k]``.
        """
        with own_cpu_threads(self.device):
            out, self.backend = transform_batch(
                self.ops, images, self.seed, epoch, indices, device=self.device,
                windows=windows, image_sizes=image_sizes, staging=self.staging,
            )
        return out
