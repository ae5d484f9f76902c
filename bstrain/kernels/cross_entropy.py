"""Triton softmax cross-entropy over rows of logits, and its launchers.

Forward: a program owns BLOCK_N rows and streams their V logits in BLOCK_V-wide slices with an
online max and sum (base 2), writing each row's loss and log-sum-exp in fp32. Backward: the same
walk writes (softmax − onehot)·dloss straight in the logits' dtype. The logits are read in their
own dtype (bf16 under bf16 training) and never copied to fp32 in memory: one read forward, one
read and one write backward. A label outside [0, V) gives a NaN loss (no host sync to check it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from bstrain.kernels.alloc import empty
from bstrain.kernels.launch import Launch, aligned, plan

LOG2E = 1.4426950408889634


@triton.jit
def _xent_fwd_kernel(X, LABEL, LOSS, LSE, N, V, s_x, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    base = X + rows.to(tl.int64)[:, None] * s_x
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols[None, :], mask=rmask[:, None] & (cols < V)[None, :], other=float("-inf"))
        x = x.to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m, tl.max(x, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp2(m - m_use) + tl.sum(tl.exp2(x - m_use[:, None]), 1)
        m = m_new
    lse = (m + tl.log2(tl.where(rmask, s, 1.0))) / 1.4426950408889634    # natural log
    label = tl.load(LABEL + rows, mask=rmask, other=0).to(tl.int64)
    valid = (label >= 0) & (label < V)
    target = tl.load(X + rows.to(tl.int64) * s_x + label, mask=rmask & valid, other=0.0).to(tl.float32)
    tl.store(LOSS + rows, tl.where(valid, lse - target, float("nan")), mask=rmask)
    tl.store(LSE + rows, lse, mask=rmask)


@triton.jit
def _xent_bwd_kernel(X, LABEL, LSE, DLOSS, DX, N, V, s_x, s_d, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    r64 = rows.to(tl.int64)[:, None]
    lse = tl.load(LSE + rows, mask=rmask, other=0.0)
    dloss = tl.load(DLOSS + rows * s_d, mask=rmask, other=0.0).to(tl.float32)
    label = tl.load(LABEL + rows, mask=rmask, other=0).to(tl.int64)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        mask = rmask[:, None] & (cols < V)[None, :]
        x = tl.load(X + r64 * s_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse[:, None])
        g = (p - (cols[None, :] == label[:, None]).to(tl.float32)) * dloss[:, None]
        tl.store(DX + r64 * V + cols[None, :], g.to(DX.dtype.element_ty), mask=mask)


_PLANS: dict = {}


def _geometry(V: int) -> tuple[int, int]:
    block_v = min(triton.next_power_of_2(V), 2048)
    return max(1, min(64, 4096 // block_v)), block_v


def xent_forward(logits: torch.Tensor, labels: torch.Tensor):
    """logits (N, V) with unit column stride; labels (N,) contiguous integers. Returns (loss, lse),
    each (N,) fp32."""
    N, V = logits.shape
    loss, lse = empty((N,), torch.float32, logits.device), empty((N,), torch.float32, logits.device)
    key = ("fwd", N, V, logits.stride(0), logits.dtype, labels.dtype, aligned(logits, labels), logits.device)

    def make():
        if not N:
            return None
        block_n, block_v = _geometry(V)
        launch = Launch(_xent_fwd_kernel, (triton.cdiv(N, block_n),), logits.device,
                        dict(BLOCK_N=block_n, BLOCK_V=block_v), num_warps=4)
        return lambda *t: launch(*t, N, V, logits.stride(0))
    run = plan(_PLANS, key, make)
    if run is not None:
        run(logits, labels, loss, lse)
    return loss, lse


def xent_backward(dloss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor):
    """dloss (N,) any stride (a broadcast mean's gradient has stride 0). Returns dlogits (N, V)
    contiguous in the logits' dtype."""
    N, V = logits.shape
    dx = empty((N, V), logits.dtype, logits.device)
    key = ("bwd", N, V, logits.stride(0), dloss.stride(0) if N else 0, logits.dtype, labels.dtype, dloss.dtype,
           aligned(logits, labels, dloss), logits.device)

    def make():
        if not N:
            return None
        block_n, block_v = _geometry(V)
        launch = Launch(_xent_bwd_kernel, (triton.cdiv(N, block_n),), logits.device,
                        dict(BLOCK_N=block_n, BLOCK_V=block_v), num_warps=4)
        return lambda *t: launch(*t, N, V, logits.stride(0), dloss.stride(0))
    run = plan(_PLANS, key, make)
    if run is not None:
        run(logits, labels, lse, dloss, dx)
    return dx
