"""Block-sparse convolution: the reference, the ``torch.ops.bstrain.bsconv2d`` custom ops over the
Triton kernels, their eager autograd path, and the seed's ``BlocksparseConv`` /
``BlocksparseDeconv`` and ``cwise_linear`` on torch tensors (in that order in this file).

**Layouts and tables.** :class:`bstrain.nn.BlockSparseConv2d` connects channel blocks by a
(C/bs, K/bs) bool layout. Its tables come from :mod:`bstrain.ops.tables` (family ``"conv"``,
spec ``(layout, block_size)``): per device, the kernels' lists (:class:`ConvLuts`, with their
launch plans) and the PyTorch paths' index tensors (:class:`ConvTables`). The custom ops name
the layout by the tables' key, resolved with :func:`bstrain.ops.tables.lookup` when they run.

**The seed's blocks.** ``BCK`` is a sequence of blocks, each a pair (input-channel indices,
output-channel indices). Block i connects its input channels to its output channels through a
filter of shape ``f_shape(block=i) = (len(k_i), len(c_i), *TRS)`` (deconv: ``(len(c_i), len(k_i),
*TRS)``, the layout of ``conv_transpose``). Blocks may differ in size and overlap; overlapping
contributions add. C and K are one more than the largest input and output index. Their index
tensors are tables too (family ``"conv_blocks"``).

**Geometry.** TRS, DHW and MPQ take 1-3 dims (the activations' spatial dims, N and C first, as in
the seed). Padding is ``"SAME"`` (TensorFlow's rule: output ceil(size / stride), the total
padding split with the extra element after, so even filters and strides pad asymmetrically),
``"VALID"``, or explicit per-dim ints (symmetric).

**How the seed ops run** (all of it PyTorch, so autograd, ``torch.compile`` and cuDNN apply):

* ``"grouped"`` (blocks of one size): gather the input channels of every block, one grouped
  convolution (``groups`` = blocks), then add each block's output into its channels. When the
  blocks' input lists are the channels in order, nothing is gathered; when the output lists are
  too, nothing is scattered.
* ``"dense"``: scatter the blocks into one dense filter (overlaps add) and run one convolution:
  the reference, and the fastest choice when the blocks cover much of the dense filter.

``backend="auto"`` takes "grouped" on CUDA when the blocks have one size and sit in channel
order (a block-diagonal layout: one grouped convolution, no gather or scatter), else "dense":
with a gather and a scatter-add, the grouped form was slower than the dense filter at every
point measured on the H200 (benchmarks/conv.md).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from bstrain.ops.tables import LayoutTables, eager, family, layout_tables, lookup, real_tensors, tracing

__all__ = ["BlocksparseConv", "BlocksparseDeconv", "cwise_linear", "conv_geometry", "conv_nd", "ConvTables",
           "bsconv2d_ref", "dense_conv_filter", "sparse_conv2d", "tables_on"]

# --- geometry -------------------------------------------------------------------------------------
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


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


# --- torch.ops.bstrain.bsconv2d: the Triton kernels as custom ops ------------------------------------
# Traced calls (torch.compile, export) go through the custom ops, which name the layout by its
# tables' key; eager calls run the same launchers through an autograd.Function (sparse_conv2d
# below): the dispatcher's boxed calls into Python cost about 0.4 ms per op on the H200, more
# than the kernels of a ResNet layer.
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


@torch.library.custom_op("bstrain::bsconv2d", mutates_args=())
def bsconv2d(x: Tensor, weight: Tensor, bias: Tensor | None, layout: str, K: int, P: int, Q: int,
             stride: list[int], pads: list[int], dilation: list[int]) -> Tensor:
    """y (N, K, P, Q) of the block-sparse 2-D convolution of x (N, C, H, W) by weight (nnz, bs, bs,
    kh, kw; x's dtype, or float32 master weights) on the layout whose tables' key is ``layout``,
    plus bias (K,); pads = (top, left). The Triton kernels: CUDA, or CPU with TRITON_INTERPRET=1."""
    return _forward(x, _wt(weight, x.dtype), bias, lookup(layout).on(x.device), K, P, Q, stride, pads, dilation)


def _like_out(shape, like: Tensor) -> Tensor:
    """An empty (N, C, H, W) in the memory format the kernels' launchers give (x's)."""
    N, C, H, W = shape
    if like.is_contiguous(memory_format=torch.channels_last) and not like.is_contiguous():
        return like.new_empty((N, H, W, C)).permute(0, 3, 1, 2)
    return like.new_empty(shape)


@bsconv2d.register_fake
def _(x, weight, bias, layout, K, P, Q, stride, pads, dilation):
    return _like_out((x.shape[0], K, P, Q), x)


@torch.library.custom_op("bstrain::bsconv2d_bwd", mutates_args=())
def bsconv2d_bwd(dy: Tensor, x: Tensor, weight: Tensor, layout: str, stride: list[int], pads: list[int],
                 dilation: list[int], need_dx: bool, need_dw: bool) -> tuple[Tensor, Tensor]:
    """(dx, dweight) of bsconv2d, dweight in weight's dtype; an unneeded one is an empty tensor."""
    wt = _wt(weight, x.dtype) if need_dx else weight.permute(0, 3, 4, 2, 1)     # dW reads only its (kh, kw)
    dx, dw = _backward(dy, x, wt, lookup(layout).on(x.device), stride, pads, dilation, need_dx, need_dw, weight.dtype)
    return dx if need_dx else x.new_empty(0), dw if need_dw else weight.new_empty(0)


