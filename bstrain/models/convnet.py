"""A ResNet-style image classifier whose 3x3 and 1x1 convolutions are block-sparse.

Stem: a dense 3x3 convolution from the image channels to ``widths[0]`` (three input channels
make no blocks). Then one stage per width: ``depth`` basic blocks (3x3 - BN - ReLU - 3x3 - BN,
plus the shortcut, a 1x1 convolution with BN where the width or stride changes), the first of
each later stage with stride 2. Global average pooling and a dense linear head.

``density < 1`` makes every 3x3 and 1x1 convolution a :class:`BlockSparseConv2d`:
``layout="balanced"`` draws a balanced random block layout per convolution (seeded by
``layout_seed`` and its position), ``layout="grouped"`` takes block-diagonal layouts with
1/density groups and shuffles channels between the groups after each first convolution
(ShuffleNet's channel shuffle), so information crosses groups. ``density=1`` is the dense
baseline (nn.Conv2d). A stateless model: ``forward(x (B, C, H, W)) -> (B, classes)``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from bstrain import layout as layouts
from bstrain.nn import BlockSparseConv2d

__all__ = ["ConvNetConfig", "SparseResNet"]


@dataclass
class ConvNetConfig:
    """Constructor arguments of :class:`SparseResNet` (the ``model/convnet`` config's keys)."""
    classes: int = field(default=10, metadata={"help": "output classes"})
    in_channels: int = field(default=3, metadata={"help": "image channels"})
    widths: str = field(default="32,64,128", metadata={"help": "channels of each stage, comma-separated"})
    depth: int = field(default=1, metadata={"help": "basic blocks per stage"})
    density: float = field(default=0.25, metadata={"help": "live fraction of channel blocks; 1: dense convs"})
    block_size: int = field(default=16, metadata={"help": "channels per block"})
    layout: str = field(default="balanced", metadata={"help": "balanced (random) | grouped (block-diagonal + "
                                                               "channel shuffle)"})
    layout_seed: int = field(default=0, metadata={"help": "seed of the drawn layouts"})


def _widths(spec) -> list[int]:
    try:
        out = [int(v) for v in str(spec).split(",")]
    except ValueError:
        out = []
    if not out or any(v < 1 for v in out):
        raise ValueError(f"model.widths: expected comma-separated positive ints, got {spec!r}")
    return out


class _Shuffle(nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.groups = groups

    def forward(self, x):
        b, c, h, w = x.shape
        if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():    # stays channels-last
            nhwc = x.permute(0, 2, 3, 1).reshape(b, h, w, self.groups, c // self.groups)
            return nhwc.transpose(3, 4).reshape(b, h, w, c).permute(0, 3, 1, 2)
        return x.view(b, self.groups, c // self.groups, h, w).transpose(1, 2).reshape(b, c, h, w)


class _Basic(nn.Module):
    def __init__(self, conv, c_in: int, c_out: int, stride: int, shuffle: int):
        super().__init__()
        self.conv1, self.bn1 = conv(c_in, c_out, 3, stride), nn.BatchNorm2d(c_out)
        self.shuffle = _Shuffle(shuffle) if shuffle > 1 else nn.Identity()
        self.conv2, self.bn2 = conv(c_out, c_out, 3, 1), nn.BatchNorm2d(c_out)
        self.short = None
        if stride != 1 or c_in != c_out:
            self.short = nn.Sequential(conv(c_in, c_out, 1, stride), nn.BatchNorm2d(c_out))

    def forward(self, x):
        h = self.shuffle(torch.relu(self.bn1(self.conv1(x))))
        h = self.bn2(self.conv2(h))
        return torch.relu(h + (x if self.short is None else self.short(x)))


class SparseResNet(nn.Module):
    """See the module docstring. ``SparseResNet(widths="32,64", density=0.25, ...)`` with
    :class:`ConvNetConfig`'s keys, or ``SparseResNet(config)``."""

    def __init__(self, config: ConvNetConfig | None = None, **kwargs):
        super().__init__()
        names = {f.name for f in dataclasses.fields(ConvNetConfig)}
        if unknown := sorted(set(kwargs) - names):
            raise TypeError(f"SparseResNet: unexpected argument {unknown[0]!r}; expected some of {', '.join(sorted(names))}")
        cfg = self.cfg = dataclasses.replace(config or ConvNetConfig(), **kwargs)
        widths = _widths(cfg.widths)
        for name in ("classes", "in_channels", "depth", "block_size"):
            v = getattr(cfg, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model.{name}: expected a positive int, got {v!r}")
        if not 0 < cfg.density <= 1:
            raise ValueError(f"model.density: expected a fraction in (0, 1], got {cfg.density}")
        if cfg.layout not in ("balanced", "grouped"):
            raise ValueError(f"model.layout: expected 'balanced' or 'grouped', got {cfg.layout!r}")
        sparse = cfg.density < 1
        groups = round(1 / cfg.density) if sparse and cfg.layout == "grouped" else 1
        if sparse and cfg.layout == "grouped" and (groups < 2 or abs(groups * cfg.density - 1) > 1e-6):
            raise ValueError(f"model.density: layout=grouped takes 1/groups (0.5, 0.25, 0.125, ...), got {cfg.density}")
        if sparse:
            bad = [w for w in widths if w % cfg.block_size or (w // cfg.block_size) % groups]
            if bad:
                raise ValueError(f"model.widths: expected multiples of block_size={cfg.block_size}"
                                 + (f" x {groups} groups" if groups > 1 else "") + f", got {bad[0]}")
        counter = iter(range(10**6))

        def conv(c_in, c_out, k, stride):
            if not sparse:
                return nn.Conv2d(c_in, c_out, k, stride, padding=k // 2, bias=False)
            nb_in, nb_out = c_in // cfg.block_size, c_out // cfg.block_size
            if groups > 1:
                lay = np.kron(np.eye(groups, dtype=bool), np.ones((nb_in // groups, nb_out // groups), bool))
            else:
                lay = layouts.balanced((nb_in, nb_out), cfg.density, seed=cfg.layout_seed * 1000 + next(counter))
            # padding k // 2 as the dense convs: "same" would pad a stride-2 3x3 asymmetrically and
            # misalign it with the 1x1 shortcut
            return BlockSparseConv2d(c_in, c_out, k, stride, padding=k // 2, bias=False, block_size=cfg.block_size,
                                     layout=lay)

        self.stem = nn.Sequential(nn.Conv2d(cfg.in_channels, widths[0], 3, padding=1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        stages, c = [], widths[0]
        for s, w in enumerate(widths):
            for d in range(cfg.depth):
                stages.append(_Basic(conv, c, w, 2 if s > 0 and d == 0 else 1, groups))
                c = w
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(c, cfg.classes)

    def shard_units(self) -> list[nn.Module]:
        """The blocks FSDP shards one by one (``trainer.strategy=fsdp``): the residual blocks of the stages."""
        return list(self.stages)

    def reset_parameters(self) -> None:
        """Initialises every parameter (and the batch norms' statistics) as the constructor does:
        for a model built on the meta device and then given memory with ``to_empty(device=...)``."""
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:           # channels-last: cuDNN's faster layout and the one the Triton conv kernels take
            x = x.contiguous(memory_format=torch.channels_last)
        h = self.stages(self.stem(x))
        return self.head(h.mean((2, 3)))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
