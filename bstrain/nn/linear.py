"""``BlockSparseLinear``, ``linear_parts`` (the dense linear layers it converts from),
``block_sparse_layouts`` and ``set_grad_group``; ``sparsify`` lives in :mod:`bstrain.nn.convert`."""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from bstrain import layout as layouts
from bstrain._deprecated import moved
from bstrain.nn._sparse import BlockLayoutModule, bias_arg, layout_of, size_arg, sparsify_candidates
from bstrain.ops.matmul import BlocksparseMatMul, check_block_size, compute_dtype

__all__ = ["BlockSparseLinear", "block_sparse_layouts", "linear_parts", "set_grad_group", "sparsify_candidates"]

__getattr__ = moved("bstrain.nn.linear", "bstrain.nn.convert", ("sparsify", "SparsifyResult"))


def linear_parts(layer: nn.Module) -> tuple[int, int, torch.Tensor, torch.Tensor | None]:
    """(C, K, weight as a (C, K) view, bias) of a dense linear layer: an ``nn.Linear`` (its
    (K, C) weight transposed) or Hugging Face's ``Conv1D`` (GPT-2's; y = x·W + b with a (C, K)
    weight, so no transpose), which transformers defines: recognised without importing it."""
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features, layer.weight.t(), layer.bias
    hf = sys.modules.get("transformers.pytorch_utils")
    if hf is not None and isinstance(layer, hf.Conv1D):
        return layer.weight.shape[0], layer.weight.shape[1], layer.weight, layer.bias
    raise TypeError(f"linear: expected an nn.Linear or transformers' Conv1D, got {type(layer).__name__}")


