"""Triton kernels of the fused mLSTM cell, and their launchers: per-gate layer norm, input add and
LSTM gates in one launch each way.

    gates        = xg + LN4(z; g, b) + bias          LN4: each of the four H-wide segments of a row
    new_c, new_h = σ(f + fb)·c + σ(i)·tanh(u),  σ(o)·tanh(new_c)      gate order i, u, f, o

as :mod:`bstrain.kernels.norms` (segments=4) followed by :mod:`bstrain.kernels.ew`'s gates, without
the (N, 4H) pre-activations ever leaving the program: they stay fp32. A program owns BLOCK_G whole
rows and visits them in FCHUNK-column slices of all four segments at once (the cell couples column
j of every segment), one slice when H <= FCHUNK. The forward takes two passes for the four
segments' statistics (the mean, then the centred variance) and a third for the outputs; the
backward one pass that writes dc, dxg and the dg/db partial sums while it sums each segment's
dxhat and dxhat·xhat, and a second that writes dz. (Hidden 4096: a pass is four slices of 1,024
columns of each segment; a row of 16,384 would not fit one program's registers at once.)

The gate bias enters as a shift like LN4's b, so its gradient equals db: the kernel writes one
partial-sum row for both.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from bstrain.kernels.alloc import empty
from bstrain.kernels.jit_math import (layer_norm_input_grad, load_state_grads, lstm_gates, lstm_gates_grads,
                                      store_partial)
from bstrain.kernels.launch import Launch, aligned, plan

TILE = 4096     # fp32 elements of a slice: BLOCK_G rows x 4 segments x FCHUNK columns
MAX_CHUNK = TILE // 4


@triton.jit
def _column(t, k):
    """Column k of a (BLOCK_G, 4) tile, as a (BLOCK_G,) vector."""
    return tl.sum(tl.where(tl.arange(0, 4)[None, :] == k, t, 0.0), axis=1)


@triton.jit
def _preact(Z, XG, G, B, BIAS, seg, H, zrow, xrow, j, jmask, mask, mean, rstd):
    """One segment's slice of the pre-activations, xg + LN(z)·g + b + bias, with its xhat and g
    (fp32, (BLOCK_G, FCHUNK)); mean, rstd: (BLOCK_G, 4). Masked lanes hold finite values."""
    feat = seg * H + j
    z = tl.load(Z + zrow + feat[None, :], mask=mask, other=0.0).to(tl.float32)
    xhat = tl.where(mask, (z - _column(mean, seg)[:, None]) * _column(rstd, seg)[:, None], 0.0)
    g = tl.load(G + feat, mask=jmask, other=0.0).to(tl.float32)
    shift = tl.load(B + feat, mask=jmask, other=0.0).to(tl.float32) + \
        tl.load(BIAS + feat, mask=jmask, other=0.0).to(tl.float32)
    xg = tl.load(XG + xrow + feat[None, :], mask=mask, other=0.0).to(tl.float32)
    return xg + xhat * g[None, :] + shift[None, :], xhat, g


@triton.jit
def _row_stats(Z, zrow, rmask, H, eps, BLOCK_G: tl.constexpr, FCHUNK: tl.constexpr):
    """(mean, rstd), each (BLOCK_G, 4): the statistics of the four segments of this program's rows
    of z, in two passes over (BLOCK_G, 4, FCHUNK) slices: the mean, then the centred variance."""
    base = Z + zrow[:, :, None] + (tl.arange(0, 4) * H)[None, :, None]           # (BLOCK_G, 4, 1)
    acc = tl.zeros((BLOCK_G, 4, FCHUNK), dtype=tl.float32)
    for j0 in range(0, H, FCHUNK):
        j = j0 + tl.arange(0, FCHUNK)
        mask = rmask[:, None, None] & (j < H)[None, None, :]
        acc += tl.load(base + j[None, None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(acc, axis=2) / H
    acc = tl.zeros((BLOCK_G, 4, FCHUNK), dtype=tl.float32)
    for j0 in range(0, H, FCHUNK):
        j = j0 + tl.arange(0, FCHUNK)
        mask = rmask[:, None, None] & (j < H)[None, None, :]
        z = tl.load(base + j[None, None, :], mask=mask, other=0.0).to(tl.float32)
        zc = tl.where(mask, z - mean[:, :, None], 0.0)
        acc += zc * zc
    return mean, 1.0 / tl.sqrt(tl.sum(acc, axis=2) / H + eps)


@triton.jit
def _load_slice(C, Z, XG, G, B, BIAS, H, crow, zrow, xrow, j, jmask, mask, mean, rstd):
    """Columns j of this program's rows: c, then each gate's pre-activation, xhat and g (fp32)."""
    i, xi, gi = _preact(Z, XG, G, B, BIAS, 0, H, zrow, xrow, j, jmask, mask, mean, rstd)
    u, xu, gu = _preact(Z, XG, G, B, BIAS, 1, H, zrow, xrow, j, jmask, mask, mean, rstd)
    f, xf, gf = _preact(Z, XG, G, B, BIAS, 2, H, zrow, xrow, j, jmask, mask, mean, rstd)
    o, xo, go = _preact(Z, XG, G, B, BIAS, 3, H, zrow, xrow, j, jmask, mask, mean, rstd)
    c = tl.load(C + crow + j[None, :], mask=mask, other=0.0).to(tl.float32)
    return c, i, xi, gi, u, xu, gu, f, xf, gf, o, xo, go


@triton.jit
def _lstm_cell_fwd_kernel(C, Z, XG, G, B, BIAS, CN, HN, MEAN, RSTD, n_rows, H, stride_c, stride_z, stride_x,
                          eps, forget_bias, BLOCK_G: tl.constexpr, FCHUNK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    rmask = rows < n_rows
    r64 = rows[:, None].to(tl.int64)
    zrow, xrow = r64 * stride_z, r64 * stride_x
    mean, rstd = _row_stats(Z, zrow, rmask, H, eps, BLOCK_G, FCHUNK)
    stats = rows[:, None] * 4 + tl.arange(0, 4)[None, :]
    tl.store(MEAN + stats, mean, mask=rmask[:, None])
    tl.store(RSTD + stats, rstd, mask=rmask[:, None])
    for j0 in range(0, H, FCHUNK):
        j = j0 + tl.arange(0, FCHUNK)
        jmask = j < H
        mask = rmask[:, None] & jmask[None, :]
        c, i, _, _, u, _, _, f, _, _, o, _, _ = _load_slice(C, Z, XG, G, B, BIAS, H, r64 * stride_c, zrow, xrow, j,
                                                           jmask, mask, mean, rstd)
        new_c, new_h = lstm_gates(c, i, u, f, o, forget_bias)
        out = r64 * H + j[None, :]
        tl.store(CN + out, new_c.to(CN.dtype.element_ty), mask=mask)
        tl.store(HN + out, new_h.to(HN.dtype.element_ty), mask=mask)


@triton.jit
def _gate_grad_out(dpre, xhat, g, DXG, DG_PART, DB_PART, seg, H, orow, prow, j, jmask, mask, s1, s2,
                   ACCUMULATE: tl.constexpr):
    """First backward pass, one segment's slice: stores dxg (= the pre-activation's gradient) and
    the dg/db partial sums; returns s1 + dxhat·xhat and s2 + dxhat."""
    feat = seg * H + j
    tl.store(DXG + orow + feat[None, :], dpre.to(DXG.dtype.element_ty), mask=mask)
    store_partial(DG_PART + prow + feat, tl.sum(dpre * xhat, axis=0), jmask, ACCUMULATE)
    store_partial(DB_PART + prow + feat, tl.sum(dpre, axis=0), jmask, ACCUMULATE)
    dxhat = dpre * g[None, :]
    return s1 + dxhat * xhat, s2 + dxhat


@triton.jit
def _store_dz(dpre, xhat, g, rstd, s1, s2, DZ, seg, H, orow, j, mask):
    """Second backward pass, one segment's slice: dz, the layer norm's input gradient (rstd: (BLOCK_G, 4))."""
    dz = layer_norm_input_grad(dpre * g[None, :], xhat, _column(rstd, seg), s1, s2, H)
    tl.store(DZ + orow + (seg * H + j)[None, :], dz.to(DZ.dtype.element_ty), mask=mask)


@triton.jit
def _lstm_cell_bwd_kernel(C, Z, XG, G, B, BIAS, MEAN, RSTD, DCN, DHN, DC, DZ, DXG, DG_PART, DB_PART,
                          n_rows, H, stride_c, stride_z, stride_x, forget_bias,
                          HAS_DC: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_G: tl.constexpr,
                          FCHUNK: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_G + tl.arange(0, BLOCK_G)
    rmask = rows < n_rows
    r64 = rows[:, None].to(tl.int64)
    zrow, xrow, orow, prow = r64 * stride_z, r64 * stride_x, r64 * (4 * H), pid * (4 * H)
    stats = rows[:, None] * 4 + tl.arange(0, 4)[None, :]                         # (BLOCK_G, 4) per segment
    mean = tl.load(MEAN + stats, mask=rmask[:, None], other=0.0)
    rstd = tl.load(RSTD + stats, mask=rmask[:, None], other=0.0)
    s1i = tl.zeros((BLOCK_G, FCHUNK), dtype=tl.float32)
    s2i, s1u, s2u, s1f, s2f, s1o, s2o = s1i, s1i, s1i, s1i, s1i, s1i, s1i
    for pass_ in tl.static_range(2):
        for j0 in range(0, H, FCHUNK):
            j = j0 + tl.arange(0, FCHUNK)
            jmask = j < H
            mask = rmask[:, None] & jmask[None, :]
            c, i, xi, gi, u, xu, gu, f, xf, gf, o, xo, go = _load_slice(C, Z, XG, G, B, BIAS, H, r64 * stride_c, zrow,
                                                                        xrow, j, jmask, mask, mean, rstd)
            out = r64 * H + j[None, :]
            dh, dcn = load_state_grads(DHN, DCN, out, mask, HAS_DC)
            dc, di, du, df, do = lstm_gates_grads(c, i, u, f, o, dh, dcn, forget_bias)
            if pass_ == 0:
                tl.store(DC + out, dc.to(DC.dtype.element_ty), mask=mask)
                s1i, s2i = _gate_grad_out(di, xi, gi, DXG, DG_PART, DB_PART, 0, H, orow, prow, j, jmask, mask,
                                          s1i, s2i, ACCUMULATE)
                s1u, s2u = _gate_grad_out(du, xu, gu, DXG, DG_PART, DB_PART, 1, H, orow, prow, j, jmask, mask,
                                          s1u, s2u, ACCUMULATE)
                s1f, s2f = _gate_grad_out(df, xf, gf, DXG, DG_PART, DB_PART, 2, H, orow, prow, j, jmask, mask,
                                          s1f, s2f, ACCUMULATE)
                s1o, s2o = _gate_grad_out(do, xo, go, DXG, DG_PART, DB_PART, 3, H, orow, prow, j, jmask, mask,
                                          s1o, s2o, ACCUMULATE)
            else:
                _store_dz(di, xi, gi, rstd, s1i, s2i, DZ, 0, H, orow, j, mask)
                _store_dz(du, xu, gu, rstd, s1u, s2u, DZ, 1, H, orow, j, mask)
                _store_dz(df, xf, gf, rstd, s1f, s2f, DZ, 2, H, orow, j, mask)
                _store_dz(do, xo, go, rstd, s1o, s2o, DZ, 3, H, orow, j, mask)


def _geometry(n_rows: int, H: int) -> tuple[int, int, int]:
    """(BLOCK_G rows per program, FCHUNK columns per segment slice, warps)."""
    chunk = min(triton.next_power_of_2(H), MAX_CHUNK)
    block_g = max(1, min(64, TILE // (4 * chunk), triton.next_power_of_2(n_rows)))
    return block_g, chunk, 8 if chunk == MAX_CHUNK else 4


_PLANS: dict = {}


def _key(tag, c, z, xg, g, b, bias, *more):
    """Everything a plan depends on: shapes, row strides, dtypes, alignment, the device."""
    return (tag, tuple(c.shape), c.stride(0), z.stride(0), xg.stride(0), c.dtype, z.dtype, xg.dtype, g.dtype,
            b.dtype, bias.dtype, aligned(c, z, xg, g, b, bias, *(t for t in more if isinstance(t, torch.Tensor))),
            c.device) + tuple(t.dtype if isinstance(t, torch.Tensor) else t for t in more)


def lstm_cell_forward(c, z, xg, g, b, bias, forget_bias: float = 1.0, eps: float = 1e-6):
    """c: (N, H); z, xg: (N, 4H), unit column stride (any row stride); g, b, bias: contiguous (4H,).
    Returns (new_c, new_h) (N, H) contiguous in c's dtype, and LN4's (mean, rstd) (N, 4) fp32."""
    n, H = c.shape
    dev = c.device
    cn, hn = empty((n, H), c.dtype, dev), empty((n, H), c.dtype, dev)
    mean, rstd = empty((n, 4), torch.float32, dev), empty((n, 4), torch.float32, dev)
    if n:
        def make():
            block_g, chunk, warps = _geometry(n, H)
            launch = Launch(_lstm_cell_fwd_kernel, (triton.cdiv(n, block_g),), dev,
                            dict(BLOCK_G=block_g, FCHUNK=chunk), num_warps=warps)
            ints = (n, H, c.stride(0), z.stride(0), xg.stride(0), float(eps), float(forget_bias))
            return lambda *t: launch(*t, *ints)
        run = plan(_PLANS, _key("fwd", c, z, xg, g, b, bias, float(forget_bias), float(eps)), make)
        run(c, z, xg, g, b, bias, cn, hn, mean, rstd)
    return cn, hn, mean, rstd


def _bwd_plan(c, z, xg, forget_bias: float, has_dc: bool, accumulate: bool):
    n, H = c.shape
    block_g, chunk, warps = _geometry(n, H)
    n_prog = triton.cdiv(n, block_g)
    dev = c.device
    launch = Launch(_lstm_cell_bwd_kernel, (n_prog,), dev,
                    dict(HAS_DC=has_dc, ACCUMULATE=accumulate, BLOCK_G=block_g, FCHUNK=chunk), num_warps=warps)
    ints = (n, H, c.stride(0), z.stride(0), xg.stride(0), float(forget_bias))

    def run(c, z, xg, g, b, bias, mean, rstd, dcn, dh, dc, dz, dxg, workspace):
        # dg, db per program: written here, or added into the caller's workspace
        parts = workspace((2, n_prog, 4 * H)) if accumulate else empty((2, n_prog, 4 * H), torch.float32, dev)
        launch(c, z, xg, g, b, bias, mean, rstd, dcn, dh, dc, dz, dxg, parts[0], parts[1], *ints)
        return None if accumulate else parts.sum(1)
    return run


def lstm_cell_backward(c, z, xg, g, b, bias, mean, rstd, dc_new, dh_new, forget_bias: float = 1.0,
                       workspace=None):
    """Gradients of :func:`lstm_cell_forward` from (dc_new or None, dh_new), (N, H) each.

    Returns (dc (N, H) in c's dtype, dz (N, 4H) in z's, dxg (N, 4H) in xg's, dg, db (4H,) fp32),
    all contiguous; db is also the gate bias's gradient. workspace: None, or
    ``workspace(shape) -> fp32 tensor`` of shape (2, programs, 4H) into which the kernel adds its
    dg/db partial sums instead (then dg and db are None).
    """
    n, H = c.shape
    dev = c.device
    dh_new = dh_new.contiguous()
    dc_new = dc_new.contiguous() if dc_new is not None else None
    dc = empty((n, H), c.dtype, dev)
    dz, dxg = empty((n, 4 * H), z.dtype, dev), empty((n, 4 * H), xg.dtype, dev)
    if not n:
        return (dc, dz, dxg) + ((None, None) if workspace is not None else
                                (torch.zeros(4 * H, device=dev), torch.zeros(4 * H, device=dev)))
    key = _key("bwd", c, z, xg, g, b, bias, dc_new, dh_new, float(forget_bias), workspace is not None)
    run = plan(_PLANS, key, lambda: _bwd_plan(c, z, xg, forget_bias, dc_new is not None, workspace is not None))
    sums = run(c, z, xg, g, b, bias, mean, rstd, dh_new if dc_new is None else dc_new, dh_new, dc, dz, dxg, workspace)
    return (dc, dz, dxg) + ((None, None) if sums is None else (sums[0], sums[1]))
