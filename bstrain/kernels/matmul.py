"""Triton kernels for block-sparse matmul (bsmm) and their launchers.

Notation: bs is the block size, C and K the input and output feature sizes, Cb = C/bs and
Kb = K/bs the layout's shape, nnz the number of live blocks, W the (nnz, bs, bs) live blocks
(block i maps input features of block-row c_i to output features of block-column k_i).

Two kernels cover the three products on both activation layouts:

* ``_bsmm_ds_kernel``: dense x sparse -> dense, ``out[M, n_out*bs] = A[M, n_in*bs] @ Wsparse``.
  One program owns a BLOCK_M x bs output tile of one output block and walks that block's list of
  (input block, weight block) entries. Forward uses the column lists (out = Y, A = X); dX uses
  the row lists with each W block read transposed (out = dX, A = dY). feature_axis=0 is the same
  product on transposed views, so it is only a matter of strides.
* ``_bsmm_dw_kernel``: dW = Xᵀ·dY sampled on live blocks only. One program owns G live blocks of
  one output column (they share the dY tile) and reduces over the M rows.

Small blocks are packed: a forward step gathers G = KC/bs blocks into one KC-wide reduction, and a
dW program stacks G blocks into one (G*bs)-row tile, so tl.dot always sees tensor-core shapes.
Block 8 pads the output width to 16 (masked).

Load balance: output blocks are visited heaviest first (longest-processing-time order) inside
groups of GROUP_M row tiles, which also keeps each row tile of A in L2 while the columns sweep.
When M is small the reduction is split over a second grid axis into an fp32 workspace.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bstrain.kernels.alloc import empty
from bstrain.kernels.launch import Launch, aligned, host_bound, plan
from bstrain.layout import growth_limit

BLOCK_SIZES = (8, 16, 32, 64, 128)
_INT32_MAX = 2**31 - 1


@triton.jit
def _swizzle(pid, M, units, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    """Program pid's (row tile, unit) when ``units`` column units sweep groups of GROUP_M row
    tiles (each row tile of A stays in L2 while the columns pass)."""
    num_m = tl.cdiv(M, BLOCK_M)
    width = GROUP_M * units
    first_m = (pid // width) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % group_rows, (pid % width) // group_rows


@triton.jit
def _bsmm_ds_kernel(
    A, W, Y, seg_ptr, seg_blk, seg_idx, order,
    M, n_out, n_split,
    stride_am, stride_ak, stride_wr, stride_wc, stride_ys, stride_ym, stride_yn,
    BS: tl.constexpr, BS_PAD: tl.constexpr, G: tl.constexpr, SUB: tl.constexpr, KC: tl.constexpr,
    BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
):
    """A: (M, n_in*bs) by strides; W: (nnz, bs, bs); Y: (n_split, M, n_out*bs) by strides. A may be
    fp32 where W is 16-bit (activations cast in registers, not by a kernel of their own), and Y
    of any float dtype."""
    split = tl.program_id(1)
    m_tile, unit = _swizzle(tl.program_id(0), M, n_out, BLOCK_M, GROUP_M)
    col = tl.load(order + unit)                          # heaviest output blocks first
    start = tl.load(seg_ptr + col)
    count = tl.load(seg_ptr + col + 1) - start
    if G == 1:
        n_iter = count * SUB
    else:
        n_iter = tl.cdiv(count, G)
    per_split = tl.cdiv(n_iter, n_split)
    it_lo = split * per_split
    it_hi = tl.minimum(it_lo + per_split, n_iter)

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    t = tl.arange(0, KC)
    n = tl.arange(0, BS_PAD)
    mask_n = n < BS
    acc = tl.zeros((BLOCK_M, BS_PAD), dtype=tl.float32)
    for it in range(it_lo, it_hi):
        if G == 1:  # one block per step, SUB steps per block
            entry = start + it // SUB
            rows = (it % SUB) * KC + t                           # (KC,) rows inside the block
            blk = tl.load(seg_blk + entry)
            idx = tl.load(seg_idx + entry)
            valid = t < KC
            w_off = idx * (BS * BS) + rows[:, None] * stride_wr
        else:  # G blocks packed into one KC-wide step
            entry = start + it * G + t // BS
            valid = entry < start + count
            rows = t % BS
            blk = tl.load(seg_blk + entry, mask=valid, other=0)
            idx = tl.load(seg_idx + entry, mask=valid, other=0)
            w_off = idx[:, None] * (BS * BS) + rows[:, None] * stride_wr
        k_off = blk * BS + rows
        k_off = tl.max_contiguous(tl.multiple_of(k_off, KC // G), KC // G)
        a = tl.load(A + offs_m[:, None] * stride_am + k_off[None, :] * stride_ak,
                    mask=mask_m[:, None] & valid[None, :], other=0.0).to(W.dtype.element_ty)   # (BLOCK_M, KC)
        w = tl.load(W + w_off + n[None, :] * stride_wc,
                    mask=valid[:, None] & mask_n[None, :], other=0.0)        # (KC, BS_PAD)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    y_ptr = Y + split * stride_ys + offs_m[:, None] * stride_ym + (col * BS + n)[None, :] * stride_yn
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _bsmm_panel_kernel(
    A, W, Y, grp_ptr, grp_blk, grp_idx, grp_col, order,
    M, n_groups,
    stride_am, stride_ak, stride_wr, stride_wc, stride_ym, stride_yn,
    BS: tl.constexpr, NB: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
):
    """Output blocks that share their list of input blocks, NB at a time: one program owns a
    BLOCK_M x (NB*bs) panel of them and loads each A tile once for all NB (the one-block kernel
    loads it once per output block). grp_idx (entries, NB) and grp_col (groups, NB): the weight
    block of each slot and its output block, -1 where a group has fewer than NB."""
    m_tile, unit = _swizzle(tl.program_id(0), M, n_groups, BLOCK_M, GROUP_M)
    grp = tl.load(order + unit)                           # heaviest groups first
    start = tl.load(grp_ptr + grp)
    end = tl.load(grp_ptr + grp + 1)

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    t = tl.arange(0, BS)
    n = tl.arange(0, NB * BS)
    slot = n // BS
    col = tl.load(grp_col + grp * NB + slot)                               # (NB*BS,) output block of each lane
    acc = tl.zeros((BLOCK_M, NB * BS), dtype=tl.float32)
    for entry in range(start, end):
        blk = tl.load(grp_blk + entry)
        idx = tl.load(grp_idx + entry * NB + slot)                         # (NB*BS,) weight block per lane
        k_off = tl.max_contiguous(tl.multiple_of(blk * BS + t, BS), BS)
        a = tl.load(A + offs_m[:, None] * stride_am + k_off[None, :] * stride_ak,
                    mask=mask_m[:, None], other=0.0)                       # (BLOCK_M, BS)
        w = tl.load(W + idx[None, :] * (BS * BS) + t[:, None] * stride_wr + (n % BS)[None, :] * stride_wc,
                    mask=(idx >= 0)[None, :], other=0.0)                   # (BS, NB*BS)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    y_ptr = Y + offs_m[:, None] * stride_ym + (col * BS + n % BS)[None, :] * stride_yn
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=mask_m[:, None] & (col >= 0)[None, :])


@triton.jit
def _bsmm_dw_kernel(
    X, DY, DW, item_col, item_start, item_count, seg_blk, seg_idx,
    N, n_split,
    stride_xn, stride_xc, stride_dn, stride_dk, stride_ws,
    BS: tl.constexpr, BS_PAD: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """X: (N, C) by strides; DY: (N, K) by strides; DW: (n_split, nnz, bs, bs). X may be fp32 where
    DY is 16-bit (cast in registers)."""
    item = tl.program_id(0)
    split = tl.program_id(1)
    col = tl.load(item_col + item)
    start = tl.load(item_start + item)
    count = tl.load(item_count + item)
    t = tl.arange(0, G * BS)
    valid = t // BS < count
    r = t % BS
    blk = tl.load(seg_blk + start + t // BS, mask=valid, other=0)
    idx = tl.load(seg_idx + start + t // BS, mask=valid, other=0)
    c_off = tl.max_contiguous(tl.multiple_of(blk * BS + r, BS), BS)    # (G*BS,) input features
    q = tl.arange(0, BS_PAD)
    mask_q = q < BS
    k_off = col * BS + q                                                 # (BS_PAD,) output features
    per_split = tl.cdiv(tl.cdiv(N, BLOCK_N), n_split) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, tl.where(count > 0, N, 0))     # a padding run (count 0) does nothing
    nn = tl.arange(0, BLOCK_N)
    acc = tl.zeros((G * BS, BS_PAD), dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + nn
        mask_nn = offs_n < hi
        xt = tl.load(X + offs_n[None, :] * stride_xn + c_off[:, None] * stride_xc,
                     mask=valid[:, None] & mask_nn[None, :], other=0.0).to(DY.dtype.element_ty)   # (G*BS, BLOCK_N)
        dy = tl.load(DY + offs_n[:, None] * stride_dn + k_off[None, :] * stride_dk,
                     mask=mask_nn[:, None] & mask_q[None, :], other=0.0)    # (BLOCK_N, BS_PAD)
        acc = tl.dot(xt, dy, acc, input_precision=PRECISION)
    out = DW + split * stride_ws + idx[:, None] * (BS * BS) + r[:, None] * BS + q[None, :]
    tl.store(out, acc.to(DW.dtype.element_ty), mask=valid[:, None] & mask_q[None, :])


@triton.jit
def _bsmm_ds_tma_kernel(
    a_desc, w_desc, y_desc, seg_ptr, seg_packed, order,
    M, n_out, n_in,
    BS: tl.constexpr, BN: tl.constexpr, KC: tl.constexpr, BLOCK_M: tl.constexpr, MAXC: tl.constexpr,
    GROUP_M: tl.constexpr, TRANS_A: tl.constexpr, TRANS_W: tl.constexpr, PRECISION: tl.constexpr,
):
    """The ds product with tensor-memory-accelerator (TMA) loads, for blocks of 32 and up.

    a_desc: A as (M, F_in), or (F_in, M) when TRANS_A; w_desc: W as (nnz*bs, bs); y_desc: Y as
    (M, F_out), or (F_out, M) when TRANS_A. One program owns a BLOCK_M x BN slice of one output
    block (BN < bs splits a block across programs when M is small). Out-of-range rows of M are
    zero-filled on load and clipped on store, so no masks are needed.
    """
    SUB: tl.constexpr = BS // KC
    NSUB: tl.constexpr = BS // BN
    m_tile, unit = _swizzle(tl.program_id(0), M, n_out * NSUB, BLOCK_M, GROUP_M)
    m0 = m_tile * BLOCK_M
    col = tl.load(order + unit // NSUB)                      # heaviest output blocks first
    n0 = (unit % NSUB) * BN
    start = tl.load(seg_ptr + col)
    count = tl.load(seg_ptr + col + 1) - start
    # The block's whole entry list is loaded once, up front, as packed (weight idx, input block)
    # pairs: the loop then computes its TMA coordinates from registers instead of waiting on a
    # dependent global load every step.
    slots = tl.arange(0, MAXC)
    packed = tl.load(seg_packed + start + slots, mask=slots < count, other=0)
    acc = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
    for it in range(0, count * SUB):
        r0 = (it % SUB) * KC
        cur = tl.sum(tl.where(slots == it // SUB, packed, 0), axis=0)
        blk = cur % n_in
        idx = cur // n_in
        if TRANS_A:
            a = a_desc.load([blk * BS + r0, m0]).T            # (BLOCK_M, KC)
        else:
            a = a_desc.load([m0, blk * BS + r0])
        if TRANS_W:
            w = w_desc.load([idx * BS + n0, r0]).T            # (KC, BN)
        else:
            w = w_desc.load([idx * BS + r0, n0])
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    out = acc.to(y_desc.dtype)
    if TRANS_A:
        y_desc.store([col * BS + n0, m0], out.T)
    else:
        y_desc.store([m0, col * BS + n0], out)


@triton.jit
def _bsmm_dw_tma_kernel(
    x_desc, dy_desc, dw_desc, item_col, item_start, seg_blk, seg_idx,
    N, nnz, n_split,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, TRANS: tl.constexpr, PRECISION: tl.constexpr,
):
    """dW for one live block per program with TMA loads (G == 1).

    x_desc, dy_desc: X (N, C) and dY (N, K), or (C, N) and (K, N) when TRANS; dw_desc: DW as
    (n_split*nnz*bs, bs).
    """
    item = tl.program_id(0)
    split = tl.program_id(1)
    col = tl.load(item_col + item)
    entry = tl.load(item_start + item)
    blk = tl.load(seg_blk + entry)
    idx = tl.load(seg_idx + entry)
    # split ranges are whole multiples of BLOCK_N, so only the last tile crosses N: TMA zero-fills it
    per_split = tl.cdiv(tl.cdiv(N, BLOCK_N), n_split) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, N)
    acc = tl.zeros((BS, BS), dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        if TRANS:
            xt = x_desc.load([blk * BS, n0])                   # (BS, BLOCK_N)
            dy = dy_desc.load([col * BS, n0]).T                # (BLOCK_N, BS)
        else:
            xt = x_desc.load([n0, blk * BS]).T
            dy = dy_desc.load([n0, col * BS])
        acc = tl.dot(xt, dy, acc, input_precision=PRECISION)
    dw_desc.store([(split * nnz + idx) * BS, 0], acc.to(dw_desc.dtype))


# ---------------------------------------------------------------------------------------------
# Lookup tables
# ---------------------------------------------------------------------------------------------
@dataclass
class SegmentLut:
    """Entries grouped by output block: entries ptr[j]:ptr[j+1] feed output block j.

    blk: input block of each entry; idx: weight block of each entry; order: output blocks,
    heaviest first; max_count: the longest list; cap: the longest list the launch plans hold in
    registers (the next power of two, at least 16), which an in-place rewrite must not exceed.
    """
    ptr: torch.Tensor    # (n_out + 1,) int32
    blk: torch.Tensor    # (nnz,) int32
    idx: torch.Tensor    # (nnz,) int32
    order: torch.Tensor  # (n_out,) int32
    max_count: int
    packed: torch.Tensor  # (nnz,) int32: idx * n_in + blk, one load per entry
    n_in: int
    cap: int
    plans: dict = field(default_factory=dict)    # launch plans by argument shape/layout (launch.plan)
    panels: object = field(default=False, repr=False)   # PanelLut, None (no shared lists), False (not built)

    @property
    def n_out(self) -> int:
        return self.order.numel()

    def take_entries(self, other: "SegmentLut") -> None:
        """Copies ``other``'s lists into these tensors (the same output and entry counts, no list
        longer than ``cap``: checked by :meth:`BsmmLuts.check_rewrite`)."""
        for mine, theirs in ((self.ptr, other.ptr), (self.blk, other.blk), (self.idx, other.idx),
                             (self.packed, other.packed), (self.order, other.order)):
            mine.copy_(theirs)
        self.max_count = other.max_count


@dataclass
class PanelLut:
    """Output blocks of a SegmentLut whose input-block lists are equal, in groups of up to ``nb``
    (:func:`_bsmm_panel_kernel`), and the rest (``single``, heaviest first) for the one-block
    kernels. A tiled layout (the mLSTM's four gates share one pattern) has groups of 4."""
    nb: int
    ptr: torch.Tensor     # (n_groups + 1,) int32: entries of each group
    blk: torch.Tensor     # (entries,) int32: input block of each entry
    idx: torch.Tensor     # (entries, nb) int32: weight block of each slot, -1 if none
    col: torch.Tensor     # (n_groups, nb) int32: output block of each slot, -1 if none
    order: torch.Tensor   # (n_groups,) int32: heaviest groups first
    single: SegmentLut    # the SegmentLut restricted (by its order) to the ungrouped output blocks
    share: float          # share of the entries that the groups hold
    plans: dict = field(default_factory=dict)

    @property
    def n_groups(self) -> int:
        return self.order.numel()


PANEL_WIDTH = 128        # most output columns a panel program holds (nb * bs)


def panel_lut(lut: SegmentLut, bs: int) -> PanelLut | None:
    """The panels of ``lut`` (None when no two output blocks share an input-block list)."""
    ptr = lut.ptr.cpu().numpy()
    blk, idx = lut.blk.cpu().numpy(), lut.idx.cpu().numpy()
    by_rows: dict[bytes, list[int]] = {}
    for j in range(len(ptr) - 1):
        if ptr[j + 1] > ptr[j]:
            by_rows.setdefault(blk[ptr[j]:ptr[j + 1]].tobytes(), []).append(j)
    sizes = [len(cols) for cols in by_rows.values() if len(cols) > 1]
    if not sizes or bs < 16:
        return None
    nb = min(PANEL_WIDTH // bs, triton.next_power_of_2(max(sizes)))
    if nb < 2:
        return None
    g_ptr, g_blk, g_idx, g_col, grouped = [0], [], [], [], set()
    for cols in by_rows.values():
        for i in range(0, len(cols) - 1, nb):              # a trailing single column stays single
            part = cols[i:i + nb]
            if len(part) < 2:
                continue
            first = ptr[part[0]]
            count = ptr[part[0] + 1] - first
            g_blk.extend(blk[first:first + count])
            slots = np.full((count, nb), -1, dtype=np.int64)
            for s, j in enumerate(part):
                slots[:, s] = idx[ptr[j]:ptr[j + 1]]
            g_idx.append(slots)
            g_col.append(part + [-1] * (nb - len(part)))
            g_ptr.append(g_ptr[-1] + count)
            grouped.update(part)
    dev = lut.ptr.device
    counts = np.diff(g_ptr)

    def as_t(v):
        return torch.as_tensor(np.ascontiguousarray(v), dtype=torch.int32, device=dev)
    order = lut.order.cpu().numpy()
    single = [j for j in order if j not in grouped]
    rest = SegmentLut(lut.ptr, lut.blk, lut.idx, as_t(np.asarray(single, dtype=np.int64)), lut.max_count, lut.packed,
                      lut.n_in, lut.cap)
    grouped_entries = sum(int(ptr[j + 1] - ptr[j]) for j in grouped)
    return PanelLut(nb, as_t(g_ptr), as_t(g_blk), as_t(np.concatenate(g_idx)), as_t(g_col),
                    as_t(np.argsort(-counts, kind="stable")), rest, grouped_entries / max(1, int(ptr[-1])))


@dataclass
class BsmmLuts:
    """All tables of one layout on one device. Built once per (layout, device)."""
    block_size: int
    C: int
    K: int
    nnz: int
    fwd: SegmentLut      # per output block-column k: (c, weight idx); also dW's source
    bwd: SegmentLut      # per input block-row c: (k, weight idx); dX
    _dw_items: dict = field(default_factory=dict)
    dw_plans: dict = field(default_factory=dict)

    def has_panels(self) -> bool:
        """Whether output panels (layout-dependent groupings: see PANELS) were built for these
        tables: then they are never rewritten in place."""
        return any(lut.panels not in (False, None) for lut in (self.fwd, self.bwd))

    def no_panels(self) -> None:
        """Never build output panels on these tables (a layout that changes in place), unless
        they were built already."""
        for lut in (self.fwd, self.bwd):
            if lut.panels is False:
                lut.panels = None

    def check_rewrite(self, layout: np.ndarray) -> None:
        """A ValueError unless these tables can take ``layout`` in place: the same shape and
        live-block count, no block column or row longer than the ``cap`` that launch plans were
        made for, and no output panels built. Per-row and per-column counts may change."""
        if self.has_panels():
            raise ValueError("layout: tables whose output panels are built (kernels.matmul.PANELS) group blocks by "
                             "layout and are not switched in place")
        lay = np.asarray(layout, dtype=bool)
        shape = (self.C // self.block_size, self.K // self.block_size)
        if lay.shape != shape or int(lay.sum()) != self.nnz:
            raise ValueError(f"layout: an in-place rewrite needs a {shape} layout with {self.nnz} live blocks, got "
                             f"{lay.shape} with {int(lay.sum())}")
        for counts, lut, what in ((lay.sum(0), self.fwd, "column"), (lay.sum(1), self.bwd, "row")):
            if int(counts.max(initial=0)) > lut.cap:
                raise ValueError(f"layout: a block {what} with {int(counts.max())} live blocks; these tables hold at "
                                 f"most {lut.cap} per {what} in place")

    def rewrite(self, layout: np.ndarray) -> None:
        """Switches these tables to ``layout`` in place (a ValueError first, with nothing changed,
        where :meth:`check_rewrite` refuses): plans and captured CUDA graphs that read them then run
        the new layout. Every tensor keeps its length, and every launch its grid."""
        self.check_rewrite(layout)
        new = make_luts(layout, self.block_size, "cpu")             # on the host, then one copy per table
        self.fwd.take_entries(new.fwd)
        self.bwd.take_entries(new.bwd)
        ptr = new.fwd.ptr.numpy()
        for group, tensors in self._dw_items.items():
            for mine, theirs in zip(tensors, self._dw_runs(ptr, group)):
                mine.copy_(torch.from_numpy(theirs))

    def dw_items(self, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(column, first entry, count) of runs of up to ``group`` entries of one column, padded with
        empty runs (count 0) to a length that no layout of this shape and live-block count exceeds:
        the dW grid stays the same when the layout changes in place."""
        if group not in self._dw_items:
            self._dw_items[group] = tuple(torch.as_tensor(v, device=self.fwd.ptr.device)
                                          for v in self._dw_runs(self.fwd.ptr.cpu().numpy(), group))
        return self._dw_items[group]

    def _dw_runs(self, ptr: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`dw_items` on the host, as int32 arrays, from the fwd lists' ``ptr``."""
        ptr = ptr.astype(np.int64)
        n_out = len(ptr) - 1
        runs = -(-np.diff(ptr) // group)                              # runs of each column
        cols = np.repeat(np.arange(n_out), runs)
        first = np.concatenate([[0], np.cumsum(runs)])[:-1]           # each column's first run
        starts = ptr[cols] + (np.arange(cols.size) - first[cols]) * group
        counts = np.minimum(group, ptr[cols + 1] - starts)
        length = min(self.nnz, (self.nnz + min(n_out, self.nnz) * (group - 1)) // group)
        out = np.zeros((3, length), dtype=np.int32)                   # padding runs: column 0, count 0
        out[:, :cols.size] = cols, starts, counts
        return out[0], out[1], out[2]


def _cap(max_count: int, n_in: int, headroom: bool, n_out: int = 1, nnz: int = 0) -> int:
    """The longest list a SegmentLut's launch plans hold: the next power of two (at least 16) of
    the longest; with headroom (tables that change in place), of a quarter more and at least the
    :func:`bstrain.layout.growth_limit` of its ``n_out`` lists of ``nnz`` entries, up to n_in's."""
    if not headroom:
        return max(16, triton.next_power_of_2(max(1, max_count)))
    want = max(16, triton.next_power_of_2(max_count + max(1, max_count // 4)), growth_limit(n_out, nnz, n_in))
    return min(want, max(16, triton.next_power_of_2(max(1, n_in))))


def _segment_lut(out_of_entry: np.ndarray, in_of_entry: np.ndarray, n_out: int, n_in: int,
                 device: torch.device, headroom: bool = False) -> SegmentLut:
    weight_idx = np.arange(out_of_entry.size)
    perm = np.lexsort((in_of_entry, out_of_entry))            # by output block, then input block
    counts = np.bincount(out_of_entry, minlength=n_out)
    ptr = np.concatenate([[0], np.cumsum(counts)])
    order = np.argsort(-counts, kind="stable")

    def as_t(v):
        return torch.as_tensor(np.ascontiguousarray(v), dtype=torch.int32, device=device)
    n_in = max(1, n_in)                                           # the layout's, so a rewrite keeps the decoding
    packed = weight_idx[perm].astype(np.int64) * n_in + in_of_entry[perm]
    if packed.size and packed.max() > _INT32_MAX:
        raise ValueError("layout: too many blocks for 32-bit lookup tables")
    max_count = int(counts.max(initial=0))
    return SegmentLut(as_t(ptr), as_t(in_of_entry[perm]), as_t(weight_idx[perm]), as_t(order),
                      max_count, as_t(packed), n_in, _cap(max_count, n_in, headroom, n_out, int(out_of_entry.size)))


def make_luts(layout: np.ndarray, block_size: int, device: torch.device | str, headroom: bool = False) -> BsmmLuts:
    """Tables for a validated (Cb, Kb) bool layout; live blocks numbered row-major. headroom: the
    layout will change in place (dynamic sparsity), so the lists' ``cap`` leaves room to grow."""
    c_idx, k_idx = np.nonzero(layout)
    cb, kb = layout.shape
    device = torch.device(device)
    return BsmmLuts(block_size, cb * block_size, kb * block_size, int(c_idx.size),
                    fwd=_segment_lut(k_idx, c_idx, kb, cb, device, headroom),
                    bwd=_segment_lut(c_idx, k_idx, cb, kb, device, headroom))


# ---------------------------------------------------------------------------------------------
# Launch configurations
# ---------------------------------------------------------------------------------------------
class DsConfig(NamedTuple):
    block_m: int   # rows of A per program
    kc: int        # reduction width per step: part of a block (kc < bs) or kc/bs packed blocks
    warps: int
    stages: int
    tma: bool      # TMA loads (needs kc <= bs); else pointer loads


class DwConfig(NamedTuple):
    block_n: int   # rows of the M reduction per step
    group: int     # live blocks of one column stacked in one program
    warps: int
    stages: int
    tma: bool      # TMA loads (needs group == 1)


# Chosen per block size from a sweep on an H200 (scripts/bench_matmul.py --sweep).
GPU_DS = {8: DsConfig(256, 64, 8, 3, False), 16: DsConfig(256, 64, 8, 3, False),
          32: DsConfig(256, 32, 8, 3, True), 64: DsConfig(128, 64, 4, 3, True),
          128: DsConfig(128, 64, 4, 3, True)}
GPU_DS_SMALL_M = {8: DsConfig(64, 64, 4, 4, False), 16: DsConfig(64, 64, 4, 4, False),
                  32: DsConfig(64, 32, 4, 4, True), 64: DsConfig(64, 64, 4, 6, True),
                  128: DsConfig(64, 128, 4, 4, True)}
# For layouts whose output blocks average fewer than FEW_STEPS reduction steps (low density):
# pipeline fill dominates each tile there; a shallower pipeline won 8% at bs=64 and 5% density.
GPU_DS_FEW = {**GPU_DS, 64: DsConfig(128, 64, 4, 2, True)}
FEW_STEPS = 8
GPU_DW = {8: DwConfig(64, 16, 4, 3, False), 16: DwConfig(64, 8, 4, 3, False),
          32: DwConfig(64, 8, 8, 3, False), 64: DwConfig(32, 2, 8, 4, False),
          128: DwConfig(64, 1, 4, 4, True)}
# Interpreter (CPU tensors): small tiles keep it quick; they cover packing, kc < bs and both load paths.
CPU_DS = {8: DsConfig(32, 32, 4, 1, False), 16: DsConfig(32, 32, 4, 1, False),
          32: DsConfig(32, 32, 4, 1, True), 64: DsConfig(32, 64, 4, 1, True),
          128: DsConfig(32, 64, 4, 1, True)}
CPU_DW = {8: DwConfig(16, 4, 4, 1, False), 16: DwConfig(16, 2, 4, 1, False),
          32: DwConfig(16, 2, 4, 1, False), 64: DwConfig(16, 1, 4, 1, True),
          128: DwConfig(16, 1, 4, 1, True)}
GROUP_M = 8
MAX_REGISTER_LUT = 1024  # longest entry list the TMA kernel holds in registers
SMALL_M = 256  # at or below this many rows, tiles shrink to keep every multiprocessor busy
DW_SMALL_N = 1024  # at or below this many rows, an eager dW launches once, unsplit (host_bound)


def ds_config(bs: int, M: int, device: torch.device, mean_steps: float = float("inf")) -> DsConfig:
    """Tile config for the ds kernels; mean_steps: average reduction steps per output block."""
    if device.type != "cuda":
        return CPU_DS[bs]
    if M <= SMALL_M:
        return GPU_DS_SMALL_M[bs]
    return GPU_DS_FEW[bs] if mean_steps < FEW_STEPS else GPU_DS[bs]


def dw_config(bs: int, device: torch.device) -> DwConfig:
    return GPU_DW[bs] if device.type == "cuda" else CPU_DW[bs]


_PIPELINE_SMEM = 160 * 1024  # bytes of shared memory the software pipeline may use per program


def _fit_stages(stages: int, bytes_per_stage: int) -> int:
    """Fewer pipeline stages when a config's tiles are too big for shared memory (e.g. fp32)."""
    return max(1, min(stages, _PIPELINE_SMEM // max(1, bytes_per_stage)))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"  # ignored by tl.dot for 16-bit operands


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA needs a unit last stride and 16-byte aligned base and row strides."""
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any((st * size) % 16 for st in t.stride()[:-1]):
            return False
    return True


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_activation(name: str, a: torch.Tensor, luts: BsmmLuts) -> None:
    if a.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"{name}: expected float32, float16 or bfloat16, got {a.dtype}")
    if a.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor, got shape {tuple(a.shape)}")
    if luts.fwd.ptr.device != a.device:
        raise ValueError(f"{name}: expected device {luts.fwd.ptr.device} (the lookup tables'), got {a.device}")
    if a.numel() > _INT32_MAX:
        raise ValueError(f"{name}: tensors over 2**31 elements are not supported")


def _check_operands(name_a: str, a: torch.Tensor, w: torch.Tensor, luts: BsmmLuts) -> None:
    """An activation and the (nnz, bs, bs) contiguous weight it meets."""
    _check_activation(name_a, a, luts)
    if w.dtype != a.dtype:
        raise TypeError(f"w: expected dtype {a.dtype} (same as {name_a}), got {w.dtype}")
    expect_w = (luts.nnz, luts.block_size, luts.block_size)
    if tuple(w.shape) != expect_w:
        raise ValueError(f"w: expected shape {expect_w}, got {tuple(w.shape)}")
    if w.numel() and w.stride() != (luts.block_size ** 2, luts.block_size, 1):
        raise ValueError(f"w: expected a contiguous (nnz, bs, bs) tensor, got strides {w.stride()}")
    if w.device != a.device:
        raise ValueError(f"w: expected device {a.device} (as {name_a}), got {w.device}")


def _rows_view(t: torch.Tensor, feature_axis: int) -> torch.Tensor:
    """(N, F) view of an activation whatever its feature axis."""
    return t if feature_axis == 1 else t.t()


def _template(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A descriptor of t's shape, strides and block, checked, holding no tensor."""
    d = TensorDescriptor(t, list(t.shape), list(t.stride()), block)
    d.base = None
    return d


def _desc_like(template: TensorDescriptor, t: torch.Tensor) -> TensorDescriptor:
    """``template`` over tensor t, which has its shape, strides and alignment: the checks were
    made once, when the template was built."""
    d = object.__new__(TensorDescriptor)
    d.__dict__.update(template.__dict__)
    d.base = t
    return d


def _ds_tma_plan(a: torch.Tensor, out: torch.Tensor, a_src: torch.Tensor, y_src: torch.Tensor, trans: bool,
                 w: torch.Tensor, lut: SegmentLut, bs: int, transpose_w: bool, cfg: DsConfig):
    """TMA path: a, out are (rows, features) views; a_src, y_src the tensors read and written
    (their transposes when trans, for axis-0 activations)."""
    M = a.shape[0]
    num_m = triton.cdiv(M, cfg.block_m)
    bn = bs
    while bn > 32 and num_m * lut.n_out * (bs // bn) < _sm_count(a.device):
        bn //= 2                                                  # small M: split blocks across programs
    a_t = _template(a_src, [cfg.kc, cfg.block_m] if trans else [cfg.block_m, cfg.kc])
    y_t = _template(y_src, [bn, cfg.block_m] if trans else [cfg.block_m, bn])
    w_t = _template(w.view(-1, bs), [bn, cfg.kc] if transpose_w else [cfg.kc, bn])
    launch = Launch(_bsmm_ds_tma_kernel, (num_m * lut.n_out * (bs // bn),), a.device, dict(
        BS=bs, BN=bn, KC=cfg.kc, BLOCK_M=cfg.block_m, MAXC=lut.cap,
        GROUP_M=GROUP_M, TRANS_A=trans, TRANS_W=transpose_w, PRECISION=_precision(a.dtype)),
        num_warps=cfg.warps, num_stages=_fit_stages(cfg.stages, (cfg.block_m + bn) * cfg.kc * a.element_size()))
    ints = (M, lut.n_out, lut.n_in)

    def run(a, w, out):
        a_src, y_src = (a.t(), out.t()) if trans else (a, out)
        launch(_desc_like(a_t, a_src), _desc_like(w_t, w.view(-1, bs)), _desc_like(y_t, y_src),
               lut.ptr, lut.packed, lut.order, *ints)
    return run


def _ds_plan(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, lut: SegmentLut, bs: int,
             transpose_w: bool, split: int | None):
    """How to compute out (M, n_out*bs) = a (M, n_in*bs) @ sparse for tensors shaped and laid out
    like these: the config, the path (TMA or pointers), the reduction split and the grid."""
    M = a.shape[0]
    if M == 0:
        return lambda a, w, out: None
    mean_steps = lut.blk.numel() / max(1, lut.n_out) * max(1, bs // GPU_DS[bs].kc)
    cfg = ds_config(bs, M, a.device, mean_steps)
    trans = a.stride(0) == 1 and a.stride(1) != 1                # axis-0 activations
    a_src, y_src = (a.t(), out.t()) if trans else (a, out)
    if cfg.tma and cfg.kc <= bs and split in (None, 1) and lut.cap <= MAX_REGISTER_LUT \
            and a.dtype == w.dtype == out.dtype and _tma_ok(a_src, y_src, w):
        return _ds_tma_plan(a, out, a_src, y_src, trans, w, lut, bs, transpose_w, cfg)
    group = max(1, cfg.kc // bs)
    sub = max(1, bs // cfg.kc)
    num_m = triton.cdiv(M, cfg.block_m)
    n_prog = num_m * lut.n_out
    max_iter = lut.max_count * sub if group == 1 else triton.cdiv(lut.max_count, group)
    if split is None:
        split = max(1, min(triton.cdiv(2 * _sm_count(a.device), n_prog), max_iter)) if max_iter else 1
    split = max(split, 1)                                     # 0: host-bound, one launch
    wr, wc = (1, bs) if transpose_w else (bs, 1)
    launch = Launch(_bsmm_ds_kernel, (n_prog, split), a.device, dict(
        BS=bs, BS_PAD=max(bs, 16), G=group, SUB=sub, KC=cfg.kc, BLOCK_M=cfg.block_m, GROUP_M=GROUP_M,
        PRECISION=_precision(w.dtype)), num_warps=cfg.warps,
        num_stages=_fit_stages(cfg.stages, (cfg.block_m + max(bs, 16)) * cfg.kc * a.element_size()))
    if split == 1:
        ints = (M, lut.n_out, 1, a.stride(0), a.stride(1), wr, wc, 0, out.stride(0), out.stride(1))

        def run(a, w, out):
            launch(a, w, out, lut.ptr, lut.blk, lut.idx, lut.order, *ints)
        return run
    shape = (split,) + tuple(out.shape)
    n_out_f = out.shape[1]
    ints = (M, lut.n_out, split, a.stride(0), a.stride(1), wr, wc, M * n_out_f, n_out_f, 1)

    def run_split(a, w, out):
        target = empty(shape, torch.float32, a.device)
        launch(a, w, target, lut.ptr, lut.blk, lut.idx, lut.order, *ints)
        torch.sum(target, dim=0, out=out) if out.dtype == torch.float32 else out.copy_(target.sum(0))
    return run_split


def _panel_plan(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, pl: PanelLut, bs: int, transpose_w: bool):
    """The panel kernel over the grouped output blocks, then the one-block kernel (unsplit: it
    must write only its own columns) over the rest."""
    M = a.shape[0]
    block_m, warps, stages = (128, 8, 3) if a.is_cuda else (32, 4, 1)
    wr, wc = (1, bs) if transpose_w else (bs, 1)
    launch = Launch(_bsmm_panel_kernel, (triton.cdiv(M, block_m) * pl.n_groups,), a.device, dict(
        BS=bs, NB=pl.nb, BLOCK_M=block_m, GROUP_M=GROUP_M, PRECISION=_precision(a.dtype)), num_warps=warps,
        num_stages=_fit_stages(stages, (block_m + pl.nb * bs) * bs * a.element_size()))
    ints = (M, pl.n_groups, a.stride(0), a.stride(1), wr, wc, out.stride(0), out.stride(1))
    rest = _ds_plan(a, w, out, pl.single, bs, transpose_w, 1) if pl.single.n_out else None

    def run(a, w, out):
        launch(a, w, out, pl.ptr, pl.blk, pl.idx, pl.col, pl.order, *ints)
        if rest is not None:
            rest(a, w, out)
    return run


def _panels(lut: SegmentLut, bs: int) -> PanelLut | None:
    if lut.panels is False:
        lut.panels = panel_lut(lut, bs)
    return lut.panels


# Panels (output blocks that share their input-block lists, computed together), above SMALL_M rows.
# None (the default): where the panels hold at least PANEL_SHARE of the entries, as in the tiled gate
# layouts (1.1-1.7x faster there on an H200; benchmarks/panels.md); True (BSTRAIN_BSMM_PANEL=1):
# wherever two output blocks share a list; False (=0): never.
_PANEL_ENV = os.environ.get("BSTRAIN_BSMM_PANEL", "")
PANELS: bool | None = None if _PANEL_ENV == "" else _PANEL_ENV == "1"
PANEL_SHARE = 0.5


def _use_panels(lut: SegmentLut, bs: int) -> bool:
    if PANELS is False:
        return False
    pl = _panels(lut, bs)
    if pl is not None and PANELS is None and pl.share < PANEL_SHARE:
        lut.panels = pl = None          # too few shared lists: these tables stay one-block (and rewritable)
    return pl is not None


def _launch_ds(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, lut: SegmentLut, bs: int,
               transpose_w: bool, split: int | None) -> None:
    """out (M, n_out*bs) = a (M, n_in*bs) @ sparse; both given as (rows, features) views."""
    if split is None and host_bound(a.shape[0], SMALL_M, a):
        split = 0                                          # one launch, pointer kernel
    key = (a.shape[0], a.dtype, w.dtype, out.dtype, a.stride(0), a.stride(1), out.stride(0), out.stride(1),
           transpose_w, split, aligned(a, w, out), a.device,
           a.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32)
    if split is None and a.shape[0] > SMALL_M and a.dtype == w.dtype == out.dtype and _use_panels(lut, bs):
        pl = lut.panels
        plan(pl.plans, key, lambda: _panel_plan(a, w, out, pl, bs, transpose_w))(a, w, out)
        return
    plan(lut.plans, key, lambda: _ds_plan(a, w, out, lut, bs, transpose_w, split))(a, w, out)


def _alloc_out(out: torch.Tensor | None, shape: tuple[int, int], like: torch.Tensor,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    dtype = dtype or like.dtype
    if out is None:
        return empty(shape, dtype, like.device)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != like.device:
        raise ValueError(f"out: expected {shape} {dtype} on {like.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    return out


def _run_ds(a: torch.Tensor, w: torch.Tensor, lut: SegmentLut, features: int, transpose_w: bool, bs: int,
            feature_axis: int, out: torch.Tensor | None, split: int | None,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    """The ds product on an activation with either feature axis, into ``out`` or a new tensor of
    ``dtype`` (a's by default)."""
    n = a.shape[1 - feature_axis]
    y = out if out is not None else empty((n, features) if feature_axis == 1 else (features, n), dtype or a.dtype,
                                          a.device)
    _launch_ds(_rows_view(a, feature_axis), w, _rows_view(y, feature_axis), lut, bs, transpose_w, split)
    return y


def run_forward(x: torch.Tensor, w: torch.Tensor, luts: BsmmLuts, feature_axis: int = 1,
                out: torch.Tensor | None = None, split: int | None = None,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`bsmm_forward` without its argument checks (the op layer checks once, at its boundary).
    x may be fp32 with a 16-bit w (then the pointer kernel runs, which casts x's tiles as it
    loads them); the output is ``dtype`` (x's by default)."""
    return _run_ds(x, w, luts.fwd, luts.K, False, luts.block_size, feature_axis, out, split, dtype)


def run_dx(dy: torch.Tensor, w: torch.Tensor, luts: BsmmLuts, feature_axis: int = 1,
           out: torch.Tensor | None = None, split: int | None = None,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`bsmm_dx` without its argument checks; dX in ``dtype`` (dy's by default)."""
    return _run_ds(dy, w, luts.bwd, luts.C, True, luts.block_size, feature_axis, out, split, dtype)


def bsmm_forward(x: torch.Tensor, w: torch.Tensor, luts: BsmmLuts, feature_axis: int = 1,
                 out: torch.Tensor | None = None, split: int | None = None) -> torch.Tensor:
    """Y = X·W. x: (N, C) if feature_axis == 1 else (C, N); w: (nnz, bs, bs); returns (N, K) or (K, N).

    split forces the pointer kernel with its reduction split that many ways (tests use it).
    """
    _check_operands("x", x, w, luts)
    xr = _rows_view(x, feature_axis)                                   # (N, C)
    if xr.shape[1] != luts.C:
        raise ValueError(f"x: expected {luts.C} features on axis {feature_axis}, got shape {tuple(x.shape)}")
    n = xr.shape[0]
    y = _alloc_out(out, (n, luts.K) if feature_axis == 1 else (luts.K, n), x)
    return run_forward(x, w, luts, feature_axis, y, split)


def bsmm_dx(dy: torch.Tensor, w: torch.Tensor, luts: BsmmLuts, feature_axis: int = 1,
            out: torch.Tensor | None = None, split: int | None = None) -> torch.Tensor:
    """dX = dY·Wᵀ: the same product over the transposed layout. dy: (N, K) or (K, N)."""
    _check_operands("dy", dy, w, luts)
    dyr = _rows_view(dy, feature_axis)                                 # (N, K)
    if dyr.shape[1] != luts.K:
        raise ValueError(f"dy: expected {luts.K} features on axis {feature_axis}, got shape {tuple(dy.shape)}")
    n = dyr.shape[0]
    dx = _alloc_out(out, (n, luts.C) if feature_axis == 1 else (luts.C, n), dy)
    return run_dx(dy, w, luts, feature_axis, dx, split)


def _check_dw(x: torch.Tensor, dy: torch.Tensor, luts: BsmmLuts, feature_axis: int,
              dw_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    _check_activation("x", x, luts)
    if dy.dtype != x.dtype or dy.device != x.device:
        raise TypeError(f"dy: expected {x.dtype} on {x.device} (like x), got {dy.dtype} on {dy.device}")
    xr, dyr = _rows_view(x, feature_axis), _rows_view(dy, feature_axis)   # (N, C), (N, K)
    if dy.dim() != 2 or xr.shape[1] != luts.C or dyr.shape != (xr.shape[0], luts.K):
        raise ValueError(f"x, dy: expected (N, {luts.C}) and (N, {luts.K}) on feature axis "
                         f"{feature_axis}, got {tuple(x.shape)} and {tuple(dy.shape)}")
    if dw_dtype not in _KERNEL_DTYPES:
        raise TypeError(f"dw_dtype: expected float32, float16 or bfloat16, got {dw_dtype}")
    return xr, dyr


def _dw_plan(x: torch.Tensor, dy: torch.Tensor, xr: torch.Tensor, dyr: torch.Tensor, luts: BsmmLuts,
             feature_axis: int, dw_dtype: torch.dtype, split: int | None, host: bool = False):
    """host: an eager launch whose host cost exceeds its GPU time (:func:`host_bound`): the pointer
    kernel, whose launch encodes no TMA descriptors (three per call, a few µs each)."""
    bs, n = luts.block_size, xr.shape[0]
    shape = (luts.nnz, bs, bs)
    if n == 0:
        return lambda x, dy, xr, dyr, dw: dw.zero_()
    cfg = dw_config(bs, x.device)
    if host and cfg.tma:
        cfg = cfg._replace(tma=False, warps=max(cfg.warps, 8))
    trans = feature_axis == 0
    x_src, dy_src = (x, dy) if trans else (xr, dyr)
    use_tma = cfg.tma and cfg.group == 1 and x.dtype == dy.dtype and _tma_ok(x_src, dy_src)
    cols, starts, counts = luts.dw_items(1 if use_tma else cfg.group)
    if split is None:
        split = max(1, min(triton.cdiv(2 * _sm_count(x.device), cols.numel()), triton.cdiv(n, 4 * cfg.block_n)))
    prec = _precision(dy.dtype)                        # the operands' dtype once x is cast
    grid = (cols.numel(), split)
    blk, fwd = luts.fwd.blk, luts.fwd.idx

    def finish(target, dw):
        if split > 1:
            torch.sum(target, dim=0, out=dw) if dw.dtype == torch.float32 else dw.copy_(target.sum(0))

    dev = x.device                                         # closures keep no argument tensor alive

    def workspace(dw):
        return dw if split == 1 else empty((split,) + shape, torch.float32, dev)
    if use_tma:
        blk_shape = [bs, cfg.block_n] if trans else [cfg.block_n, bs]
        x_t, dy_t = _template(x_src, blk_shape), _template(dy_src, blk_shape)
        dw_t = _template(empty((split * luts.nnz * bs, bs), dw_dtype if split == 1 else torch.float32, dev),
                         [bs, bs])
        launch = Launch(_bsmm_dw_tma_kernel, grid, dev,
                        dict(BS=bs, BLOCK_N=cfg.block_n, TRANS=trans, PRECISION=prec), num_warps=cfg.warps,
                        num_stages=_fit_stages(cfg.stages, 2 * bs * cfg.block_n * x.element_size()))

        def run_tma(x, dy, xr, dyr, dw):
            target = workspace(dw)
            x_src, dy_src = (x, dy) if trans else (xr, dyr)
            launch(_desc_like(x_t, x_src), _desc_like(dy_t, dy_src), _desc_like(dw_t, target.view(-1, bs)),
                   cols, starts, blk, fwd, n, luts.nnz, split)
            finish(target, dw)
        return run_tma
    launch = Launch(_bsmm_dw_kernel, grid, dev,
                    dict(BS=bs, BS_PAD=max(bs, 16), G=cfg.group, BLOCK_N=cfg.block_n, PRECISION=prec),
                    num_warps=cfg.warps,
                    num_stages=_fit_stages(cfg.stages, (cfg.group * bs + max(bs, 16)) * cfg.block_n * x.element_size()))
    ints = (n, split, xr.stride(0), xr.stride(1), dyr.stride(0), dyr.stride(1), luts.nnz * bs * bs if split > 1 else 0)

    def run(x, dy, xr, dyr, dw):
        target = workspace(dw)
        launch(xr, dyr, target, cols, starts, counts, blk, fwd, *ints)
        finish(target, dw)
    return run


def run_dw(x: torch.Tensor, dy: torch.Tensor, luts: BsmmLuts, feature_axis: int = 1,
           dw_dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
           split: int | None = None) -> torch.Tensor:
    """:func:`bsmm_dw` without its argument checks (the op layer checks once, at its boundary)."""
    xr, dyr = _rows_view(x, feature_axis), _rows_view(dy, feature_axis)
    bs = luts.block_size
    dw = out if out is not None else empty((luts.nnz, bs, bs), dw_dtype, x.device)
    host = split is None and host_bound(xr.shape[0], DW_SMALL_N, x)
    if host:
        split = 1                                          # one launch, no workspace, no descriptors
    key = (xr.shape[0], x.dtype, dy.dtype, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), feature_axis, dw_dtype,
           split, host, aligned(x, dy, dw), x.device,
           x.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32)
    plan(luts.dw_plans, key, lambda: _dw_plan(x, dy, xr, dyr, luts, feature_axis, dw_dtype, split, host))(
        x, dy, xr, dyr, dw)
    return dw


def bsmm_dw(x: torch.Tensor, dy: torch.Tensor, luts: BsmmLuts, feature_axis: int = 1,
            dw_dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
            split: int | None = None) -> torch.Tensor:
    """dW = Xᵀ·dY on live blocks only; returns (nnz, bs, bs) in dw_dtype (fp32 accumulation).

    x: (N, C) or (C, N); dy: (N, K) or (K, N). split sets how many ways the N reduction is split.
    """
    _check_dw(x, dy, luts, feature_axis, dw_dtype)
    bs = luts.block_size
    dw = _alloc_out(out, (luts.nnz, bs, bs), x, dw_dtype)
    if not dw.is_contiguous():
        raise ValueError(f"out: expected a contiguous (nnz, bs, bs) tensor, got strides {dw.stride()}")
    return run_dw(x, dy, luts, feature_axis, dw_dtype, dw, split)
