"""Checkpoint a training loop mid-epoch and resume it exactly: the loader's state_dict() beside the model's.

Run: python examples/resume.py   (uses the GPU when there is one, else the CPU)

The run is cut after 7 batches of epoch 1 (a preemption), saved with torch.save, then a new
loader and model built with the same arguments load the checkpoint and finish the run. The
samples seen, and their random crops and flips, are those of an uninterrupted run. About 35 s
on the shared 2-core CPU machine the tests run on (load average 8 to 10 when measured); the
checkpoint is kept in memory, nothing is written.
"""

import io

import torch
from torch import nn
from torch.utils.data import TensorDataset

import gpuload
from gpuload import transforms as T

images = torch.randint(0, 256, (2_000, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
labels = torch.arange(2_000)  # each sample's label is its index, so we can see which were seen
AUGMENT = [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToDtype(torch.float32, scale=True)]


def build() -> tuple[gpuload.DataLoader, nn.Module, torch.optim.Optimizer]:
    loader = gpuload.DataLoader(TensorDataset(images, labels), batch_size=128, shuffle=True,
                                generator=torch.Generator().manual_seed(42), transforms=AUGMENT)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10)).to(loader.device)
    return loader, model, torch.optim.SGD(model.parameters(), lr=0.01)


def train(loader, model, optimizer, epochs, seen, stop_at=None, start_epoch=0):
    """Train; with ``stop_at=(epoch, batch)``, return a checkpoint taken after that batch."""
    for epoch in range(start_epoch, epochs):
        for step, (x, y) in enumerate(loader):
            loss = nn.functional.cross_entropy(model(x), y % 10)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen.append((y.cpu(), x.sum().item()))
            if stop_at == (epoch, step):
                checkpoint = io.BytesIO()
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "loader": loader.state_dict()}, checkpoint)
                return checkpoint.getvalue()
        print(f"epoch {epoch}: loss {loss.item():.3f}")
    return None


uninterrupted: list = []
train(*build(), epochs=3, seen=uninterrupted)

interrupted: list = []
saved = train(*build(), epochs=3, seen=interrupted, stop_at=(1, 6))
print(f"preempted after {len(interrupted)} batches; checkpoint {len(saved) / 1024:.0f} KiB")

loader, model, optimizer = build()  # a new process would do the same
state = torch.load(io.BytesIO(saved), weights_only=False)
model.load_state_dict(state["model"])
optimizer.load_state_dict(state["optimizer"])
loader.load_state_dict(state["loader"])
train(loader, model, optimizer, epochs=3, seen=interrupted, start_epoch=loader.next_epoch)

same = len(interrupted) == len(uninterrupted) and all(
    torch.equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(interrupted, uninterrupted)
)
print(f"resumed exactly: {same}")
