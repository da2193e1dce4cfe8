"""Train a classifier on a Hugging Face ``datasets.Dataset`` with gpuload: columns, not rows.

Run: python examples/train_hf_dataset.py   (the GPU when there is one, else the CPU; about 15 s
on 2 idle cores; needs the arrow extra: pip install 'gpuload[arrow]')

1. Data: a ``datasets.Dataset`` built here (nothing is downloaded): a 32-float embedding per
   row (a class's centre plus noise), an int64 label and a caption, saved with
   ``save_to_disk`` and loaded back memory-mapped, then split with ``train_test_split`` (an
   index mapping, as ``shuffle``/``select``/``filter`` make).
2. Loading: ``gpuload.DataLoader(dataset, ...)`` over the dataset in ``torch`` format. The
   embedding and label columns are placed whole in the cache (on the GPU when there is one),
   each batch one gather; the caption is taken per batch as a list of strings. Every batch
   equals what torch's DataLoader gives over the same dataset: the script checks one epoch.
3. Training: a linear classifier for a few epochs; the test accuracy ends near 100%.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

import gpuload
from gpuload.datasets.arrow import import_optional

datasets = import_optional("datasets")
pa = import_optional("pyarrow")


def make_dataset(rows: int, classes: int, width: int, folder: Path) -> object:
    """Rows of ``width`` floats around one of ``classes`` centres, saved and loaded memory-mapped."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, classes, rows)
    centres = rng.normal(0, 1, (classes, width)).astype(np.float32)
    embedding = centres[labels] + rng.normal(0, 0.5, (rows, width)).astype(np.float32)
    table = pa.table({
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(embedding.reshape(-1)), width),
        "label": pa.array(labels, pa.int64()),
        "caption": [f"a sample of class {label}" for label in labels],
    })
    datasets.Dataset(table).save_to_disk(str(folder / "saved"))
    return datasets.load_from_disk(str(folder / "saved"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()
    datasets.disable_progress_bars()
    classes, width = 10, 32
    with tempfile.TemporaryDirectory() as folder:
        split = make_dataset(args.rows, classes, width, Path(folder)).train_test_split(test_size=0.2, seed=0)
        train, test = (split[name].with_format("torch") for name in ("train", "test"))
        loader = gpuload.DataLoader(train, batch_size=args.batch_size, shuffle=True,
                                    generator=torch.Generator().manual_seed(0))
        reference = torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True,
                                                generator=torch.Generator().manual_seed(0))
        same = all(
            torch.equal(ours["embedding"].cpu(), theirs["embedding"]) and torch.equal(ours["label"].cpu(),
                                                                                     theirs["label"])
            and ours["caption"] == theirs["caption"]
            for ours, theirs in zip(loader, reference, strict=True)
        )
        print(f"same batches as torch's DataLoader: {same} (gpuload's path: {loader.stats.path})")

        torch.manual_seed(0)
        model = nn.Linear(width, classes).to(loader.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for epoch in range(args.epochs):
            for batch in loader:
                loss = nn.functional.cross_entropy(model(batch["embedding"]), batch["label"])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            print(f"epoch {epoch}: loss {loss.item():.3f}")

        test_loader = gpuload.DataLoader(test, batch_size=1024)
        with torch.no_grad():
            right = sum(int((model(b["embedding"]).argmax(1) == b["label"]).sum()) for b in test_loader)
        print(f"test accuracy: {right / len(test):.3f}; cache: {loader.stats.extra.get('cache_plan', 'in place')}")
        loader.close()
        test_loader.close()


if __name__ == "__main__":
    main()
