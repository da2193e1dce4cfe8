"""HF Transformers' Trainer reading from gpuload (``GpuloadTrainerMixin``), one CPU process: a
tiny model (1,348 parameters) trained through Trainer with torch's loaders and with gpuload's
sees the same batches and the same losses; evaluation reads from gpuload with the same loss; a
run resumed from a checkpoint in the middle of an epoch goes on with exactly the batches and
losses of the uninterrupted run."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

import gpuload

transformers = pytest.importorskip("transformers",
                                   reason="HF Transformers is a test dependency: pip install -e '.[test]'")
import transformers.trainer  # noqa: F811 (the submodule, after the importorskip)

from gpuload.integrations.accelerate import GpuloadShard
from gpuload.integrations.transformers import LOADER_STATE_FILE, GpuloadTrainerMixin
from gpuload.resume import ResumeError

pytestmark = pytest.mark.slow  # importing Transformers takes seconds

SAMPLES, BATCH, EPOCHS = 96, 8, 2  # 12 steps an epoch


@pytest.fixture(autouse=True)
def no_hf_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    """conftest puts tests/ on sys.path, where tests/datasets/ (a namespace package, not HF
    ``datasets``) makes Trainer believe HF datasets is installed and use it."""
    if importlib.util.find_spec("datasets") is not None and not _hf_datasets_installed():
        monkeypatch.setattr(transformers.trainer, "is_datasets_available", lambda: False)


def _hf_datasets_installed() -> bool:
    try:
        importlib.metadata.version("datasets")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


class Tiny(torch.nn.Module):
    """Two linear layers; records each training batch's labels and loss (what the test compares)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        self.seen: list[tuple[list[int], float, str]] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        loss = F.cross_entropy(logits, labels)
        if self.training:
            self.seen.append((labels.tolist(), loss.item(), x.device.type))
        return {"loss": loss, "logits": logits}


class GpuloadTrainer(GpuloadTrainerMixin, transformers.Trainer):
    pass


def data(seed: int) -> gpuload.ArrayDataset:
    generator = torch.Generator().manual_seed(seed)
    return gpuload.ArrayDataset(x=torch.randn(SAMPLES, 16, generator=generator),
                                labels=torch.arange(SAMPLES) % 4)


def trainer(trainer_class: type, output_dir: str, **options) -> transformers.Trainer:
    args = transformers.TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
        num_train_epochs=EPOCHS, learning_rate=0.05, save_strategy="steps", save_steps=5, logging_steps=1,
        report_to=[], use_cpu=True, seed=0, remove_unused_columns=False, disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    torch.manual_seed(0)
    return trainer_class(model=Tiny(), args=args, train_dataset=data(1), eval_dataset=data(2),
                         data_collator=default_collate, **options)


def test_train_evaluate_and_resume_mid_epoch_give_torchs_losses(tmp_path) -> None:
    theirs = trainer(transformers.Trainer, str(tmp_path / "torch"))
    theirs.train()
    ours = trainer(GpuloadTrainer, str(tmp_path / "gpuload"))
    ours.train()
    assert len(theirs.model.seen) == EPOCHS * SAMPLES // BATCH
    assert [labels for labels, _, _ in ours.model.seen] == [labels for labels, _, _ in theirs.model.seen]
    assert [loss for _, loss, _ in ours.model.seen] == [loss for _, loss, _ in theirs.model.seen]
    assert type(ours.get_train_dataloader().base_dataloader) is gpuload.DataLoader
    assert {device for _, _, device in ours.model.seen} == {ours.args.device.type}

    eval_loader = ours.get_eval_dataloader()
    assert isinstance(eval_loader, GpuloadShard) and ours.get_eval_dataloader() is eval_loader  # kept
    assert ours.evaluate()["eval_loss"] == theirs.evaluate()["eval_loss"]

    # checkpoint-20: 8 batches into the second epoch; the rest as the uninterrupted run had it
    checkpoint = tmp_path / "gpuload" / "checkpoint-20"
    assert (checkpoint / LOADER_STATE_FILE.format(process=0)).is_file()
    resumed = trainer(GpuloadTrainer, str(tmp_path / "gpuload"))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.model.seen == ours.model.seen[20:]
    assert resumed.evaluate()["eval_loss"] == ours.evaluate()["eval_loss"]


