"""Triton kernel of rotary position embeddings on the heads of a fused projection, and its launcher.

x is (B, T, C) with C = n_heads·D (for a fused qkv projection, the q, k and v heads side by side);
the first ``rotated`` heads are rotated by their position t (rotate-half form: the pair (i, i +
D/2) of a head turns by t·θ_i, from the (T, D/2) cos/sin tables), the others are copied. The
projection's bias may ride along (added before the turn), so that the GEMM runs without it.

A program owns one head and walks every ``grid``-th tile of BLOCK_T rows. The inverse rotation
(the backward) is the same kernel with the sine negated; there it also sums its output over the
rows (SUM_COLS: the bias gradient, (programs, C) partials summed by the launcher). One kernel
serves both directions, and the rotated q and k never pass through fp32 in memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from bstrain.kernels._device import sm_count
from bstrain.kernels.alloc import empty
from bstrain.kernels.launch import Launch, aligned, plan


@triton.jit
def _rotary_kernel(X, COS, SIN, BIAS, Y, PART, N, T, s_x, C, half, rotated, sign,
                   HAS_BIAS: tl.constexpr, SUM_COLS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    head = tl.program_id(1)
    i = tl.arange(0, BLOCK_H)
    imask = i < half
    col = head * 2 * half + i
    if HAS_BIAS:
        bias_a = tl.load(BIAS + col, mask=imask, other=0.0).to(tl.float32)
        bias_b = tl.load(BIAS + col + half, mask=imask, other=0.0).to(tl.float32)
    sum_a = tl.zeros((BLOCK_H,), tl.float32)
    sum_b = tl.zeros((BLOCK_H,), tl.float32)
    for start in range(pid * BLOCK_T, N, grid * BLOCK_T):
        rows = start + tl.arange(0, BLOCK_T)
        mask = (rows < N)[:, None] & imask[None, :]
        r64 = rows.to(tl.int64)[:, None]
        a = tl.load(X + r64 * s_x + col[None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(X + r64 * s_x + col[None, :] + half, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            a += bias_a[None, :]
            b += bias_b[None, :]
        if head < rotated:
            t = (rows % T)[:, None]
            cos = tl.load(COS + t * half + i[None, :], mask=mask, other=0.0)
            sin = tl.load(SIN + t * half + i[None, :], mask=mask, other=0.0) * sign
            a, b = a * cos - b * sin, a * sin + b * cos
        tl.store(Y + r64 * C + col[None, :], a.to(Y.dtype.element_ty), mask=mask)
        tl.store(Y + r64 * C + col[None, :] + half, b.to(Y.dtype.element_ty), mask=mask)
        if SUM_COLS:
            sum_a += tl.sum(tl.where(mask, a, 0.0), axis=0)
            sum_b += tl.sum(tl.where(mask, b, 0.0), axis=0)
    if SUM_COLS:
        tl.store(PART + pid * C + col, sum_a, mask=imask)
        tl.store(PART + pid * C + col + half, sum_b, mask=imask)


_PLANS: dict = {}


def rotary_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, rotated: int,
                   inverse: bool = False, bias: torch.Tensor | None = None, sum_cols: bool = False):
    """x (B, T, C) with unit feature stride and rows of stride x.stride(1) (B·T rows of one stride);
    cos, sin (>= T, head_dim/2) fp32 contiguous; bias None or (C,) contiguous, added first.
    Returns y (B, T, C) contiguous in x's dtype: the first ``rotated`` heads of head_dim rotated by
    their position (by minus it when inverse), the rest copied; with sum_cols also y's fp32 (C,)
    sum over rows (else None)."""
    B, T, C = x.shape
    y = empty((B, T, C), x.dtype, x.device)
    N, half = B * T, head_dim // 2
    block_h = max(2, triton.next_power_of_2(half))
    block_t = max(1, min(64, 2048 // block_h))
    heads = C // head_dim
    programs = max(1, min(triton.cdiv(N, block_t),
                          (16 * sm_count(x.device)) // heads + 1 if x.is_cuda else 8))
    part = empty((programs, C), torch.float32, x.device) if sum_cols else None
    tensors = (x, cos, sin) if bias is None else (x, cos, sin, bias)
    key = (N, T, C, x.stride(1), x.dtype, head_dim, rotated, inverse, None if bias is None else bias.dtype, sum_cols,
           aligned(*tensors), x.device)

    def make():
        if not N:
            return None
        launch = Launch(_rotary_kernel, (programs, heads), x.device,
                        dict(HAS_BIAS=bias is not None, SUM_COLS=sum_cols, BLOCK_T=block_t, BLOCK_H=block_h),
                        num_warps=4)
        ints = (N, T, x.stride(1), C, half, rotated, -1.0 if inverse else 1.0)
        return lambda *t: launch(*t, *ints)
    run = plan(_PLANS, key, make)
    if run is not None:
        run(x, cos, sin, cos if bias is None else bias, y, y if part is None else part)
    elif part is not None:
        part.zero_()
    return y, None if part is None else part.sum(0)
