"""Small example models for the docs, the tests and ``pipedream-profile``.

All take 8x8 single-channel images (scikit-learn's digits, 10 classes) except :func:`mlp`, which takes flat
feature vectors. Each is deterministic under ``torch.manual_seed``.

- :func:`digits_cnn`: an ``nn.Sequential`` CNN of 11 layers, a chain.
- :func:`digits_resnet`: a small residual network (not a Sequential), traced with ``torch.fx``; its skip
  connections make the layer graph a DAG.
- :func:`mlp`: an ``nn.Sequential`` multi-layer perceptron.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

__all__ = ["digits_cnn", "digits_resnet", "mlp", "DigitsResNet", "ResidualBlock"]


def digits_cnn() -> nn.Sequential:
    """CNN for 1x8x8 inputs and 10 classes; 11 layers, enough for 4 pipeline stages."""
    return nn.Sequential(
        nn.Conv2d(1, 16, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 32, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


class ResidualBlock(nn.Module):
    """``relu(x + conv2(relu(conv1(x))))`` with shape-preserving 3x3 convolutions."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.conv2(torch.relu(self.conv1(x))))


class DigitsResNet(nn.Module):
    """Stem convolution, two residual blocks, max pooling, flatten and a linear classifier."""

    def __init__(self, channels: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, channels, kernel_size=3, padding=1)
        self.block1 = ResidualBlock(channels)
        self.block2 = ResidualBlock(channels)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(channels * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        x = self.block1(x)
        x = self.block2(x)
        x = self.pool(x)
        x = torch.flatten(x, 1)
        return self.head(x)


def digits_resnet() -> nn.Module:
    """Residual CNN for 1x8x8 inputs and 10 classes; not a Sequential, traceable with ``torch.fx``."""
    return DigitsResNet()


def mlp(widths: Sequence[int] = (64, 128, 128, 10)) -> nn.Sequential:
    """``Linear``/``ReLU`` stack through ``widths`` (input features first, classes last)."""
    widths = list(widths)
    if len(widths) < 2:
        raise ValueError(f"mlp needs at least two widths, got {widths}")
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)
