"""Block-sparse matmul below the seed's class: the references, the layout tables, and the kernel pair
from which :func:`~bstrain.ops._dispatch.kernel_op` makes the custom ops ``torch.ops.bstrain.bsmm``,
``bsmm_dx`` and ``bsmm_dw`` (traced calls) and the eager ``autograd.Function``
(:class:`bstrain.ops.matmul.BlocksparseMatMul` calls them; the names are re-exported there).

In this file's order: the references → the layout tables → the kernel pair (fake, autograd; the
second derivatives beside: forward and dX are the same product on the transposed layout).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from bstrain.ops._dispatch import kernel_op
from bstrain.ops.tables import family, lookup, real_tensors, tracing

__all__ = ["bsmm_ref", "bsmm_dx_ref", "bsmm_dw_ref", "MatmulTables", "bsmm", "bsmm_dx", "bsmm_dw", "compute_dtype"]


# --- references ---------------------------------------------------------------------------------------
def _chunk_blocks(n, bs: int) -> int:
    """Blocks per step of the reference's gather, so no (N, chunk, bs) buffer passes ~16M elements.

    A symbolic N (torch.compile with dynamic shapes, torch.export) gets a chunk that does not
    depend on it, so a new batch size neither recompiles nor specialises the graph.
    """
    if isinstance(n, torch.SymInt) or torch.compiler.is_compiling():
        return max(1, (1 << 16) // bs)
    return max(1, (1 << 24) // max(1, n * bs))


def bsmm_ref(x: torch.Tensor, w: torch.Tensor, c_idx: torch.Tensor, k_idx: torch.Tensor,
             K: int, feature_axis: int = 1) -> torch.Tensor:
    """Pure-PyTorch block-sparse matmul, differentiable, on live blocks only.

    Args:
        x: (N, C) if feature_axis == 1 else (C, N).
        w: (nnz, bs, bs) live blocks, in x's dtype.
        c_idx, k_idx: (nnz,) int64 layout coordinates of each block.
        K: output features.
    Returns (N, K) or (K, N). Works in chunks of blocks so no (N, nnz, bs) buffer grows past
    about 16M elements, and no dense (C, K) matrix is formed.
    """
    bs = w.shape[-1]
    xr = x if feature_axis == 1 else x.t()
    n = xr.shape[0]
    xb = xr.reshape(n, xr.shape[1] // bs, bs)                     # (N, Cb, bs)
    y = xr.new_zeros(n, K // bs, bs)                              # (N, Kb, bs)
    chunk = _chunk_blocks(n, bs)
    for s in range(0, c_idx.shape[0], chunk):
        part = torch.einsum("nbi,bij->nbj", xb[:, c_idx[s:s + chunk]], w[s:s + chunk])
        y = y.index_add(1, k_idx[s:s + chunk], part)              # (N, Kb, bs)
    y = y.reshape(n, K)
    return y if feature_axis == 1 else y.t().contiguous()


def bsmm_dx_ref(dy: torch.Tensor, w: torch.Tensor, c_idx: torch.Tensor, k_idx: torch.Tensor,
                C: int, feature_axis: int = 1) -> torch.Tensor:
    """dX = dY·Wᵀ on live blocks: the forward over the transposed layout. dy: (N, K) or (K, N)."""
    return bsmm_ref(dy, w.transpose(1, 2), k_idx, c_idx, C, feature_axis)


def bsmm_dw_ref(x: torch.Tensor, dy: torch.Tensor, c_idx: torch.Tensor, k_idx: torch.Tensor,
                block_size: int, feature_axis: int = 1) -> torch.Tensor:
    """dW = Xᵀ·dY on live blocks only: (nnz, bs, bs) in x's dtype; never forms the dense (C, K)."""
    xr, dyr = (x, dy) if feature_axis == 1 else (x.t(), dy.t())
    n = xr.shape[0]
    xb = xr.reshape(n, xr.shape[1] // block_size, block_size)     # (N, Cb, bs)
    dyb = dyr.reshape(n, dyr.shape[1] // block_size, block_size)  # (N, Kb, bs)
    chunk = _chunk_blocks(n, block_size)
    parts = [torch.einsum("nbi,nbj->bij", xb[:, c_idx[s:s + chunk]], dyb[:, k_idx[s:s + chunk]])
             for s in range(0, c_idx.numel(), chunk)]
    return torch.cat(parts) if parts else xr.new_zeros(0, block_size, block_size)


# --- layout tables ---------------------------------------------------------------------------------
@dataclass
class MatmulTables:
    """One (Cb, Kb) layout's tables on one device: the reference path's block coordinates (made
    with the tables) and the kernels' lookup tables (made with the tables on CUDA; on the CPU only
    when the interpreter runs the kernels)."""
    layout: np.ndarray
    block_size: int
    device: torch.device
    c_idx: Tensor          # (nnz,) int64 input block of each weight block, row-major order
    k_idx: Tensor          # (nnz,) int64 output block
    _luts: object = field(default=None, repr=False)
    # a layout that changes in place (dynamic sparsity): the kernels' lists leave room for a block
    # row or column to grow, and no output panels (they group blocks by layout, and would make
    # every switch take new tables)
    private: bool = False

    @property
    def blocks(self) -> int:
        return self.c_idx.numel()

    @property
    def C(self) -> int:
        return self.layout.shape[0] * self.block_size

    @property
    def K(self) -> int:
        return self.layout.shape[1] * self.block_size

    @property
    def luts(self):
        """The kernels' tables (:class:`bstrain.kernels.matmul_luts.BsmmLuts`) on this device."""
        if self._luts is None:
            from bstrain.kernels.matmul_luts import make_luts
            with real_tensors(self.device):
                self._luts = make_luts(self.layout, self.block_size, self.device, headroom=self.private)
            if self.private:
                self._luts.no_panels()
        return self._luts

    def check_rewrite(self, layout: np.ndarray, block_size: int) -> None:
        """A ValueError if :meth:`rewrite` cannot switch these tables to ``layout`` in place: another
        shape, block size or live-block count, or (where the kernels' tables are built) a row or
        column longer than they hold, or output panels built on the old layout."""
        new = np.asarray(layout, dtype=bool)
        if block_size != self.block_size or new.shape != self.layout.shape or int(new.sum()) != self.blocks:
            raise ValueError(f"layout: an in-place switch needs a {self.layout.shape} layout with {self.blocks} live "
                             f"blocks, got {new.shape} with {int(new.sum())} at block size {block_size}")
        if self._luts is not None:
            self._luts.check_rewrite(new)

    def rewrite(self, layout: np.ndarray, block_size: int) -> None:
        """These tables, in place, for ``layout``: the same shape and live-block count (so every
        table keeps its length and every launch its grid)."""
        self.check_rewrite(layout, block_size)
        new = np.asarray(layout, dtype=bool)
        for mine, theirs in zip((self.c_idx, self.k_idx), np.nonzero(new)):
            mine.copy_(torch.as_tensor(theirs, dtype=torch.int64))
        if self._luts is not None:
            self._luts.rewrite(new)
        self.layout = new


@family("matmul", takes_private=True)
def _matmul_tables(layout: np.ndarray, block_size: int, *, device: torch.device, private: bool = False) -> MatmulTables:
    c_idx, k_idx = (torch.as_tensor(a, dtype=torch.int64, device=device) for a in np.nonzero(layout))
    if not tracing():
        for t in (c_idx, k_idx):       # a fixed size: torch.compile(dynamic=True) must not make it a symbol
            torch._dynamo.mark_static(t)
    tables = MatmulTables(layout, block_size, device, c_idx, k_idx, private=private)
    if device.type == "cuda" and not tracing():
        tables.luts                                                   # the kernels' tables, made now
    return tables


def _as(w: Tensor, dtype: torch.dtype) -> Tensor:
    """w in ``dtype``, contiguous: fp32 master weights meet 16-bit activations."""
    return (w if w.dtype == dtype else w.to(dtype)).contiguous()


# --- kernel pair: torch.ops.bstrain.bsmm, bsmm_dx, bsmm_dw and the eager Function -------------------------
# CUDA tensors run the kernels; CPU tensors the references (so opcheck runs anywhere). ``layout`` is
# the content key of the layout's tables (bstrain.ops.tables): a compiled graph holds a string. Eager
# calls hand over the tables' ``luts`` (and the compute dtype), so they skip the key's lookup and the
# launchers' checks (the public call checked once); the op (luts None) checks.
def _bsmm_forward(x: Tensor, w: Tensor, layout: str, feature_axis: int, dw_dtype: torch.dtype, *, luts=None,
                  wk: Tensor | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """Y = X·W. x: (N, C) (feature_axis=1) or (C, N); w: (nnz, bs, bs) in x's dtype or fp32.
    dw_dtype: the dtype of dW in backward (accumulated in fp32). Eagerly, ``wk`` is w in the compute
    ``dtype`` (made once: the backward reuses it), and x may be fp32 under a 16-bit autocast
    (:func:`_casts_in_kernel`), its tiles cast by the kernel as it loads them."""
    from bstrain.kernels.matmul import bsmm_forward, run_forward   # (`from package import module` costs a
    if luts is None:                                              # Python call at every run)
        return bsmm_forward(x, _as(w, x.dtype), lookup(layout).on(x.device).luts, feature_axis)
    return run_forward(x, wk, luts, feature_axis, dtype=dtype)


def _bsmm_dx(dy: Tensor, w: Tensor, layout: str, feature_axis: int, *, luts=None,
             dtype: torch.dtype | None = None) -> Tensor:
    """dX = dY·Wᵀ. dy: (N, K) or (K, N); w: (nnz, bs, bs) in dy's dtype or fp32 (eagerly: in dy's).
    Eagerly dX comes in ``dtype`` (x's: fp32 where the kernels cast x)."""
    from bstrain.kernels.matmul import bsmm_dx, run_dx
    if luts is None:
        return bsmm_dx(dy, _as(w, dy.dtype), lookup(layout).on(dy.device).luts, feature_axis)
    return run_dx(dy, w, luts, feature_axis, dtype=dtype)


def _bsmm_dw(x: Tensor, dy: Tensor, layout: str, feature_axis: int, dw_dtype: torch.dtype, *, luts=None) -> Tensor:
    """dW = Xᵀ·dY on live blocks: (nnz, bs, bs) in dw_dtype. x: (N, C) or (C, N); dy: (N, K) or
    (K, N), in x's dtype (eagerly: in the compute dtype, x maybe fp32). The grouped-dW path calls
    it on the rows of many timesteps at once."""
    from bstrain.kernels.matmul import bsmm_dw, run_dw
    if luts is None:
        return bsmm_dw(x, dy.to(x.dtype), lookup(layout).on(x.device).luts, feature_axis, dw_dtype)
    return run_dw(x, dy, luts, feature_axis, dw_dtype)


def _bsmm_cpu(x, w, layout, feature_axis, dw_dtype):
    t = lookup(layout).on(x.device)
    return bsmm_ref(x, w.to(x.dtype), t.c_idx, t.k_idx, t.K, feature_axis)


def _bsmm_dx_cpu(dy, w, layout, feature_axis):
    t = lookup(layout).on(dy.device)
    return bsmm_dx_ref(dy, w.to(dy.dtype), t.c_idx, t.k_idx, t.C, feature_axis)


def _bsmm_dw_cpu(x, dy, layout, feature_axis, dw_dtype):
    t = lookup(layout).on(x.device)
    return bsmm_dw_ref(x, dy.to(x.dtype), t.c_idx, t.k_idx, t.block_size, feature_axis).to(dw_dtype)


def _bsmm_fake(x, w, layout, feature_axis, dw_dtype):
    t = lookup(layout).host
    n = x.shape[1 - feature_axis]
    return x.new_empty((n, t.K) if feature_axis == 1 else (t.K, n))


def _bsmm_dx_fake(dy, w, layout, feature_axis):
    t = lookup(layout).host
    n = dy.shape[1 - feature_axis]
    return dy.new_empty((n, t.C) if feature_axis == 1 else (t.C, n))


def _bsmm_dw_fake(x, dy, layout, feature_axis, dw_dtype):
    t = lookup(layout).host
    return x.new_empty((t.blocks, t.block_size, t.block_size), dtype=dw_dtype)


def _bsmm_setup(ctx, inputs, output):
    x, w, layout, feature_axis, dw_dtype = inputs
    ctx.save_for_backward(x, ctx.hints.get("wk", w))        # eagerly: the weight cast once, in the compute dtype
    ctx.layout, ctx.axis, ctx.dw_dtype = layout, feature_axis, dw_dtype


def _bsmm_grads(ctx, bwd, dy):
    """dX = dY·Wᵀ and dW = Xᵀ·dY, each only where needed: the forward's product on the transposed
    layout, and the weight's. Eagerly x may be fp32 (cast in the kernel) and gets an fp32 dX."""
    x, w = ctx.saved_tensors
    luts, dtype = ctx.hints.get("luts"), ctx.hints.get("dtype", x.dtype)
    dy = dy if dy.dtype == dtype else dy.to(dtype)
    dx_op, dw_op = bwd
    dx = dx_op(dy, w, ctx.layout, ctx.axis, luts=luts, dtype=x.dtype) if ctx.needs_input_grad[0] else None
    dw = dw_op(x, dy, ctx.layout, ctx.axis, ctx.dw_dtype, luts=luts) if ctx.needs_input_grad[1] else None
    return dx, dw, None, None, None


_bsmm_dx_op = kernel_op("bstrain::bsmm_dx", _bsmm_dx, ref=_bsmm_dx_cpu, fake=_bsmm_dx_fake)
_bsmm_dw_op = kernel_op("bstrain::bsmm_dw", _bsmm_dw, ref=_bsmm_dw_cpu, fake=_bsmm_dw_fake)
_bsmm = kernel_op("bstrain::bsmm", _bsmm_forward, ref=_bsmm_cpu, fake=_bsmm_fake, setup=_bsmm_setup,
                  backward=_bsmm_grads, bwd=(_bsmm_dx_op, _bsmm_dw_op))
bsmm, bsmm_dx, bsmm_dw = _bsmm.op, _bsmm_dx_op.op, _bsmm_dw_op.op


# Second derivatives: dX and dW are products of the same family, so each op's backward is the others
# (registered here, as kernel_op makes an autograd only for a forward with a backward op).
def _save_pair(ctx, inputs, output):
    a, b, layout, feature_axis = inputs[:4]
    ctx.save_for_backward(a, b)
    ctx.layout, ctx.axis = layout, feature_axis


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


bsmm_dx.register_autograd(_bsmm_dx_backward, setup_context=_save_pair)
bsmm_dw.register_autograd(_bsmm_dw_backward, setup_context=_save_pair)


def compute_dtype(I: torch.Tensor) -> torch.dtype:
    """The dtype the op runs in for activation I: the autocast dtype under torch.autocast for
    floating activations, else I's own."""
    dev = I.device.type
    if I.dtype in (torch.float32, torch.float16, torch.bfloat16) and dev in ("cuda", "cpu") \
            and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return I.dtype


def _autocast_input(I: torch.Tensor) -> torch.Tensor:
    """Under torch.autocast, floating activations run in the autocast dtype (weights follow)."""
    dt = compute_dtype(I)
    return I if I.dtype == dt else I.to(dt)


def _casts_in_kernel(X: torch.Tensor, dtype: torch.dtype, feature_axis: int) -> bool:
    """An fp32 activation under a 16-bit autocast goes to the kernels as it is, where an eager call
    is host-bound (few rows): the pointer kernels cast its tiles as they load them and write its
    gradient in fp32, which saves the two cast kernels (and their host time) that a cast of X
    before the product costs. Larger calls cast first and take the TMA kernels."""
    if X.dtype != torch.float32 or dtype not in (torch.float16, torch.bfloat16):
        return False
    from bstrain.kernels import launch
    from bstrain.kernels.matmul import SMALL_M
    return launch.host_bound(X.shape[1 - feature_axis], SMALL_M, X)
