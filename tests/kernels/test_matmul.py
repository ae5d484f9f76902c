"""Triton bsmm kernels against a float64 dense reference (interpreter on CPU, compiled on GPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bstrain.kernels import matmul as kernels
from bstrain.kernels.matmul_luts import make_luts, panel_lut
from tests.conftest import (DTYPE_IDS, assert_close, dense_weight, fresh_seed, kernel_device, kernel_dtypes,
                            ragged_layout, torch_mm)

BLOCK_SIZES = (8, 16, 32, 64, 128)


def make_case(bs, axis, dtype, n=37, cb=3, kb=5, seed=None):
    seed = fresh_seed() if seed is None else seed
    lay = ragged_layout(cb, kb, seed)
    dev = kernel_device()
    luts = make_luts(lay, bs, dev)
    c, k = cb * bs, kb * bs
    x = torch.randn((n, c) if axis == 1 else (c, n), device=dev).to(dtype)
    dy = torch.randn((n, k) if axis == 1 else (k, n), device=dev).to(dtype)
    w = (torch.randn(luts.nnz, bs, bs, device=dev) / bs**0.5).to(dtype)
    return lay, luts, x, dy, w


def rows(t, axis):
    return (t if axis == 1 else t.t()).double().cpu()


params = pytest.mark.parametrize
DT = params("dtype", kernel_dtypes(), ids=lambda d: DTYPE_IDS[d])
BS = params("bs", BLOCK_SIZES, ids=lambda b: f"bs{b}")
AX = params("axis", (0, 1), ids=lambda a: f"axis{a}")
# 37 rows: ragged, and (on axis 0) rows not 16-byte aligned, so the pointer kernel runs;
# 48 rows: the TMA kernels run on both axes for blocks of 32 and up.
NR = params("n", (37, 48), ids=lambda n: f"n{n}")


@params("product", ("fwd", "dx"))
@DT
@BS
@AX
@NR
def test_ds_products(product, dtype, bs, axis, n):
    """Y = X·W (fwd) and dX = dY·Wᵀ (dx): the dense x sparse kernel on both layouts."""
    lay, luts, x, dy, w = make_case(bs, axis, dtype, n=n)
    wd = dense_weight(lay, w)
    src, launch, dense = (x, kernels.bsmm_forward, wd) if product == "fwd" else (dy, kernels.bsmm_dx, wd.t())
    feats = dense.shape[1]
    out = torch.full((src.shape[0], feats) if axis == 1 else (feats, src.shape[1]), float("nan"),
                     device=src.device, dtype=dtype)                                # poisoned
    got = launch(src, w, luts, axis, out=out)
    assert_close(rows(got, axis), rows(src, axis) @ dense, torch_mm(rows(src, axis), dense, dtype), dtype,
                 product)
    empty = slice(2 * bs, 3 * bs) if product == "fwd" else slice(bs, 2 * bs)   # empty column / row
    assert (rows(got, axis)[:, empty] == 0).all(), "an empty layout column (row for dx) must give zeros"


@DT
@BS
@AX
@NR
def test_dw(dtype, bs, axis, n):
    lay, luts, x, dy, _ = make_case(bs, axis, dtype, n=n)
    out = torch.full((luts.nnz, bs, bs), float("nan"), device=x.device)
    dw = kernels.bsmm_dw(x, dy, luts, axis, torch.float32, out=out)
    full = rows(x, axis).t() @ rows(dy, axis)                                        # (C, K)
    base = torch_mm(rows(x, axis).t(), rows(dy, axis), dtype)
    c_idx, k_idx = np.nonzero(lay)

    def blocks(d):
        return d.reshape(lay.shape[0], bs, lay.shape[1], bs)[c_idx, :, k_idx, :]
    assert_close(dw, blocks(full), blocks(base), dtype, "dw")


@params("dtype", [d for d in kernel_dtypes() if d != torch.float32], ids=lambda d: DTYPE_IDS[d])
@BS
@AX
@params("split", (0, None), ids=lambda s: "one_launch" if s == 0 else "split")
def test_fp32_activations_meet_16bit_weights(dtype, bs, axis, split, monkeypatch):
    """fp32 x with a 16-bit w (an eager call under autocast): the pointer kernels cast x's tiles as
    they load them, so forward and dW equal the product of x cast first, and dX comes out in fp32;
    split=None takes the plans of a call that is not host-bound (a graph capture's: split
    reductions, the dtype guards before the TMA and panel kernels)."""
    if split is None:
        monkeypatch.setattr(kernels, "host_bound", lambda *args: False)
    lay, luts, x16, dy, w = make_case(bs, axis, dtype)
    x = torch.randn(x16.shape, device=x16.device)                                    # fp32
    wd = dense_weight(lay, w)
    xc = rows(x.to(dtype), axis)                                                     # what the kernel multiplies
    y = kernels.run_forward(x, w, luts, axis, split=split, dtype=dtype)
    assert y.dtype == dtype
    assert_close(rows(y, axis), xc @ wd, torch_mm(xc, wd, dtype), dtype, "y")
    dx = kernels.run_dx(dy, w, luts, axis, split=split, dtype=torch.float32)
    assert dx.dtype == torch.float32
    assert_close(rows(dx, axis), rows(dy, axis) @ wd.t(), torch_mm(rows(dy, axis), wd.t(), dtype), dtype, "dx")
    dw = kernels.run_dw(x, dy, luts, axis, split=None if split is None else 1)
    c_idx, k_idx = np.nonzero(lay)

    def blocks(d):
        return d.reshape(lay.shape[0], bs, lay.shape[1], bs)[c_idx, :, k_idx, :]
    assert_close(dw, blocks(xc.t() @ rows(dy, axis)), blocks(torch_mm(xc.t(), rows(dy, axis), dtype)), dtype, "dw")


@params("split", (2, 3, 7), ids=lambda s: f"split{s}")
@params("bs", (16, 128), ids=lambda b: f"bs{b}")
@AX
def test_split_reduction(split, bs, axis):
    """The small-M path: the reduction split over a second grid axis into an fp32 workspace."""
    dtype = torch.float16
    lay, luts, x, dy, w = make_case(bs, axis, dtype, n=45)
    wd = dense_weight(lay, w)
    y = kernels.bsmm_forward(x, w, luts, axis, split=split)
    assert_close(rows(y, axis), rows(x, axis) @ wd, torch_mm(rows(x, axis), wd, dtype), dtype, "y")
    dx = kernels.bsmm_dx(dy, w, luts, axis, split=split)
    assert_close(rows(dx, axis), rows(dy, axis) @ wd.t(), torch_mm(rows(dy, axis), wd.t(), dtype), dtype, "dx")
    dw = kernels.bsmm_dw(x, dy, luts, axis, torch.float16, split=split)
    c_idx, k_idx = np.nonzero(lay)
    full = (rows(x, axis).t() @ rows(dy, axis)).reshape(lay.shape[0], bs, lay.shape[1], bs)
    base = torch_mm(rows(x, axis).t(), rows(dy, axis), dtype).reshape(full.shape)
    assert dw.dtype == torch.float16
    assert_close(dw, full[c_idx, :, k_idx, :], base[c_idx, :, k_idx, :], dtype, "dw")


@params("bs", (64, 128), ids=lambda b: f"bs{b}")
@AX
def test_small_m_splits_blocks_across_programs(bs, axis, monkeypatch):
    """With few row tiles the TMA kernel gives each program a 32-wide slice of an output block."""
    monkeypatch.setattr(kernels, "sm_count", lambda device: 10_000)
    dtype = torch.float16
    lay, luts, x, dy, w = make_case(bs, axis, dtype, n=16)
    wd = dense_weight(lay, w)
    y = kernels.bsmm_forward(x, w, luts, axis)
    assert_close(rows(y, axis), rows(x, axis) @ wd, torch_mm(rows(x, axis), wd, dtype), dtype, "y")
    dx = kernels.bsmm_dx(dy, w, luts, axis)
    assert_close(rows(dx, axis), rows(dy, axis) @ wd.t(), torch_mm(rows(dy, axis), wd.t(), dtype), dtype, "dx")


def _inside_nan(t: torch.Tensor) -> torch.Tensor:
    """A copy of t carved out of NaN-filled storage: any read past its bounds turns results NaN."""
    pad = 1024
    store = torch.full((t.numel() + 2 * pad,), float("nan"), dtype=t.dtype, device=t.device)
    inner = store[pad:pad + t.numel()].view(t.shape)
    inner.copy_(t)
    return inner


@params("bs", (16, 64), ids=lambda b: f"bs{b}")
@AX
@params("n", (29, 48), ids=lambda n: f"n{n}")
def test_kernels_read_only_their_operands(bs, axis, n):
    """x, dy and w sit between NaNs: forward, dX and dW stay exact (no out-of-bounds reads)."""
    dtype = torch.float16
    lay, luts, x, dy, w = make_case(bs, axis, dtype, n=n)
    x, dy, w = _inside_nan(x), _inside_nan(dy), _inside_nan(w)
    wd = dense_weight(lay, w)
    xr, dyr = rows(x, axis), rows(dy, axis)
    y = kernels.bsmm_forward(x, w, luts, axis)
    assert_close(rows(y, axis), xr @ wd, torch_mm(xr, wd, dtype), dtype, "y")
    dx = kernels.bsmm_dx(dy, w, luts, axis)
    assert_close(rows(dx, axis), dyr @ wd.t(), torch_mm(dyr, wd.t(), dtype), dtype, "dx")
    dw = kernels.bsmm_dw(x, dy, luts, axis, torch.float32)
    c_idx, k_idx = np.nonzero(lay)
    cb, kb = lay.shape
    ref = (xr.t() @ dyr).reshape(cb, bs, kb, bs)[c_idx, :, k_idx, :]
    assert_close(dw, ref, None, torch.float32, "dw")


def test_lut_orders_heaviest_first():
    lay = np.zeros((4, 3), dtype=bool)
    lay[:, 1] = True
    lay[0, 0] = True
    luts = make_luts(lay, 16, "cpu")
    assert luts.fwd.order.tolist() == [1, 0, 2]
    assert luts.fwd.ptr.tolist() == [0, 1, 5, 5]
    assert luts.fwd.max_count == 4
    cols, starts, counts = luts.dw_items(3)
    assert list(zip(cols.tolist(), starts.tolist(), counts.tolist())) == [(0, 0, 1), (1, 1, 3), (1, 4, 1)]


def test_launcher_rejects_bad_operands():
    lay, luts, x, dy, w = make_case(16, 1, torch.float32, n=8)
    with pytest.raises(TypeError, match="w: expected dtype"):
        kernels.bsmm_forward(x, w.half(), luts)
    with pytest.raises(ValueError, match="x: expected 48 features"):
        kernels.bsmm_forward(x[:, :32], w, luts)
    with pytest.raises(ValueError, match="w: expected shape"):
        kernels.bsmm_forward(x, w[:-1], luts)
    with pytest.raises(ValueError, match="out: expected"):
        kernels.bsmm_forward(x, w, luts, out=torch.empty(3, 3, device=x.device))
    with pytest.raises(TypeError, match="dy: expected"):
        kernels.bsmm_dw(x, dy.half(), luts)


@pytest.mark.gpu
@params("dtype", (torch.float16, torch.bfloat16), ids=lambda d: DTYPE_IDS[d])
@BS
@AX
@params("n", (64, 1000), ids=lambda n: f"n{n}")
def test_gpu_sizes(dtype, bs, axis, n):
    """Production tile configs (and the split path at n=64) on larger random layouts."""
    cb = kb = 1024 // bs
    lay, luts, x, dy, w = make_case(bs, axis, dtype, n=n, cb=cb, kb=kb)
    wd = dense_weight(lay, w)
    y = kernels.bsmm_forward(x, w, luts, axis)
    assert_close(rows(y, axis), rows(x, axis) @ wd, torch_mm(rows(x, axis), wd, dtype), dtype, "y")
    dx = kernels.bsmm_dx(dy, w, luts, axis)
    assert_close(rows(dx, axis), rows(dy, axis) @ wd.t(), torch_mm(rows(dy, axis), wd.t(), dtype), dtype, "dx")
    dw = kernels.bsmm_dw(x, dy, luts, axis)
    c_idx, k_idx = np.nonzero(lay)
    full = (rows(x, axis).t() @ rows(dy, axis)).reshape(cb, bs, kb, bs)[c_idx, :, k_idx, :]
    base = torch_mm(rows(x, axis).t(), rows(dy, axis), dtype).reshape(cb, bs, kb, bs)[c_idx, :, k_idx, :]
    assert_close(dw, full, base, dtype, "dw")


# --- panels: output blocks that share their input-block lists, computed together --------------------
def _tiled_layout(seed: int, cb: int = 4, kb0: int = 3, copies: int = 4) -> np.ndarray:
    """The mLSTM's gate layout: one (cb, kb0) pattern tiled ``copies`` times along the columns,
    plus one column of its own and one empty column (both left to the one-block kernel)."""
    rng = np.random.default_rng(seed)
    subsets = rng.choice(np.arange(1, 2**cb), kb0 + 1, replace=False)     # distinct, non-empty row sets
    cols = (subsets[None, :] >> np.arange(cb)[:, None]) & 1 == 1          # (cb, kb0 + 1)
    base, own = cols[:, :kb0], cols[:, kb0:]
    return np.concatenate([np.tile(base, (1, copies)), own, np.zeros((cb, 1), bool)], axis=1)


def test_panel_lut_groups_equal_columns():
    lay = _tiled_layout(0)
    luts = make_luts(lay, 16, "cpu")
    pl = panel_lut(luts.fwd, 16)
    assert pl is not None and pl.nb == 4 and pl.n_groups == 3          # 3 pattern columns x 4 copies
    cols = pl.col.numpy()
    assert sorted(cols.ravel().tolist()) == list(range(12))
    assert all(len({tuple(np.nonzero(lay[:, j])[0]) for j in g}) == 1 for g in cols)
    assert sorted(pl.single.order.tolist()) == [12, 13]
    for g, group in enumerate(cols):                   # every slot's weight block sits at (entry row, slot column)
        for e in range(int(pl.ptr[g]), int(pl.ptr[g + 1])):
            for s, j in enumerate(group):
                assert tuple(np.argwhere(lay)[int(pl.idx[e, s])]) == (int(pl.blk[e]), j), (g, e, s)
    assert panel_lut(make_luts(np.eye(4, dtype=bool), 16, "cpu").fwd, 16) is None


@DT
@params("bs", (16, 32), ids=lambda b: f"bs{b}")
@AX
def test_panel_products(dtype, bs, axis, monkeypatch):
    """With panels on: forward over a tiled layout (panels and single columns, an empty one) and
    dX over its transpose (rows that share lists), against float64, into poisoned outputs."""
    monkeypatch.setattr(kernels, "PANELS", True)
    n = kernels.SMALL_M + 11                              # panels serve large M only
    lay = _tiled_layout(fresh_seed())
    for layout, product in ((lay, "fwd"), (lay.T.copy(), "dx")):
        luts = make_luts(layout, bs, kernel_device())
        dev = kernel_device()
        cb, kb = layout.shape
        w = (torch.randn(luts.nnz, bs, bs, device=dev) / bs**0.5).to(dtype)
        wd = dense_weight(layout, w)
        feats_in, dense, launch = (cb * bs, wd, kernels.bsmm_forward) if product == "fwd" else \
            (kb * bs, wd.t(), kernels.bsmm_dx)
        src = torch.randn((n, feats_in) if axis == 1 else (feats_in, n), device=dev).to(dtype)
        feats = dense.shape[1]
        out = torch.full((n, feats) if axis == 1 else (feats, n), float("nan"), device=dev, dtype=dtype)
        got = launch(src, w, luts, axis, out=out)
        table = luts.fwd if product == "fwd" else luts.bwd
        assert table.panels is not None and table.panels.n_groups == 3, product
        assert_close(rows(got, axis), rows(src, axis) @ dense, torch_mm(rows(src, axis), dense, dtype), dtype,
                     product)


def test_panels_by_default_only_where_most_entries_share_lists(monkeypatch):
    """PANELS=None (the default): a tiled layout takes panels; a layout where one pair of columns
    shares its list (under PANEL_SHARE of the entries) stays one-block, its tables rewritable.
    Both products against float64, into poisoned outputs."""
    monkeypatch.setattr(kernels, "PANELS", None)
    dev = kernel_device()
    n = kernels.SMALL_M + 11
    tiled = _tiled_layout(fresh_seed())
    rng = np.random.default_rng(fresh_seed())
    few = np.zeros((4, 9), bool)
    for j in range(8):                                       # 8 distinct row sets, then one repeated
        few[:, j] = (j + 1) >> np.arange(4) & 1
    few[:, 8] = few[:, 0]
    few = few[:, rng.permutation(9)]
    for lay, panels in ((tiled, True), (few, False)):
        luts = make_luts(lay, 16, dev)
        w = torch.randn(luts.nnz, 16, 16, device=dev) / 4
        x = torch.randn(n, lay.shape[0] * 16, device=dev)
        out = torch.full((n, lay.shape[1] * 16), float("nan"), device=dev)
        got = kernels.bsmm_forward(x, w, luts, out=out)
        assert luts.has_panels() is panels, lay
        torch.testing.assert_close(got.double(), x.double() @ dense_weight(lay, w).to(dev), rtol=1e-4, atol=1e-4)


def test_private_tables_take_no_panels_and_built_panels_are_not_rewritten(monkeypatch):
    """A private op (a layout that changes in place) gets no output panels, even with panels
    forced on, so a switch of its tiled layout stays in place and computes the new layout; tables
    whose panels were built refuse an in-place rewrite."""
    from bstrain.ops import BlocksparseMatMul
    monkeypatch.setattr(kernels, "PANELS", True)
    dev = kernel_device()
    lay = _tiled_layout(fresh_seed())
    op = BlocksparseMatMul(lay, 16, backend="triton")
    op.make_private()
    x = torch.randn(kernels.SMALL_M + 11, op.C, device=dev)
    w = torch.randn(op.w_shape, device=dev) / 4
    op(x, w)
    assert not op._tables.on(dev).luts.has_panels()
    new = lay[:, np.random.default_rng(fresh_seed()).permutation(lay.shape[1])]     # same row and column counts
    if np.array_equal(new, lay):
        new = lay[:, ::-1].copy()
    key = op.key
    assert op.set_layout(new) is True and op.key == key
    torch.testing.assert_close(op(x, w).double(), x.double() @ dense_weight(new, w).double().to(dev), rtol=1e-4, atol=1e-4)
    shared = make_luts(lay, 16, dev)                              # tables that are not private: panels built
    kernels.bsmm_forward(x, w, shared)
    assert shared.has_panels()
    with pytest.raises(ValueError, match="panels"):
        shared.check_rewrite(new)
