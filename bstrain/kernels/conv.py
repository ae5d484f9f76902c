"""Implicit-GEMM Triton kernels for block-sparse 2-D convolution (no autograd here).

Activations x (N, C, H, W) and y (N, K, P, Q) with any strides (channels-last makes the channel
loads contiguous). A (C/bs, K/bs) layout's live blocks are numbered row-major (e); their filters
are passed as ``wt`` (nnz, kh, kw, bs_in, bs_out), contiguous, read through a TMA descriptor
(a pointer tile of (bs, bs) costs a register per element and spilled).

* ``_conv_fwd``: one program per (BLOCK_M output pixels, output block j) walks the live blocks
  of column j and the filter taps: acc += x[pixels shifted by the tap, block i] · wt[e, tap].
* ``_conv_dx``: one program per (BLOCK_M input pixels, input block i) walks the blocks of row i
  and the taps: dx += dy[the output pixel that tap reaches, block j] · wt[e, tap]ᵀ, where the
  stride divides.
* ``_conv_dw``: one program per (live block, tap, pixel split) reduces x[shifted]ᵀ · dy over its
  share of the N·P·Q output pixels into an fp32 partial; the launcher sums the splits.

Stride-1 convolutions of channels-last 16-bit tensors take ``_conv_tma`` (forward and dX) and
``_conv_dw_tma`` instead: the activations are read as TMA boxes of a spatial tile (TN images x TH
rows x TW columns) shifted by the tap, the box's zero fill standing in for the padding, so the
loop carries no per-pixel address or mask arithmetic. Other strides, NCHW and fp32 take the
pointer-load kernels above. Timings: benchmarks/conv.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bstrain.kernels.alloc import empty
from bstrain.kernels.matmul import _precision, _tma_ok


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
def _conv_fwd(X, WT, Y, col_ptr, col_blk, col_in, M, P, Q, H, W,
              sxn, sxc, sxh, sxw, syn, syc, syp, syq,
              st_h, st_w, pad_h, pad_w, dl_h, dl_w,
              KH: tl.constexpr, KW: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
              PRECISION: tl.constexpr):
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
def _conv_dw(X, DY, DWP, blk_in, blk_out, M, P, Q, H, W, per_split,
             sxn, sxc, sxh, sxw, sdn, sdc, sdp, sdq,
             st_h, st_w, pad_h, pad_w, dl_h, dl_w,
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
    tl.store(DWP + ((split * tl.num_programs(0) + et) * BS + c[:, None]) * BS + c[None, :], acc)


@triton.jit
def _tile(pid, P, Q, TN: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr):
    """The first (n, p, q) of spatial tile ``pid`` of TN images x TH rows x TW columns."""
    tiles_q = tl.cdiv(Q, TW)
    tiles_p = tl.cdiv(P, TH)
    return (pid // (tiles_q * tiles_p)) * TN, ((pid // tiles_q) % tiles_p) * TH, (pid % tiles_q) * TW


@triton.jit
def _conv_tma(A, WT, Y, ptr, blk, other, N, P, Q, syn, syc, syp, syq, base_h, base_w, step_h, step_w,
              KH: tl.constexpr, KW: tl.constexpr, BS: tl.constexpr, TN: tl.constexpr, TH: tl.constexpr,
              TW: tl.constexpr, TRANS_B: tl.constexpr, PRECISION: tl.constexpr):
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
    m = tl.arange(0, BM)
    n = n0 + m // (TH * TW)
    p = p0 + (m // TW) % TH
    q = q0 + m % TW
    c = tl.arange(0, BS)
    out = Y + (n * syn + p * syp + q * syq)[:, None] + (j * BS + c)[None, :] * syc
    tl.store(out, acc.to(Y.dtype.element_ty), mask=((n < N) & (p < P) & (q < Q))[:, None])


@triton.jit
def _conv_dw_tma(X, DY, DWP, blk_in, blk_out, P, Q, tiles, per_split, base_h, base_w, dl_h, dl_w,
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
    c = tl.arange(0, BS)
    tl.store(DWP + ((split * tl.num_programs(0) + et) * BS + c[:, None]) * BS + c[None, :], acc)


# ---------------------------------------------------------------------------------------------
@dataclass
class ConvLuts:
    """A (C/bs, K/bs) layout's lists on one device: by output column (forward) and by input row (dX)."""
    block_size: int
    col_ptr: torch.Tensor     # (K/bs + 1,) int32
    col_blk: torch.Tensor     # live block index (row-major number) of each column entry
    col_in: torch.Tensor      # its input block
    row_ptr: torch.Tensor     # (C/bs + 1,) int32
    row_blk: torch.Tensor
    row_out: torch.Tensor
    blk_in: torch.Tensor      # (nnz,) input block of each live block
    blk_out: torch.Tensor     # (nnz,) output block


