"""Triton kernels for block-sparse attention (flash-style: the scores are never stored).

Notation: q is (B, Tq, H·D), k (B, Tk, Hk·D) and v (B, Tk, Hk·Dv) with Hk dividing H
(grouped-query attention: query head h reads k/v head h // G, G = H/Hk); bs the layout's block
size. A live block is full, or partial with a (bs, bs) element mask. Rows of q, k, v may be
strided (the chunks of a fused qkv projection); features are contiguous (:func:`kernel_inputs`).
Options: ALiBi (the logit of query i and key j gains slope_h·(j − i)), tanh soft-capping of
scale·q·k, and a gradient of the LSE (it shifts Δ).

**Tiles.** The kernels do not work on layout blocks but on tiles of (BO, BI) elements that divide
them: BO rows of the *outer* operand a program holds (queries in the forward and dQ kernels,
keys in the dK/dV kernel) against BI rows of the *inner* one it streams. A layout is re-cut into
tile lists once per tile shape (:class:`TileLuts`): a tile wholly outside its block's element
mask is dropped, a wholly kept one becomes full, and a partial tile is either *triangular*
(kept where ``q − k ≥ d`` in tile coordinates, as causal diagonals are; no memory read) or a
bit mask read from a table. Each outer row lists its full tiles first, then the triangular ones,
then those with a table, so the kernels run three loops (full, triangular, table) and only the
last one reads masks. Rows are launched batch element by batch element and head by head (the
programs in flight read the same inner rows, from L2), heaviest first within a head to shorten
the tail; inner tiles are read through tensor descriptors (TMA) where the inputs allow.

* ``_attn_fwd``: one program per (head, query tile) row and batch element walks the row's key
  tiles with an online softmax (base 2), and writes O and the row's log-sum-exp (LSE, base 2;
  +inf for a query with no live key, whose output is 0).
* ``_attn_bwd_dq``: one program per query tile, as the forward: Δ = rowsum(dO ∘ O) (stored for
  the next kernel), then dQ = dS·K·scale with dS = P ∘ (dP − Δ), dP = dO·Vᵀ, P from the LSE.
* ``_attn_bwd_dkdv``: one program per (head, key tile) column walks the query tiles that attend
  to it: dV = Pᵀ·dO, dK = dSᵀ·Q·scale. Padded keys get zero gradients. With G > 1 each query
  head writes its share to an fp32 (B, Tk, H·D) buffer that the launcher sums per group.

Tile shapes, warps and pipeline stages per (kernel, block size, dtype, head dim) come from
``bstrain.kernels.tiles.ATTENTION`` (:func:`bstrain.kernels.tiles.override` changes them;
scripts/tune/tune_attention.py sweeps them).

**Launches** go through :mod:`bstrain.kernels.launch`: :func:`launch` keeps one ``Launch`` per
kernel and everything the JIT specialises on (:func:`_pass_key`) on the layout's
:class:`AttnLuts`, so an eager call after the first hands its arguments straight to the compiled
kernel. Nothing on this path syncs with the host (CUDA-graph capture is safe).
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
from bstrain.kernels.launch import Launch, aligned, plan

LOG2E = 1.4426950408889634
_TRI = -(1 << 20)       # a masked tile's code: >= 0 indexes the mask table; _TRI + d is triangular
TRI = tl.constexpr(_TRI)
LOG2E_C = tl.constexpr(LOG2E)            # log2(e) inside the kernels


@triton.jit
def _rows(X, base, s_t, start, N: tl.constexpr, BLOCK_D: tl.constexpr, head_dim, EVEN_D: tl.constexpr):
    """Rows start..start+N of one head (columns past head_dim read as 0). Offsets in int64: one
    batch element's T · row stride may pass 2**31 (long contexts, fused qkv views)."""
    r = (start + tl.arange(0, N)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ptr = X + base + r[:, None] * s_t + d[None, :]
    if EVEN_D:
        return tl.load(ptr)
    return tl.load(ptr, mask=(d < head_dim)[None, :], other=0.0)


@triton.jit
def _inner(X, DESC, base, s_t, row0, col0, start, N: tl.constexpr, BLOCK_D: tl.constexpr, head_dim,
           EVEN_D: tl.constexpr, TMA: tl.constexpr):
    """An inner tile: rows start..start+N, through the tensor descriptor DESC (a 2-D view of X
    whose rows are (batch, position): row0 the batch's first row, col0 the head's first column)
    or by pointers."""
    if TMA:
        return DESC.load([row0 + start, col0])
    return _rows(X, base, s_t, start, N, BLOCK_D, head_dim, EVEN_D)


@triton.jit
def _store_rows(X, val, base, s_t, start, N: tl.constexpr, BLOCK_D: tl.constexpr, head_dim,
                EVEN_D: tl.constexpr):
    r = (start + tl.arange(0, N)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ptr = X + base + r[:, None] * s_t + d[None, :]
    if EVEN_D:
        tl.store(ptr, val.to(X.dtype.element_ty))
    else:
        tl.store(ptr, val.to(X.dtype.element_ty), mask=(d < head_dim)[None, :])


@triton.jit
def _keep(code, PMASK, BO: tl.constexpr, BI: tl.constexpr, MODE: tl.constexpr, TRANS: tl.constexpr):
    """(BO, BI) element mask of a masked tile. MODE 1: q − k ≥ d in tile coordinates (d = code −
    TRI; TRANS: the outer index is the key). MODE 2: row ``code`` of the bit table, BI bits of
    each of the BO rows in 32-bit words (loading a 2-D int8 mask instead costs a layout change
    through shared memory, and spills)."""
    o = tl.arange(0, BO)
    i = tl.arange(0, BI)
    if MODE == 1:
        if TRANS:
            return (i[None, :] - o[:, None]) >= code - TRI
        return (o[:, None] - i[None, :]) >= code - TRI
    NW: tl.constexpr = (BI + 31) // 32
    row = PMASK + code.to(tl.int64) * (BO * NW) + o * NW
    keep = tl.zeros((BO, BI), tl.int32)
    for w in tl.static_range(NW):
        bits = tl.load(row + w)
        keep |= tl.where((i // 32 == w)[None, :], (bits[:, None] >> (i % 32)[None, :]) & 1, 0)
    return keep != 0


@triton.jit
def _logits(s, qk_scale, cap, slope, ostart, istart, BO: tl.constexpr, BI: tl.constexpr, TRANS: tl.constexpr,
            SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """(x, t): the base-2 logits of raw scores s = q·kᵀ (BO, BI) and, under SOFTCAP, t =
    tanh(scale·s / cap). x = log2(e)·(scale·s, or cap·t under SOFTCAP, + slope·(key − query)
    under ALIBI); ``cap`` and ``slope`` arrive multiplied by log2(e), qk_scale is scale·log2(e).
    TRANS: the outer index is the key (the dK/dV kernel)."""
    if SOFTCAP:
        # tanh(y) = 1 − 2 / (1 + e^{2y}), y = scale·s / cap: exact at ±inf, no tanh instruction needed
        t = 1.0 - 2.0 / (1.0 + tl.exp2(s * (2.0 * qk_scale / cap * LOG2E_C)))
        x = t * cap
    else:
        t = s
        x = s * qk_scale
    if ALIBI:
        o = ostart + tl.arange(0, BO)
        i = istart + tl.arange(0, BI)
        if TRANS:
            x += slope * (o[:, None] - i[None, :]).to(tl.float32)
        else:
            x += slope * (i[None, :] - o[:, None]).to(tl.float32)
    return x, t


@triton.jit
def _slope(SLOPES, h, ALIBI: tl.constexpr):
    """Head h's ALiBi slope in base-2 units (0 without ALiBi)."""
    slope = 0.0
    if ALIBI:
        slope = tl.load(SLOPES + h) * LOG2E_C                       # natural units -> base 2
    return slope


@triton.jit
def _program_row(ORDER, PTR, MID, TAB, H, n_outer, BO: tl.constexpr):
    """This program's batch element, head, first outer position and its row's entry bounds: full
    tiles [e0, e1), triangular [e1, e2), with a mask table [e2, e3). Programs run batch element by
    batch element and, within one, in ORDER (head by head): the programs in flight share their
    heads' inner rows in L2."""
    pid = tl.program_id(0)
    rows = H * n_outer
    row = tl.load(ORDER + pid % rows)
    return (pid // rows, row // n_outer, (row % n_outer) * BO, tl.load(PTR + row), tl.load(MID + row),
            tl.load(TAB + row), tl.load(PTR + row + 1))


@triton.jit
def _fwd_loop(acc, l_i, m_i, q, K, V, DK, DV, k_base, v_base, s_kt, s_vt, kv_row0, k_col0, v_col0, INNER, CODE,
              e0, e1, PMASK, PAD, pad_base, start, qk_scale, cap, slope, head_dim, head_dim_v,
              BO: tl.constexpr, BI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, MODE: tl.constexpr, HAS_PAD: tl.constexpr,
              SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
              TMA: tl.constexpr):
    for e in tl.range(e0, e1, num_stages=NUM_STAGES):
        n = tl.load(INNER + e)
        k = _inner(K, DK, k_base, s_kt, kv_row0, k_col0, n * BI, BI, BLOCK_D, head_dim, EVEN_D, TMA)
        v = _inner(V, DV, v_base, s_vt, kv_row0, v_col0, n * BI, BI, BLOCK_DV, head_dim_v, EVEN_DV, TMA)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        x, _t = _logits(s, qk_scale, cap, slope, start, n * BI, BO, BI, False, SOFTCAP, ALIBI)
        if MODE > 0:
            x = tl.where(_keep(tl.load(CODE + e), PMASK, BO, BI, MODE, False), x, float("-inf"))
        if HAS_PAD:
            pad = tl.load(PAD + pad_base + n * BI + tl.arange(0, BI))
            x = tl.where(pad[None, :] == 0, x, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(x, 1))
        if MODE > 0 or HAS_PAD:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)     # a row with nothing kept yet
        else:
            m_use = m_new
        p = tl.exp2(x - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, SLOPES, DK, DV, ORDER, PTR, MID, TAB, INNER, CODE, PMASK, PAD,
              s_qb, s_qt, s_kb, s_kt, s_vb, s_vt, s_ob, s_ot, B, H, G, n_outer, Tq, Tk, head_dim, head_dim_v,
              qk_scale, cap,
              BO: tl.constexpr, BI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr,
              EVEN_DV: tl.constexpr, HAS_PAD: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
              PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr, TMA: tl.constexpr):
    b, h, start, e0, e1, e2, e3 = _program_row(ORDER, PTR, MID, TAB, H, n_outer, BO)
    q = _rows(Q, b.to(tl.int64) * s_qb + h * head_dim, s_qt, start, BO, BLOCK_D, head_dim, EVEN_D)
    hk = h // G                                                     # G query heads share a k/v head
    k_base = b.to(tl.int64) * s_kb + hk * head_dim
    v_base = b.to(tl.int64) * s_vb + hk * head_dim_v
    kv_row0 = b * Tk
    pad_base = b.to(tl.int64) * Tk
    slope = _slope(SLOPES, h, ALIBI)
    m_i = tl.full((BO,), float("-inf"), tl.float32)
    l_i = tl.zeros((BO,), tl.float32)
    acc = tl.zeros((BO, BLOCK_DV), tl.float32)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, K, V, DK, DV, k_base, v_base, s_kt, s_vt, kv_row0, hk * head_dim,
                              hk * head_dim_v, INNER, CODE, e0, e1, PMASK, PAD, pad_base, start, qk_scale, cap, slope,
                              head_dim, head_dim_v, BO, BI, BLOCK_D, BLOCK_DV, EVEN_D, EVEN_DV, 0, HAS_PAD, SOFTCAP,
                              ALIBI, PRECISION, NUM_STAGES, TMA)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, K, V, DK, DV, k_base, v_base, s_kt, s_vt, kv_row0, hk * head_dim,
                              hk * head_dim_v, INNER, CODE, e1, e2, PMASK, PAD, pad_base, start, qk_scale, cap, slope,
                              head_dim, head_dim_v, BO, BI, BLOCK_D, BLOCK_DV, EVEN_D, EVEN_DV, 1, HAS_PAD, SOFTCAP,
                              ALIBI, PRECISION, NUM_STAGES, TMA)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, K, V, DK, DV, k_base, v_base, s_kt, s_vt, kv_row0, hk * head_dim,
                              hk * head_dim_v, INNER, CODE, e2, e3, PMASK, PAD, pad_base, start, qk_scale, cap, slope,
                              head_dim, head_dim_v, BO, BI, BLOCK_D, BLOCK_DV, EVEN_D, EVEN_DV, 2, HAS_PAD, SOFTCAP,
                              ALIBI, PRECISION, NUM_STAGES, TMA)
    live = l_i > 0
    l_safe = tl.where(live, l_i, 1.0)
    _store_rows(O, acc / l_safe[:, None], b.to(tl.int64) * s_ob + h * head_dim_v, s_ot, start, BO, BLOCK_DV,
                head_dim_v, EVEN_DV)
    lse = tl.where(live, m_i + tl.log2(l_safe), float("inf"))
    tl.store(LSE + (b.to(tl.int64) * H + h) * Tq + start + tl.arange(0, BO), lse)     # (B, H, Tq)


@triton.jit
def _dq_loop(dq, q, do, lse, delta, K, V, DK, DV, k_base, v_base, s_kt, s_vt, kv_row0, k_col0, v_col0, INNER, CODE,
             e0, e1, PMASK, PAD, pad_base, start, qk_scale, cap, slope, head_dim, head_dim_v,
             BO: tl.constexpr, BI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
             EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, MODE: tl.constexpr, HAS_PAD: tl.constexpr,
             SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
             TMA: tl.constexpr):
    for e in tl.range(e0, e1, num_stages=NUM_STAGES):
        n = tl.load(INNER + e)
        k = _inner(K, DK, k_base, s_kt, kv_row0, k_col0, n * BI, BI, BLOCK_D, head_dim, EVEN_D, TMA)
        v = _inner(V, DV, v_base, s_vt, kv_row0, v_col0, n * BI, BI, BLOCK_DV, head_dim_v, EVEN_DV, TMA)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        x, t = _logits(s, qk_scale, cap, slope, start, n * BI, BO, BI, False, SOFTCAP, ALIBI)
        if MODE > 0:
            x = tl.where(_keep(tl.load(CODE + e), PMASK, BO, BI, MODE, False), x, float("-inf"))
        if HAS_PAD:
            pad = tl.load(PAD + pad_base + n * BI + tl.arange(0, BI))
            x = tl.where(pad[None, :] == 0, x, float("-inf"))
        p = tl.exp2(x - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, O, DO, LSE, DELTA, DQ, SLOPES, DLSE, DK, DV, ORDER, PTR, MID, TAB, INNER, CODE, PMASK, PAD,
                 s_qb, s_qt, s_kb, s_kt, s_vb, s_vt, s_ob, s_ot, B, H, G, n_outer, Tq, Tk, head_dim, head_dim_v,
                 qk_scale, cap, scale,
                 BO: tl.constexpr, BI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, HAS_PAD: tl.constexpr, SOFTCAP: tl.constexpr,
                 ALIBI: tl.constexpr, HAS_DLSE: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
                 TMA: tl.constexpr):
    """Also writes Δ = rowsum(dO ∘ O) − dLSE for :func:`_attn_bwd_dkdv` (o and do share strides,
    dq is contiguous)."""
    b, h, start, e0, e1, e2, e3 = _program_row(ORDER, PTR, MID, TAB, H, n_outer, BO)
    o_base = b.to(tl.int64) * s_ob + h * head_dim_v
    q = _rows(Q, b.to(tl.int64) * s_qb + h * head_dim, s_qt, start, BO, BLOCK_D, head_dim, EVEN_D)
    do = _rows(DO, o_base, s_ot, start, BO, BLOCK_DV, head_dim_v, EVEN_DV)
    o = _rows(O, o_base, s_ot, start, BO, BLOCK_DV, head_dim_v, EVEN_DV)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    stat = (b.to(tl.int64) * H + h) * Tq + start + tl.arange(0, BO)
    if HAS_DLSE:                                  # ∂lse/∂s = P: a gradient of the LSE shifts Δ
        delta -= tl.load(DLSE + stat)
    tl.store(DELTA + stat, delta)
    lse = tl.load(LSE + stat)
    hk = h // G
    k_base = b.to(tl.int64) * s_kb + hk * head_dim
    v_base = b.to(tl.int64) * s_vb + hk * head_dim_v
    kv_row0 = b * Tk
    pad_base = b.to(tl.int64) * Tk
    slope = _slope(SLOPES, h, ALIBI)
    dq = tl.zeros((BO, BLOCK_D), tl.float32)
    dq = _dq_loop(dq, q, do, lse, delta, K, V, DK, DV, k_base, v_base, s_kt, s_vt, kv_row0, hk * head_dim,
                  hk * head_dim_v, INNER, CODE, e0, e1, PMASK, PAD, pad_base, start, qk_scale, cap, slope, head_dim,
                  head_dim_v, BO, BI, BLOCK_D, BLOCK_DV, EVEN_D, EVEN_DV, 0, HAS_PAD, SOFTCAP, ALIBI, PRECISION,
                  NUM_STAGES, TMA)
    dq = _dq_loop(dq, q, do, lse, delta, K, V, DK, DV, k_base, v_base, s_kt, s_vt, kv_row0, hk * head_dim,
                  hk * head_dim_v, INNER, CODE, e1, e2, PMASK, PAD, pad_base, start, qk_scale, cap, slope, head_dim,
                  head_dim_v, BO, BI, BLOCK_D, BLOCK_DV, EVEN_D, EVEN_DV, 1, HAS_PAD, SOFTCAP, ALIBI, PRECISION,
                  NUM_STAGES, TMA)
    dq = _dq_loop(dq, q, do, lse, delta, K, V, DK, DV, k_base, v_base, s_kt, s_vt, kv_row0, hk * head_dim,
                  hk * head_dim_v, INNER, CODE, e2, e3, PMASK, PAD, pad_base, start, qk_scale, cap, slope, head_dim,
                  head_dim_v, BO, BI, BLOCK_D, BLOCK_DV, EVEN_D, EVEN_DV, 2, HAS_PAD, SOFTCAP, ALIBI, PRECISION,
                  NUM_STAGES, TMA)
    _store_rows(DQ, dq * scale, b.to(tl.int64) * Tq * H * head_dim + h * head_dim, H * head_dim, start, BO, BLOCK_D,
                head_dim, EVEN_D)


@triton.jit
def _dkdv_loop(dk, dv, k, v, Q, DO, DQD, DOD, LSE, DELTA, q_base, s_qt, o_base, s_ot, q_row0, q_col0, o_col0,
               stat_base, INNER, CODE, e0, e1, PMASK, start, qk_scale, cap, slope, head_dim, head_dim_v,
               BO: tl.constexpr, BI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, MODE: tl.constexpr, SOFTCAP: tl.constexpr,
               ALIBI: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr, TMA: tl.constexpr):
    for e in tl.range(e0, e1, num_stages=NUM_STAGES):
        n = tl.load(INNER + e)
        q = _inner(Q, DQD, q_base, s_qt, q_row0, q_col0, n * BI, BI, BLOCK_D, head_dim, EVEN_D, TMA)
        do = _inner(DO, DOD, o_base, s_ot, q_row0, o_col0, n * BI, BI, BLOCK_DV, head_dim_v, EVEN_DV, TMA)
        stat = stat_base + n * BI + tl.arange(0, BI)
        lse = tl.load(LSE + stat)
        delta = tl.load(DELTA + stat)
        st = tl.dot(k, tl.trans(q), input_precision=PRECISION)                     # (keys, queries)
        xt, tt = _logits(st, qk_scale, cap, slope, start, n * BI, BO, BI, True, SOFTCAP, ALIBI)
        if MODE > 0:
            xt = tl.where(_keep(tl.load(CODE + e), PMASK, BO, BI, MODE, True), xt, float("-inf"))
        pt = tl.exp2(xt - lse[None, :])
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dst = pt * (dpt - delta[None, :])
        if SOFTCAP:
            dst = dst * (1.0 - tt * tt)
        dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, SLOPES, DQD, DOD, ORDER, PTR, MID, TAB, INNER, CODE, PMASK, PAD,
                   s_qb, s_qt, s_kb, s_kt, s_vb, s_vt, s_ob, s_ot, B, H, G, n_outer, Tq, Tk, head_dim, head_dim_v,
                   qk_scale, cap, scale,
                   BO: tl.constexpr, BI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, HAS_PAD: tl.constexpr, SOFTCAP: tl.constexpr,
                   ALIBI: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr, TMA: tl.constexpr):
    """dK, dV of query head h's use of its k/v head h // G, into (B, Tk, H·D) and (B, Tk, H·Dv),
    contiguous: the caller sums the G heads of a group (G == 1: dK, dV themselves). DO has O's
    strides (s_ob, s_ot). (dQ through atomic additions here instead of a second kernel was
    slower on the H200 at every head dim: benchmarks/attention.md.)"""
    b, h, start, e0, e1, e2, e3 = _program_row(ORDER, PTR, MID, TAB, H, n_outer, BO)
    hk = h // G
    k = _rows(K, b.to(tl.int64) * s_kb + hk * head_dim, s_kt, start, BO, BLOCK_D, head_dim, EVEN_D)
    v = _rows(V, b.to(tl.int64) * s_vb + hk * head_dim_v, s_vt, start, BO, BLOCK_DV, head_dim_v, EVEN_DV)
    q_base = b.to(tl.int64) * s_qb + h * head_dim
    o_base = b.to(tl.int64) * s_ob + h * head_dim_v            # dO
    q_row0 = b * Tq
    stat_base = (b.to(tl.int64) * H + h) * Tq
    slope = _slope(SLOPES, h, ALIBI)
    dk = tl.zeros((BO, BLOCK_D), tl.float32)
    dv = tl.zeros((BO, BLOCK_DV), tl.float32)
    dk, dv = _dkdv_loop(dk, dv, k, v, Q, DO, DQD, DOD, LSE, DELTA, q_base, s_qt, o_base, s_ot, q_row0, h * head_dim,
                        h * head_dim_v, stat_base, INNER, CODE, e0, e1, PMASK, start, qk_scale, cap, slope, head_dim,
                        head_dim_v, BO, BI, BLOCK_D, BLOCK_DV, EVEN_D, EVEN_DV, 0, SOFTCAP, ALIBI, PRECISION,
                        NUM_STAGES, TMA)
    dk, dv = _dkdv_loop(dk, dv, k, v, Q, DO, DQD, DOD, LSE, DELTA, q_base, s_qt, o_base, s_ot, q_row0, h * head_dim,
                        h * head_dim_v, stat_base, INNER, CODE, e1, e2, PMASK, start, qk_scale, cap, slope, head_dim,
                        head_dim_v, BO, BI, BLOCK_D, BLOCK_DV, EVEN_D, EVEN_DV, 1, SOFTCAP, ALIBI, PRECISION,
                        NUM_STAGES, TMA)
    dk, dv = _dkdv_loop(dk, dv, k, v, Q, DO, DQD, DOD, LSE, DELTA, q_base, s_qt, o_base, s_ot, q_row0, h * head_dim,
                        h * head_dim_v, stat_base, INNER, CODE, e2, e3, PMASK, start, qk_scale, cap, slope, head_dim,
                        head_dim_v, BO, BI, BLOCK_D, BLOCK_DV, EVEN_D, EVEN_DV, 2, SOFTCAP, ALIBI, PRECISION,
                        NUM_STAGES, TMA)
    if HAS_PAD:                                   # a padded key is in no softmax: zero gradients
        kept = tl.load(PAD + b.to(tl.int64) * Tk + start + tl.arange(0, BO)) == 0
        dk = tl.where(kept[:, None], dk, 0.0)
        dv = tl.where(kept[:, None], dv, 0.0)
    _store_rows(DK, dk * scale, b.to(tl.int64) * Tk * H * head_dim + h * head_dim, H * head_dim, start, BO, BLOCK_D,
                head_dim, EVEN_D)
    _store_rows(DV, dv, b.to(tl.int64) * Tk * H * head_dim_v + h * head_dim_v, H * head_dim_v, start, BO, BLOCK_DV,
                head_dim_v, EVEN_DV)


