"""Small models for the job-plan tests: a CNN, an MLP and a transformer, each with a sample."""

from __future__ import annotations

import torch
from torch import nn


def cnn(width: int = 16) -> nn.Module:
    """Three conv stages with batch norm, then a linear classifier (input 3xHxW)."""
    layers: list[nn.Module] = []
    channels = 3
    for out in (width, 2 * width, 4 * width):
        layers += [nn.Conv2d(channels, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU(), nn.MaxPool2d(2)]
        channels = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))


def mlp() -> nn.Module:
    """784 -> 512 -> 512 -> 10 (input 784 floats)."""
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


class TinyTransformer(nn.Module):
    """Token embedding, two encoder layers, a vocabulary head (input: 64 int64 token ids)."""

    def __init__(self, vocab: int = 1000, dim: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def transformer() -> nn.Module:
    return TinyTransformer()


SAMPLES = {
    "cnn": lambda: torch.empty(3, 32, 32),
    "mlp": lambda: torch.empty(784),
    "transformer": lambda: torch.zeros(64, dtype=torch.long),
}
FACTORIES = {"cnn": cnn, "mlp": mlp, "transformer": transformer}