class BlockSparseLinear(BlockLayoutModule):
    """Linear layer with a block-sparse weight: y = x·W + b, with ``nn.Linear``'s conventions.

    Args:
        in_features, out_features: C and K, multiples of block_size.
        bias: add a learned (K,) bias.
        block_size: bs, one of 8, 16, 32, 64, 128.
        density: fraction of live blocks of a drawn layout (when ``layout`` is None).
        layout: a (C/bs, K/bs) 0/1 array (instead of ``density``).
        balanced: draw exactly ``round(density·blocks)`` live blocks spread evenly over output
            columns and input rows (:func:`bstrain.layout.balanced`, the default); False draws
            each block independently (:func:`bstrain.layout.random`).
        feature_axis: 1 for (*, C) inputs (as nn.Linear), 0 for (C, *).
        seed: seed of the drawn layout; None follows torch's RNG (``torch.manual_seed``).
        device, dtype: of the parameters, as for nn.Linear (``device="meta"`` builds no storage).

    Parameters: ``weight`` (nnz, bs, bs), the live blocks in row-major layout order, and
    ``bias`` (K,). The layout is kept as the ``layout`` buffer, so state dicts carry it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, block_size: int = 32,
                 density: float | None = None, layout=None, balanced: bool = True, feature_axis: int = 1,
                 seed: int | None = None, device=None, dtype=None):
        super().__init__()
        bs = check_block_size(block_size)
        in_features, out_features = size_arg("in_features", in_features, bs), size_arg("out_features", out_features, bs)
        bias = bias_arg(bias, "nn.Linear")
        if layout is not None and density is not None:
            raise ValueError("layout, density: expected one of them (a layout or a density to draw one), got both")
        drawn = layout is None
        if drawn:
            if density is None:
                raise ValueError("layout: expected a layout or a density, got neither")
            draw = layouts.balanced if balanced else layouts.random
            layout = draw((in_features // bs, out_features // bs), density, seed=seed)
        lay = layouts.validate(layout, in_features, out_features, bs)
        self.in_features, self.out_features = in_features, out_features
        self.requested_density = density if drawn else None     # shown beside the realised one
        self.op = BlocksparseMatMul(lay, bs, feature_axis)
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(self.op.w_shape, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self._register_layout(lay, device)
        self._group = None          # (GradGroup, grouped weight) inside grad_group()
        self.group_size = 1         # grad_group()'s default: set_grad_group(model, n) sets it
        self.reset_parameters()

    # --- initialisation ---------------------------------------------------------------------------
    def fan_in(self) -> torch.Tensor:
        """(K,) float: live inputs of each output unit (bs × live blocks in its block-column)."""
        per_col = np.asarray(self.op.layout).sum(0) * self.op.block_size      # (Kb,)
        return torch.as_tensor(np.repeat(per_col, self.op.block_size), dtype=torch.float32)

    def reset_parameters(self) -> None:
        """nn.Linear's init with each output unit's true fan-in: weight and bias of output unit k
        uniform in ±1/sqrt(fan_in[k]), for the layout of the ``layout`` buffer.

        ``nn.init`` functions that derive fans from the weight's shape see fan_in = bs² and
        fan_out = nnz·bs for the (nnz, bs, bs) weight: kaiming_*/xavier_* give wrong scales, and
        orthogonal_ mixes blocks. Use this method, ``op.ortho_init()`` or ``op.identity_init()``.
        """
        self._sync_layout()
        with torch.no_grad():
            bound = self.fan_in().clamp_min(1).rsqrt().to(self.weight.device, self.weight.dtype)   # (K,)
            k_idx = self.op.coords[1].to(self.weight.device)
            block_bound = bound.view(-1, self.op.block_size)[k_idx]                # (nnz, bs) per column
            self.weight.uniform_(-1.0, 1.0).mul_(block_bound[:, None, :])
            if self.bias is not None:
                self.bias.uniform_(-1.0, 1.0).mul_(bound)

    # --- forward ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def grad_group(self, group_size: int | None = None):
        """Within this context, calls share one dW computed for up to group_size calls per launch.

        group_size None: this layer's ``group_size`` attribute (1 unless :func:`set_grad_group`
        set it), so a model wraps its time loop in ``grad_group()`` and the trainer picks the size.

        For weights applied at many timesteps (recurrent weights): wrap the time loop, then call
        backward as usual; W.grad equals the ungrouped result. group_size <= 1 is a no-op when
        gradients are on. Without autograd (evaluation, sampling) there is no dW to group, and the
        context only casts the weight once for all its calls instead of at each call. Under
        torch.compile the context does nothing: autograd's graph computes each call's dW.
        """
        grad = torch.is_grad_enabled()
        group_size = self.group_size if group_size is None else group_size
        if self._group is not None or (grad and group_size <= 1) or torch.compiler.is_compiling():
            yield None
            return
        group = self.op.grad_group(group_size) if grad else None
        self._group = (group, None)
        try:
            yield group
        finally:
            self._group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (*, C) (or (C, *) with feature_axis=0); returns (*, K) (or (K, *)). Under autocast,
        runs in its dtype."""
        self._sync_layout()
        w_dt = self.weight.dtype
        if x.dtype != w_dt and not (w_dt == torch.float32 and x.dtype in (torch.float16, torch.bfloat16)) \
                and compute_dtype(x) == x.dtype:
            raise TypeError(f"x: expected {w_dt} (the weight's dtype; float16 or bfloat16 with float32 weights), "
                            f"got {x.dtype}; cast the input or the layer (or run under torch.autocast)")
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
            y = y + (b if self.op.feature_axis == 1 else b.view(-1, *([1] * (y.dim() - 1))))
        return y

    # --- dense conversion -------------------------------------------------------------------------
    def dense_weight(self) -> torch.Tensor:
        """The (out_features, in_features) dense weight, as nn.Linear holds it. Differentiable."""
        self._sync_layout()
        return self.op.to_dense(self.weight).t()

    def to_dense(self) -> nn.Linear:
        """An nn.Linear computing the same function on (*, C) inputs, on this layer's device and dtype
        (also for a layer made from a Hugging Face ``Conv1D``: its weight is the Conv1D's transposed)."""
        return self._filled(nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                                      device=self.weight.device, dtype=self.weight.dtype))

    @classmethod
    def from_dense(cls, linear: nn.Module, *, block_size: int = 32, density: float | None = None,
                   layout=None, feature_axis: int = 1) -> "BlockSparseLinear":
        """A block-sparse copy of ``linear`` (an ``nn.Linear``, or Hugging Face's ``Conv1D``, whose
        transposed weight is read as it is stored): its weights on the live blocks, its bias.

        The live blocks are ``layout``, or, with ``density``, the round(density·blocks) blocks of
        largest L2 norm in the dense weight (magnitude pruning at block granularity).
        """
        C, K, weight, bias = linear_parts(linear)                 # weight: (C, K)
        bs = check_block_size(block_size)
        norms = None
        if layout is None:
            if C % bs or K % bs:
                raise ValueError(f"linear: expected in/out features that are multiples of block_size={bs}, "
                                 f"got {C} and {K}")
            norms = weight.detach().float().reshape(C // bs, bs, K // bs, bs).square().sum((1, 3))
        layout = layout_of(norms, density, layout)
        layer = cls(C, K, bias is not None, block_size=bs, layout=layout, feature_axis=feature_axis,
                    device=weight.device, dtype=weight.dtype)
        layer.requested_density = density
        with torch.no_grad():
            layer.weight.copy_(layer.op.from_dense(weight))
            if bias is not None:
                layer.bias.copy_(bias)
        return layer

    # --- layout (bstrain.nn._sparse.BlockLayoutModule: state dicts, .to()) ------------------------------
    def _op_layout(self) -> np.ndarray:
        return self.op.layout

    def _use_layout(self, layout: np.ndarray) -> bool:
        self.requested_density = None
        if int(np.sum(layout)) == self.op.blocks:        # in place where the op's tables allow (dynamic sparsity)
            return self.op.set_layout(layout)
        self.op = BlocksparseMatMul(layout, self.op.block_size, self.op.feature_axis, backend=self.op.backend)
        return False

    def _layout_tables(self):
        return self.op._tables

    def extra_repr(self) -> str:
        density = (f"density={self.op.density:.3f}" if self.requested_density is None else
                   f"density={self.requested_density:g} (realised {self.op.density:.3f})")
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"block_size={self.op.block_size}, {density}, blocks={self.op.blocks}, "
                f"feature_axis={self.op.feature_axis}")


def block_sparse_layouts(module: nn.Module) -> Iterator[tuple[str, np.ndarray]]:
    """(qualified name, (C/bs, K/bs) bool layout) of every BlockSparseLinear in ``module``, and of
    every module with a ``block_layout()`` method (BlockSparseConv2d)."""
    for name, sub in module.named_modules():
        if callable(getattr(sub, "block_layout", None)):
            yield name, sub.block_layout()


def set_grad_group(module: nn.Module, group_size: int) -> int:
    """Sets the gradient-grouping size of every BlockSparseLinear in ``module``; returns how many.

    A layer's ``grad_group()`` context (which a recurrent model wraps around its time loop) then
    computes dW for up to ``group_size`` calls per launch; 1 turns grouping off. The trainer calls
    this once with ``trainer.group_size``; a layer applied once per forward is unaffected.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size: expected an int >= 1, got {group_size!r}")
    layers = [m for m in module.modules() if isinstance(m, BlockSparseLinear)]
    for layer in layers:
        layer.group_size = group_size
    return len(layers)
