"""The resume recipe of gpuload/docs/resume.md, its loading half run exactly as the page writes
it, from a state saved at each kind of point: before the first ``iter()`` (epoch -1), inside an
epoch, after an epoch's loop ended (``finished``), after the last epoch. The page's own assertion
must hold, and the batches before the save and after the resume are the uninterrupted run's."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch
import torch.utils.data as tud

import gpuload

PAGE = Path(__file__).parents[1] / "gpuload" / "docs" / "resume.md"
EPOCHS = 2
BATCH = 16  # the page's batch size: 4 batches an epoch of the 64 samples below


def recipe() -> str:
    """The page's first python block from its resuming half on (``# a new process``)."""
    first = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)[0]
    return "# a new process" + first.split("# a new process", 1)[1]


class Recording(gpuload.DataLoader):
    """gpuload's loader, noting the labels of every batch it hands to the loop."""

    seen: ClassVar[list[list[int]]] = []

    def __iter__(self):
        for batch in super().__iter__():
            Recording.seen.append(batch[1].tolist())
            yield batch


def dataset() -> tud.TensorDataset:
    return tud.TensorDataset(torch.zeros(64, 3), torch.arange(64))


def uninterrupted() -> list[list[int]]:
    torch.manual_seed(0)
    loader = gpuload.DataLoader(dataset(), batch_size=BATCH, shuffle=True)
    return [batch[1].tolist() for _ in range(EPOCHS) for batch in loader]


def saved_after(batches: int, tmp_path: Path) -> tuple[list[list[int]], torch.Tensor]:
    """Run as the uninterrupted run does for ``batches`` batches, ending each epoch's loop that
    reaches its last batch (its state is then ``finished``), and save the page's checkpoint;
    the batches seen and torch's global generator as the checkpoint would restore it."""
    torch.manual_seed(0)
    loader = gpuload.DataLoader(dataset(), batch_size=BATCH, shuffle=True)
    seen: ClassVar[list[list[int]]] = []
    while len(seen) < batches:
        for batch in loader:
            seen.append(batch[1].tolist())
            if len(seen) == batches and len(seen) % 4:
                break
    torch.save({"loader": loader.state_dict()}, tmp_path / "ckpt.pt")
    return seen, torch.get_rng_state()


@pytest.mark.parametrize(("batches", "saved_at"), [(0, (-1, True)), (3, (0, False)), (4, (0, True)),
                                                   (6, (1, False)), (8, (1, True))])
def test_the_pages_recipe_runs_each_epoch_once_from_any_saved_point(
        batches: int, saved_at: tuple[int, bool], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before, global_state = saved_after(batches, tmp_path)
    state = torch.load(tmp_path / "ckpt.pt", weights_only=False)["loader"]
    assert (state["epoch"], state["finished"]) == saved_at
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(Recording, "seen", [])
    torch.set_rng_state(global_state)  # the job's own checkpoint restores torch's generator
    namespace: dict[str, Any] = {"gpuload": SimpleNamespace(DataLoader=Recording), "torch": torch,
                                 "dataset": dataset(), "epochs": EPOCHS}
    exec(compile(recipe(), f"{PAGE.name} (resuming half)", "exec"), namespace)  # the page's assertion runs too
    assert before + Recording.seen == uninterrupted()
