"""``BlockSparseConv2d``: a 2-D convolution whose (out, in) channel pairs live in blocks.

The layout is a (C/bs, K/bs) 0/1 array over input and output channel blocks, as for
:class:`bstrain.nn.BlockSparseLinear`; each live block (i, j) is a (bs, bs, kh, kw) filter from
input channels i·bs.. to output channels j·bs... It runs the implicit-GEMM Triton kernels of
:mod:`bstrain.kernels.conv` (custom op ``bstrain::bsconv2d``), or the two PyTorch paths of
:func:`bstrain.ops.conv.bsconv2d_ref` (a grouped convolution between a channel gather and a
scatter-add, or one masked dense filter). Its index tables are the layout's shared tables
(:mod:`bstrain.ops.tables`, family ``"conv"``), not module buffers, so ``torch.compile`` traces
it with no graph break and ``to_empty`` has nothing to garble.

A drop-in for ``nn.Conv2d``: the same positional arguments and defaults (padding 0), int or pair
padding, unbatched (C, H, W) inputs, :meth:`~BlockSparseConv2d.to_dense` and
:meth:`~BlockSparseConv2d.from_dense`; :func:`sparsify_conv2d_candidates` and
:meth:`~BlockSparseConv2d.sparsified` are the Conv2d half of :func:`bstrain.nn.sparsify`.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from bstrain import layout as layouts
from bstrain.layout import KERNEL_BLOCK_SIZES
from bstrain.nn._sparse import BlockLayoutModule, bias_arg, layout_of, size_arg, sparsify_candidates
from bstrain.ops.conv import bsconv2d_ref, conv_geometry, dense_conv_filter, sparse_conv2d, tables_on
from bstrain.ops.matmul import compute_dtype
from bstrain.ops.tables import layout_tables

__all__ = ["BlockSparseConv2d", "sparsify_conv2d_candidates"]

_AUTOCAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_HALF = (torch.float16, torch.bfloat16)


def _pair(name: str, v, low: int = 1) -> tuple[int, int]:
    if isinstance(v, int) and not isinstance(v, bool):
        v = (v, v)
    if not isinstance(v, (tuple, list)) or len(v) != 2 or \
            not all(isinstance(a, int) and not isinstance(a, bool) and a >= low for a in v):
        raise ValueError(f"{name}: expected an int >= {low} or a pair of them, got {v!r}")
    return tuple(v)


def _padding(padding) -> str | tuple[int, int]:
    """'same', 'valid' (nn.Conv2d's spellings, any case) or (ph, pw)."""
    if isinstance(padding, str):
        if padding.lower() not in ("same", "valid"):
            raise ValueError(f"padding: expected 'same', 'valid', an int >= 0 or a pair of them, got {padding!r}")
        return padding.lower()
    try:
        return _pair("padding", padding, 0)
    except ValueError:
        raise ValueError(f"padding: expected 'same', 'valid', an int >= 0 or a pair of them, got {padding!r}") from None


class BlockSparseConv2d(BlockLayoutModule):
    """``nn.Conv2d``'s conventions with block-sparse channel connectivity.

    Args:
        in_channels, out_channels: C and K, multiples of block_size.
        kernel_size, stride, dilation: as nn.Conv2d (an int or a pair).
        padding: as nn.Conv2d: an int or a pair (ph, pw) (default 0), "valid", or "same"
            (TensorFlow's rule: output ceil(size / stride), the total padding split with the
            extra element after; at stride 1 that is nn.Conv2d's padding="same", which torch
            refuses for larger strides).
        bias: add a learned (K,) bias.
        block_size: channels per block (the kernels take 16, 32, 64 or 128).
        density: fraction of live blocks of a drawn balanced layout (when ``layout`` is None).
        layout: a (C/bs, K/bs) 0/1 array instead.
        seed: seed of the drawn layout; None follows torch's RNG.
        backend: "auto" | "grouped" | "dense" (cuDNN compositions, :func:`bsconv2d_ref`) |
            "triton" (the implicit-GEMM kernels of bstrain.kernels.conv, custom op
            ``torch.ops.bstrain.bsconv2d``; CUDA, or CPU under TRITON_INTERPRET=1). "auto" takes
            "triton" for CUDA 16-bit channels-last stride-1 inputs with blocks of 64 or more (or
            at most 1/8 live), else "grouped" for block-diagonal layouts on CUDA, else "dense".
        device, dtype: of the parameters (``device="meta"``, or a ``torch.device("meta")``
            context, builds no storage; the layout and its tables are host data all the same).

    Parameters: ``weight`` (nnz, bs, bs, kh, kw), the live blocks in row-major layout order, each
    (out, in, kh, kw) as nn.Conv2d; ``bias`` (K,). The layout is the ``layout`` buffer.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 bias: bool = True, *, block_size: int = 16, density: float | None = None, layout=None,
                 seed: int | None = None, backend: str = "auto", device=None, dtype=None):
        super().__init__()
        bs = block_size
        if isinstance(bs, (bool, np.bool_)) or not isinstance(bs, (int, np.integer)) or bs < 1:
            raise ValueError(f"block_size: expected a positive int, got {bs!r}")
        bs = block_size = int(bs)
        in_channels, out_channels = size_arg("in_channels", in_channels, bs), size_arg("out_channels", out_channels, bs)
        bias = bias_arg(bias, "nn.Conv2d")
        if layout is not None and density is not None:
            raise ValueError("layout, density: expected one of them, got both")
        if layout is None:
            if density is None:
                raise ValueError("layout: expected a layout or a density, got neither")
            layout = layouts.balanced((in_channels // bs, out_channels // bs), density, seed=seed)
        lay = layouts.validate(layout, in_channels, out_channels, bs)
        if backend not in ("auto", "grouped", "dense", "triton"):
            raise ValueError(f"backend: expected 'auto', 'grouped', 'dense' or 'triton', got {backend!r}")
        if backend == "triton" and bs not in KERNEL_BLOCK_SIZES:
            raise ValueError(f"block_size: the Triton kernels take 16, 32, 64 or 128, got {bs}")
        self.in_channels, self.out_channels, self.block_size = in_channels, out_channels, bs
        self.kernel_size = _pair("kernel_size", kernel_size)
        self.stride, self.dilation = _pair("stride", stride), _pair("dilation", dilation)
        self.padding, self.backend = _padding(padding), backend
        self._geometries: dict = {}                 # (H, W) -> (P, Q, pads per dim, (top, left))
        self._use_layout(lay)
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(int(lay.sum()), bs, bs, *self.kernel_size, **factory))
        self.bias = nn.Parameter(torch.empty(out_channels, **factory)) if bias else None
        self._register_layout(lay, device)
        self.reset_parameters()

    # --- the layout (BlockLayoutModule) ---------------------------------------------------------------
    def _op_layout(self) -> np.ndarray:
        return self._layout

    def _use_layout(self, layout: np.ndarray) -> bool:
        lay = np.ascontiguousarray(layout, dtype=bool)
        tables = getattr(self, "_tables", None)
        in_place = tables is not None and tables.private and tables.can_rewrite(lay, self.block_size)
        if in_place:                                   # dynamic sparsity: the same tables, rewritten
            tables.rewrite(lay, self.block_size)
        elif tables is None:
            self._tables = layout_tables("conv", lay, self.block_size)           # CPU tables built now
        else:
            self._tables = tables.like(lay, self.block_size)
        self._layout = lay
        self._density = float(lay.mean())
        host = self._tables.host
        self._diagonal = host.gather is None and host.scatter is None            # blocks in channel order
        return in_place

    def make_private(self) -> None:
        """Gives this layer layout tables that no other layer shares (equal layouts share them by
        default), so that a layout update (:mod:`bstrain.sparsity`) rewrites them in place: CUDA
        graphs and compiled graphs made after this keep running the current layout."""
        if not self._tables.private:
            self._tables = self._tables.like(self._layout, self.block_size, private=True)

    def _layout_tables(self):
        return self._tables

    # nn.Conv2d's attributes that tools (FLOP counters, exporters) read: one group of the dense
    # shape, zero padding
    groups = 1
    padding_mode = "zeros"

    @property
    def density(self) -> float:
        return self._density

    def fan_in(self) -> torch.Tensor:
        """(K,) live inputs of each output channel: bs x live blocks in its column x kh x kw."""
        per_col = self._layout.sum(0) * self.block_size * math.prod(self.kernel_size)
        return torch.as_tensor(np.repeat(per_col, self.block_size), dtype=torch.float32, device="cpu")

    def reset_parameters(self) -> None:
        """nn.Conv2d's default init with each output channel's true fan-in: uniform ±1/sqrt(fan_in),
        for the layout of the ``layout`` buffer."""
        self._sync_layout()
        if self.weight.is_meta:
            return
        bound = 1.0 / self.fan_in().clamp_min(1).sqrt()                      # (K,)
        _, kj = np.nonzero(self._layout)
        bs = self.block_size
        rows = torch.as_tensor(kj)[:, None] * bs + torch.arange(bs, device="cpu")[None, :]   # (nnz, bs) outputs
        with torch.no_grad():
            self.weight.uniform_(-1, 1)
            self.weight.mul_(bound[rows].view(len(kj), bs, 1, 1, 1).to(self.weight))
            if self.bias is not None:
                self.bias.uniform_(-1, 1).mul_(bound.to(self.bias))

    # --- forward ------------------------------------------------------------------------------------
    def _geometry(self, H: int, W: int) -> tuple:
        """(P, Q, ((top, bottom), (left, right)), (top, left)) of an H x W input: computed once
        per input size (not while traced, where sizes may be symbols)."""
        cacheable = type(H) is int and type(W) is int and not torch.compiler.is_compiling()
        hit = self._geometries.get((H, W)) if cacheable else None
        if hit is None:
            p = self.padding
            per_dim = ["SAME", "SAME"] if p == "same" else [0, 0] if p == "valid" else list(p)
            try:
                (P, Q), pads = conv_geometry(self.kernel_size, [H, W], self.stride, self.dilation, per_dim)
            except ValueError:
                raise ValueError(f"x: a {H} x {W} input is smaller than the filter {self.kernel_size} (dilation "
                                 f"{self.dilation}, padding {self.padding!r})") from None
            hit = (P, Q, tuple(pads), (pads[0][0], pads[1][0]))
            if cacheable:
                if len(self._geometries) >= 256:            # ragged sizes past this: start over
                    self._geometries.clear()
                self._geometries[(H, W)] = hit
        return hit

    def _path(self, x: torch.Tensor) -> str:
        """The backend that runs x. "auto" takes the Triton kernels where they beat cuDNN on the
        H200 (benchmarks/conv.md: CUDA, 16-bit, channels-last, stride 1, blocks of 64 or more, or
        at most 1/8 live), else cuDNN's grouped conv where the blocks sit in channel order
        (block-diagonal: no gather or scatter), else the masked dense filter (faster than the
        grouped gather-scatter at every measured point)."""
        if self.backend != "auto":
            return self.backend
        if not x.is_cuda:
            return "dense"
        if (x.dtype in _HALF and self.stride == (1, 1) and self.block_size in KERNEL_BLOCK_SIZES
                and (self.block_size >= 64 or self._density <= 0.125)
                and x.is_contiguous(memory_format=torch.channels_last)):
            return "triton"
        return "grouped" if self._diagonal else "dense"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (N, C, H, W), or unbatched (C, H, W); returns (N, K, P, Q) or (K, P, Q). Under
        autocast, runs in its dtype."""
        self._sync_layout()
        unbatched = x.dim() == 3
        if x.dim() not in (3, 4) or x.shape[-3] != self.in_channels:
            raise ValueError(f"x: expected (N, {self.in_channels}, H, W) or ({self.in_channels}, H, W), got "
                             f"{tuple(x.shape)}")
        if unbatched:
            x = x.unsqueeze(0)
        P, Q, pads, top_left = self._geometry(x.shape[2], x.shape[3])
        w = self.weight
        dev = x.device.type
        if x.dtype in _AUTOCAST_DTYPES and dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
            dt = compute_dtype(x)                      # autocast: run (and pick the path) in its dtype
            x = x if x.dtype == dt else x.to(dt)
        elif x.dtype != w.dtype:
            raise TypeError(f"x: expected {w.dtype} (the weight's dtype), got {x.dtype}; cast the input or the layer "
                            f"(or run under torch.autocast)")
        path = self._path(x)
        if path == "triton":                           # the kernels cast the weight with its permutation
            y = self._kernels(x, w, P, Q, top_left)
        else:
            y = bsconv2d_ref(x, w if w.dtype == x.dtype else w.to(x.dtype), tables_on(self._tables, x.device),
                             self.out_channels, self.stride, pads, self.dilation, grouped=path == "grouped")
            if self.bias is not None:
                y = y + self.bias.to(y.dtype).view(1, -1, 1, 1)
        return y.squeeze(0) if unbatched else y

    def _kernels(self, x, w, P, Q, top_left) -> torch.Tensor:
        if not x.is_cuda and not x.is_meta and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"x: backend='triton' needs a CUDA tensor (or TRITON_INTERPRET=1), got one on {x.device}")
        if x.dtype not in _AUTOCAST_DTYPES:
            raise TypeError(f"x: backend='triton' takes float16, bfloat16 or float32, got {x.dtype}")
        return sparse_conv2d(x, w, self.bias, self._tables, self.out_channels, P, Q, self.stride, top_left,
                             self.dilation)

    # --- dense conversion ----------------------------------------------------------------------------
    def dense_weight(self) -> torch.Tensor:
        """The (K, C, kh, kw) dense weight, as nn.Conv2d holds it; zeros off the live blocks.
        Differentiable."""
        self._sync_layout()
        return dense_conv_filter(self.weight, tables_on(self._tables, self.weight.device), self.out_channels,
                                 self.in_channels)

    def to_dense(self) -> nn.Conv2d:
        """An nn.Conv2d computing the same function, on this layer's device and dtype."""
        if self.padding == "same" and self.stride != (1, 1):
            raise ValueError(f"to_dense: padding='same' at stride {self.stride} follows TensorFlow's rule (the "
                             f"padding depends on the input size, the extra element after), which nn.Conv2d "
                             f"cannot express; build the layer with explicit padding")
        return self._filled(nn.Conv2d(self.in_channels, self.out_channels, self.kernel_size, self.stride,
                                      self.padding, self.dilation, bias=self.bias is not None,
                                      device=self.weight.device, dtype=self.weight.dtype))

    @classmethod
    def from_dense(cls, conv: nn.Conv2d, *, block_size: int = 16, density: float | None = None, layout=None,
                   backend: str = "auto") -> "BlockSparseConv2d":
        """A block-sparse copy of ``conv``: its weights on the live blocks, its bias and geometry.

        The live blocks are ``layout``, or, with ``density``, the round(density·blocks) blocks of
        largest L2 norm in the dense weight (magnitude pruning at block granularity).
        """
        _check_convertible("conv", conv, block_size)
        C, K, bs = conv.in_channels, conv.out_channels, block_size
        norms = None
        if layout is None:
            w = conv.weight.detach().float()
            norms = w.reshape(K // bs, bs, C // bs, bs, -1).square().sum((1, 3, 4)).t()     # (Cb, Kb)
        layout = layout_of(norms, density, layout)
        layer = cls(C, K, conv.kernel_size, conv.stride, conv.padding, conv.dilation, conv.bias is not None,
                    block_size=bs, layout=layout, backend=backend, device=conv.weight.device, dtype=conv.weight.dtype)
        t = tables_on(layer._tables, conv.weight.device)
        with torch.no_grad():
            layer.weight.copy_(conv.weight[t.rows, t.cols].view(layer.weight.shape))
            if conv.bias is not None:
                layer.bias.copy_(conv.bias)
        return layer

    @classmethod
    def sparsified(cls, conv: nn.Conv2d, *, block_size: int, density: float,
                   keep_weights: bool = True) -> "BlockSparseConv2d":
        """The layer :func:`bstrain.nn.sparsify` puts in place of ``conv``: :meth:`from_dense`
        (the largest-norm blocks and the bias) with ``keep_weights``, else a fresh balanced layout
        of that density, initialised, with conv's geometry, device and dtype."""
        if keep_weights:
            return cls.from_dense(conv, block_size=block_size, density=density)
        _check_convertible("conv", conv, block_size)
        return cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
                   conv.bias is not None, block_size=block_size, density=density, device=conv.weight.device,
                   dtype=conv.weight.dtype)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding!r}, dilation={self.dilation}, block_size={self.block_size}, "
                f"density={self._density:.3f}, bias={self.bias is not None}, backend={self.backend!r}")


