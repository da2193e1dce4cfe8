"""A tiny PyTorch Lightning fit over a gpuload loader; each rank writes down what it saw.

Used by ``test_lightning.py``, in process (``ddp_spawn``) and as the script ``torchrun`` runs
(``ddp``): ``torchrun --standalone --nproc_per_node 2 lightning_job.py OUT_DIR KIND...``, where a
KIND of ``scope`` is ``lightning_scope_job``'s fit (its own records: see that file). Each
rank writes ``OUT_DIR/rank-N.json``: the sample ids of its batches, the class of
``trainer.train_dataloader`` and of its sampler.
"""

from __future__ import annotations

import atexit
import json
import sys
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import Dataset, TensorDataset

import gpuload

NUM_SAMPLES = 32
EXIT_PAUSE_S = 0.5  # end_process_group: 0.2 s sufficed in 40 of 40 runs (benchmarks/exit_abort.py)
KINDS = ("arrays", "generic")  # gpuload's array fast path; torch's fetching (any __getitem__)


class Indexed(Dataset):
    """A generic map-style dataset: sample i is (the float i, the id i)."""

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.tensor([float(index)]), index


def dataset(kind: str) -> Dataset:
    if kind == "arrays":
        return TensorDataset(torch.arange(NUM_SAMPLES, dtype=torch.float32).unsqueeze(1), torch.arange(NUM_SAMPLES))
    return Indexed()


class RecordSamples(pl.LightningModule):
    """Fits y = w x + b to nothing in particular, recording the ids of the samples it got."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[int] = []

    def setup(self, stage: str) -> None:
        atexit.unregister(end_process_group)  # once per process, whatever the fits it runs (RecordBatches too)
        atexit.register(end_process_group)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        features, ids = batch
        self.seen += ids.tolist()
        return self.layer(features).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_end(self) -> None:
        loader = self.trainer.train_dataloader
        record = {
            "rank": self.global_rank,
            "world_size": self.trainer.world_size,
            "seen": sorted(self.seen),
            "loader": f"{type(loader).__module__}.{type(loader).__qualname__}",
            "sampler": type(loader.sampler).__name__,
        }
        Path(self.out_dir, f"rank-{self.global_rank}.json").write_text(json.dumps(record))


def end_process_group() -> None:
    """End the rank's process group, then let gloo's worker threads drop the collectives they
    finished, before the interpreter finalizes. A worker thread frees a finished collective's
    thread state (it holds Python objects) just after the waiting thread moved on; if the
    interpreter is finalizing by then, taking the GIL ends that thread by unwinding through C++,
    and the process aborts after the fit has finished ("terminate called without an active
    exception", SIGABRT; seen in a core dump: ``ProcessGroupGloo::runLoop`` ->
    ``~AsyncAllreduceWork`` -> ``gil_scoped_acquire`` -> ``pthread_exit``). The group's worker
    threads outlive ``destroy_process_group`` while DDP holds the group (here: Lightning's), so the
    pause, which releases the GIL, is what lets them finish (``benchmarks/exit_abort.py``: a
    2-rank DDP job aborted in 4 of 20 runs, 5 of 20 with the group destroyed, none of 20 with a
    0.2 s pause). Lightning ends the group at exit for NCCL only, and a
    ``ddp_spawn`` rank runs no code of ours after the fit, so each rank registers this at exit
    when Lightning sets the module up (``setup``)."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    time.sleep(EXIT_PAUSE_S)


def fit(out_dir: str, kind: str, strategy: str) -> None:
    """One epoch on 2 CPU processes, the gpuload loader passed to ``fit``."""
    loader = gpuload.DataLoader(dataset(kind), batch_size=4)
    trainer = pl.Trainer(
        strategy=strategy, devices=2, accelerator="cpu", max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(RecordSamples(out_dir), loader)


def read_records(out_dir: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(out_dir.glob("rank-*.json"))]


if __name__ == "__main__":  # OUT_DIR KIND...: one fit per kind, into OUT_DIR/KIND, in one job
    for each in sys.argv[2:]:
        Path(sys.argv[1], each).mkdir(parents=True, exist_ok=True)
        if each == "scope":
            import lightning_scope_job  # beside this file: sys.path[0] when run as a script

            lightning_scope_job.fit(str(Path(sys.argv[1], each)))
        else:
            fit(str(Path(sys.argv[1], each)), each, "ddp")
