"""The GPU entry points as ``torch.library`` custom ops: ``torch.ops.bstrain.*``.

Each op has a fake (meta) implementation, so ``torch.compile(fullgraph=True)`` and ``torch.export``
trace a model through it as one opaque node, and an autograd registration in terms of the
other ops, so AOTAutograd builds the backward graph from them too:

=======================  ==========================================  =========================
op                       computes                                    gradient through
=======================  ==========================================  =========================
bsmm                     Y = X·W on a registered layout              bsmm_dx, bsmm_dw
bsmm_dx                  dX = dY·Wᵀ                                  bsmm, bsmm_dw
bsmm_dw                  dW = Xᵀ·dY on live blocks (also grouped)   bsmm_dx, bsmm
layer_norm               (y, mean, rstd), per segment, fused ReLU    layer_norm_bwd
layer_norm_bwd           (dx, dg, db)                                (none)
lstm_gates               (new_c, new_h) from c and gates i, u, f, o  lstm_gates_bwd
lstm_gates_bwd           (dc, dgates)                                (none)
=======================  ==========================================  =========================

CUDA tensors run the Triton kernels; CPU tensors run the PyTorch references (so the ops can be
checked with ``torch.library.opcheck`` anywhere). A layout is named by a string key
(:func:`register_layout`), so a compiled graph holds a constant, not an object: the op looks the
layout's lookup tables up when it runs.

The public functions (``BlocksparseMatMul.__call__``, ``layer_norm``, ``fused_lstm_gates``) call
these ops while tracing. Called eagerly they run the same launchers through a lighter
``autograd.Function``: the dispatcher's boxed call into Python costs about as much as the whole
kernel launch at small sizes (benchmarks/eager.md).
"""
from __future__ import annotations

import hashlib
import weakref

import numpy as np
import torch
from torch import Tensor

__all__ = ["register_layout", "layout_tables", "LayoutTables", "eager"]


def eager(t: Tensor) -> bool:
    """True when a call on t runs eagerly: not under torch.compile, and t a plain tensor (not a
    fake or functional one, as torch.export and make_fx trace with). Traced calls go through
    the custom ops; eager ones take the lighter path."""
    return type(t) is torch.Tensor and not torch.compiler.is_compiling()


# --- block-sparse matmul ----------------------------------------------------------------------------
class LayoutTables:
    """A (Cb, Kb) bool layout and block size, with its kernel lookup tables per device (built on
    first use) and its (c, k) block coordinates for the reference path."""

    def __init__(self, layout: np.ndarray, block_size: int):
        self.layout, self.block_size = layout, block_size
        c_idx, k_idx = np.nonzero(layout)
        self.coords = torch.as_tensor(np.stack([c_idx, k_idx]), dtype=torch.int64)   # (2, nnz)
        self.blocks = int(c_idx.size)
        self.C, self.K = layout.shape[0] * block_size, layout.shape[1] * block_size
        self._luts: dict = {}
        self._ref: dict = {}

    def __reduce__(self):
        """Copies and pickles resolve to the registered tables of the same layout, so that a
        deep-copied (EMA) or unpickled module's key still names live tables."""
        return register_tables, (self.layout, self.block_size)

    def luts(self, device: torch.device):
        luts = self._luts.get(device)
        if luts is None:
            from bstrain.kernels.matmul import make_luts
            luts = self._luts[device] = make_luts(self.layout, self.block_size, device)
        return luts

    def ref_coords(self, device: torch.device) -> tuple[Tensor, Tensor]:
        coords = self._ref.get(device)
        if coords is None:
            coords = self._ref[device] = (self.coords[0].to(device, copy=True), self.coords[1].to(device, copy=True))
        return coords


_TABLES: "weakref.WeakValueDictionary[str, LayoutTables]" = weakref.WeakValueDictionary()


def layout_key(layout: np.ndarray, block_size: int) -> str:
    """A content hash of a layout and block size: equal layouts share a key (and tables)."""
    h = hashlib.blake2b(digest_size=12)
    h.update(np.asarray(layout.shape, dtype=np.int64).tobytes())
    h.update(np.packbits(np.asarray(layout, dtype=bool)).tobytes())
    return f"bs{block_size}-{layout.shape[0]}x{layout.shape[1]}-{h.hexdigest()}"


