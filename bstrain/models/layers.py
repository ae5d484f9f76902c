"""nn.Modules that research code composes."""
from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
from torch import nn

from bstrain import layout as layouts
from bstrain.ops.matmul import BlocksparseMatMul, check_block_size, compute_dtype

__all__ = ["BlockSparseLinear"]


class BlockSparseLinear(nn.Module):
    """Linear layer with a block-sparse weight: y = x·W (+ b).

    Args:
        in_features, out_features: C and K, multiples of block_size.
        layout: (C/bs, K/bs) 0/1 array; or None to draw a random layout of ``density``.
        density: fraction of live blocks for the random layout (used only when layout is None).
        block_size: 8, 16, 32, 64 or 128.
        bias: add a learned (K,) bias.
        feature_axis: 1 for (N, C) inputs, 0 for (C, N).
        seed: seed of the random layout.
    """

    def __init__(self, in_features: int, out_features: int, layout=None, density: float | None = None,
                 block_size: int = 32, bias: bool = True, feature_axis: int = 1, seed: int | None = None):
        super().__init__()
        bs = check_block_size(block_size)
        for name, feat in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(feat, int) or feat <= 0 or feat % bs:
                raise ValueError(f"{name}: expected a positive multiple of block_size={bs}, got {feat!r}")
        if layout is None:
            if density is None:
                raise ValueError("layout: expected a layout or a density, got neither")
            layout = layouts.random((in_features // bs, out_features // bs), density, seed=seed)
        lay = layouts.validate(layout, in_features, out_features, bs)
        self.in_features, self.out_features = in_features, out_features
        self.op = BlocksparseMatMul(lay, bs, feature_axis)
        self.weight = nn.Parameter(torch.empty(self.op.w_shape))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.register_buffer("layout", torch.as_tensor(lay), persistent=True)
        self._group = None          # (GradGroup, grouped weight) inside grad_group()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) with fan_in the mean live inputs per output."""
        fan_in = max(1.0, float(np.asarray(self.op.layout).sum(0).mean()) * self.op.block_size)
        bound = 1.0 / math.sqrt(fan_in)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    @contextlib.contextmanager
    def grad_group(self, group_size: int = 8):
        """Within this context, calls share one dW computed for up to group_size calls per launch.

        For weights applied at many timesteps (recurrent weights): wrap the time loop, then call
        backward as usual; W.grad equals the ungrouped result. group_size <= 1 is a no-op when
        gradients are on. Without autograd (evaluation, sampling) there is no dW to group, and the
        context only casts the weight once for all its calls instead of at each call.
        """
        grad = torch.is_grad_enabled()
        if self._group is not None or (grad and group_size <= 1):
            yield None
            return
        group = self.op.grad_group(group_size) if grad else None
        self._group = (group, None)
        try:
            yield group
        finally:
            self._group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (N, C) or (C, N); returns (N, K) or (K, N). Under autocast, runs in its dtype."""
        if self._group is not None:
            group, w = self._group
            if w is None:                              # first call in the context: cast W once
                dtype = compute_dtype(x)
                w = self.weight.to(dtype) if group is None else self.op.group_weight(self.weight, group, dtype)
                self._group = (group, w)
            y = self.op(x, w) if group is None else self.op.grouped(x, w, group)
        else:
            y = self.op(x, self.weight)
        if self.bias is not None:
            b = self.bias.to(y.dtype)
            y = y + (b if self.op.feature_axis == 1 else b[:, None])
        return y

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """A loaded layout replaces the op's, so weights always meet the layout they were trained on."""
        key = prefix + "layout"
        if key in state_dict:
            new = np.asarray(state_dict[key].cpu(), dtype=bool)
            if new.shape != self.op.layout.shape or (new != self.op.layout).any():
                backend = self.op.backend
                self.op = BlocksparseMatMul(new, self.op.block_size, self.op.feature_axis, backend=backend)
                self.layout = torch.as_tensor(new, device=self.layout.device)
                if tuple(self.weight.shape) != self.op.w_shape:
                    self.weight = nn.Parameter(self.weight.new_empty(self.op.w_shape))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block_size={self.op.block_size}, density={self.op.density:.3f}, "
                f"feature_axis={self.op.feature_axis}, bias={self.bias is not None}")
