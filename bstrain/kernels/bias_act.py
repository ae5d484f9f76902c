"""Triton kernels of a bias add and GELU, ``y = gelu(x + b)`` (the exact, erf form), and its backward
with the bias gradient, and their launchers.

The FFN's first projection runs without its bias; this adds it on the way into the GELU. Forward:
a 2-D grid of (BLOCK_N, BLOCK_C) tiles. Backward: dx = dy·gelu'(x + b) from the saved x, and db,
the column sum of dx: a program owns a BLOCK_C slice of columns and walks every ``grid``-th row
tile, keeping its partial sums in registers ((programs, C) partials, summed by the launcher),
so no separate reduction pass reads dx again.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from bstrain.kernels._device import sm_count
from bstrain.kernels.alloc import empty
from bstrain.kernels.launch import Launch, aligned, plan

BLOCK_N, BLOCK_C = 16, 256


@triton.jit
def _bias_gelu_fwd_kernel(X, B, Y, N, C, s_x, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    mask = (rows < N)[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    z = tl.load(X + r64 * s_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z += tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    y = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    tl.store(Y + r64 * C + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(X, B, DY, DX, PART, N, C, s_x, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    bias = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    db = tl.zeros((BLOCK_C,), tl.float32)
    for start in range(pid * BLOCK_N, N, grid * BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        mask = (rows < N)[:, None] & cmask[None, :]
        r64 = rows.to(tl.int64)[:, None]
        z = tl.load(X + r64 * s_x + cols[None, :], mask=mask, other=0.0).to(tl.float32) + bias[None, :]
        dy = tl.load(DY + r64 * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
        pdf = tl.exp(-0.5 * z * z) * 0.3989422804014327
        dx = tl.where(mask, dy * (cdf + z * pdf), 0.0)
        tl.store(DX + r64 * C + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        db += tl.sum(dx, axis=0)
    tl.store(PART + pid * C + cols, db, mask=cmask)


_PLANS: dict = {}


def bias_gelu_forward(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x (N, C) with unit column stride, b (C,) contiguous. Returns gelu(x + b), (N, C) contiguous in x's dtype."""
    N, C = x.shape
    y = empty((N, C), x.dtype, x.device)
    key = ("fwd", N, C, x.stride(0), x.dtype, b.dtype, aligned(x, b), x.device)

    def make():
        if not N:
            return None
        launch = Launch(_bias_gelu_fwd_kernel, (triton.cdiv(N, BLOCK_N), triton.cdiv(C, BLOCK_C)), x.device,
                        dict(BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C), num_warps=4)
        return lambda *t: launch(*t, N, C, x.stride(0))
    run = plan(_PLANS, key, make)
    if run is not None:
        run(x, b, y)
    return y


def bias_gelu_backward(dy: torch.Tensor, x: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dy (N, C) contiguous; x, b as the forward's. Returns (dx (N, C) in x's dtype, db (C,) fp32)."""
    N, C = x.shape
    dx = empty((N, C), x.dtype, x.device)
    col_tiles = triton.cdiv(C, BLOCK_C)
    programs = max(1, min(triton.cdiv(N, BLOCK_N), (16 * sm_count(x.device)) // col_tiles + 1 if x.is_cuda else 8))
    part = empty((programs, C), torch.float32, x.device)
    key = ("bwd", N, C, x.stride(0), x.dtype, b.dtype, dy.dtype, aligned(x, b, dy), x.device)

    def make():
        launch = Launch(_bias_gelu_bwd_kernel, (programs, col_tiles), x.device,
                        dict(BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C), num_warps=4)
        return lambda *t: launch(*t, N, C, x.stride(0))
    if N:
        plan(_PLANS, key, make)(x, b, dy, dx, part)
    else:
        part.zero_()
    return dx, part.sum(0)
