"""Your own image classifier, trained by bstrain's trainer on the classification task.

    cd examples && python -m bstrain train config=my_cnn.yaml

The classification task feeds (B, 3, H, W) float images and wants (B, classes) logits. With no
data.path the images are a synthetic set of 10 grating classes (no download); data.path=DIR takes
CIFAR-10's python directory.
"""
import torch
from torch import nn

from bstrain.nn import BlockSparseLinear


class SmallCNN(nn.Module):
    """Two convolutions, then a block-sparse hidden layer and a linear head."""

    def __init__(self, classes: int = 10, width: int = 32, density: float = 0.25):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4))
        self.hidden = BlockSparseLinear(32 * width, 256, block_size=32, density=density)
        self.head = nn.Linear(256, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.features(x).flatten(1))))