def test_a_checkpoint_without_the_loaders_position_is_refused(tmp_path) -> None:
    theirs = trainer(transformers.Trainer, str(tmp_path))
    theirs.args.num_train_epochs = 1
    theirs.train()
    resumed = trainer(GpuloadTrainer, str(tmp_path))
    with pytest.raises(ResumeError, match="ignore_data_skip=True"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5"))


def test_unknown_gpuload_options_are_refused(tmp_path) -> None:
    with pytest.raises(TypeError, match="cache_sise"):
        trainer(GpuloadTrainer, str(tmp_path), gpuload_options={"cache_sise": "1GiB"})


def readme_snippet(marker: str) -> str:
    """The docs' one python block that contains ``marker`` (gpuload/docs/drop-in.md; the test runs
    exactly that text)."""
    readme = (Path(__file__).parents[2] / "gpuload" / "docs" / "drop-in.md").read_text()
    [block] = [block for block in re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL) if marker in block]
    return block


def test_the_readme_snippet_trains_and_evaluates_from_gpuload(tmp_path) -> None:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=BATCH, num_train_epochs=1, report_to=[],
        use_cpu=True, remove_unused_columns=False, disable_tqdm=True, dataloader_pin_memory=False,
    )
    scope = {"model": Tiny(), "args": args, "train_set": data(1), "eval_set": data(2)}
    exec(readme_snippet("from gpuload.integrations.transformers import GpuloadTrainerMixin"), scope)
    trainer = scope["trainer"]
    assert type(trainer.get_train_dataloader().base_dataloader) is gpuload.DataLoader
    assert trainer.get_train_dataloader().cache_size == "8GiB"
    assert len(scope["model"].seen) == SAMPLES // BATCH and "eval_loss" in scope["metrics"]


def test_resume_errors_the_test_loader_and_an_older_transformers(tmp_path) -> None:
    from gpuload.integrations.transformers import SaveLoaderState

    ours = trainer(GpuloadTrainer, str(tmp_path))
    ours.args.num_train_epochs = 1
    with pytest.raises(ValueError, match=r"^No valid checkpoint found in output directory \("):
        ours.train(resume_from_checkpoint=True)
    ours.train()
    assert isinstance(ours.get_test_dataloader(data(3)), GpuloadShard)
    last = tmp_path / f"checkpoint-{ours.state.global_step}" / LOADER_STATE_FILE.format(process=0)
    last.unlink()
    torch_loader = torch.utils.data.DataLoader(data(3), batch_size=BATCH)
    SaveLoaderState().on_save(ours.args, ours.state, ours.control, train_dataloader=torch_loader)
    assert not last.exists()  # not gpuload's loader: no position to save
    position = tmp_path / "checkpoint-5" / LOADER_STATE_FILE.format(process=0)
    state = torch.load(position, weights_only=False)
    torch.save({**state, "batches": 3}, position)  # a position from another run
    resumed = trainer(GpuloadTrainer, str(tmp_path))
    with pytest.raises(ResumeError, match=r"holds a loader position 3 batches into epoch 0, but the Trainer resumes 5 "
                       r"batches into its epoch: the loader state and the checkpoint do not belong together$"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5"))

    class Old:  # a Trainer from before get_resumed_dataloader
        def __init__(self, *args, **kwargs) -> None:
            pass

    class OldGpuloadTrainer(GpuloadTrainerMixin, Old):
        pass

    with pytest.raises(ImportError, match="get_resumed_dataloader"):
        OldGpuloadTrainer()


def test_eval_loaders_with_persistent_workers_are_kept_and_read_from_gpuload(tmp_path) -> None:
    """With persistent workers Trainer hands back the torch loader it kept; gpuload's, kept for
    that eval dataset, serves it."""
    ours = trainer(GpuloadTrainer, str(tmp_path))
    ours.args.dataloader_persistent_workers, ours.args.dataloader_num_workers = True, 1
    eval_loader = ours.get_eval_dataloader()
    assert type(eval_loader.base_dataloader) is gpuload.DataLoader and ours.get_eval_dataloader() is eval_loader
    assert ours.evaluate()["eval_loss"] == ours.evaluate()["eval_loss"]


def test_a_loader_gpuload_does_not_serve_resumes_as_trainer_resumes_it(tmp_path) -> None:
    ours = trainer(GpuloadTrainer, str(tmp_path))
    torch_loader = torch.utils.data.DataLoader(torch.arange(40), batch_size=BATCH)
    resumed = ours.get_resumed_dataloader(torch_loader, 2)
    assert [batch.tolist() for batch in resumed] == [list(range(start, start + BATCH)) for start in (16, 24, 32)]
