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


class VocabLM(nn.Module):
    """A stateless LM over ``vocab_size`` tokens: a byte LM needs 256 (the start check names the key)."""

    def __init__(self, vocab_size: int = 256, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, x):
        return self.head(self.embed(x))


class HeadLM(VocabLM):
    """:class:`VocabLM` with ``outputs`` logits per position, under a name the start check does not know."""

    def __init__(self, outputs: int = 256, width: int = 16):
        super().__init__(vocab_size=outputs, width=width)


class RGBNet(nn.Module):
    """An image classifier that takes 3-channel images and has ``outputs`` logits, with no config
    key the start check knows saying so."""

    def __init__(self, outputs: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.head = nn.Linear(8, outputs)

    def forward(self, x):
        return self.head(self.conv(x).mean((2, 3)))


class LimitLM(nn.Module):
    """A stateless LM that takes at most ``limit`` positions (a name the start check does not know)
    and raises ValueError for longer inputs."""

    def __init__(self, limit: int = 64, width: int = 16):
        super().__init__()
        self.limit = limit
        self.embed = nn.Embedding(256, width)
        self.head = nn.Linear(width, 256)

    def forward(self, x):
        if x.shape[1] > self.limit:
            raise ValueError(f"x: expected at most {self.limit} positions, got {x.shape[1]}")
        return self.head(self.embed(x))


class StackBlock(nn.Module):
    """One residual block of :class:`StackLM`."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = BlockSparseLinear(width, width, block_size=16, density=0.5, seed=len(str(width)))

    def forward(self, h):
        return h + torch.relu(self.mix(self.norm(h)))


class StackLM(nn.Module):
    """A stateless byte LM of residual blocks (``blocks.0``, ``blocks.1``, ...): a user's model whose
    FSDP units ``model.shard`` names."""

    def __init__(self, width: int = 32, depth: int = 2):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.blocks = nn.ModuleList(StackBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 256)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class FailsToBuild(nn.Module):
    """A model whose constructor raises (a bug in a user's code at start): one line, traceback in train.log."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.head = nn.Linear(width, 256)
        self.scale = 1 / (width - 32)


class _CrossBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, h):
        return h + torch.relu(self.fc(h))


class CrossUnitLM(nn.Module):
    """Reads blocks.0's weight in the root's forward: under fsdp with model.shard=[blocks.*], a unit's
    parameter used outside that unit."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.blocks = nn.ModuleList([_CrossBlock(width) for _ in range(2)])
        self.head = nn.Linear(width, 256)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h @ self.blocks[0].fc.weight)
