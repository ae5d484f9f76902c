"""Triton kernels for block-sparse attention (flash-style: the scores are never stored).

Notation: q is (B, Tq, H·D), k and v (B, Tk, H·D); bs the block size; a layout's live blocks are
numbered head by head, row-major within a head. Each live block is full, or partial with a
(bs, bs) element mask; only partial blocks have a stored mask.

* ``_attn_fwd``: one program per (head, query block) row and batch element walks the row's live
  key blocks with an online softmax (base 2), and writes O and the row's log-sum-exp (LSE, base
  2; +inf for a query with no live key, whose output is 0).
* ``_attn_bwd_dkdv``: one program per (head, key block) column walks the query blocks that attend
  to it, recomputing P from the LSE: dV = Pᵀ·dO, dK = dSᵀ·Q·scale.
* ``_attn_bwd_dq``: one program per row, as the forward: dQ = dS·K·scale.
with dS = P ∘ (dP − Δ), dP = dO·Vᵀ, Δ = rowsum(dO ∘ O).

Status: checked in the interpreter (fp32, fp16) against float64; not yet compiled or timed on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from bstrain.kernels.alloc import empty
from bstrain.kernels.matmul import _precision

LOG2E = 1.4426950408889634


@triton.jit
def _tile(X, b, s_b, s_t, blk, h, head_dim, BS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The (BS, BLOCK_D) tile of block ``blk`` of head h, batch b (zeros past head_dim)."""
    r = tl.arange(0, BS)
    d = tl.arange(0, BLOCK_D)
    return tl.load(X + b * s_b + (blk * BS + r)[:, None] * s_t + h * head_dim + d[None, :],
                   mask=(d < head_dim)[None, :], other=0.0)


