"""One epoch through HF Transformers' Trainer: Trainer's own DataLoader against gpuload's
(``GpuloadTrainerMixin``), on the same in-memory dataset, runs interleaved.

The dataset is ``gpuload.ArrayDataset`` of named arrays (samples are dicts, as Trainer passes
them to the model), collated by torch's ``default_collate`` in both runs: Trainer's loader
indexes and collates per sample in Python; gpuload gathers each batch with one index per array.
The model is a small MLP, so the step is short and the loader's share of it shows. Reports
Trainer's own ``train_runtime`` per epoch (median over rounds) and the load average.

    python benchmarks/bench_trainer.py [--samples 20000] [--batch-size 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch
import torch.nn.functional as F
from torch.utils.data import default_collate
from transformers import Trainer, TrainingArguments

import gpuload
from gpuload.integrations.transformers import GpuloadTrainerMixin


class MLP(torch.nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(features, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.cross_entropy(self.net(x), labels)}


class GpuloadTrainer(GpuloadTrainerMixin, Trainer):
    pass


def epoch_seconds(trainer_class: type, dataset: gpuload.ArrayDataset, batch_size: int, features: int) -> float:
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=batch_size, num_train_epochs=1, save_strategy="no",
            logging_strategy="no", report_to=[], remove_unused_columns=False, disable_tqdm=True,
            dataloader_pin_memory=False, seed=0,
        )
        torch.manual_seed(0)
        trainer = trainer_class(model=MLP(features), args=args, train_dataset=dataset, data_collator=default_collate)
        return float(trainer.train().metrics["train_runtime"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    dataset = gpuload.ArrayDataset(x=torch.randn(options.samples, options.features, generator=generator),
                                   labels=torch.randint(0, 10, (options.samples,), generator=generator))
    times: dict[str, list[float]] = {"Trainer's DataLoader": [], "gpuload (GpuloadTrainerMixin)": []}
    epoch_seconds(Trainer, dataset, options.batch_size, options.features)  # warm-up: imports, first-call costs
    for _ in range(options.rounds):
        times["Trainer's DataLoader"].append(epoch_seconds(Trainer, dataset, options.batch_size, options.features))
        times["gpuload (GpuloadTrainerMixin)"].append(
            epoch_seconds(GpuloadTrainer, dataset, options.batch_size, options.features))
    steps = -(-options.samples // options.batch_size)
    print(f"one epoch through Trainer: {options.samples:,} samples x {options.features} float32, batch "
          f"{options.batch_size} ({steps} steps), "
          f"device {torch.device('cuda' if torch.cuda.is_available() else 'cpu')}, "
          f"{options.rounds} rounds interleaved, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    baseline = statistics.median(times["Trainer's DataLoader"])
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"  {name:32s} {median:7.2f} s median ({min(seconds):.2f}-{max(seconds):.2f}), "
              f"{options.samples / median:9,.0f} samples/s, {baseline / median:.2f}x")


if __name__ == "__main__":
    main()
