"""PyTorch Lightning: :class:`TimelineCallback` logs where the step waits (``loader.timeline``)
with the module's other metrics.

    trainer = pl.Trainer(callbacks=[TimelineCallback()])
    trainer.fit(model, gpuload.DataLoader(dataset, batch_size=256, timeline_steps=1000))

Every ``every_n_steps`` training steps it logs ``gpuload/wait_percent`` and each stage's mean ms
per step (``loader.timeline.scalars()``, over the loader's life) through ``LightningModule.log``,
so they reach whatever logger the Trainer has (TensorBoard, CSV, W&B); at each epoch's end it
puts the verdict line (``summary``), which names the top stage, in the log. The loader records
only with its timeline on (``timeline_steps=`` or ``GPULOAD_TIMELINE=on``; off by default). Under
torch.distributed it also gathers every rank's waits at those steps (one small collective,
``gpuload.distributed.rank_waits``) and logs the slowest rank and its wait share.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytorch_lightning as pl
import torch.distributed as dist

from gpuload.distributed.rank_waits import gather_waits
from gpuload.timeline import Timeline, timeline_of

__all__ = ["TimelineCallback"]

_log = logging.getLogger("gpuload.timeline")


class TimelineCallback(pl.Callback):
    """Logs the train loader's wait share and stage times every ``every_n_steps`` steps, and its
    verdict at each epoch's end (also kept in ``summary``). ``loader``: the gpuload loader to
    watch; default the Trainer's train loader (gpuload's, also inside Lightning's wrappers)."""

    def __init__(self, every_n_steps: int = 50, loader: Any = None) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps!r} must be a positive int")
        self.every_n_steps = every_n_steps
        self.loader = loader
        self.summary = ""

    def _timeline(self, trainer: pl.Trainer) -> Timeline | None:
        return timeline_of(self.loader if self.loader is not None else trainer.train_dataloader)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if (batch_idx + 1) % self.every_n_steps:
            return
        timeline = self._timeline(trainer)
        if timeline is None or not timeline.enabled:
            return
        scalars = {name: value for name, value in timeline.scalars().items() if math.isfinite(value)}
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            slowest = gather_waits(timeline).slowest  # a collective: every rank is at this step
            if slowest is not None and slowest.wait_fraction is not None:
                scalars["gpuload/slowest_rank"] = float(slowest.rank)
                scalars["gpuload/slowest_rank_wait_percent"] = 100 * slowest.wait_fraction
        pl_module.log_dict(scalars, on_step=True, on_epoch=False, batch_size=1)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        timeline = self._timeline(trainer)
        if timeline is not None and timeline.enabled:
            self.summary = timeline.summary()
            _log.info("gpuload: %s", self.summary)