@triton.jit
def _store_tile(X, val, b, s_b, s_t, blk, h, head_dim, BS: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.arange(0, BS)
    d = tl.arange(0, BLOCK_D)
    tl.store(X + b * s_b + (blk * BS + r)[:, None] * s_t + h * head_dim + d[None, :], val.to(X.dtype.element_ty),
             mask=(d < head_dim)[None, :])


@triton.jit
def _masked_scores(q, k, b, j, p_idx, PMASK, PAD, k_ctx, qk_scale, BS: tl.constexpr, HAS_PAD: tl.constexpr,
                   PRECISION: tl.constexpr):
    """(BS, BS) scores q·kᵀ·qk_scale with the block's element mask and the key padding as -inf."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    r = tl.arange(0, BS)
    if p_idx >= 0:
        keep = tl.load(PMASK + p_idx.to(tl.int64) * (BS * BS) + r[:, None] * BS + r[None, :])
        s = tl.where(keep != 0, s, float("-inf"))
    if HAS_PAD:
        pad = tl.load(PAD + b * k_ctx + j * BS + r)
        s = tl.where(pad[None, :] == 0, s, float("-inf"))
    return s


@triton.jit
def _p_and_ds(q, k, v, do, lse, delta, b, j, p_idx, PMASK, PAD, k_ctx, qk_scale, BS: tl.constexpr,
              HAS_PAD: tl.constexpr, PRECISION: tl.constexpr):
    """P recomputed from the row LSE, and dS = P ∘ (dO·Vᵀ − Δ), for one (query, key) block pair."""
    s = _masked_scores(q, k, b, j, p_idx, PMASK, PAD, k_ctx, qk_scale, BS, HAS_PAD, PRECISION)
    p = tl.exp2(s - lse[:, None])
    return p, p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, row_ptr, row_kblk, row_pidx, PMASK, PAD,
              s_qb, s_qt, s_kb, s_kt, s_ob, s_ot, n_qblk, q_ctx, k_ctx, head_dim, qk_scale,
              BS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_PAD: tl.constexpr, PRECISION: tl.constexpr):
    row = tl.program_id(0)
    b = tl.program_id(1)
    h = row // n_qblk
    i = row % n_qblk
    r = tl.arange(0, BS)
    q = _tile(Q, b, s_qb, s_qt, i, h, head_dim, BS, BLOCK_D)
    m_i = tl.full((BS,), float("-inf"), tl.float32)
    l_i = tl.zeros((BS,), tl.float32)
    acc = tl.zeros((BS, BLOCK_D), tl.float32)
    for e in range(tl.load(row_ptr + row), tl.load(row_ptr + row + 1)):
        j = tl.load(row_kblk + e)
        p_idx = tl.load(row_pidx + e)
        k = _tile(K, b, s_kb, s_kt, j, h, head_dim, BS, BLOCK_D)
        v = _tile(V, b, s_kb, s_kt, j, h, head_dim, BS, BLOCK_D)
        s = _masked_scores(q, k, b, j, p_idx, PMASK, PAD, k_ctx, qk_scale, BS, HAS_PAD, PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    _store_tile(O, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], b, s_ob, s_ot, i, h, head_dim, BS, BLOCK_D)
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("inf"))
    tl.store(LSE + (b * tl.num_programs(0) + row) * BS + r, lse)       # (B, H·nq·bs): row-major stats


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, col_ptr, col_qblk, col_pidx, PMASK, PAD,
                   s_qb, s_qt, s_kb, s_kt, n_qblk, n_kblk, k_ctx, head_dim, qk_scale, scale,
                   BS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_PAD: tl.constexpr, PRECISION: tl.constexpr):
    col = tl.program_id(0)
    b = tl.program_id(1)
    h = col // n_kblk
    j = col % n_kblk
    r = tl.arange(0, BS)
    k = _tile(K, b, s_kb, s_kt, j, h, head_dim, BS, BLOCK_D)
    v = _tile(V, b, s_kb, s_kt, j, h, head_dim, BS, BLOCK_D)
    dk = tl.zeros((BS, BLOCK_D), tl.float32)
    dv = tl.zeros((BS, BLOCK_D), tl.float32)
    n_rows = tl.num_programs(0) // n_kblk * n_qblk               # heads x query blocks
    for e in range(tl.load(col_ptr + col), tl.load(col_ptr + col + 1)):
        i = tl.load(col_qblk + e)
        p_idx = tl.load(col_pidx + e)
        q = _tile(Q, b, s_qb, s_qt, i, h, head_dim, BS, BLOCK_D)
        do = _tile(DO, b, s_qb, s_qt, i, h, head_dim, BS, BLOCK_D)
        stat = (b * n_rows + h * n_qblk + i) * BS + r
        lse = tl.load(LSE + stat)
        delta = tl.load(DELTA + stat)
        p, ds = _p_and_ds(q, k, v, do, lse, delta, b, j, p_idx, PMASK, PAD, k_ctx, qk_scale, BS, HAS_PAD, PRECISION)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    _store_tile(DK, dk * scale, b, s_kb, s_kt, j, h, head_dim, BS, BLOCK_D)
    _store_tile(DV, dv, b, s_kb, s_kt, j, h, head_dim, BS, BLOCK_D)


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, row_ptr, row_kblk, row_pidx, PMASK, PAD,
                 s_qb, s_qt, s_kb, s_kt, n_qblk, k_ctx, head_dim, qk_scale, scale,
                 BS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_PAD: tl.constexpr, PRECISION: tl.constexpr):
    row = tl.program_id(0)
    b = tl.program_id(1)
    h = row // n_qblk
    i = row % n_qblk
    r = tl.arange(0, BS)
    q = _tile(Q, b, s_qb, s_qt, i, h, head_dim, BS, BLOCK_D)
    do = _tile(DO, b, s_qb, s_qt, i, h, head_dim, BS, BLOCK_D)
    stat = (b * tl.num_programs(0) + row) * BS + r
    lse = tl.load(LSE + stat)
    delta = tl.load(DELTA + stat)
    dq = tl.zeros((BS, BLOCK_D), tl.float32)
    for e in range(tl.load(row_ptr + row), tl.load(row_ptr + row + 1)):
        j = tl.load(row_kblk + e)
        p_idx = tl.load(row_pidx + e)
        k = _tile(K, b, s_kb, s_kt, j, h, head_dim, BS, BLOCK_D)
        v = _tile(V, b, s_kb, s_kt, j, h, head_dim, BS, BLOCK_D)
        _, ds = _p_and_ds(q, k, v, do, lse, delta, b, j, p_idx, PMASK, PAD, k_ctx, qk_scale, BS, HAS_PAD, PRECISION)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    _store_tile(DQ, dq * scale, b, s_qb, s_qt, i, h, head_dim, BS, BLOCK_D)


# ---------------------------------------------------------------------------------------------
@dataclass
class AttnLuts:
    """Row and column lists of one layout on one device (see the module docstring)."""
    block_size: int
    heads: int
    q_blocks: int
    k_blocks: int
    row_ptr: torch.Tensor     # (H*nq + 1,) int32
    row_kblk: torch.Tensor    # (nnz,) int32: key block of each entry (row order = block order)
    row_pidx: torch.Tensor    # (nnz,) int32: partial-mask index, -1 for full blocks
    col_ptr: torch.Tensor     # (H*nk + 1,) int32
    col_qblk: torch.Tensor    # (nnz,) int32: query block of each entry, by column
    col_pidx: torch.Tensor    # (nnz,) int32
    pmask: torch.Tensor       # (n_partial, bs, bs) int8


def make_luts(h_idx: np.ndarray, q_idx: np.ndarray, k_idx: np.ndarray, partial_idx: np.ndarray,
              partial_masks: np.ndarray, heads: int, q_blocks: int, k_blocks: int, block_size: int,
              device) -> AttnLuts:
    """Blocks in head-major, row-major order (as BlocksparseTransformer numbers them)."""
    def t(a):
        return torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int32, device=device)
    rows = h_idx * q_blocks + q_idx
    row_ptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=heads * q_blocks))])
    cols = h_idx * k_blocks + k_idx
    order = np.lexsort((q_idx, cols))
    col_ptr = np.concatenate([[0], np.cumsum(np.bincount(cols, minlength=heads * k_blocks))])
    pm = np.ascontiguousarray(partial_masks, dtype=np.int8) if len(partial_masks) else \
        np.ones((1, block_size, block_size), np.int8)
    return AttnLuts(block_size, heads, q_blocks, k_blocks, t(row_ptr), t(k_idx), t(partial_idx),
                    t(col_ptr), t(q_idx[order]), t(partial_idx[order]), torch.as_tensor(pm, device=device))


def _warps(bs: int, D: int) -> int:
    """8 warps for large tiles (an fp32 (bs, D) accumulator of 64x128 and up), else 4. Untuned."""
    return 8 if bs * D >= 64 * 128 else 4


def _pad_arg(pad, like):
    return (pad.to(torch.int8).contiguous(), True) if pad is not None else (like, False)


def attention_forward(q, k, v, luts: AttnLuts, scale: float, pad=None):
    """q (B, Tq, H·D), k, v (B, Tk, H·D) contiguous, one dtype; pad (B, Tk) bool (True = padding)
    or None. Returns (O like q, LSE (B, H·nq·bs) fp32, base 2)."""
    B, Tq, HD = q.shape
    D, bs = HD // luts.heads, luts.block_size
    o = empty(q.shape, q.dtype, q.device)
    lse = empty((B, luts.heads * Tq), torch.float32, q.device)
    pad_t, has_pad = _pad_arg(pad, luts.pmask)
    if B and luts.heads * luts.q_blocks:
        _attn_fwd[(luts.heads * luts.q_blocks, B)](
            q, k, v, o, lse, luts.row_ptr, luts.row_kblk, luts.row_pidx, luts.pmask, pad_t,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), o.stride(0), o.stride(1),
            luts.q_blocks, Tq, k.shape[1], D, scale * LOG2E,
            BS=bs, BLOCK_D=max(16, triton.next_power_of_2(D)), HAS_PAD=has_pad, PRECISION=_precision(q.dtype),
            num_warps=_warps(bs, D))
    return o, lse


def attention_backward(do, q, k, v, o, lse, luts: AttnLuts, scale: float, pad=None):
    """(dq, dk, dv) of :func:`attention_forward`."""
    B, Tq, HD = q.shape
    H, bs = luts.heads, luts.block_size
    D = HD // H
    do = do.contiguous()
    delta = (do.float() * o.float()).view(B, Tq, H, D).sum(-1).transpose(1, 2).contiguous()   # (B, H, Tq)
    dq = empty(q.shape, q.dtype, q.device)
    dk = empty(k.shape, k.dtype, k.device)
    dv = empty(v.shape, v.dtype, v.device)
    pad_t, has_pad = _pad_arg(pad, luts.pmask)
    meta = dict(BS=bs, BLOCK_D=max(16, triton.next_power_of_2(D)), HAS_PAD=has_pad, PRECISION=_precision(q.dtype),
                num_warps=_warps(bs, D))
    if B and H * luts.k_blocks:
        _attn_bwd_dkdv[(H * luts.k_blocks, B)](
            q, k, v, do, lse, delta, dk, dv, luts.col_ptr, luts.col_qblk, luts.col_pidx, luts.pmask, pad_t,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), luts.q_blocks, luts.k_blocks, k.shape[1], D,
            scale * LOG2E, scale, **meta)
    if B and H * luts.q_blocks:
        _attn_bwd_dq[(H * luts.q_blocks, B)](
            q, k, v, do, lse, delta, dq, luts.row_ptr, luts.row_kblk, luts.row_pidx, luts.pmask, pad_t,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), luts.q_blocks, k.shape[1], D,
            scale * LOG2E, scale, **meta)
    return dq, dk, dv
