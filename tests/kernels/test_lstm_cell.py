"""The fused mLSTM cell kernels (LN4 + input add + LSTM gates) against float64 references."""
from __future__ import annotations

import pytest
import torch

from bstrain.kernels import lstm_cell as kernels
from bstrain.ops.lstm_cell import fused_lstm_cell_ref
from tests.conftest import DTYPE_IDS, assert_close, kernel_device, kernel_dtypes

NAMES = ("dc", "dz", "dxg", "dg", "db", "dbias")


def cell_inputs(n: int, H: int, dtype: torch.dtype, dev: str, strided_xg: bool = False):
    """c, z, xg in dtype (xg a column slice of a wider tensor if asked); g, b, bias fp32."""
    c = torch.randn(n, H, device=dev).to(dtype)
    z = (2 * torch.randn(n, 4 * H, device=dev) + 1).to(dtype)
    xg = torch.randn(n, 5 * H, device=dev).to(dtype)
    xg = xg[:, H:] if strided_xg else xg[:, H:].contiguous()
    g = torch.rand(4 * H, device=dev) + 0.5
    return c, z, xg, g, torch.randn(4 * H, device=dev), torch.randn(4 * H, device=dev)


def reference(inputs, fb, dc_new, dh_new):
    """float64 (new_c, new_h) and the gradients NAMES, by autograd of fused_lstm_cell_ref."""
    x64 = [t.detach().double().cpu().requires_grad_() for t in inputs]
    cn, hn = fused_lstm_cell_ref(*x64, forget_bias=fb)
    loss = (hn * dh_new.double().cpu()).sum() + ((cn * dc_new.double().cpu()).sum() if dc_new is not None else 0)
    return cn, hn, torch.autograd.grad(loss, x64)


def check_cell(inputs, dtype, fb=0.5, with_dc=True):
    c = inputs[0]
    dc_new = torch.randn_like(c) if with_dc else None
    dh_new = torch.randn_like(c)
    cn, hn, mean, rstd = kernels.lstm_cell_forward(*inputs, fb, 1e-6)
    rc, rh, grads = reference(inputs, fb, dc_new, dh_new)
    base_c, base_h = fused_lstm_cell_ref(*inputs, forget_bias=fb)        # PyTorch, rounded to dtype
    assert_close(cn, rc, base_c, dtype, "new_c")
    assert_close(hn, rh, base_h, dtype, "new_h")
    dc, dz, dxg, dg, db = kernels.lstm_cell_backward(*inputs, mean, rstd, dc_new, dh_new, fb)
    for name, got, want in zip(NAMES, (dc, dz, dxg, dg, db, db), grads):
        assert_close(got, want, None, dtype, name)
    return mean, rstd, dc_new, dh_new, grads


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("n, H", [(1, 5), (3, 33)], ids=["B1-H5", "B3-H33"])
def test_lstm_cell(dtype, n, H):
    """One slice per segment, ragged H (not a power of two), a single row."""
    check_cell(cell_inputs(n, H, dtype, kernel_device(), strided_xg=n > 1), dtype, with_dc=n > 1)


def test_lstm_cell_looped_and_accumulated(monkeypatch):
    """Rows wider than a slice (three slices, the last ragged), two rows per program with a ragged
    last program, xg a strided view; then the backward adding into a workspace that holds data."""
    monkeypatch.setattr(kernels, "TILE", 128)
    monkeypatch.setattr(kernels, "MAX_CHUNK", 16)
    n, H = 3, 40
    block_g, chunk, _ = kernels._geometry(n, H)
    assert (block_g, chunk) == (2, 16)
    inputs = cell_inputs(n, H, torch.float32, kernel_device(), strided_xg=True)
    mean, rstd, dc_new, dh_new, grads = check_cell(inputs, torch.float32)
    ws = torch.randn(2, 2, 4 * H, device=inputs[0].device)            # (dg, db) x programs x features
    before = ws.clone()

    def workspace(shape):
        assert tuple(shape) == tuple(ws.shape)
        return ws
    out = kernels.lstm_cell_backward(*inputs, mean, rstd, dc_new, dh_new, 0.5, workspace=workspace)
    assert out[3] is None and out[4] is None
    dg, db = (ws - before).sum(1)
    assert_close(dg, grads[3], None, torch.float32, "dg (workspace)")
    assert_close(db, grads[4], None, torch.float32, "db (workspace)")


def test_lstm_cell_enwik8_row_width():
    """A row of 4H = 16,384 (hidden 4096): the statistics in two passes of 1,024-column slices."""
    inputs = cell_inputs(1, 4096, torch.float32, kernel_device())
    assert kernels._geometry(1, 4096)[:2] == (1, 1024)
    check_cell(inputs, torch.float32, fb=1.0, with_dc=False)


def test_empty_batch():
    c, z, xg, g, b, bias = cell_inputs(0, 8, torch.float32, kernel_device())
    cn, hn, mean, rstd = kernels.lstm_cell_forward(c, z, xg, g, b, bias)
    assert cn.shape == hn.shape == (0, 8) and mean.shape == (0, 4)
    dc, dz, dxg, dg, db = kernels.lstm_cell_backward(c, z, xg, g, b, bias, mean, rstd, None, hn)
    assert dz.shape == (0, 32) and torch.equal(dg, torch.zeros_like(dg)) and torch.equal(db, torch.zeros_like(db))
