"""Your own model, trained by bstrain's trainer: a stateless byte-level language model.

    cd examples && python -m bstrain train config=my_lm.yaml

The trainer needs an nn.Module whose forward maps (B, T) int64 bytes to (B, T, 256) logits
(the byte LM task's contract). This one is causal: output t sees bytes t-7 .. t only.
"""
import torch
import torch.nn.functional as F
from torch import nn

from bstrain.nn import BlockSparseLinear


class ConvLM(nn.Module):
    """Embedding, a causal convolution over the last ``kernel`` bytes, a block-sparse MLP, a head."""

    def __init__(self, width: int = 256, kernel: int = 8, density: float = 0.25, block_size: int = 32):
        super().__init__()
        self.kernel = kernel
        self.embed = nn.Embedding(256, width)
        self.conv = nn.Conv1d(width, width, kernel)
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(BlockSparseLinear(width, 4 * width, block_size=block_size, density=density),
                                 nn.GELU(),
                                 BlockSparseLinear(4 * width, width, block_size=block_size, density=density))
        self.head = nn.Linear(width, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).transpose(1, 2)                                   # (B, width, T)
        h = self.conv(F.pad(h, (self.kernel - 1, 0))).transpose(1, 2)       # causal: pad on the left
        h = h + self.mlp(self.norm(h))
        return self.head(h)                                                 # (B, T, 256)
