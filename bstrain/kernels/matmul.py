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
Tiles per (kernel, block size) come from ``bstrain.kernels.tiles.MATMUL``.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from bstrain._tensors import INT32_MAX as _INT32_MAX
from bstrain.kernels import tiles
from bstrain.kernels._device import desc_like, desc_template, precision, sm_count, tma_ok
from bstrain.kernels.alloc import empty
from bstrain.kernels.launch import Launch, aligned, host_bound, plan
# the tables live in matmul_luts; their names stay importable from here (callers and pickles name them)
from bstrain.kernels.matmul_luts import BsmmLuts, PanelLut, SegmentLut, make_luts, panel_lut  # noqa: F401
from bstrain.kernels.tiles import Tile



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
# Tiles (bstrain.kernels.tiles.MATMUL)
# ---------------------------------------------------------------------------------------------
FEW_STEPS = 8   # output blocks averaging fewer reduction steps than this take the "ds_few" tiles
GROUP_M = 8
MAX_REGISTER_LUT = 1024  # longest entry list the TMA kernel holds in registers
SMALL_M = 256  # at or below this many rows, tiles shrink to keep every multiprocessor busy
DW_SMALL_N = 1024  # at or below this many rows, an eager dW launches once, unsplit (host_bound)


def ds_tile(bs: int, M: int, itemsize: int, device: torch.device, mean_steps: float = float("inf")) -> Tile:
    """The ds kernels' tile for M rows of operands of ``itemsize`` bytes; mean_steps: average
    reduction steps per output block."""
    if device.type != "cuda":
        return tiles.MATMUL("ds", bs, itemsize, False)
    if M <= SMALL_M:
        return tiles.MATMUL("ds_small_m", bs, itemsize, True)
    return tiles.MATMUL("ds_few" if mean_steps < FEW_STEPS else "ds", bs, itemsize, True)


_PIPELINE_SMEM = 160 * 1024  # bytes of shared memory the software pipeline may use per program


