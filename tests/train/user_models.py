"""Models defined outside bstrain, named by ``_target_`` in the trainer tests (stand-ins for a user's code)."""
from __future__ import annotations

import os

import torch
from torch import nn

from bstrain.nn import BlockSparseLinear


class OverflowLM(nn.Module):
    """A stateless byte LM whose output overflows in fp16 at one training step on one rank
    (environment: BSTRAIN_TEST_OVERFLOW="RANK:STEP")."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.mix = BlockSparseLinear(width, width, block_size=16, density=0.5)
        self.head = nn.Linear(width, 256)
        self.calls = 0

    def forward(self, x):
        logits = self.head(torch.relu(self.mix(self.embed(x))))
        if self.training:
            self.calls += 1
            rank, step = (int(v) for v in os.environ.get("BSTRAIN_TEST_OVERFLOW", "-1:-1").split(":"))
            if int(os.environ.get("RANK", "0")) == rank and self.calls == step:
                logits = logits * float("inf")
        return logits


class Broken(nn.Module):
    """A model with a bug in its forward: the CLI must show the traceback."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        raise RuntimeError("a bug in the model")


class SyncingLM(nn.Module):
    """A stateless byte LM that reads a value on the host in its forward (cannot be captured)."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.head = nn.Linear(width, 256)

    def forward(self, x):
        h = self.embed(x)
        if float(h.abs().max()) > 1e6:          # a host sync
            h = h / 2
        return self.head(h)


class BoostLM(nn.Module):
    """A stateless byte LM whose logits are multiplied by the buffer ``boost`` (a test sets it to inf)."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.mix = BlockSparseLinear(width, width, block_size=16, density=0.5)
        self.head = nn.Linear(width, 256)
        self.register_buffer("boost", torch.ones(()))

    def forward(self, x):
        return self.head(torch.relu(self.mix(self.embed(x)))) * self.boost
