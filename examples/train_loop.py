"""A training loop fed by gpuload.DataLoader: the only change from torch is the import.

Run: python examples/train_loop.py   (uses the GPU when there is one, else the CPU)

It shows 10,000 CIFAR-shaped uint8 images kept on the loader's device, converted to float
there, two epochs of a linear model, and the loader's counters. About 35 s on the shared
2-core CPU machine the tests run on (load average 8 when measured); it writes nothing.
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

import gpuload

images = torch.randint(0, 256, (10_000, 3, 32, 32), dtype=torch.uint8)
labels = torch.randint(0, 10, (10_000,))
loader = gpuload.DataLoader(TensorDataset(images, labels), batch_size=256, shuffle=True)

model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10)).to(loader.device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
mean = torch.tensor([125.3, 123.0, 113.9], device=loader.device).view(1, 3, 1, 1)
std = torch.tensor([63.0, 62.1, 66.7], device=loader.device).view(1, 3, 1, 1)

for epoch in range(2):
    for x, y in loader:  # x: uint8 on loader.device; convert there, not on the host
        x = (x.float() - mean) / std
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"epoch {epoch}: loss {loss.item():.3f}; {loader.stats}")
loader.close()
