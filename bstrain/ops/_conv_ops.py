"""Block-sparse convolution below the seed's API: the geometry, the layout tables, the reference,
and the kernel pair from which :func:`~bstrain.ops._dispatch.kernel_op` makes the
``torch.ops.bstrain.bsconv2d`` custom ops over the Triton kernels and their eager autograd path
(in that order in this file). :class:`bstrain.nn.BlockSparseConv2d` runs them; the names are
re-exported by :mod:`bstrain.ops.conv`, beside the seed's ``BlocksparseConv``.

**Layouts and tables.** :class:`bstrain.nn.BlockSparseConv2d` connects channel blocks by a
(C/bs, K/bs) bool layout. Its tables come from :mod:`bstrain.ops.tables` (family ``"conv"``,
spec ``(layout, block_size)``): per device, the kernels' lists (:class:`ConvLuts`, with their
launch plans) and the PyTorch paths' index tensors (:class:`ConvTables`). The custom ops name
the layout by the tables' key, resolved with :func:`bstrain.ops.tables.lookup` when they run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from bstrain.ops._dispatch import kernel_op
from bstrain.ops.tables import LayoutTables, eager, family, lookup, real_tensors, tracing

__all__ = ["conv_geometry", "conv_nd", "ConvTables", "conv_tables", "block_tables", "tables_on", "bsconv2d_ref",
           "dense_conv_filter", "bsconv2d", "bsconv2d_bwd", "sparse_conv2d"]


# --- geometry -------------------------------------------------------------------------------------
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def conv_geometry(TRS, DHW, strides, dilates, padding) -> tuple[list[int], list[tuple[int, int]]]:
    """(output size per dim, (pad before, pad after) per dim) of a convolution of DHW."""
    out, pads = [], []
    for s, w, st, dl, p in zip(TRS, DHW, strides, dilates, padding):
        eff = (s - 1) * dl + 1
        if p == "SAME":
            q = -(-w // st)
            total = max((q - 1) * st + eff - w, 0)
            pads.append((total // 2, total - total // 2))
        else:
            pads.append((p, p))
        q = (w + sum(pads[-1]) - eff) // st + 1
        if q < 1:
            raise ValueError(f"DHW: the filter ({s}, dilation {dl}) does not fit an input of {w} with padding "
                             f"{pads[-1]}")
        out.append(q)
    return out, pads


def conv_nd(x: Tensor, w: Tensor, strides, dilates, pads, groups: int = 1) -> Tensor:
    """F.conv1d/2d/3d with (before, after) padding per dim (asymmetric pads go through F.pad)."""
    n = x.dim() - 2
    if all(a == b for a, b in pads):
        return _CONV[n](x, w, None, list(strides), [a for a, _ in pads], list(dilates), groups)
    flat = [p for pair in reversed(pads) for p in pair]                      # F.pad: last dim first
    return _CONV[n](F.pad(x, flat), w, None, list(strides), 0, list(dilates), groups)


# --- layout tables ----------------------------------------------------------------------------------
def _index(a: np.ndarray, device) -> Tensor:
    t = torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int64, device=device)
    torch._dynamo.mark_static(t)          # a fixed size: torch.compile(dynamic=True) must not make it a symbol
    return t


@dataclass(eq=False)
class ConvTables:
    """A (C/bs, K/bs) layout's tables on one device (family ``"conv"``)."""
    block_size: int
    layout: np.ndarray
    device: torch.device
    gather: Tensor | None     # (nnz·bs,) input channel of each grouped-conv input; None: the channels in order
    scatter: Tensor | None    # (nnz·bs,) output channel of each grouped-conv output; None: in order
    rows: Tensor              # (nnz·bs·bs,) dense filter row (output channel) of each weight element
    cols: Tensor              # (nnz·bs·bs,) its column (input channel)
    _luts: object = field(default=None, repr=False)

    @property
    def luts(self):
        """The kernels' lists and launch plans (:class:`bstrain.kernels.conv.ConvLuts`): made with
        the tables on CUDA, on the CPU only when the interpreter runs the kernels (so the PyTorch
        paths need no triton)."""
        if self._luts is None:
            from bstrain.kernels.conv import make_luts
            with real_tensors(self.device):
                self._luts = make_luts(self.layout, self.block_size, self.device)
        return self._luts

    def check_rewrite(self, layout: np.ndarray, block_size: int) -> None:
        """A ValueError if :meth:`rewrite` cannot switch these tables to ``layout`` in place:
        another shape, block size or live-block count, or a channel gather (scatter) that these
        tables skip (blocks in channel order) and the new layout needs."""
        new = np.asarray(layout, dtype=bool)
        if block_size != self.block_size or new.shape != self.layout.shape or int(new.sum()) != int(self.layout.sum()):
            raise ValueError(f"layout: an in-place switch needs a {self.layout.shape} layout with "
                             f"{int(self.layout.sum())} live blocks, got {new.shape} with {int(new.sum())}")
        cin, kout, _, _ = _channel_maps(new, block_size)
        if (self.gather is None and not _in_order(cin, new.shape[0] * block_size)) or \
                (self.scatter is None and not _in_order(kout, new.shape[1] * block_size)):
            raise ValueError("layout: tables of blocks in channel order (no gather or scatter) cannot take a layout "
                             "that needs one in place")

    def rewrite(self, layout: np.ndarray, block_size: int) -> None:
        """These tables, in place, for ``layout`` (:meth:`check_rewrite`): every tensor keeps its
        length, so plans, CUDA graphs and compiled graphs made before run the new layout."""
        self.check_rewrite(layout, block_size)
        new = np.asarray(layout, dtype=bool)
        cin, kout, rows, cols = _channel_maps(new, block_size)
        for mine, theirs in ((self.gather, cin), (self.scatter, kout), (self.rows, rows), (self.cols, cols)):
            if mine is not None:
                mine.copy_(torch.as_tensor(theirs, dtype=mine.dtype))
        if self._luts is not None:
            self._luts.rewrite(new)
        self.layout = new


