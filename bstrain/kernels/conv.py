"""Implicit-GEMM Triton kernels for block-sparse 2-D convolution and their launchers (no autograd here).

Activations x (N, C, H, W) and y (N, K, P, Q) with any strides (channels-last makes the channel
loads contiguous). A (C/bs, K/bs) layout's live blocks are numbered row-major (e); their filters
are passed as ``wt`` (nnz, kh, kw, bs_in, bs_out), contiguous, read through a TMA descriptor
(a pointer tile of (bs, bs) costs a register per element and spilled).

* ``_conv_fwd``: one program per (BLOCK_M output pixels, output block j) walks the live blocks
  of column j and the filter taps: acc += x[pixels shifted by the tap, block i] · wt[e, tap];
  the bias, if any, is added before the store.
* ``_conv_dx``: one program per (BLOCK_M input pixels, input block i) walks the blocks of row i
  and the taps: dx += dy[the output pixel that tap reaches, block j] · wt[e, tap]ᵀ, where the
  stride divides.
* ``_conv_dw``: one program per (live block, tap, pixel split) reduces x[shifted]ᵀ · dy over its
  share of the N·P·Q output pixels. Unsplit, it writes dW straight into the module's weight
  layout (nnz, out, in, kh, kw) in its dtype; split, into fp32 partials of that layout, summed.

Stride-1 convolutions of channels-last 16-bit tensors take ``_conv_tma`` (forward and dX) and
``_conv_dw_tma`` instead: the activations are read as TMA boxes of a spatial tile (TN images x TH
rows x TW columns) shifted by the tap, the box's zero fill standing in for the padding, so the
loop carries no per-pixel address or mask arithmetic. Other strides, NCHW and fp32 take the
pointer-load kernels above. Timings: benchmarks/conv.md.

**Launches.** Every launcher goes through :mod:`bstrain.kernels.launch`: a plan per key of what the
JIT specialises on (shapes, strides, dtypes, 16-byte alignment, geometry) is cached on the
layout's :class:`ConvLuts`, holding its :class:`Launch`, descriptor templates and integer
arguments, so an eager call after the first costs a dict lookup and one direct launch. Tiles per
(kernel, block size, itemsize) come from ``bstrain.kernels.tiles.CONV``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import triton
import triton.language as tl

from bstrain.kernels import tiles
from bstrain.kernels._device import desc_like, desc_template, precision, tma_ok
from bstrain.kernels.alloc import empty
from bstrain.kernels.launch import Launch, aligned, host_bound, plan


@triton.jit
def _pixels(m, P, Q):
    n = m // (P * Q)
    pq = m % (P * Q)
    return n, pq // Q, pq % Q


@triton.jit
def _entry(t, BLK, OTHER, KH: tl.constexpr, KW: tl.constexpr):
    """Step t of a (live block, filter tap) walk: (block number, its other-side block, tap, r, s)."""
    ent = t // (KH * KW)
    tap = t % (KH * KW)
    return tl.load(BLK + ent), tl.load(OTHER + ent), tap, tap // KW, tap % KW


@triton.jit
def _conv_fwd(X, WT, Y, B, col_ptr, col_blk, col_in, M, P, Q, H, W,
              sxn, sxc, sxh, sxw, syn, syc, syp, syq,
              st_h, st_w, pad_h, pad_w, dl_h, dl_w,
              KH: tl.constexpr, KW: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
              HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    j = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n, p, q = _pixels(m, P, Q)
    ok_m = m < M
    c = tl.arange(0, BS)
    acc = tl.zeros((BLOCK_M, BS), tl.float32)
    for t in range(tl.load(col_ptr + j) * (KH * KW), tl.load(col_ptr + j + 1) * (KH * KW)):
        e, i, tap, r, s = _entry(t, col_blk, col_in, KH, KW)
        h = p * st_h - pad_h + r * dl_h
        w = q * st_w - pad_w + s * dl_w
        ok = ok_m & (h >= 0) & (h < H) & (w >= 0) & (w < W)
        a = tl.load(X + (n * sxn + h * sxh + w * sxw)[:, None] + (i * BS + c)[None, :] * sxc,
                    mask=ok[:, None], other=0.0)
        b = WT.load([(e * (KH * KW) + tap) * BS, 0])                        # (in, out)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(B + j * BS + c).to(tl.float32)[None, :]
    out = Y + (n * syn + p * syp + q * syq)[:, None] + (j * BS + c)[None, :] * syc
    tl.store(out, acc.to(Y.dtype.element_ty), mask=ok_m[:, None])


@triton.jit
def _conv_dx(DY, WT, DX, row_ptr, row_blk, row_out, M, P, Q, H, W,
             sdn, sdc, sdp, sdq, sxn, sxc, sxh, sxw,
             st_h, st_w, pad_h, pad_w, dl_h, dl_w,
             KH: tl.constexpr, KW: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
             PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    i = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)           # input pixels (n, h, w), M = N·H·W
    n, h, w = _pixels(m, H, W)
    ok_m = m < M
    c = tl.arange(0, BS)
    acc = tl.zeros((BLOCK_M, BS), tl.float32)
    for t in range(tl.load(row_ptr + i) * (KH * KW), tl.load(row_ptr + i + 1) * (KH * KW)):
        e, j, tap, r, s = _entry(t, row_blk, row_out, KH, KW)
        ph = h + pad_h - r * dl_h
        pw = w + pad_w - s * dl_w
        p = ph // st_h
        q = pw // st_w
        ok = ok_m & (ph >= 0) & (pw >= 0) & (ph % st_h == 0) & (pw % st_w == 0) & (p < P) & (q < Q)
        g = tl.load(DY + (n * sdn + p * sdp + q * sdq)[:, None] + (j * BS + c)[None, :] * sdc,
                    mask=ok[:, None], other=0.0)
        b = WT.load([(e * (KH * KW) + tap) * BS, 0]).T                      # (out, in)
        acc = tl.dot(g, b, acc, input_precision=PRECISION)
    out = DX + (n * sxn + h * sxh + w * sxw)[:, None] + (i * BS + c)[None, :] * sxc
    tl.store(out, acc.to(DX.dtype.element_ty), mask=ok_m[:, None])


@triton.jit
def _store_dw(DW, acc, et, split, sw_split, sw_e, sw_tap, sw_in, sw_out, KH: tl.constexpr, KW: tl.constexpr,
              BS: tl.constexpr):
    """acc (in, out) of (live block, tap) ``et`` into DW by strides: the weight layout, or its partials."""
    c = tl.arange(0, BS)
    out = DW + split * sw_split + (et // (KH * KW)) * sw_e + (et % (KH * KW)) * sw_tap
    tl.store(out + c[:, None] * sw_in + c[None, :] * sw_out, acc.to(DW.dtype.element_ty))


@triton.jit
def _conv_dw(X, DY, DW, blk_in, blk_out, M, P, Q, H, W, per_split,
             sxn, sxc, sxh, sxw, sdn, sdc, sdp, sdq,
             st_h, st_w, pad_h, pad_w, dl_h, dl_w, sw_split, sw_e, sw_tap, sw_in, sw_out,
             KH: tl.constexpr, KW: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
             PRECISION: tl.constexpr):
    et = tl.program_id(0)                                   # (live block, tap)
    split = tl.program_id(1)
    i, j, tap, r, s = _entry(et, blk_in, blk_out, KH, KW)
    c = tl.arange(0, BS)
    acc = tl.zeros((BS, BS), tl.float32)                    # (in, out)
    start = split * per_split
    for m0 in range(start, tl.minimum(start + per_split, M), BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        n, p, q = _pixels(m, P, Q)
        ok_m = (m < M) & (m < start + per_split)
        h = p * st_h - pad_h + r * dl_h
        w = q * st_w - pad_w + s * dl_w
        ok = ok_m & (h >= 0) & (h < H) & (w >= 0) & (w < W)
        a = tl.load(X + (n * sxn + h * sxh + w * sxw)[:, None] + (i * BS + c)[None, :] * sxc,
                    mask=ok[:, None], other=0.0)
        g = tl.load(DY + (n * sdn + p * sdp + q * sdq)[:, None] + (j * BS + c)[None, :] * sdc,
                    mask=ok_m[:, None], other=0.0)
        acc = tl.dot(tl.trans(a), g, acc, input_precision=PRECISION)
    _store_dw(DW, acc, et, split, sw_split, sw_e, sw_tap, sw_in, sw_out, KH, KW, BS)


@triton.jit
def _tile(pid, P, Q, TN: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr):
    """The first (n, p, q) of spatial tile ``pid`` of TN images x TH rows x TW columns."""
    tiles_q = tl.cdiv(Q, TW)
    tiles_p = tl.cdiv(P, TH)
    return (pid // (tiles_q * tiles_p)) * TN, ((pid // tiles_q) % tiles_p) * TH, (pid % tiles_q) * TW


@triton.jit
def _conv_tma(A, WT, Y, B, ptr, blk, other, N, P, Q, syn, syc, syp, syq, base_h, base_w, step_h, step_w,
              KH: tl.constexpr, KW: tl.constexpr, BS: tl.constexpr, TN: tl.constexpr, TH: tl.constexpr,
              TW: tl.constexpr, TRANS_B: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr):
    """Stride-1 forward (A = x, lists by output column, base = -pad, step = dilation) and dX (A = dy,
    lists by input row, base = +pad, step = -dilation, TRANS_B): one program per spatial tile of
    the result and one of its channel blocks; every (block, tap) step is one TMA box of A (the
    tile shifted by the tap; the padding is the box's zero fill past the edges) and one filter."""
    BM: tl.constexpr = TN * TH * TW
    n0, p0, q0 = _tile(tl.program_id(0), P, Q, TN, TH, TW)
    j = tl.program_id(1)
    acc = tl.zeros((BM, BS), tl.float32)
    for t in range(tl.load(ptr + j) * (KH * KW), tl.load(ptr + j + 1) * (KH * KW)):
        e, i, tap, r, s = _entry(t, blk, other, KH, KW)
        a = A.load([n0, p0 + base_h + r * step_h, q0 + base_w + s * step_w, i * BS]).reshape(BM, BS)
        b = WT.load([(e * (KH * KW) + tap) * BS, 0])
        if TRANS_B:
            b = b.T
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    c = tl.arange(0, BS)
    if HAS_BIAS:
        acc += tl.load(B + j * BS + c).to(tl.float32)[None, :]
    m = tl.arange(0, BM)
    n = n0 + m // (TH * TW)
    p = p0 + (m // TW) % TH
    q = q0 + m % TW
    out = Y + (n * syn + p * syp + q * syq)[:, None] + (j * BS + c)[None, :] * syc
    tl.store(out, acc.to(Y.dtype.element_ty), mask=((n < N) & (p < P) & (q < Q))[:, None])


@triton.jit
def _conv_dw_tma(X, DY, DW, blk_in, blk_out, P, Q, tiles, per_split, base_h, base_w, dl_h, dl_w,
                 sw_split, sw_e, sw_tap, sw_in, sw_out,
                 KH: tl.constexpr, KW: tl.constexpr, BS: tl.constexpr, TN: tl.constexpr, TH: tl.constexpr,
                 TW: tl.constexpr, PRECISION: tl.constexpr):
    """Stride-1 dW: one program per (live block, tap, split of the output tiles); TMA boxes of x
    (shifted by the tap) and dy; dy's zero fill past the edges cancels the tile's overhang."""
    BM: tl.constexpr = TN * TH * TW
    et = tl.program_id(0)
    split = tl.program_id(1)
    i, j, tap, r, s = _entry(et, blk_in, blk_out, KH, KW)
    acc = tl.zeros((BS, BS), tl.float32)
    for tile in range(split * per_split, tl.minimum(split * per_split + per_split, tiles)):
        n0, p0, q0 = _tile(tile, P, Q, TN, TH, TW)
        a = X.load([n0, p0 + base_h + r * dl_h, q0 + base_w + s * dl_w, i * BS]).reshape(BM, BS)
        g = DY.load([n0, p0, q0, j * BS]).reshape(BM, BS)
        acc = tl.dot(tl.trans(a), g, acc, input_precision=PRECISION)
    _store_dw(DW, acc, et, split, sw_split, sw_e, sw_tap, sw_in, sw_out, KH, KW, BS)


# ---------------------------------------------------------------------------------------------
# Lookup tables
# ---------------------------------------------------------------------------------------------
@dataclass(eq=False)
class ConvLuts:
    """A (C/bs, K/bs) layout's lists on one device: by output column (forward) and by input row
    (dX), and the launch plans of the calls made with them (:func:`bstrain.kernels.launch.plan`)."""
    block_size: int
    col_ptr: torch.Tensor     # (K/bs + 1,) int32
    col_blk: torch.Tensor     # live block index (row-major number) of each column entry
    col_in: torch.Tensor      # its input block
    row_ptr: torch.Tensor     # (C/bs + 1,) int32
    row_blk: torch.Tensor
    row_out: torch.Tensor
    blk_in: torch.Tensor      # (nnz,) input block of each live block
    blk_out: torch.Tensor     # (nnz,) output block
    plans: dict = field(default_factory=dict, repr=False)

    def rewrite(self, layout: np.ndarray) -> None:
        """These lists, in place, for ``layout`` (same shape and live-block count: every list keeps
        its length, and no launch's grid depends on the per-row or per-column counts), so that
        plans and CUDA graphs made before run the new layout."""
        new = make_luts(layout, self.block_size, "cpu")              # on the host, then one copy per list
        names = ("col_ptr", "col_blk", "col_in", "row_ptr", "row_blk", "row_out", "blk_in", "blk_out")
        if any(getattr(self, n).shape != getattr(new, n).shape for n in names):
            raise ValueError("layout: an in-place rewrite needs the same shape and live-block count")
        for n in names:
            getattr(self, n).copy_(getattr(new, n))


def make_luts(layout: np.ndarray, block_size: int, device) -> ConvLuts:
    lay = np.asarray(layout, dtype=bool)
    ci, kj = np.nonzero(lay)                                # row-major: the weight's block order
    e = np.arange(len(ci))
    by_col = np.lexsort((ci, kj))
    t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int32, device=device)   # noqa: E731
    col_ptr = np.concatenate([[0], np.cumsum(np.bincount(kj, minlength=lay.shape[1]))])
    row_ptr = np.concatenate([[0], np.cumsum(np.bincount(ci, minlength=lay.shape[0]))])
    return ConvLuts(block_size, t(col_ptr), t(e[by_col]), t(ci[by_col]), t(row_ptr), t(e), t(kj), t(ci), t(kj))


# The TMA kernels serve stride-1 convolutions of channels-last 16-bit tensors; False forces the
# pointer-load kernels everywhere (tests and benchmarks compare the two).
USE_TMA = True
DW_PROGRAMS = 264 * 4      # dW splits its pixels until about this many programs run (4 per SM x 2, H200)
DW_SMALL_M = 8192          # at or below this many output pixels an eager dW launches once, unsplit


def _knobs(dtype: torch.dtype) -> tuple:
    """What a plan depends on beyond its arguments: tl.dot's precision, the TMA switch and the
    tile tables' version (:func:`bstrain.kernels.tiles.override`)."""
    return precision(dtype), USE_TMA, tiles.version()


def _channels_last(t: torch.Tensor) -> bool:
    return t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def _allocator(shape, dtype: torch.dtype, device, channels_last: bool):
    """A function making outputs (N, C, H, W) in the chosen memory format."""
    N, C, H, W = shape
    if channels_last:
        return lambda: empty((N, H, W, C), dtype, device).permute(0, 3, 1, 2)
    return lambda: empty(shape, dtype, device)


def _nhwc(t: torch.Tensor):
    """t's (N, H, W, C) view for a TMA descriptor, or None where the TMA kernels don't apply
    (not channels-last, not 16-bit, misaligned)."""
    if not USE_TMA or t.dim() != 4 or t.dtype not in (torch.float16, torch.bfloat16):
        return None
    v = t.permute(0, 2, 3, 1)
    return v if v.is_contiguous() and tma_ok(v) else None


def _check_size(*tensors) -> None:
    """The kernels index in int32: every tensor must hold fewer than 2**31 elements."""
    for t in tensors:
        if t.numel() >= 2**31:
            raise ValueError(f"x: the convolution kernels take tensors of at most 2**31 - 1 elements, got one of "
                             f"{tuple(t.shape)}; split the batch")


def _tiles(N: int, P: int, Q: int, bm: int) -> tuple[int, int, int, int]:
    """(TN, TH, TW, tile count): spatial tiles of bm pixels, whole rows first, then images."""
    tw = min(triton.next_power_of_2(Q), bm)
    th = min(triton.next_power_of_2(P), bm // tw)
    tn = bm // (tw * th)
    return tn, th, tw, triton.cdiv(N, tn) * triton.cdiv(P, th) * triton.cdiv(Q, tw)


def _wt_template(wt: torch.Tensor):
    """The filters (nnz, kh, kw, in, out) as a (nnz·kh·kw·in, out) descriptor of (bs, bs) tiles
    (a template: each call sets its base to that call's filters)."""
    bs = wt.shape[-1]
    return desc_template(wt.view(-1, bs), [bs, bs])


def _tma_launch(a: torch.Tensor, y: torch.Tensor, bs: int, kernel: str, consts: dict, base, step, trans_b: bool):
    """(Launch of _conv_tma, template of a's NHWC descriptor, integer arguments) for y from a."""
    N, _, P, Q = y.shape
    tile = tiles.CONV(kernel, bs, a.element_size())
    tn, th, tw, n_tiles = _tiles(N, P, Q, tile.block_m)
    a_t = desc_template(a.permute(0, 2, 3, 1), [tn, th, tw, bs])
    launch = Launch(_conv_tma, (n_tiles, y.shape[1] // bs), a.device,
                    dict(consts, TN=tn, TH=th, TW=tw, TRANS_B=trans_b), num_warps=tile.warps, num_stages=tile.stages)
    return launch, a_t, (N, P, Q, *y.stride(), base[0], base[1], step[0], step[1])


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------
def conv_forward(x, wt, luts: ConvLuts, K: int, P: int, Q: int, stride, pads, dilation, bias=None):
    """y (N, K, P, Q) in x's memory format, plus bias (K,) of any float dtype if given.

    x: (N, C, H, W); wt: (nnz, kh, kw, bs, bs) contiguous; pads: (top, left); the bottom and
    right padding follow from P and Q.
    """
    stride, pads, dilation = tuple(stride), tuple(pads), tuple(dilation)
    dev = x.device
    key = ("fwd", x.shape, x.stride(), x.dtype, dev, wt.shape, K, P, Q, stride, pads, dilation,
           None if bias is None else bias.dtype, aligned(x, wt) if bias is None else aligned(x, wt, bias),
           _knobs(x.dtype))
    run = plan(luts.plans, key, lambda: _fwd_plan(x, wt, bias, luts, K, P, Q, stride, pads, dilation))
    return run(x, wt, bias)


def _fwd_plan(x, wt, bias, luts: ConvLuts, K, P, Q, stride, pads, dilation):
    N, C, H, W = x.shape
    bs, KH, KW = luts.block_size, wt.shape[1], wt.shape[2]
    alloc = _allocator((N, K, P, Q), x.dtype, x.device, _channels_last(x))
    y = alloc()                                   # a sample: fresh outputs are 16-byte aligned alike
    _check_size(x, y)
    if not (N * P * Q and K):
        return lambda x, wt, bias: alloc()
    w_t = _wt_template(wt)
    consts = dict(KH=KH, KW=KW, BS=bs, HAS_BIAS=bias is not None, PRECISION=precision(x.dtype))
    lists = (luts.col_ptr, luts.col_blk, luts.col_in)
    if stride == (1, 1) and _nhwc(x) is not None and _nhwc(y) is not None:
        launch, a_t, ints = _tma_launch(x, y, bs, "fwd_tma", consts, (-pads[0], -pads[1]), dilation, False)

        def run_tma(x, wt, bias):
            y = alloc()
            launch(desc_like(a_t, x), desc_like(w_t, wt), y, y if bias is None else bias, *lists, *ints)
            return y
        return run_tma
    tile = tiles.CONV("fwd", bs, x.element_size())
    M = N * P * Q
    launch = Launch(_conv_fwd, (triton.cdiv(M, tile.block_m), K // bs), x.device, dict(consts, BLOCK_M=tile.block_m),
                    num_warps=tile.warps, num_stages=tile.stages)
    ints = (M, P, Q, H, W, *x.stride(), *y.stride(), *stride, *pads, *dilation)

    def run(x, wt, bias):
        y = alloc()
        launch(x, desc_like(w_t, wt), y, y if bias is None else bias, *lists, *ints)
        return y
    return run


def conv_dx(dy, wt, luts: ConvLuts, C: int, H: int, W: int, stride, pads, dilation, like):
    """dx (N, C, H, W) in dy's dtype and ``like``'s memory format (x's)."""
    stride, pads, dilation = tuple(stride), tuple(pads), tuple(dilation)
    dev = dy.device
    key = ("dx", dy.shape, dy.stride(), dy.dtype, dev, wt.shape, C, H, W, stride, pads, dilation,
           like.stride(), aligned(dy, wt), _knobs(dy.dtype))
    run = plan(luts.plans, key, lambda: _dx_plan(dy, wt, luts, C, H, W, stride, pads, dilation, like))
    return run(dy, wt)


def _dx_plan(dy, wt, luts: ConvLuts, C, H, W, stride, pads, dilation, like):
    N, K, P, Q = dy.shape
    bs, KH, KW = luts.block_size, wt.shape[1], wt.shape[2]
    alloc = _allocator((N, C, H, W), dy.dtype, dy.device, _channels_last(like))
    dx = alloc()
    _check_size(dy, dx)
    M = N * H * W
    if not (M and C):
        return lambda dy, wt: alloc()
    w_t = _wt_template(wt)
    consts = dict(KH=KH, KW=KW, BS=bs, PRECISION=precision(dy.dtype))
    lists = (luts.row_ptr, luts.row_blk, luts.row_out)
    if stride == (1, 1) and _nhwc(dy) is not None and _nhwc(dx) is not None:
        launch, a_t, ints = _tma_launch(dy, dx, bs, "dx_tma", dict(consts, HAS_BIAS=False), pads,
                                        (-dilation[0], -dilation[1]), True)

        def run_tma(dy, wt):
            dx = alloc()
            launch(desc_like(a_t, dy), desc_like(w_t, wt), dx, dx, *lists, *ints)
            return dx
        return run_tma
    tile = tiles.CONV("dx", bs, dy.element_size())
    launch = Launch(_conv_dx, (triton.cdiv(M, tile.block_m), C // bs), dy.device, dict(consts, BLOCK_M=tile.block_m),
                    num_warps=tile.warps, num_stages=tile.stages)
    ints = (M, P, Q, H, W, *dy.stride(), *dx.stride(), *stride, *pads, *dilation)

    def run(dy, wt):
        dx = alloc()
        launch(dy, desc_like(w_t, wt), dx, *lists, *ints)
        return dx
    return run


def conv_dw(x, dy, luts: ConvLuts, KH: int, KW: int, stride, pads, dilation, dtype: torch.dtype = torch.float32,
            splits: int | None = None):
    """dW (nnz, bs_out, bs_in, KH, KW) in ``dtype`` (fp32 accumulation): the module's weight layout.

    splits: how many ways the N·P·Q reduction is split (None: chosen; tests force it). An eager
    call over few pixels (host-bound) runs unsplit: one launch, no workspace.
    """
    stride, pads, dilation = tuple(stride), tuple(pads), tuple(dilation)
    dev = x.device
    if splits is None and host_bound(dy.shape[0] * dy.shape[2] * dy.shape[3], DW_SMALL_M, x):
        splits = 1
    key = ("dw", x.shape, x.stride(), dy.shape, dy.stride(), x.dtype, dtype, dev, KH, KW, stride, pads,
           dilation, splits, aligned(x, dy), _knobs(x.dtype))
    run = plan(luts.plans, key, lambda: _dw_plan(x, dy, luts, KH, KW, stride, pads, dilation, dtype, splits))
    return run(x, dy)


def _dw_split(work: int, per_program: int, nnz_taps: int, splits: int | None) -> tuple[int, int]:
    """(splits, units per split) of ``work`` units (pixels or tiles), units rounded to per_program."""
    if splits is None:
        splits = max(1, min(triton.cdiv(work, 8 * per_program), triton.cdiv(DW_PROGRAMS, nnz_taps)))
    per = triton.cdiv(triton.cdiv(work, max(1, splits)), per_program) * per_program
    return triton.cdiv(work, per), per


def _dw_plan(x, dy, luts: ConvLuts, KH, KW, stride, pads, dilation, dtype, splits):
    N, C, H, W = x.shape
    _, K, P, Q = dy.shape
    bs, dev = luts.block_size, x.device
    nnz = luts.blk_in.numel()
    shape = (nnz, bs, bs, KH, KW)
    M = N * P * Q
    if not (nnz and M):
        return lambda x, dy: torch.zeros(shape, dtype=dtype, device=dev)
    # strides of (split, live block, tap, in, out) in the (nnz, out, in, KH, KW) weight layout
    sw = (nnz * bs * bs * KH * KW, bs * bs * KH * KW, 1, KH * KW, bs * KH * KW)
    consts = dict(KH=KH, KW=KW, BS=bs, PRECISION=precision(x.dtype))
    tma = stride == (1, 1) and _nhwc(x) is not None and _nhwc(dy) is not None
    tile = tiles.CONV("dw_tma" if tma else "dw", bs, x.element_size())
    BM, warps, stages = tile.block_m, tile.warps, tile.stages
    if tma:
        tn, th, tw, n_tiles = _tiles(N, P, Q, BM)
        splits, per = _dw_split(n_tiles, 1, nnz * KH * KW, splits)
        x_t, dy_t = (desc_template(t.permute(0, 2, 3, 1), [tn, th, tw, bs]) for t in (x, dy))
        launch = Launch(_conv_dw_tma, (nnz * KH * KW, splits), dev, dict(consts, TN=tn, TH=th, TW=tw),
                        num_warps=warps, num_stages=stages)
        ints = (P, Q, n_tiles, per, -pads[0], -pads[1], *dilation, *sw)

        def operands(x, dy):
            return desc_like(x_t, x), desc_like(dy_t, dy), luts.blk_in, luts.blk_out
    else:
        splits, per = _dw_split(M, BM, nnz * KH * KW, splits)
        launch = Launch(_conv_dw, (nnz * KH * KW, splits), dev, dict(consts, BLOCK_M=BM),
                        num_warps=warps, num_stages=stages)
        ints = (M, P, Q, H, W, per, *x.stride(), *dy.stride(), *stride, *pads, *dilation, *sw)

        def operands(x, dy):
            return x, dy, luts.blk_in, luts.blk_out
    if splits == 1:
        def run(x, dy):
            dw = empty(shape, dtype, dev)
            a, b, blk_in, blk_out = operands(x, dy)
            launch(a, b, dw, blk_in, blk_out, *ints)
            return dw
        return run

    def run_split(x, dy):
        part = empty((splits,) + shape, torch.float32, dev)         # fp32 partial sums
        a, b, blk_in, blk_out = operands(x, dy)
        launch(a, b, part, blk_in, blk_out, *ints)
        dw = part.sum(0)
        return dw if dtype == torch.float32 else dw.to(dtype)
    return run_split
