"""Triton layer norm for the seed's general case: either feature axis, segments, fused ReLU, and
a fused multiplicative operand (y = LN(x)·m, the mLSTM's multiplicative input).

x is seen as groups: one group is one segment of the features of one row (axis=1) or one
column (axis=0). A program normalises BLOCK_G groups of one segment at once, as a
(BLOCK_G, KS) tile, so loads are coalesced along features (axis=1) or along rows of N (axis=0).
Statistics are fp32. The backward writes per-program partial dg/db rows, summed by torch, or
adds them into a caller's fp32 workspace (ACCUMULATE: one workspace for every timestep of a
sequence, see bstrain.ops.grouping).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from bstrain.kernels._device import sm_count
from bstrain.kernels.alloc import empty, empty_like
from bstrain.kernels.jit_math import layer_norm_input_grad, store_partial
from bstrain.kernels.launch import Launch, aligned, plan

MAX_SEGMENT = 8192  # features per segment the one-tile kernel handles


@triton.jit
def _normalize_store(x, mean, rstd, G, B, M, Y, feat, fmask, offs, mask, RELU: tl.constexpr, HAS_MUL: tl.constexpr):
    """Y[offs] = (x - mean)·rstd·g + b, then ReLU or ·M[offs] if asked, for one (BLOCK_G, width) tile."""
    g = tl.load(G + feat, mask=fmask, other=0.0).to(tl.float32)
    b = tl.load(B + feat, mask=fmask, other=0.0).to(tl.float32)
    y = (x - mean[:, None]) * rstd[:, None] * g[None, :] + b[None, :]
    if RELU:
        y = tl.maximum(y, 0.0)
    if HAS_MUL:
        y = y * tl.load(M + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _relu_grad(xhat, g, B, feat, fmask, dy, DX):
    """dy where the forward's stored output y > 0, else 0.

    y is recomputed as the forward computed it and rounded to the stored dtype (DX's, which is
    x's and y's), so the gradient follows the forward's own ReLU decision even where y lies
    within rounding of zero.
    """
    b = tl.load(B + feat, mask=fmask, other=0.0).to(tl.float32)
    y = (xhat * g[None, :] + b[None, :]).to(DX.dtype.element_ty)
    return tl.where(y > 0.0, dy, 0.0)


@triton.jit
def _mul_grad(xhat, g, B, M, DM, feat, fmask, offs, mask, dy, STORE: tl.constexpr):
    """The gradient reaching LN(x) through y = LN(x)·m (dy·m); stores dm = dy·LN(x) if STORE."""
    m = tl.load(M + offs, mask=mask, other=0.0).to(tl.float32)
    if STORE:
        b = tl.load(B + feat, mask=fmask, other=0.0).to(tl.float32)
        tl.store(DM + offs, (dy * (xhat * g[None, :] + b[None, :])).to(DM.dtype.element_ty), mask=mask)
    return dy * m


@triton.jit
def _layer_norm_fwd_kernel(X, G, B, M, Y, MEAN, RSTD, n_groups, n_seg, seg_size,
                           stride_g, stride_f, eps,
                           RELU: tl.constexpr, HAS_MUL: tl.constexpr, BLOCK_G: tl.constexpr, KS: tl.constexpr):
    seg = tl.program_id(1)
    grp = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)                 # (BLOCK_G,)
    feat = seg * seg_size + tl.arange(0, KS)                                 # (KS,)
    gmask = grp < n_groups
    fmask = tl.arange(0, KS) < seg_size
    mask = gmask[:, None] & fmask[None, :]
    offs = grp[:, None].to(tl.int64) * stride_g + feat[None, :].to(tl.int64) * stride_f
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / seg_size
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / seg_size + eps)
    _normalize_store(x, mean, rstd, G, B, M, Y, feat, fmask, offs, mask, RELU, HAS_MUL)
    tl.store(MEAN + grp * n_seg + seg, mean, mask=gmask)
    tl.store(RSTD + grp * n_seg + seg, rstd, mask=gmask)


@triton.jit
def _layer_norm_bwd_kernel(X, G, B, M, DY, DX, DM, MEAN, RSTD, DG_PART, DB_PART, n_groups, n_seg, seg_size, C,
                           stride_g, stride_f,
                           RELU: tl.constexpr, HAS_MUL: tl.constexpr, ACCUMULATE: tl.constexpr,
                           BLOCK_G: tl.constexpr, KS: tl.constexpr):
    pid = tl.program_id(0)
    seg = tl.program_id(1)
    grp = pid * BLOCK_G + tl.arange(0, BLOCK_G)
    feat = seg * seg_size + tl.arange(0, KS)
    gmask = grp < n_groups
    fmask = tl.arange(0, KS) < seg_size
    mask = gmask[:, None] & fmask[None, :]
    offs = grp[:, None].to(tl.int64) * stride_g + feat[None, :].to(tl.int64) * stride_f
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    mean = tl.load(MEAN + grp * n_seg + seg, mask=gmask, other=0.0)
    rstd = tl.load(RSTD + grp * n_seg + seg, mask=gmask, other=0.0)
    g = tl.load(G + feat, mask=fmask, other=0.0).to(tl.float32)
    xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    if RELU:
        dy = _relu_grad(xhat, g, B, feat, fmask, dy, DX)
    if HAS_MUL:
        dy = _mul_grad(xhat, g, B, M, DM, feat, fmask, offs, mask, dy, True)
    store_partial(DG_PART + pid * C + feat, tl.sum(dy * xhat, axis=0), fmask, ACCUMULATE)
    store_partial(DB_PART + pid * C + feat, tl.sum(dy, axis=0), fmask, ACCUMULATE)
    dxhat = dy * g[None, :]
    dx = layer_norm_input_grad(dxhat, xhat, rstd, dxhat * xhat, dxhat, seg_size)
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_fwd_loop_kernel(X, G, B, M, Y, MEAN, RSTD, n_groups, n_seg, seg_size,
                                stride_g, stride_f, eps,
                                RELU: tl.constexpr, HAS_MUL: tl.constexpr, BLOCK_G: tl.constexpr,
                                FCHUNK: tl.constexpr):
    """Large segments: three passes over FCHUNK-feature slices (mean, variance, normalise)."""
    seg = tl.program_id(1)
    grp = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    gmask = grp < n_groups
    base = X + grp[:, None].to(tl.int64) * stride_g
    acc = tl.zeros((BLOCK_G, FCHUNK), dtype=tl.float32)
    for f0 in range(0, seg_size, FCHUNK):
        j = f0 + tl.arange(0, FCHUNK)
        mask = gmask[:, None] & (j < seg_size)[None, :]
        acc += tl.load(base + (seg * seg_size + j)[None, :].to(tl.int64) * stride_f, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(acc, axis=1) / seg_size
    acc = tl.zeros((BLOCK_G, FCHUNK), dtype=tl.float32)
    for f0 in range(0, seg_size, FCHUNK):
        j = f0 + tl.arange(0, FCHUNK)
        mask = gmask[:, None] & (j < seg_size)[None, :]
        x = tl.load(base + (seg * seg_size + j)[None, :].to(tl.int64) * stride_f, mask=mask, other=0.0).to(tl.float32)
        xc = tl.where(mask, x - mean[:, None], 0.0)
        acc += xc * xc
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=1) / seg_size + eps)
    for f0 in range(0, seg_size, FCHUNK):
        j = f0 + tl.arange(0, FCHUNK)
        fmask = j < seg_size
        mask = gmask[:, None] & fmask[None, :]
        offs = grp[:, None].to(tl.int64) * stride_g + (seg * seg_size + j)[None, :].to(tl.int64) * stride_f
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        _normalize_store(x, mean, rstd, G, B, M, Y, seg * seg_size + j, fmask, offs, mask, RELU, HAS_MUL)
    tl.store(MEAN + grp * n_seg + seg, mean, mask=gmask)
    tl.store(RSTD + grp * n_seg + seg, rstd, mask=gmask)


@triton.jit
def _layer_norm_bwd_loop_kernel(X, G, B, M, DY, DX, DM, MEAN, RSTD, DG_PART, DB_PART, n_groups, n_seg, seg_size, C,
                                stride_g, stride_f,
                                RELU: tl.constexpr, HAS_MUL: tl.constexpr, ACCUMULATE: tl.constexpr,
                                BLOCK_G: tl.constexpr, FCHUNK: tl.constexpr):
    """Large segments: pass 1 sums dxhat and dxhat·xhat; pass 2 writes dx, dm and dg/db partials."""
    pid = tl.program_id(0)
    seg = tl.program_id(1)
    grp = pid * BLOCK_G + tl.arange(0, BLOCK_G)
    gmask = grp < n_groups
    mean = tl.load(MEAN + grp * n_seg + seg, mask=gmask, other=0.0)
    rstd = tl.load(RSTD + grp * n_seg + seg, mask=gmask, other=0.0)
    s1 = tl.zeros((BLOCK_G, FCHUNK), dtype=tl.float32)
    s2 = tl.zeros((BLOCK_G, FCHUNK), dtype=tl.float32)
    for pass_ in tl.static_range(2):
        for f0 in range(0, seg_size, FCHUNK):
            j = f0 + tl.arange(0, FCHUNK)
            feat = seg * seg_size + j
            fmask = j < seg_size
            mask = gmask[:, None] & fmask[None, :]
            offs = grp[:, None].to(tl.int64) * stride_g + feat[None, :].to(tl.int64) * stride_f
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(G + feat, mask=fmask, other=0.0).to(tl.float32)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
            if RELU:
                dy = _relu_grad(xhat, g, B, feat, fmask, dy, DX)
            if HAS_MUL:
                dy = _mul_grad(xhat, g, B, M, DM, feat, fmask, offs, mask, dy, pass_ == 1)
            dxhat = dy * g[None, :]
            if pass_ == 0:
                s1 += dxhat * xhat
                s2 += dxhat
            else:
                dx = layer_norm_input_grad(dxhat, xhat, rstd, s1, s2, seg_size)
                tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
                store_partial(DG_PART + pid * C + feat, tl.sum(dy * xhat, axis=0), fmask, ACCUMULATE)
                store_partial(DB_PART + pid * C + feat, tl.sum(dy, axis=0), fmask, ACCUMULATE)


TILE = 4096     # fp32 elements a program holds at once


def _geometry(x: torch.Tensor, axis: int, segments: int):
    """(groups, segment size, group stride, feature stride, BLOCK_G, feature tile, looped, warps).

    One tile holds BLOCK_G groups x a power-of-two slice of features. Segments that fit one tile
    with enough groups to coalesce (16 along N on axis 0) use the one-pass kernels; larger ones
    loop over FCHUNK-feature slices.
    """
    C = x.shape[axis]
    seg_size = C // segments
    if seg_size > MAX_SEGMENT:
        raise ValueError(f"segments: the kernel handles up to {MAX_SEGMENT} features per segment, got {seg_size}")
    n_groups = x.shape[1 - axis]
    stride_g, stride_f = (x.stride(0), x.stride(1)) if axis == 1 else (x.stride(1), x.stride(0))
    ks = triton.next_power_of_2(seg_size)
    min_g = 16 if axis == 0 else 1
    if ks * min_g <= TILE:
        return n_groups, seg_size, stride_g, stride_f, max(min_g, min(64, TILE // ks)), ks, False, 4
    # axis 0 needs 32 groups per program to coalesce; axis 1 takes 4 rows per program only when
    # that still leaves enough programs to fill the GPU (few rows: one row per program)
    block_g = 32 if axis == 0 else (4 if n_groups * segments >= 4 * 2 * sm_count(x.device) else 1)
    return n_groups, seg_size, stride_g, stride_f, block_g, max(2, TILE // block_g), True, 8


_PLANS: dict = {}


def _fwd_plan(x, axis: int, eps: float, relu: bool, segments: int, has_mul: bool):
    n_groups, seg_size, sg, sf, block_g, ks, looped, warps = _geometry(x, axis, segments)
    if not n_groups:
        return None
    kernel = _layer_norm_fwd_loop_kernel if looped else _layer_norm_fwd_kernel
    tile = dict(FCHUNK=ks) if looped else dict(KS=ks)
    launch = Launch(kernel, (triton.cdiv(n_groups, block_g), segments), x.device,
                    dict(RELU=relu, HAS_MUL=has_mul, BLOCK_G=block_g, **tile), num_warps=warps)
    ints = (n_groups, segments, seg_size, sg, sf, float(eps))
    return lambda x, g, b, m, y, mean, rstd: launch(x, g, b, m, y, mean, rstd, *ints)


def layer_norm_forward(x, g, b, axis: int, eps: float, relu: bool, segments: int, mul=None):
    """x: contiguous (N, C) for axis=1 or (C, N) for axis=0; g, b: (C,); mul: None, or a contiguous
    tensor shaped like x (any float dtype) to multiply the output by (not with relu).
    Returns (y like x, mean (groups, segments) fp32, rstd (groups, segments) fp32)."""
    y = empty_like(x)
    n_groups = x.shape[1 - axis]
    mean = empty((n_groups, segments), torch.float32, x.device)
    rstd = empty((n_groups, segments), torch.float32, x.device)
    operands = (x, g, b) if mul is None else (x, g, b, mul)
    key = ("fwd", tuple(x.shape), x.stride(0), x.stride(1), x.dtype, g.dtype, b.dtype, axis, eps, relu, segments,
           None if mul is None else mul.dtype, aligned(*operands), x.device)
    run = plan(_PLANS, key, lambda: _fwd_plan(x, axis, eps, relu, segments, mul is not None))
    if run is not None:
        run(x, g, b, x if mul is None else mul, y, mean, rstd)
    return y, mean, rstd


def _bwd_plan(x, axis: int, relu: bool, segments: int, has_mul: bool, accumulate: bool):
    n_groups, seg_size, sg, sf, block_g, ks, looped, warps = _geometry(x, axis, segments)
    C = x.shape[axis]
    n_prog = triton.cdiv(n_groups, block_g)
    kernel = _layer_norm_bwd_loop_kernel if looped else _layer_norm_bwd_kernel
    tile = dict(FCHUNK=ks) if looped else dict(KS=ks)
    launch = Launch(kernel, (n_prog, segments), x.device,
                    dict(RELU=relu, HAS_MUL=has_mul, ACCUMULATE=accumulate, BLOCK_G=block_g, **tile),
                    num_warps=warps)
    ints = (n_groups, segments, seg_size, C, sg, sf)
    dev = x.device

    def run(dy, x, g, b, mean, rstd, dx, m, dm, workspace):
        # dg, db per program: written here, or added into the caller's workspace
        parts = workspace((2, n_prog, C)) if accumulate else empty((2, n_prog, C), torch.float32, dev)
        if n_groups:
            launch(x, g, b, m, dy, dx, dm, mean, rstd, parts[0], parts[1], *ints)
        return None if accumulate else parts.sum(1)               # one reduction for both
    return run


def layer_norm_backward(dy, x, g, b, mean, rstd, axis: int, relu: bool, segments: int, mul=None, workspace=None):
    """dy, x (and mul): contiguous, same shape. Returns (dx like x, dg (C,), db (C,), dm like mul or
    None) with dg/db in g's dtype.

    workspace: None, or ``workspace(shape) -> fp32 tensor`` of shape (2, programs, C) into which
    the kernel adds its dg/db partial sums instead (then dg and db are None).
    """
    dx = empty_like(x)
    dm = None if mul is None else empty_like(mul)
    operands = (x, g, b, dy) if mul is None else (x, g, b, dy, mul, dm)
    key = ("bwd", tuple(x.shape), x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), x.dtype, dy.dtype, g.dtype,
           b.dtype, axis, relu, segments, None if mul is None else mul.dtype, workspace is not None,
           aligned(*operands), x.device)
    sums = plan(_PLANS, key, lambda: _bwd_plan(x, axis, relu, segments, mul is not None, workspace is not None))(
        dy, x, g, b, mean, rstd, dx, x if mul is None else mul, dx if dm is None else dm, workspace)
    if sums is None:
        return dx, None, None, dm
    dg, db = sums[0], sums[1]
    return dx, dg if g.dtype == dg.dtype else dg.to(g.dtype), db if b.dtype == db.dtype else db.to(b.dtype), dm
