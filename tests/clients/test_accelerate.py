"""HF Accelerate's ``Accelerator.prepare`` with a gpuload loader (one CPU process).

``prepare`` rebuilds every loader from torch's constructor arguments as
``accelerate.data_loader.DataLoader`` (torch's class, bound when Accelerate is imported),
wrapped in its ``DataLoaderShard``. The prepared loader must serve from gpuload, with the
batches Accelerate gives for torch's loader.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import TensorDataset

import gpuload
from equivalence import assert_same_epochs

accelerate = pytest.importorskip("accelerate", reason="HF Accelerate is a test dependency: pip install -e '.[test]'")
import accelerate.data_loader  # noqa: E402,F811 (the submodule, after the importorskip)

pytestmark = pytest.mark.slow  # importing Accelerate alone takes seconds


def shuffled(loader_class: type) -> TorchDataLoader:
    data = TensorDataset(torch.arange(32, dtype=torch.float32).unsqueeze(1), torch.arange(32))
    return loader_class(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))


def serves_from_gpuload(prepared: object) -> bool:
    return isinstance(prepared, gpuload.DataLoader) or isinstance(
        getattr(prepared, "base_dataloader", None), gpuload.DataLoader
    )


@pytest.mark.xfail(
    strict=True,
    reason="issue #11: prepare() rebuilds the loader as torch's DataLoader (accelerate.data_loader.DataLoader, "
    "bound at import) from torch's arguments: gpuload and its options are dropped",
)
def test_prepare_keeps_a_gpuload_loader_with_the_same_batches() -> None:
    accelerator = accelerate.Accelerator(cpu=True)
    theirs = accelerator.prepare(shuffled(TorchDataLoader))
    ours = accelerator.prepare(shuffled(gpuload.DataLoader))
    assert serves_from_gpuload(ours), type(getattr(ours, "base_dataloader", ours))
    assert_same_epochs(ours, theirs, epochs=2)


def test_prepare_serves_from_gpuload_when_accelerates_class_is_swapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workaround today: swap the class Accelerate builds (as the global swap would)."""
    accelerator = accelerate.Accelerator(cpu=True)
    theirs = accelerator.prepare(shuffled(TorchDataLoader))
    monkeypatch.setattr(accelerate.data_loader, "DataLoader", gpuload.DataLoader)
    ours = accelerator.prepare(shuffled(gpuload.DataLoader))
    assert serves_from_gpuload(ours)
    assert_same_epochs(ours, theirs, epochs=2)