def make_luts(layout: np.ndarray, block_size: int, device) -> ConvLuts:
    lay = np.asarray(layout, dtype=bool)
    ci, kj = np.nonzero(lay)                                # row-major: the weight's block order
    e = np.arange(len(ci))
    by_col = np.lexsort((ci, kj))
    t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int32, device=device)   # noqa: E731
    col_ptr = np.concatenate([[0], np.cumsum(np.bincount(kj, minlength=lay.shape[1]))])
    row_ptr = np.concatenate([[0], np.cumsum(np.bincount(ci, minlength=lay.shape[0]))])
    return ConvLuts(block_size, t(col_ptr), t(e[by_col]), t(ci[by_col]), t(row_ptr), t(e), t(kj), t(ci), t(kj))


def _out(shape, like):
    """An output (N, C, H, W) in ``like``'s memory format (channels-last or contiguous)."""
    N, C, H, W = shape
    if like.dim() == 4 and like.is_contiguous(memory_format=torch.channels_last) and not like.is_contiguous():
        return empty((N, H, W, C), like.dtype, like.device).permute(0, 3, 1, 2)
    return empty(shape, like.dtype, like.device)


def _wt_desc(wt: torch.Tensor) -> TensorDescriptor:
    """The filters (nnz, kh, kw, in, out) as a (nnz·kh·kw·in, out) TMA descriptor of (bs, bs) tiles."""
    bs = wt.shape[-1]
    return TensorDescriptor.from_tensor(wt.view(-1, bs), [bs, bs])


def _check_size(*tensors) -> None:
    """The kernels index in int32: every tensor must hold fewer than 2**31 elements."""
    for t in tensors:
        if t.numel() >= 2**31:
            raise ValueError(f"x: the convolution kernels take tensors of at most 2**31 - 1 elements, got one of "
                             f"{tuple(t.shape)}; split the batch")


# (BLOCK_M, num_warps, num_stages) per (kernel, block size); CONFIGS overrides config()'s guess
# (scripts/tune_conv.py sweeps it on the GPU; the guesses are untimed).
CONFIGS: dict[tuple[str, int, int], tuple[int, int, int]] = {}


def config(kernel: str, bs: int, itemsize: int = 2) -> tuple[int, int, int]:
    """(BLOCK_M, num_warps, num_stages) of ``kernel`` in {"fwd", "dx", "dw"} (pointer loads) or
    {"fwd_tma", "dx_tma", "dw_tma"} (stride 1, channels-last, 16-bit) at block size bs and
    element size ``itemsize`` (fp32 tiles take twice the shared memory: fewer stages)."""
    hit = CONFIGS.get((kernel, bs, itemsize))
    if hit is not None:
        return hit
    if kernel.endswith("_tma"):                        # H200 sweep, 2026-11-30 (scripts/tune_conv.py)
        if bs >= 128:
            return 128, 8, 2
        if kernel == "dw_tma":
            return (128, 4, 4) if bs >= 64 else (128, 4, 3)
        return 128, 4, 2
    if itemsize == 4 or bs >= 128:
        return 64, 8 if bs >= 128 else 4, 2
    if kernel == "dw":                                  # H200 sweep, 2026-11-30 (benchmarks/conv.md)
        return (128, 8, 3) if bs >= 64 else (64, 4, 2)
    return 128, 4, 3


