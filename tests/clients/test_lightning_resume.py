"""PyTorch Lightning saves gpuload's loader state in its checkpoints: a fit resumed mid-epoch sees
exactly the samples of an uninterrupted fit."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.utils.data as tud

import gpuload


def _lightning():
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    pytest.skip("needs PyTorch Lightning (the test extra installs it)")


@pytest.mark.slow
def test_a_fit_resumed_from_a_mid_epoch_checkpoint_sees_the_uninterrupted_samples(tmp_path) -> None:
    pl = _lightning()

    class Recorder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)
            self.seen: list[int] = []

        def training_step(self, batch, _index):
            x, index = batch
            self.seen.extend(index.tolist())
            return self.layer(x).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def loader() -> gpuload.DataLoader:
        data = tud.TensorDataset(torch.randn(40, 2, generator=torch.Generator().manual_seed(0)), torch.arange(40))
        return gpuload.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))

    quiet = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    whole = Recorder()
    pl.Trainer(max_epochs=2, enable_checkpointing=False, **quiet).fit(whole, loader())
    cut = Recorder()
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=13, save_top_k=-1)
    pl.Trainer(max_epochs=2, max_steps=13, callbacks=[saver], **quiet).fit(cut, loader())  # 3 batches into epoch 1
    checkpoint = next(tmp_path.glob("*.ckpt"))
    saved = torch.load(checkpoint, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert (saved["epoch"], saved["batches"]) == (1, 3)  # gpuload's own state, inside Lightning's checkpoint
    rest = Recorder()
    pl.Trainer(max_epochs=2, enable_checkpointing=False, **quiet).fit(rest, loader(), ckpt_path=str(checkpoint))
    assert cut.seen + rest.seen == whole.seen
