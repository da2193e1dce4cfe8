"""The image cache of an image-file dataset while it serves, as the image source holds it.

``decide_images`` (in ``gpuload.cache``) chooses what may be kept (decoded images on the
device, or encoded bytes in host memory) and why; a :class:`CachedImages` holds the
``SampleStore`` that keeps them as the epochs read them, and says what the source reports of it.
"""

from __future__ import annotations

from typing import Any

import torch

from gpuload.cache import CacheDecision, SampleStore, Store
from gpuload.sources import Setup

__all__ = ["CachedImages"]


class CachedImages:
    """An image cache (``cache``) keeping ``keeps`` images (``"decoded"`` or ``"encoded"``)."""

    def __init__(self, setup: Setup, decision: CacheDecision, num_images: int) -> None:
        where = setup.device if decision.holds == "decoded" else torch.device("cpu")
        self.cache = SampleStore(
            decision.budget, where, owner=setup.owner, room=setup.settings.room_check(where), num_samples=num_images,
        )
        self.keeps, self.reason = decision.holds, decision.reason

    @property
    def store(self) -> Store:
        return self.cache

    @property
    def path(self) -> str:
        return f"image-cache ({self.keeps})"

    def begin_epoch(self, keepable: Any) -> None:
        """Give device memory back if the model has grown into the reserve (the images cached
        last go first)."""
        self.cache.shrink_to_reserve(keepable, "those images are decoded from their files again")

    def summary(self) -> dict[str, Any]:
        """For ``loader.stats.extra["cache"]``."""
        return self.cache.summary(kind="images", mode=self.keeps, reason=self.reason)

    def entries(self) -> dict[str, Any]:
        return {"cache": self.summary()}

    def close(self) -> dict[str, Any]:
        """Drop the cache; its summary as released."""
        self.cache.close()
        return dict(self.summary(), released=True)