def _check_convertible(name: str, conv: nn.Conv2d, block_size: int) -> None:
    """A ValueError naming ``name`` when ``conv`` has no BlockSparseConv2d equivalent."""
    if not isinstance(conv, nn.Conv2d):
        raise TypeError(f"{name}: expected an nn.Conv2d, got {type(conv).__name__}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    if conv.in_channels % block_size or conv.out_channels % block_size:
        raise ValueError(f"{name}: expected in/out channels that are multiples of block_size={block_size}, got "
                         f"{conv.in_channels} and {conv.out_channels}")
    if conv.groups != 1:
        raise ValueError(f"{name}: expected groups=1 (a grouped conv is a block-diagonal layout: build a "
                         f"BlockSparseConv2d with layout=...), got groups={conv.groups}")
    if conv.padding_mode != "zeros":
        raise ValueError(f"{name}: expected padding_mode='zeros', got {conv.padding_mode!r}")


def sparsify_conv2d_candidates(model: nn.Module, include: str | Callable[[str, nn.Module], bool],
                               block_size: int) -> list[tuple[str, nn.Conv2d]]:
    """(name, layer) of every ``nn.Conv2d`` of ``model`` (exactly that type) chosen by ``include``
    (a glob on qualified names, or ``(name, conv) -> bool``), checked: a chosen layer that cannot
    become a BlockSparseConv2d (channels not multiples of block_size, groups, padding mode, a
    parameter tied to another module's) is a ValueError naming it, raised before the caller
    replaces anything. As in :func:`bstrain.nn.sparsify`, a layer registered under several names
    is chosen when any of them is, and is listed under each: build one
    ``BlockSparseConv2d.sparsified(conv, block_size=..., density=..., keep_weights=...)`` per
    layer object and put it under each of its names, so that the registrations stay one module."""
    chosen, problems = sparsify_candidates(model, include, block_size, {nn.Conv2d: _check_convertible})
    if problems:
        raise ValueError(problems[0][2])
    return chosen
