"""``BlockSparseLinear``, and helpers that convert dense models: ``sparsify`` (and ``sparsify_candidates``,
the layers it would replace), ``set_grad_group``."""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import nn

from bstrain import layout as layouts
from bstrain.nn._sparse import BlockLayoutModule, bias_arg, layout_of, size_arg, sparsify_candidates
from bstrain.ops.matmul import BlocksparseMatMul, check_block_size, compute_dtype

__all__ = ["BlockSparseLinear", "SparsifyResult", "block_sparse_layouts", "set_grad_group", "sparsify",
           "sparsify_candidates"]


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
        """An nn.Linear computing the same function on (*, C) inputs, on this layer's device and dtype."""
        return self._filled(nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                                      device=self.weight.device, dtype=self.weight.dtype))

    @classmethod
    def from_dense(cls, linear: nn.Linear, *, block_size: int = 32, density: float | None = None,
                   layout=None, feature_axis: int = 1) -> "BlockSparseLinear":
        """A block-sparse copy of ``linear``: its weights on the live blocks, its bias.

        The live blocks are ``layout``, or, with ``density``, the round(density·blocks) blocks of
        largest L2 norm in the dense weight (magnitude pruning at block granularity).
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear: expected an nn.Linear, got {type(linear).__name__}")
        bs = check_block_size(block_size)
        C, K = linear.in_features, linear.out_features
        norms = None
        if layout is None:
            if C % bs or K % bs:
                raise ValueError(f"linear: expected in/out features that are multiples of block_size={bs}, "
                                 f"got {C} and {K}")
            norms = linear.weight.detach().float().t().reshape(C // bs, bs, K // bs, bs).square().sum((1, 3))
        layout = layout_of(norms, density, layout)
        layer = cls(C, K, linear.bias is not None, block_size=bs, layout=layout, feature_axis=feature_axis,
                    device=linear.weight.device, dtype=linear.weight.dtype)
        layer.requested_density = density
        with torch.no_grad():
            layer.weight.copy_(layer.op.from_dense(linear.weight.t()))
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
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


class SparsifyResult(list):
    """What :func:`sparsify` returns: the list of names it replaced (it compares and prints as that
    list), and ``skipped``, {name: why} of each chosen layer it left dense under ``errors="skip"``
    (every name of the layer; empty otherwise)."""

    def __init__(self, replaced=(), skipped: dict[str, str] | None = None):
        super().__init__(replaced)
        self.skipped = dict(skipped or {})


def _check_linear(name: str, linear: nn.Linear, block_size: int) -> None:
    """A ValueError naming ``name`` when ``linear`` has no BlockSparseLinear equivalent."""
    if linear.in_features % block_size or linear.out_features % block_size:
        raise ValueError(f"{name}: expected in/out features that are multiples of block_size={block_size}, "
                         f"got {linear.in_features} and {linear.out_features}")


def _sparse_layer(dense: nn.Module, block_size: int, density: float, keep_weights: bool, balanced: bool) -> nn.Module:
    """The block-sparse layer :func:`sparsify` puts in place of ``dense`` (an nn.Linear or nn.Conv2d)."""
    from bstrain.nn.conv import BlockSparseConv2d
    if type(dense) is nn.Conv2d:
        return BlockSparseConv2d.sparsified(dense, block_size=block_size, density=density, keep_weights=keep_weights)
    if keep_weights:
        return BlockSparseLinear.from_dense(dense, block_size=block_size, density=density)
    return BlockSparseLinear(dense.in_features, dense.out_features, dense.bias is not None, block_size=block_size,
                             density=density, balanced=balanced, device=dense.weight.device, dtype=dense.weight.dtype)


def sparsify(model: nn.Module, include: str | Callable[[str, nn.Module], bool], *, block_size: int = 32,
             density: float, keep_weights: bool = True, balanced: bool = True,
             errors: str = "raise") -> SparsifyResult:
    """Replaces, in place, the ``nn.Linear`` and ``nn.Conv2d`` layers of ``model`` chosen by ``include``
    with :class:`BlockSparseLinear` and :class:`bstrain.nn.BlockSparseConv2d`.

    Layers are replaced per module object, as ``torch.nn.utils.parametrize`` works: a layer
    registered under several names (``model.dec = model.enc``, twice in an ``nn.ModuleList``,
    under two parents) is chosen when ``include`` chooses any of its names, and one block-sparse
    layer then takes every registration, so the sharing stays. To keep such a layer dense, choose
    none of its names. A layer whose parameter is tied to another module's (``b.weight =
    a.weight``, a head tied to an ``nn.Embedding``) cannot be converted: a copy would untie them.
    Only layers of exactly these types are candidates (subclasses such as
    ``nn.MultiheadAttention``'s ``out_proj``, whose weight their owner reads, are left alone).

    Args:
        include: a glob on qualified module names (``"blocks.*.mlp.*"``, ``"*"``), or a function
            ``(name, layer) -> bool``, asked for each name of a layer.
        density: fraction of live blocks of each new layer.
        keep_weights: True keeps the largest-norm blocks of the dense weights and the biases
            (``from_dense``); False draws a fresh layout and initialises it.
        balanced: for linear layers without keep_weights, draw a balanced layout (the default) or
            an independent one; conv layouts are always balanced.
        errors: what a chosen layer that cannot be converted (features or channels not multiples
            of block_size, a grouped conv, a tied parameter) does: "raise" (the default) raises a
            ValueError naming it before any layer is replaced; "skip" leaves it dense, warns once
            listing the skipped layers and why, and records them in the result's ``skipped``.
    Returns the names replaced, in module order, every name of a layer registered under several
    (a list: a :class:`SparsifyResult`, whose ``skipped`` is {name: why} under ``errors="skip"``).
    """
    from bstrain.nn.conv import _check_convertible
    if errors not in ("raise", "skip"):
        raise ValueError(f"errors: expected 'raise' or 'skip', got {errors!r}")
    if isinstance(block_size, (bool, np.bool_)) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    block_size, density = int(block_size), layouts.check_density(density)
    chosen, problems = sparsify_candidates(model, include, block_size,
                                           {nn.Linear: _check_linear, nn.Conv2d: _check_convertible})
    if nn.Linear in {type(m) for _, m in chosen} | {type(m) for m, _, _ in problems}:
        check_block_size(block_size)                     # the Linear kernels' sizes; conv takes any
    if problems and errors == "raise":
        raise ValueError(problems[0][2])
    new: dict[int, nn.Module] = {}                       # one replacement per layer object
    for _, m in chosen:
        if id(m) not in new:
            new[id(m)] = _sparse_layer(m, block_size, density, keep_weights, balanced)
    for name, m in chosen:                               # built all first: a failed build replaces nothing
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new[id(m)])
    skipped = {name: why for _, names, why in problems for name in names}
    if skipped:
        warnings.warn(f"sparsify left {len(problems)} chosen layer(s) dense (errors='skip'): "
                      + "; ".join(why for *_, why in problems), stacklevel=2)
    return SparsifyResult([name for name, _ in chosen], skipped)