@bsconv2d_bwd.register_fake
def _(dy, x, weight, layout, stride, pads, dilation, need_dx, need_dw):
    return (_like_out(tuple(x.shape), x) if need_dx else x.new_empty(0),
            weight.new_empty(weight.shape) if need_dw else weight.new_empty(0))


def _bias_grad(dy: Tensor, dtype: torch.dtype) -> Tensor:
    return dy.sum((0, 2, 3), dtype=dtype)                             # (K,)


def _bsconv2d_setup(ctx, inputs, output):
    x, weight, bias, layout, _, _, _, stride, pads, dilation = inputs
    ctx.save_for_backward(x, weight)
    ctx.layout, ctx.stride, ctx.pads, ctx.dilation = layout, stride, pads, dilation
    ctx.bias_dtype = None if bias is None else bias.dtype


def _bsconv2d_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    dx, dw = bsconv2d_bwd(dy, x, weight, ctx.layout, ctx.stride, ctx.pads, ctx.dilation, need_dx, need_dw)
    return (dx if need_dx else None, dw if need_dw else None, _bias_grad(dy, ctx.bias_dtype) if need_db else None,
            None, None, None, None, None, None, None)


bsconv2d.register_autograd(_bsconv2d_backward, setup_context=_bsconv2d_setup)


# --- eager autograd -----------------------------------------------------------------------------------
class _SparseConv2dFn(torch.autograd.Function):
    """bsconv2d and its backward for eager calls: no dispatcher round trip, no key lookup, and
    the filters permuted once per step (dX reuses the forward's)."""

    @staticmethod
    def forward(ctx, x, weight, bias, tables, K, P, Q, stride, pads, dilation):
        wt = _wt(weight, x.dtype)                         # (nnz, kh, kw, in, out)
        ctx.save_for_backward(x, wt)
        ctx.tables, ctx.stride, ctx.pads, ctx.dilation = tables, stride, pads, dilation
        ctx.w_dtype, ctx.bias_dtype = weight.dtype, None if bias is None else bias.dtype
        return _forward(x, wt, bias, tables, K, P, Q, stride, pads, dilation)

    @staticmethod
    def backward(ctx, dy):
        x, wt = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx, dw = _backward(dy, x, wt, ctx.tables, ctx.stride, ctx.pads, ctx.dilation, need_dx, need_dw, ctx.w_dtype)
        db = _bias_grad(dy, ctx.bias_dtype) if need_db else None
        return dx, dw, db, None, None, None, None, None, None, None


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
        return _SparseConv2dFn.apply(x, weight, bias, tables.on(x.device), K, P, Q, stride, pads, dilation)
    return _forward(x, _wt(weight, x.dtype), bias, tables.on(x.device), K, P, Q, stride, pads, dilation)


