"""Triton kernels for block-sparse attention (flash-style: the scores are never stored).

Notation: q is (B, Tq, H·D), k and v (B, Tk, Hk·D) with Hk dividing H (grouped-query attention:
query head h reads k/v head h // G, G = H/Hk); bs the layout's block size. A live block is full,
or partial with a (bs, bs) element mask. Rows of q, k, v may be strided (the chunks of a fused
qkv projection); features are contiguous (:func:`kernel_inputs`).

**Tiles.** The kernels do not work on layout blocks but on tiles of (BO, BI) elements that divide
them: BO rows of the *outer* operand a program holds (queries in the forward and dQ kernels,
keys in the dK/dV kernel) against BI rows of the *inner* one it streams. A layout is re-cut into
tile lists once per tile shape (:class:`TileLuts`): a tile wholly outside its block's element
mask is dropped, a wholly kept one becomes full, and a partial tile is either *triangular*
(kept where ``q − k ≥ d`` in tile coordinates, as causal diagonals are; no memory read) or a
bit mask read from a table. Each outer row lists its full tiles first, then the triangular ones,
then those with a table, so the kernels run three loops (full, triangular, table) and only the
last one reads masks. Rows are launched heaviest first (longest-processing-time order) to
shorten the tail.

* ``_attn_fwd``: one program per (head, query tile) row and batch element walks the row's key
  tiles with an online softmax (base 2), and writes O and the row's log-sum-exp (LSE, base 2;
  +inf for a query with no live key, whose output is 0).
* ``_attn_bwd_dq``: one program per query tile, as the forward: Δ = rowsum(dO ∘ O) (stored for
  the next kernel), then dQ = dS·K·scale with dS = P ∘ (dP − Δ), dP = dO·Vᵀ, P from the LSE.
* ``_attn_bwd_dkdv``: one program per (head, key tile) column walks the query tiles that attend
  to it: dV = Pᵀ·dO, dK = dSᵀ·Q·scale. Padded keys get zero gradients. With G > 1 each query
  head writes its share to an fp32 (B, Tk, H·D) buffer that the launcher sums per group.

Tile shapes, warps and pipeline stages per (kernel, block size, head dim, dtype) come from
:func:`tiles`; ``TILES`` overrides them (scripts/tune_attention.py sweeps it).

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

from bstrain.kernels.alloc import empty
from bstrain.kernels.launch import Launch, aligned, plan
from bstrain.kernels.matmul import _precision

LOG2E = 1.4426950408889634
_TRI = -(1 << 20)       # a masked tile's code: >= 0 indexes the mask table; _TRI + d is triangular
TRI = tl.constexpr(_TRI)


@triton.jit
def _rows(X, base, s_t, start, N: tl.constexpr, BLOCK_D: tl.constexpr, head_dim, EVEN_D: tl.constexpr):
    """Rows start..start+N of one head (columns past head_dim read as 0)."""
    r = start + tl.arange(0, N)
    d = tl.arange(0, BLOCK_D)
    ptr = X + base + r[:, None] * s_t + d[None, :]
    if EVEN_D:
        return tl.load(ptr)
    return tl.load(ptr, mask=(d < head_dim)[None, :], other=0.0)


@triton.jit
def _store_rows(X, val, base, s_t, start, N: tl.constexpr, BLOCK_D: tl.constexpr, head_dim,
                EVEN_D: tl.constexpr):
    r = start + tl.arange(0, N)
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
def _program_row(ORDER, PTR, MID, TAB, B, n_outer, BO: tl.constexpr):
    """This program's batch element, head, first outer position and its row's entry bounds: full
    tiles [e0, e1), triangular [e1, e2), with a mask table [e2, e3)."""
    pid = tl.program_id(0)
    row = tl.load(ORDER + pid // B)
    return (pid % B, row // n_outer, (row % n_outer) * BO, tl.load(PTR + row), tl.load(MID + row),
            tl.load(TAB + row), tl.load(PTR + row + 1))


@triton.jit
def _fwd_loop(acc, l_i, m_i, q, K, V, kv_base, s_kt, INNER, CODE, e0, e1, PMASK, PAD, pad_base, qk_scale,
              head_dim, BO: tl.constexpr, BI: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
              MODE: tl.constexpr, HAS_PAD: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr):
    for e in tl.range(e0, e1, num_stages=NUM_STAGES):
        n = tl.load(INNER + e)
        k = _rows(K, kv_base, s_kt, n * BI, BI, BLOCK_D, head_dim, EVEN_D)
        v = _rows(V, kv_base, s_kt, n * BI, BI, BLOCK_D, head_dim, EVEN_D)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MODE > 0:
            s = tl.where(_keep(tl.load(CODE + e), PMASK, BO, BI, MODE, False), s, float("-inf"))
        if HAS_PAD:
            pad = tl.load(PAD + pad_base + n * BI + tl.arange(0, BI))
            s = tl.where(pad[None, :] == 0, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        if MODE > 0 or HAS_PAD:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)     # a row with nothing kept yet
        else:
            m_use = m_new
        p = tl.exp2(s * qk_scale - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, ORDER, PTR, MID, TAB, INNER, CODE, PMASK, PAD,
              s_qb, s_qt, s_kb, s_kt, s_ob, s_ot, B, H, G, n_outer, Tq, Tk, head_dim, qk_scale,
              BO: tl.constexpr, BI: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
              HAS_PAD: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr):
    b, h, start, e0, e1, e2, e3 = _program_row(ORDER, PTR, MID, TAB, B, n_outer, BO)
    q = _rows(Q, b.to(tl.int64) * s_qb + h * head_dim, s_qt, start, BO, BLOCK_D, head_dim, EVEN_D)
    kv_base = b.to(tl.int64) * s_kb + (h // G) * head_dim          # G query heads share a k/v head
    pad_base = b.to(tl.int64) * Tk
    m_i = tl.full((BO,), float("-inf"), tl.float32)
    l_i = tl.zeros((BO,), tl.float32)
    acc = tl.zeros((BO, BLOCK_D), tl.float32)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, K, V, kv_base, s_kt, INNER, CODE, e0, e1, PMASK, PAD, pad_base,
                              qk_scale, head_dim, BO, BI, BLOCK_D, EVEN_D, 0, HAS_PAD, PRECISION, NUM_STAGES)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, K, V, kv_base, s_kt, INNER, CODE, e1, e2, PMASK, PAD, pad_base,
                              qk_scale, head_dim, BO, BI, BLOCK_D, EVEN_D, 1, HAS_PAD, PRECISION, NUM_STAGES)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, K, V, kv_base, s_kt, INNER, CODE, e2, e3, PMASK, PAD, pad_base,
                              qk_scale, head_dim, BO, BI, BLOCK_D, EVEN_D, 2, HAS_PAD, PRECISION, NUM_STAGES)
    live = l_i > 0
    l_safe = tl.where(live, l_i, 1.0)
    _store_rows(O, acc / l_safe[:, None], b.to(tl.int64) * s_ob + h * head_dim, s_ot, start, BO, BLOCK_D,
                head_dim, EVEN_D)
    lse = tl.where(live, m_i + tl.log2(l_safe), float("inf"))
    tl.store(LSE + (b.to(tl.int64) * H + h) * Tq + start + tl.arange(0, BO), lse)     # (B, H, Tq)


@triton.jit
def _dq_loop(dq, q, do, lse, delta, K, V, kv_base, s_kt, INNER, CODE, e0, e1, PMASK, PAD, pad_base, qk_scale,
             head_dim, BO: tl.constexpr, BI: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
             MODE: tl.constexpr, HAS_PAD: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr):
    for e in tl.range(e0, e1, num_stages=NUM_STAGES):
        n = tl.load(INNER + e)
        k = _rows(K, kv_base, s_kt, n * BI, BI, BLOCK_D, head_dim, EVEN_D)
        v = _rows(V, kv_base, s_kt, n * BI, BI, BLOCK_D, head_dim, EVEN_D)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MODE > 0:
            s = tl.where(_keep(tl.load(CODE + e), PMASK, BO, BI, MODE, False), s, float("-inf"))
        if HAS_PAD:
            pad = tl.load(PAD + pad_base + n * BI + tl.arange(0, BI))
            s = tl.where(pad[None, :] == 0, s, float("-inf"))
        p = tl.exp2(s * qk_scale - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, O, DO, LSE, DELTA, DQ, ORDER, PTR, MID, TAB, INNER, CODE, PMASK, PAD,
                 s_qb, s_qt, s_kb, s_kt, s_ob, s_ot, B, H, G, n_outer, Tq, Tk, head_dim, qk_scale, scale,
                 BO: tl.constexpr, BI: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                 HAS_PAD: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Also writes Δ = rowsum(dO ∘ O) for :func:`_attn_bwd_dkdv` (o, do and dq share strides)."""
    b, h, start, e0, e1, e2, e3 = _program_row(ORDER, PTR, MID, TAB, B, n_outer, BO)
    q_base = b.to(tl.int64) * s_qb + h * head_dim
    o_base = b.to(tl.int64) * s_ob + h * head_dim
    q = _rows(Q, q_base, s_qt, start, BO, BLOCK_D, head_dim, EVEN_D)
    do = _rows(DO, o_base, s_ot, start, BO, BLOCK_D, head_dim, EVEN_D)
    o = _rows(O, o_base, s_ot, start, BO, BLOCK_D, head_dim, EVEN_D)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    stat = (b.to(tl.int64) * H + h) * Tq + start + tl.arange(0, BO)
    tl.store(DELTA + stat, delta)
    lse = tl.load(LSE + stat)
    kv_base = b.to(tl.int64) * s_kb + (h // G) * head_dim
    pad_base = b.to(tl.int64) * Tk
    dq = tl.zeros((BO, BLOCK_D), tl.float32)
    dq = _dq_loop(dq, q, do, lse, delta, K, V, kv_base, s_kt, INNER, CODE, e0, e1, PMASK, PAD, pad_base, qk_scale,
                  head_dim, BO, BI, BLOCK_D, EVEN_D, 0, HAS_PAD, PRECISION, NUM_STAGES)
    dq = _dq_loop(dq, q, do, lse, delta, K, V, kv_base, s_kt, INNER, CODE, e1, e2, PMASK, PAD, pad_base, qk_scale,
                  head_dim, BO, BI, BLOCK_D, EVEN_D, 1, HAS_PAD, PRECISION, NUM_STAGES)
    dq = _dq_loop(dq, q, do, lse, delta, K, V, kv_base, s_kt, INNER, CODE, e2, e3, PMASK, PAD, pad_base, qk_scale,
                  head_dim, BO, BI, BLOCK_D, EVEN_D, 2, HAS_PAD, PRECISION, NUM_STAGES)
    _store_rows(DQ, dq * scale, o_base, s_ot, start, BO, BLOCK_D, head_dim, EVEN_D)


@triton.jit
def _dkdv_loop(dk, dv, k, v, Q, DO, LSE, DELTA, q_base, s_qt, o_base, s_ot, stat_base, INNER, CODE, e0, e1, PMASK,
               qk_scale, head_dim, BO: tl.constexpr, BI: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
               MODE: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr):
    for e in tl.range(e0, e1, num_stages=NUM_STAGES):
        n = tl.load(INNER + e)
        q = _rows(Q, q_base, s_qt, n * BI, BI, BLOCK_D, head_dim, EVEN_D)
        do = _rows(DO, o_base, s_ot, n * BI, BI, BLOCK_D, head_dim, EVEN_D)
        stat = stat_base + n * BI + tl.arange(0, BI)
        lse = tl.load(LSE + stat)
        delta = tl.load(DELTA + stat)
        st = tl.dot(k, tl.trans(q), input_precision=PRECISION)                     # (keys, queries)
        if MODE > 0:
            st = tl.where(_keep(tl.load(CODE + e), PMASK, BO, BI, MODE, True), st, float("-inf"))
        pt = tl.exp2(st * qk_scale - lse[None, :])
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, ORDER, PTR, MID, TAB, INNER, CODE, PMASK, PAD,
                   s_qb, s_qt, s_kb, s_kt, s_ob, s_ot, s_db, s_dt, B, H, G, n_outer, Tq, Tk, head_dim, qk_scale,
                   scale, BO: tl.constexpr, BI: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                   HAS_PAD: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr):
    """dK, dV of query head h's use of its k/v head h // G, into (B, Tk, H·D) by (s_db, s_dt): the
    caller sums the G heads of a group (G == 1: dK, dV themselves)."""
    b, h, start, e0, e1, e2, e3 = _program_row(ORDER, PTR, MID, TAB, B, n_outer, BO)
    kv_base = b.to(tl.int64) * s_kb + (h // G) * head_dim
    k = _rows(K, kv_base, s_kt, start, BO, BLOCK_D, head_dim, EVEN_D)
    v = _rows(V, kv_base, s_kt, start, BO, BLOCK_D, head_dim, EVEN_D)
    q_base = b.to(tl.int64) * s_qb + h * head_dim
    o_base = b.to(tl.int64) * s_ob + h * head_dim            # dO
    stat_base = (b.to(tl.int64) * H + h) * Tq
    dk = tl.zeros((BO, BLOCK_D), tl.float32)
    dv = tl.zeros((BO, BLOCK_D), tl.float32)
    dk, dv = _dkdv_loop(dk, dv, k, v, Q, DO, LSE, DELTA, q_base, s_qt, o_base, s_ot, stat_base, INNER, CODE,
                        e0, e1, PMASK, qk_scale, head_dim, BO, BI, BLOCK_D, EVEN_D, 0, PRECISION, NUM_STAGES)
    dk, dv = _dkdv_loop(dk, dv, k, v, Q, DO, LSE, DELTA, q_base, s_qt, o_base, s_ot, stat_base, INNER, CODE,
                        e1, e2, PMASK, qk_scale, head_dim, BO, BI, BLOCK_D, EVEN_D, 1, PRECISION, NUM_STAGES)
    dk, dv = _dkdv_loop(dk, dv, k, v, Q, DO, LSE, DELTA, q_base, s_qt, o_base, s_ot, stat_base, INNER, CODE,
                        e2, e3, PMASK, qk_scale, head_dim, BO, BI, BLOCK_D, EVEN_D, 2, PRECISION, NUM_STAGES)
    if HAS_PAD:                                   # a padded key is in no softmax: zero gradients
        kept = tl.load(PAD + b.to(tl.int64) * Tk + start + tl.arange(0, BO)) == 0
        dk = tl.where(kept[:, None], dk, 0.0)
        dv = tl.where(kept[:, None], dv, 0.0)
    d_base = b.to(tl.int64) * s_db + h * head_dim
    _store_rows(DK, dk * scale, d_base, s_dt, start, BO, BLOCK_D, head_dim, EVEN_D)
    _store_rows(DV, dv, d_base, s_dt, start, BO, BLOCK_D, head_dim, EVEN_D)


# ---------------------------------------------------------------------------------------------
# Tile shapes: (BO, BI, num_warps, num_stages) per kernel. Keys of TILES: (kernel, block size,
# padded head dim, element size); a hit overrides tiles()'s rule.
class _TileTable(dict):
    """A dict whose every change bumps ``version``: launch plans are keyed by it, so a plan made
    before a change of tile shapes is not reused after it."""
    version = 0

    def _changed(self, result=None):
        self.version += 1
        return result

    def __setitem__(self, key, value):
        self._changed(super().__setitem__(key, value))

    def __delitem__(self, key):
        self._changed(super().__delitem__(key))

    def pop(self, *args):
        return self._changed(super().pop(*args))

    def popitem(self):
        return self._changed(super().popitem())

    def clear(self):
        self._changed(super().clear())

    def update(self, *args, **kwargs):
        self._changed(super().update(*args, **kwargs))

    def setdefault(self, key, default=None):
        return self._changed(super().setdefault(key, default))


TILES: dict[tuple[str, int, int, int], tuple[int, int, int, int]] = _TileTable()


def tiles(kernel: str, bs: int, block_d: int, itemsize: int) -> tuple[int, int, int, int]:
    """(BO, BI, num_warps, num_stages) of ``kernel`` in {"fwd", "dq", "dkdv"}."""
    hit = TILES.get((kernel, bs, block_d, itemsize))
    if hit is not None:
        return hit
    if itemsize == 4:                                   # fp32 operands: small tiles (shared memory)
        return min(bs, 64), min(bs, 32), 4, 2
    # swept on the H200 (benchmarks/attention_tune.json): 64-row tiles and 4 warps won for every
    # kernel and head dim, over 128-row tiles with 8 warps
    bi = {"fwd": 64, "dq": 64 if block_d <= 64 else 32, "dkdv": 32}[kernel]
    return min(bs, 64), min(bs, bi), 4, 3


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
    order: torch.Tensor       # (H·n_outer,) int32: outer rows, heaviest first
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
        launch = np.argsort(-cost, kind="stable")

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


def kernel_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """q, k, v as the kernels take them: unit last stride, v laid out as k. Views such as the
    chunks of a fused qkv projection are taken as they are; anything else is copied."""
    if q.stride(2) != 1:
        q = q.contiguous()
    if k.stride(2) != 1 or v.stride() != k.stride():
        k, v = k.contiguous(), v.contiguous()
    return q, k, v


def _pass_key(q: torch.Tensor, k: torch.Tensor, pad: torch.Tensor | None, *inputs: torch.Tensor) -> tuple:
    """What the plans of one pass are keyed by, besides the kernel: everything the JIT specialises
    on. The shapes and strides of q (B, Tq, H·D) and k, v (B, Tk, Hk·D) (:func:`kernel_inputs`;
    outputs are contiguous), which fix every integer argument; the dtype; the padding mask's
    presence; the 16-byte alignment of the inputs (outputs are fresh allocations, always
    aligned); the tile table's version; TF32 for fp32."""
    B, Tq, HD = q.shape
    Tk, HDk = k.shape[1], k.shape[2]
    s_q, s_k = q.stride(), k.stride()
    dtype = q.dtype
    return (B, Tq, Tk, HD, HDk, s_q[0], s_q[1], s_k[0], s_k[1], dtype, pad is not None,
            aligned(*inputs) if pad is None else aligned(pad, *inputs), TILES.version,
            dtype is torch.float32 and torch.backends.cuda.matmul.allow_tf32)


def _plan(kind: str, luts: AttnLuts, key: tuple):
    """(Launch, tile tables, integer arguments) of ``kind`` for a :func:`_pass_key`, or None for
    an empty grid."""
    fn, by_key = _KERNELS[kind]
    B, Tq, Tk, HD, HDk, s_qb, s_qt, s_kb, s_kt, dtype, has_pad = key[:11]
    H = luts.heads
    D = HD // H
    block_d = max(16, triton.next_power_of_2(D))
    bo, bi, warps, stages = tiles(kind, luts.block_size, block_d, dtype.itemsize)
    t = luts.tiles(by_key, bo, bi)
    if not B * H * t.n_outer:
        return None
    launch = Launch(fn, (H * t.n_outer * B,), luts.device, dict(
        BO=bo, BI=bi, BLOCK_D=block_d, EVEN_D=block_d == D, HAS_PAD=has_pad, PRECISION=_precision(dtype),
        NUM_STAGES=stages), num_warps=warps, num_stages=stages)
    strides = (s_qb, s_qt, s_kb, s_kt, Tq * HD, HD)            # q; k and v; o, do, dq (contiguous)
    if kind == "dkdv":
        strides += (Tk * HD, HD)                                # dK, dV of every query head: (B, Tk, H·D)
    ints = strides + (B, H, HD // HDk, t.n_outer, Tq, Tk, D)
    return launch, (t.order, t.ptr, t.mid, t.tab, t.inner, t.code, t.pmask), ints


def launch(kind: str, luts: AttnLuts, tensors: tuple, pad: torch.Tensor | None, scales: tuple,
           key: tuple | None = None) -> None:
    """One kernel, ``kind`` in {"fwd", "dq", "dkdv"}, over ``luts`` cut to its tiles
    (:func:`tiles`): ``tensors`` are its tensor arguments in signature order (q and k first, as
    :func:`kernel_inputs` makes them; the others contiguous), ``pad`` None or the int8 (B, Tk)
    padding mask (:func:`_pad_i8`), ``scales`` its float arguments; ``key`` the pass's
    :func:`_pass_key` (made from the tensors if None). Launches through a plan cached on ``luts``
    (:mod:`bstrain.kernels.launch`)."""
    if key is None:
        key = _pass_key(tensors[0], tensors[1], pad, *tensors)
    p = plan(luts.plans, (kind, key), lambda: _plan(kind, luts, key))
    if p is not None:
        run, tabs, ints = p
        run(*tensors, *tabs, tensors[0] if pad is None else pad, *ints, *scales)   # PAD unread without HAS_PAD


def _pad_i8(pad: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels' form of a (B, Tk) bool padding mask: its bytes as int8, a view (no copy, no
    host sync, so CUDA-graph capture is safe)."""
    return None if pad is None else pad.contiguous().view(torch.int8)


def attention_forward(q, k, v, luts: AttnLuts, scale: float, pad=None):
    """q (B, Tq, H·D), k, v (B, Tk, Hk·D) of one dtype, laid out by :func:`kernel_inputs`; Hk divides H (grouped-query
    attention: query head h reads k/v head h // (H/Hk)); pad (B, Tk) bool (True = padding) or
    None. Returns (O like q, LSE (B, H·Tq) fp32, base 2)."""
    B, Tq, _ = q.shape
    pad = _pad_i8(pad)
    key = _pass_key(q, k, pad, q, k, v)
    o = empty(q.shape, q.dtype, q.device)                       # (B, Tq, H·D)
    lse = empty((B, luts.heads * Tq), torch.float32, q.device)  # (B, H·Tq)
    launch("fwd", luts, (q, k, v, o, lse), pad, (scale * LOG2E,), key)
    return o, lse


def attention_backward(do, q, k, v, o, lse, luts: AttnLuts, scale: float, pad=None):
    """(dq, dk, dv), contiguous, of :func:`attention_forward` (its q, k, v, o and LSE)."""
    B, Tq, HD = q.shape
    Tk, HDk = k.shape[1], k.shape[2]
    do = do.contiguous()
    pad = _pad_i8(pad)
    key = _pass_key(q, k, pad, q, k, v, o, do, lse)
    delta = empty(lse.shape, torch.float32, q.device)           # (B, H·Tq)
    if HDk == HD:
        dq, dk, dv = empty(q.shape, q.dtype, q.device), empty(k.shape, k.dtype, k.device), \
            empty(v.shape, v.dtype, v.device)
    else:                                                       # per query head, summed per group below
        dq = empty(q.shape, q.dtype, q.device)
        dk, dv = empty((2, B, Tk, HD), torch.float32, k.device).unbind(0)
    scales = (scale * LOG2E, scale)
    launch("dq", luts, (q, k, v, o, do, lse, delta, dq), pad, scales, key)
    launch("dkdv", luts, (q, k, v, do, lse, delta, dk, dv), pad, scales, key)
    if HDk != HD:
        D = HD // luts.heads
        dk, dv = (t.view(B, Tk, HDk // D, HD // HDk, D).sum(3).view(B, Tk, HDk).to(k.dtype) for t in (dk, dv))
    return dq, dk, dv