def _bits(m: np.ndarray) -> np.ndarray:
    """(R, C) bool -> (R, ceil(C/32)) int32 words, bit c % 32 of word c // 32."""
    r, c = m.shape
    padded = np.zeros((r, -(-c // 32) * 32), bool)
    padded[:, :c] = m
    words = (padded.reshape(r, -1, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1)
    return words.astype(np.uint32).view(np.int32)


def _classify(m: np.ndarray) -> tuple[str, int]:
    """A (rows = queries, cols = keys) bool tile: ("dead"|"full"|"tri"|"table", d for "tri")."""
    if not m.any():
        return "dead", 0
    if m.all():
        return "full", 0
    diff = np.arange(m.shape[0])[:, None] - np.arange(m.shape[1])[None, :]
    d = int(diff[m].min())
    return ("tri", d) if np.array_equal(m, diff >= d) else ("table", 0)


@dataclass
class TileLuts:
    """One layout cut into (BO, BI) tiles for one kernel direction, on one device."""
    n_outer: int              # outer tiles per head
    order: torch.Tensor       # (H·n_outer,) int32: outer rows, head by head, heaviest first in a head
    ptr: torch.Tensor         # (H·n_outer + 1,) int32: row r's entries are ptr[r]:ptr[r+1] ...
    mid: torch.Tensor         # (H·n_outer,) int32: ... full ones before mid[r], then triangular ones,
    tab: torch.Tensor         # (H·n_outer,) int32: ... then from tab[r] on those with a mask table
    inner: torch.Tensor       # (entries,) int32: inner tile index of each entry
    code: torch.Tensor        # (entries,) int32: -1 full, >= 0 mask table row, TRI + d triangular
    pmask: torch.Tensor       # (tables or 1, BO, ceil(BI/32)) int32: bit c of word w of row r keeps
                              # (outer r, inner 32·w + c)


@dataclass
class AttnLuts:
    """A layout's live blocks (head-major, row-major, as BlocksparseTransformer numbers them) on
    one device; :meth:`tiles` cuts them per tile shape, on first use."""
    block_size: int
    heads: int
    q_blocks: int
    k_blocks: int
    h_idx: np.ndarray
    q_idx: np.ndarray
    k_idx: np.ndarray
    partial_idx: np.ndarray   # (nnz,) -1 for full blocks, else a row of partial_masks
    partial_masks: np.ndarray  # (n_partial, bs, bs) bool
    device: torch.device
    _cache: dict = field(default_factory=dict, repr=False)
    plans: dict = field(default_factory=dict, repr=False)    # launch plans by argument shapes (launch.plan)

    @property
    def plain(self) -> bool:
        """Every partial block is triangular (as causal diagonals are): no mask table."""
        used = np.unique(self.partial_idx[self.partial_idx >= 0])
        return all(_classify(self.partial_masks[p])[0] != "table" for p in used)

    def tiles(self, by_key: bool, bo: int, bi: int) -> TileLuts:
        """Tile lists with queries (by_key False) or keys (True) as the outer operand."""
        key = (by_key, bo, bi)
        hit = self._cache.get(key)
        if hit is None:
            with torch.inference_mode(False):        # tables outlive the call: never inference tensors
                hit = self._cache[key] = self._cut(by_key, bo, bi)
        return hit

    def _cut(self, by_key: bool, bo: int, bi: int) -> TileLuts:
        bs = self.block_size
        so, si = bs // bo, bs // bi
        n_out_blocks = self.k_blocks if by_key else self.q_blocks
        out_blk, in_blk = (self.k_idx, self.q_idx) if by_key else (self.q_idx, self.k_idx)
        a, c = np.meshgrid(np.arange(so), np.arange(si), indexing="ij")
        a, c = a.ravel(), c.ravel()                                  # tile (a, c) of a block
        # every tile of every live block, then the partial blocks' tiles reclassified
        rows = ((self.h_idx * n_out_blocks + out_blk)[:, None] * so + a[None, :]).ravel()
        inner = (in_blk[:, None] * si + c[None, :]).ravel()
        code = np.full(rows.shape, -1, np.int64)
        tables: list[np.ndarray] = []
        seen: dict[bytes, int] = {}
        classes = {}
        for p in np.unique(self.partial_idx[self.partial_idx >= 0]):
            m = self.partial_masks[p]
            out = []
            for aa, cc in zip(a, c):
                if by_key:                                           # rows = queries in m
                    sub = m[cc * bi:(cc + 1) * bi, aa * bo:(aa + 1) * bo]
                else:
                    sub = m[aa * bo:(aa + 1) * bo, cc * bi:(cc + 1) * bi]
                kind, d = _classify(sub)
                if kind == "table":
                    t = _bits(sub.T if by_key else sub)
                    idx = seen.setdefault(t.tobytes(), len(tables))
                    if idx == len(tables):
                        tables.append(t)
                    out.append(idx)
                else:
                    out.append({"dead": -2, "full": -1, "tri": _TRI + d}[kind])
            classes[p] = np.array(out, np.int64)
        per_tile = so * si
        for n in np.nonzero(self.partial_idx >= 0)[0]:
            code[n * per_tile:(n + 1) * per_tile] = classes[self.partial_idx[n]]
        keep = code != -2
        rows, inner, code = rows[keep], inner[keep], code[keep]
        kind = np.where(code == -1, 0, np.where(code >= 0, 2, 1))             # full, triangular, table
        order = np.lexsort((inner, kind, rows))
        rows, inner, code, kind = rows[order], inner[order], code[order], kind[order]
        n_rows = self.heads * n_out_blocks * so
        count = np.bincount(rows, minlength=n_rows)
        n_full = np.bincount(rows[kind == 0], minlength=n_rows)
        n_tri = np.bincount(rows[kind == 1], minlength=n_rows)
        ptr = np.concatenate([[0], np.cumsum(count)])
        cost = n_full + 1.1 * n_tri + 1.5 * (count - n_full - n_tri)
        # head by head (the rows in flight read the same inner rows: L2 hits, where a global
        # heaviest-first order streamed every head's keys at once from memory); heaviest first
        # within a head, to shorten the tail
        launch = np.lexsort((-cost, np.arange(n_rows) // (n_out_blocks * so)))

        def t(x):
            return torch.as_tensor(np.ascontiguousarray(x), dtype=torch.int32, device=self.device)
        pm = np.stack(tables) if tables else np.zeros((1, bo, (bi + 31) // 32), np.int32)
        return TileLuts(n_out_blocks * so, t(launch), t(ptr), t(ptr[:-1] + n_full), t(ptr[:-1] + n_full + n_tri),
                        t(inner), t(code),
                        torch.as_tensor(pm, device=self.device))


def make_luts(h_idx: np.ndarray, q_idx: np.ndarray, k_idx: np.ndarray, partial_idx: np.ndarray,
              partial_masks: np.ndarray, heads: int, q_blocks: int, k_blocks: int, block_size: int,
              device) -> AttnLuts:
    """Blocks in head-major, row-major order (as BlocksparseTransformer numbers them)."""
    arr = lambda x: np.asarray(x, dtype=np.int64)      # noqa: E731
    return AttnLuts(block_size, heads, q_blocks, k_blocks, arr(h_idx), arr(q_idx), arr(k_idx), arr(partial_idx),
                    np.asarray(partial_masks, dtype=bool), torch.device(device))


_KERNELS = {"fwd": (_attn_fwd, False), "dq": (_attn_bwd_dq, False), "dkdv": (_attn_bwd_dkdv, True)}
# the tensor arguments the inner loop streams (index, "d" for q/k's head dim or "dv" for v's):
# tensor descriptors replace them under TMA
_DESCS = {"fwd": ((1, "d"), (2, "dv")), "dq": ((1, "d"), (2, "dv")), "dkdv": ((0, "d"), (3, "dv"))}


def kernel_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """q, k, v as the kernels take them: unit last stride. Views such as the chunks of a fused
    qkv projection are taken as they are; anything else is copied."""
    return tuple(t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))


def _pass_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor | None, mods: tuple,
              *inputs: torch.Tensor) -> tuple:
    """What the plans of one pass are keyed by, besides the kernel: everything the JIT specialises
    on. The shapes and strides of q (B, Tq, H·D), k (B, Tk, Hk·D) and v (B, Tk, Hk·Dv)
    (:func:`kernel_inputs`; outputs are contiguous), which fix every integer argument; the dtype;
    the padding mask's presence; ``mods`` (softcap, ALiBi, an LSE gradient: on or off); the
    16-byte alignment of the inputs (outputs are fresh allocations, always aligned); tl.dot's
    precision; the tile tables' version."""
    B, Tq, HD = q.shape
    dtype = q.dtype
    return (B, Tq, k.shape[1], HD, k.shape[2], v.shape[2], *q.stride()[:2], *k.stride()[:2], *v.stride()[:2],
            dtype, pad is not None, mods, aligned(*inputs) if pad is None else aligned(pad, *inputs), precision(dtype),
            tiles.version())


def _desc_ok(t: torch.Tensor, rows: int, width: int) -> bool:
    """t (B, T, width) read as a 2-D (B·T, width) tensor descriptor: its batches follow each
    other and its base and rows are 16-byte aligned."""
    B, T, _ = t.shape
    return (B == 1 or t.stride(0) == T * t.stride(1)) and tma_ok(t.as_strided((rows, width), (t.stride(1), 1)))


def _plan(kind: str, luts: AttnLuts, key: tuple, tensors: tuple):
    """(Launch, tile tables, integer arguments, descriptor templates or None) of ``kind`` for a
    :func:`_pass_key`, or None for an empty grid."""
    fn, by_key = _KERNELS[kind]
    B, Tq, Tk, HD, HDk, HDv, s_qb, s_qt, s_kb, s_kt, s_vb, s_vt, dtype, has_pad, mods = key[:15]
    softcap, alibi, dlse = mods
    H = luts.heads
    D = HD // H
    Hk = HDk // D
    Dv = HDv // Hk
    block_d, block_dv = (max(16, triton.next_power_of_2(x)) for x in (D, Dv))
    tile = tiles.ATTENTION(kind, luts.block_size, dtype.itemsize, max(block_d, block_dv), plain=luts.plain)
    bo, bi = tile.block_m, tile.block_n
    t = luts.tiles(by_key, bo, bi)
    if not B * H * t.n_outer:
        return None
    templates = None
    if tile.tma and luts.device.type == "cuda" and block_d == D and block_dv == Dv:
        rows = B * (Tq if by_key else Tk)
        srcs = [(tensors[i], block_d if w == "d" else block_dv) for i, w in _DESCS[kind]]
        if all(_desc_ok(x, rows, x.shape[2]) for x, _ in srcs):
            templates = tuple(desc_template(x.as_strided((rows, x.shape[2]), (x.stride(1), 1)), [bi, w])
                              for x, w in srcs)
    consts = dict(BO=bo, BI=bi, BLOCK_D=block_d, BLOCK_DV=block_dv, EVEN_D=block_d == D,
                  EVEN_DV=block_dv == Dv, HAS_PAD=has_pad, SOFTCAP=softcap, ALIBI=alibi)
    if kind == "dq":
        consts["HAS_DLSE"] = dlse
    consts.update(PRECISION=precision(dtype), NUM_STAGES=tile.stages, TMA=templates is not None)
    launch = Launch(fn, (H * t.n_outer * B,), luts.device, consts, num_warps=tile.warps, num_stages=tile.stages)
    ints = (s_qb, s_qt, s_kb, s_kt, s_vb, s_vt, Tq * H * Dv, H * Dv,    # q; k; v; o and do (contiguous)
            B, H, H // Hk, t.n_outer, Tq, Tk, D, Dv)
    return launch, (t.order, t.ptr, t.mid, t.tab, t.inner, t.code, t.pmask), ints, templates


def launch(kind: str, luts: AttnLuts, tensors: tuple, pad: torch.Tensor | None, scales: tuple,
           key: tuple | None = None, slopes: torch.Tensor | None = None, dlse: torch.Tensor | None = None,
           softcap: float = 0.0) -> None:
    """One kernel, ``kind`` in {"fwd", "dq", "dkdv"}, over ``luts`` cut to its tiles
    (``bstrain.kernels.tiles.ATTENTION``): ``tensors`` are its leading tensor arguments in signature order (q and k
    first, as :func:`kernel_inputs` makes them; the others contiguous), ``pad`` None or the int8
    (B, Tk) padding mask (:func:`_pad_i8`), ``scales`` (scale·log2 e, softcap·log2 e) and for the
    backward the scale; ``slopes`` the (H,) fp32 ALiBi slopes or None, ``dlse`` (dq only) the
    gradient of the natural-log LSE or None; ``key`` the pass's :func:`_pass_key` (made from the
    tensors if None). Launches through a plan cached on ``luts`` (:mod:`bstrain.kernels.launch`)."""
    v = tensors[2]
    if key is None:
        key = _pass_key(tensors[0], tensors[1], v, pad, (softcap > 0, slopes is not None, dlse is not None),
                        *tensors, *(x for x in (slopes, dlse) if x is not None))
    p = plan(luts.plans, (kind, key), lambda: _plan(kind, luts, key, tensors))
    if p is None:
        return
    run, tabs, ints, templates = p
    extra = (tensors[0] if slopes is None else slopes,)
    if kind == "dq":
        extra += (tensors[5] if dlse is None else dlse,)                  # LSE stands in, unread
    inner = tuple(tensors[i] for i, _ in _DESCS[kind])
    if templates is not None:
        inner = tuple(desc_like(tm, x) for tm, x in zip(templates, inner))
    run(*tensors, *extra, *inner, *tabs, tensors[0] if pad is None else pad, *ints, *scales)  # PAD unread without HAS_PAD


def _pad_i8(pad: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels' form of a (B, Tk) bool padding mask: its bytes as int8, a view (no copy, no
    host sync, so CUDA-graph capture is safe)."""
    return None if pad is None else pad.contiguous().view(torch.int8)


def _mods(softcap: float, alibi: torch.Tensor | None) -> tuple:
    return softcap * LOG2E, alibi if alibi is None else alibi.float().contiguous()


def attention_forward(q, k, v, luts: AttnLuts, scale: float, pad=None, *, alibi=None, softcap: float = 0.0):
    """q (B, Tq, H·D), k (B, Tk, Hk·D), v (B, Tk, Hk·Dv) of one dtype, laid out by
    :func:`kernel_inputs`; Hk divides H (grouped-query attention: query head h reads k/v head
    h // (H/Hk)); pad (B, Tk) bool (True = padding) or None; ``alibi`` None or (H,) slopes: the
    logit of query i and key j gains slope·(j − i); ``softcap`` > 0: scale·q·k becomes
    softcap·tanh(scale·q·k / softcap) (before the ALiBi term). Returns (O (B, Tq, H·Dv) in q's
    dtype, LSE (B, H·Tq) fp32, base 2: +inf for a query with no live key, whose output is 0)."""
    B, Tq, HD = q.shape
    H = luts.heads
    Dv = v.shape[2] * (HD // H) // k.shape[2]
    pad = _pad_i8(pad)
    cap2, slopes = _mods(softcap, alibi)
    mods = (softcap > 0, slopes is not None, False)
    key = _pass_key(q, k, v, pad, mods, q, k, v, *(() if slopes is None else (slopes,)))
    o = empty((B, Tq, H * Dv), q.dtype, q.device)
    lse = empty((B, H * Tq), torch.float32, q.device)           # (B, H·Tq)
    launch("fwd", luts, (q, k, v, o, lse), pad, (scale * LOG2E, cap2), key, slopes)
    return o, lse


def attention_backward(do, q, k, v, o, lse, luts: AttnLuts, scale: float, pad=None, *, dlse=None, alibi=None,
                       softcap: float = 0.0):
    """(dq, dk, dv), contiguous, of :func:`attention_forward` (its q, k, v, o, LSE and options);
    ``dlse`` None or the (B, H·Tq) gradient of the natural-log LSE."""
    B, Tq, HD = q.shape
    Tk, HDk, HDv = k.shape[1], k.shape[2], v.shape[2]
    H = luts.heads
    do = do.contiguous()
    pad = _pad_i8(pad)
    cap2, slopes = _mods(softcap, alibi)
    if dlse is not None:
        dlse = dlse.float().contiguous()
    key = _pass_key(q, k, v, pad, (softcap > 0, slopes is not None, dlse is not None), q, k, v, o, do, lse,
                    *(x for x in (slopes, dlse) if x is not None))
    delta = empty(lse.shape, torch.float32, q.device)           # (B, H·Tq)
    if HDk == HD:
        dk, dv = empty(k.shape, k.dtype, k.device), empty(v.shape, v.dtype, v.device)
    else:                                                       # per query head, summed per group below
        dk = empty((B, Tk, HD), torch.float32, k.device)
        dv = empty((B, Tk, HDv * HD // HDk), torch.float32, k.device)
    scales = (scale * LOG2E, cap2, scale)
    dq = empty(q.shape, q.dtype, q.device)
    launch("dq", luts, (q, k, v, o, do, lse, delta, dq), pad, scales, key, slopes, dlse)
    launch("dkdv", luts, (q, k, v, do, lse, delta, dk, dv), pad, scales, key, slopes)
    if HDk != HD:
        G = HD // HDk
        dk, dv = (t.view(B, Tk, HDk_ // (t.shape[2] // H), G, t.shape[2] // H).sum(3).view(B, Tk, HDk_).to(k.dtype)
                  for t, HDk_ in ((dk, HDk), (dv, HDv)))
    return dq, dk, dv