def register_layout(layout: np.ndarray, block_size: int) -> tuple[str, LayoutTables]:
    """(key, tables) of a validated layout; ops with equal layouts share the tables. The caller
    keeps the tables alive (a BlocksparseMatMul holds them): the registry holds weak references."""
    key = layout_key(layout, block_size)
    tables = _TABLES.get(key)
    if tables is None:
        tables = LayoutTables(layout, block_size)
        _TABLES[key] = tables
    return key, tables


def register_tables(layout: np.ndarray, block_size: int) -> LayoutTables:
    return register_layout(layout, block_size)[1]


def layout_tables(key: str) -> LayoutTables:
    tables = _TABLES.get(key)
    if tables is None:
        raise RuntimeError(f"layout: no block-sparse layout is registered under {key!r}; build the "
                           f"BlocksparseMatMul (or the module holding it) in this process before running a "
                           f"graph that uses it")
    return tables


def _kernels(t: Tensor) -> bool:
    return t.device.type == "cuda"


def _as(w: Tensor, dtype: torch.dtype) -> Tensor:
    """w in ``dtype``, contiguous: fp32 master weights meet 16-bit activations."""
    return (w if w.dtype == dtype else w.to(dtype)).contiguous()


@torch.library.custom_op("bstrain::bsmm", mutates_args=())
def bsmm(x: Tensor, w: Tensor, layout: str, feature_axis: int, dw_dtype: torch.dtype) -> Tensor:
    """Y = X·W. x: (N, C) (feature_axis=1) or (C, N); w: (nnz, bs, bs) in x's dtype or fp32.
    dw_dtype: the dtype of dW in backward (accumulated in fp32)."""
    t = layout_tables(layout)
    if _kernels(x):
        from bstrain.kernels.matmul import bsmm_forward          # checked: the op may be called directly
        return bsmm_forward(x, _as(w, x.dtype), t.luts(x.device), feature_axis)
    from bstrain.ops.matmul import bsmm_ref
    return bsmm_ref(x, w.to(x.dtype), *t.ref_coords(x.device), t.K, feature_axis)


@bsmm.register_fake
def _(x, w, layout, feature_axis, dw_dtype):
    t = layout_tables(layout)
    n = x.shape[1 - feature_axis]
    return x.new_empty((n, t.K) if feature_axis == 1 else (t.K, n))


@torch.library.custom_op("bstrain::bsmm_dx", mutates_args=())
def bsmm_dx(dy: Tensor, w: Tensor, layout: str, feature_axis: int) -> Tensor:
    """dX = dY·Wᵀ. dy: (N, K) or (K, N); w: (nnz, bs, bs) in dy's dtype or fp32."""
    t = layout_tables(layout)
    if _kernels(dy):
        from bstrain.kernels.matmul import bsmm_dx
        return bsmm_dx(dy, _as(w, dy.dtype), t.luts(dy.device), feature_axis)
    from bstrain.ops.matmul import bsmm_dx_ref
    return bsmm_dx_ref(dy, w.to(dy.dtype), *t.ref_coords(dy.device), t.C, feature_axis)


@bsmm_dx.register_fake
def _(dy, w, layout, feature_axis):
    t = layout_tables(layout)
    n = dy.shape[1 - feature_axis]
    return dy.new_empty((n, t.C) if feature_axis == 1 else (t.C, n))


@torch.library.custom_op("bstrain::bsmm_dw", mutates_args=())
def bsmm_dw(x: Tensor, dy: Tensor, layout: str, feature_axis: int, dw_dtype: torch.dtype) -> Tensor:
    """dW = Xᵀ·dY on live blocks: (nnz, bs, bs) in dw_dtype. x: (N, C) or (C, N); dy: (N, K) or
    (K, N), in x's dtype. The grouped-dW path calls it on the rows of many timesteps at once."""
    t = layout_tables(layout)
    if _kernels(x):
        from bstrain.kernels.matmul import bsmm_dw
        return bsmm_dw(x, dy.to(x.dtype), t.luts(x.device), feature_axis, dw_dtype)
    from bstrain.ops.matmul import bsmm_dw_ref
    return bsmm_dw_ref(x, dy.to(x.dtype), *t.ref_coords(x.device), t.block_size, feature_axis).to(dw_dtype)


