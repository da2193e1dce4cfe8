"""A Lightning ``ddp`` fit over a gpuload loader with ``cache_scope="world"``, under torchrun.

Run by ``lightning_job.py`` as its ``scope`` kind (one torchrun job for every Lightning ``ddp``
fit of the tests: the ranks start and import Lightning once), or on its own:
``torchrun --standalone --nproc_per_node 2 lightning_scope_job.py OUT_DIR``. Lightning re-creates
the loader on each rank with a ``DistributedSampler``; each rank writes ``OUT_DIR/rank-N.json``
(what ``lightning_job.RecordSamples`` records) and ``OUT_DIR/batches-N.json``: the sample ids
of each epoch's batches, in order, and the scope and exchange of the loader it trained on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from lightning_job import RecordSamples  # beside this file: sys.path[0] when run as a script
from torch.utils.data import TensorDataset

import gpuload

NUM_SAMPLES = 64
BATCH_SIZE = 4
EPOCHS = 2
LIMIT_BATCHES = 6  # of 8 per rank and epoch: Lightning stops every rank at the same batch


def dataset() -> TensorDataset:
    return TensorDataset(torch.arange(NUM_SAMPLES, dtype=torch.float32).unsqueeze(1), torch.arange(NUM_SAMPLES))


class RecordBatches(RecordSamples):
    """``RecordSamples`` (its ``rank-N.json``), plus each epoch's batches in order and the loader's
    scope and exchange counters in ``batches-N.json``."""

    def __init__(self, out_dir: str) -> None:
        super().__init__(out_dir)
        self.batches: dict[int, list[list[int]]] = {}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.batches.setdefault(self.current_epoch, []).append(batch[1].tolist())
        return super().training_step(batch, batch_idx)

    def on_train_end(self) -> None:
        super().on_train_end()
        loader = self.trainer.train_dataloader
        record = {"batches": self.batches, "sampler_seed": loader.sampler.seed, "cache_scope": loader.cache_scope,
                  "exchange": loader.stats.extra.get("exchange")}
        Path(self.out_dir, f"batches-{self.global_rank}.json").write_text(json.dumps(record))


def fit(out_dir: str) -> None:
    """``EPOCHS`` epochs of ``LIMIT_BATCHES`` batches on each rank, the loader split over the world."""
    loader = gpuload.DataLoader(dataset(), batch_size=BATCH_SIZE, shuffle=True, device="cpu", cache_scope="world")
    trainer = pl.Trainer(
        strategy="ddp", devices=2, accelerator="cpu", max_epochs=EPOCHS, limit_train_batches=LIMIT_BATCHES,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(RecordBatches(out_dir), loader)


if __name__ == "__main__":
    fit(sys.argv[1])  # RecordSamples.setup registered lightning_job.end_process_group at exit
