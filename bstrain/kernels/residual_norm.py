"""Triton kernels of the pre-LN transformer's residual step: a residual add and the next layer norm
in one pass each way.

    h = x + r + c        the residual stream after a sublayer (r: the sublayer's output, c: its output
                         projection's bias, left out of the GEMM; none at the start)
    y = LN(h)·w + b      the next sublayer's input

Forward: a program holds BLOCK_N whole rows (C <= MAX_C features) as one tile, adds, normalises and
writes h and y (in x's dtype) and fp32 (mean, rstd) per row; neither h nor y makes an fp32 round
trip through memory. Backward: dh = dh_out + LN'(dy), written once as the gradient of both x and r;
dc is its column sum. A program walks every ``grid``-th row tile and keeps its dw/db/dc partial
sums in registers, so the partials are (programs, C), not (row tiles, C).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from bstrain.kernels._device import sm_count
from bstrain.kernels.alloc import empty
from bstrain.kernels.jit_math import layer_norm_input_grad
from bstrain.kernels.launch import Launch, aligned, plan

TILE = 4096       # fp32 elements a program holds at once


@triton.jit
def _add_layer_norm_fwd_kernel(X, R, RB, W, B, H, Y, MEAN, RSTD, N, C, s_x, s_r, eps,
                               HAS_RES: tl.constexpr, HAS_RB: tl.constexpr, STORE_H: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_C)
    rmask = rows < N
    cmask = cols < C
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    h = tl.load(X + r64 * s_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h += tl.load(R + r64 * s_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RB:
            h += tl.load(RB + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        h = h.to(H.dtype.element_ty).to(tl.float32)         # normalise the stream as it is stored
    if STORE_H:
        tl.store(H + r64 * C + cols[None, :], h.to(H.dtype.element_ty), mask=mask)
    mean = tl.sum(h, axis=1) / C
    hc = tl.where(mask, h - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(hc * hc, axis=1) / C + eps)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    y = hc * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + r64 * C + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=rmask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def _add_layer_norm_bwd_kernel(H, W, DY, DH, DX, MEAN, RSTD, DW_PART, DB_PART, DC_PART, N, C, s_h,
                               HAS_DH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_C,), tl.float32)
    db = tl.zeros((BLOCK_C,), tl.float32)
    dc = tl.zeros((BLOCK_C,), tl.float32)
    for start in range(pid * BLOCK_N, N, grid * BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        rmask = rows < N
        mask = rmask[:, None] & cmask[None, :]
        r64 = rows.to(tl.int64)[:, None]
        h = tl.load(H + r64 * s_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + r64 * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=rmask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        xhat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
        dxhat = dy * w[None, :]
        dx = layer_norm_input_grad(dxhat, xhat, rstd, dxhat * xhat, dxhat, C)
        if HAS_DH:
            dx += tl.load(DH + r64 * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + r64 * C + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dc += tl.sum(tl.where(mask, dx, 0.0), axis=0)
    tl.store(DW_PART + pid * C + cols, dw, mask=cmask)
    tl.store(DB_PART + pid * C + cols, db, mask=cmask)
    tl.store(DC_PART + pid * C + cols, dc, mask=cmask)


_PLANS: dict = {}


def _geometry(N: int, C: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_C, warps): whole rows, about TILE elements per program."""
    block_c = triton.next_power_of_2(C)
    block_n = max(1, min(16, TILE // block_c))
    return block_n, block_c, 4 if block_c * block_n <= 4096 else 8


def _programs(N: int, block_n: int, device: torch.device) -> int:
    """Backward programs: enough row tiles in flight to keep memory busy (a persistent program
    waits on each tile's loads), few enough that the (programs, C) partials stay small."""
    return max(1, min(triton.cdiv(N, block_n), 16 * sm_count(device) if device.type == "cuda" else 64))


def add_layer_norm_forward(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, b: torch.Tensor, eps: float,
                           store_h: bool = True, rb: torch.Tensor | None = None):
    """x (N, C) and r (N, C) or None, unit feature stride; w, b and rb (r's bias, or None; only with
    r) (C,) contiguous. Returns (y (N, C), h (N, C) or None when r is None, mean (N,), rstd (N,)):
    y and h contiguous in x's dtype, statistics fp32."""
    N, C = x.shape
    y = empty((N, C), x.dtype, x.device)
    h = empty((N, C), x.dtype, x.device) if store_h and r is not None else None
    mean, rstd = empty((N,), torch.float32, x.device), empty((N,), torch.float32, x.device)
    has_res = r is not None
    operands = (x, w, b) if r is None else (x, r, w, b) if rb is None else (x, r, w, b, rb)
    key = ("fwd", N, C, x.stride(0), None if r is None else (r.stride(0), r.dtype), None if rb is None else rb.dtype,
           x.dtype, w.dtype, b.dtype, float(eps), h is not None, aligned(*operands), x.device)

    def make():
        if not N:
            return None
        block_n, block_c, warps = _geometry(N, C)
        launch = Launch(_add_layer_norm_fwd_kernel, (triton.cdiv(N, block_n),), x.device,
                        dict(HAS_RES=has_res, HAS_RB=rb is not None, STORE_H=h is not None, BLOCK_N=block_n,
                             BLOCK_C=block_c),
                        num_warps=warps)
        ints = (N, C, x.stride(0), r.stride(0) if has_res else 0, float(eps))
        return lambda *t: launch(*t, *ints)
    run = plan(_PLANS, key, make)
    if run is not None:
        run(x, x if r is None else r, w if rb is None else rb, w, b, y if h is None else h, y, mean, rstd)
    return y, h, mean, rstd


def add_layer_norm_backward(dy: torch.Tensor, dh: torch.Tensor | None, h: torch.Tensor, w: torch.Tensor,
                            mean: torch.Tensor, rstd: torch.Tensor, dx_dtype: torch.dtype):
    """dy (N, C) contiguous; dh None or (N, C) contiguous: the gradient reaching h directly; h (N,
    C) unit feature stride: the normalised stream. Returns (dx (N, C) in dx_dtype, dw, db, dc (C,)
    fp32, dc the column sum of dx: the gradient of a bias added to the stream)."""
    N, C = h.shape
    dx = empty((N, C), dx_dtype, h.device)
    block_n, block_c, warps = _geometry(N, C)
    programs = _programs(N, block_n, h.device)
    parts = empty((3, programs, C), torch.float32, h.device)
    key = ("bwd", N, C, h.stride(0), h.dtype, dy.dtype, None if dh is None else dh.dtype, w.dtype, dx_dtype,
           aligned(h, w, dy) if dh is None else aligned(h, w, dy, dh), h.device)

    def make():
        launch = Launch(_add_layer_norm_bwd_kernel, (programs,), h.device,
                        dict(HAS_DH=dh is not None, BLOCK_N=block_n, BLOCK_C=block_c), num_warps=warps)
        ints = (N, C, h.stride(0))
        return lambda *t: launch(*t, *ints)
    if N:
        plan(_PLANS, key, make)(h, w, dy, dy if dh is None else dh, dx, mean, rstd, parts[0], parts[1], parts[2])
    else:
        parts.zero_()
    return dx, parts[0].sum(0), parts[1].sum(0), parts[2].sum(0)    # separate storage each