def _in_order(idx: np.ndarray, n: int) -> bool:
    return np.array_equal(idx, np.arange(n))


def _channel_maps(layout: np.ndarray, bs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(input channel of each grouped input, output channel of each grouped output, dense filter
    row and column of each weight element) of a layout's live blocks in row-major order."""
    ci, kj = np.nonzero(layout)
    chan = np.arange(bs)
    cin = (ci[:, None] * bs + chan).ravel()                         # (nnz·bs,) grouped input channels
    kout = (kj[:, None] * bs + chan).ravel()                        # (nnz·bs,) grouped output channels
    rows = np.repeat(kout.reshape(-1, bs), bs, axis=1).ravel()      # weight[e, o, i] -> (kout[e, o],
    cols = np.tile(cin.reshape(-1, bs), (1, bs)).ravel()            #                    cin[e, i])
    return cin, kout, rows, cols


@family("conv")
def conv_tables(layout: np.ndarray, block_size: int, *, device) -> ConvTables:
    """The tables of a validated (C/bs, K/bs) bool layout; live blocks numbered row-major."""
    bs = block_size
    cin, kout, rows, cols = _channel_maps(layout, bs)
    tables = ConvTables(bs, layout, torch.device(device),
                        None if _in_order(cin, layout.shape[0] * bs) else _index(cin, device),
                        None if _in_order(kout, layout.shape[1] * bs) else _index(kout, device),
                        _index(rows, device), _index(cols, device))
    if tables.device.type == "cuda" and not tracing():
        tables.luts                                                 # the kernels' tables, made now
    return tables


@dataclass(eq=False)
class BlockTables:
    """The index tensors of the seed's blocks on one device (family ``"conv_blocks"``)."""
    rows: Tensor              # dense filter (row, col) of every filter element, block by block
    cols: Tensor
    gather: Tensor | None     # the blocks' input channels in order; None: 0..C-1
    scatter: Tensor | None    # their output channels; None: 0..K-1
    edge: Tensor | None       # (prod MPQ,) edge pattern of each output position (-1: none)


@family("conv_blocks")
def block_tables(c_flat: np.ndarray, k_flat: np.ndarray, sizes: np.ndarray, transposed: bool,
                 edge_map: np.ndarray | None, *, device) -> BlockTables:
    """c_flat, k_flat: every block's channel lists, concatenated; sizes: (blocks, 2) their lengths."""
    cs = np.split(c_flat, np.cumsum(sizes[:, 0])[:-1])
    ks = np.split(k_flat, np.cumsum(sizes[:, 1])[:-1])
    rows, cols = [], []
    for c, k in zip(cs, ks):
        a, b = (c, k) if transposed else (k, c)
        rows.append(np.repeat(a, len(b)))
        cols.append(np.tile(b, len(a)))
    C, K = int(c_flat.max()) + 1, int(k_flat.max()) + 1
    return BlockTables(_index(np.concatenate(rows), device), _index(np.concatenate(cols), device),
                       None if np.array_equal(c_flat, np.arange(C)) else _index(c_flat, device),
                       None if np.array_equal(k_flat, np.arange(K)) else _index(k_flat, device),
                       None if edge_map is None else _index(edge_map, device))


_BUILD = {"conv": conv_tables, "conv_blocks": block_tables}


def tables_on(tables: LayoutTables, device: torch.device):
    """``tables.on(device)``; on the meta device (shape-only runs) an uncached meta copy."""
    if device.type == "meta":
        return _BUILD[tables.family](*tables.spec, device=device)
    return tables.on(device)


# --- reference: the PyTorch paths --------------------------------------------------------------------
def dense_conv_filter(weight: Tensor, tables: ConvTables, K: int, C: int) -> Tensor:
    """The (K, C, kh, kw) dense filter of weight (nnz, bs, bs, kh, kw), zeros off the live blocks.
    Differentiable."""
    dense = weight.new_zeros(K, C, *weight.shape[3:])
    return dense.index_put((tables.rows, tables.cols), weight.flatten(0, 2))


def bsconv2d_ref(x: Tensor, weight: Tensor, tables: ConvTables, K: int, stride, pads, dilation,
                 grouped: bool = False) -> Tensor:
    """The block-sparse convolution in PyTorch: the CPU path and the kernels' oracle.

    Args:
        x: (N, C, H, W); weight: (nnz, bs_out, bs_in, kh, kw) live blocks in row-major order.
        pads: ((top, bottom), (left, right)).
        grouped: one grouped convolution between a channel gather and a scatter-add (cuDNN's
            fastest form for block-diagonal layouts, which need neither); else the masked dense
            filter.
    Returns (N, K, P, Q).
    """
    if not grouped:
        return conv_nd(x, dense_conv_filter(weight, tables, K, x.shape[1]), stride, dilation, pads)
    xg = x if tables.gather is None else x.index_select(1, tables.gather)       # (N, nnz·bs, H, W)
    y = conv_nd(xg, weight.flatten(0, 1), stride, dilation, pads, groups=weight.shape[0])
    if tables.scatter is None:
        return y
    return y.new_zeros(y.shape[0], K, y.shape[2], y.shape[3]).index_add(1, tables.scatter, y)


# --- kernel pair: torch.ops.bstrain.bsconv2d and bsconv2d_bwd, and their eager Function -----------------
# Traced calls (torch.compile, export) go through the custom ops, which name the layout by its
# tables' key; eager calls run the same launchers through the autograd.Function kernel_op makes
# (sparse_conv2d below): the dispatcher's boxed calls into Python cost about 0.4 ms per op on the
# H200, more than the kernels of a ResNet layer. No CPU reference: the ops run the kernels there
# too (TRITON_INTERPRET=1).
def _wt(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """(nnz, out, in, kh, kw) -> the kernels' (nnz, kh, kw, in, out) in ``dtype``, contiguous: one
    copy kernel, which also casts fp32 master weights to a 16-bit compute dtype (autocast)."""
    w = weight.permute(0, 3, 4, 2, 1)
    return w.contiguous() if weight.dtype == dtype else w.to(dtype, memory_format=torch.contiguous_format)


def _forward(x, wt, bias, tables: ConvTables, K, P, Q, stride, pads, dilation) -> Tensor:
    from bstrain.kernels.conv import conv_forward
    return conv_forward(x, wt, tables.luts, K, P, Q, stride, pads, dilation, bias)


def _backward(dy, x, wt, tables: ConvTables, stride, pads, dilation, need_dx, need_dw, w_dtype):
    """(dx or None, dweight or None); wt: the kernels' filters (nnz, kh, kw, in, out)."""
    from bstrain.kernels.conv import conv_dw, conv_dx
    if dy.stride(1) != 1 and x.stride(1) == 1 and dy.dim() == 4:      # channels-last x: gather dy's channels
        dy = dy.contiguous(memory_format=torch.channels_last)         # from contiguous rows, not strided ones
    N, C, H, W = x.shape
    dx = conv_dx(dy, wt, tables.luts, C, H, W, stride, pads, dilation, x) if need_dx else None
    dw = conv_dw(x, dy, tables.luts, wt.shape[1], wt.shape[2], stride, pads, dilation, w_dtype) if need_dw else None
    return dx, dw


def _op_forward(x: Tensor, weight: Tensor, bias: Tensor | None, layout: str, K: int, P: int, Q: int,
                stride: list[int], pads: list[int], dilation: list[int], *, tables=None, wt=None) -> Tensor:
    """y (N, K, P, Q) of the block-sparse 2-D convolution of x (N, C, H, W) by weight (nnz, bs, bs,
    kh, kw; x's dtype, or float32 master weights) on the layout whose tables' key is ``layout``,
    plus bias (K,); pads = (top, left). The Triton kernels: CUDA, or CPU with TRITON_INTERPRET=1.
    Eager calls hand over the layout's ``tables`` and the kernels' filters ``wt`` (``_wt``), which
    their backward reuses: no key lookup, and the filters permuted once per step."""
    tables = lookup(layout).on(x.device) if tables is None else tables
    return _forward(x, _wt(weight, x.dtype) if wt is None else wt, bias, tables, K, P, Q, stride, pads, dilation)


def _op_backward(dy: Tensor, x: Tensor, weight: Tensor, layout: str, stride: list[int], pads: list[int],
                 dilation: list[int], need_dx: bool, need_dw: bool, *, tables=None,
                 w_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """(dx, dweight) of bsconv2d, dweight in weight's dtype; an unneeded one is an empty tensor.
    Eager calls hand over the forward's filters ``wt`` as ``weight``, the weight's dtype as
    ``w_dtype`` and the layout's ``tables``; an unneeded gradient then comes back None."""
    if w_dtype is not None:
        return _backward(dy, x, weight, tables, stride, pads, dilation, need_dx, need_dw, w_dtype)
    wt = _wt(weight, x.dtype) if need_dx else weight.permute(0, 3, 4, 2, 1)     # dW reads only its (kh, kw)
    dx, dw = _backward(dy, x, wt, lookup(layout).on(x.device), stride, pads, dilation, need_dx, need_dw, weight.dtype)
    return dx if need_dx else x.new_empty(0), dw if need_dw else weight.new_empty(0)


def _like_out(shape, like: Tensor) -> Tensor:
    """An empty (N, C, H, W) in the memory format the kernels' launchers give (x's)."""
    N, C, H, W = shape
    if like.is_contiguous(memory_format=torch.channels_last) and not like.is_contiguous():
        return like.new_empty((N, H, W, C)).permute(0, 3, 1, 2)
    return like.new_empty(shape)


def _bias_grad(dy: Tensor, dtype: torch.dtype) -> Tensor:
    return dy.sum((0, 2, 3), dtype=dtype)                             # (K,)


def _setup(ctx, inputs, output):
    x, weight, bias, layout, _, _, _, stride, pads, dilation = inputs
    wt = ctx.hints.get("wt")                                          # eager calls: the forward's filters
    ctx.save_for_backward(x, weight if wt is None else wt)
    ctx.layout, ctx.stride, ctx.pads, ctx.dilation = layout, stride, pads, dilation
    ctx.w_dtype, ctx.bias_dtype = weight.dtype, None if bias is None else bias.dtype


def _grads(ctx, bwd, dy):
    x, weight = ctx.saved_tensors                                     # (weight: the filters wt, eagerly)
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    dx, dw = bwd(dy, x, weight, ctx.layout, ctx.stride, ctx.pads, ctx.dilation, need_dx, need_dw,
                 tables=ctx.hints.get("tables"), w_dtype=ctx.w_dtype)
    return (dx if need_dx else None, dw if need_dw else None, _bias_grad(dy, ctx.bias_dtype) if need_db else None,
            None, None, None, None, None, None, None)


_bsconv2d_bwd = kernel_op(
    "bstrain::bsconv2d_bwd", _op_backward, ref=None,
    fake=lambda dy, x, weight, layout, stride, pads, dilation, need_dx, need_dw: (
        _like_out(tuple(x.shape), x) if need_dx else x.new_empty(0),
        weight.new_empty(weight.shape) if need_dw else weight.new_empty(0)))
_bsconv2d = kernel_op(
    "bstrain::bsconv2d", _op_forward, ref=None,
    fake=lambda x, weight, bias, layout, K, P, Q, stride, pads, dilation: _like_out((x.shape[0], K, P, Q), x),
    setup=_setup, backward=_grads, bwd=_bsconv2d_bwd)
bsconv2d, bsconv2d_bwd = _bsconv2d.op, _bsconv2d_bwd.op                # (importable, as before)


def sparse_conv2d(x: Tensor, weight: Tensor, bias: Tensor | None, tables: LayoutTables, K: int, P: int, Q: int,
                  stride, pads, dilation) -> Tensor:
    """bsconv2d with autograd: the custom op when traced (or on meta tensors), the lighter
    autograd.Function eagerly, the bare launcher when nothing needs a gradient. weight: in x's
    dtype or float32 (cast with the filters' permutation, and dW returned in float32);
    tables: the layout's ``layout_tables("conv", ...)``."""
    if not eager(x) or x.is_meta:
        return bsconv2d(x, weight, bias, tables.key, K, P, Q, list(stride), list(pads), list(dilation))
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or
                                    (bias is not None and bias.requires_grad)):
        return _bsconv2d(x, weight, bias, tables.key, K, P, Q, stride, pads, dilation, tables=tables.on(x.device),
                         wt=_wt(weight, x.dtype))
    return _forward(x, _wt(weight, x.dtype), bias, tables.on(x.device), K, P, Q, stride, pads, dilation)