@bsmm_dw.register_fake
def _(x, dy, layout, feature_axis, dw_dtype):
    t = layout_tables(layout)
    return x.new_empty((t.blocks, t.block_size, t.block_size), dtype=dw_dtype)


def _save_pair(ctx, inputs, output):
    a, b, layout, feature_axis = inputs[:4]
    ctx.save_for_backward(a, b)
    ctx.layout, ctx.axis = layout, feature_axis
    ctx.dtypes = (a.dtype, b.dtype)


def _bsmm_backward(ctx, dy):
    x, w = ctx.saved_tensors
    dx = bsmm_dx(dy, w, ctx.layout, ctx.axis) if ctx.needs_input_grad[0] else None
    dw = bsmm_dw(x, dy, ctx.layout, ctx.axis, ctx.dw_dtype) if ctx.needs_input_grad[1] else None
    return dx, dw, None, None, None


def _bsmm_setup(ctx, inputs, output):
    _save_pair(ctx, inputs, output)
    ctx.dw_dtype = inputs[4]


def _bsmm_dx_backward(ctx, g):
    """dX = dY·Wᵀ: d(dY) = G·W, dW = Gᵀ·dY."""
    dy, w = ctx.saved_tensors
    d_dy = bsmm(g, w, ctx.layout, ctx.axis, w.dtype) if ctx.needs_input_grad[0] else None
    d_w = bsmm_dw(g, dy, ctx.layout, ctx.axis, w.dtype) if ctx.needs_input_grad[1] else None
    return d_dy, d_w, None, None


def _bsmm_dw_backward(ctx, g):
    """dW = Xᵀ·dY: dX = dY·Gᵀ, d(dY) = X·G."""
    x, dy = ctx.saved_tensors
    d_x = bsmm_dx(dy, g, ctx.layout, ctx.axis) if ctx.needs_input_grad[0] else None
    d_dy = bsmm(x, g, ctx.layout, ctx.axis, x.dtype).to(dy.dtype) if ctx.needs_input_grad[1] else None
    return d_x, d_dy, None, None, None


bsmm.register_autograd(_bsmm_backward, setup_context=_bsmm_setup)
bsmm_dx.register_autograd(_bsmm_dx_backward, setup_context=_save_pair)
bsmm_dw.register_autograd(_bsmm_dw_backward, setup_context=_save_pair)


# --- layer norm -------------------------------------------------------------------------------------
def _ln_groups(x: Tensor, axis: int) -> Tensor:
    """(groups, C) view of a 2-D x with features on ``axis``."""
    return x if axis == 1 else x.t()


def layer_norm_stats_ref(x: Tensor, axis: int, eps: float, segments: int) -> tuple[Tensor, Tensor]:
    """(mean, rstd), each (groups, segments), in fp32 (fp64 for fp64 x)."""
    xr = _ln_groups(x, axis)
    work = torch.promote_types(x.dtype, torch.float32)
    xs = xr.reshape(xr.shape[0], segments, -1).to(work)
    var, mean = torch.var_mean(xs, dim=-1, correction=0)
    return mean, torch.rsqrt(var + eps)