# The TMA kernels serve stride-1 convolutions of channels-last 16-bit tensors; False forces the
# pointer-load kernels everywhere (tests and benchmarks compare the two).
USE_TMA = True


def _nhwc(t: torch.Tensor):
    """t's (N, H, W, C) view for a TMA descriptor, or None where the TMA kernels don't apply
    (not channels-last, not 16-bit, misaligned)."""
    if not USE_TMA or t.dim() != 4 or t.dtype not in (torch.float16, torch.bfloat16):
        return None
    v = t.permute(0, 2, 3, 1)
    return v if v.is_contiguous() and _tma_ok(v) else None


def _tiles(N: int, P: int, Q: int, bm: int) -> tuple[int, int, int, int]:
    """(TN, TH, TW, tile count): spatial tiles of bm pixels, whole rows first, then images."""
    tw = min(triton.next_power_of_2(Q), bm)
    th = min(triton.next_power_of_2(P), bm // tw)
    tn = bm // (tw * th)
    return tn, th, tw, triton.cdiv(N, tn) * triton.cdiv(P, th) * triton.cdiv(Q, tw)


def _tma_conv(a, wt, y, ptr, blk, other, bs, base, step, trans_b, kernel):
    """Launch _conv_tma: y (N, ·, P, Q) channels-last from A (N, ·, H, W) channels-last."""
    N, _, P, Q = y.shape
    KH, KW = wt.shape[1], wt.shape[2]
    BM, warps, stages = config(kernel, bs, a.element_size())
    tn, th, tw, tiles = _tiles(N, P, Q, BM)
    desc = TensorDescriptor.from_tensor(a.permute(0, 2, 3, 1), [tn, th, tw, bs])
    _conv_tma[(tiles, y.shape[1] // bs)](
        desc, _wt_desc(wt), y, ptr, blk, other, N, P, Q, *y.stride(), base[0], base[1], step[0], step[1],
        KH=KH, KW=KW, BS=bs, TN=tn, TH=th, TW=tw, TRANS_B=trans_b, PRECISION=_precision(a.dtype),
        num_warps=warps, num_stages=stages)


def conv_forward(x, wt, luts: ConvLuts, K: int, P: int, Q: int, stride, pads, dilation):
    """y (N, K, P, Q) like x's memory format; wt (nnz, kh, kw, bs, bs) contiguous; pads (top, left)."""
    N, C, H, W = x.shape
    bs = luts.block_size
    KH, KW = wt.shape[1], wt.shape[2]
    y = _out((N, K, P, Q), x)
    _check_size(x, y)
    M = N * P * Q
    BM, warps, stages = config("fwd", bs, x.element_size())
    if M and K and tuple(stride) == (1, 1) and _nhwc(x) is not None and _nhwc(y) is not None:
        _tma_conv(x, wt, y, luts.col_ptr, luts.col_blk, luts.col_in, bs, (-pads[0], -pads[1]), dilation, False,
                  "fwd_tma")
    elif M and K:
        _conv_fwd[(triton.cdiv(M, BM), K // bs)](
            x, _wt_desc(wt), y, luts.col_ptr, luts.col_blk, luts.col_in, M, P, Q, H, W, *x.stride(), *y.stride(),
            stride[0], stride[1], pads[0], pads[1], dilation[0], dilation[1], KH=KH, KW=KW, BS=bs, BLOCK_M=BM,
            PRECISION=_precision(x.dtype), num_warps=warps,
            num_stages=stages)
    return y


def conv_dx(dy, wt, luts: ConvLuts, C: int, H: int, W: int, stride, pads, dilation, like):
    """dx (N, C, H, W) in ``like``'s memory format."""
    N, K, P, Q = dy.shape
    bs = luts.block_size
    KH, KW = wt.shape[1], wt.shape[2]
    dx = _out((N, C, H, W), like).to(dy.dtype) if like.dtype != dy.dtype else _out((N, C, H, W), like)
    _check_size(dy, dx)
    M = N * H * W
    BM, warps, stages = config("dx", bs, dy.element_size())
    if M and C and tuple(stride) == (1, 1) and _nhwc(dy) is not None and _nhwc(dx) is not None:
        _tma_conv(dy, wt, dx, luts.row_ptr, luts.row_blk, luts.row_out, bs, pads, (-dilation[0], -dilation[1]), True,
                  "dx_tma")
    elif M and C:
        _conv_dx[(triton.cdiv(M, BM), C // bs)](
            dy, _wt_desc(wt), dx, luts.row_ptr, luts.row_blk, luts.row_out, M, P, Q, H, W, *dy.stride(),
            *dx.stride(),
            stride[0], stride[1], pads[0], pads[1], dilation[0], dilation[1], KH=KH, KW=KW, BS=bs, BLOCK_M=BM,
            PRECISION=_precision(dy.dtype), num_warps=warps,
            num_stages=stages)
    return dx


def conv_dw(x, dy, luts: ConvLuts, KH: int, KW: int, stride, pads, dilation):
    """dW (nnz, bs_out, bs_in, KH, KW) fp32, the module's weight layout."""
    N, C, H, W = x.shape
    _, K, P, Q = dy.shape
    bs = luts.block_size
    nnz = luts.blk_in.numel()
    M = N * P * Q
    if nnz and M and tuple(stride) == (1, 1) and _nhwc(x) is not None and _nhwc(dy) is not None:
        BM, warps, stages = config("dw_tma", bs, x.element_size())
        tn, th, tw, tiles = _tiles(N, P, Q, BM)
        splits = max(1, min(triton.cdiv(tiles, 8), triton.cdiv(264 * 4, nnz * KH * KW)))
        per = triton.cdiv(tiles, splits)
        splits = triton.cdiv(tiles, per)
        part = empty((splits, nnz * KH * KW, bs, bs), torch.float32, x.device)
        _conv_dw_tma[(nnz * KH * KW, splits)](
            TensorDescriptor.from_tensor(x.permute(0, 2, 3, 1), [tn, th, tw, bs]),
            TensorDescriptor.from_tensor(dy.permute(0, 2, 3, 1), [tn, th, tw, bs]), part, luts.blk_in, luts.blk_out,
            P, Q, tiles, per, -pads[0], -pads[1], dilation[0], dilation[1], KH=KH, KW=KW, BS=bs, TN=tn, TH=th,
            TW=tw, PRECISION=_precision(x.dtype), num_warps=warps, num_stages=stages)
        dw = part.sum(0)
        return dw.view(nnz, KH, KW, bs, bs).permute(0, 4, 3, 1, 2)
    BM, warps, stages = config("dw", bs, x.element_size())
    splits = max(1, min(triton.cdiv(M, 8 * BM), triton.cdiv(264 * 4, max(1, nnz * KH * KW))))
    per = triton.cdiv(triton.cdiv(M, splits), BM) * BM
    splits = triton.cdiv(M, per) if M else 1
    part = empty((splits, nnz * KH * KW, bs, bs), torch.float32, x.device)
    if nnz and M:
        _conv_dw[(nnz * KH * KW, splits)](
            x, dy, part, luts.blk_in, luts.blk_out, M, P, Q, H, W, per, *x.stride(), *dy.stride(),
            stride[0], stride[1], pads[0], pads[1], dilation[0], dilation[1], KH=KH, KW=KW, BS=bs, BLOCK_M=BM,
            PRECISION=_precision(x.dtype), num_warps=warps,
            num_stages=stages)
        dw = part.sum(0)
    else:
        dw = torch.zeros((nnz * KH * KW, bs, bs), dtype=torch.float32, device=x.device)
    # (nnz, KH, KW, in, out) -> (nnz, out, in, KH, KW)
    return dw.view(nnz, KH, KW, bs, bs).permute(0, 4, 3, 1, 2)