def _fit_stages(stages: int, bytes_per_stage: int) -> int:
    """Fewer pipeline stages when a config's tiles are too big for shared memory (e.g. fp32)."""
    return max(1, min(stages, _PIPELINE_SMEM // max(1, bytes_per_stage)))


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


def _ds_tma_plan(a: torch.Tensor, out: torch.Tensor, a_src: torch.Tensor, y_src: torch.Tensor, trans: bool,
                 w: torch.Tensor, lut: SegmentLut, bs: int, transpose_w: bool, tile: Tile):
    """TMA path: a, out are (rows, features) views; a_src, y_src the tensors read and written
    (their transposes when trans, for axis-0 activations)."""
    M = a.shape[0]
    num_m = triton.cdiv(M, tile.block_m)
    bn = bs
    while bn > 32 and num_m * lut.n_out * (bs // bn) < sm_count(a.device):
        bn //= 2                                                  # small M: split blocks across programs
    a_t = desc_template(a_src, [tile.block_n, tile.block_m] if trans else [tile.block_m, tile.block_n])
    y_t = desc_template(y_src, [bn, tile.block_m] if trans else [tile.block_m, bn])
    w_t = desc_template(w.view(-1, bs), [bn, tile.block_n] if transpose_w else [tile.block_n, bn])
    launch = Launch(_bsmm_ds_tma_kernel, (num_m * lut.n_out * (bs // bn),), a.device, dict(
        BS=bs, BN=bn, KC=tile.block_n, BLOCK_M=tile.block_m, MAXC=lut.cap,
        GROUP_M=GROUP_M, TRANS_A=trans, TRANS_W=transpose_w, PRECISION=precision(a.dtype)),
        num_warps=tile.warps,
        num_stages=_fit_stages(tile.stages, (tile.block_m + bn) * tile.block_n * a.element_size()))
    ints = (M, lut.n_out, lut.n_in)

    def run(a, w, out):
        a_src, y_src = (a.t(), out.t()) if trans else (a, out)
        launch(desc_like(a_t, a_src), desc_like(w_t, w.view(-1, bs)), desc_like(y_t, y_src),
               lut.ptr, lut.packed, lut.order, *ints)
    return run


def _ds_plan(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, lut: SegmentLut, bs: int,
             transpose_w: bool, split: int | None):
    """How to compute out (M, n_out*bs) = a (M, n_in*bs) @ sparse for tensors shaped and laid out
    like these: the tile, the path (TMA or pointers), the reduction split and the grid."""
    M = a.shape[0]
    if M == 0:
        return lambda a, w, out: None
    itemsize = w.element_size()                                  # the operands' once a is cast
    mean_steps = lut.blk.numel() / max(1, lut.n_out) * max(1, bs // tiles.MATMUL("ds", bs, itemsize, True).block_n)
    tile = ds_tile(bs, M, itemsize, a.device, mean_steps)
    trans = a.stride(0) == 1 and a.stride(1) != 1                # axis-0 activations
    a_src, y_src = (a.t(), out.t()) if trans else (a, out)
    if tile.tma and tile.block_n <= bs and split in (None, 1) and lut.cap <= MAX_REGISTER_LUT \
            and a.dtype == w.dtype == out.dtype and tma_ok(a_src, y_src, w):
        return _ds_tma_plan(a, out, a_src, y_src, trans, w, lut, bs, transpose_w, tile)
    group = max(1, tile.block_n // bs)
    sub = max(1, bs // tile.block_n)
    num_m = triton.cdiv(M, tile.block_m)
    n_prog = num_m * lut.n_out
    max_iter = lut.max_count * sub if group == 1 else triton.cdiv(lut.max_count, group)
    if split is None:
        split = max(1, min(triton.cdiv(2 * sm_count(a.device), n_prog), max_iter)) if max_iter else 1
    split = max(split, 1)                                     # 0: host-bound, one launch
    wr, wc = (1, bs) if transpose_w else (bs, 1)
    launch = Launch(_bsmm_ds_kernel, (n_prog, split), a.device, dict(
        BS=bs, BS_PAD=max(bs, 16), G=group, SUB=sub, KC=tile.block_n, BLOCK_M=tile.block_m, GROUP_M=GROUP_M,
        PRECISION=precision(w.dtype)), num_warps=tile.warps,
        num_stages=_fit_stages(tile.stages, (tile.block_m + max(bs, 16)) * tile.block_n * a.element_size()))
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
    tile = tiles.MATMUL("panel", bs, a.element_size(), a.is_cuda)
    wr, wc = (1, bs) if transpose_w else (bs, 1)
    launch = Launch(_bsmm_panel_kernel, (triton.cdiv(M, tile.block_m) * pl.n_groups,), a.device, dict(
        BS=bs, NB=pl.nb, BLOCK_M=tile.block_m, GROUP_M=GROUP_M, PRECISION=precision(a.dtype)), num_warps=tile.warps,
        num_stages=_fit_stages(tile.stages, (tile.block_m + pl.nb * bs) * bs * a.element_size()))
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
           transpose_w, split, aligned(a, w, out), a.device, precision(a.dtype), tiles.version())
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
    tile = tiles.MATMUL("dw", bs, dy.element_size(), x.device.type == "cuda")
    if host and tile.tma:
        tile = tile.replace(tma=False, warps=max(tile.warps, 8))
    trans = feature_axis == 0
    x_src, dy_src = (x, dy) if trans else (xr, dyr)
    use_tma = tile.tma and tile.group == 1 and x.dtype == dy.dtype and tma_ok(x_src, dy_src)
    cols, starts, counts = luts.dw_items(1 if use_tma else tile.group)
    if split is None:
        split = max(1, min(triton.cdiv(2 * sm_count(x.device), cols.numel()), triton.cdiv(n, 4 * tile.block_n)))
    prec = precision(dy.dtype)                        # the operands' dtype once x is cast
    grid = (cols.numel(), split)
    blk, fwd = luts.fwd.blk, luts.fwd.idx

    def finish(target, dw):
        if split > 1:
            torch.sum(target, dim=0, out=dw) if dw.dtype == torch.float32 else dw.copy_(target.sum(0))

    dev = x.device                                         # closures keep no argument tensor alive

    def workspace(dw):
        return dw if split == 1 else empty((split,) + shape, torch.float32, dev)
    if use_tma:
        blk_shape = [bs, tile.block_n] if trans else [tile.block_n, bs]
        x_t, dy_t = desc_template(x_src, blk_shape), desc_template(dy_src, blk_shape)
        dw_t = desc_template(empty((split * luts.nnz * bs, bs), dw_dtype if split == 1 else torch.float32, dev),
                             [bs, bs])
        launch = Launch(_bsmm_dw_tma_kernel, grid, dev,
                        dict(BS=bs, BLOCK_N=tile.block_n, TRANS=trans, PRECISION=prec), num_warps=tile.warps,
                        num_stages=_fit_stages(tile.stages, 2 * bs * tile.block_n * x.element_size()))

        def run_tma(x, dy, xr, dyr, dw):
            target = workspace(dw)
            x_src, dy_src = (x, dy) if trans else (xr, dyr)
            launch(desc_like(x_t, x_src), desc_like(dy_t, dy_src), desc_like(dw_t, target.view(-1, bs)),
                   cols, starts, blk, fwd, n, luts.nnz, split)
            finish(target, dw)
        return run_tma
    launch = Launch(_bsmm_dw_kernel, grid, dev,
                    dict(BS=bs, BS_PAD=max(bs, 16), G=tile.group, BLOCK_N=tile.block_n, PRECISION=prec),
                    num_warps=tile.warps,
                    num_stages=_fit_stages(tile.stages,
                                           (tile.group * bs + max(bs, 16)) * tile.block_n * x.element_size()))
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
           split, host, aligned(x, dy, dw), x.device, precision(x.dtype), tiles.version())
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