def _check_ln(x: Tensor, g: Tensor, b: Tensor, axis: int, segments: int) -> None:
    """The kernel's contract: x contiguous 2-D, features on axis 0 or 1 splitting into segments
    of at most MAX_SEGMENT; g and b (C,) contiguous on x's device."""
    from bstrain.kernels.norms import MAX_SEGMENT
    if x.dim() != 2 or axis not in (0, 1) or not x.is_contiguous():
        raise ValueError(f"x: expected a contiguous 2-D tensor with features on axis 0 or 1, got shape "
                         f"{tuple(x.shape)}, axis {axis}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"x: expected float32, float16 or bfloat16, got {x.dtype}")
    C = x.shape[axis]
    if segments < 1 or C % segments or C // segments > MAX_SEGMENT:
        raise ValueError(f"segments: expected a divisor of the {C} features into segments of at most "
                         f"{MAX_SEGMENT}, got {segments}")
    for name, p in (("g", g), ("b", b)):
        if p.shape != (C,) or not p.is_contiguous() or p.device != x.device:
            raise ValueError(f"{name}: expected a contiguous ({C},) tensor on {x.device}, got "
                             f"{tuple(p.shape)} on {p.device}")


@torch.library.custom_op("bstrain::layer_norm", mutates_args=())
def layer_norm(x: Tensor, g: Tensor, b: Tensor, axis: int, eps: float, relu: bool,
               segments: int) -> tuple[Tensor, Tensor, Tensor]:
    """x: contiguous (N, C) (axis=1) or (C, N) (axis=0); g, b: (C,). Returns (y, mean, rstd); the
    statistics are (groups, segments) fp32."""
    if _kernels(x):
        from bstrain.kernels.norms import layer_norm_forward
        _check_ln(x, g, b, axis, segments)
        return layer_norm_forward(x, g, b, axis, eps, relu, segments)
    mean, rstd = layer_norm_stats_ref(x, axis, eps, segments)
    xr = _ln_groups(x, axis)
    xhat = (xr.reshape(xr.shape[0], segments, -1).to(mean.dtype) - mean[..., None]) * rstd[..., None]
    y = xhat.reshape(xr.shape) * g.to(mean.dtype) + b.to(mean.dtype)
    y = (torch.relu(y) if relu else y).to(x.dtype)
    return (y if axis == 1 else y.t()).contiguous(), mean, rstd


@layer_norm.register_fake
def _(x, g, b, axis, eps, relu, segments):
    groups = x.shape[1 - axis]
    stats = x.new_empty((groups, segments), dtype=torch.promote_types(x.dtype, torch.float32))
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, stats.clone()


@torch.library.custom_op("bstrain::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(dy: Tensor, x: Tensor, g: Tensor, b: Tensor, mean: Tensor, rstd: Tensor, axis: int,
                   relu: bool, segments: int) -> tuple[Tensor, Tensor, Tensor]:
    """(dx like x, dg, db in g's and b's dtypes)."""
    if _kernels(x):
        from bstrain.kernels.norms import layer_norm_backward
        _check_ln(x, g, b, axis, segments)
        if dy.shape != x.shape:
            raise ValueError(f"dy: expected shape {tuple(x.shape)} (as x), got {tuple(dy.shape)}")
        dx, dg, db = layer_norm_backward(dy.contiguous(), x, g, b, mean, rstd, axis, relu, segments)
        if dg.untyped_storage().data_ptr() == db.untyped_storage().data_ptr():
            db = db.clone()                                 # views of one sum: outputs may not share storage
        return dx, dg, db
    work = mean.dtype
    xr, dyr = _ln_groups(x, axis).to(work), _ln_groups(dy, axis).to(work)
    n, c = xr.shape
    xhat = ((xr.reshape(n, segments, -1) - mean[..., None]) * rstd[..., None]).reshape(n, c)
    gw = g.to(work)
    if relu:
        dyr = dyr * ((xhat * gw + b.to(work)) > 0)
    dg, db = (dyr * xhat).sum(0), dyr.sum(0)
    dxhat = (dyr * gw).reshape(n, segments, -1)
    xh = xhat.reshape(n, segments, -1)
    dx = (dxhat - dxhat.mean(-1, keepdim=True) - xh * (dxhat * xh).mean(-1, keepdim=True)) * rstd[..., None]
    dx = dx.reshape(n, c).to(x.dtype)
    return (dx if axis == 1 else dx.t()).contiguous(), dg.to(g.dtype), db.to(b.dtype)


@layer_norm_bwd.register_fake
def _(dy, x, g, b, mean, rstd, axis, relu, segments):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(g), torch.empty_like(b)


def _ln_setup(ctx, inputs, output):
    x, g, b, axis, eps, relu, segments = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, g, b, mean, rstd)
    ctx.config = (axis, relu, segments)
    ctx.mark_non_differentiable(mean, rstd)


def _ln_backward(ctx, dy, _dmean, _drstd):
    x, g, b, mean, rstd = ctx.saved_tensors
    dx, dg, db = layer_norm_bwd(dy, x, g, b, mean, rstd, *ctx.config)
    return dx, dg, db, None, None, None, None


layer_norm.register_autograd(_ln_backward, setup_context=_ln_setup)