# --- the seed's API -----------------------------------------------------------------------------------
def _dims(name: str, value, n: int, low: int) -> list[int]:
    """An int or a 1..3-sequence, broadcast/checked to n dims."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = [int(value)] * n
    if not isinstance(value, (list, tuple)) or not 1 <= len(value) <= 3 or \
            not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{name}: expected an int or a sequence of 1-3 ints, got {value!r}")
    value = [int(v) for v in value]
    if len(value) != n:
        if len(value) == 3 and all(v == 1 for v in value[:3 - n]):      # the seed's (1, 1, x) defaults
            value = value[3 - n:]
        else:
            raise ValueError(f"{name}: expected {n} value(s) (one per spatial dim of TRS), got {value!r}")
    if any(v < low for v in value):
        raise ValueError(f"{name}: expected values >= {low}, got {value!r}")
    return value


def _float_dtype(name: str, dtype) -> torch.dtype | None:
    """A torch or numpy floating dtype as a torch dtype (None stays None)."""
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype):
        try:
            dtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        except TypeError:
            dtype = None
    if dtype is None or not dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating dtype (torch or numpy) or None, got {dtype!r}")
    return dtype


def _padding(padding, n: int):
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID"):
            raise ValueError(f"padding: expected 'SAME', 'VALID' or ints, got {padding!r}")
        return ["SAME"] * n if padding.upper() == "SAME" else [0] * n
    return _dims("padding", padding, n, 0)


def _index_list(name: str, idx) -> np.ndarray:
    arr = np.asarray(idx)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"BCK: {name} must be a non-empty sequence of channel indices, got {idx!r}")
    if arr.min() < 0:
        raise ValueError(f"BCK: {name} has a negative channel index, {int(arr.min())}")
    if len(np.unique(arr)) != arr.size:
        raise ValueError(f"BCK: {name} repeats a channel index")
    return arr.astype(np.int64)


class _Checked(list):
    """Checked per-block filters; ``stacked``: the (blocks, ...) tensor they came from, if any."""

    def __init__(self, fs, stacked):
        super().__init__(fs)
        self.stacked = stacked


class BlocksparseConv:
    """The seed's block-sparse convolution (see the module docstring).

    Args:
        BCK: ((c indices, k indices), ...) blocks.
        TRS: filter size, 1-3 dims. DHW: input size. MPQ: output size (None: computed; deconv
            uses it to resolve strided sizes).
        strides, dilates: per dim (the seed's 3-tuples of ones fit any rank).
        padding: "SAME", "VALID" or ints.
        edge_bias: also make an edge bias (``edge_bias_shape``): one value per output channel and
            per pattern of padded filter taps, added at the output positions whose filter window
            reaches into the padding, in that pattern.
        backend: "auto", "grouped" or "dense" (not in the seed).
    """

    _transposed = False

    def __init__(self, BCK, TRS, DHW, MPQ=None, strides=(1, 1, 1), dilates=(1, 1, 1), padding="SAME",
                 edge_bias=False, debug=False, deconv=False, backend: str = "auto"):
        if deconv is not self._transposed and deconv is not False:
            raise ValueError("deconv: the seed's switch to a transposed convolution; use BlocksparseDeconv(...) "
                             "with the same arguments")
        if not isinstance(TRS, (list, tuple)) or not 1 <= len(TRS) <= 3:
            raise ValueError(f"TRS: expected a sequence of 1-3 filter sizes, got {TRS!r}")
        n = len(TRS)
        self.TRS = _dims("TRS", list(TRS), n, 1)
        self.DHW = _dims("DHW", DHW, n, 1)
        self.strides = _dims("strides", strides, n, 1)
        self.dilates = _dims("dilates", dilates, n, 1)
        self.padding = _padding(padding, n)
        if backend not in ("auto", "grouped", "dense"):
            raise ValueError(f"backend: expected 'auto', 'grouped' or 'dense', got {backend!r}")
        self.backend = backend
        if isinstance(BCK, (str, bytes)) or not hasattr(BCK, "__len__") or len(BCK) == 0:
            raise ValueError(f"BCK: expected a non-empty sequence of (c indices, k indices) blocks, got {BCK!r}")
        blocks = []
        for b, pair in enumerate(BCK):
            if not hasattr(pair, "__len__") or len(pair) != 2:
                raise ValueError(f"BCK: block {b} must be a pair (c indices, k indices), got {pair!r}")
            blocks.append((_index_list(f"block {b}'s c indices", pair[0]),
                           _index_list(f"block {b}'s k indices", pair[1])))
        self.BCK = [(c.tolist(), k.tolist()) for c, k in blocks]
        self._c = [c for c, _ in blocks]
        self._k = [k for _, k in blocks]
        self.blocks = len(blocks)
        # in the convolution's own terms: "in" channels feed the filter, "out" channels receive it
        self.C = int(max(c.max() for c in self._c)) + 1
        self.K = int(max(k.max() for k in self._k)) + 1
        self.fixed_block_size = len({(len(c), len(k)) for c, k in blocks}) == 1
        if backend == "grouped" and not self.fixed_block_size:
            raise ValueError("backend: 'grouped' needs blocks of one size (len(c), len(k)); these differ, use "
                             "'dense' or 'auto'")
        self.sizeF = sum(len(c) * len(k) for c, k in blocks) * math.prod(self.TRS)
        self._geometry(MPQ)
        self.edge_bias = bool(edge_bias)
        self._edge_map = self._edge_patterns() if edge_bias else None
        self.flops = 2 * self.sizeF * math.prod(self.DHW if self._transposed else self.MPQ)
        # index tensors (dense filter, gather, scatter, edge bias), shared by equal ops, built now
        self._tables = layout_tables("conv_blocks", np.concatenate(self._c), np.concatenate(self._k),
                                     np.array([(len(c), len(k)) for c, k in blocks], dtype=np.int64),
                                     self._transposed, self._edge_map)

    # --- geometry -------------------------------------------------------------------------------
    def _geometry(self, MPQ):
        out, self._pads = conv_geometry(self.TRS, self.DHW, self.strides, self.dilates, self.padding)
        self.MPQ = out if MPQ is None else _dims("MPQ", MPQ, len(self.TRS), 1)
        if self.MPQ != out:
            raise ValueError(f"MPQ: the convolution of DHW={self.DHW} gives {out}, got {self.MPQ}")

    def _edge_patterns(self) -> np.ndarray:
        """(prod MPQ,) int64: each output position's edge pattern (-1: none), numbered in order
        of their first position (the seed's order)."""
        per_dim = []
        for q_n, w, s, st, dl, (pb, _) in zip(self.MPQ, self.DHW, self.TRS, self.strides, self.dilates, self._pads):
            x = np.arange(q_n)[:, None] * st - pb + np.arange(s)[None, :] * dl
            per_dim.append((x < 0) | (x >= w))                              # (Q, S): tap in the padding
        return self._edge_ids(per_dim, self.MPQ)

    def _edge_ids(self, per_dim: list[np.ndarray], sizes: list[int]) -> np.ndarray:
        """per_dim[d]: (sizes[d], TRS[d]) bool, tap in the padding. Returns each position's edge
        pattern id (-1: none), ids in order of first position; sets ``_n_edges``."""
        n = len(sizes)
        grids = np.meshgrid(*[np.arange(q) for q in sizes], indexing="ij")
        keys = np.zeros([math.prod(sizes)] + self.TRS, bool)
        for d in range(n):
            shape = [-1] + [1] * n
            shape[d + 1] = self.TRS[d]
            keys = keys | per_dim[d][grids[d].ravel()].reshape(shape)
        keys = keys.reshape(len(keys), -1)
        edge = np.full(len(keys), -1, np.int64)
        seen: dict[bytes, int] = {}
        for pos in np.nonzero(keys.any(1))[0]:
            edge[pos] = seen.setdefault(np.packbits(keys[pos]).tobytes(), len(seen))
        self._n_edges = len(seen)
        return edge

    # --- the seed's shapes ----------------------------------------------------------------------
    @property
    def edge_bias_shape(self) -> list[int]:
        """(K, edge patterns): the edge bias's shape (0 patterns without padding)."""
        if not self.edge_bias:
            raise ValueError("edge_bias_shape: this op was built with edge_bias=False")
        return [self.K, self._n_edges]

    def i_shape(self, N: int) -> list[int]:
        return [N, self.C] + self.DHW

    def o_shape(self, N: int) -> list[int]:
        return [N, self.K] + self.MPQ

    def f_shape(self, block: int | None = None) -> list[int]:
        """Block ``block``'s filter shape; None: (blocks, Kb, Cb, *TRS) when all blocks have one
        size, else (sizeF,)."""
        if block is None:
            if self.fixed_block_size:
                return [self.blocks] + self._fshape(0)
            return [self.sizeF]
        if not 0 <= block < self.blocks:
            raise ValueError(f"block: expected 0..{self.blocks - 1}, got {block}")
        return self._fshape(block)

    def _fshape(self, b: int) -> list[int]:
        return [len(self._k[b]), len(self._c[b])] + self.TRS

    # --- filters --------------------------------------------------------------------------------
    def _filters(self, Fs) -> "_Checked":
        """Per-block filters from a list, a stacked tensor (fixed block size) or a flat (sizeF,)
        tensor, checked; ``.stacked`` keeps the stacked tensor when there is one."""
        stacked = None
        if isinstance(Fs, Tensor):
            if self.fixed_block_size and list(Fs.shape) == self.f_shape():
                stacked, Fs = Fs, list(Fs.unbind(0))
            elif Fs.dim() == 1 and Fs.numel() == self.sizeF:
                sizes = [math.prod(self.f_shape(b)) for b in range(self.blocks)]
                Fs = [f.view(self.f_shape(b)) for b, f in enumerate(Fs.split(sizes))]
            else:
                raise ValueError(f"F: expected a list of {self.blocks} per-block filters, or a tensor of shape "
                                 f"{self.f_shape()}, got a tensor of shape {tuple(Fs.shape)}")
        Fs = list(Fs)
        if len(Fs) != self.blocks:
            raise ValueError(f"F: expected {self.blocks} per-block filters, got {len(Fs)}")
        for b, f in enumerate(Fs):
            if not isinstance(f, Tensor):
                raise TypeError(f"F[{b}]: expected a torch.Tensor, got {type(f).__name__}")
            if list(f.shape) != self.f_shape(b):
                raise ValueError(f"F[{b}]: expected shape {self.f_shape(b)}, got {list(f.shape)}")
        return _Checked(Fs, stacked)

    def dense_filter(self, F) -> Tensor:
        """The blocks summed into one dense filter (K, C, *TRS) (deconv: (C, K, *TRS)), in one
        accumulating index_put."""
        fs = F if isinstance(F, _Checked) else self._filters(F)
        rows, cols = self._dense_index(fs[0].device)
        vals = fs.stacked.flatten(0, 2) if fs.stacked is not None else \
            torch.cat([f.reshape([-1] + self.TRS) for f in fs])
        shape = ([self.C, self.K] if self._transposed else [self.K, self.C]) + self.TRS
        return vals.new_zeros(shape).index_put((rows, cols), vals, accumulate=True)

    def _dense_index(self, device):
        """(row, col) of every filter element of every block in the dense filter, block by block."""
        t = tables_on(self._tables, device)
        return t.rows, t.cols

    # --- call -----------------------------------------------------------------------------------
    def _check_input(self, I: Tensor, C: int, size: list[int]) -> Tensor:
        if not isinstance(I, Tensor):
            raise TypeError(f"I: expected a torch.Tensor, got {type(I).__name__}")
        n = len(self.TRS)
        if I.dim() != n + 2 or I.shape[1] != C or list(I.shape[2:]) != size:
            raise ValueError(f"I: expected shape (N, {C}, {', '.join(map(str, size))}), got {tuple(I.shape)}")
        if not I.is_floating_point():
            raise TypeError(f"I: expected a floating-point tensor, got {I.dtype}")
        return I

    def _use_grouped(self, I: Tensor) -> bool:
        if self.backend == "dense" or not self.fixed_block_size:
            return False
        if self.backend == "grouped":
            return True
        # H200 (benchmarks/conv.md): cuDNN's grouped conv beats the dense filter only when no
        # channel gather or scatter-add is needed (the blocks sit in channel order, block-diagonal)
        return I.is_cuda and self._gather_plan(I.device) == (None, None)

    def __call__(self, F, I: Tensor, edge_bias: Tensor | None = None) -> Tensor:
        self._check_input(I, self.C, self.DHW)
        fs = self._filters(F)
        for b, f in enumerate(fs):
            if f.dtype != I.dtype or f.device != I.device:
                raise TypeError(f"F[{b}]: expected {I.dtype} on {I.device} (as I), got {f.dtype} on {f.device}")
        y = self._grouped(fs, I) if self._use_grouped(I) else self._dense(fs, I)
        return self._add_edge_bias(y, edge_bias)

    def _conv(self, x: Tensor, w: Tensor, groups: int = 1) -> Tensor:
        """This op's convolution (the deconv overrides it with the transposed one)."""
        return conv_nd(x, w, self.strides, self.dilates, self._pads, groups)

    def _dense(self, fs: list[Tensor], I: Tensor) -> Tensor:
        return self._conv(I, self.dense_filter(fs))

    def _gather_plan(self, device):
        """(input channel gather or None, output scatter or None) on ``device``."""
        t = tables_on(self._tables, device)
        return t.gather, t.scatter

    def _grouped(self, fs: list[Tensor], I: Tensor) -> Tensor:
        gather, scatter = self._gather_plan(I.device)
        x = I if gather is None else I.index_select(1, gather)
        y = self._conv(x, fs.stacked.flatten(0, 1) if fs.stacked is not None else torch.cat(fs, 0),
                       groups=self.blocks)
        if scatter is None:
            return y
        out = y.new_zeros([y.shape[0], self.K] + list(y.shape[2:]))
        return out.index_add(1, scatter, y)

    def _add_edge_bias(self, y: Tensor, eb: Tensor | None) -> Tensor:
        if eb is None:
            return y
        if not self.edge_bias:
            raise ValueError("edge_bias: this op was built with edge_bias=False")
        if not isinstance(eb, Tensor) or list(eb.shape) != self.edge_bias_shape:
            raise ValueError(f"edge_bias: expected shape {self.edge_bias_shape}, got "
                             f"{tuple(eb.shape) if isinstance(eb, Tensor) else type(eb).__name__}")
        if eb.device != y.device:
            raise ValueError(f"edge_bias: expected a tensor on {y.device} (as I), got one on {eb.device}")
        idx = tables_on(self._tables, y.device).edge                       # (prod MPQ,)
        table = torch.cat([eb.to(y.dtype), eb.new_zeros(eb.shape[0], 1).to(y.dtype)], 1)    # column -1: no edge
        add = table[:, idx].view([1, self.K] + list(y.shape[2:]))
        return y + add

    # --- weight norm ----------------------------------------------------------------------------
    def _norm_dims(self) -> tuple[int, ...]:
        return tuple(range(1, 2 + len(self.TRS)))                          # per output channel of a block

    def l2_normalize(self, F, gain: Tensor | None = None, epsilon: float = 1e-12, dtype=None):
        """Each block's filter scaled to unit L2 norm per output channel (times ``gain``, one value
        per output channel of the blocks in order): the norm is sqrt(max(sum of squares, epsilon)),
        in fp32 (fp64 for fp64 filters). Returns F's form (per-block filters, the stacked tensor, or
        the flat (sizeF,) tensor), in ``dtype`` (a torch or numpy float dtype; default F's)."""
        out_dtype = _float_dtype("dtype", dtype)
        fs_in = list(self._filters(F))
        dims = self._norm_dims()
        out, off = [], 0
        n_out = [len(k) for k in self._k]                                   # output channels (deconv too)
        if gain is not None:
            if self._k_overlap():
                raise ValueError("gain: not supported when blocks share output channels")
            if not isinstance(gain, Tensor) or gain.numel() != sum(n_out):
                raise ValueError(f"gain: expected {sum(n_out)} values (the blocks' output channels in order), got "
                                 f"{tuple(gain.shape) if isinstance(gain, Tensor) else type(gain).__name__}")
        for f, n in zip(fs_in, n_out):
            work = f.to(torch.promote_types(f.dtype, torch.float32))
            norm = work.square().sum(dims, keepdim=True).clamp_min(epsilon).sqrt()
            g = work / norm
            if gain is not None:
                shape = [1] * f.dim()
                shape[1 if self._transposed else 0] = n
                g = g * gain.reshape(-1)[off:off + n].to(work.dtype).view(shape)
            off += n
            out.append(g.to(out_dtype or f.dtype))
        if isinstance(F, Tensor):                       # the form F came in: flat or stacked
            return torch.cat([o.reshape(-1) for o in out]) if F.dim() == 1 else torch.stack(out)
        return out

    def _k_overlap(self) -> bool:
        k = np.concatenate(self._k)
        return len(np.unique(k)) != len(k)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(blocks={self.blocks}, C={self.C}, K={self.K}, TRS={self.TRS}, "
                f"DHW={self.DHW}, MPQ={self.MPQ}, strides={self.strides}, dilates={self.dilates}, "
                f"padding={self.padding})")


class BlocksparseDeconv(BlocksparseConv):
    """The transposed convolution of :class:`BlocksparseConv`, with the seed's arguments: DHW is
    the deconv's input size and MPQ its output size (None: stride x input for "SAME", the full
    size for "VALID" and explicit padding). Block filters are (len(c_i), len(k_i), *TRS): c_i
    are the deconv's input channels, k_i its output channels."""

    _transposed = True

    def _geometry(self, MPQ):
        n = len(self.TRS)
        if MPQ is None:
            out = []
            for s, w, st, dl, p in zip(self.TRS, self.DHW, self.strides, self.dilates, self.padding):
                eff = (s - 1) * dl + 1
                out.append(w * st if p == "SAME" else (w - 1) * st + eff - 2 * p)
            MPQ = out
        self.MPQ = _dims("MPQ", MPQ, n, 1)
        # the forward convolution this one transposes: MPQ -> DHW
        try:
            fwd, self._pads = conv_geometry(self.TRS, self.MPQ, self.strides, self.dilates, self.padding)
        except ValueError as exc:
            raise ValueError(f"MPQ: the deconv's output {self.MPQ} is too small for its filter ({exc})") from None
        if fwd != self.DHW:
            raise ValueError(f"MPQ: a convolution of MPQ={self.MPQ} gives {fwd}, not the deconv's input DHW="
                             f"{self.DHW}; pass an MPQ whose convolution gives DHW")

    def _edge_patterns(self) -> np.ndarray:
        """Deconv output positions (the forward conv's inputs) by the pattern of taps whose forward
        output falls outside it (the seed's bprop rule; stride holes do not count)."""
        per_dim = []
        for x_n, q_n, s, st, dl, (pb, _) in zip(self.MPQ, self.DHW, self.TRS, self.strides, self.dilates, self._pads):
            num = np.arange(x_n)[:, None] + pb - np.arange(s)[None, :] * dl      # q * stride for tap s
            hole = num % st != 0
            q = num // st
            per_dim.append(~hole & ((q < 0) | (q >= q_n)))
        return self._edge_ids(per_dim, self.MPQ)

    def i_shape(self, N: int) -> list[int]:
        return [N, self.C] + self.DHW

    def o_shape(self, N: int) -> list[int]:
        return [N, self.K] + self.MPQ

    @property
    def edge_bias_shape(self) -> list[int]:
        if not self.edge_bias:
            raise ValueError("edge_bias_shape: this op was built with edge_bias=False")
        return [self.K, self._n_edges]

    def _fshape(self, b: int) -> list[int]:
        return [len(self._c[b]), len(self._k[b])] + self.TRS

    def _norm_dims(self) -> tuple[int, ...]:
        return (0,) + tuple(range(2, 2 + len(self.TRS)))                   # per output channel (dim 1)

    def _conv(self, x: Tensor, w: Tensor, groups: int = 1) -> Tensor:
        """This op's convolution (shared by the dense and grouped paths): conv_transpose with (in, out/groups, *TRS) weights, cropped to MPQ (asymmetric pads)."""
        n = len(self.TRS)
        extra = []
        for x_n, q_n, s, st, dl, (pb, _) in zip(self.MPQ, self.DHW, self.TRS, self.strides, self.dilates, self._pads):
            full = (q_n - 1) * st + (s - 1) * dl + 1
            extra.append(max(0, pb + x_n - full))
        outpad = [min(e, max(st, dl) - 1) for e, st, dl in zip(extra, self.strides, self.dilates)]
        y = _CONV_T[n](x, w, None, self.strides, 0, outpad, groups, self.dilates)
        sl = [slice(None), slice(None)]
        pad_after = []
        for d, (x_n, (pb, _)) in enumerate(zip(self.MPQ, self._pads)):
            have = y.shape[2 + d]
            sl.append(slice(pb, min(pb + x_n, have)))
            pad_after.append(pb + x_n - min(pb + x_n, have))
        y = y[tuple(sl)]
        if any(pad_after):
            y = F.pad(y, [p for a in reversed(pad_after) for p in (0, a)])
        return y


def cwise_linear(x: Tensor, gain: Tensor | None = None, bias: Tensor | None = None, relu: bool = False,
                 bias_first: bool = False, use_tf: bool = False, *, a: Tensor | None = None,
                 b: Tensor | None = None) -> Tensor:
    """gain·x + bias per channel (dim 1), the seed's argument names: gain and bias have C elements,
    as (1, C, 1, 1) or any shape of that size. ``bias_first``: (x + bias)·gain. ``relu``: max(·, 0).
    ``use_tf`` (the seed's TensorFlow fallback) has no effect. ``a=``, ``b=``: deprecated names of
    gain and bias."""
    if a is not None or b is not None:
        warnings.warn("cwise_linear: a= and b= are deprecated; use the seed's gain= and bias=", DeprecationWarning,
                      stacklevel=2)
        if (a is not None and gain is not None) or (b is not None and bias is not None):
            raise TypeError("cwise_linear: gain and a (or bias and b) name the same argument; pass one")
        gain = gain if a is None else a
        bias = bias if b is None else b
    a, b = gain, bias
    if a is None and b is None:
        raise ValueError("cwise_linear: expected gain, bias or both, got neither")
    if not isinstance(x, Tensor) or x.dim() < 2:
        raise ValueError(f"x: expected a tensor (N, C, ...), got "
                         f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    for name, t in (("gain", a), ("bias", b)):
        if t is not None and (not isinstance(t, Tensor) or t.numel() != x.shape[1]):
            raise ValueError(f"{name}: expected {x.shape[1]} values (one per channel), got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    a = None if a is None else a.reshape(shape).to(x.dtype)
    b = None if b is None else b.reshape(shape).to(x.dtype)
    if bias_first:
        y = x if b is None else x + b
        y = y if a is None else y * a
    else:
        y = x if a is None else x * a
        y = y if b is None else y + b
    return torch.relu(y) if relu else y
