"""Where the step waits, in the tools people watch: Lightning's ``TimelineCallback`` logs the wait
share and stage times with the module's metrics; HF Trainer's adds the wait share and the top
stage to each log. Both on CPU, with tiny models and a loader built to be slow in its reads."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from torch.utils.data import Dataset, default_collate

import gpuload

pytestmark = pytest.mark.slow  # importing Lightning and Transformers takes seconds


@pytest.fixture(autouse=True)
def timeline_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULOAD_TIMELINE", "on")  # off by default (its cost): the loaders here record


class SleepyPairs(Dataset):
    """(x, label) pairs whose every read sleeps: the loader is slow in its dataset reads."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        time.sleep(0.05)  # 200 ms a batch: far longer than a tiny model's step, even at load 8
        return {"x": torch.full((4,), float(index)), "labels": torch.tensor(index % 2)}


class TinyForHF(torch.nn.Module):
    """A model as HF's Trainer calls it: the batch's keys as arguments, a dict with the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.cross_entropy(self.layer(x), labels)}


def test_lightning_logs_the_wait_and_the_stages_and_names_the_top_stage(caplog: pytest.LogCaptureFixture) -> None:
    pl = pytest.importorskip("pytorch_lightning")
    from gpuload.integrations.lightning import TimelineCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch, _index):
            return torch.nn.functional.cross_entropy(self.layer(batch["x"]), batch["labels"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    callback = TimelineCallback(every_n_steps=2)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[callback])
    with caplog.at_level(logging.INFO, logger="gpuload.timeline"):
        trainer.fit(Tiny(), gpuload.DataLoader(SleepyPairs(), batch_size=4))
    metrics = trainer.callback_metrics
    assert 50 < float(metrics["gpuload/wait_percent"]) <= 100
    assert float(metrics["gpuload/stage_ms/read"]) > 0
    assert callback.summary.startswith("data-bound") and "dataset reads" in callback.summary
    assert callback.summary in caplog.text


@pytest.mark.parametrize("integration", ["lightning", "transformers"])
def test_a_callback_needs_a_positive_interval(integration: str) -> None:
    pytest.importorskip({"lightning": "pytorch_lightning", "transformers": "transformers"}[integration])
    import importlib

    callback = importlib.import_module(f"gpuload.integrations.{integration}").TimelineCallback
    with pytest.raises(ValueError, match="every_n_steps"):
        callback(every_n_steps=0)


def test_hf_trainer_logs_the_wait_and_the_top_stage(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    from gpuload.integrations.transformers import GpuloadTrainerMixin, TimelineCallback

    class Trainer(GpuloadTrainerMixin, transformers.Trainer):
        pass

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_train_epochs=1, logging_steps=2,
        report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False, disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    callback = TimelineCallback()
    trainer = Trainer(model=TinyForHF(), args=args, train_dataset=SleepyPairs(), data_collator=default_collate,
                      callbacks=[callback])
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "gpuload_wait_percent" in entry]
    assert logged, trainer.state.log_history
    assert all(entry["gpuload_top_stage"] == "read" for entry in logged), logged
    assert not any("gpuload_slowest_rank" in entry for entry in logged)  # one process: nothing gathered
    assert 50 < logged[-1]["gpuload_wait_percent"] <= 100
    assert callback.summary.startswith("data-bound") and "dataset reads" in callback.summary