# --- LSTM gates -------------------------------------------------------------------------------------
def _gates_ref(c, i, u, f, o, bias, forget_bias):
    """c and the four gate pre-activations (bias added) in the math dtype (fp32 for 16-bit)."""
    work = torch.promote_types(c.dtype, torch.float32)
    gates = [t.to(work) for t in (i, u, f, o)]
    if bias is not None:
        gates = [t + bb.to(work) for t, bb in zip(gates, bias.reshape(4, -1))]
    return c.to(work), gates


@torch.library.custom_op("bstrain::lstm_gates", mutates_args=())
def lstm_gates(c: Tensor, i: Tensor, u: Tensor, f: Tensor, o: Tensor, bias: Tensor | None,
               forget_bias: float) -> tuple[Tensor, Tensor]:
    """(new_c, new_h), (N, K) each, from c and the gates i, u, f, o ((N, K) views, unit feature
    stride); bias: (4K,) or None, added to the gates. The math is fp32 for 16-bit inputs."""
    if _kernels(c):
        from bstrain.kernels.ew import lstm_gates_forward
        return lstm_gates_forward(c, i, u, f, o, bias, forget_bias)
    cw, (gi, gu, gf, go) = _gates_ref(c, i, u, f, o, bias, forget_bias)
    new_c = cw * torch.sigmoid(gf + forget_bias) + torch.sigmoid(gi) * torch.tanh(gu)
    new_h = torch.tanh(new_c) * torch.sigmoid(go)
    return new_c.to(c.dtype), new_h.to(c.dtype)


@lstm_gates.register_fake
def _(c, i, u, f, o, bias, forget_bias):
    return c.new_empty(c.shape), c.new_empty(c.shape)


@torch.library.custom_op("bstrain::lstm_gates_bwd", mutates_args=())
def lstm_gates_bwd(c: Tensor, i: Tensor, u: Tensor, f: Tensor, o: Tensor, bias: Tensor | None,
                   dc_new: Tensor | None, dh_new: Tensor, forget_bias: float) -> tuple[Tensor, Tensor]:
    """(dc (N, K), dgates (N, 4K) in the order i, u, f, o), in c's dtype."""
    if _kernels(c):
        from bstrain.kernels.ew import lstm_gates_backward
        for name, d in (("dc_new", dc_new), ("dh_new", dh_new)):
            if d is not None and d.shape != c.shape:
                raise ValueError(f"{name}: expected shape {tuple(c.shape)} (as c), got {tuple(d.shape)}")
        return lstm_gates_backward(c, i, u, f, o, dc_new, dh_new, bias, forget_bias)
    cw, (gi, gu, gf, go) = _gates_ref(c, i, u, f, o, bias, forget_bias)
    si, tu, sf, so = torch.sigmoid(gi), torch.tanh(gu), torch.sigmoid(gf + forget_bias), torch.sigmoid(go)
    t = torch.tanh(cw * sf + si * tu)
    dh = dh_new.to(cw.dtype)
    dcn = dh * so * (1 - t * t) + (dc_new.to(cw.dtype) if dc_new is not None else 0)
    dg = torch.cat([dcn * tu * si * (1 - si), dcn * si * (1 - tu * tu), dcn * cw * sf * (1 - sf),
                    dh * t * so * (1 - so)], dim=1)
    return (dcn * sf).to(c.dtype), dg.to(c.dtype)


@lstm_gates_bwd.register_fake
def _(c, i, u, f, o, bias, dc_new, dh_new, forget_bias):
    return c.new_empty(c.shape), c.new_empty((c.shape[0], 4 * c.shape[1]))


def _gates_setup(ctx, inputs, output):
    c, i, u, f, o, bias, forget_bias = inputs
    ctx.save_for_backward(c, i, u, f, o, bias)
    ctx.forget_bias = forget_bias
    ctx.set_materialize_grads(False)


def _gates_backward(ctx, dc_new, dh_new):
    c, i, u, f, o, bias = ctx.saved_tensors
    if dh_new is None:
        dh_new = torch.zeros_like(c)
    dc, dg = lstm_gates_bwd(c, i, u, f, o, bias, dc_new, dh_new, ctx.forget_bias)
    dbias = dg.sum(0, dtype=torch.float32).to(bias.dtype) if bias is not None and ctx.needs_input_grad[5] else None
    return (dc,) + tuple(dg.chunk(4, dim=1)) + (dbias, None)


lstm_gates.register_autograd(_gates_backward, setup_context=_gates_setup)
